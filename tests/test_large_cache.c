/*
 * The int64 requirement: a cache of 1,048,576 tokens x 32 KV heads x 128 dims in fp16
 * (page 16) has 2^32 elements in each of K and V (8 GiB each), so element offsets pass
 * 2^31 and byte offsets pass 2^32. Where memory allows, the test builds it, appends all
 * tokens, reads the last tokens back, checks page summaries near the end, and runs dense
 * 1.5-entmax decode over the whole sequence against an independent computation in double.
 * It also checks that impossible pools fail cleanly (size overflow, out of memory).
 *
 * Exit 77 (skipped) under sanitizers or when MemAvailable < bytes needed + 2 GiB.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>
#include <sys/resource.h>
#include <time.h>

enum { NTOK = 1 << 20, HK = 32, DIM = 128, PS = 16, CHUNK = 4096, NH = 32 };
#define POOL_N (1 << 20) /* random values; rows are windows of it */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- independent fp16 model ---- */
static double round_f16(double x) {
    if (x == 0 || !isfinite(x)) return x;
    int e;
    (void)frexp(x, &e);
    int ue = e - 11;
    if (ue < -24) ue = -24;
    double q = ldexp(rint(ldexp(x, -ue)), ue);
    if (fabs(q) > 65504.0) q = copysign(INFINITY, x);
    return q;
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

static int64_t mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    long long kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) break;
    fclose(f);
    return kb < 0 ? -1 : (int64_t)kb * 1024;
}

/* ---- data: every row is a window of a random pool at a hashed offset ---- */
static float *g_pool;
static float g_q[NH * DIM];
static const int64_t g_needles[4] = {5, (1 << 19) + 1, NTOK - 40, NTOK - 1};
static const double g_needle_s[4] = {3.0, 2.9, 3.1, 2.95}; /* target scores scale*<q,k> */

static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static int needle_index(int64_t t, int64_t h) {
    if (h != 0 && h != HK - 1) return -1;
    for (int i = 0; i < 4; i++)
        if (g_needles[i] == t) return i;
    return -1;
}

/* K and V rows (fp32, before rounding to fp16) of token t, KV head h. */
static void make_row(int64_t t, int64_t h, float *k, float *v) {
    uint64_t a = mix((uint64_t)t * HK + (uint64_t)h), b = mix(a ^ 0x5bd1e995ull);
    memcpy(k, g_pool + a % (POOL_N - DIM), sizeof(float) * DIM);
    memcpy(v, g_pool + b % (POOL_N - DIM), sizeof(float) * DIM);
    int ni = needle_index(t, h);
    if (ni >= 0) {
        /* key along q_h (query head h uses KV head h: 32 query heads over 32 KV heads) */
        const float *q = g_q + h * DIM;
        double qq = 0;
        for (int d = 0; d < DIM; d++) qq += (double)q[d] * q[d];
        double c = g_needle_s[ni] * sqrt((double)DIM) / qq;
        for (int d = 0; d < DIM; d++) {
            k[d] = (float)(c * q[d]);
            v[d] = (float)(((d + ni) % 3 == 0 ? 0.9 : -0.6) + 0.05 * ni);
        }
    }
}

/* Element offset of (token, head, dim) through the view. */
static int64_t elem_off(const ekv_paged_kv *kv, const int32_t *pages, int64_t t, int64_t h,
                        int64_t d) {
    return (int64_t)pages[t / kv->page_size] * kv->stride_page + h * kv->stride_head +
           (t % kv->page_size) * kv->stride_token + d;
}

static double kval(const ekv_paged_kv *kv, int64_t off) {
    return dec_f16(((const uint16_t *)kv->k)[off]);
}
static double vval(const ekv_paged_kv *kv, int64_t off) {
    return dec_f16(((const uint16_t *)kv->v)[off]);
}

