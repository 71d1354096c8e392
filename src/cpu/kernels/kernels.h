/*
 * The CPU's inner loops, one implementation per ISA (kernels_scalar.c, kernels_avx2.c,
 * kernels_avx512.c), chosen at run time by ekv_cpu_kernels_for() (dispatch.c). Every kernel
 * has the same contract, so the tests can check each ISA against the scalar one and the ref.
 */
#ifndef EKV_CPU_KERNELS_H
#define EKV_CPU_KERNELS_H
#include "../../core/internal.h"

struct ekv_screen_page;
struct ekv_screen_terms;

typedef struct ekv_cpu_kernels {
    /*
     * Scores of G query heads over ntok consecutive key rows (row t at k + t*stride_tok,
     * head_dim D contiguous elements of dtype dt):
     *   z[g*ldz + t] = <q[g*ldq ..], k_t> + (bias0[g] + bias_step[g] * (float)(pos0 + t))
     * and zmax[g] = max(zmax[g], every z written for head g). bias0/bias_step may be NULL.
     * The bias is one product and one sum in fp32 on every ISA, and a key's dot product does
     * not depend on its place in the call, so a row scored alone (pos0 = its slot in the page)
     * gets the bits it gets when its whole page is scored (screened decode relies on it).
     * prefetch, if not NULL, is the start of the rows the caller will score later (same
     * stride and count): the kernel prefetches them into L2 a tile at a time, which spreads
     * the prefetches over the work instead of issuing them in one burst.
     */
    void (*score)(const void *k, int64_t stride_tok, int64_t ntok, ekv_dtype dt, int64_t D,
                  const float *q, int64_t ldq, int G, const float *bias0, const float *bias_step,
                  int64_t pos0, float *z, int64_t ldz, float *zmax, const void *prefetch);
    /*
     * out[g*ldo + d] += sum_t w[g*ldw + t] * v_t[d] for G heads over ntok consecutive value
     * rows (row t at v + t*stride_tok).
     */
    void (*accum)(const void *v, int64_t stride_tok, int64_t ntok, ekv_dtype dt, int64_t D,
                  const float *w, int64_t ldw, int G, float *out, int64_t ldo);
    /*
     * Appends every i in [0, n) with z[i] > thr to idx (as base + i) and y (z[i] - m, in
     * double); returns how many were appended.
     */
    int64_t (*compact_gt)(const float *z, int64_t n, float thr, double m, int64_t base,
                          int64_t *idx, double *y);
    /*
     * Quest box bounds of np pages for G query heads sharing their KV head:
     * u[g*ldu + i] = sum_d qpos[g*ldq + d] * kmax[i][d] + qneg[g*ldq + d] * kmin[i][d], where
     * qpos/qneg are the positive/negative parts of the (scaled) query, so each term is
     * max(q_d kmin_d, q_d kmax_d). Each page summary is read once for the whole group.
     */
    void (*bound_box)(const float *qpos, const float *qneg, int64_t ldq, int G,
                      const float *const *kmin, const float *const *kmax, int np, int64_t D,
                      float *u, int64_t ldu);
    /*
     * dst[i] = src[i] converted from sdt to ddt (round to nearest even), and, if f32 is not
     * NULL, f32[i] = the stored value read back as float. Inputs are finite and in range
     * (the cache validates them first).
     */
    void (*convert)(const void *src, ekv_dtype sdt, void *dst, ekv_dtype ddt, int64_t n,
                    float *f32);
    /* w[i] = exp(z[i] - m) for i in [0, n) (w may equal z); returns the sum of w. */
    double (*exp_shift)(const float *z, int64_t n, float m, float *w);
    /*
     * The screen of one page (docs/math.md §10.2, screen_page.h): lo/hi[g*ld + t] bound the
     * scores of the page's tokens for G query heads, from its key codes. The SIMD versions
     * take G <= 16 (EKV_SCREEN_SIMD: one register sum per head); ekv_cpu_screen_page gives a
     * larger group to the scalar one.
     */
    void (*screen_page)(const struct ekv_screen_page *pg, const float *qs, int64_t ldq, int G,
                        const struct ekv_screen_terms *terms, float *scratch, float *lo, float *hi,
                        int64_t ld);
} ekv_cpu_kernels;

const ekv_cpu_kernels *ekv_cpu_kernels_for(ekv_isa isa);
/* The groups the SIMD screens take (one register sum per head, at most 16). */
#define EKV_SCREEN_SIMD(G) ((G) <= 16)

/* What a CPU stage's job starts from: the context's kernels and the (validated) step. */
typedef struct ekv_cpu_step {
    const ekv_cpu_kernels *kern;
    const ekv_decode_params *prm;
    const ekv_paged_kv *kv;
    const ekv_page_table *t;
    ekv_step_shape sh;
} ekv_cpu_step;
static inline ekv_cpu_step ekv_cpu_step_of(const ekv_context *ctx, const ekv_decode_params *prm,
                                           const ekv_paged_kv *kv, const ekv_page_table *t) {
    const ekv_cpu_step s = {ekv_cpu_kernels_for(ctx->isa), prm, kv, t,
                            ekv_step_shape_of(prm, kv, t)};
    return s;
}
/* qs = q' = (a * scale) * q for the step's [B][H][D] queries, the factor rounded to fp32 once:
 * the queries every score kernel takes, so that every path (dense, page lists, token rows, the
 * screen) scores with the same bits (docs/math.md §10.3, "The same bits as dense"). */
static inline void ekv_cpu_scale_queries(const ekv_decode_params *prm, const ekv_step_shape *sh,
                                         const float *q, float *qs) {
    const float f = (float)(sh->a * (float)ekv_effective_scale(prm->scale, sh->D));
    for (int64_t i = 0; i < sh->B * sh->H * sh->D; i++) qs[i] = q[i] * f;
}
extern const ekv_cpu_kernels ekv_cpu_kernels_scalar;
#if defined(__x86_64__)
extern const ekv_cpu_kernels ekv_cpu_kernels_avx2;
extern const ekv_cpu_kernels ekv_cpu_kernels_avx512;
#endif

/* The CPU stages keep per-head arrays of one group (score maxima, ALiBi terms, page bounds) on
 * the stack, sized for this many query heads; a larger group is refused, not overrun. */
#define EKV_CPU_MAX_GROUP 256
static inline ekv_status ekv_cpu_check_group(ekv_context *ctx, int64_t group) {
    if (group <= EKV_CPU_MAX_GROUP) return EKV_OK;
    return ekv_fail(ctx, EKV_ERR_UNSUPPORTED, "GQA group size %lld > %d is not supported",
                    (long long)group, EKV_CPU_MAX_GROUP);
}
#endif
