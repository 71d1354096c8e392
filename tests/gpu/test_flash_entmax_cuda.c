/*
 * ekv_cuda_flash_entmax_forward/backward (include/entmaxkv/cuda.h, docs/math.md §12, §13) against
 * the CPU reference in double (ekv_entmax_attention_forward_f64/ohat_f64/backward_f64) on the
 * values the device reads: q, k, v and dout are drawn, rounded to their dtypes, and the reference
 * takes the rounded values. Shapes T, N in {1, 17, 64, 300} (causal needs T <= N), H/Hk 6/2 and
 * 4/4, D 64 and 128, alpha 1, 1.5, 2, causal or not, ALiBi or not, K/V f16 and bf16, q f32 or
 * 16-bit, out f32 or q's dtype, one sequence or two, one pass or passes of 16 tokens (in both tau
 * schemes against one pass); then 4 cases of up to 1100 keys (alpha 1.25, H/Hk 8/1, q of the
 * other 16-bit type), one of 2100 x 16 heads (33600 rows: the automatic passes of the two
 * schemes differ), three with every V element offset by 4 (g and delta = dout . o-hat share a
 * large common part, D 64 and 128), and three more (no causal mask with T > N and with T < N,
 * softmax over 700 keys).
 * Tolerances (why): the device forms the scores in fp32 (exact 16-bit products, fp32 sums,
 * docs/math.md §12), so z differs from the double reference by about 1e-6; that moves tau by as
 * much, p by beta (z - tau)^(beta - 1) times it, and the output, a p-weighted mean of V rows,
 * by far less than 1e-4 max|v|. So:
 *   out:  |gpu - ref| <= u_out |ref| + 1e-4 max|v|   (u_out: the output dtype's unit roundoff,
 *         2^-8 bf16, 2^-11 f16, 0 f32: the rounding of the result itself);
 *   tau:  |gpu - ref| <= 1e-5 max(1, |ref|);
 *   o-hat (fp32, from the reference's tau): |gpu - ref| <= 1e-4 max|v| (a w-weighted mean of V
 *         rows, as out is a p-weighted one; w = p^(2 - alpha) moves as p does);
 *   dq, dk, dv: |gpu - ref| <= u |ref| + 2e-4 G, G the largest |ref| of the three (fp32 sums of
 *         up to 300 terms, then the rounding to the gradient's dtype; a gradient that is 0
 *         exactly is a cancellation of terms of that size).
 * Sparsemax (alpha 2) has no derivative where a key sits at tau (docs/math.md §13.4): a key within
 * the fp32 scores' error of tau may be in the support on one side and out on the other, so its
 * data is drawn again (next seed) until every key is at least 5e-5 from tau in double (the fp32
 * scores are within about 1e-5 of it at worst).
 * Both tau schemes of the forward (ekv_flash_entmax_args.tau_scheme, docs/math.md §12.1): each
 * case runs the candidate scheme, the histogram scheme, and the histogram scheme with row_cap 1
 * (the rows whose list would hold more than one key, nearly all, take the pool's leftover room
 * in row order while it lasts and the Newton passes after), each
 * against the reference as above, and the two schemes' tau within 1e-5 relative of each other.
 * Flat cases (every key of a KV head equal, so every row's support is its whole prefix: 1100
 * keys, past the 1024 a list takes, for the last rows) drive both routes in one call.
 * Also: two passes of the same rows agree; a second backward over a workspace of other bytes
 * gives the same bits; each invalid argument answers its status and leaves
 * out, tau, o-hat, dq, dk and dv untouched (the backward needs o-hat, the forward may skip it); the
 * workspace query is what the calls need (a byte less fails) and shrinks with block_tokens. Exit 77
 * when no CUDA device is present.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include "core/internal.h" /* ekv_store_f32, ekv_load_f32 */
#include <cuda_runtime.h>

typedef struct {
    int64_t B, T, N;
    int H, Hk, D, causal, alibi;
    double alpha;
    ekv_dtype qt, kvt, ot;
    int64_t block;
    int flat; /* every key of a KV head equal to its first: support = the whole prefix */
    double voff; /* added to every element of V: a row's g = dout . v share dout . voff, and
                  * delta = dout . o-hat with them (docs/math.md §13.3): g - delta cancels it */
} fcase;

/* One case's tensors: typed host copies (what the device reads), their values in double, the
 * device buffers, and the args that point at them. */
typedef struct {
    fcase c;
    int64_t nq, nk; /* elements of q (and out, dout, dq) and of k (v, dk, dv), all sequences */
    void *hq, *hk, *hv, *hg;
    double *q, *k, *v, *g;
    float slopes[16];
    void *dq_, *dk_, *dv_, *dg_, *dout_, *dgq_, *dgk_, *dgv_, *dws;
    double *dtau_;
    float *dohat_; /* the forward's o-hat, the backward's input */
    float *dslopes;
    int64_t fwd_bytes, bwd_bytes;
    ekv_flash_entmax_args a;
} fdata;

static double unit(ekv_dtype dt) {
    return dt == EKV_DTYPE_BF16 ? 0x1p-8 : dt == EKV_DTYPE_F16 ? 0x1p-11 : 0.0;
}

