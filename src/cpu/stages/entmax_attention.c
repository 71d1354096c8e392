/*
 * Exact entmax attention of T query rows over N keys, forward and backward, in double on the
 * CPU (docs/math.md §13): the reference that prefill kernels and a training op are checked
 * against. One body serves the float and the double entry points (tensors are read through
 * att_in, written through att_out); every result is built in the workspace and written out
 * only when the whole call has succeeded, so an error leaves the outputs untouched.
 */
#include "../../core/internal.h"
#include "../../math/entmax_tau.h"
#include <float.h>

/* A tensor of the call: f for the float entry points, d for the double ones. */
typedef struct att_in {
    const float *f;
    const double *d;
} att_in;
typedef struct att_out {
    float *f;
    double *d;
} att_out;

static inline double at(att_in t, int64_t i) { return t.f ? (double)t.f[i] : t.d[i]; }
#define PTR(t) ((t).f ? (const void *)(t).f : (const void *)(t).d)

typedef struct att_job {
    int64_t T, N, H, Hk, G, D, nq, nk; /* nq = T*H*D, nk = N*Hk*D elements */
    double alpha, a, scale;            /* a = alpha - 1, or 1 for softmax (z = s) */
    const float *slopes;
    int causal;
    att_in q, k, v, dout;
    const double *tau_in; /* backward: the forward's tau */
    att_out out, dq, dk, dv; /* out: the forward's output, or o-hat */
    double *tau_out;         /* forward, may be NULL */
} att_job;

/* What an entry point computes. */
typedef enum att_mode { ATT_FORWARD, ATT_BACKWARD, ATT_OHAT } att_mode;

static ekv_status entry(ekv_context *ctx, const ekv_attention_params *p, att_job *j, att_mode mode);

ekv_attention_params ekv_attention_default_params(void) {
    return (ekv_attention_params){.num_queries = 1,
                                  .num_keys = 1,
                                  .num_heads = 1,
                                  .num_kv_heads = 1,
                                  .head_dim = 64,
                                  .causal = 1,
                                  .alpha = 1.5};
}

static ekv_status check_finite(ekv_context *ctx, att_in t, int64_t n, const char *name) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(at(t, i)))
            return ekv_fail(ctx, EKV_ERR_NAN_INPUT, "%s[%lld] is NaN or infinite", name,
                            (long long)i);
    return EKV_OK;
}

/* The shapes by the library's one check (ekv_check_attention_params, validate.c), the slopes
 * (host memory here), then the job. */
static ekv_status check_shape(ekv_context *ctx, const ekv_attention_params *p, att_job *j) {
    ekv_status st = ekv_check_attention_params(ctx, p);
    /* |j - i| < max(N, T): i = N - T + t is in [N - T, N), j in [0, N) */
    if (!st)
        st = ekv_check_slopes(ctx, p->alibi_slopes, p->num_heads,
                              p->num_keys > p->num_queries ? p->num_keys : p->num_queries);
    if (st) return st;
    j->T = p->num_queries, j->N = p->num_keys, j->H = p->num_heads, j->Hk = p->num_kv_heads;
    j->G = j->H / j->Hk, j->D = p->head_dim;
    j->nq = p->num_queries * p->num_heads * p->head_dim;
    j->nk = p->num_keys * p->num_kv_heads * p->head_dim;
    j->alpha = p->alpha, j->a = p->alpha == 1.0 ? 1.0 : p->alpha - 1.0;
    j->scale = ekv_effective_scale(p->scale, p->head_dim);
    j->slopes = p->alibi_slopes, j->causal = p->causal;
    return EKV_OK;
}

/* Keys row t sees: [0, n). */
static int64_t row_len(const att_job *j, int64_t t) {
    return j->causal ? j->N - j->T + t + 1 : j->N;
}

/* z-space scores of row (t, h) over its n keys: z_j = a (scale q.k_j - m_h |j - i|) with the
 * row at position i = N - T + t (docs/math.md §1.6, §13). Fails when a score overflows. */
static ekv_status row_z(ekv_context *ctx, const att_job *j, int64_t t, int64_t h, int64_t n,
                        double *z) {
    const int64_t qo = (t * j->H + h) * j->D, kh = h / j->G, i = j->N - j->T + t;
    const double m = j->slopes ? (double)j->slopes[h] : 0.0;
    for (int64_t c = 0; c < n; c++) {
        const int64_t ko = (c * j->Hk + kh) * j->D;
        double dot = 0;
        for (int64_t d = 0; d < j->D; d++) dot += at(j->q, qo + d) * at(j->k, ko + d);
        z[c] = j->a * (j->scale * dot - m * (double)(c > i ? c - i : i - c));
        if (!isfinite(z[c]))
            return ekv_fail(ctx, EKV_ERR_NAN_INPUT,
                            "the score of row %lld, head %lld, key %lld overflows a double",
                            (long long)t, (long long)h, (long long)c);
    }
    return EKV_OK;
}

