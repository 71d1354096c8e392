/* Portable scalar kernels (the fallback, and the baseline the SIMD kernels are tested
 * against). Contracts in kernels.h. */
#include "kernels.h"
#include "../core/codes.h"

static void score_scalar(const void *k, int64_t stride_tok, int64_t ntok, ekv_dtype dt, int64_t D,
                         const float *q, int64_t ldq, int G, const float *bias0,
                         const float *bias_step, float *z, int64_t ldz, float *zmax,
                         const void *prefetch) {
    (void)prefetch; /* the scalar path is compute-bound; no prefetch */
    for (int64_t t = 0; t < ntok; t++) {
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            const float *qg = q + g * ldq;
            for (int64_t d = 0; d < D; d++) s += qg[d] * ekv_load_f32(k, dt, t * stride_tok + d);
            if (bias0) s += bias0[g] + bias_step[g] * (float)t;
            z[g * ldz + t] = s;
            if (s > zmax[g]) zmax[g] = s;
        }
    }
}

static void accum_scalar(const void *v, int64_t stride_tok, int64_t ntok, ekv_dtype dt, int64_t D,
                         const float *w, int64_t ldw, int G, float *out, int64_t ldo) {
    for (int64_t t = 0; t < ntok; t++) {
        for (int64_t d = 0; d < D; d++) {
            float x = ekv_load_f32(v, dt, t * stride_tok + d);
            for (int g = 0; g < G; g++) out[g * ldo + d] += w[g * ldw + t] * x;
        }
    }
}

int64_t ekv_compact_gt_scalar(const float *z, int64_t n, float thr, double m, int64_t base,
                              int64_t *idx, double *y);
int64_t ekv_compact_gt_scalar(const float *z, int64_t n, float thr, double m, int64_t base,
                              int64_t *idx, double *y) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        if (z[i] > thr) {
            idx[c] = base + i;
            y[c] = (double)z[i] - m;
            c++;
        }
    }
    return c;
}

void ekv_bound_box_scalar(const float *qpos, const float *qneg, int64_t ldq, int G,
                          const float *const *kmin, const float *const *kmax, int np, int64_t D,
                          float *u, int64_t ldu);
void ekv_bound_box_scalar(const float *qpos, const float *qneg, int64_t ldq, int G,
                          const float *const *kmin, const float *const *kmax, int np, int64_t D,
                          float *u, int64_t ldu) {
    for (int i = 0; i < np; i++)
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            for (int64_t d = 0; d < D; d++)
                s += qpos[g * ldq + d] * kmax[i][d] + qneg[g * ldq + d] * kmin[i][d];
            u[g * ldu + i] = s;
        }
}

void ekv_convert_scalar(const void *src, ekv_dtype sdt, void *dst, ekv_dtype ddt, int64_t n,
                        float *f32);
void ekv_convert_scalar(const void *src, ekv_dtype sdt, void *dst, ekv_dtype ddt, int64_t n,
                        float *f32) {
    for (int64_t i = 0; i < n; i++) {
        ekv_store_f32(dst, ddt, i, ekv_load_f32(src, sdt, i));
        if (f32) f32[i] = ekv_load_f32(dst, ddt, i);
    }
}

double ekv_exp_shift_scalar(const float *z, int64_t n, float m, float *w);
double ekv_exp_shift_scalar(const float *z, int64_t n, float m, float *w) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) {
        w[i] = expf(z[i] - m);
        s += w[i];
    }
    return s;
}

void ekv_code_dots_scalar(const uint8_t *codes, int64_t rb, int64_t ntok, int32_t bits, int64_t D,
                          const float *w, int64_t ldw, int G, float *dots, int64_t ldd);
void ekv_code_dots_scalar(const uint8_t *codes, int64_t rb, int64_t ntok, int32_t bits, int64_t D,
                          const float *w, int64_t ldw, int G, float *dots, int64_t ldd) {
    enum { CH = 256 }; /* channels unpacked at a time */
    float c[CH];
    for (int64_t t = 0; t < ntok; t++) {
        const uint8_t *row = codes + t * rb;
        for (int g = 0; g < G; g++) dots[g * ldd + t] = 0.f;
        for (int64_t d0 = 0; d0 < D; d0 += CH) {
            const int64_t n = D - d0 < CH ? D - d0 : CH;
            for (int64_t i = 0; i < n; i++) c[i] = (float)ekv_code_get(row, d0 + i, bits);
            for (int g = 0; g < G; g++) {
                float s = 0.f;
                for (int64_t i = 0; i < n; i++) s += w[g * ldw + d0 + i] * c[i];
                dots[g * ldd + t] += s;
            }
        }
    }
}

const ekv_cpu_kernels ekv_cpu_kernels_scalar = {
        score_scalar,       accum_scalar,         ekv_compact_gt_scalar, ekv_bound_box_scalar,
        ekv_convert_scalar, ekv_exp_shift_scalar, ekv_code_dots_scalar};

const ekv_cpu_kernels *ekv_cpu_kernels_for(ekv_isa isa) {
#if defined(__x86_64__)
    if (isa == EKV_ISA_AVX512) return &ekv_cpu_kernels_avx512;
    if (isa == EKV_ISA_AVX2) return &ekv_cpu_kernels_avx2;
#endif
    (void)isa;
    return &ekv_cpu_kernels_scalar;
}
