/*
 * Property tests of the paged KV cache (ekv_cache):
 *   - random interleaved appends (decode steps, prefill chunks crossing pages) over page
 *     sizes, storage/source dtypes, KV heads and head dims; after every append the touched
 *     pages, and at the end every page, are checked against a from-scratch recomputation
 *     in double of the stored values and of the page summaries (docs/math.md §1.2, 9.5);
 *   - page tables (CSR consistency, "needed" query mode, too-small capacity);
 *   - freeing sequences, page reuse with fresh statistics;
 *   - cache full and NaN/inf (and storage-overflow) inputs: error, nothing changed;
 *   - ekv_cache_bytes_needed / ekv_cache_pages_for;
 *   - sequence versions: a page table of a sequence freed, created again and refilled to the
 *     same length is stale although the length agrees (issue 32).
 * The expected storage values come from an independent model of f16/bf16 rounding
 * (round to nearest even via rint in double), not from the library's converters.
 */
#include "entmaxkv.h"
#include "core/internal.h"
#include "test_util.h"
#include <float.h>
#include <string.h>

static char g_cfg[256]; /* current configuration, printed with every failure */

/* ---------------------------------------------------------------------------------- */
/* Independent dtype model                                                             */
/* ---------------------------------------------------------------------------------- */
static double round_f16(double x) {
    if (x == 0 || !isfinite(x)) return x;
    int e;
    (void)frexp(x, &e); /* |x| in [2^(e-1), 2^e); 11 significant bits */
    int ue = e - 11;
    if (ue < -24) ue = -24; /* subnormal spacing */
    double q = ldexp(rint(ldexp(x, -ue)), ue);
    if (fabs(q) > 65504.0) q = copysign(INFINITY, x);
    return q;
}

static double round_bf16(double x) {
    if (x == 0 || !isfinite(x)) return x;
    int e;
    (void)frexp(x, &e); /* 8 significant bits, float exponent range */
    int ue = e - 8;
    if (ue < -133) ue = -133;
    double q = ldexp(rint(ldexp(x, -ue)), ue);
    if (fabs(q) > 0x1.fep127) q = copysign(INFINITY, x);
    return q;
}

static double round_to(ekv_dtype dt, double x) {
    switch (dt) {
    case EKV_DTYPE_F16: return round_f16(x);
    case EKV_DTYPE_BF16: return round_bf16(x);
    default: return (double)(float)x;
    }
}

static uint16_t enc_f16(double v) { /* v representable in f16 */
    uint16_t s = signbit(v) ? 0x8000u : 0;
    double a = fabs(v);
    if (isinf(a)) return (uint16_t)(s | 0x7c00u);
    if (a < 0x1p-14) return (uint16_t)(s | (uint16_t)ldexp(a, 24));
    int e;
    double m = frexp(a, &e);
    return (uint16_t)(s | (uint16_t)((e - 1 + 15) << 10) | (uint16_t)((m * 2 - 1) * 1024));
}

static double dec_f16(uint16_t h) {
    int ex = (h >> 10) & 31, man = h & 1023;
    double v;
    if (ex == 0)
        v = ldexp(man, -24);
    else if (ex == 31)
        v = man ? NAN : INFINITY;
    else
        v = ldexp(1024 + man, ex - 25);
    return (h & 0x8000u) ? -v : v;
}

static uint16_t enc_bf16(double v) { /* v representable in bf16 */
    float f = (float)v;
    uint32_t b;
    memcpy(&b, &f, 4);
    return (uint16_t)(b >> 16);
}