/* p = [z - tau]_+^beta (softmax: exp(z - tau)) in place; returns their sum. */
static double row_weights(double *z, int64_t n, double tau, double alpha) {
    double sum = 0;
    for (int64_t c = 0; c < n; c++) sum += z[c] = ekv_entmax_weight(z[c], tau, alpha);
    return sum;
}

static void write_out(att_out o, const double *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (o.f)
            o.f[i] = (float)x[i];
        else
            o.d[i] = x[i];
}

static ekv_status forward_run(ekv_context *ctx, att_job *j) {
    const int64_t S = (int64_t)sizeof(double), rows = j->T * j->H;
    int64_t sizes[4] = {j->N * S, ekv_tau_scratch_doubles(j->N) * S, j->nq * S, rows * S}, off[4];
    ekv_status st;
    char *base = ekv_workspace_blocks(ctx, sizes, 4, off, "entmax attention", &st);
    if (!base) return st;
    double *z = (double *)(base + off[0]), *scratch = (double *)(base + off[1]);
    double *acc = (double *)(base + off[2]), *taus = (double *)(base + off[3]);
    for (int64_t t = 0; t < j->T; t++)
        for (int64_t h = 0; h < j->H; h++) {
            const int64_t n = row_len(j, t), r = t * j->H + h;
            if ((st = row_z(ctx, j, t, h, n, z))) return st;
            /* scores are finite and n >= 1, so the solve cannot fail */
            if (ekv_tau_exact_f64(z, n, j->alpha, scratch, &taus[r], NULL))
                return ekv_fail(ctx, EKV_ERR_INTERNAL, "tau solve failed on finite scores");
            const double sum = row_weights(z, n, taus[r], j->alpha);
            double *o = acc + r * j->D;
            memset(o, 0, (size_t)j->D * sizeof *o);
            for (int64_t c = 0; c < n; c++) {
                if (z[c] == 0) continue; /* outside the support: V not read (§9.7) */
                const int64_t vo = (c * j->Hk + h / j->G) * j->D;
                for (int64_t d = 0; d < j->D; d++) o[d] += z[c] * at(j->v, vo + d);
            }
            /* the exact paths divide by the computed sum (docs/math.md §0) */
            for (int64_t d = 0; d < j->D; d++) o[d] /= sum;
        }
    write_out(j->out, acc, j->nq);
    if (j->tau_out) memcpy(j->tau_out, taus, (size_t)rows * sizeof *taus);
    return EKV_OK;
}

ekv_status ekv_entmax_attention_forward(ekv_context *ctx, const ekv_attention_params *params,
                                        const float *q, const float *k, const float *v, float *out,
                                        double *tau) {
    att_job j = {.q = {q, NULL}, .k = {k, NULL}, .v = {v, NULL}, .out = {out, NULL}};
    j.tau_out = tau;
    return entry(ctx, params, &j, ATT_FORWARD);
}

ekv_status ekv_entmax_attention_forward_f64(ekv_context *ctx, const ekv_attention_params *params,
                                            const double *q, const double *k, const double *v,
                                            double *out, double *tau) {
    att_job j = {.q = {NULL, q}, .k = {NULL, k}, .v = {NULL, v}, .out = {NULL, out}};
    j.tau_out = tau;
    return entry(ctx, params, &j, ATT_FORWARD);
}

/* ---- backward (docs/math.md §13) ---- */

/* Scratch of the backward: one row's p, w and g = dout.v, and the gradients' accumulators. */
typedef struct bwd_rows {
    double *p, *w, *g, *dq, *dk, *dv;
} bwd_rows;

/* Row (t, h)'s n weights from the forward's tau into p (p = p~ / sum p~, as the forward
 * normalises them) and w = p^(2 - alpha) on the support, 0 outside (a key at tau too, §13).
 * Fails on a tau that is not the row's threshold. */
static ekv_status row_support(ekv_context *ctx, const att_job *j, int64_t t, int64_t h, int64_t n,
                              double *p, double *w) {
    const int64_t r = t * j->H + h;
    ekv_status st = row_z(ctx, j, t, h, n, p);
    if (st) return st;
    const double tau = j->tau_in[r], sum = row_weights(p, n, tau, j->alpha);
    /* the forward's tau gives sum 1 to the rounding of its solve (§0); anything else is not it */
    if (!(sum > 0) || fabs(sum - 1.0) > 1e-3)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "tau[%lld]=%.17g is not the threshold of row %lld, head %lld: its weights "
                        "sum to %g, not 1 (pass the forward's tau)",
                        (long long)r, tau, (long long)t, (long long)h, sum);
    for (int64_t c = 0; c < n; c++) {
        p[c] /= sum;
        w[c] = p[c] > 0 ? pow(p[c], 2.0 - j->alpha) : 0;
    }
    return EKV_OK;
}

