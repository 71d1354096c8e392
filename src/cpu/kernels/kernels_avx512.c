/*
 * AVX-512 kernels (compiled with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c; only
 * called when the CPU reports AVX-512, see ekv_cpu_best_isa). Contracts in kernels.h.
 *
 * Scores use register tiles of TT tokens x TG heads = 16 dot products: each key chunk is
 * loaded and converted once and used by TG heads; the 16 accumulators are then reduced
 * together by a transpose-add tree (45 shuffles/adds for 16 dots instead of 16 separate
 * horizontal sums), which leaves dot product i = g*TT + t in lane i.
 */
#include "kernels.h"
#include "screen_page.h"
#if defined(__x86_64__)
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

INLINE __m512 load16(const void *base, ekv_dtype dt, int64_t off, __mmask16 m) {
    if (dt == EKV_DTYPE_F32) return _mm512_maskz_loadu_ps(m, (const float *)base + off);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)base + off);
    if (dt == EKV_DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Reduces 16 vectors to one: lane i = horizontal sum of a[i]. */
INLINE __m512 reduce16(const __m512 a[16]) {
    __m512 t[8], u[4], v[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88),
                         _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

/* One TT x TG tile; rows[t] and qs[g] are already padded (valid pointers). */
INLINE __m512 score_tile(const void *k, const int64_t rowoff[16], const float *qs[16], ekv_dtype dt,
                         int64_t D, const int TT, const int TG) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        __m512 qv[4];
        for (int g = 0; g < TG; g++) qv[g] = _mm512_loadu_ps(qs[g] + d);
        for (int t = 0; t < TT; t++) {
            __m512 kv = load16(k, dt, rowoff[t] + d, 0xffff);
            for (int g = 0; g < TG; g++)
                acc[g * TT + t] = _mm512_fmadd_ps(kv, qv[g], acc[g * TT + t]);
        }
    }
    if (d < D) {
        __mmask16 m = (__mmask16)((1u << (D - d)) - 1);
        __m512 qv[4];
        for (int g = 0; g < TG; g++) qv[g] = _mm512_maskz_loadu_ps(m, qs[g] + d);
        for (int t = 0; t < TT; t++) {
            __m512 kv = load16(k, dt, rowoff[t] + d, m);
            for (int g = 0; g < TG; g++)
                acc[g * TT + t] = _mm512_fmadd_ps(kv, qv[g], acc[g * TT + t]);
        }
    }
    return reduce16(acc);
}

INLINE void score_impl(const void *k, int64_t stride_tok, int64_t ntok, ekv_dtype dt, int64_t D,
                       const float *q, int64_t ldq, int G, const float *bias0,
                       const float *bias_step, int64_t pos0, float *z, int64_t ldz, float *zmax,
                       const char *pf, const int TG) {
    const int TT = 16 / TG;
    const int64_t esz = dt == EKV_DTYPE_F32 ? 4 : 2;
    for (int g0 = 0; g0 < G; g0 += TG) {
        int gn = G - g0 < TG ? G - g0 : TG;
        const float *qs[16];
        float b0[16], bs[16], lane[16]; /* bias of lane g*TT + t: b0 + bs * (pos0 + t0 + t) */
        for (int g = 0; g < TG; g++) {
            int gg = g0 + (g < gn ? g : gn - 1);
            qs[g] = q + gg * ldq;
            for (int t = 0; t < TT; t++) {
                b0[g * TT + t] = bias0 ? bias0[gg] : 0.f;
                bs[g * TT + t] = bias0 ? bias_step[gg] : 0.f;
                lane[g * TT + t] = (float)t;
            }
        }
        const __m512 vb0 = _mm512_loadu_ps(b0), vbs = _mm512_loadu_ps(bs),
                     vlane = _mm512_loadu_ps(lane);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        __mmask16 gmask = 0;
        for (int g = 0; g < gn; g++) gmask |= (__mmask16)(((1u << TT) - 1) << (g * TT));
        for (int64_t t0 = 0; t0 < ntok; t0 += TT) {
            int tn = ntok - t0 < TT ? (int)(ntok - t0) : TT;
            int64_t rowoff[16];
            for (int t = 0; t < TT; t++) rowoff[t] = (t0 + (t < tn ? t : tn - 1)) * stride_tok;
            if (pf && g0 == 0) /* the matching rows of the slab scored later */
                for (int64_t o = 0; o < (int64_t)tn * stride_tok * esz; o += 64)
                    _mm_prefetch(pf + t0 * stride_tok * esz + o, _MM_HINT_T1);
            /* pos0 + t0 + t is exact in fp32 (below 2^24), as the scalar kernel's (float) */
            const __m512 pos = _mm512_add_ps(vlane, _mm512_set1_ps((float)(pos0 + t0)));
            const __m512 bias = _mm512_add_ps(vb0, _mm512_mul_ps(vbs, pos));
            __m512 r = _mm512_add_ps(score_tile(k, rowoff, qs, dt, D, TT, TG), bias);
            __mmask16 valid = gmask;
            if (tn < TT) {
                __mmask16 tm = 0;
                for (int g = 0; g < TG; g++) tm |= (__mmask16)(((1u << tn) - 1) << (g * TT));
                valid &= tm;
            }
            mx = _mm512_mask_max_ps(mx, valid, mx, r);
            float tmp[16];
            _mm512_storeu_ps(tmp, r);
            for (int g = 0; g < gn; g++) {
                float *dst = z + (int64_t)(g0 + g) * ldz + t0;
                if (tn == TT)
                    memcpy(dst, tmp + g * TT, sizeof(float) * (size_t)TT);
                else
                    memcpy(dst, tmp + g * TT, sizeof(float) * (size_t)tn);
            }
        }
        float mt[16];
        _mm512_storeu_ps(mt, mx);
        for (int g = 0; g < gn; g++)
            for (int t = 0; t < TT; t++)
                if (mt[g * TT + t] > zmax[g0 + g]) zmax[g0 + g] = mt[g * TT + t];
    }
}

