/*
 * Softmax (alpha = 1) in one pass over K and V on tensor cores (docs/math.md §3.9, "One-pass
 * softmax"; the CPU counterpart is src/cpu/stages/decode_dense.c's softmax). For f16/bf16 K and V,
 * head dims 64 and 128, page sizes that are multiples of 16; other shapes take the two-pass
 * path (scores, log-sum-exp, values).
 *
 * Grid (split, sequence x KV head), FL_NW warps per block; each warp streams 16-token tiles of
 * K and V (cp.async, swizzled as in scores_mma.cu) and keeps, for the 16 rows of the
 * group's head tile, a running max m, sum l and output o:
 *   S^T = q' K^T   (16 heads x 16 tokens; q' in three exact parts, each mma from zero, §3.1)
 *   m' = max(m, rowmax S),  P = exp(S - m'),  l = l e^(m - m') + rowsum P,
 *   o = o e^(m - m') + P V  (P split into two 16-bit parts, hi + lo, so p keeps 16 or 22 bits).
 * The warps of a block merge into one partial (m, l, o, tokens) per split and head; the merge
 * kernel combines the splits: out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M), and reports
 * tau = M + log L (the log-sum-exp) and the support (every token).
 */
#include "../common/launch.cuh"
#include "../common/mma.cuh"
#include "mma_tiles.cuh"
#include "../common/plan.cuh"
#include "scores_common.cuh"
#include "softmax.cuh"
#include "../common/splits.cuh"
#include "../../core/geometry.h"
#include <math_constants.h>

namespace {

enum { FL_NW = 4, FL_THREADS = FL_NW * 32 };

struct flash_args : score_args {
    float *part; /* [B*H][split_cap][D + 4]: o, then m, l, and the tokens (int64 in the last two) */
};

template <int D> __host__ __device__ constexpr int part_pitch() { return D + 4; }

/* stages [warp][stage][K tile, V tile], query parts [part][16 heads][D + 8], unscale [16] */
template <int D> constexpr size_t flash_smem_bytes() {
    return (size_t)FL_NW * MMA_STAGES * 2 * mma_tile_bytes<D>() +
           (size_t)MMA_PARTS * MMA_QROWS * mma_qpitch<D>() * 2 + (size_t)MMA_QROWS * 4;
}

/* The running state of a warp's 16 head rows: this lane holds rows g0 = lane / 4 and g0 + 8
 * (index hi = 0, 1), and of o the C-fragment columns nt 8 + 2 (lane % 4) + {0, 1}. */
template <int D> struct flash_state {
    float m[2], l[2];
    float o[D / 8][4];
    int64_t tokens;
};

/* One landed tile into the state: scores to z, the online max and rescale, then P V. */
template <typename T, int D>
__device__ __forceinline__ void tile_softmax(const flash_args &A, const unsigned char *kt,
                                             const uint32_t (*qa)[D / 16][4], const float *uns,
                                             const float *slope, float jbase, int r0, int valid,
                                             flash_state<D> &st) {
    const int lane = threadIdx.x & 31;
    float s[2][4];
    tile_scores_q<T, D, MMA_PARTS>(kt, qa, s);
    float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int hi = i >> 1, t = r0 + nt * 8 + (lane & 3) * 2 + (i & 1);
            s[nt][i] = score_z(s[nt][i] * uns[hi], slope[hi], jbase, t, t < valid);
            mx[hi] = fmaxf(mx[hi], s[nt][i]);
        }
    float scale[2];
#pragma unroll
    for (int hi = 0; hi < 2; hi++) {
        mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 1));
        mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 2));
        const float mn = fmaxf(st.m[hi], mx[hi]);
        scale[hi] = mn == -CUDART_INF_F ? 1.f : expf(st.m[hi] - mn);
        st.m[hi] = mn;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int hi = i >> 1;
            s[nt][i] = st.m[hi] == -CUDART_INF_F ? 0.f : expf(s[nt][i] - st.m[hi]);
            rs[hi] += s[nt][i];
        }
#pragma unroll
    for (int hi = 0; hi < 2; hi++) st.l[hi] = st.l[hi] * scale[hi] + rs[hi];
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) st.o[nt][i] *= scale[i >> 1];
    tile_pv<T, D, 2>(kt + mma_tile_bytes<D>(), s, st.o);
    const int n = valid - r0;
    st.tokens += n < MMA_ROWS ? (n > 0 ? n : 0) : MMA_ROWS;
}