/* One (row, head): p and w from the forward's tau, then ds_j = w_j (g_j - delta) on the
 * support, delta = sum w g / sum w, added to dq of the row and dk, dv of its keys. */
static ekv_status backward_row(ekv_context *ctx, const att_job *j, int64_t t, int64_t h,
                               bwd_rows *b) {
    const int64_t n = row_len(j, t), r = t * j->H + h, D = j->D, kh = h / j->G;
    ekv_status st = row_support(ctx, j, t, h, n, b->p, b->w);
    if (st) return st;
    double sw = 0, swg = 0;
    for (int64_t c = 0; c < n; c++) {
        b->g[c] = 0;
        if (!(b->w[c] > 0)) continue; /* outside S */
        const int64_t vo = (c * j->Hk + kh) * D;
        double g = 0;
        for (int64_t d = 0; d < D; d++) g += at(j->dout, r * D + d) * at(j->v, vo + d);
        b->g[c] = g;
        sw += b->w[c];
        swg += b->w[c] * g;
    }
    const double delta = swg / sw;
    double *dq = b->dq + r * D;
    for (int64_t c = 0; c < n; c++) {
        if (!(b->p[c] > 0)) continue;
        const double ds = j->scale * b->w[c] * (b->g[c] - delta); /* d/d(q.k_c) */
        const int64_t ko = (c * j->Hk + kh) * D;
        for (int64_t d = 0; d < D; d++) {
            dq[d] += ds * at(j->k, ko + d);
            b->dk[ko + d] += ds * at(j->q, r * D + d);
            b->dv[ko + d] += b->p[c] * at(j->dout, r * D + d);
        }
    }
    return EKV_OK;
}

/* Every gradient fits the output type (float: FLT_MAX), or the call fails naming the first. */
static ekv_status check_fits(ekv_context *ctx, const att_job *j, const double *x, int64_t n,
                             const char *name) {
    const double lim = j->dq.f ? (double)FLT_MAX : DBL_MAX;
    for (int64_t i = 0; i < n; i++)
        if (!(fabs(x[i]) <= lim))
            return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                            "%s[%lld]=%g overflows the output type%s", name, (long long)i, x[i],
                            j->alpha > 2.0 ? " (alpha > 2: the entmax Jacobian is unbounded near "
                                             "the edge of the support, docs/math.md §13)"
                                           : "");
    return EKV_OK;
}

static ekv_status backward_run(ekv_context *ctx, att_job *j) {
    const int64_t S = (int64_t)sizeof(double);
    int64_t sizes[6] = {j->N * S, j->N * S, j->N * S, j->nq * S, j->nk * S, j->nk * S}, off[6];
    ekv_status st;
    char *base = ekv_workspace_blocks(ctx, sizes, 6, off, "entmax attention backward", &st);
    if (!base) return st;
    bwd_rows b = {(double *)(base + off[0]), (double *)(base + off[1]), (double *)(base + off[2]),
                  (double *)(base + off[3]), (double *)(base + off[4]), (double *)(base + off[5])};
    memset(b.dq, 0, (size_t)j->nq * sizeof(double));
    memset(b.dk, 0, (size_t)j->nk * sizeof(double));
    memset(b.dv, 0, (size_t)j->nk * sizeof(double));
    for (int64_t t = 0; t < j->T; t++)
        for (int64_t h = 0; h < j->H; h++)
            if ((st = backward_row(ctx, j, t, h, &b))) return st;
    if ((st = check_fits(ctx, j, b.dq, j->nq, "dq")) ||
        (st = check_fits(ctx, j, b.dk, j->nk, "dk")) ||
        (st = check_fits(ctx, j, b.dv, j->nk, "dv")))
        return st;
    write_out(j->dq, b.dq, j->nq);
    write_out(j->dk, b.dk, j->nk);
    write_out(j->dv, b.dv, j->nk);
    return EKV_OK;
}

/* ---- o-hat (docs/math.md §13.3: the backward's delta = dout . o-hat) ---- */