#define SCORE_DT(DT)                                                                               \
    if (G == 1)                                                                                    \
        score_impl(k, st, n, DT, D, q, ldq, G, b0, bs, pos0, z, ldz, zmax, pf, 1);                 \
    else if (G == 2)                                                                               \
        score_impl(k, st, n, DT, D, q, ldq, G, b0, bs, pos0, z, ldz, zmax, pf, 2);                 \
    else                                                                                           \
        score_impl(k, st, n, DT, D, q, ldq, G, b0, bs, pos0, z, ldz, zmax, pf, 4);

static void score_avx512(const void *k, int64_t st, int64_t n, ekv_dtype dt, int64_t D,
                         const float *q, int64_t ldq, int G, const float *b0, const float *bs,
                         int64_t pos0, float *z, int64_t ldz, float *zmax, const void *prefetch) {
    const char *pf = (const char *)prefetch;
    switch (dt) {
    case EKV_DTYPE_F16: SCORE_DT(EKV_DTYPE_F16) break;
    case EKV_DTYPE_BF16: SCORE_DT(EKV_DTYPE_BF16) break;
    default: SCORE_DT(EKV_DTYPE_F32) break;
    }
}

INLINE void accum_impl(const void *v, int64_t st, int64_t ntok, ekv_dtype dt, int64_t D,
                       const float *w, int64_t ldw, float *out, int64_t ldo, const int GN) {
    for (int64_t d = 0; d < D; d += 16) {
        __mmask16 m = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1);
        __m512 acc[8];
        for (int g = 0; g < GN; g++) acc[g] = _mm512_maskz_loadu_ps(m, out + g * ldo + d);
        for (int64_t t = 0; t < ntok; t++) {
            __m512 x = load16(v, dt, t * st + d, m);
            for (int g = 0; g < GN; g++)
                acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * ldw + t]), x, acc[g]);
        }
        for (int g = 0; g < GN; g++) _mm512_mask_storeu_ps(out + g * ldo + d, m, acc[g]);
    }
}

#define ACCUM_DT(DT)                                                                               \
    for (int g0 = 0; g0 < G;) {                                                                    \
        int r = G - g0;                                                                            \
        const float *wg = w + (int64_t)g0 * ldw;                                                   \
        float *og = out + (int64_t)g0 * ldo;                                                       \
        if (r >= 8) {                                                                              \
            accum_impl(v, st, n, DT, D, wg, ldw, og, ldo, 8);                                      \
            g0 += 8;                                                                               \
        } else if (r >= 4) {                                                                       \
            accum_impl(v, st, n, DT, D, wg, ldw, og, ldo, 4);                                      \
            g0 += 4;                                                                               \
        } else if (r >= 2) {                                                                       \
            accum_impl(v, st, n, DT, D, wg, ldw, og, ldo, 2);                                      \
            g0 += 2;                                                                               \
        } else {                                                                                   \
            accum_impl(v, st, n, DT, D, wg, ldw, og, ldo, 1);                                      \
            g0 += 1;                                                                               \
        }                                                                                          \
    }

static void accum_avx512(const void *v, int64_t st, int64_t n, ekv_dtype dt, int64_t D,
                         const float *w, int64_t ldw, int G, float *out, int64_t ldo) {
    switch (dt) {
    case EKV_DTYPE_F16: ACCUM_DT(EKV_DTYPE_F16) break;
    case EKV_DTYPE_BF16: ACCUM_DT(EKV_DTYPE_BF16) break;
    default: ACCUM_DT(EKV_DTYPE_F32) break;
    }
}