static void *dev(int64_t bytes) {
    void *p = NULL;
    if (cudaMalloc(&p, (size_t)(bytes > 0 ? bytes : 1)) != cudaSuccess) p = NULL;
    return p;
}

/* n values drawn with standard deviation sd, stored in dt at h, their stored values at d. */
static void draw(test_rng *r, void *h, double *d, int64_t n, ekv_dtype dt, double sd) {
    for (int64_t i = 0; i < n; i++) {
        ekv_store_f32(h, dt, i, (float)(sd * test_normal(r)));
        d[i] = ekv_load_f32(h, dt, i);
    }
}

static ekv_attention_params shape_of(const fcase *c, const float *slopes) {
    ekv_attention_params p = ekv_attention_default_params();
    p.num_queries = c->T, p.num_keys = c->N, p.num_heads = c->H, p.num_kv_heads = c->Hk;
    p.head_dim = c->D, p.causal = c->causal, p.alpha = c->alpha;
    p.alibi_slopes = c->alibi ? slopes : NULL;
    return p;
}

/* The smallest |z - tau| over every row and key the row sees (z in double, docs/math.md §13.1). */
static double edge_gap(const fdata *f, const double *tau) {
    const fcase *c = &f->c;
    const int64_t G = c->H / c->Hk;
    const double a = c->alpha == 1.0 ? 1.0 : c->alpha - 1.0, scale = 1.0 / sqrt((double)c->D);
    double gap = INFINITY;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t t = 0; t < c->T; t++)
            for (int64_t h = 0; h < c->H; h++) {
                const int64_t i = c->N - c->T + t, n = c->causal ? i + 1 : c->N;
                const double *q = f->q + ((b * c->T + t) * c->H + h) * c->D;
                const double m = c->alibi ? f->slopes[h] : 0.0;
                for (int64_t j = 0; j < n; j++) {
                    const double *k = f->k + ((b * c->N + j) * c->Hk + h / G) * c->D;
                    double s = 0;
                    for (int64_t d = 0; d < c->D; d++) s += q[d] * k[d];
                    const double z = a * (scale * s - m * fabs((double)(j - i)));
                    gap = fmin(gap, fabs(z - tau[(b * c->T + t) * c->H + h]));
                }
            }
    return gap;
}

/* The case's inputs from `seed` on the host and on the device, and the args. 0 on success. */
static int setup(fdata *f, const fcase *c, uint64_t seed) {
    memset(f, 0, sizeof *f);
    f->c = *c;
    f->nq = c->B * c->T * c->H * c->D, f->nk = c->B * c->N * c->Hk * c->D;
    test_rng r = {seed};
    f->hq = malloc((size_t)f->nq * 4), f->hg = malloc((size_t)f->nq * 4);
    f->hk = malloc((size_t)f->nk * 2), f->hv = malloc((size_t)f->nk * 2);
    f->q = malloc((size_t)f->nq * 8), f->g = malloc((size_t)f->nq * 8);
    f->k = malloc((size_t)f->nk * 8), f->v = malloc((size_t)f->nk * 8);
    draw(&r, f->hq, f->q, f->nq, c->qt, 3.0);
    draw(&r, f->hk, f->k, f->nk, c->kvt, 1.0);
    if (c->flat) /* key j of each (sequence, KV head) := key 0 of it */
        for (int64_t i = 0; i < f->nk; i++) {
            const int64_t d = i % c->D, hk = i / c->D % c->Hk, b = i / (c->D * c->Hk * c->N);
            const int64_t src = (b * c->N * c->Hk + hk) * c->D + d;
            ekv_store_f32(f->hk, c->kvt, i, (float)f->k[src]);
            f->k[i] = f->k[src];
        }
    draw(&r, f->hv, f->v, f->nk, c->kvt, 1.0);
    if (c->voff != 0)
        for (int64_t i = 0; i < f->nk; i++) {
            ekv_store_f32(f->hv, c->kvt, i, (float)(f->v[i] + c->voff));
            f->v[i] = ekv_load_f32(f->hv, c->kvt, i);
        }
    draw(&r, f->hg, f->g, f->nq, c->ot, 1.0);
    for (int h = 0; h < c->H; h++) f->slopes[h] = 0.25f / (float)(1 << h);
    const int64_t qes = ekv_dtype_size(c->qt), oes = ekv_dtype_size(c->ot),
                  rows = c->B * c->T * c->H;
    f->dq_ = dev(f->nq * qes), f->dk_ = dev(f->nk * 2), f->dv_ = dev(f->nk * 2);
    f->dg_ = dev(f->nq * oes), f->dout_ = dev(f->nq * oes), f->dtau_ = dev(rows * 8);
    f->dgq_ = dev(f->nq * qes), f->dgk_ = dev(f->nk * 2), f->dgv_ = dev(f->nk * 2);
    f->dslopes = dev(64), f->dohat_ = dev(f->nq * 4);
    if (!f->dq_ || !f->dk_ || !f->dv_ || !f->dg_ || !f->dout_ || !f->dtau_ || !f->dgq_ ||
        !f->dgk_ || !f->dgv_ || !f->dslopes || !f->dohat_)
        return 1;
    cudaMemcpy(f->dq_, f->hq, (size_t)(f->nq * qes), cudaMemcpyHostToDevice);
    cudaMemcpy(f->dk_, f->hk, (size_t)(f->nk * 2), cudaMemcpyHostToDevice);
    cudaMemcpy(f->dv_, f->hv, (size_t)(f->nk * 2), cudaMemcpyHostToDevice);
    cudaMemcpy(f->dg_, f->hg, (size_t)(f->nq * oes), cudaMemcpyHostToDevice);
    cudaMemcpy(f->dslopes, f->slopes, sizeof f->slopes, cudaMemcpyHostToDevice);
    ekv_flash_entmax_args *a = &f->a;
    a->shape = shape_of(c, f->dslopes);
    a->batch = (int32_t)c->B, a->q_dtype = c->qt, a->kv_dtype = c->kvt, a->out_dtype = c->ot;
    a->block_tokens = c->block;
    a->q = f->dq_, a->k = f->dk_, a->v = f->dv_, a->out = f->dout_, a->tau = f->dtau_;
    a->ohat = f->dohat_;
    return 0;
}