/* Fails cleanly: overflow and out-of-memory pools. */
static void test_impossible_pools(ekv_context *ctx) {
    ekv_cache_params p = ekv_cache_default_params();
    p.page_size = 256;
    p.num_kv_heads = 4096;
    p.head_dim = 65536;
    p.dtype = EKV_DTYPE_F32;
    p.max_seqs = 1;
    const int64_t pages[3] = {INT32_MAX, (int64_t)1 << 40, INT64_MAX};
    for (int i = 0; i < 3; i++) {
        p.num_pages = pages[i];
        ekv_cache *c = (ekv_cache *)&p; /* sentinel: must stay untouched */
        ekv_status st = ekv_cache_create(ctx, &p, &c);
        CHECK(st == EKV_ERR_SIZE_OVERFLOW, "num_pages %lld x 2^36 elements: %s, want SIZE_OVERFLOW",
              (long long)pages[i], ekv_status_string(st));
        CHECK(c == (ekv_cache *)&p, "out written on error");
        CHECK(ekv_last_error(ctx)[0] != '\0', "no message for size overflow");
        CHECK(ekv_cache_bytes_needed(&p) < 0, "bytes_needed(overflowing pool) = %lld",
              (long long)ekv_cache_bytes_needed(&p));
        fprintf(stderr, "  overflow (num_pages %lld): %s: %s\n", (long long)pages[i],
                ekv_status_string(st), ekv_last_error(ctx));
    }
    /* ~1 TiB: 3.4M pages of 16 tokens x 32 heads x 128 dims fp16 (+ fp32 summaries). The
     * address space is capped at 256 GiB for this call so that malloc fails even where the
     * kernel overcommits; without the cap a 1 TiB request fails on any normal machine. */
    p = ekv_cache_default_params();
    p.page_size = PS;
    p.num_kv_heads = HK;
    p.head_dim = DIM;
    p.dtype = EKV_DTYPE_F16;
    p.max_seqs = 1;
    p.num_pages = ((int64_t)1 << 40) / (2 * PS * HK * DIM * 2 + HK * DIM * 16);
    const int64_t need = ekv_cache_bytes_needed(&p);
    CHECK(need > ((int64_t)1 << 40) - ((int64_t)1 << 32), "1 TiB pool: bytes_needed %lld",
          (long long)need);
    struct rlimit old, lim;
    int capped = 0;
    if (getrlimit(RLIMIT_AS, &old) == 0) {
        lim = old;
        rlim_t cap = (rlim_t)256 << 30;
        if (lim.rlim_cur == RLIM_INFINITY || lim.rlim_cur > cap) {
            lim.rlim_cur = cap;
            capped = setrlimit(RLIMIT_AS, &lim) == 0;
        }
    }
    ekv_cache *c = (ekv_cache *)&p;
    ekv_status st = ekv_cache_create(ctx, &p, &c);
    if (capped) setrlimit(RLIMIT_AS, &old);
    CHECK(st == EKV_ERR_OUT_OF_MEMORY, "1 TiB pool (%lld pages): %s, want OUT_OF_MEMORY",
          (long long)p.num_pages, ekv_status_string(st));
    CHECK(ekv_last_error(ctx)[0] != '\0', "no message for out of memory");
    if (st == EKV_OK)
        ekv_cache_free(c);
    else
        CHECK(c == (ekv_cache *)&p, "out written on error");
    fprintf(stderr, "  1 TiB pool (%.1f GiB needed%s): %s: %s\n", (double)need / (1 << 30),
            capped ? ", address space capped at 256 GiB" : "", ekv_status_string(st),
            ekv_last_error(ctx));
}

