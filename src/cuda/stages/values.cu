/*
 * attend, step 3 on the GPU: the values kernels (see attend_common.cuh).
 */
#include "attend_common.cuh"
#include "../common/launch.cuh"
#include "../common/loads.cuh"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include "../common/sizes.cuh"
#include "../common/splits.cuh"
#include "values.cuh"
#include "../common/weights.cuh"
#include <math_constants.h>

namespace {

struct value_args : ekv_cuda_shape {
    ekv_paged_kv kv;
    int gchunks;
    int64_t ccap;
    int nsplit; /* ekv_seq_splits' base for the kernel's grid (cap: nsplit * batch) */
    const int32_t *list_pages, *list_count;
    double alpha;
    const float *scores;
    const float *tau_m; /* tau = tau_m + tau_t per query head (tau.cu) */
    const double *tau_t;
    const float *sup_p;
    const int64_t *sup_off;
    const int64_t *sup_count;
    int64_t *v_rows;
    float *out;
    const int32_t *rows, *row_count; /* screened: score slots are these rows (NULL: pages) */
    uint32_t *ubits; /* the group-union kernel: the support slots per KV head (tau marks them) */
    int64_t cap_words;
    const int32_t *ulist, *ucount; /* and the same slots listed once (union_mark) */
};

/* This block's split of a grid (split, rows per sequence) with A.nsplit splits per row of a
 * uniform batch; false: none (return at once, block-uniform). */
__device__ __forceinline__ bool value_block(const value_args &A, ekv_split *sp) {
    *sp = ekv_block_split(A.t, A.nsplit, A.nsplit * A.t.batch);
    return sp->b >= 0;
}

/* Element offset of score slot s of list row lrow in the V pool: screened's row lists, or the
 * page list (the sequence's pages without one). */
__device__ __forceinline__ int64_t value_offset(const value_args &A, int lrow, int64_t first,
                                                int kvh, int64_t s) {
    return A.rows ? row_offset(A.t, A.kv, A.rows, A.cap_tokens, lrow, first, kvh, A.ps, s)
                  : slot_offset(A.t, A.kv, A.list_pages, A.cap_pages, lrow, first, kvh, A.ps, s);
}

/* 8 elements of a V row (16-byte aligned for 16-bit types) as fp32, with the load predicated */
template <typename T> __device__ __forceinline__ void load8_if(bool on, const T *p, float *o) {
    if (on)
        ekv_elem<T>::load8(p, o);
    else {
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = 0.f;
    }
}

enum { VAL_THREADS = 256, VAL_WARPS = VAL_THREADS / 32, VAL_U = 4 };

/* Entmax values: out[row] += sum over the head's support of p V[row]. Items are the support
 * list's entries, or (support over the list's cap) every token of the score row with p from
 * z and tau. LPR lanes per V row (8-element chunks), VC chunks per lane (D <= 8 LPR VC);
 * RPW = 32 / LPR rows per warp pass, VAL_U passes in flight. */
template <typename T, int LPR, int VC>
__global__ void __launch_bounds__(VAL_THREADS) values_support_kernel(value_args A) {
    ekv_grid_begin();
    __shared__ float red[VAL_WARPS][EKV_CUDA_MAX_DIM];
    constexpr int RPW = 32 / LPR, STEP = RPW * VAL_U;
    ekv_split sp;
    if (!value_block(A, &sp)) return;
    const int b = sp.b, h = blockIdx.y, kvh = h / A.G, lrow = b * A.Hk + kvh;
    const int64_t row = (int64_t)b * A.H + h;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / LPR, sl = lane % LPR,
              D = A.D;
    const int64_t nsup = A.sup_count[row];
    const bool from_list = nsup <= A.ccap;
    const float tm = A.tau_m[row];
    const double tt = A.tau_t[row], beta = 1.0 / (A.alpha - 1.0);
    int64_t nitems = nsup;
    ekv_seq_geom sg = {0, 0, 0};
    if (!from_list) {
        sg = ekv_seq(A.t, b, A.ps);
        int64_t begin, end;
        entry_range(A.list_count, sg.P, lrow, 3, &begin, &end);
        nitems = A.rows ? (int64_t)A.row_count[lrow] : end * A.ps;
    }
    const float *z = A.scores + row * A.cap_tokens;
    const T *V = static_cast<const T *>(A.kv.v);
    float acc[VC][8];
    zero_acc(acc);
    const int64_t wstride = (int64_t)sp.n * VAL_WARPS * STEP;
    bool any = false;
    for (int64_t base = ((int64_t)sp.s * VAL_WARPS + warp) * STEP; base < nitems;
         base += wstride) {
        float p[VAL_U];
        int64_t off[VAL_U];
#pragma unroll
        for (int r = 0; r < VAL_U; r++) {
            const int64_t i = base + r * RPW + sub;
            p[r] = 0.f;
            off[r] = 0;
            if (i < nitems) {
                if (from_list) {
                    p[r] = A.sup_p[row * A.ccap + i];
                    off[r] = A.sup_off[row * A.ccap + i];
                } else {
                    p[r] = entmax_p_split(z[i], tm, tt, beta);
                    if (p[r] > 0.f) off[r] = value_offset(A, lrow, sg.first, kvh, i);
                }
            }
        }
        float v8[VAL_U][VC][8];
#pragma unroll
        for (int r = 0; r < VAL_U; r++)
#pragma unroll
            for (int c = 0; c < VC; c++) {
                const int ch = sl + c * LPR;
                load8_if<T>(p[r] > 0.f && ch * 8 < D, V + off[r] + ch * 8, v8[r][c]);
            }
#pragma unroll
        for (int r = 0; r < VAL_U; r++) {
            any |= p[r] > 0.f;
#pragma unroll
            for (int c = 0; c < VC; c++)
#pragma unroll
                for (int i = 0; i < 8; i++) acc[c][i] += p[r] * v8[r][c][i];
        }
    }
    if (!__syncthreads_or(any)) return;
        /* the RPW rows of a pass went to different lane groups: sum them, then over the warps */
#pragma unroll
    for (int c = 0; c < VC; c++)
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int o = LPR; o < 32; o <<= 1)
                acc[c][i] += __shfl_xor_sync(0xffffffffu, acc[c][i], o);
    if (sub == 0)
#pragma unroll
        for (int c = 0; c < VC; c++) {
            const int ch = sl + c * LPR;
            if (ch * 8 < D)
#pragma unroll
                for (int i = 0; i < 8; i++) red[warp][ch * 8 + i] = acc[c][i];
        }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float s = 0.f;
        for (int w = 0; w < VAL_WARPS; w++) s += red[w][d];
        atomicAdd(A.out + row * D + d, s);
    }
}