static double dec_bf16(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static double load(const void *base, ekv_dtype dt, int64_t i) {
    switch (dt) {
    case EKV_DTYPE_F16: return dec_f16(((const uint16_t *)base)[i]);
    case EKV_DTYPE_BF16: return dec_bf16(((const uint16_t *)base)[i]);
    default: return ((const float *)base)[i];
    }
}

/* v must be representable in dt */
static void store(void *base, ekv_dtype dt, int64_t i, double v) {
    switch (dt) {
    case EKV_DTYPE_F16: ((uint16_t *)base)[i] = enc_f16(v); break;
    case EKV_DTYPE_BF16: ((uint16_t *)base)[i] = enc_bf16(v); break;
    default: ((float *)base)[i] = (float)v; break;
    }
}

static int same_value(double a, double b) { return a == b && signbit(a) == signbit(b); }

/* ---------------------------------------------------------------------------------- */
/* Shadow model of the cache                                                           */
/* ---------------------------------------------------------------------------------- */
typedef struct {
    int alive;
    int32_t id;
    int64_t len, cap, target;
    int mode;
    double *k, *v; /* expected stored values [len][Hk][D] */
} shadow;

typedef struct {
    ekv_context *ctx;
    ekv_cache *c;
    ekv_cache_params p;
    ekv_paged_kv kv;
    ekv_page_stats st;
    int nsh;
    shadow sh[8];
} world;

/* worst observed errors relative to the tolerance scales (printed at the end) */
static double g_worst_mean = 0, g_worst_m2 = 0, g_worst_radius = 0;

static int world_init(world *w, ekv_context *ctx, const ekv_cache_params *p) {
    memset(w, 0, sizeof *w);
    w->ctx = ctx;
    w->p = *p;
    ekv_status st = ekv_cache_create(ctx, p, &w->c);
    CHECK(st == EKV_OK, "[%s] ekv_cache_create: %s (%s)", g_cfg, ekv_status_string(st),
          ekv_last_error(ctx));
    if (st) return 0;
    CHECK(ekv_cache_free_pages(w->c) == p->num_pages,
          "[%s] fresh cache has %lld free pages, want %lld", g_cfg,
          (long long)ekv_cache_free_pages(w->c), (long long)p->num_pages);
    st = ekv_cache_kv_view(w->c, &w->kv, &w->st);
    CHECK(st == EKV_OK, "[%s] kv_view: %s", g_cfg, ekv_status_string(st));
    const ekv_paged_kv *kv = &w->kv;
    CHECK(kv->dtype == p->dtype && kv->page_size == p->page_size &&
                  kv->num_kv_heads == p->num_kv_heads && kv->head_dim == p->head_dim &&
                  kv->num_pages == p->num_pages,
          "[%s] view geometry differs from params", g_cfg);
    /* strides: any layout the view describes is accepted, but slots must not overlap */
    CHECK(kv->stride_token >= p->head_dim && kv->stride_head >= kv->stride_token * p->page_size &&
                  kv->stride_page >= kv->stride_head * p->num_kv_heads,
          "[%s] view strides overlap: page %lld head %lld token %lld", g_cfg,
          (long long)kv->stride_page, (long long)kv->stride_head, (long long)kv->stride_token);
    return 1;
}

static void world_free(world *w) {
    for (int i = 0; i < w->nsh; i++) {
        free(w->sh[i].k);
        free(w->sh[i].v);
    }
    ekv_cache_free(w->c);
    w->c = NULL;
}

static shadow *world_new_seq(world *w, int mode, int64_t target) {
    shadow *s = NULL;
    for (int i = 0; i < w->nsh; i++)
        if (!w->sh[i].alive) {
            s = &w->sh[i];
            break;
        }
    if (!s) s = &w->sh[w->nsh++];
    int32_t id = -1;
    ekv_status st = ekv_cache_seq_new(w->c, &id);
    CHECK(st == EKV_OK, "[%s] seq_new: %s", g_cfg, ekv_status_string(st));
    if (st) return NULL;
    for (int i = 0; i < w->nsh; i++)
        CHECK(!(w->sh[i].alive && w->sh[i].id == id), "[%s] seq_new returned live id %d", g_cfg,
              id);
    s->alive = 1;
    s->id = id;
    s->len = 0;
    s->mode = mode;
    s->target = target;
    int64_t len = -1;
    CHECK(ekv_cache_seq_length(w->c, id, &len) == EKV_OK && len == 0, "[%s] new seq length %lld",
          g_cfg, (long long)len);
    return s;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Page table of one live sequence (malloc'd indices; caller frees). */
static int32_t *seq_pages(world *w, const shadow *s, int64_t *np_out, int32_t *lpl_out) {
    int64_t needed = -1, indptr[2] = {-1, -1};
    int32_t lpl = -1;
    ekv_status st = ekv_cache_page_table(w->c, &s->id, 1, NULL, NULL, 0, NULL, &needed);
    CHECK(st == EKV_OK, "[%s] page_table(needed): %s", g_cfg, ekv_status_string(st));
    if (st || needed < 0) return NULL;
    int32_t *idx = malloc((size_t)(needed > 0 ? needed : 1) * sizeof(int32_t));
    st = ekv_cache_page_table(w->c, &s->id, 1, indptr, idx, needed, &lpl, NULL);
    CHECK(st == EKV_OK, "[%s] page_table: %s", g_cfg, ekv_status_string(st));
    CHECK(indptr[0] == 0 && indptr[1] == needed, "[%s] indptr {%lld, %lld}, needed %lld", g_cfg,
          (long long)indptr[0], (long long)indptr[1], (long long)needed);
    *np_out = needed;
    *lpl_out = lpl;
    return idx;
}

/*
 * Checks pages [i0, i1] of sequence s: stored K/V against the shadow, token counts, and
 * the summaries against a from-scratch recomputation in double.
 */
/* The next 16-bit value towards +inf and -inf (bits); their values: test_value16. */
static uint16_t up16(uint16_t h) {
    return h == 0x8000 ? 0x0001 : (h & 0x8000) ? (uint16_t)(h - 1) : (uint16_t)(h + 1);
}
static uint16_t down16(uint16_t h) {
    return h == 0x0000 ? 0x8001 : (h & 0x8000) ? (uint16_t)(h + 1) : (uint16_t)(h - 1);
}

/* Compact ranges (docs/math.md §1.2): the stored min and max rounded outward, as tightly as the
 * range dtype allows (the next value inward would cut a key off). */
static void check_compact_range(const ekv_page_stats *st, int64_t i, double mn, double mx) {
    const ekv_dtype dt = st->range_dtype;
    const uint16_t lo = st->kmin16[i], hi = st->kmax16[i];
    const double l = test_value16(lo, dt), h = test_value16(hi, dt);
    CHECK(l <= mn && (l == mn || test_value16(up16(lo), dt) > mn),
          "[%s] compact min %.9g (%s) for min %.9g at %lld: not the outward rounding", g_cfg, l,
          ekv_dtype_name(dt), mn, (long long)i);
    CHECK(h >= mx && (h == mx || test_value16(down16(hi), dt) < mx),
          "[%s] compact max %.9g (%s) for max %.9g at %lld: not the outward rounding", g_cfg, h,
          ekv_dtype_name(dt), mx, (long long)i);
}

/* ekv_round16_outward (docs/math.md §1.2) against the definition, for every finite 16-bit value
 * of f16 and bf16 and fp32 numbers just around it and halfway to its neighbour, the extremes
 * beyond the dtype's range, zeros, infinities and subnormals: rounded down it is at most x and
 * the next 16-bit value is above x; rounded up, the mirror image. */
static void check_outward_one(float x, ekv_dtype dt, int64_t *bad) {
    const uint16_t lo = ekv_round16_outward(x, dt, -1), hi = ekv_round16_outward(x, dt, 1);
    const double l = test_value16(lo, dt), h = test_value16(hi, dt);
    const int ok = l <= x && (l == x || test_value16(up16(lo), dt) > x) && h >= x &&
                   (h == x || test_value16(down16(hi), dt) < x);
    if (!ok && (*bad)++ < 3)
        fprintf(stderr, "outward %s of %.9g: down %.9g, up %.9g\n", ekv_dtype_name(dt), x, l, h);
}

static void test_round_outward(void) {
    const ekv_dtype dts[2] = {EKV_DTYPE_F16, EKV_DTYPE_BF16};
    int64_t bad = 0, n = 0;
    for (int k = 0; k < 2; k++)
        for (uint32_t b = 0; b < 65536; b++) {
            const uint16_t h = (uint16_t)b;
            const double v = test_value16(h, dts[k]), next = test_value16(up16(h), dts[k]);
            if (!isfinite(v) || !isfinite(next)) continue;
            const float x = (float)v, mid = (float)(0.5 * (v + next));
            const float probe[5] = {x, nextafterf(x, INFINITY), nextafterf(x, -INFINITY), mid,
                                    nextafterf(mid, INFINITY)};
            for (int i = 0; i < 5; i++, n++) check_outward_one(probe[i], dts[k], &bad);
        }
    const float edge[10] = {0.f,      -0.f,    INFINITY, -INFINITY, 70000.f,
                            -70000.f, FLT_MAX, -FLT_MAX, 0x1p-149f, -0x1p-149f};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 10; i++, n++) check_outward_one(edge[i], dts[k], &bad);
    CHECK(bad == 0, "%lld of %lld values rounded outward wrongly", (long long)bad, (long long)n);
}

static void verify_pages(world *w, const shadow *s, const int32_t *pages, int64_t np, int64_t i0,
                         int64_t i1) {
    const int64_t ps = w->p.page_size, Hk = w->p.num_kv_heads, D = w->p.head_dim;
    const ekv_paged_kv *kv = &w->kv;
    const ekv_page_stats *st = &w->st;
    double *col = malloc(sizeof(double) * (size_t)(ps * D));
    for (int64_t i = i0; i <= i1 && i < np; i++) {
        const int32_t page = pages[i];
        const int64_t n = i < np - 1 ? ps : s->len - (np - 1) * ps;
        CHECK(st->count[page] == n, "[%s] seq %d page #%lld (id %d): count %d, want %lld", g_cfg,
              s->id, (long long)i, page, st->count[page], (long long)n);
        for (int64_t h = 0; h < Hk; h++) {
            const int64_t base = page * kv->stride_page + h * kv->stride_head;
            int bad_k = 0, bad_v = 0;
            for (int64_t t = 0; t < n; t++) {
                const int64_t tok = i * ps + t;
                for (int64_t d = 0; d < D; d++) {
                    const int64_t off = base + t * kv->stride_token + d;
                    const double ek = s->k[(tok * Hk + h) * D + d],
                                 ev = s->v[(tok * Hk + h) * D + d];
                    double gk = load(kv->k, kv->dtype, off), gv = load(kv->v, kv->dtype, off);
                    if (kv->dtype == EKV_DTYPE_F32) { /* bit-exact */
                        float fk = (float)ek, fv = (float)ev;
                        if (memcmp(&fk, (const float *)kv->k + off, 4) && bad_k++ < 3)
                            CHECK(0, "[%s] seq %d tok %lld h %lld d %lld: K %.9g, want %.9g (bits)",
                                  g_cfg, s->id, (long long)tok, (long long)h, (long long)d, gk, ek);
                        if (memcmp(&fv, (const float *)kv->v + off, 4) && bad_v++ < 3)
                            CHECK(0, "[%s] seq %d tok %lld h %lld d %lld: V %.9g, want %.9g (bits)",
                                  g_cfg, s->id, (long long)tok, (long long)h, (long long)d, gv, ev);
                    } else {
                        if (!same_value(gk, ek) && bad_k++ < 3)
                            CHECK(0, "[%s] seq %d tok %lld h %lld d %lld: K %.9g, want %.9g", g_cfg,
                                  s->id, (long long)tok, (long long)h, (long long)d, gk, ek);
                        if (!same_value(gv, ev) && bad_v++ < 3)
                            CHECK(0, "[%s] seq %d tok %lld h %lld d %lld: V %.9g, want %.9g", g_cfg,
                                  s->id, (long long)tok, (long long)h, (long long)d, gv, ev);
                    }
                    col[d * ps + t] = gk;
                }
            }
            g_checks++;
            if (n <= 0) continue;
            /* summaries of (page, h) */
            const int64_t so = (page * Hk + h) * D;
            for (int64_t d = 0; d < D; d++) {
                const double *x = col + d * ps;
                double mn = x[0], mx = x[0], sum = 0;
                for (int64_t t = 0; t < n; t++) {
                    if (x[t] < mn) mn = x[t];
                    if (x[t] > mx) mx = x[t];
                    sum += x[t];
                }
                const double mean = sum / n;
                double m2 = 0;
                for (int64_t t = 0; t < n; t++) m2 += (x[t] - mean) * (x[t] - mean);
                const double mag = fmax(fabs(mn), fabs(mx));
                const double smin = st->kmin[so + d], smax = st->kmax[so + d];
                const double smean = st->kmean[so + d], sm2 = st->km2[so + d];
                CHECK(smin == mn && smax == mx,
                      "[%s] seq %d page #%lld h %lld d %lld: min/max %.9g/%.9g, want %.9g/%.9g",
                      g_cfg, s->id, (long long)i, (long long)h, (long long)d, smin, smax, mn, mx);
                if (st->range_dtype != EKV_DTYPE_F32) check_compact_range(st, so + d, mn, mx);
                /* mean: float Welford drifts by a few ulps of the magnitude */
                const double tol_mean = 1e-5 * mag + 1e-30;
                CHECK(fabs(smean - mean) <= tol_mean,
                      "[%s] seq %d page #%lld h %lld d %lld n %lld: mean %.9g, want %.9g", g_cfg,
                      s->id, (long long)i, (long long)h, (long long)d, (long long)n, smean, mean);
                if (mag > 0) g_worst_mean = fmax(g_worst_mean, fabs(smean - mean) / mag);
                /* M2: relative 1e-5, plus cancellation against the squared magnitude */
                const double scale_m2 = m2 + 1e-2 * (double)n * mag * mag;
                const double tol_m2 = 1e-5 * scale_m2 + 1e-37;
                CHECK(sm2 >= 0 && fabs(sm2 - m2) <= tol_m2,
                      "[%s] seq %d page #%lld h %lld d %lld n %lld: M2 %.9g, want %.9g (tol %.3g)",
                      g_cfg, s->id, (long long)i, (long long)h, (long long)d, (long long)n, sm2, m2,
                      tol_m2);
                if (scale_m2 > 0) g_worst_m2 = fmax(g_worst_m2, fabs(sm2 - m2) / scale_m2);
                /* derived std (docs/math.md §1.2) against the exact population std */
                const double sstd = fmax(sqrt(sm2 / n), 1e-6), estd = fmax(sqrt(m2 / n), 1e-6);
                CHECK(fabs(sstd - estd) <= sqrt(tol_m2 / n) + 1e-6 * estd,
                      "[%s] seq %d page #%lld h %lld d %lld: std %.9g, want %.9g", g_cfg, s->id,
                      (long long)i, (long long)h, (long long)d, sstd, estd);
            }
            /* radius: exact ball around the stored mean, never smaller than exact */
            double best = 0;
            for (int64_t t = 0; t < n; t++) {
                double ss = 0;
                for (int64_t d = 0; d < D; d++) {
                    double diff = col[d * ps + t] - (double)st->kmean[so + d];
                    ss += diff * diff;
                }
                if (ss > best) best = ss;
            }
            const double r = sqrt(best), sr = st->radius[page * Hk + h];
            CHECK(sr >= r && sr <= r * (1 + 1e-5) + 1e-37,
                  "[%s] seq %d page #%lld h %lld n %lld: radius %.9g, exact around stored mean %.9g",
                  g_cfg, s->id, (long long)i, (long long)h, (long long)n, sr, r);
            if (r > 0) g_worst_radius = fmax(g_worst_radius, (sr - r) / r);
            if (st->kmean16) { /* the compact ball: the mean rounded to the nearest finite 16-bit
                                * value, and the exact radius around that centre (§9.5) */
                const ekv_dtype rd = st->range_dtype;
                double b16 = 0;
                for (int64_t d = 0; d < D; d++) {
                    const uint16_t c16 = st->kmean16[so + d];
                    const double cv = test_value16(c16, rd), m = st->kmean[so + d];
                    const int nearest = fabs(cv - m) <= fabs(test_value16(up16(c16), rd) - m) &&
                                        fabs(cv - m) <= fabs(test_value16(down16(c16), rd) - m);
                    CHECK(isfinite(cv) && (nearest || !isfinite(test_value16(up16(c16), rd))),
                          "[%s] page #%lld h %lld d %lld: compact centre %.9g is not the nearest "
                          "finite %s to the mean %.9g",
                          g_cfg, (long long)i, (long long)h, (long long)d, cv, ekv_dtype_name(rd), m);
                }
                for (int64_t t = 0; t < n; t++) {
                    double ss = 0;
                    for (int64_t d = 0; d < D; d++) {
                        const double diff = col[d * ps + t] - test_value16(st->kmean16[so + d], rd);
                        ss += diff * diff;
                    }
                    b16 = ss > b16 ? ss : b16;
                }
                const double r16 = sqrt(b16), s16 = st->radius16[page * Hk + h];
                CHECK(s16 >= r16 && s16 <= r16 * (1 + 1e-5) + 1e-37,
                      "[%s] page #%lld h %lld: compact radius %.9g, exact around the centre %.9g",
                      g_cfg, (long long)i, (long long)h, s16, r16);
            }
            /* the superpage box holds every live key of its pages (after reuse too) */
            if (st->smin) {
                const int64_t sso = ((page / st->superpage_pages) * Hk + h) * D;
                for (int64_t d = 0; d < D; d++)
                    CHECK(st->smin[sso + d] <= st->kmin[so + d] &&
                                  st->smax[sso + d] >= st->kmax[so + d],
                          "[%s] page #%lld h %lld d %lld: superpage box [%g, %g] misses the page's [%g, %g]",
                          g_cfg, (long long)i, (long long)h, (long long)d,
                          (double)st->smin[sso + d], (double)st->smax[sso + d],
                          (double)st->kmin[so + d], (double)st->kmax[so + d]);
            }
        }
    }
    free(col);
}

/* Whole-cache check: page tables of all live sequences, page ownership, free-page
 * accounting, every page's values and summaries, counts of free pages. */
static void check_all(world *w) {
    const int64_t ps = w->p.page_size, P = w->p.num_pages;
    int32_t ids[8];
    const shadow *shs[8];
    int32_t n = 0;
    for (int i = 0; i < w->nsh; i++)
        if (w->sh[i].alive) {
            ids[n] = w->sh[i].id;
            shs[n++] = &w->sh[i];
        }
    uint8_t *owned = calloc((size_t)P, 1);
    int64_t total = 0;
    if (n > 0) {
        int64_t needed = -1;
        ekv_status st = ekv_cache_page_table(w->c, ids, n, NULL, NULL, 0, NULL, &needed);
        CHECK(st == EKV_OK, "[%s] page_table(needed): %s", g_cfg, ekv_status_string(st));
        int64_t expect = 0;
        for (int32_t b = 0; b < n; b++) expect += ceil_div(shs[b]->len, ps);
        CHECK(needed == expect, "[%s] page_table needed %lld, want %lld", g_cfg, (long long)needed,
              (long long)expect);
        if (st || needed != expect) {
            free(owned);
            return;
        }
        int64_t indptr[9];
        int32_t lpl[8];
        int32_t *idx = malloc((size_t)(needed + 1) * sizeof(int32_t));
        st = ekv_cache_page_table(w->c, ids, n, indptr, idx, needed, lpl, NULL);
        CHECK(st == EKV_OK, "[%s] page_table: %s", g_cfg, ekv_status_string(st));
        CHECK(indptr[0] == 0 && indptr[n] == needed, "[%s] indptr ends %lld..%lld", g_cfg,
              (long long)indptr[0], (long long)indptr[n]);
        for (int32_t b = 0; b < n && !st; b++) {
            const shadow *s = shs[b];
            const int64_t np = indptr[b + 1] - indptr[b];
            CHECK(np == ceil_div(s->len, ps), "[%s] seq %d: %lld pages for %lld tokens", g_cfg,
                  s->id, (long long)np, (long long)s->len);
            if (s->len > 0) {
                CHECK(lpl[b] >= 1 && lpl[b] <= ps && (np - 1) * ps + lpl[b] == s->len,
                      "[%s] seq %d: last_page_len %d with %lld pages, length %lld", g_cfg, s->id,
                      lpl[b], (long long)np, (long long)s->len);
            }
            int64_t len = -1;
            CHECK(ekv_cache_seq_length(w->c, s->id, &len) == EKV_OK && len == s->len,
                  "[%s] seq %d length %lld, want %lld", g_cfg, s->id, (long long)len,
                  (long long)s->len);
            int ok = np == ceil_div(s->len, ps);
            for (int64_t i = indptr[b]; i < indptr[b + 1]; i++) {
                int32_t pg = idx[i];
                if (pg < 0 || pg >= P) {
                    CHECK(0, "[%s] seq %d: page id %d out of [0, %lld)", g_cfg, s->id, pg,
                          (long long)P);
                    ok = 0;
                    continue;
                }
                CHECK(!owned[pg], "[%s] page %d owned twice", g_cfg, pg);
                owned[pg] = 1;
            }
            if (ok) verify_pages(w, s, idx + indptr[b], np, 0, np - 1);
            total += np;
        }
        free(idx);
    }
    CHECK(ekv_cache_free_pages(w->c) == P - total, "[%s] free pages %lld, want %lld - %lld", g_cfg,
          (long long)ekv_cache_free_pages(w->c), (long long)P, (long long)total);
    int64_t bad = 0;
    for (int64_t pg = 0; pg < P; pg++)
        if (!owned[pg] && w->st.count[pg] != 0 && bad++ < 3)
            CHECK(0, "[%s] free page %lld has count %d", g_cfg, (long long)pg, w->st.count[pg]);
    g_checks++;
    free(owned);
}

/* ---------------------------------------------------------------------------------- */
/* Appends                                                                             */
/* ---------------------------------------------------------------------------------- */
static double gen_value(test_rng *r, int mode, int64_t h, int64_t d) {
    /* small set: ties for min/max, signed zeros, and exact rounding ties of f16 / bf16
     * (round to nearest even), normal and subnormal */
    static const double quant[] = {-2,
                                   -1,
                                   -0.5,
                                   -0.0,
                                   0,
                                   0.5,
                                   1,
                                   3,
                                   1 + 0x1p-11,
                                   1 + 0x1.8p-10,
                                   -(1 + 0x1p-8),
                                   1 + 0x1.8p-7,
                                   2049,
                                   -2051,
                                   0x1p-25,
                                   -0x1.8p-24,
                                   0x1p-26 + 0x1p-35};
    switch (mode) {
    case 0: return test_normal(r);
    case 1:
        return 10.0 * (double)((d % 5) - 2) + 0.5 * (double)h + 0.3 * test_normal(r); /* offsets */
    case 2: return 3e-5 * test_normal(r); /* f16 subnormals, tiny spread */
    case 3: return quant[test_range(r, 0, (int64_t)(sizeof quant / sizeof quant[0]) - 1)];
    case 4: return 200.0 * test_normal(r);                      /* large magnitudes */
    default: return 0.25 * (double)(h + 1) - 0.125 * (double)d; /* every token identical */
    }
}

/* Builds a chunk of n tokens in src dtype; expected stored values go to ek/ev. */
static void make_chunk(world *w, test_rng *r, int mode, int64_t n, ekv_dtype src, void *k, void *v,
                       double *ek, double *ev) {
    const int64_t Hk = w->p.num_kv_heads, D = w->p.head_dim;
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < Hk; h++)
            for (int64_t d = 0; d < D; d++) {
                int64_t i = (t * Hk + h) * D + d;
                double xk = round_to(src, gen_value(r, mode, h, d));
                double xv = round_to(src, gen_value(r, mode == 5 ? 0 : mode, h, d));
                store(k, src, i, xk);
                store(v, src, i, xv);
                ek[i] = round_to(w->p.dtype, xk);
                ev[i] = round_to(w->p.dtype, xv);
            }
}

/* Appends n tokens to s, expecting success, then checks the pages it touched. */
static void do_append(world *w, shadow *s, test_rng *r, int64_t n, ekv_dtype src) {
    const int64_t Hk = w->p.num_kv_heads, D = w->p.head_dim, row = Hk * D, ps = w->p.page_size;
    if (s->len + n > s->cap) {
        int64_t cap = s->cap ? s->cap : 16;
        while (cap < s->len + n) cap *= 2;
        s->k = realloc(s->k, sizeof(double) * (size_t)(cap * row));
        s->v = realloc(s->v, sizeof(double) * (size_t)(cap * row));
        s->cap = cap;
    }
    void *k = malloc((size_t)(n * row) * 4), *v = malloc((size_t)(n * row) * 4);
    make_chunk(w, r, s->mode, n, src, k, v, s->k + s->len * row, s->v + s->len * row);
    const int64_t free0 = ekv_cache_free_pages(w->c);
    const int64_t np0 = ceil_div(s->len, ps), np1 = ceil_div(s->len + n, ps);
    ekv_status st = ekv_cache_append(w->c, s->id, n, k, v, src);
    CHECK(st == EKV_OK, "[%s] append %lld tokens (src %s) to seq %d at %lld: %s (%s)", g_cfg,
          (long long)n, ekv_dtype_name(src), s->id, (long long)s->len, ekv_status_string(st),
          ekv_last_error(w->ctx));
    free(k);
    free(v);
    if (st) return;
    const int64_t first_page = s->len / ps;
    s->len += n;
    CHECK(ekv_cache_free_pages(w->c) == free0 - (np1 - np0),
          "[%s] free pages %lld after append, want %lld", g_cfg,
          (long long)ekv_cache_free_pages(w->c), (long long)(free0 - (np1 - np0)));
    int64_t len = -1;
    CHECK(ekv_cache_seq_length(w->c, s->id, &len) == EKV_OK && len == s->len,
          "[%s] length %lld, want %lld", g_cfg, (long long)len, (long long)s->len);
    int64_t np = 0;
    int32_t lpl = 0;
    int32_t *pages = seq_pages(w, s, &np, &lpl);
    if (!pages) return;
    CHECK(np == np1 && (np - 1) * ps + lpl == s->len,
          "[%s] seq %d: %lld pages, last %d, length %lld", g_cfg, s->id, (long long)np, lpl,
          (long long)s->len);
    if (np == np1) verify_pages(w, s, pages, np, first_page, np - 1);
    free(pages);
}

static void expect_dead(world *w, int32_t id) {
    const int64_t row = (int64_t)w->p.num_kv_heads * w->p.head_dim;
    float *buf = calloc((size_t)row, sizeof(float));
    int64_t len = -7, needed = -7, indptr[2] = {-7, -7};
    int32_t idx[4] = {-7, -7, -7, -7}, lpl = -7;
    ekv_status st = ekv_cache_seq_length(w->c, id, &len);
    CHECK(st == EKV_ERR_INVALID_SEQUENCE && len == -7, "[%s] seq_length(dead %d): %s", g_cfg, id,
          ekv_status_string(st));
    const int64_t free0 = ekv_cache_free_pages(w->c);
    st = ekv_cache_append(w->c, id, 1, buf, buf, EKV_DTYPE_F32);
    CHECK(st == EKV_ERR_INVALID_SEQUENCE, "[%s] append(dead %d): %s", g_cfg, id,
          ekv_status_string(st));
    CHECK(ekv_cache_free_pages(w->c) == free0, "[%s] append to a dead seq took pages", g_cfg);
    st = ekv_cache_seq_free(w->c, id);
    CHECK(st == EKV_ERR_INVALID_SEQUENCE, "[%s] seq_free(dead %d): %s", g_cfg, id,
          ekv_status_string(st));
    CHECK(ekv_cache_free_pages(w->c) == free0, "[%s] double free changed free pages", g_cfg);
    st = ekv_cache_page_table(w->c, &id, 1, indptr, idx, 4, &lpl, &needed);
    CHECK(st == EKV_ERR_INVALID_SEQUENCE && indptr[0] == -7 && idx[0] == -7 && lpl == -7,
          "[%s] page_table(dead %d): %s", g_cfg, id, ekv_status_string(st));
    free(buf);
}

/* Frees s and checks that its pages went back to the pool. */
static void free_seq(world *w, shadow *s) {
    const int64_t free0 = ekv_cache_free_pages(w->c), np = ceil_div(s->len, w->p.page_size);
    ekv_status st = ekv_cache_seq_free(w->c, s->id);
    CHECK(st == EKV_OK, "[%s] seq_free(%d): %s", g_cfg, s->id, ekv_status_string(st));
    CHECK(ekv_cache_free_pages(w->c) == free0 + np,
          "[%s] free pages %lld after freeing %lld pages (was %lld)", g_cfg,
          (long long)ekv_cache_free_pages(w->c), (long long)np, (long long)free0);
    s->alive = 0;
    expect_dead(w, s->id);
}

/* ---------------------------------------------------------------------------------- */
/* 1. Random interleaved appends                                                       */
/* ---------------------------------------------------------------------------------- */
static void random_trial(ekv_context *ctx, test_rng *r, int trial) {
    static const int32_t sizes[] = {1, 2, 7, 16, 64, 256};
    static const int32_t dims[] = {8, 20, 64};
    ekv_cache_params p = ekv_cache_default_params();
    p.page_size = sizes[trial % 6];
    p.dtype = (ekv_dtype)((trial / 6) % 3);
    p.range_dtype = (ekv_dtype)((trial / 18 + trial) % 3); /* every K dtype meets every one */
    p.num_kv_heads = (int32_t)test_range(r, 1, 4);
    p.head_dim = dims[test_range(r, 0, 2)];
    ekv_dtype src = EKV_DTYPE_F32;
    if (test_uniform(r) < 0.35) src = test_uniform(r) < 0.5 ? EKV_DTYPE_F16 : EKV_DTYPE_BF16;
    const int nseq = (int)test_range(r, 1, 4);
    p.max_seqs = nseq + 2;
    const int64_t ps = p.page_size;
    int64_t maxlen = ps == 1 ? test_range(r, 1, 40)
                             : ps * test_range(r, 1, ps >= 64 ? 3 : 6) + test_range(r, 0, ps);
    if (maxlen > 1200) maxlen = 1200;
    p.num_pages = nseq * ceil_div(maxlen, ps) + test_range(r, 0, 3);
    snprintf(g_cfg, sizeof g_cfg,
             "trial %d: ps %d %s ranges %s Hk %d D %d src %s nseq %d maxlen %lld pages %lld thr %d",
             trial, p.page_size, ekv_dtype_name(p.dtype), ekv_dtype_name(p.range_dtype),
             p.num_kv_heads, p.head_dim, ekv_dtype_name(src), nseq, (long long)maxlen,
             (long long)p.num_pages, ekv_context_threads(ctx));
    world w;
    if (!world_init(&w, ctx, &p)) {
        world_free(&w);
        return;
    }
    for (int i = 0; i < nseq; i++)
        world_new_seq(&w, (int)test_range(r, 0, 5), test_range(r, 1, maxlen));
    int respawns = 0;
    for (int steps = 0; steps < 100000; steps++) {
        shadow *cand[8];
        int nc = 0;
        for (int i = 0; i < w.nsh; i++)
            if (w.sh[i].alive && w.sh[i].len < w.sh[i].target) cand[nc++] = &w.sh[i];
        if (nc == 0) break;
        shadow *s = cand[test_range(r, 0, nc - 1)];
        const int64_t rem = s->target - s->len;
        int64_t n;
        double u = test_uniform(r);
        if (u < 0.45)
            n = 1; /* decode step */
        else if (u < 0.70)
            n = test_range(r, 2, ps + 1); /* small chunk */
        else if (u < 0.90)
            n = test_range(r, ps, 3 * ps + 5); /* crosses pages */
        else
            n = rem; /* rest in one go */
        if (n > rem) n = rem;
        /* sometimes a different source dtype for this chunk */
        ekv_dtype csrc = test_uniform(r) < 0.8 ? src : (ekv_dtype)test_range(r, 0, 2);
        do_append(&w, s, r, n, csrc);
        if (s->len == s->target && respawns < 3 && test_uniform(r) < 0.4) {
            /* free it and start another sequence (reuses its pages, different data) */
            if (test_uniform(r) < 0.5) check_all(&w);
            free_seq(&w, s);
            respawns++;
            world_new_seq(&w, (int)test_range(r, 0, 5), test_range(r, 1, maxlen));
        }
        if (test_uniform(r) < 0.02) check_all(&w);
    }
    check_all(&w);
    world_free(&w);
}

/* ---------------------------------------------------------------------------------- */
/* 2. Page tables                                                                      */
/* ---------------------------------------------------------------------------------- */
static void test_page_table(ekv_context *ctx, test_rng *r) {
    ekv_cache_params p = ekv_cache_default_params();
    p.page_size = 7;
    p.num_kv_heads = 1;
    p.head_dim = 8;
    p.dtype = EKV_DTYPE_F32;
    p.num_pages = 20;
    p.max_seqs = 8;
    snprintf(g_cfg, sizeof g_cfg, "page_table");
    world w;
    if (!world_init(&w, ctx, &p)) {
        world_free(&w);
        return;
    }
    static const int64_t lens[5] = {0, 1, 7, 8, 50};
    for (int i = 0; i < 5; i++) {
        shadow *s = world_new_seq(&w, 0, lens[i]);
        if (!s) {
            world_free(&w);
            return;
        }
        /* interleave: build in two chunks */
        if (lens[i] > 0) do_append(&w, s, r, (lens[i] + 1) / 2, EKV_DTYPE_F32);
    }
    for (int i = 0; i < 5; i++)
        if (lens[i] / 2 > 0) do_append(&w, &w.sh[i], r, lens[i] / 2, EKV_DTYPE_F32);
    check_all(&w);
    const int order[5] = {4, 0, 2, 1, 3};
    int32_t ids[5];
    int64_t expect_np[5], want = 0;
    for (int b = 0; b < 5; b++) {
        ids[b] = w.sh[order[b]].id;
        expect_np[b] = ceil_div(lens[order[b]], 7);
        want += expect_np[b];
    }
    /* needed mode: no output arrays at all */
    int64_t needed = -1;
    ekv_status st = ekv_cache_page_table(w.c, ids, 5, NULL, NULL, 0, NULL, &needed);
    CHECK(st == EKV_OK && needed == want, "needed mode: %s, needed %lld want %lld",
          ekv_status_string(st), (long long)needed, (long long)want);
    /* too small: INVALID_SIZE, arrays untouched */
    enum { CAP = 64 };
    int64_t indptr[6];
    int32_t idx[CAP], lpl[5];
    const int64_t caps[4] = {0, 1, 2, want - 1};
    for (int ci = 0; ci < 4; ci++) {
        const int64_t cap = caps[ci];
        for (int i = 0; i < 6; i++) indptr[i] = -77;
        for (int i = 0; i < CAP; i++) idx[i] = -77;
        for (int i = 0; i < 5; i++) lpl[i] = -77;
        st = ekv_cache_page_table(w.c, ids, 5, indptr, idx, cap, lpl, NULL);
        CHECK(st == EKV_ERR_INVALID_SIZE, "capacity %lld < %lld: %s", (long long)cap,
              (long long)want, ekv_status_string(st));
        int untouched = 1;
        for (int i = 0; i < 6; i++) untouched &= indptr[i] == -77;
        for (int i = 0; i < CAP; i++) untouched &= idx[i] == -77;
        for (int i = 0; i < 5; i++) untouched &= lpl[i] == -77;
        CHECK(untouched, "capacity %lld: output arrays were written on error", (long long)cap);
        CHECK(ekv_last_error(ctx)[0] != '\0', "capacity %lld: no error message", (long long)cap);
    }
    /* exact and generous capacity */
    for (int extra = 0; extra <= 5; extra += 5) {
        for (int i = 0; i < CAP; i++) idx[i] = -77;
        needed = -1;
        st = ekv_cache_page_table(w.c, ids, 5, indptr, idx, want + extra, lpl, &needed);
        CHECK(st == EKV_OK && needed == want, "capacity %lld: %s", (long long)(want + extra),
              ekv_status_string(st));
        CHECK(indptr[0] == 0, "indptr[0] = %lld", (long long)indptr[0]);
        for (int b = 0; b < 5; b++) {
            CHECK(indptr[b + 1] - indptr[b] == expect_np[b], "seq #%d: %lld pages, want %lld", b,
                  (long long)(indptr[b + 1] - indptr[b]), (long long)expect_np[b]);
            const int64_t len = lens[order[b]];
            if (len > 0)
                CHECK((expect_np[b] - 1) * 7 + lpl[b] == len && lpl[b] >= 1 && lpl[b] <= 7,
                      "seq #%d: last_page_len %d for length %lld", b, lpl[b], (long long)len);
            /* same pages, same order, as the sequence's own table */
            int64_t np = 0;
            int32_t l1 = 0;
            int32_t *own = seq_pages(&w, &w.sh[order[b]], &np, &l1);
            if (own && np == expect_np[b]) {
                CHECK(memcmp(own, idx + indptr[b], (size_t)np * sizeof(int32_t)) == 0,
                      "seq #%d: pages differ from its single-sequence table", b);
                if (len > 0) CHECK(l1 == lpl[b], "seq #%d: last_page_len %d vs %d", b, l1, lpl[b]);
            }
            free(own);
        }
        int tail_ok = 1;
        for (int64_t i = want; i < CAP; i++) tail_ok &= idx[i] == -77;
        CHECK(tail_ok, "page_table wrote past the %lld needed ids", (long long)want);
    }
    /* unknown / bad sequence ids in the list: error, arrays untouched */
    const int32_t bad_ids[3] = {-1, 7, 1 << 20}; /* 7 = valid slot, never created */
    for (int i = 0; i < 3; i++) {
        int32_t ids2[3] = {ids[0], bad_ids[i], ids[1]};
        for (int j = 0; j < 6; j++) indptr[j] = -77;
        for (int j = 0; j < CAP; j++) idx[j] = -77;
        needed = -77;
        st = ekv_cache_page_table(w.c, ids2, 3, indptr, idx, CAP, lpl, &needed);
        CHECK(st == EKV_ERR_INVALID_SEQUENCE && indptr[0] == -77 && idx[0] == -77,
              "page_table with seq %d: %s", bad_ids[i], ekv_status_string(st));
    }
    st = ekv_cache_page_table(w.c, ids, 0, indptr, idx, CAP, lpl, &needed);
    CHECK(st != EKV_OK, "page_table with n_seqs = 0 succeeded");
    world_free(&w);
}

/* ---------------------------------------------------------------------------------- */
/* 3. Free and reuse                                                                   */
/* ---------------------------------------------------------------------------------- */
static void test_free_reuse(ekv_context *ctx, test_rng *r) {
    for (int dt = 0; dt < 3; dt++) {
        ekv_cache_params p = ekv_cache_default_params();
        p.page_size = 8;
        p.num_kv_heads = 2;
        p.head_dim = 20;
        p.dtype = (ekv_dtype)dt;
        p.num_pages = 12;
        p.max_seqs = 3;
        snprintf(g_cfg, sizeof g_cfg, "free/reuse %s", ekv_dtype_name(p.dtype));
        world w;
        if (!world_init(&w, ctx, &p)) {
            world_free(&w);
            continue;
        }
        shadow *a = world_new_seq(&w, 4, 0); /* large magnitudes: would leave stale min/max */
        shadow *b = world_new_seq(&w, 1, 0);
        shadow *e = world_new_seq(&w, 0, 0); /* stays empty */
        if (!a || !b || !e) {
            world_free(&w);
            continue;
        }
        do_append(&w, a, r, 35, EKV_DTYPE_F32); /* 5 pages, last holds 3 */
        do_append(&w, b, r, 9, EKV_DTYPE_F32);
        do_append(&w, a, r, 5, EKV_DTYPE_F32); /* 40 tokens: 5 full pages */
        check_all(&w);
        int32_t no_id = -1;
        ekv_status st = ekv_cache_seq_new(w.c, &no_id);
        CHECK(st != EKV_OK && no_id == -1, "[%s] seq_new beyond max_seqs: %s, id %d", g_cfg,
              ekv_status_string(st), no_id);
        int64_t np_a = 0;
        int32_t l = 0;
        int32_t *pages_a = seq_pages(&w, a, &np_a, &l);
        CHECK(ekv_cache_free_pages(w.c) == 12 - 5 - 2, "[%s] free pages %lld", g_cfg,
              (long long)ekv_cache_free_pages(w.c));
        const int32_t id_a = a->id;
        free_seq(&w, a); /* 5 pages back */
        free_seq(&w, e); /* empty sequence: nothing back */
        check_all(&w);
        /* a new sequence with small values reuses a's pages; 37 tokens: last page partial */
        shadow *c = world_new_seq(&w, 2, 0);
        if (!c) {
            free(pages_a);
            world_free(&w);
            continue;
        }
        do_append(&w, c, r, 30, EKV_DTYPE_F32);
        do_append(&w, c, r, 1, EKV_DTYPE_F32);
        do_append(&w, c, r, 6, EKV_DTYPE_F32);
        int64_t np_c = 0;
        int32_t *pages_c = seq_pages(&w, c, &np_c, &l);
        int reused = 0;
        for (int64_t i = 0; pages_a && pages_c && i < np_c; i++)
            for (int64_t j = 0; j < np_a; j++) reused += pages_c[i] == pages_a[j];
        /* 10 pages free before c, c needs 5: with 5 of a's pages on top of the free list
         * or not, at least some must be reused unless the pool hands out never-used pages
         * first; force the issue by filling the rest of the pool below. */
        shadow *d = world_new_seq(&w, 3, 0);
        if (d) do_append(&w, d, r, 8 * ekv_cache_free_pages(w.c), EKV_DTYPE_F32);
        CHECK(ekv_cache_free_pages(w.c) == 0, "[%s] pool not full: %lld free", g_cfg,
              (long long)ekv_cache_free_pages(w.c));
        int64_t np_d = 0;
        int32_t *pages_d = d ? seq_pages(&w, d, &np_d, &l) : NULL;
        for (int64_t i = 0; pages_a && pages_d && i < np_d; i++)
            for (int64_t j = 0; j < np_a; j++) reused += pages_d[i] == pages_a[j];
        CHECK(reused == np_a, "[%s] %d of %lld freed pages reused", g_cfg, reused, (long long)np_a);
        (void)id_a;
        check_all(&w); /* reused pages: fresh min/max/mean/M2/radius/count */
        free(pages_a);
        free(pages_c);
        free(pages_d);
        world_free(&w);
    }
}

/* ---------------------------------------------------------------------------------- */
/* 4. Atomic failures: snapshot of everything observable                                */
/* ---------------------------------------------------------------------------------- */
typedef struct {
    unsigned char *b;
    size_t n, cap;
} bytes;

static void put(bytes *x, const void *p, size_t n) {
    if (x->n + n > x->cap) {
        x->cap = (x->n + n) * 2 + 64;
        x->b = realloc(x->b, x->cap);
    }
    memcpy(x->b + x->n, p, n);
    x->n += n;
}

static bytes snapshot(world *w) {
    bytes x = {NULL, 0, 0};
    const int64_t ps = w->p.page_size, Hk = w->p.num_kv_heads, D = w->p.head_dim;
    const int64_t es = ekv_dtype_size(w->p.dtype);
    int64_t fp = ekv_cache_free_pages(w->c);
    put(&x, &fp, sizeof fp);
    put(&x, w->st.count, sizeof(int32_t) * (size_t)w->p.num_pages);
    for (int i = 0; i < w->nsh; i++) {
        const shadow *s = &w->sh[i];
        if (!s->alive) continue;
        int64_t len = -1, np = 0;
        int32_t lpl = 0;
        ekv_cache_seq_length(w->c, s->id, &len);
        put(&x, &len, sizeof len);
        int32_t *pages = seq_pages(w, s, &np, &lpl);
        if (!pages) continue;
        put(&x, pages, sizeof(int32_t) * (size_t)np);
        put(&x, &lpl, sizeof lpl);
        for (int64_t j = 0; j < np; j++) {
            const int64_t pg = pages[j], n = j < np - 1 ? ps : lpl;
            for (int64_t h = 0; h < Hk; h++) {
                const int64_t off = pg * w->kv.stride_page + h * w->kv.stride_head;
                for (int64_t t = 0; t < n; t++) {
                    put(&x, (const char *)w->kv.k + (off + t * w->kv.stride_token) * es,
                        (size_t)(D * es));
                    put(&x, (const char *)w->kv.v + (off + t * w->kv.stride_token) * es,
                        (size_t)(D * es));
                }
                const int64_t so = (pg * Hk + h) * D;
                put(&x, w->st.kmin + so, sizeof(float) * (size_t)D);
                put(&x, w->st.kmax + so, sizeof(float) * (size_t)D);
                put(&x, w->st.kmean + so, sizeof(float) * (size_t)D);
                put(&x, w->st.km2 + so, sizeof(float) * (size_t)D);
                put(&x, w->st.radius + pg * Hk + h, sizeof(float));
                if (w->st.kmin16) {
                    put(&x, w->st.kmin16 + so, sizeof(uint16_t) * (size_t)D);
                    put(&x, w->st.kmax16 + so, sizeof(uint16_t) * (size_t)D);
                    put(&x, w->st.kmean16 + so, sizeof(uint16_t) * (size_t)D);
                    put(&x, w->st.radius16 + pg * Hk + h, sizeof(float));
                }
                /* the key codes of the live slots: byte j * ps + t of the block is slot t's */
                const int64_t R = (D * w->st.code_bits + 7) / 8;
                const uint8_t *blk = w->st.codes ? w->st.codes + (pg * Hk + h) * ps * R : NULL;
                for (int64_t j = 0; blk && j < R; j++) put(&x, blk + j * ps, (size_t)n);
            }
        }
        free(pages);
    }
    if (w->st.smin) {
        const size_t nb = sizeof(float) * (size_t)(w->st.num_superpages * Hk * D);
        put(&x, w->st.smin, nb);
        put(&x, w->st.smax, nb);
    }
    return x;
}

static void expect_unchanged(world *w, const bytes *before, const char *what) {
    bytes after = snapshot(w);
    CHECK(after.n == before->n && memcmp(after.b, before->b, after.n) == 0,
          "[%s] %s changed the cache", g_cfg, what);
    free(after.b);
}

static void test_cache_full(ekv_context *ctx, test_rng *r) {
    for (int dt = 0; dt < 3; dt++) {
        ekv_cache_params p = ekv_cache_default_params();
        p.page_size = 16;
        p.num_kv_heads = 2;
        p.head_dim = 8;
        p.dtype = (ekv_dtype)dt;
        p.num_pages = 7;
        p.max_seqs = 4;
        snprintf(g_cfg, sizeof g_cfg, "cache full %s", ekv_dtype_name(p.dtype));
        world w;
        if (!world_init(&w, ctx, &p)) {
            world_free(&w);
            continue;
        }
        shadow *a = world_new_seq(&w, 0, 0), *b = world_new_seq(&w, 4, 0);
        if (!a || !b) {
            world_free(&w);
            continue;
        }
        do_append(&w, a, r, 20, EKV_DTYPE_F32); /* 2 pages, last holds 4 */
        do_append(&w, b, r, 50, EKV_DTYPE_F32); /* 4 pages, last holds 2 */
        CHECK(ekv_cache_free_pages(w.c) == 1, "[%s] free %lld", g_cfg,
              (long long)ekv_cache_free_pages(w.c));
        const int64_t row = 2 * 8;
        float *k = malloc(sizeof(float) * 200 * row), *v = malloc(sizeof(float) * 200 * row);
        for (int64_t i = 0; i < 200 * row; i++) {
            k[i] = (float)test_normal(r);
            v[i] = (float)test_normal(r);
        }
        /* needs 2 new pages (a: 20 + 29 = 49 tokens = 4 pages), 1 free: all or nothing */
        const int64_t tries[4] = {29, 45, 200, 1 + 12 + 16 + 16};
        for (int i = 0; i < 4; i++) {
            bytes before = snapshot(&w);
            ekv_status st = ekv_cache_append(w.c, a->id, tries[i], k, v, EKV_DTYPE_F32);
            CHECK(st == EKV_ERR_CACHE_FULL, "[%s] append %lld tokens with 1 free page: %s", g_cfg,
                  (long long)tries[i], ekv_status_string(st));
            CHECK(ekv_last_error(ctx)[0] != '\0', "[%s] cache full: no message", g_cfg);
            expect_unchanged(&w, &before, "failed append (cache full)");
            free(before.b);
        }
        /* exactly one new page: fits */
        do_append(&w, a, r, 28, EKV_DTYPE_F32); /* 48 tokens = 3 pages */
        CHECK(ekv_cache_free_pages(w.c) == 0, "[%s] free %lld", g_cfg,
              (long long)ekv_cache_free_pages(w.c));
        /* no free page, but room in the last pages: fits */
        do_append(&w, b, r, 13, EKV_DTYPE_F32);
        do_append(&w, b, r, 1, EKV_DTYPE_F32); /* b = 64 tokens, full */
        /* now every page is full */
        for (int i = 0; i < 2; i++) {
            shadow *s = i ? b : a;
            bytes before = snapshot(&w);
            ekv_status st = ekv_cache_append(w.c, s->id, 1, k, v, EKV_DTYPE_F32);
            CHECK(st == EKV_ERR_CACHE_FULL, "[%s] decode step into a full pool: %s", g_cfg,
                  ekv_status_string(st));
            expect_unchanged(&w, &before, "failed decode step (cache full)");
            free(before.b);
        }
        /* a new, empty sequence cannot get a page either */
        shadow *c = world_new_seq(&w, 0, 0);
        if (c) {
            bytes before = snapshot(&w);
            ekv_status st = ekv_cache_append(w.c, c->id, 1, k, v, EKV_DTYPE_F32);
            CHECK(st == EKV_ERR_CACHE_FULL, "[%s] first token of a new seq into a full pool: %s",
                  g_cfg, ekv_status_string(st));
            expect_unchanged(&w, &before, "failed first append (cache full)");
            free(before.b);
        }
        check_all(&w);
        /* free b: its 4 pages make room again */
        free_seq(&w, b);
        if (c) do_append(&w, c, r, 64, EKV_DTYPE_F32);
        CHECK(ekv_cache_free_pages(w.c) == 0, "[%s] free %lld", g_cfg,
              (long long)ekv_cache_free_pages(w.c));
        check_all(&w);
        free(k);
        free(v);
        world_free(&w);
    }
    /* capacity from ekv_cache_pages_for is exactly enough */
    for (int ps = 1; ps <= 64; ps *= 4) {
        ekv_cache_params p = ekv_cache_default_params();
        p.page_size = ps;
        p.num_kv_heads = 1;
        p.head_dim = 8;
        p.dtype = EKV_DTYPE_F16;
        const int64_t T = 3 * ps + 1;
        p.num_pages = ekv_cache_pages_for(T, 3, ps);
        p.max_seqs = 3;
        snprintf(g_cfg, sizeof g_cfg, "pages_for capacity ps %d", ps);
        world w;
        if (!world_init(&w, ctx, &p)) {
            world_free(&w);
            continue;
        }
        for (int i = 0; i < 3; i++) {
            shadow *s = world_new_seq(&w, 0, 0);
            if (s) do_append(&w, s, r, T, EKV_DTYPE_F32);
        }
        CHECK(ekv_cache_free_pages(w.c) == 0, "[%s] free %lld", g_cfg,
              (long long)ekv_cache_free_pages(w.c));
        float *kv1 = calloc((size_t)ps * 8, sizeof(float));
        bytes before = snapshot(&w);
        /* the last page holds 1 token: ps more need a new page */
        ekv_status st = ekv_cache_append(w.c, w.sh[0].id, ps, kv1, kv1, EKV_DTYPE_F32);
        CHECK(st == EKV_ERR_CACHE_FULL, "[%s] over capacity: %s", g_cfg, ekv_status_string(st));
        expect_unchanged(&w, &before, "append over capacity");
        free(before.b);
        free(kv1);
        check_all(&w);
        world_free(&w);
    }
}

static void set_bad(void *buf, ekv_dtype dt, int64_t i, int kind) { /* 0 NaN, 1 +inf, 2 -inf */
    switch (dt) {
    case EKV_DTYPE_F16:
        ((uint16_t *)buf)[i] = kind == 0 ? 0x7e00u : kind == 1 ? 0x7c00u : 0xfc00u;
        break;
    case EKV_DTYPE_BF16:
        ((uint16_t *)buf)[i] = kind == 0 ? 0x7fc0u : kind == 1 ? 0x7f80u : 0xff80u;
        break;
    default: ((float *)buf)[i] = kind == 0 ? NAN : kind == 1 ? INFINITY : -INFINITY; break;
    }
}

static void test_nan_input(ekv_context *ctx, test_rng *r) {
    for (int dt = 0; dt < 3; dt++) {
        ekv_cache_params p = ekv_cache_default_params();
        p.page_size = 4;
        p.num_kv_heads = 2;
        p.head_dim = 8;
        p.dtype = (ekv_dtype)dt;
        p.num_pages = 16;
        p.max_seqs = 2;
        snprintf(g_cfg, sizeof g_cfg, "nan input %s", ekv_dtype_name(p.dtype));
        world w;
        if (!world_init(&w, ctx, &p)) {
            world_free(&w);
            continue;
        }
        shadow *s = world_new_seq(&w, 0, 0), *o = world_new_seq(&w, 1, 0);
        if (!s || !o) {
            world_free(&w);
            continue;
        }
        do_append(&w, s, r, 10, EKV_DTYPE_F32); /* last page holds 2 */
        do_append(&w, o, r, 5, EKV_DTYPE_F32);
        const int64_t n = 7, row = 16, N = n * row; /* crosses a page boundary */
        void *k = malloc((size_t)N * 4), *v = malloc((size_t)N * 4);
        double *ek = malloc(sizeof(double) * (size_t)N), *ev = malloc(sizeof(double) * (size_t)N);
        for (int src = 0; src < 3; src++)
            for (int which = 0; which < 2; which++)
                for (int kind = 0; kind < 3; kind++)
                    for (int at = 0; at < 3; at++) {
                        make_chunk(&w, r, 0, n, (ekv_dtype)src, k, v, ek, ev);
                        int64_t pos = at == 0 ? 0 : at == 1 ? test_range(r, 1, N - 2) : N - 1;
                        set_bad(which ? v : k, (ekv_dtype)src, pos, kind);
                        bytes before = snapshot(&w);
                        ekv_status st = ekv_cache_append(w.c, s->id, n, k, v, (ekv_dtype)src);
                        CHECK(st == EKV_ERR_NAN_INPUT, "[%s] %s %s at %lld (src %s): %s", g_cfg,
                              kind == 0   ? "NaN"
                              : kind == 1 ? "+inf"
                                          : "-inf",
                              which ? "v" : "k", (long long)pos, ekv_dtype_name((ekv_dtype)src),
                              ekv_status_string(st));
                        CHECK(ekv_last_error(ctx)[0] != '\0', "[%s] NaN input: no message", g_cfg);
                        expect_unchanged(&w, &before, "append with NaN/inf");
                        free(before.b);
                    }
        /* finite input that is not finite in the storage dtype (f16 > 65504, bf16 near FLT_MAX) */
        if (dt != EKV_DTYPE_F32) {
            const float big = dt == EKV_DTYPE_F16 ? 65520.0f : 3.4e38f;
            for (int which = 0; which < 2; which++) {
                make_chunk(&w, r, 0, n, EKV_DTYPE_F32, k, v, ek, ev);
                ((float *)(which ? v : k))[3 * row + 5] = which ? -big : big;
                bytes before = snapshot(&w);
                ekv_status st = ekv_cache_append(w.c, s->id, n, k, v, EKV_DTYPE_F32);
                CHECK(st == EKV_ERR_NAN_INPUT, "[%s] %s = %g overflows %s storage: %s", g_cfg,
                      which ? "v" : "k", (double)big, ekv_dtype_name(p.dtype),
                      ekv_status_string(st));
                expect_unchanged(&w, &before, "append overflowing the storage dtype");
                free(before.b);
            }
        }
        /* the largest finite values are accepted and stored exactly rounded */
        if (dt == EKV_DTYPE_F16) {
            float *kk = k, *vv = v;
            make_chunk(&w, r, 0, 1, EKV_DTYPE_F32, k, v, ek, ev);
            kk[0] = 65504.0f;
            kk[1] = -65519.0f; /* rounds to -65504 */
            vv[2] = 65519.0f;
            ekv_status st = ekv_cache_append(w.c, o->id, 1, k, v, EKV_DTYPE_F32);
            CHECK(st == EKV_OK, "[%s] append of f16-max values: %s", g_cfg, ekv_status_string(st));
            if (st == EKV_OK) {
                int64_t np = 0;
                int32_t lpl = 0;
                int32_t *pages = seq_pages(&w, o, &np, &lpl);
                if (pages) {
                    const int64_t off =
                            pages[np - 1] * w.kv.stride_page + (lpl - 1) * w.kv.stride_token;
                    CHECK(load(w.kv.k, w.kv.dtype, off) == 65504.0 &&
                                  load(w.kv.k, w.kv.dtype, off + 1) == -65504.0 &&
                                  load(w.kv.v, w.kv.dtype, off + 2) == 65504.0,
                          "[%s] f16 max values stored wrong", g_cfg);
                    free(pages);
                }
                /* keep the shadow in sync */
                o->k = realloc(o->k, sizeof(double) * (size_t)((o->len + 1) * row));
                o->v = realloc(o->v, sizeof(double) * (size_t)((o->len + 1) * row));
                o->cap = o->len + 1;
                for (int64_t i = 0; i < row; i++) {
                    o->k[o->len * row + i] = round_f16(kk[i]);
                    o->v[o->len * row + i] = round_f16(vv[i]);
                }
                o->len++;
            }
        }
        /* the cache still works */
        do_append(&w, s, r, 7, EKV_DTYPE_F32);
        check_all(&w);
        free(k);
        free(v);
        free(ek);
        free(ev);
        world_free(&w);
    }
}

/* Largest finite values of each storage dtype are accepted (rounded to the dtype's max);
 * the first value that rounds to inf is rejected. */
static void test_storage_limits(ekv_context *ctx) {
    for (int dt = 0; dt < 3; dt++) {
        ekv_cache_params p = ekv_cache_default_params();
        p.page_size = 4;
        p.num_kv_heads = 1;
        p.head_dim = 8;
        p.dtype = (ekv_dtype)dt;
        p.num_pages = 4;
        p.max_seqs = 1;
        snprintf(g_cfg, sizeof g_cfg, "storage limits %s", ekv_dtype_name(p.dtype));
        ekv_cache *c = NULL;
        int32_t id = -1;
        if (ekv_cache_create(ctx, &p, &c) != EKV_OK || ekv_cache_seq_new(c, &id) != EKV_OK) {
            CHECK(0, "[%s] setup failed", g_cfg);
            ekv_cache_free(c);
            continue;
        }
        const float lim = dt == EKV_DTYPE_F16    ? 65520.0f
                          : dt == EKV_DTYPE_BF16 ? 0x1.ffp127f
                                                 : INFINITY;
        const float below = dt == EKV_DTYPE_F32 ? FLT_MAX : nextafterf(lim, 0.f);
        float k[8] = {below, -below, 1, 2, 3, 4, 5, 6}, v[8] = {1, 2, below, 4, -below, 6, 7, 8};
        ekv_status st = ekv_cache_append(c, id, 1, k, v, EKV_DTYPE_F32);
        CHECK(st == EKV_OK, "[%s] append of %.9g: %s (%s)", g_cfg, (double)below,
              ekv_status_string(st), ekv_last_error(ctx));
        ekv_paged_kv kv;
        ekv_cache_kv_view(c, &kv, NULL);
        const double mx = round_to(p.dtype, below);
        CHECK(isfinite(mx) && load(kv.k, kv.dtype, 0) == mx && load(kv.k, kv.dtype, 1) == -mx &&
                      load(kv.v, kv.dtype, 2) == mx && load(kv.v, kv.dtype, 4) == -mx,
              "[%s] largest values stored as %g %g %g %g, want +-%g", g_cfg,
              load(kv.k, kv.dtype, 0), load(kv.k, kv.dtype, 1), load(kv.v, kv.dtype, 2),
              load(kv.v, kv.dtype, 4), mx);
        if (dt != EKV_DTYPE_F32) {
            for (int i = 0; i < 4; i++) {
                float k2[8] = {1, 2, 3, 4, 5, 6, 7, 8}, v2[8] = {1, 2, 3, 4, 5, 6, 7, 8};
                (i & 1 ? v2 : k2)[3 + i] = i & 2 ? -lim : lim;
                st = ekv_cache_append(c, id, 1, k2, v2, EKV_DTYPE_F32);
                CHECK(st == EKV_ERR_NAN_INPUT, "[%s] %s = %.9g (rounds to inf): %s", g_cfg,
                      i & 1 ? "v" : "k", (double)(i & 2 ? -lim : lim), ekv_status_string(st));
            }
        }
        if (dt == EKV_DTYPE_F16) { /* bf16 source: 65280 fits, 65536 does not */
            uint16_t k3[8], v3[8];
            for (int i = 0; i < 8; i++) k3[i] = v3[i] = 0x3f80u; /* 1.0 */
            k3[5] = 0x477fu;                                     /* 65280 */
            st = ekv_cache_append(c, id, 1, k3, v3, EKV_DTYPE_BF16);
            CHECK(st == EKV_OK, "[%s] bf16 65280: %s", g_cfg, ekv_status_string(st));
            v3[6] = 0xc780u; /* -65536 */
            st = ekv_cache_append(c, id, 1, k3, v3, EKV_DTYPE_BF16);
            CHECK(st == EKV_ERR_NAN_INPUT, "[%s] bf16 -65536 into f16: %s", g_cfg,
                  ekv_status_string(st));
        }
        int64_t len = -1;
        CHECK(ekv_cache_seq_length(c, id, &len) == EKV_OK && len == (dt == EKV_DTYPE_F16 ? 2 : 1),
              "[%s] length %lld after rejected appends", g_cfg, (long long)len);
        ekv_cache_free(c);
    }
}

/* ---------------------------------------------------------------------------------- */
/* 5. Size helpers                                                                     */
/* ---------------------------------------------------------------------------------- */
static void test_sizes(test_rng *r) {
    snprintf(g_cfg, sizeof g_cfg, "sizes");
    CHECK(ekv_cache_pages_for(0, 3, 16) == 0, "pages_for(0)");
    CHECK(ekv_cache_pages_for(1, 1, 16) == 1, "pages_for(1)");
    CHECK(ekv_cache_pages_for(16, 1, 16) == 1, "pages_for(16)");
    CHECK(ekv_cache_pages_for(17, 1, 16) == 2, "pages_for(17)");
    CHECK(ekv_cache_pages_for(17, 3, 16) == 6, "pages_for(17, 3)");
    CHECK(ekv_cache_pages_for(1 << 20, 1, 16) == 65536, "pages_for(1M)");
    CHECK(ekv_cache_pages_for(5, 0, 16) == 0, "pages_for(seqs 0)");
    for (int i = 0; i < 2000; i++) {
        int64_t t = test_range(r, 0, 1 << 24), s = test_range(r, 0, 64);
        int32_t ps = (int32_t)test_range(r, 1, 256);
        int64_t got = ekv_cache_pages_for(t, s, ps), want = s * ((t + ps - 1) / ps);
        CHECK(got == want, "pages_for(%lld, %lld, %d) = %lld, want %lld", (long long)t,
              (long long)s, ps, (long long)got, (long long)want);
    }
    CHECK(ekv_cache_pages_for(-1, 1, 16) < 0, "pages_for(negative tokens)");
    CHECK(ekv_cache_pages_for(1, -1, 16) < 0, "pages_for(negative seqs)");
    CHECK(ekv_cache_pages_for(1, 1, 0) < 0, "pages_for(page size 0)");
    CHECK(ekv_cache_pages_for(INT64_MAX, 2, 1) < 0, "pages_for overflow returned %lld",
          (long long)ekv_cache_pages_for(INT64_MAX, 2, 1));
    CHECK(ekv_cache_pages_for(INT64_MAX, 1, 1) == INT64_MAX, "pages_for(INT64_MAX, 1, 1)");

    for (int i = 0; i < 200; i++) {
        ekv_cache_params p = ekv_cache_default_params();
        p.page_size = (int32_t)test_range(r, 1, 256);
        p.num_kv_heads = (int32_t)test_range(r, 1, 64);
        p.head_dim = (int32_t)test_range(r, 1, 256);
        p.dtype = (ekv_dtype)test_range(r, 0, 2);
        p.num_pages = test_range(r, 1, 100000);
        const int64_t epp = (int64_t)p.page_size * p.num_kv_heads * p.head_dim;
        /* superpage summaries: two fp32 arrays per (superpage, head, dim), ceil(pages / S) of them
         */
        {
            ekv_cache_params s0 = p;
            s0.superpage_pages = 0;
            const int64_t nsp = (p.num_pages + p.superpage_pages - 1) / p.superpage_pages;
            CHECK(ekv_cache_bytes_needed(&p) - ekv_cache_bytes_needed(&s0) ==
                          nsp * p.num_kv_heads * p.head_dim * 8,
                  "superpage bytes are not 2 floats per (superpage, head, dim)");
            p.superpage_pages = 0; /* the exact size relations below are for the flat pool */
        }
        const int64_t b1 = ekv_cache_bytes_needed(&p);
        /* at least K + V + the four [page][head][dim] fp32 summary arrays + radius */
        const int64_t lower = 2 * p.num_pages * epp * ekv_dtype_size(p.dtype) +
                              p.num_pages * p.num_kv_heads * ((int64_t)p.head_dim * 16 + 4);
        CHECK(b1 >= lower, "bytes_needed %lld < lower bound %lld", (long long)b1, (long long)lower);
        CHECK(b1 <= 2 * lower + (1 << 20), "bytes_needed %lld far above %lld", (long long)b1,
              (long long)lower);
        /* affine in num_pages, exact difference between storage dtypes */
        ekv_cache_params q = p;
        q.num_pages = 2 * p.num_pages;
        ekv_cache_params q3 = p;
        q3.num_pages = 3 * p.num_pages;
        const int64_t b2 = ekv_cache_bytes_needed(&q), b3 = ekv_cache_bytes_needed(&q3);
        CHECK(b3 - b2 == b2 - b1 && b2 > b1, "bytes_needed not affine in num_pages: %lld %lld %lld",
              (long long)b1, (long long)b2, (long long)b3);
        ekv_cache_params f32 = p, f16 = p;
        f32.dtype = EKV_DTYPE_F32;
        f16.dtype = EKV_DTYPE_F16;
        ekv_cache_params bf = p;
        bf.dtype = EKV_DTYPE_BF16;
        CHECK(ekv_cache_bytes_needed(&f32) - ekv_cache_bytes_needed(&f16) ==
                      2 * p.num_pages * epp * 2,
              "f32 - f16 bytes != K/V size difference");
        CHECK(ekv_cache_bytes_needed(&bf) == ekv_cache_bytes_needed(&f16),
              "bf16 and f16 sizes differ");
    }
    ekv_cache_params p = ekv_cache_default_params();
    CHECK(ekv_cache_bytes_needed(&p) < 0, "bytes_needed with num_pages 0 = %lld",
          (long long)ekv_cache_bytes_needed(&p));
    CHECK(ekv_cache_bytes_needed(NULL) < 0, "bytes_needed(NULL)");
    p.num_pages = 10;
    CHECK(ekv_cache_bytes_needed(&p) > 0, "bytes_needed of defaults with 10 pages");
    ekv_cache_params bad = p;
    bad.page_size = 0;
    CHECK(ekv_cache_bytes_needed(&bad) < 0, "bytes_needed page_size 0");
    bad.page_size = 257;
    CHECK(ekv_cache_bytes_needed(&bad) < 0, "bytes_needed page_size 257");
    bad = p;
    bad.dtype = (ekv_dtype)7;
    CHECK(ekv_cache_bytes_needed(&bad) < 0, "bytes_needed dtype 7");
    bad = p;
    bad.head_dim = 0;
    CHECK(ekv_cache_bytes_needed(&bad) < 0, "bytes_needed head_dim 0");
    bad = p;
    bad.num_kv_heads = -1;
    CHECK(ekv_cache_bytes_needed(&bad) < 0, "bytes_needed num_kv_heads -1");
    bad = p;
    bad.num_pages = INT64_MAX;
    CHECK(ekv_cache_bytes_needed(&bad) < 0, "bytes_needed INT64_MAX pages");
    /* the 1M-token fp16 cache of test_large_cache: K+V alone are 16 GiB */
    ekv_cache_params big = p;
    big.page_size = 16;
    big.num_kv_heads = 32;
    big.head_dim = 128;
    big.dtype = EKV_DTYPE_F16;
    big.num_pages = 65536;
    CHECK(ekv_cache_bytes_needed(&big) >= (int64_t)16 << 30, "bytes_needed(1M tokens) = %lld",
          (long long)ekv_cache_bytes_needed(&big));
}

/* ---------------------------------------------------------------------------------- */
/* Truncation (ekv_cache_truncate)                                                     */
/* ---------------------------------------------------------------------------------- */
/* Appends the shadow's own next n tokens again (its stored values, as f32: exact), as a
 * truncated sequence's continuation that must rebuild what the first appends built. */
static void reappend(world *w, shadow *s, int64_t n) {
    const int64_t row = (int64_t)w->p.num_kv_heads * w->p.head_dim;
    float *k = malloc(sizeof(float) * (size_t)(n * row)),
          *v = malloc(sizeof(float) * (size_t)(n * row));
    for (int64_t i = 0; i < n * row; i++) {
        k[i] = (float)s->k[s->len * row + i];
        v[i] = (float)s->v[s->len * row + i];
    }
    ekv_status st = ekv_cache_append(w->c, s->id, n, k, v, EKV_DTYPE_F32);
    CHECK(st == EKV_OK, "[%s] re-append %lld tokens at %lld: %s", g_cfg, (long long)n,
          (long long)s->len, ekv_last_error(w->ctx));
    if (!st) s->len += n;
    free(k);
    free(v);
}

static void truncate_to(world *w, shadow *s, int64_t n) {
    ekv_status st = ekv_cache_truncate(w->c, s->id, n);
    CHECK(st == EKV_OK, "[%s] truncate seq %d from %lld to %lld: %s", g_cfg, s->id,
          (long long)s->len, (long long)n, ekv_last_error(w->ctx));
    if (!st) s->len = n;
    check_all(w); /* kept pages against their keys, freed pages' counts, the page table */
}

static int same_bytes(const bytes *a, const bytes *b) {
    return a->n == b->n && memcmp(a->b, b->b, a->n) == 0;
}

/* A sequence (large keys, so a stale min/max or box would show) between another's pages:
 * truncated mid-page, at a page boundary, to 0 and to its own length, the cache equals bit
 * for bit (keys, values, summaries, compact ranges and ball, live key codes, superpage
 * boxes, page ids, free count) what it was when the sequence first had that length, and
 * re-appending the same tokens gives back the later states; the refusals change nothing. */
static void test_truncate(ekv_context *ctx, test_rng *r) {
    for (int cfg = 0; cfg < 6; cfg++) {
        ekv_cache_params p = ekv_cache_default_params();
        p.page_size = 8;
        p.num_kv_heads = 2;
        p.head_dim = 20;
        p.dtype = (ekv_dtype)(cfg % 3);
        p.range_dtype = cfg < 3 ? EKV_DTYPE_F32 : ekv_cache_compact_ranges(p.dtype);
        p.code_bits = cfg < 3 ? 0 : (cfg == 3 ? 8 : 4);
        p.superpage_pages = 2;
        p.num_pages = 16;
        p.max_seqs = 3;
        snprintf(g_cfg, sizeof g_cfg, "truncate %s ranges %s codes %d", ekv_dtype_name(p.dtype),
                 ekv_dtype_name(p.range_dtype), p.code_bits);
        world w;
        shadow *a = world_init(&w, ctx, &p) ? world_new_seq(&w, 4, 0) : NULL;
        shadow *b = a ? world_new_seq(&w, 1, 0) : NULL;
        if (!b) {
            world_free(&w);
            continue;
        }
        do_append(&w, a, r, 13, EKV_DTYPE_F32); /* pages 0, 1 */
        do_append(&w, b, r, 9, EKV_DTYPE_F32);  /* pages 2, 3: b's pages share a superpage */
        do_append(&w, a, r, 19, EKV_DTYPE_F32); /* 32: pages 1, 4, 5 */
        bytes at32 = snapshot(&w);
        do_append(&w, a, r, 5, EKV_DTYPE_F32); /* 37: page 6 holds 5 */
        bytes at37 = snapshot(&w);
        do_append(&w, a, r, 1, EKV_DTYPE_F32);
        do_append(&w, a, r, 10, EKV_DTYPE_F32); /* 48 */
        bytes at48 = snapshot(&w);
        truncate_to(&w, a, 48); /* its own length: nothing changes */
        bytes now = snapshot(&w);
        CHECK(same_bytes(&now, &at48), "[%s] truncating to the length changed the cache", g_cfg);
        free(now.b);
        truncate_to(&w, a, 37); /* mid-page: page 6's summaries and codes from its 5 keys */
        now = snapshot(&w);
        CHECK(same_bytes(&now, &at37), "[%s] truncated to 37: differs from the cache at 37", g_cfg);
        free(now.b);
        reappend(&w, a, 11);
        now = snapshot(&w);
        CHECK(same_bytes(&now, &at48), "[%s] 37 + 11 re-appended: differs from the cache at 48",
              g_cfg);
        free(now.b);
        truncate_to(&w, a, 32); /* a page boundary */
        now = snapshot(&w);
        CHECK(same_bytes(&now, &at32), "[%s] truncated to 32: differs from the cache at 32", g_cfg);
        free(now.b);
        bytes before = snapshot(&w);
        CHECK(ekv_cache_truncate(w.c, a->id, 33) == EKV_ERR_INVALID_SIZE &&
                      ekv_cache_truncate(w.c, a->id, -1) == EKV_ERR_INVALID_SIZE,
              "[%s] truncation past the length or below 0 accepted", g_cfg);
        CHECK(ekv_cache_truncate(w.c, 7, 0) == EKV_ERR_INVALID_SEQUENCE &&
                      ekv_cache_truncate(NULL, 0, 0) == EKV_ERR_NULL_POINTER,
              "[%s] truncation of a bad sequence accepted", g_cfg);
        expect_unchanged(&w, &before, "a refused truncation");
        free(before.b);
        truncate_to(&w, a, 0); /* every page back, the superpage boxes without them */
        reappend(&w, a, 37);
        now = snapshot(&w);
        CHECK(same_bytes(&now, &at37), "[%s] 0 + 37 re-appended: differs from the cache at 37",
              g_cfg);
        free(now.b);
        truncate_to(&w, b, 3); /* the other sequence, mid-page, beside a */
        do_append(&w, b, r, 20, EKV_DTYPE_F32);
        check_all(&w);
        free(at32.b);
        free(at37.b);
        free(at48.b);
        world_free(&w);
    }
}

/* ekv_cache_seq_adopt: a cache over a copy of `filled`'s pool (params q) adopts its sequence's
 * pages (np pages, the last holding `last`): the statistics and key codes of those pages equal
 * the appending cache's bit for bit, and so do the decode outputs (`want`, dense); then the
 * refusals, each leaving the cache as it was. */
static void adopt_check(ekv_context *ctx, const ekv_cache_params *q, ekv_cache *filled,
                        const int32_t *pages, int64_t np, int32_t last, const ekv_page_table *tab,
                        const float *qv, const float *want, test_rng *r) {
    const int64_t D = q->head_dim, HK = q->num_kv_heads, PS = q->page_size,
                  R = D * q->code_bits / 8;
    const size_t pool = (size_t)q->num_pages * PS * HK * D * ekv_dtype_size(q->dtype);
    ekv_paged_kv fk;
    ekv_page_stats fs;
    ekv_cache_kv_view(filled, &fk, &fs);
    ekv_cache_params p2 = *q;
    p2.k_pool = aligned_alloc(64, pool);
    p2.v_pool = aligned_alloc(64, pool);
    memcpy(p2.k_pool, fk.k, pool);
    memcpy(p2.v_pool, fk.v, pool);
    ekv_cache *c = NULL;
    CHECK(ekv_cache_create(ctx, &p2, &c) == EKV_OK, "adopting cache: %s", ekv_last_error(ctx));
    int32_t s, s2;
    ekv_cache_seq_new(c, &s);
    ekv_cache_seq_new(c, &s2);
    CHECK(ekv_cache_seq_adopt(c, s, pages, np, last) == EKV_OK, "adopt: %s", ekv_last_error(ctx));
    int64_t len = 0;
    ekv_cache_seq_length(c, s, &len);
    CHECK(len == (np - 1) * PS + last && ekv_cache_free_pages(c) == q->num_pages - np,
          "adopted length %lld, free pages %lld", (long long)len,
          (long long)ekv_cache_free_pages(c));
    ekv_paged_kv ak;
    ekv_page_stats as;
    ekv_cache_kv_view(c, &ak, &as);
    int64_t bad = 0;
    for (int64_t e = 0; e < np; e++)
        for (int64_t h = 0; h < HK; h++) {
            const size_t so = (size_t)(pages[e] * HK + h) * D;
            bad += memcmp(as.kmin + so, fs.kmin + so, D * 4) ||
                   memcmp(as.kmax + so, fs.kmax + so, D * 4) ||
                   memcmp(as.kmean + so, fs.kmean + so, D * 4) ||
                   memcmp(as.km2 + so, fs.km2 + so, D * 4) ||
                   memcmp(as.kmin16 + so, fs.kmin16 + so, D * 2) ||
                   memcmp(as.kmean16 + so, fs.kmean16 + so, D * 2) ||
                   as.radius16[pages[e] * HK + h] != fs.radius16[pages[e] * HK + h] ||
                   as.radius[pages[e] * HK + h] != fs.radius[pages[e] * HK + h] ||
                   memcmp(as.codes + (pages[e] * HK + h) * PS * R,
                          fs.codes + (pages[e] * HK + h) * PS * R, (size_t)(PS * R));
        }
    CHECK(!bad, "%lld adopted (page, head) summaries differ from the appending cache's",
          (long long)bad);
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = 4;
    ekv_select_params sp = ekv_select_default_params();
    sp.method = EKV_SELECT_SCREENED;
    float got[4 * 64];
    CHECK(ekv_decode(ctx, &dp, &sp, &ak, &as, tab, qv, got, NULL) == EKV_OK &&
                  !memcmp(got, want, sizeof(float) * 4 * D),
          "decode over the adopted pages differs: %s", ekv_last_error(ctx));
    /* refusals: nothing changes */
    const int64_t nfree = ekv_cache_free_pages(c);
    CHECK(ekv_cache_seq_adopt(c, s2, pages, 1, PS) == EKV_ERR_INVALID_ARGUMENT &&
                  strstr(ekv_last_error(ctx), "another sequence"),
          "a held page adopted: %s", ekv_last_error(ctx));
    int32_t free2[2];
    for (int32_t pg = 0, k = 0; pg < q->num_pages && k < 2; pg++) {
        int held = 0;
        for (int64_t e = 0; e < np; e++) held |= pages[e] == pg;
        if (!held) free2[k++] = pg;
    }
    const int32_t twice[2] = {free2[0], free2[0]};
    CHECK(ekv_cache_seq_adopt(c, s2, twice, 2, 1) == EKV_ERR_INVALID_ARGUMENT &&
                  strstr(ekv_last_error(ctx), "twice"),
          "a page listed twice: %s", ekv_last_error(ctx));
    CHECK(ekv_cache_seq_adopt(c, s2, free2, 2, (int32_t)PS + 1) == EKV_ERR_INVALID_SIZE,
          "last_page_len above the page size");
    CHECK(ekv_cache_seq_adopt(c, s, free2, 1, 1) == EKV_ERR_INVALID_SEQUENCE,
          "a non-empty sequence adopted");
    const uint16_t nan16 = 0x7e00; /* f16 NaN in free page free2[1]'s first K element */
    memcpy((char *)p2.k_pool + (size_t)free2[1] * PS * HK * D * 2, &nan16, 2);
    CHECK(ekv_cache_seq_adopt(c, s2, free2 + 1, 1, 1) == EKV_ERR_NAN_INPUT,
          "a NaN page adopted: %s", ekv_last_error(ctx));
    CHECK(ekv_cache_free_pages(c) == nfree, "a refused adopt changed the free pages");
    (void)r;
    ekv_cache_free(c);
    free(p2.k_pool);
    free(p2.v_pool);
}

/* The NHD layout in the caller's memory (ekv_cache_params.layout, k_pool/v_pool): the same
 * appends as an HND cache of its own put every K and V element at [page][slot][head][dim] of
 * the caller's buffers, and give bitwise the same statistics, key codes and decode outputs
 * (dense, certified, screened); freeing the cache leaves the caller's memory alone (ASan would
 * see a free of it); the refusals. */
static void test_nhd_caller_pool(ekv_context *ctx, test_rng *r) {
    enum { NP = 40, PS = 16, HK = 2, D = 24, H = 4, N = 300 };
    ekv_cache_params p = test_cache_params(PS, HK, D, EKV_DTYPE_F16,
                                           ekv_cache_default_params().max_seqs, NP);
    p.superpage_pages = 4;
    p.code_bits = 4;
    p.range_dtype = EKV_DTYPE_F16;
    const size_t pool = (size_t)NP * PS * HK * D * 2;
    uint16_t *kb = aligned_alloc(64, pool), *vb = aligned_alloc(64, pool);
    memset(kb, 0, pool);
    memset(vb, 0, pool);
    ekv_cache *hnd = NULL, *nhd = NULL;
    CHECK(ekv_cache_create(ctx, &p, &hnd) == EKV_OK, "hnd: %s", ekv_last_error(ctx));
    ekv_cache_params q = p;
    q.layout = EKV_LAYOUT_NHD;
    q.k_pool = kb;
    q.v_pool = vb;
    CHECK(ekv_cache_bytes_needed(&q) == ekv_cache_bytes_needed(&p) - 2 * (int64_t)pool,
          "the caller's pools are not the cache's bytes");
    CHECK(ekv_cache_create(ctx, &q, &nhd) == EKV_OK, "nhd: %s", ekv_last_error(ctx));
    if (!hnd || !nhd) return;
    float *k = malloc(sizeof(float) * N * HK * D), *v = malloc(sizeof(float) * N * HK * D);
    for (int i = 0; i < N * HK * D; i++) k[i] = (float)test_normal(r), v[i] = (float)test_normal(r);
    int32_t s1, s2;
    ekv_cache_seq_new(hnd, &s1);
    ekv_cache_seq_new(nhd, &s2);
    for (int64_t t0 = 0; t0 < N; t0 += 37) { /* chunks that straddle pages */
        const int64_t n = N - t0 < 37 ? N - t0 : 37;
        CHECK(ekv_cache_append(hnd, s1, n, k + t0 * HK * D, v + t0 * HK * D, EKV_DTYPE_F32) ==
                              EKV_OK &&
                      ekv_cache_append(nhd, s2, n, k + t0 * HK * D, v + t0 * HK * D,
                                       EKV_DTYPE_F32) == EKV_OK,
              "append: %s", ekv_last_error(ctx));
    }
    ekv_paged_kv a, b;
    ekv_page_stats sa, sb;
    ekv_cache_kv_view(hnd, &a, &sa);
    ekv_cache_kv_view(nhd, &b, &sb);
    CHECK(b.k == kb && b.stride_token == HK * D && b.stride_head == D &&
                  b.stride_page == PS * HK * D,
          "NHD view: strides %lld %lld %lld", (long long)b.stride_token, (long long)b.stride_head,
          (long long)b.stride_page);
    int64_t ip[2], ip2[2];
    int32_t idx[NP], idx2[NP], lpl[1], lpl2[1];
    ekv_cache_page_table(hnd, &s1, 1, ip, idx, NP, lpl, NULL);
    ekv_cache_page_table(nhd, &s2, 1, ip2, idx2, NP, lpl2, NULL);
    const ekv_page_table tab = {1, ip, idx, lpl}, tab2 = {1, ip2, idx2, lpl2};
    CHECK(ip[1] == ip2[1] && !memcmp(idx, idx2, sizeof(int32_t) * ip[1]),
          "the two caches placed the sequence on different pages");
    int64_t bad = 0, stat_bad = 0;
    const int64_t R = D * 4 / 8; /* code bytes per token row */
    for (int64_t e = 0; e < ip[1]; e++) {
        const int64_t pg = idx[e], ntok = e + 1 == ip[1] ? lpl[0] : PS;
        for (int h = 0; h < HK; h++) {
            for (int t = 0; t < ntok; t++)
                for (int d = 0; d < D; d++) {
                    const int64_t ia = pg * a.stride_page + h * a.stride_head + t * a.stride_token +
                                       d,
                                  ib = ((pg * PS + t) * HK + h) * D + d;
                    bad += ((const uint16_t *)a.k)[ia] != kb[ib] ||
                           ((const uint16_t *)a.v)[ia] != vb[ib];
                }
            const size_t so = (size_t)(pg * HK + h) * D;
            stat_bad += memcmp(sa.kmin + so, sb.kmin + so, D * 4) ||
                        memcmp(sa.kmax + so, sb.kmax + so, D * 4) ||
                        memcmp(sa.kmean + so, sb.kmean + so, D * 4) ||
                        memcmp(sa.km2 + so, sb.km2 + so, D * 4) ||
                        memcmp(sa.kmin16 + so, sb.kmin16 + so, D * 2) ||
                        memcmp(sa.kmean16 + so, sb.kmean16 + so, D * 2) ||
                        sa.radius16[pg * HK + h] != sb.radius16[pg * HK + h] ||
                        sa.radius[pg * HK + h] != sb.radius[pg * HK + h] ||
                        memcmp(sa.codes + (pg * HK + h) * PS * R, sb.codes + (pg * HK + h) * PS * R,
                               (size_t)(PS * R));
        }
    }
    CHECK(!bad, "%lld K/V elements differ between the HND pool and the caller's NHD buffers",
          (long long)bad);
    CHECK(!stat_bad, "%lld (page, head) statistics or key codes differ between NHD and HND",
          (long long)stat_bad);
    float qv[H * D], oa[H * D], ob[H * D];
    for (int i = 0; i < H * D; i++) qv[i] = (float)test_normal(r);
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = H;
    const ekv_select_method methods[3] = {EKV_SELECT_DENSE, EKV_SELECT_CERTIFIED,
                                          EKV_SELECT_SCREENED};
    for (int m = 0; m < 3; m++) {
        ekv_select_params sp = ekv_select_default_params();
        sp.method = methods[m];
        sp.budget_tokens = 64;
        CHECK(ekv_decode(ctx, &dp, &sp, &a, &sa, &tab, qv, oa, NULL) == EKV_OK &&
                      ekv_decode(ctx, &dp, &sp, &b, &sb, &tab2, qv, ob, NULL) == EKV_OK,
              "decode %s: %s", ekv_method_name(methods[m]), ekv_last_error(ctx));
        CHECK(!memcmp(oa, ob, sizeof oa), "%s: NHD output differs from HND",
              ekv_method_name(methods[m]));
    }
    adopt_check(ctx, &q, nhd, idx2, ip2[1], lpl2[0], &tab2, qv, ob, r);
    ekv_cache_free(hnd);
    ekv_cache_free(nhd);
    CHECK(kb[0] == kb[0], "the caller's pool outlives the cache"); /* ASan: no free of it */
    q.v_pool = NULL;
    ekv_cache *x = NULL;
    CHECK(ekv_cache_create(ctx, &q, &x) == EKV_ERR_NULL_POINTER && !x, "one pool accepted");
    q.v_pool = (char *)vb + 2;
    CHECK(ekv_cache_create(ctx, &q, &x) == EKV_ERR_INVALID_ARGUMENT && !x,
          "a misaligned pool accepted");
    q.v_pool = vb;
    q.layout = (ekv_kv_layout)2;
    CHECK(ekv_cache_create(ctx, &q, &x) == EKV_ERR_INVALID_ARGUMENT && !x &&
                  strstr(ekv_last_error(ctx), "layout"),
          "layout 2 accepted: %s", ekv_last_error(ctx));
    free(k);
    free(v);
    free(kb);
    free(vb);
}

/* ---------------------------------------------------------------------------------- */
/* Sequence versions (issue 32): what a plan keeping a page table checks               */
/* ---------------------------------------------------------------------------------- */
static uint64_t version_of(ekv_cache *c, int32_t seq) {
    uint64_t v = 0;
    ekv_status st = ekv_cache_seq_version(c, seq, &v);
    CHECK(st == EKV_OK && v != 0, "version of sequence %d: %s, %llu", seq, ekv_status_string(st),
          (unsigned long long)v);
    return v;
}

static void test_seq_versions(ekv_context *ctx) {
    enum { HK = 2, D = 8, PS = 4, N = 10 };
    ekv_cache_params p = ekv_cache_default_params();
    p.num_pages = 16;
    p.page_size = PS;
    p.num_kv_heads = HK;
    p.head_dim = D;
    p.dtype = EKV_DTYPE_F32;
    p.max_seqs = 4;
    static _Alignas(64) float kpool[16 * HK * PS * D], vpool[16 * HK * PS * D]; /* zeros */
    p.k_pool = kpool; /* adoption reads pages the caller filled */
    p.v_pool = vpool;
    ekv_cache *c = NULL;
    if (ekv_cache_create(ctx, &p, &c) != EKV_OK) {
        CHECK(0, "cache: %s", ekv_last_error(ctx));
        return;
    }
    float kv[N * HK * D];
    for (int i = 0; i < N * HK * D; i++) kv[i] = (float)(i % 9) * 0.5f - 2.0f;
    int32_t a, b, a2;
    CHECK(ekv_cache_seq_new(c, &a) == EKV_OK && ekv_cache_seq_new(c, &b) == EKV_OK, "sequences");
    const uint64_t v_new = version_of(c, a);
    CHECK(version_of(c, b) != v_new, "two new sequences share a version");
    CHECK(ekv_cache_append(c, a, N, kv, kv, EKV_DTYPE_F32) == EKV_OK, "append a");
    const uint64_t v_plan = version_of(c, a);
    CHECK(v_plan != v_new, "an append kept the version");
    /* the plan: a's page table and length, as a wrapper keeps them */
    int64_t ip[2], len = -1;
    int32_t idx[8], idx2[8], lpl, lpl2;
    CHECK(ekv_cache_page_table(c, &a, 1, ip, idx, 8, &lpl, NULL) == EKV_OK, "table");
    /* readers leave it alone */
    CHECK(ekv_cache_seq_length(c, a, &len) == EKV_OK && len == N && version_of(c, a) == v_plan,
          "a read changed the version");
    /* the repro: free a, reuse its id, append to another sequence (it takes a's old pages),
     * refill the id to the same length */
    CHECK(ekv_cache_seq_free(c, a) == EKV_OK, "free a");
    uint64_t gone = 7;
    CHECK(ekv_cache_seq_version(c, a, &gone) == EKV_ERR_INVALID_SEQUENCE && gone == 7,
          "a freed sequence has a version");
    CHECK(ekv_cache_seq_new(c, &a2) == EKV_OK && a2 == a, "the id is reused (%d, %d)", a2, a);
    CHECK(ekv_cache_append(c, b, N, kv, kv, EKV_DTYPE_F32) == EKV_OK, "append b");
    CHECK(ekv_cache_append(c, a2, N, kv, kv, EKV_DTYPE_F32) == EKV_OK, "append a again");
    CHECK(ekv_cache_seq_length(c, a2, &len) == EKV_OK && len == N, "same length");
    CHECK(ekv_cache_page_table(c, &a2, 1, ip, idx2, 8, &lpl2, NULL) == EKV_OK, "table again");
    CHECK(memcmp(idx, idx2, sizeof(int32_t) * (size_t)ip[1]) != 0,
          "the reused id holds the same pages: the repro does not reproduce");
    CHECK(version_of(c, a2) != v_plan, "a stale page table keeps its version");
    /* truncation and adoption give new versions too; a version is never handed out twice */
    uint64_t seen[6] = {v_new, v_plan, version_of(c, a2), version_of(c, b), 0, 0};
    CHECK(ekv_cache_truncate(c, a2, N - 1) == EKV_OK, "truncate");
    seen[4] = version_of(c, a2);
    int32_t d;
    const int32_t free_page = 15;
    CHECK(ekv_cache_seq_new(c, &d) == EKV_OK, "new d");
    const uint64_t v_d = version_of(c, d);
    CHECK(ekv_cache_seq_adopt(c, d, &free_page, 1, 1) == EKV_OK, "adopt: %s", ekv_last_error(ctx));
    seen[5] = version_of(c, d);
    CHECK(seen[5] != v_d, "an adoption kept the version");
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < i; j++)
            CHECK(seen[i] != seen[j], "versions %d and %d agree (%llu)", i, j,
                  (unsigned long long)seen[i]);
    CHECK(ekv_cache_seq_version(NULL, a2, &gone) == EKV_ERR_NULL_POINTER &&
                  ekv_cache_seq_version(c, a2, NULL) == EKV_ERR_NULL_POINTER,
          "NULL arguments");
    ekv_cache_free(c);
}