/* The block's warps merged into this split's partial of each head of the group. */
template <int D>
__device__ __forceinline__ void block_partial(const flash_args &A, flash_state<D> &st,
                                              unsigned char *smem, int split, int b, int kvh) {
    constexpr int PP = part_pitch<D>();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g0 = lane >> 2;
#pragma unroll
    for (int hi = 0; hi < 2; hi++) { /* the row sums of the quad */
        st.l[hi] += __shfl_xor_sync(0xffffffffu, st.l[hi], 1);
        st.l[hi] += __shfl_xor_sync(0xffffffffu, st.l[hi], 2);
    }
    float *ws = reinterpret_cast<float *>(smem); /* [warp][16 rows][PP] */
    int64_t *wt = reinterpret_cast<int64_t *>(ws + FL_NW * MMA_QROWS * PP);
    __syncthreads(); /* every warp is done with the stages */
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            ws[(warp * MMA_QROWS + g0 + 8 * (i >> 1)) * PP + nt * 8 + (lane & 3) * 2 + (i & 1)] =
                    st.o[nt][i];
    if ((lane & 3) == 0)
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            ws[(warp * MMA_QROWS + g0 + 8 * hi) * PP + D] = st.m[hi];
            ws[(warp * MMA_QROWS + g0 + 8 * hi) * PP + D + 1] = st.l[hi];
        }
    if (lane == 0) wt[warp] = st.tokens;
    __syncthreads();
    const int G = A.G;
    for (int i = threadIdx.x; i < G * (D + 1); i += blockDim.x) {
        const int r = i / (D + 1), d = i % (D + 1); /* d == D: the row's m, l and tokens */
        float M = -CUDART_INF_F;
        for (int w = 0; w < FL_NW; w++) M = fmaxf(M, ws[(w * MMA_QROWS + r) * PP + D]);
        float acc = 0.f;
        int64_t tokens = 0;
        for (int w = 0; w < FL_NW; w++) {
            const float *wr = ws + (w * MMA_QROWS + r) * PP;
            const float f = wr[D] == -CUDART_INF_F ? 0.f : expf(wr[D] - M);
            acc += (d < D ? wr[d] : wr[D + 1]) * f;
            tokens += wt[w];
        }
        float *pr = A.part + (((int64_t)b * A.H + kvh * G + r) * A.split_cap + split) * PP;
        if (d < D)
            pr[d] = acc;
        else {
            pr[D] = M;
            pr[D + 1] = acc;
            *reinterpret_cast<int64_t *>(pr + D + 2) = tokens;
        }
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(FL_THREADS, 2) softmax_flash_kernel(flash_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    constexpr size_t TB = mma_tile_bytes<D>();
    ekv_split sp;
    int b, kvh, row;
    if (!score_block(A, &sp, &b, &kvh, &row)) return;
    const int G = A.G, ps = A.ps;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned char *stage = smem_raw + (size_t)warp * MMA_STAGES * 2 * TB;
    T *qparts = reinterpret_cast<T *>(smem_raw + (size_t)FL_NW * MMA_STAGES * 2 * TB);
    float *unscale = reinterpret_cast<float *>(qparts + MMA_PARTS * MMA_QROWS * mma_qpitch<D>());
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    int64_t e0, e1;
    split_entries(A, sp, sg, row, &e0, &e1);
    mma_group_q<T, D>(A, b, kvh, G, reinterpret_cast<float *>(smem_raw), qparts, unscale);
    uint32_t qa[MMA_PARTS][D / 16][4];
    load_q_frags<T, D, MMA_PARTS>(qparts, MMA_QROWS * mma_qpitch<D>(), qa);
    float uns[2], slope[2];
    flash_state<D> st;
#pragma unroll
    for (int hi = 0; hi < 2; hi++) {
        const int g = (lane >> 2) + 8 * hi;
        uns[hi] = unscale[g];
        slope[hi] = (g < G && A.slopes) ? A.a * A.slopes[kvh * G + g] : 0.f;
        st.m[hi] = -CUDART_INF_F;
        st.l[hi] = 0.f;
    }
    mma_zero<D / 8>(st.o);
    st.tokens = 0;
    const T *K = static_cast<const T *>(A.kv.k), *V = static_cast<const T *>(A.kv.v);
    auto copy = [&](int64_t e, int r0,
                    unsigned char *kt) { /* the K tile, then the V tile */
                                         int valid;
                                         const int64_t off = page_block(
                                                 A, sg, entry_page(A, sg, row, e, &valid), kvh);
                                         tile_copy<T, D, false>(kt, K + off, A.kv.stride_token, r0,
                                                                valid);
                                         tile_copy<T, D, true>(kt + TB, V + off, A.kv.stride_token,
                                                               r0, valid);
    };
    auto use = [&](int64_t e, int r0, const unsigned char *kt) {
        int valid;
        const int64_t lp = entry_page(A, sg, row, e, &valid);
        tile_softmax<T, D>(A, kt, qa, uns, slope, (float)(lp * ps - (sg.N - 1)), r0, valid, st);
    };
    warp_tiles<FL_NW>(e0, e1, ps, stage, 2 * TB, copy, use);
    block_partial<D>(A, st, smem_raw, sp.s, b, kvh);
}

/* The splits of each head combined: the output, tau (log-sum-exp), the support (every token)
 * and, by the group's first head, the V rows of its KV head (each read once). */
struct merge_args {
    ekv_page_table t;
    const float *part;
    int nsplit, split_cap, D, H, G, Hk; /* the row's splits: ekv_seq_splits(nsplit, split_cap) */
    float *out;
    double *tau;
    int64_t *support, *v_rows;
};

__global__ void __launch_bounds__(128) softmax_merge_kernel(merge_args A) {
    ekv_grid_begin();
    const int64_t row = blockIdx.x;
    const int PP = A.D + 4, ns = ekv_seq_splits(A.t, (int)(row / A.H), A.nsplit, A.split_cap);
    const float *pr = A.part + row * A.split_cap * PP;
    float M = -CUDART_INF_F;
    for (int s = 0; s < ns; s++) M = fmaxf(M, pr[s * PP + A.D]);
    double L = 0;
    int64_t tokens = 0;
    for (int s = 0; s < ns; s++) {
        const float m = pr[s * PP + A.D];
        if (m > -CUDART_INF_F) L += (double)pr[s * PP + A.D + 1] * exp((double)m - (double)M);
        tokens += *reinterpret_cast<const int64_t *>(pr + s * PP + A.D + 2);
    }
    for (int d = threadIdx.x; d < A.D; d += blockDim.x) {
        double acc = 0;
        for (int s = 0; s < ns; s++) {
            const float m = pr[s * PP + A.D];
            if (m > -CUDART_INF_F) acc += (double)pr[s * PP + d] * exp((double)m - (double)M);
        }
        A.out[row * A.D + d] = L > 0 ? (float)(acc / L) : 0.f;
    }
    if (threadIdx.x == 0) {
        A.tau[row] = (double)M + log(L);
        A.support[row] = tokens;
        const int b = (int)(row / A.H), h = (int)(row % A.H);
        if (h % A.G == 0) A.v_rows[(int64_t)b * A.Hk + h / A.G] = tokens;
    }
}

template <typename T, int D>
void launch_flash(const flash_args &A, dim3 grid, const ekv_launch_stream &st) {
    constexpr auto kernel = softmax_flash_kernel<T, D>;
    if (ekv_cuda_allow_smem<kernel>(flash_smem_bytes<D>()) == cudaSuccess)
        ekv_launch(st, kernel, grid, FL_THREADS, flash_smem_bytes<D>(), A);
}

} // namespace

