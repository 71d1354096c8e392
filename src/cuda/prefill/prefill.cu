/*
 * Dense prefill attention on tensor cores (docs/math.md §12), the entry and the GEMM path (the
 * fused kernel, prefill_fused.cu, takes over after step 1 when pf->fused): for a
 * block of T query tokens at positions pos0.. and each KV head g, the G query heads of g times
 * the T tokens are R = T*G rows of one GEMM against the head's keys [0, pos0 + T) in the cache:
 *   1. q' = a*scale*q split exactly into parts of K's dtype (docs/math.md §12, as §3.1 does
 *      for decode), rows laid out [Hk][T*G][D]; a q exact in K's dtype is one part, q itself,
 *      and a*scale goes to the row's factor instead of 2^-s;
 *   2. S = sum over parts of q'_part . K^T (cuBLAS, fp32 accumulation, batched over KV heads);
 *   3. per row: z = S * 2^-s + a*m_h*(j - i) over the causal prefix j <= i, the max M, the
 *      candidates z > M - 1, tau by the backend's solver (tau_solve.cuh), p = [z - tau]_+^beta
 *      split into parts of V's dtype (zero for j > i);
 *   4. O = sum over parts of P_part . V (cuBLAS), divided by the row's sum of p (the CPU's
 *      exact paths divide by the computed sum too, docs/math.md §0) on the way back to the
 *      [T][H][D] layout.
 * Each row is exact entmax over its prefix: the dense method's result, token by token.
 */
#include "prefill.cuh"
#include "prefill_common.cuh"
#include "../common/reduce.cuh"
#include "../common/tau_solve.cuh"
#include "../../core/geometry.h"

namespace {

enum { ROW_THREADS = 256, ROW_CANDS = 4096, ROW_ROUNDS = 4 };

/* z of key j for the query at position i: the GEMM's sum unshifted, plus ALiBi (docs/math.md §1.6)
 */
struct row_z {
    const float *S;
    float shift;
    double am;
    int64_t i;
    __device__ float operator()(int64_t j) const {
        return S[j] * shift + (float)(am * (double)(j - i));
    }
};

/* tau - M of one row (every thread of the block). The candidates y = z - M > thr are gathered
 * in shared memory, thr = -1 first (docs/math.md §0). When more than ROW_CANDS pass, the
 * threshold of the ROW_CANDS kept (a subset, solved about its own max) is a lower bound on tau
 * (docs/math.md §9.1), so the next pass keeps only what exceeds it (minus 1e-6, for the
 * solve's rounding): still a superset of the support, whose threshold is tau. A row that
 * overflows ROW_ROUNDS times is solved whole (the same tau); *whole = 1 then, and zrow holds z. */
template <typename Z>
__device__ double row_tau(const Z &z, float *zrow, int64_t n, float M, double alpha, float *cand,
                          int *ncand, double *scratch, float *fscratch, int *whole) {
    double thr = -1.0;
    *whole = 0;
    for (int round = 0; round < ROW_ROUNDS; round++) {
        __syncthreads(); /* the previous round's readers of ncand and cand are done */
        if (threadIdx.x == 0) *ncand = 0;
        __syncthreads();
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            const float v = z(j);
            if ((double)v - (double)M > thr) {
                const int k = atomicAdd(ncand, 1);
                if (k < ROW_CANDS) cand[k] = v;
            }
        }
        __syncthreads();
        const int nc = *ncand;
        if (nc <= ROW_CANDS) return solve_tau(cand, nc, M, alpha, scratch);
        const double lb = subset_threshold(cand, ROW_CANDS, alpha, scratch, fscratch) - (double)M;
        thr = lb - 1e-6 > thr ? lb - 1e-6 : thr;
    }
    __syncthreads();
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) zrow[j] = z(j);
    __syncthreads();
    *whole = 1;
    return solve_tau(zrow, n, M, alpha, scratch);
}

/* block (r, g): one query row's exact entmax over its causal prefix, written as P parts
 * (unnormalised; 1 / sum p goes to rinv and gather_heads_kernel applies it). The scores row is
 * read three times and never written: max, candidates, P. */
