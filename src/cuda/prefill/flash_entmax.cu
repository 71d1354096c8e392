/*
 * ekv_cuda_flash_entmax_forward (include/entmaxkv/cuda.h; docs/math.md §12, §13.1): exact entmax
 * attention of B sequences of T query rows over device tensors, on the fused prefill kernel
 * (prefill_fused.cu, through ekv_cuda_prefill_attention, the model engine's entry). Per
 * sequence and per pass of `chunk` query tokens:
 *   1. q of the pass is read where it is, in its dtype (the split of the queries converts it);
 *      a q of K's dtype is exact there, so the scores take it as one part and a * scale after
 *      the product, as the backward does (docs/math.md §12);
 *   2. the fused kernel on the pass's rows (positions N - T + t0.., causal or every key; its
 *      scratch carved from the caller's workspace, sized for `chunk` tokens);
 *   3. finish_kernel: each row's tau back in z-space (the kernel keeps tau - M and M, docs/math.md
 *      §12) and, for a 16-bit out, the fp32 output of the pass converted.
 * Also the checks every entry shares (flash_check) and the workspace query.
 */
#include "flash_entmax.cuh"
#include "prefill.cuh"
#include "../../core/geometry.h"
extern "C" {
#include "../../core/internal.h" /* ekv_check_attention_params, ekv_mul_i64 (C) */
}

/* rows of a forward pass (H x tokens) when the caller leaves it to us: enough 64-row blocks of
 * the fused kernel to fill an H200 a few times over (132 SMs x 3 resident), with the candidates'
 * 12 bytes x 4096 a row (about 1.6 GB) the largest part of the workspace. The histogram scheme's
 * pool holds row_cap entries a row (1024 by default), so about the same bytes hold up to 4x
 * the rows (FLASH_PASS_GROWTH; the per-row buffers, q and out of a pass, grow with them: +6 % at
 * D 64, +11 % at D 128): 4x the blocks a launch, so a causal pass's short and long row blocks
 * even out over several waves (ncu at 32K: 16 % achieved occupancy of 25 % in one wave) and a
 * quarter of the launches. */
enum { FLASH_PASS_ROWS = 32768, FLASH_PASS_GROWTH = 4 };

/* The entries a row's list may take: the candidate scheme's EKV_PREFILL_CANDIDATES, the
 * histogram scheme's row_cap (0: EKV_PREFILL_ROW_CAP). */
static int32_t flash_list_cap(const ekv_flash_entmax_args *a) {
    if (a->tau_scheme != EKV_PREFILL_TAU_HIST) return EKV_PREFILL_CANDIDATES;
    return ekv_prefill_row_cap(a->row_cap);
}

/* Query tokens of a pass when the caller leaves it to us: FLASH_PASS_ROWS rows, times what the
 * shorter lists save (at most FLASH_PASS_GROWTH). */
static int64_t flash_pass_tokens(const ekv_flash_entmax_args *a, int64_t H) {
    int64_t grow = EKV_PREFILL_CANDIDATES / flash_list_cap(a);
    grow = grow < 1 ? 1 : grow > FLASH_PASS_GROWTH ? (int64_t)FLASH_PASS_GROWTH : grow;
    return FLASH_PASS_ROWS * grow / H;
}

static ekv_status check_tensor(ekv_context *ctx, const void *p, const char *name, uintptr_t align) {
    if (!p) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "flash entmax: %s is NULL", name);
    if ((uintptr_t)p % align)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "flash entmax: %s must be %d-byte aligned",
                        name, (int)align);
    return EKV_OK;
}

/* The dtypes and the head dim the fused kernel serves (docs/math.md §12). */
static ekv_status check_dtypes(ekv_context *ctx, const ekv_flash_entmax_args *a) {
    if (!ekv_dtype_valid(a->q_dtype) || !ekv_dtype_valid(a->kv_dtype) ||
        !ekv_dtype_valid(a->out_dtype))
        return ekv_fail(ctx, EKV_ERR_INVALID_DTYPE,
                        "flash entmax: q_dtype=%d, kv_dtype=%d and out_dtype=%d must be f32 (0), "
                        "f16 (1) or bf16 (2)",
                        (int)a->q_dtype, (int)a->kv_dtype, (int)a->out_dtype);
    if (a->out_dtype != EKV_DTYPE_F32 && a->out_dtype != a->q_dtype)
        return ekv_fail(ctx, EKV_ERR_INVALID_DTYPE,
                        "flash entmax: out_dtype=%d must be f32 (0) or q_dtype (%d)",
                        (int)a->out_dtype, (int)a->q_dtype);
    if (a->kv_dtype == EKV_DTYPE_F32 || (a->shape.head_dim != 64 && a->shape.head_dim != 128))
        return ekv_fail(ctx, EKV_ERR_UNSUPPORTED,
                        "flash entmax (cuda): K and V f16 or bf16 with head_dim 64 or 128 only "
                        "(kv_dtype=%d, head_dim=%d)",
                        (int)a->kv_dtype, a->shape.head_dim);
    return EKV_OK;
}

