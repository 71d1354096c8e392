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

#define FLASH_TRY(J, call)                                                                         \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return ekv_fail((J).ctx, EKV_ERR_DEVICE, "flash entmax (cuda): %s: %s", #call,         \
                            cudaGetErrorString(e_));                                               \
    } while (0)