/* ---- entmax values for a GQA group at once (docs/architecture.md, CUDA values): the tau
 * kernel marks each head's support slots in its KV head's bitmap and lists each slot once
 * (union_mark), so the list holds the union of the group's supports; each listed V row is
 * read once, and every head g of the group adds p_g V with p_g = [z_g - tau_g]_+^beta from its
 * own score row (0 where the slot is not in its support). The same products as
 * values_support_kernel, summed in another order. The blocks of a KV head take equal shares
 * of its list, and clear the bits of the slots they read for the next step. ---- */

/* acc[g] summed over the block for each head g < G and added to its output row. red: [warps][D]
 * of shared memory. Block-uniform call. */
template <int LPR, int GM>
__device__ __forceinline__ void union_out(const value_args &A, float (*acc)[8], float *red,
                                          int64_t h0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / LPR, sl = lane % LPR;
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= A.G) break;
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int o = LPR; o < 32; o <<= 1)
                acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], o);
        __syncthreads(); /* the previous head's sums are read */
        if (sub == 0 && sl * 8 < A.D)
#pragma unroll
            for (int i = 0; i < 8; i++) red[warp * A.D + sl * 8 + i] = acc[g][i];
        __syncthreads();
        for (int d = threadIdx.x; d < A.D; d += blockDim.x) {
            float s = 0.f;
            for (int w = 0; w < VAL_WARPS; w++) s += red[w * A.D + d];
            atomicAdd(A.out + (h0 + g) * A.D + d, s);
        }
    }
}

/* Grid (split of the bitmap's words, KV head). D = 8 LPR (64, 128, 256); GM >= G heads (<= 8
 * <= LPR: lane sl of a row's lanes forms p of head sl, the others take it by shuffle); U row
 * passes in flight. */
