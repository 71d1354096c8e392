/*
 * Key codes (docs/math.md §10.1): after an append call touched (page, head), every token's
 * codes of that page are re-derived from the stored keys and the page's current range (as
 * decode reads it: the compact copy when the cache keeps one). A
 * new token that widens a channel's range changes that channel's step, so re-deriving the
 * page is what keeps the codes exact; it costs O(page_size * D) per touched page, the same as
 * the radius update beside it (one page per KV head for a decode step, O(D) per token for a
 * prefill chunk).
 */
#include "cache_internal.h"

void ekv_codes_update_page(ekv_cache *c, int32_t page, int32_t head) {
    if (!c->codes) return;
    const int64_t D = c->p.head_dim, ps = c->p.page_size;
    const int32_t bits = c->p.code_bits;
    const int64_t soff = ((int64_t)page * c->p.num_kv_heads + head) * D;
    uint8_t *block = c->codes +
                     ((int64_t)page * c->p.num_kv_heads + head) * ps * ekv_code_row_bytes(D, bits);
    memset(block, 0, (size_t)(ps * ekv_code_row_bytes(D, bits)));
    for (int64_t d = 0; d < D; d++) {
        float mn, mx;
        ekv_cache_range_at(c, soff + d, &mn, &mx);
        const float step = ekv_code_step(mn, mx, bits);
        for (int32_t t = 0; t < c->count[page]; t++) {
            const float k = ekv_load_f32(c->k, c->p.dtype, ekv_cache_row(c, page, head, t) + d);
            ekv_code_put(block, d, t, ps, bits, ekv_code_of(k, mn, step, bits));
        }
    }
}