/* o-hat = sum w v / sum w of every row, w from the forward's tau (row_support). */
static ekv_status ohat_run(ekv_context *ctx, att_job *j) {
    const int64_t S = (int64_t)sizeof(double);
    int64_t sizes[3] = {j->N * S, j->N * S, j->nq * S}, off[3];
    ekv_status st;
    char *base = ekv_workspace_blocks(ctx, sizes, 3, off, "entmax attention o-hat", &st);
    if (!base) return st;
    double *p = (double *)(base + off[0]), *w = (double *)(base + off[1]);
    double *acc = (double *)(base + off[2]);
    for (int64_t t = 0; t < j->T; t++)
        for (int64_t h = 0; h < j->H; h++) {
            const int64_t n = row_len(j, t), r = t * j->H + h;
            if ((st = row_support(ctx, j, t, h, n, p, w))) return st;
            double *o = acc + r * j->D, sw = 0;
            memset(o, 0, (size_t)j->D * sizeof *o);
            for (int64_t c = 0; c < n; c++) {
                if (!(w[c] > 0)) continue; /* outside S */
                const int64_t vo = (c * j->Hk + h / j->G) * j->D;
                for (int64_t d = 0; d < j->D; d++) o[d] += w[c] * at(j->v, vo + d);
                sw += w[c];
            }
            for (int64_t d = 0; d < j->D; d++) o[d] /= sw;
        }
    write_out(j->out, acc, j->nq);
    return EKV_OK;
}

/* Every entry point: its pointers, the shapes, the inputs' values, then the run. */
static ekv_status entry(ekv_context *ctx, const ekv_attention_params *p, att_job *j,
                        att_mode mode) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    static const char *const name[] = {"params", "q",    "k",  "v",  "out",
                                       "tau",    "dout", "dq", "dk", "dv"};
    const void *ptr[] = {p,         PTR(j->q),    PTR(j->k),  PTR(j->v),  PTR(j->out),
                         j->tau_in, PTR(j->dout), PTR(j->dq), PTR(j->dk), PTR(j->dv)};
    /* the pointers each mode needs: the forward 0-4, the backward 0-3 and 5-9, o-hat 0-5 */
    static const unsigned need[] = {0x1f, 0x3ef, 0x3f};
    for (int i = 0; i < 10; i++)
        if ((need[mode] >> i & 1) && !ptr[i])
            return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL",
                            i == 4 && mode == ATT_OHAT ? "ohat" : name[i]);
    ekv_status st = check_shape(ctx, p, j);
    if (!st) st = check_finite(ctx, j->q, j->nq, "q");
    if (!st) st = check_finite(ctx, j->k, j->nk, "k");
    if (!st) st = check_finite(ctx, j->v, j->nk, "v");
    if (!st && mode == ATT_BACKWARD) st = check_finite(ctx, j->dout, j->nq, "dout");
    if (!st && mode != ATT_FORWARD)
        st = check_finite(ctx, (att_in){NULL, j->tau_in}, j->T * j->H, "tau");
    EKV_GUARDED(ctx, st,
                mode == ATT_FORWARD    ? forward_run(ctx, j)
                : mode == ATT_BACKWARD ? backward_run(ctx, j)
                                       : ohat_run(ctx, j));
    if (!st) ekv_clear_error(ctx);
    return st;
}

ekv_status ekv_entmax_attention_ohat(ekv_context *ctx, const ekv_attention_params *params,
                                     const float *q, const float *k, const float *v,
                                     const double *tau, float *ohat) {
    att_job j = {.q = {q, NULL}, .k = {k, NULL}, .v = {v, NULL}, .out = {ohat, NULL}};
    j.tau_in = tau;
    return entry(ctx, params, &j, ATT_OHAT);
}

ekv_status ekv_entmax_attention_ohat_f64(ekv_context *ctx, const ekv_attention_params *params,
                                         const double *q, const double *k, const double *v,
                                         const double *tau, double *ohat) {
    att_job j = {.q = {NULL, q}, .k = {NULL, k}, .v = {NULL, v}, .out = {NULL, ohat}};
    j.tau_in = tau;
    return entry(ctx, params, &j, ATT_OHAT);
}

ekv_status ekv_entmax_attention_backward(ekv_context *ctx, const ekv_attention_params *params,
                                         const float *q, const float *k, const float *v,
                                         const double *tau, const float *dout, float *dq, float *dk,
                                         float *dv) {
    att_job j = {.q = {q, NULL}, .k = {k, NULL}, .v = {v, NULL}, .dout = {dout, NULL}};
    j.tau_in = tau, j.dq = (att_out){dq, NULL}, j.dk = (att_out){dk, NULL};
    j.dv = (att_out){dv, NULL};
    return entry(ctx, params, &j, ATT_BACKWARD);
}

ekv_status ekv_entmax_attention_backward_f64(ekv_context *ctx, const ekv_attention_params *params,
                                             const double *q, const double *k, const double *v,
                                             const double *tau, const double *dout, double *dq,
                                             double *dk, double *dv) {
    att_job j = {.q = {NULL, q}, .k = {NULL, k}, .v = {NULL, v}, .dout = {NULL, dout}};
    j.tau_in = tau, j.dq = (att_out){NULL, dq}, j.dk = (att_out){NULL, dk};
    j.dv = (att_out){NULL, dv};
    return entry(ctx, params, &j, ATT_BACKWARD);
}
