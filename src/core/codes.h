/*
 * Key codes for screened decode (docs/math.md §10.1), written once for the cache (which
 * encodes) and the screen (which bounds): per page, KV head and channel c the step
 * s_c = fl(M_c - m_c) * 2^-b over the stored range [m_c, M_c]; a key k_c gets the b-bit code
 * clamp(floor((k_c - m_c) / s_c), 0, 2^b - 1) (0 when s_c = 0), which stands for
 * m_c + (code + 1/2) s_c, within s_c / 2 + 2u max(|m_c|, |M_c|) of k_c.
 * Block layout (docs/math.md §10.1): the codes of one (page, KV head) are one block of
 * page_size * row_bytes bytes, token-minor: byte (j, t) at j * page_size + t. 8-bit codes: j is
 * the channel. 4-bit codes: byte j of token t holds channel 2j in the low nibble and 2j + 1 in
 * the high nibble. So one load of consecutive bytes gives one channel (pair) for consecutive
 * tokens: the screen's dot products run with tokens across the SIMD lanes (or GPU threads) and
 * need no horizontal sums.
 */
#ifndef EKV_CODES_H
#define EKV_CODES_H
#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define EKV_CODES static __host__ __device__ __forceinline__
#else
#define EKV_CODES static inline
#endif

/* Bytes of one token's codes for one KV head. */
EKV_CODES int64_t ekv_code_row_bytes(int64_t head_dim, int32_t bits) {
    return (head_dim * bits + 7) / 8;
}

/* The step of a channel whose stored keys span [mn, mx]. */
EKV_CODES float ekv_code_step(float mn, float mx, int32_t bits) {
    return (mx - mn) * (bits == 8 ? 0x1p-8f : 0x1p-4f);
}

/* The code of a stored key k in a channel with minimum mn and step s. */
EKV_CODES uint32_t ekv_code_of(float k, float mn, float step, int32_t bits) {
    if (!(step > 0.f)) return 0;
    const double r = floor(((double)k - (double)mn) / (double)step);
    const double top = (double)((1u << bits) - 1);
    return (uint32_t)(r < 0 ? 0 : r > top ? top : r);
}

/* The byte of a block that holds channel c of token slot t. */
EKV_CODES int64_t ekv_code_byte(int64_t c, int64_t t, int64_t page_size, int32_t bits) {
    return (bits == 8 ? c : c >> 1) * page_size + t;
}

/* Code of channel c of token slot t in a (page, KV head) block. */
EKV_CODES uint32_t ekv_code_get(const uint8_t *block, int64_t c, int64_t t, int64_t page_size,
                                int32_t bits) {
    const uint32_t byte = block[ekv_code_byte(c, t, page_size, bits)];
    return bits == 8 ? byte : (byte >> ((c & 1) * 4)) & 15u;
}

/* Writes code v of channel c of token slot t into a block whose bytes start cleared. */
EKV_CODES void ekv_code_put(uint8_t *block, int64_t c, int64_t t, int64_t page_size, int32_t bits,
                            uint32_t v) {
    block[ekv_code_byte(c, t, page_size, bits)] |= (uint8_t)(bits == 8 ? v : v << ((c & 1) * 4));
}
#endif
