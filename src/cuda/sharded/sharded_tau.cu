/*
 * The sharded plan's kernels (sharded.cuh, docs/math.md §11): what one shard computes for the
 * agreement on tau and the merge. A head's scores are its candidate list as the tau kernel left
 * it (z >= M_j - 1 over the shard's scored tokens; for a long list the scores above a lower
 * bound of tau_j, its count written back: stages/tau.cu) or, where that overflowed, its whole
 * score row: every score that can be in the global support is there, because the global support
 * lies above max_j tau_j >= tau_j and the shard's method scored every token above tau_j.
 * A head may have no score on a shard (topk/gaussian: no page of its list there): its tau_j is
 * then -inf, and its moments, support and partial output are empty (the last shard always
 * holds the sequence's last page, so the agreed bracket is finite).
 */
#include "../stages/attend_common.cuh"
#include "../common/launch.cuh"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include "sharded.cuh"
#include "../common/splits.cuh"
#include "../stages/values.cuh"
#include "../common/weights.cuh"
#include "../../math/shard_agree.h"
#include <math_constants.h>

namespace {

enum { SH_THREADS = 256 };

struct shard_args : ekv_cuda_shape {
    ekv_paged_kv kv;
    int64_t ccap;
    int mode; /* ekv_shard_rows */
    double alpha;
    const int32_t *list_count, *row_count, *list_pages, *rows;
    const float *scores, *cand_z;
    const int64_t *cand_slot; /* the candidates' score slots (stages/tau.cu) */
    const int32_t *cand_count;
    uint32_t *ubits; /* the group-union values kernel's support bitmap (NULL: support lists) */
    int64_t cap_words;
    int32_t *ulist, *ucount; /* its union list (union_mark) */
    double *tau;
    float *tau_m; /* the agreed tau as (0, tau) for the values kernels (stages/values.cu) */
    double *tau_t;
    int64_t *support;
    float *sup_p;
    int64_t *sup_off, *sup_count;
    const ekv_agree_state *cstate;
    ekv_agree_state *state;
    double *red;
    int32_t *pending;
    float *out;
};

shard_args shard_args_of(const ekv_cuda_plan *pl, const ekv_page_table *t, int mode) {
    shard_args A;
    memset(&A, 0, sizeof A);
    ekv_cuda_set_shape(A, pl, t);
    A.ccap = pl->cand_cap;
    A.mode = mode;
    /* the support lists, not the union's bitmap (which ekv_shard_launch_support sets) */
    ekv_cuda_set_support(A, pl, mode == EKV_SHARD_LISTED, mode == EKV_SHARD_ROWS, false);
    A.cand_z = pl->cand_z;
    A.cand_slot = pl->cand_slot;
    A.cand_count = pl->cand_count;
    A.tau = pl->tau;
    A.support = pl->support;
    return A;
}

/* A head's scores: the candidates, or the score row where they overflowed (the tau kernel's
 * own choice, stages/tau.cu). */
struct head_scores {
    const float *v;
    int64_t n;
    bool overflow;
    int lrow;
    ekv_seq_geom sg;
};
__device__ head_scores scores_of(const shard_args &A, int64_t row) {
    head_scores s;
    const int b = (int)(row / A.H);
    s.lrow = b * A.Hk + (int)(row % A.H) / A.G;
    s.sg = ekv_seq(A.t, b, A.ps);
    const int64_t nc = A.cand_count[row];
    s.overflow = nc > A.ccap;
    if (!s.overflow) {
        s.v = A.cand_z + row * A.ccap;
        s.n = nc;
        return s;
    }
    int64_t begin, end;
    entry_range(A.list_count, s.sg.P, s.lrow, 3, &begin, &end);
    s.v = A.scores + row * A.cap_tokens;
    s.n = A.row_count ? (int64_t)A.row_count[s.lrow] : end * A.ps;
    return s;
}

__global__ void __launch_bounds__(SH_THREADS) summary_kernel(shard_args A) {
    ekv_grid_begin();
    __shared__ float fscratch[32];
    const int64_t row = blockIdx.x;
    const head_scores s = scores_of(A, row);
    float m = -CUDART_INF_F;
    for (int64_t i = threadIdx.x; i < s.n; i += blockDim.x) m = fmaxf(m, s.v[i]);
    m = ekv_block_max(m, fscratch, -CUDART_INF_F);
    if (threadIdx.x == 0) { /* no score (a shard with no page of the head's list): no bound */
        A.red[2 * row] = m == -CUDART_INF_F ? -CUDART_INF : A.tau[row];
        A.red[2 * row + 1] = (double)m;
    }
}

__global__ void start_kernel(shard_args A, int64_t n) {
    ekv_grid_begin();
    const int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (row < n) ekv_agree_start(&A.state[row], A.red[2 * row], A.red[2 * row + 1]);
}

__global__ void __launch_bounds__(SH_THREADS) moments_kernel(shard_args A) {
    ekv_grid_begin();
    __shared__ double scratch[32];
    const int64_t row = blockIdx.x;
    const ekv_agree_state st = A.cstate[row];
    double m[EKV_AGREE_MOMENTS] = {0, 0, 0, 0, 0, 0};
    if (!st.done) {
        const head_scores s = scores_of(A, row);
        for (int64_t i = threadIdx.x; i < s.n; i += blockDim.x)
            ekv_agree_add(m, (double)s.v[i], st.x, st.clo, st.chi, A.alpha);
    }
    for (int k = 0; k < EKV_AGREE_MOMENTS; k++) {
        const double r = ekv_block_sum(m[k], scratch);
        if (threadIdx.x == 0) A.red[EKV_AGREE_MOMENTS * row + k] = r;
    }
}

__global__ void update_kernel(shard_args A, int64_t n) {
    ekv_grid_begin();
    const int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (row >= n || A.state[row].done) return;
    if (!ekv_agree_step(&A.state[row], A.red + EKV_AGREE_MOMENTS * row, A.alpha))
        atomicAdd(&A.pending[0], 1);
}

/* The support at the agreed tau: a subset of the shard's own support (tau >= tau_j), so of its
 * candidates; listed with p and V offsets for the per-head values kernel, or, where the
 * candidates overflowed, counted over the row with the list marked full (the values kernel then
 * scans the row with tau); for the group-union values kernel its slots are marked in the
 * group's bitmap instead (as the tau kernel's final round marks them, stages/tau.cu). */
__global__ void __launch_bounds__(SH_THREADS) support_kernel(shard_args A) {
    ekv_grid_begin();
    __shared__ double scratch[32];
    __shared__ int s_n;
    const int64_t row = blockIdx.x;
    const ekv_agree_state st = A.cstate[row];
    const double tau = st.tau, beta = 1.0 / (A.alpha - 1.0);
    const head_scores s = scores_of(A, row);
    for (int d = threadIdx.x; d < A.D; d += blockDim.x) A.out[row * A.D + d] = 0.f;
    if (threadIdx.x == 0) s_n = 0;
    __syncthreads();
    double c = 0;
    const int lane = threadIdx.x & 31;
    for (int64_t base = threadIdx.x & ~31; base < s.n; base += blockDim.x) {
        const int64_t i = base + lane;
        const bool in = i < s.n && (double)s.v[i] - tau > 0;
        c += in;
        const int64_t slot = !in ? 0 : s.overflow ? i : A.cand_slot[row * A.ccap + i];
        if (A.ubits) { /* the union kernel forms p from the score rows and the agreed tau */
            union_mark(A.ubits + s.lrow * A.cap_words, A.ulist + s.lrow * A.cap_tokens,
                       A.ucount + s.lrow, slot, in);
            continue;
        }
        if (s.overflow) continue;
        const unsigned m = __ballot_sync(0xffffffffu, in);
        if (!m) continue;
        int at = 0;
        if (lane == __ffs(m) - 1) at = atomicAdd(&s_n, __popc(m));
        at = __shfl_sync(0xffffffffu, at, __ffs(m) - 1) + __popc(m & ((1u << lane) - 1));
        if (in) {
            A.sup_p[row * A.ccap + at] = entmax_p(s.v[i], tau, beta);
            const int kvh = (int)(row % A.H) / A.G;
            A.sup_off[row * A.ccap + at] =
                    A.rows ? row_offset(A.t, A.kv, A.rows, A.cap_tokens, s.lrow, s.sg.first, kvh,
                                        A.ps, slot)
                           : slot_offset(A.t, A.kv, A.list_pages, A.cap_pages, s.lrow, s.sg.first,
                                         kvh, A.ps, slot);
        }
    }
    c = ekv_block_sum(c, scratch);
    if (threadIdx.x == 0) {
        A.tau[row] = tau;
        A.tau_m[row] = 0.f;
        A.tau_t[row] = tau;
        A.support[row] = (int64_t)c;
        A.sup_count[row] = s.overflow ? A.ccap + 1 : (int64_t)c;
        if (!st.done) atomicAdd(&A.pending[1], 1);
    }
}

/* softmax's merge of log-sum-exps (state[row].lo keeps the max between the phases) */
__global__ void __launch_bounds__(SH_THREADS) lse_kernel(shard_args A, int phase) {
    ekv_grid_begin();
    const int64_t row = blockIdx.x;
    const double own = A.tau[row];
    if (phase == 0) {
        if (threadIdx.x == 0) A.red[row] = own;
        return;
    }
    if (phase == 1) {
        if (threadIdx.x == 0) {
            A.state[row].lo = A.red[row];
            A.red[row] = exp(own - A.red[row]);
        }
        return;
    }
    const double tau = A.state[row].lo + log(A.red[row]);
    const float scale = (float)exp(own - tau);
    for (int d = threadIdx.x; d < A.D; d += blockDim.x) A.out[row * A.D + d] *= scale;
    __syncthreads();
    if (threadIdx.x == 0) A.tau[row] = tau;
}

__global__ void pack_kernel(shard_args A, int64_t rows, int unpack) {
    ekv_grid_begin();
    const int64_t W = A.D + 1, n = rows * W;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = i / W, d = i % W;
        if (!unpack)
            A.red[i] = d < A.D ? (double)A.out[row * A.D + d] : (double)A.support[row];
        else if (d < A.D)
            A.out[row * A.D + d] = (float)A.red[i];
        else
            A.support[row] = (int64_t)llrint(A.red[i]);
    }
}

} // namespace