template <typename T, int LPR, int GM, int U>
__global__ void __launch_bounds__(VAL_THREADS) values_union_kernel(value_args A) {
    ekv_grid_begin();
    __shared__ __align__(16) float red[VAL_WARPS * 256]; /* [warps][D], D = 8 LPR <= 256 */
    constexpr int RPW = 32 / LPR;
    ekv_split sp;
    if (!value_block(A, &sp)) return;
    const int b = sp.b, kvh = blockIdx.y, lrow = b * A.Hk + kvh, G = A.G;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / LPR, sl = lane % LPR;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    int64_t r0, r1;
    ekv_split_range(sp, 0, A.ucount[lrow], &r0, &r1);
    if (r0 >= r1) return; /* block-uniform: a short union's blocks past its end add nothing */
    const int64_t h0 = (int64_t)b * A.H + kvh * G;
    const int gm = sl < G ? sl : 0; /* the head whose p this lane forms */
    const float tm = A.tau_m[h0 + gm];
    const double tt = A.tau_t[h0 + gm], beta = 1.0 / (A.alpha - 1.0);
    const float *zm = A.scores + (h0 + gm) * A.cap_tokens;
    uint32_t *bits = A.ubits + lrow * A.cap_words;
    const int32_t *list = A.ulist + lrow * A.cap_tokens;
    const T *V = static_cast<const T *>(A.kv.v);
    float acc[GM][8];
    zero_acc(acc);
    int64_t rows = 0;
    /* A pass's loads in stages, each stage's U rows in flight together: the slots, then their
     * scores and V row offsets, then the V rows; the bits are cleared after them. With the
     * clearing store between one row's slot and the next row's (the compiler cannot move a load
     * past a store that may alias it), each row of a pass waited on its own chain of loads. */
    for (int64_t base = r0 + (int64_t)warp * RPW * U; base < r1;
         base += (int64_t)VAL_WARPS * RPW * U) {
        int64_t s[U], off[U];
        float zs[U], p[U][GM], v8[U][8];
        bool in[U], on[U];
#pragma unroll
        for (int r = 0; r < U; r++) {
            const int64_t i = base + r * RPW + sub;
            in[r] = i < r1;
            s[r] = in[r] ? list[i] : 0;
        }
#pragma unroll
        for (int r = 0; r < U; r++) {
            zs[r] = in[r] && sl < G ? zm[s[r]] : 0.f;
            off[r] = in[r] ? value_offset(A, lrow, sg.first, kvh, s[r]) : 0;
        }
#pragma unroll
        for (int r = 0; r < U; r++) {
            const float pm = in[r] && sl < G ? entmax_p_split(zs[r], tm, tt, beta) : 0.f;
            on[r] = false;
#pragma unroll
            for (int g = 0; g < GM; g++) {
                p[r][g] = __shfl_sync(0xffffffffu, pm, (lane & ~(LPR - 1)) + g);
                on[r] |= p[r][g] > 0.f;
            }
            rows += on[r] && sl == 0;
        }
#pragma unroll
        for (int r = 0; r < U; r++) load8_if<T>(on[r], V + off[r] + sl * 8, v8[r]);
#pragma unroll
        for (int r = 0; r < U; r++)
            if (in[r] && sl == 0) bits[s[r] >> 5] = 0u; /* every marked slot is listed */
#pragma unroll
        for (int r = 0; r < U; r++)
#pragma unroll
            for (int g = 0; g < GM; g++)
#pragma unroll
                for (int i = 0; i < 8; i++) acc[g][i] += p[r][g] * v8[r][i];
    }
    rows = ekv_warp_sum(rows);
    if (lane == 0 && rows)
        atomicAdd(reinterpret_cast<unsigned long long *>(&A.v_rows[lrow]), (unsigned long long)rows);
    union_out<LPR, GM>(A, acc, red, h0);
}

/* 4 elements as fp32 (8-byte aligned for the 16-bit types, 16-byte for f32). */
template <typename T> __device__ __forceinline__ void load4(const T *p, float *o) {
    ekv_unpack_pairs<T, 2>(__ldg(reinterpret_cast<const uint2 *>(p)), o);
}
template <> __device__ __forceinline__ void load4<float>(const float *p, float *o) {
    float4 a = __ldg(reinterpret_cast<const float4 *>(p));
    o[0] = a.x;
    o[1] = a.y;
    o[2] = a.z;
    o[3] = a.w;
}

