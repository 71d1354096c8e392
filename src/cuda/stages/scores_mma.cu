/*
 * attend, step 1 on tensor cores (docs/math.md §3.1, "Scores on tensor cores"): the scores of
 * a GQA group for 16-bit K, head dims 64 and 128, page sizes that are multiples of 16. The
 * same arguments and outputs as the CUDA-core scores kernel (scores_common.cuh).
 *
 * One mma.m16n8k16 multiplies a tile of 16 key rows (M, from shared memory by ldmatrix) by 8
 * query heads (N; two tiles of 8 for groups up to 16) over 16 dims (K). The query q' (fp32) is
 * split exactly into three parts in K's type, q' = 2^-s (hi + mid + lo), so each product is
 * exact; each mma starts from zero and its four results are added in fp32, which keeps the
 * computed score within the error the bounds' slack already covers (§3.1 proves it). s is a
 * per-head power of two that lifts the largest |q'| into [2^14, 2^15) for f16 (bf16 has
 * fp32's exponent range: s = 0).
 *
 * Each warp streams its own 16-row tiles of its pages through MMA_STAGES shared-memory stages
 * (cp.async, 2 tiles in flight); rows are stored with their 16-byte chunks XOR-swizzled by the
 * row so that ldmatrix reads the 8 rows of a matrix from 8 different bank groups.
 */
#include "../common/launch.cuh"
#include "../common/mma.cuh"
#include "mma_tiles.cuh"
#include "scores_common.cuh"
#include "../common/sizes.cuh"
#include "../common/splits.cuh"
#include <math_constants.h>

namespace {

enum { MMA_NW = EKV_CUDA_THREADS / 32 }; /* warps of a scores block */

/* stages [warp][stage][16 rows][D], query parts [part][16 heads][D + 8], warp maxima [warp][16],
 * unscale factors [16] */
template <int D> __host__ __device__ constexpr size_t scores_smem_bytes() {
    return (size_t)MMA_NW * MMA_STAGES * mma_tile_bytes<D>() +
           (size_t)MMA_PARTS * MMA_QROWS * mma_qpitch<D>() * 2 + (size_t)MMA_NW * MMA_QROWS * 4 +
           (size_t)MMA_QROWS * 4;
}

/* The scores of one landed tile: acc[nt][i] = <q'_g, k_t> for the lane's C-fragment slots
 * (token rows lane/4 and lane/4 + 8, heads nt 8 + 2 (lane % 4) + {0, 1}). */
template <typename T, int D, int NT>
__device__ __forceinline__ void tile_dots(const unsigned char *tile, const T *qparts,
                                          float (*acc)[4]) {
    const int lane = threadIdx.x & 31, arow = lane & 15, ahalf = lane >> 4;
    const int qrow = lane >> 2, qcol = (lane & 3) * 2;
    mma_zero<NT>(acc);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[4];
        ldmatrix_x4(a, tile + tile_chunk<D>(arow, 2 * kk + ahalf));
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int part = 0; part < MMA_PARTS; part++) {
                const T *qp = qparts + (part * MMA_QROWS + nt * 8 + qrow) * mma_qpitch<D>() +
                              kk * 16 + qcol;
                const uint32_t b0 = *reinterpret_cast<const uint32_t *>(qp);
                const uint32_t b1 = *reinterpret_cast<const uint32_t *>(qp + 8);
                float c[4];
                mma_16816<T>(c, a, b0, b1);
#pragma unroll
                for (int i = 0; i < 4; i++) acc[nt][i] += c[i];
            }
        }
    }
}

