/*
 * Per-page key summaries (docs/math.md §1.2, 9.5): min, max, Welford mean/M2 and the exact ball
 * radius, per physical page and KV head, all in fp32 and computed from the keys as
 * stored (after rounding to the storage dtype), so bounds hold for what decode reads; with
 * compact ranges, also min and max rounded outward to f16/bf16, which decode reads instead.
 *
 * min/max/mean/M2 are updated in O(D) per appended token. The radius max_j ||k_j - mean||
 * depends on the mean, which moves with every token, so it is recomputed over the page's
 * tokens once per append call (O(n_page * D) per touched page): for a decode step that is
 * one page per KV head, for a prefill chunk it amortises to O(D) per token.
 */
#include "cache_internal.h"

void ekv_summary_reset_page(ekv_cache *c, int32_t page) {
    int64_t D = c->p.head_dim, H = c->p.num_kv_heads;
    float *mn = c->kmin + (int64_t)page * H * D, *mx = c->kmax + (int64_t)page * H * D;
    float *me = c->kmean + (int64_t)page * H * D, *m2 = c->km2 + (int64_t)page * H * D;
    for (int64_t i = 0; i < H * D; i++) {
        mn[i] = INFINITY;
        mx[i] = -INFINITY;
        me[i] = 0.f;
        m2[i] = 0.f;
    }
    for (int64_t h = 0; h < H; h++) {
        c->radius[(int64_t)page * H + h] = 0.f;
        if (c->radius16) c->radius16[(int64_t)page * H + h] = 0.f;
        ekv_summary_round_ranges(c, page, (int32_t)h);
    }
    c->count[page] = 0;
}

void ekv_summary_round_ranges(ekv_cache *c, int32_t page, int32_t head) {
    if (!c->kmin16) return;
    const int64_t D = c->p.head_dim, off = ((int64_t)page * c->p.num_kv_heads + head) * D;
    for (int64_t d = 0; d < D; d++) {
        c->kmin16[off + d] = ekv_round16_outward(c->kmin[off + d], c->p.range_dtype, -1);
        c->kmax16[off + d] = ekv_round16_outward(c->kmax[off + d], c->p.range_dtype, 1);
    }
}

void ekv_summary_rebuild_superpage(ekv_cache *c, int32_t page) {
    if (!c->smin) return;
    const int64_t D = c->p.head_dim, H = c->p.num_kv_heads, S = c->p.superpage_pages,
                  sid = page / S;
    float *smn = c->smin + sid * H * D, *smx = c->smax + sid * H * D;
    for (int64_t i = 0; i < H * D; i++) {
        smn[i] = INFINITY;
        smx[i] = -INFINITY;
    }
    for (int64_t pg = sid * S; pg < (sid + 1) * S && pg < c->p.num_pages; pg++) {
        c->in_super[pg] = c->count[pg] > 0;
        if (c->count[pg] <= 0) continue; /* free, never used, or being reset: no live keys */
        const float *mn = c->kmin + pg * H * D, *mx = c->kmax + pg * H * D;
        for (int64_t i = 0; i < H * D; i++) {
            if (mn[i] < smn[i]) smn[i] = mn[i];
            if (mx[i] > smx[i]) smx[i] = mx[i];
        }
    }
}

void ekv_summary_add_row(ekv_cache *c, int32_t page, int32_t head, const float *row, int32_t n) {
    int64_t D = c->p.head_dim;
    int64_t off = ((int64_t)page * c->p.num_kv_heads + head) * D;
    float *mn = c->kmin + off, *mx = c->kmax + off, *me = c->kmean + off, *m2 = c->km2 + off;
    float *smn = NULL, *smx = NULL; /* the superpage box only grows between resets */
    if (c->smin) {
        const int64_t soff =
                ((int64_t)(page / c->p.superpage_pages) * c->p.num_kv_heads + head) * D;
        smn = c->smin + soff;
        smx = c->smax + soff;
    }
    double inv_n = 1.0 / n;
    for (int64_t d = 0; d < D; d++) {
        float x = row[d];
        if (x < mn[d]) mn[d] = x;
        if (x > mx[d]) mx[d] = x;
        if (smn) {
            if (x < smn[d]) smn[d] = x;
            if (x > smx[d]) smx[d] = x;
        }
        double old = me[d];
        double mean = old + (x - old) * inv_n;
        me[d] = (float)mean;
        m2[d] = (float)((double)m2[d] + (x - old) * (x - mean));
    }
}

void ekv_summary_page_done(ekv_cache *c, int32_t page, int32_t head) {
    ekv_summary_update_radius(c, page, head);
    ekv_summary_round_ranges(c, page, head);
    ekv_codes_update_page(c, page, head);
}

/* sqrt(s) as a float rounded up: a radius must not shrink. */
static float radius_up(double s) {
    const double r = sqrt(s);
    float rf = (float)r;
    if ((double)rf < r) rf = nextafterf(rf, INFINITY);
    return rf;
}

/* The radius around the fp32 mean and, with compact ranges, the compact centre (the mean
 * rounded to the nearest finite range_dtype value) and the radius around it (docs/math.md
 * §9.5): one pass over the page's stored keys. */
void ekv_summary_update_radius(ekv_cache *c, int32_t page, int32_t head) {
    const int64_t D = c->p.head_dim, soff = ((int64_t)page * c->p.num_kv_heads + head) * D;
    const float *me = c->kmean + soff;
    uint16_t *me16 = c->kmean16 ? c->kmean16 + soff : NULL;
    if (me16)
        for (int64_t d = 0; d < D; d++)
            me16[d] = ekv_round16_nearest_finite(me[d], c->p.range_dtype);
    double best = 0, best16 = 0;
    for (int32_t t = 0; t < c->count[page]; t++) {
        double s = 0, s16 = 0;
        for (int64_t d = 0; d < D; d++) {
            const double k =
                    (double)ekv_load_f32(c->k, c->p.dtype, ekv_cache_row(c, page, head, t) + d);
            s += (k - me[d]) * (k - me[d]);
            if (me16) {
                const double c16 = (double)ekv_load_f32(me16, c->p.range_dtype, d);
                s16 += (k - c16) * (k - c16);
            }
        }
        best = s > best ? s : best;
        best16 = s16 > best16 ? s16 : best16;
    }
    c->radius[(int64_t)page * c->p.num_kv_heads + head] = radius_up(best);
    if (me16) c->radius16[(int64_t)page * c->p.num_kv_heads + head] = radius_up(best16);
}

/* The page's summaries (and the box of its superpage) from its first `count` stored keys, as
 * appending them would have built them (row: head_dim floats of scratch): adoption and
 * truncation build pages with it. */
void ekv_summary_rebuild_page(ekv_cache *c, int32_t page, int32_t count, float *row) {
    ekv_summary_reset_page(c, page);
    if (c->in_super && c->in_super[page]) /* a reused page: drop its old keys from the box */
        ekv_summary_rebuild_superpage(c, page);
    c->count[page] = count;
    if (c->in_super) c->in_super[page] = 1;
    for (int32_t h = 0; h < c->p.num_kv_heads; h++) {
        for (int32_t t = 0; t < count; t++) {
            const int64_t at = ekv_cache_row(c, page, h, t);
            for (int64_t d = 0; d < c->p.head_dim; d++)
                row[d] = ekv_load_f32(c->k, c->p.dtype, at + d);
            ekv_summary_add_row(c, page, h, row, t + 1);
        }
        ekv_summary_page_done(c, page, h);
    }
}
