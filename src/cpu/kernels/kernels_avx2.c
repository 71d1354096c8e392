/*
 * AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c; only called when the CPU
 * reports AVX2 and FMA). Simpler than the AVX-512 tiles: one token at a time, each key
 * chunk converted once and shared by up to 4 heads, then horizontal sums.
 */
#include "kernels.h"
#include "screen_page.h"
#if defined(__x86_64__)
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

/* Loads 8 elements (or the first r < 8 with zeros after them) as floats. */
INLINE __m256 load8(const void *base, ekv_dtype dt, int64_t off, int r) {
    if (r >= 8) {
        if (dt == EKV_DTYPE_F32) return _mm256_loadu_ps((const float *)base + off);
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
        if (dt == EKV_DTYPE_F16) return _mm256_cvtph_ps(h);
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    float tmp[8] = {0};
    for (int i = 0; i < r; i++) tmp[i] = ekv_load_f32(base, dt, off + i);
    return _mm256_loadu_ps(tmp);
}

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

INLINE void score_impl(const void *k, int64_t st, int64_t ntok, ekv_dtype dt, int64_t D,
                       const float *q, int64_t ldq, int G, const float *b0, const float *bs,
                       int64_t pos0, float *z, int64_t ldz, float *zmax) {
    for (int g0 = 0; g0 < G; g0 += 4) {
        int gn = G - g0 < 4 ? G - g0 : 4;
        for (int64_t t = 0; t < ntok; t++) {
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
            for (int64_t d = 0; d < D; d += 8) {
                int r = (int)(D - d < 8 ? D - d : 8);
                __m256 kv = load8(k, dt, t * st + d, r);
                for (int g = 0; g < 4; g++) {
                    if (g >= gn) break;
                    __m256 qv = load8(q + (g0 + g) * ldq, EKV_DTYPE_F32, d, r);
                    acc[g] = _mm256_fmadd_ps(kv, qv, acc[g]);
                }
            }
            for (int g = 0; g < gn; g++) {
                int gg = g0 + g;
                float s = hsum8(acc[g]);
                if (b0) s += b0[gg] + bs[gg] * (float)(pos0 + t);
                z[gg * ldz + t] = s;
                if (s > zmax[gg]) zmax[gg] = s;
            }
        }
    }
}

static void score_avx2(const void *k, int64_t st, int64_t n, ekv_dtype dt, int64_t D,
                       const float *q, int64_t ldq, int G, const float *b0, const float *bs,
                       int64_t pos0, float *z, int64_t ldz, float *zmax, const void *prefetch) {
    if (prefetch) { /* one burst: this path is a fallback for CPUs without AVX-512 */
        int64_t bytes = n * st * (dt == EKV_DTYPE_F32 ? 4 : 2);
        for (int64_t o = 0; o < bytes; o += 64)
            _mm_prefetch((const char *)prefetch + o, _MM_HINT_T1);
    }
    switch (dt) {
    case EKV_DTYPE_F16:
        score_impl(k, st, n, EKV_DTYPE_F16, D, q, ldq, G, b0, bs, pos0, z, ldz, zmax);
        break;
    case EKV_DTYPE_BF16:
        score_impl(k, st, n, EKV_DTYPE_BF16, D, q, ldq, G, b0, bs, pos0, z, ldz, zmax);
        break;
    default: score_impl(k, st, n, EKV_DTYPE_F32, D, q, ldq, G, b0, bs, pos0, z, ldz, zmax); break;
    }
}

static void accum_avx2(const void *v, int64_t st, int64_t ntok, ekv_dtype dt, int64_t D,
                       const float *w, int64_t ldw, int G, float *out, int64_t ldo) {
    for (int64_t d = 0; d < D; d += 8) {
        int r = (int)(D - d < 8 ? D - d : 8);
        for (int g0 = 0; g0 < G; g0 += 4) {
            int gn = G - g0 < 4 ? G - g0 : 4;
            __m256 acc[4];
            for (int g = 0; g < gn; g++) acc[g] = load8(out + (g0 + g) * ldo, EKV_DTYPE_F32, d, r);
            for (int64_t t = 0; t < ntok; t++) {
                __m256 x = load8(v, dt, t * st + d, r);
                for (int g = 0; g < gn; g++)
                    acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(w[(g0 + g) * ldw + t]), x, acc[g]);
            }
            for (int g = 0; g < gn; g++) {
                float tmp[8];
                _mm256_storeu_ps(tmp, acc[g]);
                memcpy(out + (g0 + g) * ldo + d, tmp, sizeof(float) * (size_t)r);
            }
        }
    }
}