/* Summaries of (page, head) recomputed in double from the stored keys. */
static void check_page_stats(const ekv_paged_kv *kv, const ekv_page_stats *st, int32_t page,
                             int64_t h, int64_t n) {
    const int64_t so = ((int64_t)page * HK + h) * DIM;
    const int64_t base = (int64_t)page * kv->stride_page + h * kv->stride_head;
    CHECK(st->count[page] == n, "page %d: count %d, want %lld", page, st->count[page],
          (long long)n);
    double best = 0;
    for (int64_t d = 0; d < DIM; d++) {
        double mn = INFINITY, mx = -INFINITY, sum = 0, m2 = 0;
        for (int64_t t = 0; t < n; t++) {
            double x = kval(kv, base + t * kv->stride_token + d);
            mn = fmin(mn, x);
            mx = fmax(mx, x);
            sum += x;
        }
        double mean = sum / n, mag = fmax(fabs(mn), fabs(mx));
        for (int64_t t = 0; t < n; t++) {
            double x = kval(kv, base + t * kv->stride_token + d) - mean;
            m2 += x * x;
        }
        CHECK(st->kmin[so + d] == mn && st->kmax[so + d] == mx,
              "page %d h %lld d %lld: min/max %g/%g want %g/%g", page, (long long)h, (long long)d,
              (double)st->kmin[so + d], (double)st->kmax[so + d], mn, mx);
        CHECK(fabs(st->kmean[so + d] - mean) <= 1e-5 * mag + 1e-30,
              "page %d h %lld d %lld: mean %.9g want %.9g", page, (long long)h, (long long)d,
              (double)st->kmean[so + d], mean);
        CHECK(fabs(st->km2[so + d] - m2) <= 1e-5 * (m2 + 1e-2 * n * mag * mag) + 1e-37,
              "page %d h %lld d %lld: M2 %.9g want %.9g", page, (long long)h, (long long)d,
              (double)st->km2[so + d], m2);
    }
    for (int64_t t = 0; t < n; t++) {
        double ss = 0;
        for (int64_t d = 0; d < DIM; d++) {
            double diff = kval(kv, base + t * kv->stride_token + d) - (double)st->kmean[so + d];
            ss += diff * diff;
        }
        if (ss > best) best = ss;
    }
    double r = sqrt(best), sr = st->radius[(int64_t)page * HK + h];
    CHECK(sr >= r && sr <= r * (1 + 1e-5) + 1e-37, "page %d h %lld: radius %.9g, exact %.9g", page,
          (long long)h, sr, r);
}