static void teardown(fdata *f) {
    void *h[] = {f->hq, f->hk, f->hv, f->hg, f->q, f->k, f->v, f->g};
    for (size_t i = 0; i < sizeof h / sizeof h[0]; i++) free(h[i]);
    void *d[] = {f->dq_,  f->dk_,  f->dv_,  f->dg_,     f->dout_, f->dtau_,
                 f->dgq_, f->dgk_, f->dgv_, f->dslopes, f->dws,   f->dohat_};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) cudaFree(d[i]);
}

/* max over i of |gpu_i - ref_i| - u |ref_i|, and in *mx max |ref| (the tolerance's terms) */
static double excess(const void *gpu, ekv_dtype dt, const double *ref, int64_t n, double u,
                     double *mx) {
    double worst = 0;
    *mx = 0;
    for (int64_t i = 0; i < n; i++) {
        const double x = ekv_load_f32(gpu, dt, i), e = fabs(x - ref[i]) - u * fabs(ref[i]);
        worst = e > worst || x != x ? (x != x ? INFINITY : e) : worst;
        *mx = fmax(*mx, fabs(ref[i]));
    }
    return worst;
}

static void *host_copy(const void *d, int64_t bytes) {
    void *h = malloc((size_t)bytes);
    cudaMemcpy(h, d, (size_t)bytes, cudaMemcpyDeviceToHost);
    return h;
}

/* The reference's forward (out, tau) or, with out NULL, backward from tau (dq, dk, dv), every
 * sequence on its own (the reference has no batch). */
static ekv_status reference(ekv_context *ctx, const fdata *f, double *out, double *tau, double *dq,
                            double *dk, double *dv) {
    const fcase *c = &f->c;
    const ekv_attention_params p = shape_of(c, f->slopes);
    const int64_t sq = c->T * c->H * c->D, sk = c->N * c->Hk * c->D, st = c->T * c->H;
    ekv_status s = EKV_OK;
    for (int64_t b = 0; b < c->B && !s; b++)
        s = out ? ekv_entmax_attention_forward_f64(ctx, &p, f->q + b * sq, f->k + b * sk,
                                                   f->v + b * sk, out + b * sq, tau + b * st)
                : ekv_entmax_attention_backward_f64(ctx, &p, f->q + b * sq, f->k + b * sk,
                                                    f->v + b * sk, tau + b * st, f->g + b * sq,
                                                    dq + b * sq, dk + b * sk, dv + b * sk);
    return s;
}

/* The reference's o-hat from its tau, every sequence on its own. */
static ekv_status reference_ohat(ekv_context *ctx, const fdata *f, const double *tau,
                                 double *ohat) {
    const fcase *c = &f->c;
    const ekv_attention_params p = shape_of(c, f->slopes);
    const int64_t sq = c->T * c->H * c->D, sk = c->N * c->Hk * c->D, st = c->T * c->H;
    ekv_status s = EKV_OK;
    for (int64_t b = 0; b < c->B && !s; b++)
        s = ekv_entmax_attention_ohat_f64(ctx, &p, f->q + b * sq, f->k + b * sk, f->v + b * sk,
                                          tau + b * st, ohat + b * sq);
    return s;
}

/* The device forward against the reference's out, tau and o-hat (fp32 on the device: within
 * 1e-4 max|v|, as out less its own rounding); *gpu_out and *gpu_tau get its output and tau
 * (host). */
