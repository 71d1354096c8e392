/* Minimal test helpers: CHECK records a failure with file:line and continues, so one run
 * reports every broken case; test_finish() turns the count into the exit status. */
#ifndef EKV_TEST_UTIL_H
#define EKV_TEST_UTIL_H
#include "entmaxkv.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_failures = 0, g_checks = 0;

/* A cache's geometry: the library's defaults with these pages, heads, dims, dtype, sequences and
 * pool size (the rest, codes, ranges and superpages, as each test sets them). */
static inline ekv_cache_params test_cache_params(int ps, int Hk, int D, ekv_dtype dt, int seqs,
                                                 int64_t pages) {
    ekv_cache_params cp = ekv_cache_default_params();
    cp.page_size = ps;
    cp.num_kv_heads = Hk;
    cp.head_dim = D;
    cp.dtype = dt;
    cp.max_seqs = seqs;
    cp.num_pages = pages;
    return cp;
}

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        g_checks++;                                                                                \
        if (!(cond)) {                                                                             \
            if (g_failures < 50) {                                                                 \
                fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);           \
                fprintf(stderr, __VA_ARGS__);                                                      \
                fprintf(stderr, "\n");                                                             \
            }                                                                                      \
            g_failures++;                                                                          \
        }                                                                                          \
    } while (0)

/* A 16-bit f16/bf16 value (its bit pattern; dt EKV_DTYPE_F16 or EKV_DTYPE_BF16) as a double. */
static inline double test_value16(uint16_t h, ekv_dtype dt) {
    if (dt == EKV_DTYPE_BF16) {
        const uint32_t b = (uint32_t)h << 16;
        float f;
        memcpy(&f, &b, 4);
        return f;
    }
    const int e = (h >> 10) & 31, m = h & 1023;
    const double mag = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -mag : mag;
}

/* max over heads of ||a - b|| / (||b|| + floor) */
static inline double test_head_rel_err(const float *a, const float *b, int64_t heads, int64_t D,
                                        double floor_) {
    double worst = 0;
    for (int64_t h = 0; h < heads; h++) {
        double e = 0, n = 0;
        for (int64_t d = 0; d < D; d++) {
            const double x = (double)a[h * D + d] - b[h * D + d];
            e += x * x;
            n += (double)b[h * D + d] * b[h * D + d];
        }
        const double r = sqrt(e) / (sqrt(n) + floor_);
        worst = r > worst ? r : worst;
    }
    return worst;
}

static inline int test_finish(const char *name) {
    printf("%s: %d checks, %d failures\n", name, g_checks, g_failures);
    return g_failures ? 1 : 0;
}

/* Deterministic xorshift random numbers for tests. */
typedef struct {
    uint64_t s;
} test_rng;
static inline uint64_t test_next(test_rng *r) {
    uint64_t x = r->s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return r->s = x;
}
static inline double test_uniform(test_rng *r) {
    return (double)(test_next(r) >> 11) / 9007199254740992.0;
}
static inline double test_normal(test_rng *r) {
    double u = test_uniform(r) + 1e-300, v = test_uniform(r);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}
static inline int64_t test_range(test_rng *r, int64_t lo, int64_t hi) { /* [lo, hi] */
    return lo + (int64_t)(test_next(r) % (uint64_t)(hi - lo + 1));
}
#endif