ekv_status flash_check(ekv_context *ctx, const ekv_flash_entmax_args *a, void *stream, int grads,
                       const void *const *extra, flash_job *J) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!a) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "flash entmax: args is NULL");
    const ekv_attention_params *p = &a->shape;
    ekv_status st = ekv_check_attention_params(ctx, p);
    if (!st) st = check_dtypes(ctx, a);
    if (st) return st;
    if (a->tau_scheme != EKV_PREFILL_TAU_CANDIDATES && a->tau_scheme != EKV_PREFILL_TAU_HIST)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "flash entmax: tau_scheme=%d must be 0 (candidates) or 1 (histogram)",
                        a->tau_scheme);
    if (a->row_cap < 0 || a->row_cap > EKV_PREFILL_CANDIDATES)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "flash entmax: row_cap=%d must be in [0, %d] (0 = %d)", a->row_cap,
                        (int)EKV_PREFILL_CANDIDATES, (int)EKV_PREFILL_ROW_CAP);
    if (a->batch < 1 || a->block_tokens < 0 || p->num_kv_heads > 65535)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "flash entmax: batch=%d must be >= 1, block_tokens=%lld >= 0 (0 = "
                        "automatic) and num_kv_heads=%d <= 65535",
                        a->batch, (long long)a->block_tokens, p->num_kv_heads);
    int64_t nq, nk;
    if (ekv_mul_i64(a->batch, p->num_queries * p->num_heads * p->head_dim, &nq) ||
        ekv_mul_i64(nq, 8, &nq) ||
        ekv_mul_i64(a->batch, p->num_keys * p->num_kv_heads * p->head_dim, &nk) ||
        ekv_mul_i64(nk, 8, &nk))
        return ekv_fail(ctx, EKV_ERR_SIZE_OVERFLOW,
                        "flash entmax: batch=%d x the shapes overflows int64 bytes", a->batch);
    /* the tensors: q, k, v, tau, then out, or dout, dq, dk, dv and ohat; the forward's ohat
     * may be NULL */
    const char *names[] = {"q", "k", "v", "tau", "out", "dout", "dq", "dk", "dv", "ohat"};
    const void *ptrs[] = {a->q,     a->k,     a->v,     a->tau,   a->out,
                          extra[0], extra[1], extra[2], extra[3], a->ohat};
    for (int i = 0; i < 10 && !st; i++) {
        const bool need = i < 4 || (i == 4 && !grads) || (i > 4 && i < 9 && grads) ||
                          (i == 9 && (grads || a->ohat));
        if (need) st = check_tensor(ctx, ptrs[i], names[i], i == 3 ? 8 : 16);
    }
    if (st) return st;
    J->a = a;
    J->B = a->batch, J->T = p->num_queries, J->N = p->num_keys, J->H = p->num_heads;
    J->Hk = p->num_kv_heads, J->G = J->H / J->Hk, J->D = p->head_dim, J->causal = p->causal;
    J->alpha = p->alpha;
    J->scale = ekv_effective_scale(p->scale, p->head_dim);
    /* z = a s (softmax: z = s, docs/math.md §0); the factor rounded as the prefill rounds it */
    J->qf = (float)((p->alpha == 1.0 ? 1.0 : p->alpha - 1.0) * (float)J->scale);
    int64_t chunk = a->block_tokens ? a->block_tokens : flash_pass_tokens(a, J->H);
    chunk = chunk < 1 ? 1 : chunk > J->T ? J->T : chunk;
    if (chunk * J->H > INT32_MAX / 2) /* the fused kernel's row lists are int32 */
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "flash entmax: block_tokens=%lld x num_heads=%d passes 2^30 rows",
                        (long long)chunk, p->num_heads);
    J->chunk = chunk;
    J->ctx = ctx;
    J->stream = (cudaStream_t)stream;
    return EKV_OK;
}