static void check_forward(ekv_context *ctx, fdata *f, const double *rout, const double *rtau,
                          const double *rohat, const char *name, void **gpu_out, double **gpu_tau) {
    const fcase *c = &f->c;
    const int64_t rows = c->B * c->T * c->H, ob = f->nq * ekv_dtype_size(c->ot);
    ekv_status s = ekv_cuda_flash_entmax_forward(ctx, &f->a, f->dws, f->fwd_bytes, NULL);
    CHECK(s == EKV_OK, "%s: forward: %s", name, ekv_last_error(ctx));
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "%s: forward: %s", name,
          cudaGetErrorString(cudaGetLastError()));
    void *out = host_copy(f->dout_, ob);
    double *tau = host_copy(f->dtau_, rows * 8), vmax = 0, mx, terr = 0;
    for (int64_t i = 0; i < f->nk; i++) vmax = fmax(vmax, fabs(f->v[i]));
    const double e = excess(out, c->ot, rout, f->nq, unit(c->ot), &mx);
    for (int64_t i = 0; i < rows; i++)
        terr = fmax(terr, fabs(tau[i] - rtau[i]) / fmax(1.0, fabs(rtau[i])));
    CHECK(e <= 1e-4 * vmax, "%s: out: max |gpu - ref| - u|ref| = %.3g > 1e-4 max|v| (%.3g)", name,
          e, vmax);
    CHECK(terr <= 1e-5, "%s: tau: max relative difference %.3g > 1e-5", name, terr);
    float *ohat = host_copy(f->dohat_, f->nq * 4);
    const double eh = excess(ohat, EKV_DTYPE_F32, rohat, f->nq, 0.0, &mx);
    CHECK(eh <= 1e-4 * vmax, "%s: ohat: max |gpu - ref| = %.3g > 1e-4 max|v| (%.3g)", name, eh,
          vmax);
    free(ohat);
    printf("  %-58s out %.1e tau %.1e ohat %.1e\n", name, e / vmax, terr, eh / vmax);
    *gpu_tau = tau;
    *gpu_out = out;
}

/* The histogram scheme (row_cap 0: the default cap; 1: every row over one entry a list only
 * where the pool's room lasts, the rest by Newton passes)
 * against the reference, and its tau against the candidate scheme's (tau0). */
static void check_hist(ekv_context *ctx, fdata *f, const double *rout, const double *rtau,
                       const double *rohat, const double *tau0, const char *name, int32_t row_cap) {
    char hname[200];
    snprintf(hname, sizeof hname, "%s hist%s", name, row_cap ? " cap 1" : "");
    f->a.tau_scheme = 1;
    f->a.row_cap = row_cap;
    void *out = NULL;
    double *tau = NULL, diff = 0;
    check_forward(ctx, f, rout, rtau, rohat, hname, &out, &tau);
    const int64_t rows = f->c.B * f->c.T * f->c.H;
    for (int64_t i = 0; i < rows; i++)
        diff = fmax(diff, fabs(tau[i] - tau0[i]) / fmax(1.0, fabs(tau0[i])));
    CHECK(diff <= 1e-5, "%s: tau of the two schemes differ by %.3g relative", hname, diff);
    f->a.tau_scheme = 0;
    f->a.row_cap = 0;
    free(out);
    free(tau);
}

/* The device backward (from the device forward's tau and o-hat) against the reference's (from
 * its own tau). */
static void check_backward(ekv_context *ctx, fdata *f, double *rtau, const char *name) {
    const fcase *c = &f->c;
    double *ref = calloc((size_t)(f->nq + 2 * f->nk), 8);
    ekv_status s = reference(ctx, f, NULL, rtau, ref, ref + f->nq, ref + f->nq + f->nk);
    CHECK(s == EKV_OK, "%s: reference backward: %s", name, ekv_last_error(ctx));
    s = ekv_cuda_flash_entmax_backward(ctx, &f->a, f->dg_, f->dgq_, f->dgk_, f->dgv_, f->dws,
                                       f->bwd_bytes, NULL);
    CHECK(s == EKV_OK, "%s: backward: %s", name, ekv_last_error(ctx));
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "%s: backward: %s", name,
          cudaGetErrorString(cudaGetLastError()));
    const void *dev_[3] = {f->dgq_, f->dgk_, f->dgv_};
    const ekv_dtype dt[3] = {c->qt, c->kvt, c->kvt};
    const int64_t n[3] = {f->nq, f->nk, f->nk}, off[3] = {0, f->nq, f->nq + f->nk};
    const char *what[3] = {"dq", "dk", "dv"};
    /* The scale is the case's largest gradient, not each tensor's own: a gradient that is 0
     * exactly (one key: ds = w (g - delta) = 0, so dk = dq = 0) comes out of cancelling terms
     * of the size of the others, within their rounding. */
    double e[3], mx[3], scale = 0;
    void *h[3];
    for (int i = 0; i < 3; i++) {
        h[i] = host_copy(dev_[i], n[i] * ekv_dtype_size(dt[i]));
        e[i] = excess(h[i], dt[i], ref + off[i], n[i], unit(dt[i]), &mx[i]);
        scale = fmax(scale, mx[i]);
    }
    /* A second call over a workspace of other bytes gives the same bits: every gradient is
     * summed in an order fixed by the shape (no atomics), and nothing reads scratch that the
     * call did not write (docs/math.md §13.3, "On tensor cores"). */
    cudaMemset(f->dws, 0x5a, (size_t)f->bwd_bytes);
    s = ekv_cuda_flash_entmax_backward(ctx, &f->a, f->dg_, f->dgq_, f->dgk_, f->dgv_, f->dws,
                                       f->bwd_bytes, NULL);
    CHECK(s == EKV_OK && cudaDeviceSynchronize() == cudaSuccess, "%s: second backward", name);
    for (int i = 0; i < 3; i++) {
        const size_t bytes = (size_t)(n[i] * ekv_dtype_size(dt[i]));
        void *again = host_copy(dev_[i], (int64_t)bytes);
        CHECK(memcmp(h[i], again, bytes) == 0, "%s: %s differs between two calls", name, what[i]);
        free(again);
        free(h[i]);
    }
    printf("  %-58s", "");
    for (int i = 0; i < 3; i++) {
        CHECK(e[i] <= 2e-4 * scale,
              "%s: %s: max |gpu - ref| - u|ref| = %.3g > 2e-4 of the largest gradient (%.3g)",
              name, what[i], e[i], scale);
        printf(" %s %.1e", what[i], scale > 0 ? e[i] / scale : e[i]);
    }
    printf("\n");
    free(ref);
}