static int64_t compact_avx512(const float *z, int64_t n, float thr, double m, int64_t base,
                              int64_t *idx, double *y) {
    int64_t c = 0;
    __m512 tv = _mm512_set1_ps(thr);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 lm = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __mmask16 hit =
                _mm512_mask_cmp_ps_mask(lm, _mm512_maskz_loadu_ps(lm, z + i), tv, _CMP_GT_OQ);
        while (hit) {
            int b = __builtin_ctz(hit);
            idx[c] = base + i + b;
            y[c] = (double)z[i + b] - m;
            c++;
            hit &= (__mmask16)(hit - 1);
        }
    }
    return c;
}

/* exp(x) for x <= 0 to about 2 ulp: x = n*ln2 + r, |r| <= ln2/2, degree-6 polynomial for
 * e^r (the classic Cephes coefficients), then scalef by 2^n (handles underflow to 0). */
INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

static double exp_shift_avx512(const float *z, int64_t n, float m, float *w) {
    __m512 mv = _mm512_set1_ps(m), acc = _mm512_setzero_ps();
    double total = 0;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 lm = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(lm, z + i), mv));
        e = _mm512_maskz_mov_ps(lm, e);
        _mm512_mask_storeu_ps(w + i, lm, e);
        acc = _mm512_add_ps(acc, e);
        if ((i & 4095) == 4080) { /* flush to double now and then to bound rounding */
            total += _mm512_reduce_add_ps(acc);
            acc = _mm512_setzero_ps();
        }
    }
    return total + _mm512_reduce_add_ps(acc);
}

/* 4 pages x TG heads per register tile (like the score tiles): the query chunks are loaded
 * once for 4 pages and each summary chunk once for TG heads; one transpose-add tree reduces
 * the 16 sums (lane g*4 + i). */
INLINE void bound_impl(const float *qpos, const float *qneg, int64_t ldq, int G,
                       const float *const *kmin, const float *const *kmax, int np, int64_t D,
                       float *u, int64_t ldu, const int TG) {
    for (int g0 = 0; g0 < G; g0 += TG) {
        const int gn = G - g0 < TG ? G - g0 : TG;
        for (int i0 = 0; i0 < np; i0 += 4) {
            const int in = np - i0 < 4 ? np - i0 : 4;
            __m512 acc[16];
            for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
                __mmask16 m = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1);
                __m512 qp[4], qn[4];
                for (int g = 0; g < TG; g++) {
                    const int64_t o = (int64_t)(g0 + (g < gn ? g : gn - 1)) * ldq + d;
                    qp[g] = _mm512_maskz_loadu_ps(m, qpos + o);
                    qn[g] = _mm512_maskz_loadu_ps(m, qneg + o);
                }
                for (int i = 0; i < 4; i++) {
                    const int ii = i0 + (i < in ? i : in - 1);
                    __m512 mx = _mm512_maskz_loadu_ps(m, kmax[ii] + d),
                           mn = _mm512_maskz_loadu_ps(m, kmin[ii] + d);
                    for (int g = 0; g < TG; g++)
                        acc[g * 4 + i] = _mm512_fmadd_ps(
                                qn[g], mn, _mm512_fmadd_ps(qp[g], mx, acc[g * 4 + i]));
                }
            }
            float r[16];
            _mm512_storeu_ps(r, reduce16(acc));
            for (int g = 0; g < gn; g++)
                for (int i = 0; i < in; i++) u[(int64_t)(g0 + g) * ldu + i0 + i] = r[g * 4 + i];
        }
    }
}

static void bound_box_avx512(const float *qpos, const float *qneg, int64_t ldq, int G,
                             const float *const *kmin, const float *const *kmax, int np, int64_t D,
                             float *u, int64_t ldu) {
    if (G == 1)
        bound_impl(qpos, qneg, ldq, G, kmin, kmax, np, D, u, ldu, 1);
    else if (G == 2)
        bound_impl(qpos, qneg, ldq, G, kmin, kmax, np, D, u, ldu, 2);
    else
        bound_impl(qpos, qneg, ldq, G, kmin, kmax, np, D, u, ldu, 4);
}

