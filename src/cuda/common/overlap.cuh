/*
 * Overlapped launches (docs/architecture.md, "Overlapped launches"): a decode step is a chain of
 * ~10 short kernels a layer, and between two of them the GPU idles while the second is launched
 * and its blocks ramp up. With Hopper's programmatic dependent launch a kernel may be launched
 * while the one before it in the stream still runs; its reads must then wait for that kernel's
 * results. The two halves of that contract are written here, once:
 *
 *   device: every kernel of the project begins with ekv_grid_begin() (scripts/check_kernels.py
 *           checks it): griddepcontrol.wait, which returns when every kernel this grid depends
 *           on has completed and its writes are visible, so nothing the kernel reads or writes
 *           can race with them; then griddepcontrol.launch_dependents, which lets the next
 *           kernel of the stream be launched now (its blocks wait at their own
 *           ekv_grid_begin). Both are no-ops in a launch without the attribute and below sm_90.
 *           Or with `x = ekv_grid_begin_with(reads)`: reads() first, then the same; reads()
 *           may load only memory that no kernel writes (the model's weights, uploaded before
 *           any step), so that those loads overlap the previous kernel's tail.
 *
 *   host:   ekv_launch(on, kernel, grid, block, smem, args...) launches with the attribute
 *           when on.overlap is set (the plan's overlap_launches), as <<<>>> without.
 *
 * Why waiting first is exact: a kernel that waits before its first global access sees every
 * write of the kernels before it (the wait is transitive: the kernel before it waited in turn),
 * and the kernels after it wait for it. So an overlapped step computes what the plain one does;
 * only the launch latency and the blocks' start overlap the previous kernel's tail. The wait
 * exists only in code compiled for sm_90 or later: the plan refuses overlap_launches = 1 (and
 * takes -1 as 0) where the device or the build's kernels are older (resolve_sm90_options,
 * plan/plan.cu).
 */
#pragma once
#include <cuda_runtime.h>
#include <utility>

__device__ __forceinline__ void ekv_grid_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* reads(), then ekv_grid_begin(); returns what reads() returned. reads() loads only memory no
 * kernel writes (see above). */
template <typename F> __device__ __forceinline__ auto ekv_grid_begin_with(F &&reads) {
    auto held = reads();
    ekv_grid_begin();
    return held;
}

/* Where a kernel goes: the stream, and whether it may be launched before the previous kernel
 * of the stream ends (the plan's overlap_launches; ekv_plan_stream in plan.cuh). */
struct ekv_launch_stream {
    cudaStream_t stream;
    int overlap;
};

/* The launch attribute of clusters of x consecutive blocks of x (ekv_launch_clusters, and the
 * occupancy queries of such launches). */
static inline cudaLaunchAttribute ekv_cluster_attr(unsigned x) {
    cudaLaunchAttribute at;
    at.id = cudaLaunchAttributeClusterDimension;
    at.val.clusterDim.x = x;
    at.val.clusterDim.y = 1;
    at.val.clusterDim.z = 1;
    return at;
}

/* A launch's configuration with its n attributes at (for cudaLaunchKernelEx and the occupancy
 * queries of the same launch). */
static inline cudaLaunchConfig_t ekv_launch_config(dim3 grid, dim3 block, size_t smem,
                                                   cudaStream_t stream, cudaLaunchAttribute *at,
                                                   unsigned n) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = at;
    cfg.numAttrs = n;
    return cfg;
}

/* kernel<<<grid, block, smem, on.stream>>>(args...), launched early (programmatic stream
 * serialization) when on.overlap is set, in clusters of cluster_x consecutive blocks of x when
 * cluster_x > 1 (thread block clusters: compute capability 9.0; their blocks run at once and
 * share their shared memory); the kernel begins with ekv_grid_begin(). Returns the launch's
 * error, which is also left for cudaGetLastError, as <<<>>> leaves it. */
template <typename... P, typename... A>
static inline cudaError_t ekv_launch_clusters(const ekv_launch_stream &on, void (*kernel)(P...),
                                              dim3 grid, dim3 block, size_t smem,
                                              unsigned cluster_x, A &&...args) {
    cudaLaunchAttribute at[2];
    unsigned n = 0;
    if (on.overlap) {
        at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[n++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster_x > 1) at[n++] = ekv_cluster_attr(cluster_x);
    const cudaLaunchConfig_t cfg = ekv_launch_config(grid, block, smem, on.stream, at, n);
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

/* The same without clusters: every kernel's launch. */
template <typename... P, typename... A>
static inline cudaError_t ekv_launch(const ekv_launch_stream &on, void (*kernel)(P...), dim3 grid,
                                     dim3 block, size_t smem, A &&...args) {
    return ekv_launch_clusters(on, kernel, grid, block, smem, 1u, std::forward<A>(args)...);
}