/* The forward of tau scheme `scheme` with block_tokens `block` into a host copy of out (NULL
 * when it failed, counted); *bytes: the workspace it took. */
static void *forward_out(ekv_context *ctx, fdata *f, int32_t scheme, int64_t block, int64_t *bytes,
                         const char *name) {
    ekv_flash_entmax_args a = f->a;
    a.tau_scheme = scheme;
    a.block_tokens = block;
    *bytes = 0;
    CHECK(ekv_cuda_flash_entmax_workspace(ctx, &a, bytes, NULL) == EKV_OK, "%s: query", name);
    void *ws = dev(*bytes);
    const ekv_status s = ekv_cuda_flash_entmax_forward(ctx, &a, ws, *bytes, NULL);
    CHECK(s == EKV_OK, "%s: %s", name, ekv_last_error(ctx));
    cudaDeviceSynchronize();
    cudaFree(ws);
    return s ? NULL : host_copy(f->dout_, f->nq * ekv_dtype_size(f->c.ot));
}

/* In either tau scheme the same rows in passes of c->block tokens and in one automatic pass
 * agree (each row is computed alike wherever it lands, docs/math.md §12), and the smaller
 * passes need less workspace. */
static void check_passes(ekv_context *ctx, fdata *f, const char *name, int32_t scheme) {
    int64_t small = 0, big = 0;
    void *parts = forward_out(ctx, f, scheme, f->c.block, &small, name);
    void *one = forward_out(ctx, f, scheme, 0, &big, name);
    CHECK(big > small,
          "%s: scheme %d: %lld workspace bytes for passes of %lld tokens, %lld for one", name,
          scheme, (long long)small, (long long)f->c.block, (long long)big);
    double diff = 0, vmax = 0;
    for (int64_t i = 0; parts && one && i < f->nq; i++)
        diff = fmax(diff,
                    fabs((double)ekv_load_f32(one, f->c.ot, i) - ekv_load_f32(parts, f->c.ot, i)));
    for (int64_t i = 0; i < f->nk; i++) vmax = fmax(vmax, fabs(f->v[i]));
    CHECK(diff <= 1e-6 * vmax, "%s: scheme %d: passes of %lld tokens and one pass differ by %.3g",
          name, scheme, (long long)f->c.block, diff);
    free(parts);
    free(one);
}

static void run_case(ekv_context *ctx, const fcase *c, uint64_t seed) {
    char name[160];
    snprintf(name, sizeof name, "B%lld T%lld N%lld H%d/%d D%d a%g %s%s kv %s q %s out %s%s%s%s",
             (long long)c->B, (long long)c->T, (long long)c->N, c->H, c->Hk, c->D, c->alpha,
             c->causal ? "causal" : "all", c->alibi ? " alibi" : "", ekv_dtype_name(c->kvt),
             ekv_dtype_name(c->qt), ekv_dtype_name(c->ot), c->block ? " passes" : "",
             c->flat ? " flat" : "", c->voff != 0 ? " v offset" : "");
    fdata f;
    const int64_t rows = c->B * c->T * c->H;
    double *rout = malloc((size_t)(c->B * c->T * c->H * c->D) * 8),
           *rohat = malloc((size_t)(c->B * c->T * c->H * c->D) * 8),
           *rtau = malloc((size_t)rows * 8);
    for (int tries = 0;; tries++) {
        if (setup(&f, c, seed + 7919u * (uint64_t)tries)) {
            CHECK(0, "%s: no device memory", name);
            break;
        }
        CHECK(reference(ctx, &f, rout, rtau, NULL, NULL, NULL) == EKV_OK, "%s: reference: %s", name,
              ekv_last_error(ctx));
        if (c->alpha != 2.0 || edge_gap(&f, rtau) >= 5e-5) break;
        CHECK(tries < 39, "%s: no draw in 40 keeps every key 5e-5 from tau", name);
        if (tries == 39) break;
        teardown(&f);
    }
    CHECK(reference_ohat(ctx, &f, rtau, rohat) == EKV_OK, "%s: reference o-hat: %s", name,
          ekv_last_error(ctx));
    ekv_status s = ekv_cuda_flash_entmax_workspace(ctx, &f.a, &f.fwd_bytes, &f.bwd_bytes);
    CHECK(s == EKV_OK, "%s: workspace: %s", name, ekv_last_error(ctx));
    f.dws = dev(f.fwd_bytes > f.bwd_bytes ? f.fwd_bytes : f.bwd_bytes);
    if (!s && f.dws) {
        void *out = NULL;
        double *tau0 = NULL;
        check_forward(ctx, &f, rout, rtau, rohat, name, &out, &tau0);
        check_hist(ctx, &f, rout, rtau, rohat, tau0, name, 0);
        check_hist(ctx, &f, rout, rtau, rohat, tau0, name, 1);
        if (c->block)
            for (int32_t scheme = 0; scheme < 2; scheme++) check_passes(ctx, &f, name, scheme);
        if (!c->flat) /* the flat cases are about the forward's two routes */
            check_backward(ctx, &f, rtau, name);
        free(out);
        free(tau0);
    }
    teardown(&f);
    free(rout);
    free(rohat);
    free(rtau);
}

