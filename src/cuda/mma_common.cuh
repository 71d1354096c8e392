/*
 * Tensor-core pieces shared by the kernels that use them (attend_scores_mma.cu: the scores of a
 * GQA group; attend_softmax_mma.cu: one-pass softmax): the tile geometry, ldmatrix and mma, and
 * the exact three-part split of the group's queries (docs/math.md §3.1).
 */
#pragma once
#include "scores_common.cuh"

enum { MMA_ROWS = 16, MMA_STAGES = 3, MMA_PARTS = 3, MMA_QROWS = 16 };

/* The query parts' row pitch in elements: 8 extra elements (16 bytes) put the 8 heads a
 * B-fragment load touches in 8 different bank groups. */
template <int D> __host__ __device__ constexpr int mma_qpitch() { return D + 8; }
template <int D> __host__ __device__ constexpr size_t mma_tile_bytes() {
    return (size_t)MMA_ROWS * D * 2;
}
/* ---- the two tensor-core instructions ---- */
__device__ __forceinline__ void ldmatrix_x4(uint32_t *a, const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
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

/* The transposed load: B operands from a row-major [k][n] tile (V rows as [token][dim]). */
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t *a, const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(s)
                 : "memory");
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

/* Two fp32 values as one register of two T (the low half first), rounded to nearest. */
template <typename T> __device__ __forceinline__ uint32_t pack2(float x, float y) {
    const T a = ekv_elem<T>::from(x), b = ekv_elem<T>::from(y);
    return (uint32_t) * reinterpret_cast<const uint16_t *>(&a) |
           ((uint32_t) * reinterpret_cast<const uint16_t *>(&b) << 16);
}

/* A warp's 16-row tiles of its list entries (e0 + warp, e0 + warp + NW, ... below e1, ps / 16
 * tiles each) through MMA_STAGES shared-memory stages of stage_bytes, two tiles in flight:
 * copy(e, r0, stage) starts the cp.async copies of entry e's rows [r0, r0 + 16), use(e, r0,
 * stage) reads them once every lane's copies have landed. */
template <int NW, typename Copy, typename Use>
__device__ __forceinline__ void warp_tiles(int64_t e0, int64_t e1, int ps, unsigned char *stages,
                                           size_t stage_bytes, Copy copy, Use use) {
    const int warp = threadIdx.x >> 5;
    const int64_t mine = e1 > e0 + warp ? (e1 - e0 - warp + NW - 1) / NW : 0;
    const int64_t ntiles = mine * (ps / MMA_ROWS);
    score_cursor ci = {e0 + warp, 0}, cc = {e0 + warp, 0};
    auto issue = [&](int64_t j) {
        copy(ci.e, ci.r0, stages + (size_t)(j % MMA_STAGES) * stage_bytes);
        advance<MMA_ROWS, NW>(ci, ps);
    };
#pragma unroll
    for (int s = 0; s < MMA_STAGES - 1; s++) {
        if (s < ntiles) issue(s);
        cp_async_commit();
    }
    for (int64_t j = 0; j < ntiles; j++) {
        __syncwarp(); /* every lane has read the stage the next issue overwrites */
        if (j + MMA_STAGES - 1 < ntiles) issue(j + MMA_STAGES - 1);
        cp_async_commit();
        cp_async_wait<MMA_STAGES - 1>(); /* this lane's copies of tile j have landed ... */
        __syncwarp();                    /* ... and every other lane's */
        use(cc.e, cc.r0, stages + (size_t)(j % MMA_STAGES) * stage_bytes);
        advance<MMA_ROWS, NW>(cc, ps);
    }
    cp_async_wait<0>();
}
