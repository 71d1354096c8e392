/*
 * Exact entmax attention over device tensors (include/entmaxkv/cuda.h, ekv_cuda_flash_entmax_*;
 * docs/math.md §13): what the forward (flash_entmax.cu) and the backward
 * (flash_entmax_backward.cu) share: the checked call, the carving of the caller's workspace,
 * and the conversion of 16-bit tensors to fp32.
 */
#pragma once
#include "entmaxkv.h"
#include <cuda_runtime.h>
#include <stdint.h>
#include "../common/launch.cuh"
#include "../common/loads.cuh"
#include "prefill.cuh" /* ws_carver: the workspace is carved as the prefill's scratch is */

/* A checked call: the shapes, the scale and factor as the kernels take them, the dtypes. */
struct flash_job {
    const ekv_flash_entmax_args *a;
    int64_t B, T, N, H, Hk, G, D;
    int causal;
    double alpha, scale; /* scale: the effective one (0 = 1/sqrt(D)) */
    float qf;            /* (a * scale) rounded as the CPU rounds it (docs/math.md §3.1) */
    int64_t chunk;       /* query tokens of one forward pass */
    ekv_context *ctx;
    cudaStream_t stream;
};

/* The checks of every entry (ctx and args not NULL, the reference's shape rules, batch, dtypes,
 * head dim, the tensors' pointers and 16-byte alignment, the element counts fit int64); fills
 * *J. With `grads` the backward's tensors too (dout, dq, dk, dv), else out; tau in both. */
ekv_status flash_check(ekv_context *ctx, const ekv_flash_entmax_args *a, void *stream, int grads,
                       const void *const *extra, flash_job *J);
/* The workspace bytes of the forward and the backward of a checked call. */
int64_t flash_forward_bytes(const flash_job &J);
int64_t flash_backward_bytes(const flash_job &J);
/* The workspace given to a call: not NULL, 256-byte aligned, at least `need` bytes. */
ekv_status flash_check_workspace(const flash_job &J, const void *ws, int64_t bytes, int64_t need);

namespace {

/* dst[i] = src[i] as fp32 (T: the source's storage type), a grid-stride loop. */
template <typename T> __global__ void flash_to_f32_kernel(const T *src, float *dst, int64_t n) {
    ekv_grid_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = ekv_elem<T>::to(src[i]);
}

/* n elements of dtype dt at src as fp32 at dst, on the job's stream. */
inline cudaError_t flash_to_f32(const flash_job &J, ekv_dtype dt, const void *src, float *dst,
                                int64_t n) {
    const int64_t blocks = (n + 255) / 256;
    const unsigned grid = (unsigned)(blocks < 65536 ? blocks : 65536);
    ekv_cuda_with_dtype(dt, [&](auto ty) {
        typedef typename decltype(ty)::type T;
        flash_to_f32_kernel<T><<<grid, 256, 0, J.stream>>>(static_cast<const T *>(src), dst, n);
    });
    return cudaGetLastError();
}

} // namespace

#define FLASH_TRY(J, call)                                                                         \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return ekv_fail((J).ctx, EKV_ERR_DEVICE, "flash entmax (cuda): %s: %s", #call,         \
                            cudaGetErrorString(e_));                                               \
    } while (0)