/* Every output byte still 0x5a (the sentinel check_invalid writes). */
static int untouched(const fdata *f) {
    const void *d[6] = {f->dout_, f->dtau_, f->dgq_, f->dgk_, f->dgv_, f->dohat_};
    const int64_t n[6] = {f->nq * ekv_dtype_size(f->c.ot),
                          f->c.B * f->c.T * f->c.H * 8,
                          f->nq * ekv_dtype_size(f->c.qt),
                          f->nk * 2,
                          f->nk * 2,
                          f->nq * 4};
    int ok = 1;
    for (int i = 0; i < 6; i++) {
        unsigned char *h = host_copy(d[i], n[i]);
        for (int64_t j = 0; j < n[i]; j++) ok &= h[j] == 0x5a;
        free(h);
    }
    return ok;
}

static void try_bad(ekv_context *ctx, fdata *f, ekv_flash_entmax_args a, void *ws, int64_t bytes,
                    const void *const *g, int backward, ekv_status want, const char *what) {
    const ekv_status s =
            backward ? ekv_cuda_flash_entmax_backward(ctx, &a, g[0], (void *)g[1], (void *)g[2],
                                                      (void *)g[3], ws, bytes, NULL)
                     : ekv_cuda_flash_entmax_forward(ctx, &a, ws, bytes, NULL);
    CHECK(s == want, "%s (%s): %s, want %s (%s)", what, backward ? "backward" : "forward",
          ekv_status_string(s), ekv_status_string(want), ekv_last_error(ctx));
    cudaDeviceSynchronize();
    CHECK(untouched(f), "%s (%s): an output changed", what, backward ? "backward" : "forward");
}