template <typename T>
__global__ void __launch_bounds__(ROW_THREADS) row_entmax_kernel(prefill_args A) {
    ekv_grid_begin();
    __shared__ double scratch[128];
    __shared__ float fscratch[32];
    __shared__ float cand[ROW_CANDS];
    __shared__ int ncand;
    const int64_t r = blockIdx.x, g = blockIdx.y, t = r / A.G, h = g * A.G + r % A.G;
    const int64_t i = A.pos0 + t, n = i + 1, row = g * A.R + r;
    float *zrow = A.scores + row * A.ld;
    const row_z z = {zrow, A.qshift[row], A.slopes ? A.a * (double)A.slopes[h] : 0.0, i};
    float mx = -INFINITY;
    int finite = 1;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        const float v = z(j);
        finite &= isfinite(v);
        mx = fmaxf(mx, v);
    }
    const float M = ekv_block_max(mx, fscratch, -INFINITY);
    finite = __syncthreads_and(finite);
    if (!finite) { /* |scale q.k| overflowed: the step fails (docs/math.md §6.2) */
        if (threadIdx.x == 0) atomicExch(A.bad, 1);
        return;
    }
    int whole;
    const double tt = row_tau(z, zrow, n, M, A.alpha, cand, &ncand, scratch, fscratch, &whole);
    __syncthreads();
    const double beta = 1.0 / (A.alpha - 1.0);
    /* p <= 1 (z - tau <= M - tau <= 1), so p * pscale stays within f16's range */
    T *dst = (T *)A.pparts + row * A.ld;
    const int64_t pstride = A.Hk * A.R * A.ld;
    const row_z zs = whole ? row_z{zrow, 1.f, 0.0, i} : z; /* a whole-row solve left z there */
    double sum = 0;
    for (int64_t j = threadIdx.x; j < A.nk; j += blockDim.x) {
        double p = 0;
        if (j < n) {
            const double y = (double)zs(j) - (double)M - tt;
            p = y > 0 ? (beta == 2.0 ? y * y : pow(y, beta)) : 0.0;
        }
        sum += p;
        split<T>((float)(p * A.pscale), A.np, dst + j, pstride);
    }
    sum = ekv_block_sum(sum, scratch);
    if (threadIdx.x == 0) A.rinv[row] = (float)(1.0 / sum);
}

/* att [T][H][D] = obuf [Hk][T*G][D] / sum p of the row (the exact paths divide by the
 * computed sum, docs/math.md §0) */
__global__ void gather_heads_kernel(prefill_args A) {
    ekv_grid_begin();
    const int64_t t = blockIdx.x, h = blockIdx.y, g = h / A.G, row = g * A.R + t * A.G + h % A.G;
    const float f = A.rinv[row];
    for (int64_t d = threadIdx.x; d < A.D; d += blockDim.x)
        A.att[(t * A.H + h) * A.D + d] = A.obuf[row * A.D + d] * f;
}

cudaDataType_t blas_type(ekv_dtype dt) {
    return dt == EKV_DTYPE_F16 ? CUDA_R_16F : dt == EKV_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

template <typename T> void launch_rows(const prefill_args &A, cudaStream_t s, int split_q) {
    if (split_q)
        split_queries_kernel<T>
                <<<ekv_prefill_warp_row_blocks(A.T * A.H), 32 * EKV_PREFILL_WARP_ROWS, 0, s>>>(A);
    else
        row_entmax_kernel<T><<<dim3((unsigned)A.R, (unsigned)A.Hk), ROW_THREADS, 0, s>>>(A);
}

void launch(ekv_dtype dt, const prefill_args &A, cudaStream_t s, int split_q) {
    ekv_cuda_with_dtype(dt,
                        [&](auto ty) { launch_rows<typename decltype(ty)::type>(A, s, split_q); });
}

/* ALiBi's reach (docs/math.md §12.1): where the histogram scheme's P1 may stop a sweep (entmax
 * with ALiBi slopes), A.kbound gets each KV head's largest |k| over the block's keys, which
 * split_queries_kernel turns into each row's bound A.qbound; elsewhere both stay NULL. */
ekv_status key_bounds(const ekv_cuda_prefill *pf, const ekv_cuda_prefill_block *b,
                      prefill_args *A) {
    A->kbound = A->qbound = NULL;
    if (!pf->fused || pf->tau_scheme != EKV_PREFILL_TAU_HIST || !b->slopes || b->alpha == 1.0)
        return EKV_OK;
    A->kbound = pf->kbound;
    A->qbound = pf->qbound;
    const int64_t keys = b->noncausal_keys ? b->noncausal_keys : A->nk;
    const int64_t per = KEY_BOUND_THREADS / 32 * KEY_BOUND_KEYS;
    GPU_TRY(pf, cudaMemsetAsync(A->kbound, 0, (size_t)A->Hk * 4, pf->stream));
    const dim3 grid((unsigned)((keys + per - 1) / per), (unsigned)A->Hk);
    ekv_cuda_with_dtype(b->dtype, [&](auto ty) {
        typedef typename decltype(ty)::type T;
        key_bound_kernel<T><<<grid, KEY_BOUND_THREADS, 0, pf->stream>>>(
                static_cast<const T *>(b->k), A->Hk * A->D, A->D, keys, A->kbound);
    });
    GPU_LAUNCHED(pf);
    return EKV_OK;
}

} // namespace