int64_t ekv_compact_gt_scalar(const float *z, int64_t n, float thr, double m, int64_t base,
                              int64_t *idx, double *y);

double ekv_exp_shift_scalar(const float *z, int64_t n, float m, float *w);
void ekv_bound_box_scalar(const float *qpos, const float *qneg, int64_t ldq, int G,
                          const float *const *kmin, const float *const *kmax, int np, int64_t D,
                          float *u, int64_t ldu);

void ekv_convert_scalar(const void *src, ekv_dtype sdt, void *dst, ekv_dtype ddt, int64_t n,
                        float *f32);

/* acc[g] += w[g][c] * x for the G heads: one channel of 8 tokens. */
static inline void code_fma8(__m256 x, const float *w, int64_t ldw, int64_t c, int G, __m256 *acc) {
    for (int g = 0; g < G; g++) acc[g] = _mm256_fmadd_ps(x, _mm256_set1_ps(w[g * ldw + c]), acc[g]);
}

/* Tokens across the lanes, 8 per tile (as the AVX-512 kernel; a short tile is copied out so
 * that no load reads past the block). */
static void code_dots_avx2(const uint8_t *block, int64_t ps, int64_t ntok, int32_t bits, int64_t D,
                           const float *w, int64_t ldw, int G, float *dots, int64_t ldd) {
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t t0 = 0; t0 < ntok; t0 += 8) {
        const int64_t tn = ntok - t0 < 8 ? ntok - t0 : 8;
        __m256 acc[16];
        for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
        const int64_t rows = bits == 8 ? D : (D + 1) / 2;
        for (int64_t j = 0; j < rows; j++) {
            uint8_t b8[8] = {0};
            memcpy(b8, block + j * ps + t0, (size_t)tn);
            int64_t v;
            memcpy(&v, b8, 8);
            const __m256i x = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v));
            if (bits == 8) {
                code_fma8(_mm256_cvtepi32_ps(x), w, ldw, j, G, acc);
                continue;
            }
            code_fma8(_mm256_cvtepi32_ps(_mm256_and_si256(x, low4)), w, ldw, 2 * j, G, acc);
            if (2 * j + 1 < D)
                code_fma8(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4)), w, ldw, 2 * j + 1, G, acc);
        }
        for (int g = 0; g < G; g++) {
            float tmp[8];
            _mm256_storeu_ps(tmp, acc[g]);
            memcpy(dots + g * ldd + t0, tmp, sizeof(float) * (size_t)tn);
        }
    }
}

static void screen_dots2_avx2(const float *q, const float *mid, const float *qabs, const float *w,
                              int64_t D, float *c0, float *e) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= D; c += 8) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(mid + c), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(qabs + c), _mm256_loadu_ps(w + c), b);
    }
    float sa = hsum8(a), sb = hsum8(b);
    for (; c < D; c++) {
        sa += q[c] * mid[c];
        sb += qabs[c] * w[c];
    }
    *c0 = sa;
    *e = sb;
}

static void screen_page_avx2(const ekv_screen_page *pg, const float *qs, int64_t ldq, int G,
                             const ekv_screen_terms *terms, float *scratch, float *lo, float *hi,
                             int64_t ld) {
    ekv_screen_page_impl(code_dots_avx2, screen_dots2_avx2, pg, qs, ldq, G, terms, scratch, lo, hi,
                         ld);
}

const ekv_cpu_kernels ekv_cpu_kernels_avx2 = {
        score_avx2,         accum_avx2,           ekv_compact_gt_scalar, ekv_bound_box_scalar,
        ekv_convert_scalar, ekv_exp_shift_scalar, screen_page_avx2};
#endif
