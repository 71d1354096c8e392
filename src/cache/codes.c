/*
 * Key codes (docs/math.md §10.1): after an append call touched (page, head), every token's
 * codes of that page are re-derived from the stored keys and the page's current range. A
 * new token that widens a channel's range changes that channel's step, so re-deriving the
 * page is what keeps the codes exact; it costs O(page_size * D) per touched page, the same as
 * the radius update beside it (one page per KV head for a decode step, O(D) per token for a
 * prefill chunk).
 */
#include "cache_internal.h"

void ekv_codes_update_page(ekv_cache *c, int32_t page, int32_t head) {
    if (!c->codes) return;
    const int64_t D = c->p.head_dim, bits = c->p.code_bits,
                  rb = ekv_code_row_bytes(D, c->p.code_bits);
    const int64_t soff = ((int64_t)page * c->p.num_kv_heads + head) * D;
    const float *mn = c->kmin + soff, *mx = c->kmax + soff;
    const int64_t kbase = (int64_t)page * c->elems_per_page + (int64_t)head * c->p.page_size * D;
    uint8_t *rows = c->codes + (((int64_t)page * c->p.num_kv_heads + head) * c->p.page_size) * rb;
    for (int32_t t = 0; t < c->count[page]; t++) {
        uint8_t *row = rows + t * rb;
        memset(row, 0, (size_t)rb);
        for (int64_t d = 0; d < D; d++) {
            const float k = ekv_load_f32(c->k, c->p.dtype, kbase + t * D + d);
            const uint32_t code = ekv_code_of(k, mn[d], ekv_code_step(mn[d], mx[d], (int32_t)bits),
                                              (int32_t)bits);
            if (bits == 8)
                row[d] = (uint8_t)code;
            else
                row[d >> 1] |= (uint8_t)(code << ((d & 1) * 4));
        }
    }
}