/* S = q' K^T and O = P V over the parts (beta 1 after the first part: each part's product,
 * computed from zero, is added to the fp32 result, docs/math.md §12), batched over the KV heads:
 * S (nk x R, ld apart) = K^T X with X q' (D x R), or O (D x R) = V X / pscale with X P (nk x R,
 * ld apart); part p of X lies p Hk R ldx elements on. */
static ekv_status prefill_gemms(const ekv_cuda_prefill *pf, const ekv_cuda_prefill_block *b,
                                const prefill_args &A, int scores) {
    const cudaDataType_t ty = blas_type(b->dtype);
    const int64_t es = ekv_dtype_size(b->dtype), kvld = A.Hk * A.D;
    const float one = 1.f, zero = 0.f, pback = 1.f / A.pscale;
    const int64_t m = scores ? A.nk : A.D, k = scores ? A.D : A.nk;
    const int64_t ldx = scores ? A.D : A.ld, ldc = scores ? A.ld : A.D;
    const char *x = static_cast<const char *>(scores ? A.qparts : A.pparts);
    for (int p = 0; p < (scores ? A.nq : A.np); p++)
        BLAS_TRY(pf, cublasGemmStridedBatchedEx(
                             pf->blas, scores ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, (int)m,
                             (int)A.R, (int)k, scores ? &one : &pback, scores ? b->k : b->v, ty,
                             (int)kvld, A.D, x + p * A.Hk * A.R * ldx * es, ty, (int)ldx, A.R * ldx,
                             p ? &one : &zero, scores ? A.scores : A.obuf, CUDA_R_32F, (int)ldc,
                             A.R * ldc, (int)A.Hk, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return EKV_OK;
}

ekv_status ekv_cuda_prefill_attention(const ekv_cuda_prefill *pf, const ekv_cuda_prefill_block *b) {
    const int64_t pos0 = b->pos0, T = b->T;
    prefill_args A;
    A.pos0 = pos0;
    A.T = T;
    A.H = b->H;
    A.Hk = b->Hk;
    A.G = A.H / A.Hk;
    A.R = T * A.G;
    A.D = b->D;
    A.nk = pos0 + T;
    A.ld = (A.nk + 15) / 16 * 16;
    if (T > pf->chunk || (!pf->fused && A.ld > pf->ld_cap))
        return ekv_fail(pf->ctx, EKV_ERR_INTERNAL,
                        "model (cuda): prefill block %lld x %lld keys exceeds its buffers",
                        (long long)T, (long long)A.nk);
    if (!pf->fused && (b->noncausal_keys || b->alpha == 1.0 || b->ohat))
        return ekv_fail(pf->ctx, EKV_ERR_INTERNAL,
                        "prefill (cuda): the GEMM path is causal entmax without o-hat only (the "
                        "fused kernel serves softmax, all keys and o-hat)");
    A.np = pf->nparts;
    A.nq = b->q_in_kv_dtype ? 1 : pf->nparts;
    A.a = b->alpha == 1.0 ? 1.0 : b->alpha - 1.0; /* z = a s (docs/math.md §0; softmax: z = s) */
    A.alpha = b->alpha;
    A.qf = (float)(A.a * (float)ekv_effective_scale(b->scale, A.D)); /* as ekv_cpu_scale_queries */
    A.pscale = b->dtype == EKV_DTYPE_F16 ? 16384.f : 1.f;
    A.q = b->q;
    A.q_dtype = b->q_dtype;
    A.slopes = b->slopes;
    A.scores = pf->scores;
    A.qshift = pf->qshift;
    A.rinv = pf->qshift + b->H * pf->chunk; /* the second half of the buffer */
    A.obuf = pf->obuf;
    A.att = b->att;
    A.ohat = b->ohat;
    A.qparts = pf->qparts;
    A.pparts = pf->pparts;
    A.bad = pf->bad;
    ekv_status s = key_bounds(pf, b, &A);
    if (s) return s;
    launch(b->dtype, A, pf->stream, 1);
    GPU_LAUNCHED(pf);
    if (pf->fused) return ekv_cuda_prefill_fused(pf, b, A);
    s = prefill_gemms(pf, b, A, 1);
    if (s) return s;
    launch(b->dtype, A, pf->stream, 0);
    GPU_LAUNCHED(pf);
    if ((s = prefill_gemms(pf, b, A, 0))) return s;
    gather_heads_kernel<<<dim3((unsigned)T, (unsigned)A.H), 64, 0, pf->stream>>>(A);
    GPU_LAUNCHED(pf);
    return EKV_OK;
}