template <typename T, int D, int NT>
__global__ void __launch_bounds__(EKV_CUDA_THREADS, 2) scores_mma_kernel(score_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    constexpr size_t TB = mma_tile_bytes<D>();
    ekv_split sp;
    int b, kvh, row;
    if (!score_block(A, &sp, &b, &kvh, &row)) return;
    const int G = A.G, ps = A.ps;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned char *stage = smem_raw + (size_t)warp * MMA_STAGES * TB;
    T *qparts = reinterpret_cast<T *>(smem_raw + (size_t)MMA_NW * MMA_STAGES * TB);
    float *red = reinterpret_cast<float *>(qparts + MMA_PARTS * MMA_QROWS * mma_qpitch<D>());
    float *unscale = red + MMA_NW * MMA_QROWS;
    zero_step_counters(A, sp, row, b, kvh);
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    int64_t e0, e1;
    split_entries(A, sp, sg, row, &e0, &e1);
    mma_group_q<T, D>(A, b, kvh, G, reinterpret_cast<float *>(smem_raw), qparts, unscale);
    /* the lane's C-fragment heads: nt 8 + 2 (lane % 4) + j */
    float runmax[NT][2], slope[NT][2], uns[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int g = nt * 8 + (lane & 3) * 2 + j;
            runmax[nt][j] = -CUDART_INF_F;
            slope[nt][j] = (g < G && A.slopes) ? A.a * A.slopes[kvh * G + g] : 0.f;
            uns[nt][j] = unscale[g];
        }
    const T *K = static_cast<const T *>(A.kv.k);
    float *srow = A.scores + ((int64_t)b * A.H + kvh * G) * A.cap_tokens; /* + g * cap_tokens */
    auto copy = [&](int64_t e, int r0, unsigned char *tile) {
        int valid;
        const int64_t lp = entry_page(A, sg, row, e, &valid);
        tile_copy<T, D, false>(tile, K + page_block(A, sg, lp, kvh), A.kv.stride_token, r0, valid);
    };
    auto use = [&](int64_t e, int r0, const unsigned char *tile) {
        int valid;
        const int64_t lp = entry_page(A, sg, row, e, &valid);
        const float jbase = (float)(lp * ps - (sg.N - 1));
        const unsigned heads = entry_heads(A, row, e);
        float *sbase = srow + e * ps;
        float acc[NT][4];
        tile_dots<T, D, NT>(tile, qparts, acc);
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int j2 = 0; j2 < 2; j2++) {
                const int g = nt * 8 + (lane & 3) * 2 + j2;
                if (g >= G) continue;
#pragma unroll
                for (int h = 0; h < 2; h++) { /* token rows lane/4 and lane/4 + 8 */
                    const int t = r0 + (lane >> 2) + 8 * h;
                    const float z = score_z(acc[nt][2 * h + j2] * uns[nt][j2], slope[nt][j2], jbase,
                                            t, t < valid && (heads >> g & 1u));
                    sbase[(int64_t)g * A.cap_tokens + t] = z;
                    runmax[nt][j2] = fmaxf(runmax[nt][j2], z);
                }
            }
    };
    warp_tiles<MMA_NW>(e0, e1, ps, stage, TB, copy, use);
    /* the warp's max per head: the lanes with equal lane % 4 hold the same heads */
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int j2 = 0; j2 < 2; j2++) {
            float m = runmax[nt][j2];
            for (int o = 4; o < 32; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            const int g = nt * 8 + lane * 2 + j2;
            if (lane < 4 && g < G) red[warp * G + g] = m;
        }
    publish_split_max(A, red, sp, b, kvh);
}

template <typename T, int D, int NT>
void launch_mma(const score_args &A, dim3 grid, const ekv_launch_stream &st) {
    constexpr auto kernel = scores_mma_kernel<T, D, NT>;
    if (ekv_cuda_allow_smem<kernel>(scores_smem_bytes<D>()) == cudaSuccess)
        ekv_launch(st, kernel, grid, EKV_CUDA_THREADS, scores_smem_bytes<D>(), A);
}

template <typename T>
void launch_mma_t(const score_args &A, dim3 grid, const ekv_launch_stream &st) {
    if (A.D == 64)
        A.G <= 8 ? launch_mma<T, 64, 1>(A, grid, st) : launch_mma<T, 64, 2>(A, grid, st);
    else
        A.G <= 8 ? launch_mma<T, 128, 1>(A, grid, st) : launch_mma<T, 128, 2>(A, grid, st);
}

} // namespace

bool ekv_cuda_scores_mma_applies(int dtype, int head_dim, int page_size, int group) {
    return (dtype == EKV_DTYPE_F16 || dtype == EKV_DTYPE_BF16) &&
           (head_dim == 64 || head_dim == 128) && page_size % MMA_ROWS == 0 && group <= MMA_QROWS;
}

cudaError_t ekv_cuda_scores_mma(const score_args &A, int dtype, dim3 grid,
                                const ekv_launch_stream &st) {
    if (dtype == EKV_DTYPE_F16)
        launch_mma_t<__half>(A, grid, st);
    else
        launch_mma_t<__nv_bfloat16>(A, grid, st);
    return cudaGetLastError();
}
