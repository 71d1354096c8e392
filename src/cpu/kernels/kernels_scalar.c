/* Portable scalar kernels (the fallback, and the baseline the SIMD kernels are tested
 * against). Contracts in kernels.h. */
#include "kernels.h"
#include "screen_page.h"

static void score_scalar(const void *k, int64_t stride_tok, int64_t ntok, ekv_dtype dt, int64_t D,
                         const float *q, int64_t ldq, int G, const float *bias0,
                         const float *bias_step, int64_t pos0, float *z, int64_t ldz, float *zmax,
                         const void *prefetch) {
    (void)prefetch; /* the scalar path is compute-bound; no prefetch */
    for (int64_t t = 0; t < ntok; t++) {
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            const float *qg = q + g * ldq;
            for (int64_t d = 0; d < D; d++) s += qg[d] * ekv_load_f32(k, dt, t * stride_tok + d);
            if (bias0) s += bias0[g] + bias_step[g] * (float)(pos0 + t);
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

static void code_dots_scalar(const uint8_t *block, int64_t ps, int64_t ntok, int32_t bits,
                             int64_t D, const float *w, int64_t ldw, int G, float *dots,
                             int64_t ldd) {
    for (int g = 0; g < G; g++)
        for (int64_t t = 0; t < ntok; t++) dots[g * ldd + t] = 0.f;
    for (int64_t c = 0; c < D; c++)
        for (int g = 0; g < G; g++)
            for (int64_t t = 0; t < ntok; t++)
                dots[g * ldd + t] += w[g * ldw + c] * (float)ekv_code_get(block, c, t, ps, bits);
}

static void screen_dots2_scalar(const float *q, const float *mid, const float *qabs, const float *w,
                                int64_t D, float *c0, float *e) {
    float a = 0.f, b = 0.f;
    for (int64_t c = 0; c < D; c++) {
        a += q[c] * mid[c];
        b += qabs[c] * w[c];
    }
    *c0 = a;
    *e = b;
}

static void screen_page_scalar(const ekv_screen_page *pg, const float *qs, int64_t ldq, int G,
                               const ekv_screen_terms *terms, float *scratch, float *lo, float *hi,
                               int64_t ld) {
    ekv_screen_page_impl(code_dots_scalar, screen_dots2_scalar, pg, qs, ldq, G, terms, scratch, lo,
                         hi, ld);
}

const ekv_cpu_kernels ekv_cpu_kernels_scalar = {
        score_scalar,       accum_scalar,         ekv_compact_gt_scalar, ekv_bound_box_scalar,
        ekv_convert_scalar, ekv_exp_shift_scalar, screen_page_scalar};