/* Each invalid argument answers its status and changes no output (forward and backward). */
static void check_invalid(ekv_context *ctx) {
    const fcase c = {1, 17, 17, 4, 4, 64, 1, 0, 1.5, EKV_DTYPE_BF16, EKV_DTYPE_BF16, EKV_DTYPE_BF16,
                     0, 0,  0};
    fdata f;
    if (setup(&f, &c, 42)) {
        CHECK(0, "invalid: no device memory");
        teardown(&f);
        return;
    }
    CHECK(ekv_cuda_flash_entmax_workspace(ctx, &f.a, &f.fwd_bytes, &f.bwd_bytes) == EKV_OK,
          "invalid: query: %s", ekv_last_error(ctx));
    const int64_t bytes = f.fwd_bytes > f.bwd_bytes ? f.fwd_bytes : f.bwd_bytes;
    f.dws = dev(bytes + 256);
    const void *d[6] = {f.dout_, f.dtau_, f.dgq_, f.dgk_, f.dgv_, f.dohat_};
    const int64_t n[6] = {f.nq * 2, c.T * c.H * 8, f.nq * 2, f.nk * 2, f.nk * 2, f.nq * 4};
    for (int i = 0; i < 6; i++) cudaMemset((void *)d[i], 0x5a, (size_t)n[i]);
    const void *g[4] = {f.dg_, f.dgq_, f.dgk_, f.dgv_};
    CHECK(ekv_cuda_flash_entmax_forward(NULL, &f.a, f.dws, bytes, NULL) == EKV_ERR_NULL_POINTER,
          "ctx NULL");
    CHECK(ekv_cuda_flash_entmax_forward(ctx, NULL, f.dws, bytes, NULL) == EKV_ERR_NULL_POINTER,
          "args NULL");
    for (int bw = 0; bw < 2; bw++) {
        ekv_flash_entmax_args a;
#define BAD(mutation, want, what)                                                                  \
    do {                                                                                           \
        a = f.a;                                                                                   \
        mutation;                                                                                  \
        try_bad(ctx, &f, a, f.dws, bytes, g, bw, want, what);                                      \
    } while (0)
        BAD(a.batch = 0, EKV_ERR_INVALID_SIZE, "batch 0");
        BAD(a.block_tokens = -1, EKV_ERR_INVALID_SIZE, "block_tokens -1");
        BAD(a.tau_scheme = 2, EKV_ERR_INVALID_ARGUMENT, "tau_scheme 2");
        BAD(a.row_cap = -1, EKV_ERR_INVALID_SIZE, "row_cap -1");
        BAD(a.row_cap = 4097, EKV_ERR_INVALID_SIZE, "row_cap 4097");
        BAD(a.shape.head_dim = 96, EKV_ERR_UNSUPPORTED, "head_dim 96");
        BAD(a.kv_dtype = EKV_DTYPE_F32, EKV_ERR_UNSUPPORTED, "K/V f32");
        BAD(a.kv_dtype = (ekv_dtype)7, EKV_ERR_INVALID_DTYPE, "kv_dtype 7");
        BAD(a.out_dtype = EKV_DTYPE_F16, EKV_ERR_INVALID_DTYPE, "out f16 for bf16 q");
        BAD(a.shape.alpha = 0.5, EKV_ERR_INVALID_ALPHA, "alpha 0.5");
        BAD(a.shape.scale = -1.f, EKV_ERR_INVALID_ARGUMENT, "scale -1");
        BAD(a.shape.num_keys = 16, EKV_ERR_INVALID_SIZE, "causal T > N");
        BAD(a.shape.num_kv_heads = 3, EKV_ERR_HEAD_MISMATCH, "H 4, Hk 3");
        BAD(a.q = NULL, EKV_ERR_NULL_POINTER, "q NULL");
        BAD(a.k = (const char *)a.k + 2, EKV_ERR_INVALID_ARGUMENT, "k misaligned");
        BAD(a.tau = NULL, EKV_ERR_NULL_POINTER, "tau NULL");
        BAD(a.ohat = (float *)a.ohat + 1, EKV_ERR_INVALID_ARGUMENT, "ohat misaligned");
        if (!bw) BAD(a.out = NULL, EKV_ERR_NULL_POINTER, "out NULL");
        if (bw) BAD(a.ohat = NULL, EKV_ERR_NULL_POINTER, "ohat NULL");
        a = f.a;
        try_bad(ctx, &f, a, NULL, bytes, g, bw, EKV_ERR_NULL_POINTER, "workspace NULL");
        try_bad(ctx, &f, a, f.dws, (bw ? f.bwd_bytes : f.fwd_bytes) - 1, g, bw,
                EKV_ERR_INVALID_SIZE, "workspace a byte short");
        try_bad(ctx, &f, a, (char *)f.dws + 16, bytes, g, bw, EKV_ERR_INVALID_SIZE,
                "workspace misaligned");
#undef BAD
    }
    for (int i = 0; i < 4; i++) { /* the backward's own tensors */
        const void *gb[4] = {g[0], g[1], g[2], g[3]};
        gb[i] = i == 2 ? (const char *)g[i] + 2 : NULL;
        try_bad(ctx, &f, f.a, f.dws, bytes, gb, 1,
                i == 2 ? EKV_ERR_INVALID_ARGUMENT : EKV_ERR_NULL_POINTER,
                i == 0   ? "dout NULL"
                : i == 1 ? "dq NULL"
                : i == 2 ? "dk misaligned"
                         : "dv NULL");
    }
    /* the backward does not read out, nor the forward need o-hat: NULL is fine there */
    ekv_flash_entmax_args a = f.a;
    a.out = NULL;
    CHECK(ekv_cuda_flash_entmax_backward(ctx, &a, g[0], (void *)g[1], (void *)g[2], (void *)g[3],
                                         f.dws, f.bwd_bytes, NULL) == EKV_OK,
          "backward with out NULL: %s", ekv_last_error(ctx));
    a = f.a;
    a.ohat = NULL;
    CHECK(ekv_cuda_flash_entmax_forward(ctx, &a, f.dws, f.fwd_bytes, NULL) == EKV_OK,
          "forward with ohat NULL: %s", ekv_last_error(ctx));
    teardown(&f);
    printf("  invalid arguments: statuses and untouched outputs checked\n");
}