ekv_status flash_check_workspace(const flash_job &J, const void *ws, int64_t bytes, int64_t need) {
    if (!ws || (uintptr_t)ws % 256 || bytes < need)
        return ekv_fail(J.ctx, !ws ? EKV_ERR_NULL_POINTER : EKV_ERR_INVALID_SIZE,
                        "flash entmax: the workspace must be 256-byte aligned device memory of "
                        "%lld bytes (ekv_cuda_flash_entmax_workspace); got %lld bytes at %p",
                        (long long)need, (long long)bytes, ws);
    return EKV_OK;
}

/* The fused kernel's scratch for one pass (prefill.cuh) without its buffers: what it is laid
 * out for and how it runs (the defaults, and the caller's tau scheme and row cap). */
static ekv_cuda_prefill prefill_sizes(const flash_job &J) {
    ekv_cuda_prefill pf = {};
    pf.ctx = J.ctx;
    pf.stream = J.stream;
    pf.chunk = J.chunk;
    pf.nparts = ekv_cuda_prefill_parts(J.a->kv_dtype);
    pf.fused = 1;
    pf.cand_cap = flash_list_cap(J.a); /* the histogram scheme's pool: row_cap a row */
    pf.compact_at = EKV_PREFILL_COMPACT_AT;
    pf.tau_scheme = J.a->tau_scheme;
    pf.row_cap = J.a->row_cap;
    pf.key_cap = J.N; /* the tile marks' room: a pass's keys are the keys' at most */
    return pf;
}

/* The forward's pieces of the workspace: the fused kernel's scratch for one pass first
 * (ekv_cuda_prefill_layout_of), then its counters and the pass's fp32 output when the caller's
 * is 16-bit. */
struct fwd_layout {
    ekv_cuda_prefill_layout pf;
    int64_t counters, att32, total;
};

static fwd_layout forward_layout(const flash_job &J) {
    const ekv_cuda_prefill sizes = prefill_sizes(J);
    const int64_t rows = J.H * J.chunk;
    fwd_layout L;
    L.pf = ekv_cuda_prefill_layout_of(&sizes, J.H, J.Hk, J.D, J.a->kv_dtype);
    ws_carver c;
    c.at = L.pf.total;
    L.counters = c.take(PF_COUNTERS * 8);
    L.att32 = J.a->out_dtype != EKV_DTYPE_F32 ? c.take(rows * J.D * 4) : -1;
    L.total = c.at;
    return L;
}

int64_t flash_forward_bytes(const flash_job &J) { return forward_layout(J).total; }

namespace {

/* What finish_kernel reads and writes for one pass of Tc tokens. */
struct finish_args {
    int64_t Tc, H, G, D, R;
    const float *m;     /* [Hk][R] the rows' max M (the fused kernel's row order) */
    const double *trel; /* [Hk][R] tau - M */
    double *tau;        /* [Tc][H] of the pass, z-space */
    const float *att32; /* [Tc][H][D] fp32 output, or NULL when out is fp32 already */
    void *out;          /* [Tc][H][D] */
};

/* warp (t, h) (ekv_prefill_warp_row), rows t H + h in order: tau = M + (tau - M) of row (t, h),
 * and out converted from fp32 (TO). */
template <typename TO> __global__ void finish_kernel(finish_args F) {
    ekv_grid_begin();
    const int lane = threadIdx.x & 31;
    const int64_t id = ekv_prefill_warp_row();
    if (id >= F.Tc * F.H) return; /* warp-uniform */
    const int64_t t = id / F.H, h = id % F.H;
    const int64_t row = (h / F.G) * F.R + t * F.G + h % F.G;
    if (lane == 0) F.tau[id] = (double)F.m[row] + F.trel[row];
    if (!F.att32) return;
    for (int64_t d = lane; d < F.D; d += 32)
        static_cast<TO *>(F.out)[id * F.D + d] = ekv_elem<TO>::from(F.att32[id * F.D + d]);
}

} // namespace