enum { VCH = 4, VDIM = EKV_CUDA_MAX_DIM / 128 }; /* heads per block, 4-element chunks per lane */

/* acc[g] += p[g] of lane src * V row, for the chunk's heads (lanes split the row in 4s). */
template <typename T, int VD>
__device__ __forceinline__ void accum_dense_row(const T *vrow, const float *p, int src, int lane,
                                                int D, float (*acc)[VD][4]) {
    float pg[VCH];
#pragma unroll
    for (int g = 0; g < VCH; g++) pg[g] = __shfl_sync(0xffffffffu, p[g], src);
#pragma unroll
    for (int c = 0; c < VD; c++) {
        const int d = c * 128 + lane * 4;
        if (d < D) {
            float v4[4];
            load4<T>(vrow + d, v4);
#pragma unroll
            for (int g = 0; g < VCH; g++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[g][c][i] += pg[g] * v4[i];
        }
    }
}

/* The V row of the split's token rel (from its first entry e0). 32-bit division: a split
 * holds < 2^31 tokens. */
template <typename T>
__device__ __forceinline__ const T *dense_vrow(const value_args &A, const T *V, int row, int kvh,
                                               const ekv_seq_geom &sg, int64_t e0, int rel) {
    const int64_t e = e0 + rel / A.ps;
    const int64_t lp = A.list_pages ? A.list_pages[(int64_t)row * A.cap_pages + e] : e;
    return V + A.t.indices[sg.first + lp] * A.kv.stride_page + (int64_t)kvh * A.kv.stride_head +
           (rel % A.ps) * A.kv.stride_token;
}

enum { DENSE_BATCH = 8 }; /* V rows whose loads are in flight together */

/* acc[g] += p[g] of lanes src0 .. src0 + DENSE_BATCH - 1 times their V rows (tokens rel0 + k):
 * every row's address, then every load, then the sums, so the loads overlap (one row at a
 * time left the values kernel at a fifth of the bandwidth). */
template <typename T, int VD>
__device__ __forceinline__ void
accum_dense_batch(const value_args &A, const T *V, int row, int kvh, const ekv_seq_geom &sg,
                  int64_t e0, int rel0, const float *p, int src0, int lane, float (*acc)[VD][4]) {
    const T *vrow[DENSE_BATCH];
#pragma unroll
    for (int k = 0; k < DENSE_BATCH; k++) vrow[k] = dense_vrow(A, V, row, kvh, sg, e0, rel0 + k);
    float v4[DENSE_BATCH][VD][4];
#pragma unroll
    for (int k = 0; k < DENSE_BATCH; k++)
#pragma unroll
        for (int c = 0; c < VD; c++) {
            const int d = c * 128 + lane * 4;
            if (d < A.D)
                load4<T>(vrow[k] + d, v4[k][c]);
            else
                v4[k][c][0] = v4[k][c][1] = v4[k][c][2] = v4[k][c][3] = 0.f;
        }
#pragma unroll
    for (int k = 0; k < DENSE_BATCH; k++) {
        float pg[VCH];
#pragma unroll
        for (int g = 0; g < VCH; g++) pg[g] = __shfl_sync(0xffffffffu, p[g], src0 + k);
#pragma unroll
        for (int c = 0; c < VD; c++)
#pragma unroll
            for (int g = 0; g < VCH; g++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[g][c][i] += pg[g] * v4[k][c][i];
    }
}

/* out[g] += acc[g] for the chunk's ng heads (a split's share of the output rows). */
template <int VD>
__device__ __forceinline__ void add_dense_out(float *out, int ng, int lane, int D,
                                              float (*acc)[VD][4]) {
#pragma unroll
    for (int g = 0; g < VCH; g++) {
        if (g < ng) {
#pragma unroll
            for (int c = 0; c < VD; c++) {
                const int d = c * 128 + lane * 4;
                if (d < D)
#pragma unroll
                    for (int i = 0; i < 4; i++)
                        atomicAdd(out + (int64_t)g * D + d + i, acc[g][c][i]);
            }
        }
    }
}

/* Softmax values (every token has p > 0): grid (split, sequence x KV head x chunk of VCH
 * group heads); a V row is read once for the chunk's heads. VD: 4-element chunks per lane
 * (D <= 128 VD); the accumulators are VCH x VD x 4 registers. */
template <typename T, int VD>
__global__ void __launch_bounds__(EKV_CUDA_THREADS) values_dense_kernel(value_args A) {
    ekv_grid_begin();
    ekv_split sp;
    if (!value_block(A, &sp)) return;
    const int y = blockIdx.y, gc = y % A.gchunks, b = sp.b, kvh = y / A.gchunks,
              row = b * A.Hk + kvh;
    const int D = A.D, ps = A.ps, g0 = gc * VCH, ng = A.G - g0 < VCH ? A.G - g0 : VCH;
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    int64_t begin, end, e0, e1;
    entry_range(A.list_count, sg.P, row, 3, &begin, &end);
    ekv_split_range(sp, begin, end, &e0, &e1);
    if (e1 <= e0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    double tt[VCH];
    float tm[VCH];
    const float *zr[VCH];
    for (int g = 0; g < VCH; g++) {
        const int64_t hrow = (int64_t)b * A.H + kvh * A.G + g0 + (g < ng ? g : 0);
        tm[g] = A.tau_m[hrow];
        tt[g] = A.tau_t[hrow];
        zr[g] = A.scores + hrow * A.cap_tokens;
    }
    float acc[VCH][VD][4];
#pragma unroll
    for (int g = 0; g < VCH; g++)
#pragma unroll
        for (int c = 0; c < VD; c++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[g][c][i] = 0.f;
    const T *V = static_cast<const T *>(A.kv.v);
    int64_t rows = 0;
    bool any_w = false;
    const int64_t t0 = e0 * ps, t1 = e1 * ps;
    constexpr int VU = 4; /* warp-rows of scores loaded ahead */
    for (int64_t base0 = t0 + (int64_t)warp * 32; base0 < t1; base0 += (int64_t)nw * 32 * VU) {
        float zpre[VU][VCH];
#pragma unroll
        for (int v = 0; v < VU; v++)
#pragma unroll
            for (int g = 0; g < VCH; g++) {
                const int64_t u = base0 + (int64_t)v * nw * 32 + lane;
                zpre[v][g] = (g < ng && u < t1) ? zr[g][u] : -CUDART_INF_F;
            }
#pragma unroll
        for (int v = 0; v < VU; v++) {
            const int64_t base = base0 + (int64_t)v * nw * 32;
            if (base >= t1) break;
            const int64_t u = base + lane;
            float p[VCH];
            bool any = false;
#pragma unroll
            for (int g = 0; g < VCH; g++) {
                p[g] = 0.f;
                if (g < ng && u < t1) {
                    const float zz = zpre[v][g];
                    p[g] = zz > -CUDART_INF_F ? (float)exp(((double)zz - (double)tm[g]) - tt[g]) : 0.f;
                    any |= p[g] > 0.f;
                }
            }
            unsigned mask = __ballot_sync(0xffffffffu, any);
            if (mask) any_w = true;
            if (lane == 0) rows += __popc(mask);
            if (mask == 0xffffffffu) { /* softmax's common case: batches of rows in flight */
                for (int s0 = 0; s0 < 32; s0 += DENSE_BATCH)
                    accum_dense_batch<T, VD>(A, V, row, kvh, sg, e0, (int)(base - t0) + s0, p, s0,
                                             lane, acc);
                continue;
            }
            while (mask) {
                const int src = __ffs(mask) - 1;
                mask &= mask - 1;
                const T *vrow = dense_vrow(A, V, row, kvh, sg, e0, (int)(base + src - t0));
                accum_dense_row<T, VD>(vrow, p, src, lane, D, acc);
            }
        }
    }
    if (lane == 0 && rows)
        atomicAdd(reinterpret_cast<unsigned long long *>(&A.v_rows[row]), (unsigned long long)rows);
    if (any_w) add_dense_out<VD>(A.out + ((int64_t)b * A.H + kvh * A.G + g0) * D, ng, lane, D, acc);
}
/* Softmax values over one wave (A.nsplit: its splits per row of a uniform batch). */
template <typename T, int VD>
void launch_dense_values(value_args A, int rows, int sms, const ekv_launch_stream &st) {
    static int per_sm = 0;
    A.nsplit =
            ekv_cuda_one_wave(values_dense_kernel<T, VD>, EKV_CUDA_THREADS, 0, rows, sms, &per_sm);
    const dim3 grid(ekv_cuda_split_grid(A.nsplit, A.t.batch), rows / A.t.batch);
    ekv_launch(st, values_dense_kernel<T, VD>, grid, EKV_CUDA_THREADS, 0, A);
}

template <typename T, int LPR>
void launch_union_d(const value_args &A, dim3 grid, const ekv_launch_stream &st) {
    if (A.G <= 2)
        ekv_launch(st, values_union_kernel<T, LPR, 2, 4>, grid, VAL_THREADS, 0, A);
    else if (A.G <= 4)
        ekv_launch(st, values_union_kernel<T, LPR, 4, 4>, grid, VAL_THREADS, 0, A);
    else
        ekv_launch(st, values_union_kernel<T, LPR, 8, 2>, grid, VAL_THREADS, 0, A);
}

template <typename T>
void launch_values_t(value_args A, int softmax, int rows_dense, int sms, int usplit, int vsplit,
                     const ekv_launch_stream &st) {
    if (A.ubits) { /* ekv_cuda_values_union */
        A.nsplit = usplit;
        const dim3 grid(ekv_cuda_split_grid(usplit, A.t.batch), A.Hk);
        ekv_cuda_with_lanes(
                A.D, [&](auto lpr) { launch_union_d<T, decltype(lpr)::value>(A, grid, st); },
                [&] { launch_union_d<T, 32>(A, grid, st); }); /* not reached: D 64, 128, 256 */
        return;
    }
    A.nsplit = vsplit;
    const dim3 grid_support(ekv_cuda_split_grid(vsplit, A.t.batch), A.H);
    if (softmax) {
        if (A.D <= 128)
            launch_dense_values<T, 1>(A, rows_dense, sms, st);
        else if (A.D <= 256)
            launch_dense_values<T, 2>(A, rows_dense, sms, st);
        else
            launch_dense_values<T, VDIM>(A, rows_dense, sms, st);
        return;
    }
    ekv_cuda_with_lanes(
            A.D,
            [&](auto lpr) {
                ekv_launch(st, values_support_kernel<T, decltype(lpr)::value, 1>, grid_support,
                           VAL_THREADS, 0, A);
            },
            [&] {
                ekv_launch(st, values_support_kernel<T, 32, EKV_CUDA_MAX_DIM / 256>, grid_support,
                           VAL_THREADS, 0, A);
            });
}

} // namespace

ekv_status ekv_cuda_launch_values(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                  const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                                  int use_list, float *out) {
    return ekv_cuda_launch_values_rows(pl, prm, kv, t, batch, use_list, out, 0);
}

ekv_status ekv_cuda_launch_values_rows(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                       const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                                       int use_list, float *out, int rows) {
    /* a shard's step (sharded/sharded.cu) stops after its own tau: its values come at the
     * agreed tau, and read the group's union list only once the agreement has added to it */
    if (pl->skip_values) return EKV_OK;
    value_args A;
    ekv_cuda_set_shape(A, pl, t);
    A.kv = *kv;
    A.gchunks = (A.G + VCH - 1) / VCH;
    A.ccap = pl->cand_cap;
    A.nsplit = 1; /* set by the path launch_values_t takes */
    ekv_cuda_set_support(A, pl, use_list, rows, ekv_cuda_values_union(pl, prm->alpha));
    A.alpha = prm->alpha;
    A.v_rows = pl->v_rows;
    A.out = out;
    const int softmax = prm->alpha == 1.0;
    const int rows_dense = batch * A.Hk * A.gchunks;
    const ekv_step_splits sp = ekv_cuda_step_splits(pl, batch);
    ekv_cuda_with_dtype(kv->dtype, [&](auto ty) {
        launch_values_t<typename decltype(ty)::type>(A, softmax, rows_dense, pl->sms, sp.unions,
                                                     sp.values, ekv_plan_stream(pl));
    });
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

/* Entmax (alpha > 1) with GQA groups of 2 to 8 and head dims 64, 128, 256: the values read each
 * support V row once per KV head (values_union_kernel); G = 1 has nothing to share, larger
 * groups and other dims keep the per-head kernel (their accumulators would spill). */
bool ekv_cuda_values_union(const ekv_cuda_plan *pl, double alpha) {
    const int G = pl->p.num_heads / pl->p.num_kv_heads, D = pl->p.head_dim;
    return alpha != 1.0 && G >= 2 && G <= 8 && (D == 64 || D == 128 || D == 256);
}