int main(void) {
    test_rng r = {0x9e3779b97f4a7c15ull};
    test_round_outward();
    ekv_context *ctx1 = NULL, *ctx3 = NULL;
    ekv_context_params cp = ekv_context_default_params();
    /* ctx1: one thread, scalar conversions; ctx3: three threads, the best SIMD conversions.
     * The random trials alternate, so both append paths meet the independent dtype model. */
    cp.n_threads = 1;
    cp.isa = EKV_ISA_SCALAR;
    if (ekv_context_create(&cp, &ctx1) != EKV_OK) {
        fprintf(stderr, "context_create failed\n");
        return 1;
    }
    cp.n_threads = 3;
    cp.isa = EKV_ISA_AUTO;
    if (ekv_context_create(&cp, &ctx3) != EKV_OK) {
        fprintf(stderr, "context_create failed\n");
        return 1;
    }

    /* the model of the storage dtypes itself */
    CHECK(round_f16(65519.0) == 65504.0 && isinf(round_f16(65520.0)) && round_f16(0x1p-25) == 0 &&
                  round_f16(0x1.8p-25) == 0x1p-24 && round_f16(1.0 + 0x1p-11) == 1.0 &&
                  round_f16(1.0 + 0x1.8p-11) == 1.0 + 0x1p-10,
          "f16 rounding model");
    CHECK(round_bf16(1.0 + 0x1p-8) == 1.0 && round_bf16(1.0 + 0x1.8p-8) == 1.0 + 0x1p-7 &&
                  isinf(round_bf16(3.4e38)),
          "bf16 rounding model");
    CHECK(dec_f16(enc_f16(-0x1p-24)) == -0x1p-24 && dec_f16(enc_f16(65504.0)) == 65504.0 &&
                  dec_f16(0x3c00) == 1.0,
          "f16 codec");

    test_sizes(&r);
    test_page_table(ctx1, &r);
    test_free_reuse(ctx3, &r);
    test_truncate(ctx3, &r);
    test_cache_full(ctx1, &r);
    test_nan_input(ctx3, &r);
    test_storage_limits(ctx1);
    test_seq_versions(ctx1);
    const int trials = 6 * 3 * 80;
    for (int t = 0; t < trials; t++) random_trial(t % 2 ? ctx3 : ctx1, &r, t);

    printf("worst errors / tolerance scale: mean %.3g, M2 %.3g, radius excess %.3g (tolerance 1e-5)\n",
           g_worst_mean, g_worst_m2, g_worst_radius);
    test_nhd_caller_pool(ctx3, &r);
    ekv_context_free(ctx1);
    ekv_context_free(ctx3);
    return test_finish("test_cache");
}
