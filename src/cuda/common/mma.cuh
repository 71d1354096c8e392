/*
 * Tensor-core pieces shared by the kernels that use them (stages/scores_mma.cu: the scores of a
 * GQA group; stages/softmax_mma.cu: one-pass softmax; prefill/prefill_fused.cu: the model's
 * fused dense prefill): the tile geometry, ldmatrix and mma, the exact three-part split
 * of the group's queries (docs/math.md §3.1), and 16 query rows against key tiles (S^T and P V).
 */
#pragma once
#include "loads.cuh"
#include "reduce.cuh"
#include <math_constants.h>

enum { MMA_ROWS = 16, MMA_STAGES = 3, MMA_PARTS = 3, MMA_QROWS = 16 };

/* The query parts' row pitch in elements: 8 extra elements (16 bytes) put the 8 heads a
 * B-fragment load touches in 8 different bank groups. */
template <int D> __host__ __device__ constexpr int mma_qpitch() { return D + 8; }
template <int D> __host__ __device__ constexpr size_t mma_tile_bytes() {
    return (size_t)MMA_ROWS * D * 2;
}
/* ---- the two tensor-core instructions ---- */
/* Four 8x8 matrices of 16-bit elements from shared memory; with TRANS the transposed load (B
 * operands from a row-major [k][n] tile: V rows as [token][dim]). */
template <bool TRANS = false>
__device__ __forceinline__ void ldmatrix_x4(uint32_t *a, const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                     : "r"(s)
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                     : "r"(s)
                     : "memory");
}
/* c = A B from zero: A 16x16 (row), B 16x8 (col), fp32 results. */
template <typename T>
__device__ __forceinline__ void mma_16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    if constexpr (std::is_same<T, __half>::value)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
                     : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
                     : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

/* q' of the group (fp32, staged at qs [G][D]) as three parts in T per head, scaled by 2^s_g,
 * into qparts [part][head][pitch] (heads G..15 zero), and 2^-s_g into unscale[g]. */
template <typename T, int D>
__device__ __forceinline__ void split_group_q(const float *qs, int G, T *qparts, float *unscale) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int g = warp; g < MMA_QROWS; g += nw) {
        float m = 0.f;
        for (int d = lane; d < D && g < G; d += 32) m = fmaxf(m, fabsf(qs[g * D + d]));
        m = ekv_warp_max(m);
        int s = 0;
        if (std::is_same<T, __half>::value && m > 0.f && m < CUDART_INF_F) {
            int e;
            frexpf(m, &e); /* m in [2^(e-1), 2^e): 2^(15-e) m in [2^14, 2^15) */
            s = 15 - e > 126 ? 126 : 15 - e;
        }
        if (lane == 0) unscale[g] = ldexpf(1.f, -s);
        for (int d = lane; d < D; d += 32) {
            const float x = g < G ? ldexpf(qs[g * D + d], s) : 0.f;
            const T hi = ekv_elem<T>::from(x);
            const float r1 = x - ekv_elem<T>::to(hi); /* exact: the bits hi did not keep */
            const T mid = ekv_elem<T>::from(r1);
            const T lo = ekv_elem<T>::from(r1 - ekv_elem<T>::to(mid));
            qparts[(0 * MMA_QROWS + g) * mma_qpitch<D>() + d] = hi;
            qparts[(1 * MMA_QROWS + g) * mma_qpitch<D>() + d] = mid;
            qparts[(2 * MMA_QROWS + g) * mma_qpitch<D>() + d] = lo;
        }
    }
}

/* Byte offset of 16-byte chunk c of row r in a tile (D / 8 chunks per row), swizzled. */
template <int D> __device__ __forceinline__ int tile_chunk(int r, int c) {
    return r * D * 2 + ((c ^ (r & 7)) << 4);
}

/* Rows [r0, r0 + 16) of a page's head block (`page`, `stride` elements between tokens) into a
 * swizzled tile by cp.async, this lane's share. Rows at or past `valid` are zero-filled with
 * ZERO_TAIL (a V tile: p = 0 times stale bits that happen to be NaN is NaN) and left as they
 * are otherwise (a K tile: the scores of those rows are masked). */
template <typename T, int D, bool ZERO_TAIL>
__device__ __forceinline__ void tile_copy(unsigned char *dst, const T *page, int64_t stride, int r0,
                                          int valid) {
    constexpr int CH = D / 8, PER = MMA_ROWS * CH / 32; /* chunks per row, per lane */
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < PER; u++) {
        const int i = lane + 32 * u, r = i / CH, c = i % CH;
        if (r0 + r < valid)
            cp_async16(dst + tile_chunk<D>(r, c), page + (int64_t)(r0 + r) * stride + c * 8);
        else if (ZERO_TAIL)
            *reinterpret_cast<uint4 *>(dst + tile_chunk<D>(r, c)) = make_uint4(0, 0, 0, 0);
    }
}

/* c += A B (A 16x16 row, B 16x8 col, fp32 c in and out). */
template <typename T>
__device__ __forceinline__ void mma_16816_acc(float *c, const uint32_t *a, uint32_t b0,
                                              uint32_t b1) {
    if constexpr (std::is_same<T, __half>::value)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* N C fragments (4 fp32 values each) set to zero. */
template <int N> __device__ __forceinline__ void mma_zero(float (*c)[4]) {
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) c[n][i] = 0.f;
}