int main(void) {
#ifdef EKV_TEST_SANITIZED
    printf("test_large_cache: skipped: a 20 GiB cache is too big and too slow under ASan/UBSan\n");
    return 77;
#endif
    const double t0 = now_s();
    ekv_context *ctx = NULL;
    ekv_context_params cp = ekv_context_default_params();
    cp.n_threads = 2;
    if (ekv_context_create(&cp, &ctx) != EKV_OK) {
        fprintf(stderr, "context_create failed\n");
        return 1;
    }
    test_impossible_pools(ctx);

    ekv_cache_params p = ekv_cache_default_params();
    p.page_size = PS;
    p.num_kv_heads = HK;
    p.head_dim = DIM;
    p.dtype = EKV_DTYPE_F16;
    p.max_seqs = 1;
    p.superpage_pages =
            0; /* this test is about int64 offsets; keep the pool within 24 GB machines */
    p.num_pages = ekv_cache_pages_for(NTOK, 1, PS);
    CHECK(p.num_pages == NTOK / PS, "pages_for = %lld", (long long)p.num_pages);
    const int64_t need = ekv_cache_bytes_needed(&p), avail = mem_available();
    CHECK(need >= ((int64_t)16 << 30), "bytes_needed %lld < 16 GiB", (long long)need);
    if (g_failures) return test_finish("test_large_cache");
    if (avail < need + ((int64_t)2 << 30)) {
        printf("test_large_cache: skipped: the 1M-token cache needs %.2f GiB + 2 GiB headroom, MemAvailable is %.2f GiB\n",
               (double)need / (1 << 30), (double)avail / (1 << 30));
        ekv_context_free(ctx);
        return g_failures ? 1 : 77;
    }
    fprintf(stderr, "cache: %.2f GiB needed, %.2f GiB available\n", (double)need / (1 << 30),
            (double)avail / (1 << 30));

    test_rng rng = {0x2545f4914f6cdd1dull};
    g_pool = malloc(sizeof(float) * POOL_N);
    for (int64_t i = 0; i < POOL_N; i++) g_pool[i] = (float)(2.0 * test_uniform(&rng) - 1.0);
    for (int i = 0; i < NH * DIM; i++) g_q[i] = (float)test_normal(&rng);

    ekv_cache *c = NULL;
    ekv_status st = ekv_cache_create(ctx, &p, &c);
    CHECK(st == EKV_OK, "create: %s (%s)", ekv_status_string(st), ekv_last_error(ctx));
    if (st) return test_finish("test_large_cache");
    int32_t seq = -1;
    st = ekv_cache_seq_new(c, &seq);
    CHECK(st == EKV_OK, "seq_new: %s", ekv_status_string(st));

    /* ---- append 1M tokens ---- */
    float *kb = malloc(sizeof(float) * CHUNK * HK * DIM),
          *vb = malloc(sizeof(float) * CHUNK * HK * DIM);
    double last_print = now_s(), ta = now_s(), t_lib = 0;
    for (int64_t t0c = 0; t0c < NTOK && !st; t0c += CHUNK) {
        for (int64_t t = 0; t < CHUNK; t++)
            for (int64_t h = 0; h < HK; h++)
                make_row(t0c + t, h, kb + (t * HK + h) * DIM, vb + (t * HK + h) * DIM);
        double tl = now_s();
        st = ekv_cache_append(c, seq, CHUNK, kb, vb, EKV_DTYPE_F32);
        t_lib += now_s() - tl;
        CHECK(st == EKV_OK, "append at %lld: %s (%s)", (long long)t0c, ekv_status_string(st),
              ekv_last_error(ctx));
        if (now_s() - last_print > 5) {
            last_print = now_s();
            fprintf(stderr, "  appended %lld / %d tokens (%.0f s)\n", (long long)(t0c + CHUNK),
                    NTOK, last_print - ta);
        }
    }
    free(kb);
    free(vb);
    fprintf(stderr, "append: %.1f s (%.1f s in ekv_cache_append)\n", now_s() - ta, t_lib);
    if (st) return test_finish("test_large_cache");
    int64_t len = -1;
    CHECK(ekv_cache_seq_length(c, seq, &len) == EKV_OK && len == NTOK, "length %lld",
          (long long)len);
    CHECK(ekv_cache_free_pages(c) == 0, "free pages %lld", (long long)ekv_cache_free_pages(c));

    ekv_paged_kv kv;
    ekv_page_stats ps;
    CHECK(ekv_cache_kv_view(c, &kv, &ps) == EKV_OK, "kv_view");
    int64_t indptr[2], needed = -1;
    int32_t lpl = -1;
    int32_t *pages = malloc(sizeof(int32_t) * (size_t)p.num_pages);
    st = ekv_cache_page_table(c, &seq, 1, indptr, pages, p.num_pages, &lpl, &needed);
    CHECK(st == EKV_OK && needed == p.num_pages && indptr[1] == p.num_pages && lpl == PS,
          "page table: %s, needed %lld, last %d", ekv_status_string(st), (long long)needed, lpl);
    if (st) return test_finish("test_large_cache");

    /* ---- read back tokens with element offsets past 2^31 and byte offsets past 2^32 ---- */
    int64_t max_off = 0, checked = 0, bad = 0;
    float kr[DIM], vr[DIM];
    const int64_t probe[] = {0, 5, (1 << 19) - 1, 1 << 19, (1 << 19) + 1, NTOK - 40};
    for (int pass = 0; pass < 2; pass++) {
        const int64_t lo = pass ? NTOK - 64 : 0,
                      hi = pass ? NTOK : (int64_t)(sizeof probe / sizeof probe[0]);
        for (int64_t i = lo; i < hi; i++) {
            const int64_t t = pass ? i : probe[i];
            for (int64_t h = 0; h < HK; h++) {
                make_row(t, h, kr, vr);
                for (int64_t d = 0; d < DIM; d++) {
                    const int64_t off = elem_off(&kv, pages, t, h, d);
                    if (off > max_off) max_off = off;
                    double gk = kval(&kv, off), gv = vval(&kv, off);
                    if ((gk != round_f16(kr[d]) || gv != round_f16(vr[d])) && bad++ < 5)
                        CHECK(0,
                              "token %lld h %lld d %lld (element offset %lld): K %g V %g, want %g %g",
                              (long long)t, (long long)h, (long long)d, (long long)off, gk, gv,
                              round_f16(kr[d]), round_f16(vr[d]));
                    checked++;
                }
            }
        }
    }
    g_checks++;
    CHECK(max_off > ((int64_t)1 << 32) - ((int64_t)1 << 16) && max_off > ((int64_t)1 << 31),
          "largest element offset read %lld", (long long)max_off);
    fprintf(stderr, "read back %lld values, largest element offset %lld (byte offset %lld)\n",
            (long long)checked, (long long)max_off, (long long)max_off * 2);

    /* ---- summaries of a few pages near the end (and at 2^31 elements) ---- */
    const int64_t np = p.num_pages;
    const int32_t spages[] = {pages[np - 1], pages[np - 2], pages[np - 3], pages[(1 << 19) / PS]};
    const int64_t sheads[] = {0, 17, HK - 1};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) check_page_stats(&kv, &ps, spages[i], sheads[j], PS);

    /* ---- dense 1.5-entmax decode over all 1M tokens ---- */
    ekv_decode_params dp = ekv_decode_default_params();
    dp.num_heads = NH;
    dp.alpha = 1.5;
    dp.scale = 0.f; /* 1/sqrt(128) */
    ekv_page_table tab = {1, indptr, pages, &lpl};
    float *out = malloc(sizeof(float) * NH * DIM);
    double tau[NH];
    int64_t support[NH];
    ekv_decode_info info;
    memset(&info, 0, sizeof info);
    info.tau = tau;
    info.support = support;
    double td = now_s();
    st = ekv_decode_dense(ctx, &dp, &kv, &tab, g_q, out, &info);
    td = now_s() - td;
    CHECK(st == EKV_OK, "decode_dense: %s (%s)", ekv_status_string(st), ekv_last_error(ctx));
    fprintf(stderr, "decode_dense over %d tokens x %d heads: %.2f s, K bytes %lld, V bytes %lld\n",
            NTOK, NH, td, (long long)info.bytes_k, (long long)info.bytes_v);

    double *x = malloc(sizeof(double) * NTOK), *pr = malloc(sizeof(double) * NTOK);
    const double scale = 1.0 / sqrt((double)DIM);
    const int64_t heads[2] = {0, NH - 1};
    for (int hi = 0; hi < 2 && st == EKV_OK; hi++) {
        const int64_t h = heads[hi]; /* query head h reads KV head h */
        const float *q = g_q + h * DIM;
        for (int64_t t = 0; t < NTOK; t++) {
            const int64_t off = elem_off(&kv, pages, t, h, 0);
            double s = 0;
            for (int64_t d = 0; d < DIM; d++) s += (double)q[d] * kval(&kv, off + d);
            x[t] = scale * s;
        }
        double rtau = 0;
        int64_t rsup = 0;
        ekv_status rs = ekv_entmax_f64(ctx, x, NTOK, 1.5, pr, &rtau, &rsup);
        CHECK(rs == EKV_OK, "ekv_entmax_f64: %s", ekv_status_string(rs));
        double ref[DIM] = {0}, psum = 0, rmax = 0, err = 0;
        int needles_in = 0;
        for (int64_t t = 0; t < NTOK; t++) {
            if (pr[t] <= 0) continue;
            psum += pr[t];
            needles_in += needle_index(t, h) >= 0;
            const int64_t off = elem_off(&kv, pages, t, h, 0);
            for (int64_t d = 0; d < DIM; d++) ref[d] += pr[t] * vval(&kv, off + d);
        }
        for (int64_t d = 0; d < DIM; d++) {
            rmax = fmax(rmax, fabs(ref[d]));
            err = fmax(err, fabs((double)out[h * DIM + d] - ref[d]));
        }
        const double tol = 1e-4 * fmax(rmax, 0.1);
        CHECK(fabs(psum - 1) < 1e-9, "head %lld: reference probabilities sum to %.12g",
              (long long)h, psum);
        CHECK(needles_in == 4, "head %lld: %d of 4 planted tokens in the reference support",
              (long long)h, needles_in);
        CHECK(rsup > 8,
              "head %lld: reference support %lld: too few random tokens to test the V gather",
              (long long)h, (long long)rsup);
        CHECK(err <= tol, "head %lld: max |out - ref| = %.3g > %.3g (max |ref| %.3g)", (long long)h,
              err, tol, rmax);
        CHECK(fabs(tau[h] - rtau) <= 1e-5 * (1 + fabs(rtau)), "head %lld: tau %.9g, reference %.9g",
              (long long)h, tau[h], rtau);
        CHECK(llabs(support[h] - rsup) <= 2, "head %lld: support %lld, reference %lld",
              (long long)h, (long long)support[h], (long long)rsup);
        fprintf(stderr,
                "head %lld: support %lld (ref %lld), tau %.9g (ref %.9g), max err %.3g, max |ref| %.3g\n",
                (long long)h, (long long)support[h], (long long)rsup, tau[h], rtau, err, rmax);
    }
    free(x);
    free(pr);
    free(out);
    free(pages);
    free(g_pool);
    ekv_cache_free(c);
    ekv_context_free(ctx);
    fprintf(stderr, "total %.1f s\n", now_s() - t0);
    return test_finish("test_large_cache");
}