bool ekv_cuda_softmax_one_pass_applies(const ekv_cuda_plan *pl, int dtype) {
    return pl->p.tensor_cores && ekv_cuda_scores_mma_applies(dtype, pl->p.head_dim, pl->p.page_size,
                                                             pl->p.num_heads / pl->p.num_kv_heads);
}

ekv_status ekv_cuda_launch_softmax_one_pass(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                            const ekv_paged_kv *kv, const ekv_page_table *t,
                                            const float *q, int batch, int use_list, float *out) {
    flash_args A;
    ekv_cuda_set_shape(A, pl, t);
    A.kv = *kv;
    ekv_cuda_set_query(A, prm, kv->head_dim, q); /* alpha = 1: a = 1 */
    A.nsplit = pl->last_score_splits = ekv_cuda_step_splits(pl, batch).scores;
    A.split_cap = pl->split_cap;
    A.list_pages = use_list ? pl->list_pages : NULL;
    A.list_count = use_list ? pl->list_count : NULL;
    A.list_heads = NULL; /* masked lists take the two-pass path (plan/decode.cu) */
    A.round = 1;
    A.part = pl->flash_part;
    const dim3 grid(ekv_cuda_split_grid(A.nsplit, batch), A.Hk);
    if (kv->dtype == EKV_DTYPE_F16)
        A.D == 64 ? launch_flash<__half, 64>(A, grid, ekv_plan_stream(pl))
                  : launch_flash<__half, 128>(A, grid, ekv_plan_stream(pl));
    else
        A.D == 64 ? launch_flash<__nv_bfloat16, 64>(A, grid, ekv_plan_stream(pl))
                  : launch_flash<__nv_bfloat16, 128>(A, grid, ekv_plan_stream(pl));
    EKV_CUDA_LAUNCHED(pl);
    merge_args M = {*t,  pl->flash_part, A.nsplit, pl->split_cap, A.D,        A.H,
                    A.G, A.Hk,           out,        pl->tau,       pl->support, pl->v_rows};
    ekv_launch(ekv_plan_stream(pl), softmax_merge_kernel, batch * A.H, 128, 0, M);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}