/* Two fp32 values as one register of two T (the low half first), rounded to nearest. */
template <typename T> __device__ __forceinline__ uint32_t pack2(float x, float y) {
    const T a = ekv_elem<T>::from(x), b = ekv_elem<T>::from(y);
    return (uint32_t) * reinterpret_cast<const uint16_t *>(&a) |
           ((uint32_t) * reinterpret_cast<const uint16_t *>(&b) << 16);
}

/* ---- 16 query rows against key tiles, the queries in registers (stages/softmax_mma.cu: a
 * GQA group's heads; the model's fused prefill: query rows of a block) ---- */

/* The A fragments of 16 query rows in NP parts (part p at q + p * part_stride elements, rows
 * mma_qpitch<D>() apart) for every 16-dim step, loaded once and kept across the key tiles. */
template <typename T, int D, int NP>
__device__ __forceinline__ void load_q_frags(const T *q, int part_stride,
                                             uint32_t (*qa)[D / 16][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int part = 0; part < NP; part++)
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            ldmatrix_x4(qa[part][kk], q + part * part_stride + (lane & 15) * mma_qpitch<D>() +
                                              kk * 16 + (lane >> 4) * 8);
}

/* S^T of a 16-key tile: s[nt][i] = <q'_g, k_t> for row g = lane / 4 + 8 (i / 2) and key
 * t = nt 8 + 2 (lane % 4) + i % 2, the sum over the NP parts of mmas that each start from zero
 * (docs/math.md §3.1). */
template <typename T, int D, int NP>
__device__ __forceinline__ void tile_scores_q(const unsigned char *kt,
                                              const uint32_t (*qa)[D / 16][4], float (*s)[4]) {
    const int lane = threadIdx.x & 31;
    mma_zero<2>(s);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t kb[4]; /* B fragments: tokens 0-7 (kb[0], kb[1]) and 8-15 (kb[2], kb[3]) */
        ldmatrix_x4(kb, kt + tile_chunk<D>((lane & 7) + ((lane >> 4) << 3),
                                           2 * kk + ((lane >> 3) & 1)));
#pragma unroll
        for (int part = 0; part < NP; part++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                float c[4];
                mma_16816<T>(c, qa[part][kk], kb[2 * nt], kb[2 * nt + 1]);
#pragma unroll
                for (int i = 0; i < 4; i++) s[nt][i] += c[i];
            }
    }
}

/* P (16 rows x 16 keys, the A fragments from s as tile_scores_q lays them out) as NP parts of T
 * (x_1 = rn(p), x_{k+1} = rn(p - x_1 - .. - x_k)), the A registers of each part. */
template <typename T, int NP>
__device__ __forceinline__ void pv_pack(const float (*p)[4], uint32_t (*pa)[4]) {
#pragma unroll
    for (int r = 0; r < 4; r++) { /* a0..a3: rows g0, g0 + 8, tokens 0-7 then 8-15 */
        const int nt = r >> 1, i = (r & 1) * 2;
        float x = p[nt][i], y = p[nt][i + 1];
#pragma unroll
        for (int part = 0; part < NP; part++) {
            pa[part][r] = pack2<T>(x, y);
            x -= ekv_elem<T>::to(ekv_elem<T>::from(x));
            y -= ekv_elem<T>::to(ekv_elem<T>::from(y));
        }
    }
}

/* The B fragments of dims dp 16 + 0..7 (vb[0], vb[1]) and + 8..15 (vb[2], vb[3]) of a 16-key
 * tile of V. */
template <int D>
__device__ __forceinline__ void pv_load_b(const unsigned char *vt, int dp, uint32_t *vb) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4<true>(
            vb, vt + tile_chunk<D>((lane & 7) + (((lane >> 3) & 1) << 3), 2 * dp + (lane >> 4)));
}

/* o (4 accumulators of one 8-dim n tile) += the parts' products with B (b0, b1), chained in
 * one accumulator from the smallest part. */
template <typename T, int NP>
__device__ __forceinline__ void pv_mma(const uint32_t (*pa)[4], uint32_t b0, uint32_t b1,
                                       float *o) {
    float c[4];
    mma_16816<T>(c, pa[NP - 1], b0, b1);
#pragma unroll
    for (int part = NP - 2; part >= 0; part--) mma_16816_acc<T>(c, pa[part], b0, b1);
#pragma unroll
    for (int i = 0; i < 4; i++) o[i] += c[i];
}

/* o += P V over a 16-key tile, P as NP parts (pv_pack). */
template <typename T, int D, int NP>
__device__ __forceinline__ void tile_pv(const unsigned char *vt, const float (*p)[4],
                                        float (*o)[4]) {
    uint32_t pa[NP][4]; /* [part][A register] */
    pv_pack<T, NP>(p, pa);
#pragma unroll
    for (int dp = 0; dp < D / 16; dp++) {
        uint32_t vb[4];
        pv_load_b<D>(vt, dp, vb);
#pragma unroll
        for (int h = 0; h < 2; h++) pv_mma<T, NP>(pa, vb[2 * h], vb[2 * h + 1], o[2 * dp + h]);
    }
}
