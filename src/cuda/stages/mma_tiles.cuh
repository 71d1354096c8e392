/*
 * The tensor-core kernels' walk over a list's pages (scores_mma.cu, softmax_mma.cu):
 * a warp's 16-row tiles of its list entries through shared-memory stages, two in flight.
 */
#pragma once
#include "../common/loads.cuh"
#include "../common/mma.cuh"
#include "scores_common.cuh"

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