int main(void) {
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("test_flash_entmax_cuda: no CUDA device, skipped\n");
        return 77;
    }
    ekv_context *ctx = NULL;
    if (ekv_context_create(NULL, &ctx)) return 1;
    static const int64_t TN[][2] = {{1, 1},   {1, 17},   {17, 17},   {17, 64}, {64, 64},
                                    {1, 300}, {64, 300}, {300, 300}, {300, 64}};
    static const double alphas[] = {1.0, 1.5, 2.0};
    static const ekv_dtype kvs[] = {EKV_DTYPE_F16, EKV_DTYPE_BF16};
    int i = 0;
    for (size_t p = 0; p < sizeof TN / sizeof TN[0]; p++)
        for (int ai = 0; ai < 3; ai++)
            for (int ki = 0; ki < 2; ki++, i++) {
                /* the other choices from the bits of a hash of the case number, so that each
                 * alpha meets each of them (a plain rotation tied them to alpha's period) */
                uint32_t x = (uint32_t)i * 2654435761u;
                x ^= x >> 15, x *= 2246822519u, x ^= x >> 13;
                fcase c;
                c.T = TN[p][0], c.N = TN[p][1], c.alpha = alphas[ai], c.kvt = kvs[ki];
                c.D = x & 1 ? 128 : 64;
                c.H = x >> 1 & 1 ? 4 : 6, c.Hk = c.H == 4 ? 4 : 2;
                c.causal = c.T <= c.N && (x >> 2) % 3 != 2;
                c.alibi = x >> 4 & 1;
                c.qt = x >> 5 & 1 ? EKV_DTYPE_F32 : c.kvt;
                c.ot = x >> 6 & 1 ? EKV_DTYPE_F32 : c.qt;
                c.B = (x >> 7) % 7 == 3 ? 2 : 1;
                c.block = c.T >= 64 && (x >> 10 & 1) ? 16 : 0;
                c.flat = 0, c.voff = 0;
                run_case(ctx, &c, 0x9e3779b97f4a7c15ull + 1000003ull * (uint64_t)i);
            }
    /* flat rows: support = the prefix, up to 1100 keys (the last 76 rows past a list's 1024),
     * alpha 1.5 and 2, a softer alpha 1.25 and a harder 3, ALiBi off (it would tilt them) */
    static const double flat_alphas[] = {1.5, 2.0, 1.25, 3.0};
    for (int ai = 0; ai < 4; ai++, i++) {
        static const fcase flat = {
                1, 1100, 1100, 4, 4, 64, 1, 0, 1.5, EKV_DTYPE_BF16, EKV_DTYPE_BF16, EKV_DTYPE_F32,
                0, 1,    0};
        fcase c = flat;
        c.alpha = flat_alphas[ai];
        if (ai & 1) c.qt = EKV_DTYPE_F32, c.kvt = EKV_DTYPE_F16;
        run_case(ctx, &c, 0x9e3779b97f4a7c15ull + 1000003ull * (uint64_t)i);
    }
    /* beside the table: alpha 1.25 (the general power), a 16-bit q of the other 16-bit type
     * (the backward splits it), and prefixes of many 64-key tiles and 16-row blocks (the
     * backward's keys pass skips the row blocks before a tile; its rows pass ends mid-tile) */
    static const fcase extra[] = {
            {1, 200, 1100, 6, 2, 64, 1, 1, 1.25, EKV_DTYPE_F16, EKV_DTYPE_BF16, EKV_DTYPE_F16, 0, 0,
             0},
            {2, 130, 700, 4, 4, 128, 0, 0, 1.25, EKV_DTYPE_BF16, EKV_DTYPE_F16, EKV_DTYPE_F32, 0, 0,
             0},
            {1, 700, 700, 6, 2, 128, 1, 1, 1.5, EKV_DTYPE_BF16, EKV_DTYPE_BF16, EKV_DTYPE_BF16, 0,
             0, 0},
            {1, 333, 1000, 8, 1, 64, 1, 0, 1.0, EKV_DTYPE_F32, EKV_DTYPE_F16, EKV_DTYPE_F32, 0, 0,
             0},
            /* 33600 rows: two automatic passes of the candidate scheme, one of the histogram
             * scheme's (4x the rows: flash_entmax.cu, FLASH_PASS_GROWTH) */
            {1, 2100, 2100, 16, 2, 64, 1, 0, 1.5, EKV_DTYPE_BF16, EKV_DTYPE_BF16, EKV_DTYPE_BF16, 0,
             0, 0},
            /* V offset by 4 in every dim: g and delta = dout . o-hat share a large common part
             * that g - delta cancels (D 64 and 128, 16-bit q and dout) */
            {1, 700, 700, 6, 2, 64, 1, 0, 1.5, EKV_DTYPE_BF16, EKV_DTYPE_BF16, EKV_DTYPE_BF16, 0, 0,
             4.0},
            {1, 300, 300, 4, 4, 64, 1, 1, 1.25, EKV_DTYPE_F16, EKV_DTYPE_F16, EKV_DTYPE_F16, 0, 0,
             4.0},
            {1, 300, 300, 6, 2, 128, 1, 0, 1.5, EKV_DTYPE_BF16, EKV_DTYPE_BF16, EKV_DTYPE_BF16, 0,
             0, 4.0},
            /* the same without a causal mask (T > N; T < N with ALiBi and sparsemax) and for
             * softmax over long rows */
            {1, 300, 64, 4, 4, 64, 0, 0, 1.5, EKV_DTYPE_BF16, EKV_DTYPE_BF16, EKV_DTYPE_BF16, 0, 0,
             4.0},
            {1, 200, 300, 6, 2, 64, 0, 1, 2.0, EKV_DTYPE_BF16, EKV_DTYPE_BF16, EKV_DTYPE_BF16, 0, 0,
             0},
            {1, 700, 700, 6, 2, 64, 1, 0, 1.0, EKV_DTYPE_F16, EKV_DTYPE_F16, EKV_DTYPE_F16, 0, 0,
             4.0}};
    for (size_t e = 0; e < sizeof extra / sizeof extra[0]; e++, i++)
        run_case(ctx, &extra[e], 0x9e3779b97f4a7c15ull + 1000003ull * (uint64_t)i);
    check_invalid(ctx);
    ekv_context_free(ctx);
    return test_finish("test_flash_entmax_cuda");
}