/* Conversions for the cache's append: f32/f16/bf16 -> f32/f16/bf16, round to nearest even. */
static void convert_avx512(const void *src, ekv_dtype sdt, void *dst, ekv_dtype ddt, int64_t n,
                           float *f32) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 x = load16(src, sdt, i, m), back = x;
        if (ddt == EKV_DTYPE_F32) {
            _mm512_mask_storeu_ps((float *)dst + i, m, x);
        } else if (ddt == EKV_DTYPE_F16) {
            __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm256_mask_storeu_epi16((uint16_t *)dst + i, m, h);
            back = _mm512_cvtph_ps(h);
        } else { /* bf16: add 0x7fff + lsb, keep the high half (finite inputs) */
            __m512i b = _mm512_castps_si512(x);
            __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
            b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
            __m512i hi = _mm512_srli_epi32(b, 16);
            _mm256_mask_storeu_epi16((uint16_t *)dst + i, m, _mm512_cvtepi32_epi16(hi));
            back = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16));
        }
        if (f32) _mm512_mask_storeu_ps(f32 + i, m, back);
    }
}

/* acc[g] += w[g][c] * x for TG heads: one channel of 16 tokens. */
INLINE void code_fma16(__m512 x, const float *w, int64_t ldw, int64_t c, const int TG,
                       __m512 *acc) {
    for (int g = 0; g < TG; g++)
        acc[g] = _mm512_fmadd_ps(x, _mm512_set1_ps(w[g * ldw + c]), acc[g]);
}

/* One tile: up to 16 tokens from t0 (mask m) for TG heads; the sums stay in registers. */
INLINE void code_tile(const uint8_t *block, int64_t ps, int64_t t0, __mmask16 m, int32_t bits,
                      int64_t D, const float *w, int64_t ldw, float *dots, int64_t ldd,
                      const int TG) {
    const __m512i low4 = _mm512_set1_epi32(15);
    __m512 acc[4];
    for (int g = 0; g < TG; g++) acc[g] = _mm512_setzero_ps();
    const int64_t rows = bits == 8 ? D : (D + 1) / 2;
    for (int64_t j = 0; j < rows; j++) {
        const __m512i x = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, block + j * ps + t0));
        if (bits == 8) {
            code_fma16(_mm512_cvtepi32_ps(x), w, ldw, j, TG, acc);
            continue;
        }
        code_fma16(_mm512_cvtepi32_ps(_mm512_and_si512(x, low4)), w, ldw, 2 * j, TG, acc);
        if (2 * j + 1 < D)
            code_fma16(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4)), w, ldw, 2 * j + 1, TG, acc);
    }
    for (int g = 0; g < TG; g++) _mm512_mask_storeu_ps(dots + g * ldd + t0, m, acc[g]);
}

/* Tokens across the lanes (the block layout of src/core/codes.h): 16 tokens per tile, one
 * byte load per channel (pair), the heads 4 at a time in register sums, no horizontal
 * reduction. */
static void code_dots_avx512(const uint8_t *block, int64_t ps, int64_t ntok, int32_t bits,
                             int64_t D, const float *w, int64_t ldw, int G, float *dots,
                             int64_t ldd) {
    for (int64_t t0 = 0; t0 < ntok; t0 += 16) {
        const __mmask16 m =
                ntok - t0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (ntok - t0)) - 1);
        for (int g0 = 0; g0 < G;) {
            const float *wg = w + g0 * ldw;
            float *dg = dots + g0 * ldd;
            if (G - g0 >= 4) {
                code_tile(block, ps, t0, m, bits, D, wg, ldw, dg, ldd, 4);
                g0 += 4;
            } else if (G - g0 >= 2) {
                code_tile(block, ps, t0, m, bits, D, wg, ldw, dg, ldd, 2);
                g0 += 2;
            } else {
                code_tile(block, ps, t0, m, bits, D, wg, ldw, dg, ldd, 1);
                g0 += 1;
            }
        }
    }
}

static void screen_dots2_avx512(const float *q, const float *mid, const float *qabs, const float *w,
                                int64_t D, float *c0, float *e) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
        const __mmask16 m = D - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - c)) - 1);
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + c), _mm512_maskz_loadu_ps(m, mid + c), a);
        b = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qabs + c), _mm512_maskz_loadu_ps(m, w + c), b);
    }
    *c0 = _mm512_reduce_add_ps(a);
    *e = _mm512_reduce_add_ps(b);
}

static void screen_page_avx512(const ekv_screen_page *pg, const float *qs, int64_t ldq, int G,
                               const ekv_screen_terms *terms, float *scratch, float *lo, float *hi,
                               int64_t ld) {
    ekv_screen_page_impl(code_dots_avx512, screen_dots2_avx512, pg, qs, ldq, G, terms, scratch, lo,
                         hi, ld);
}

const ekv_cpu_kernels ekv_cpu_kernels_avx512 = {score_avx512,      accum_avx512,   compact_avx512,
                                                bound_box_avx512,  convert_avx512, exp_shift_avx512,
                                                screen_page_avx512};

#endif
