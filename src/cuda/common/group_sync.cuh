/*
 * A barrier among n blocks of one cooperative launch (docs/architecture.md, "The fused dense
 * attend" and "The split top-k select"): the fused attend kernel's blocks of one (sequence, KV
 * head), or the split select's parts of one list, meet here between their phases, without the
 * whole grid (other groups run their own rounds). A cooperative launch
 * makes every block resident, so a spinning block never waits on one that cannot start.
 * bar[0] counts arrivals and bar[1] is the generation; both start at zero (the plan clears
 * them) and the count is zero again after every barrier.
 */
#pragma once

namespace {

/* Block-wide: every write of this block before it is visible to the n blocks after it (the
 * arrival is fenced; readers of another block's writes load through L2: __ldcg). */
__device__ __forceinline__ void group_sync(unsigned *bar, unsigned n) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned *gen = bar + 1;
        const unsigned g = *gen; /* this barrier's generation: it moves only when all arrive */
        __threadfence();
        if (atomicAdd(bar, 1u) == n - 1) {
            atomicExch(bar, 0u); /* before the generation moves: the next round counts anew */
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (*gen == g) __nanosleep(32);
        }
        __threadfence();
    }
    __syncthreads();
}

} // namespace