/* One pass: tokens [t0, t0 + Tc) of sequence b (steps 1-3 of the file's comment). */
static ekv_status forward_pass(const flash_job &J, const fwd_layout &L, const ekv_cuda_prefill &pf,
                               char *base, int64_t b, int64_t t0, int64_t Tc) {
    const ekv_flash_entmax_args *a = J.a;
    const int64_t qo = ((b * J.T + t0) * J.H) * J.D, ko = b * J.N * J.Hk * J.D;
    const int64_t kes = ekv_dtype_size(a->kv_dtype);
    ekv_cuda_prefill_block blk = {};
    blk.pos0 = J.N - J.T + t0;
    blk.T = Tc;
    blk.H = J.H, blk.Hk = J.Hk, blk.D = J.D;
    blk.alpha = J.alpha;
    blk.scale = (float)J.scale;
    blk.noncausal_keys = J.causal ? 0 : J.N;
    blk.dtype = a->kv_dtype;
    blk.k = (const char *)a->k + ko * kes;
    blk.v = (const char *)a->v + ko * kes;
    blk.q = (const char *)a->q + qo * ekv_dtype_size(a->q_dtype);
    blk.q_dtype = a->q_dtype;
    blk.q_in_kv_dtype = a->q_dtype == a->kv_dtype; /* q as one part (docs/math.md §12) */
    blk.slopes = a->shape.alibi_slopes;
    blk.att = L.att32 < 0 ? (float *)a->out + qo : (float *)(base + L.att32);
    blk.ohat = a->ohat ? a->ohat + qo : NULL; /* fp32 already: written where it is */
    blk.counters = (unsigned long long *)(base + L.counters);
    ekv_status st = ekv_cuda_prefill_attention(&pf, &blk);
    if (st) return st;
    finish_args F = {Tc,
                     J.H,
                     J.G,
                     J.D,
                     Tc * J.G,
                     pf.m,
                     pf.tau,
                     a->tau + (b * J.T + t0) * J.H,
                     L.att32 < 0 ? NULL : blk.att,
                     (char *)a->out + qo * ekv_dtype_size(a->out_dtype)};
    ekv_cuda_with_dtype(a->out_dtype, [&](auto ty) {
        finish_kernel<typename decltype(ty)::type>
                <<<ekv_prefill_warp_row_blocks(Tc * J.H), 32 * EKV_PREFILL_WARP_ROWS, 0,
                   J.stream>>>(F);
    });
    FLASH_TRY(J, cudaGetLastError());
    return EKV_OK;
}

extern "C" ekv_status ekv_cuda_flash_entmax_workspace(ekv_context *ctx,
                                                      const ekv_flash_entmax_args *args,
                                                      int64_t *forward_bytes,
                                                      int64_t *backward_bytes) {
    /* the pointers are the calls' business: the query checks the shapes and dtypes only */
    const void *none[4] = {NULL, NULL, NULL, NULL};
    flash_job J;
    ekv_flash_entmax_args probe;
    if (args) {
        probe = *args;
        alignas(256) static const double any[2] = {0, 0}; /* non-NULL, aligned stand-ins */
        probe.q = probe.k = probe.v = probe.out = (void *)any;
        probe.tau = (double *)any;
        probe.ohat = NULL; /* optional in the forward's check */
    }
    ekv_status st = flash_check(ctx, args ? &probe : NULL, NULL, 0, none, &J);
    if (st) return st;
    if (forward_bytes) *forward_bytes = flash_forward_bytes(J);
    if (backward_bytes) *backward_bytes = flash_backward_bytes(J);
    ekv_clear_error(ctx);
    return EKV_OK;
}

extern "C" ekv_status ekv_cuda_flash_entmax_forward(ekv_context *ctx,
                                                    const ekv_flash_entmax_args *args,
                                                    void *workspace, int64_t workspace_bytes,
                                                    void *stream) {
    const void *none[4] = {NULL, NULL, NULL, NULL};
    flash_job J;
    ekv_status st = flash_check(ctx, args, stream, 0, none, &J);
    if (st) return st;
    const fwd_layout L = forward_layout(J);
    if ((st = flash_check_workspace(J, workspace, workspace_bytes, L.total))) return st;
    char *base = static_cast<char *>(workspace);
    ekv_cuda_prefill pf = prefill_sizes(J);
    ekv_cuda_prefill_place(&pf, &L.pf, base);
    for (int64_t b = 0; b < J.B; b++)
        for (int64_t t0 = 0; t0 < J.T; t0 += J.chunk) {
            const int64_t Tc = J.T - t0 < J.chunk ? J.T - t0 : J.chunk;
            if ((st = forward_pass(J, L, pf, base, b, t0, Tc))) return st;
        }
    ekv_clear_error(ctx);
    return EKV_OK;
}