ekv_status ekv_shard_launch_summary(ekv_cuda_plan *pl, const ekv_page_table *t, int batch, int mode,
                                    double *red) {
    shard_args A = shard_args_of(pl, t, mode);
    A.red = red;
    summary_kernel<<<batch * A.H, SH_THREADS, 0, pl->stream>>>(A);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

ekv_status ekv_shard_launch_start(ekv_cuda_plan *pl, int batch, const double *red,
                                  ekv_agree_state *state) {
    shard_args A = shard_args_of(pl, NULL, 0);
    A.red = (double *)red;
    A.state = state;
    const int64_t n = (int64_t)batch * A.H;
    start_kernel<<<(unsigned)((n + 127) / 128), 128, 0, pl->stream>>>(A, n);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

ekv_status ekv_shard_launch_moments(ekv_cuda_plan *pl, const ekv_page_table *t, int batch, int mode,
                                    double alpha, const ekv_agree_state *state, double *red) {
    shard_args A = shard_args_of(pl, t, mode);
    A.alpha = alpha;
    A.cstate = state;
    A.red = red;
    moments_kernel<<<batch * A.H, SH_THREADS, 0, pl->stream>>>(A);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

ekv_status ekv_shard_launch_update(ekv_cuda_plan *pl, int batch, double alpha, const double *red,
                                   ekv_agree_state *state, int32_t *pending) {
    shard_args A = shard_args_of(pl, NULL, 0);
    A.alpha = alpha;
    A.red = (double *)red;
    A.state = state;
    A.pending = pending;
    const int64_t n = (int64_t)batch * A.H;
    EKV_CUDA_TRY(pl, cudaMemsetAsync(pending, 0, sizeof(int32_t), pl->stream));
    update_kernel<<<(unsigned)((n + 127) / 128), 128, 0, pl->stream>>>(A, n);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

ekv_status ekv_shard_launch_support(ekv_cuda_plan *pl, const ekv_paged_kv *kv,
                                    const ekv_page_table *t, int batch, int mode, double alpha,
                                    const ekv_agree_state *state, int32_t *pending, float *out) {
    shard_args A = shard_args_of(pl, t, mode);
    A.kv = *kv;
    A.alpha = alpha;
    A.cstate = state;
    A.pending = pending;
    A.out = out;
    A.ubits = ekv_cuda_values_union(pl, alpha) ? pl->ubits : NULL; /* as the values launch */
    EKV_CUDA_TRY(pl, cudaMemsetAsync(pending + 1, 0, sizeof(int32_t), pl->stream));
    support_kernel<<<batch * A.H, SH_THREADS, 0, pl->stream>>>(A);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

ekv_status ekv_shard_launch_lse(ekv_cuda_plan *pl, int batch, int phase, double *red,
                                ekv_agree_state *state, float *out) {
    shard_args A = shard_args_of(pl, NULL, 0);
    A.red = red;
    A.state = state;
    A.out = out;
    lse_kernel<<<batch * A.H, phase == 2 ? SH_THREADS : 32, 0, pl->stream>>>(A, phase);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

ekv_status ekv_shard_launch_pack(ekv_cuda_plan *pl, int batch, int unpack, double *red,
                                 float *out) {
    shard_args A = shard_args_of(pl, NULL, 0);
    A.red = red;
    A.out = out;
    const int64_t rows = (int64_t)batch * A.H, n = rows * (A.D + 1);
    const int64_t blocks = (n + 255) / 256;
    pack_kernel<<<(unsigned)(blocks < 1024 ? blocks : 1024), 256, 0, pl->stream>>>(A, rows, unpack);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}
