/*
 * Host-side launch helpers of the CUDA backend: a failed CUDA call or launch as a status, the
 * one-wave grid rule, the opt-in to large dynamic shared memory, and the ladders every kernel
 * templated on the storage type, the head dim or the GQA group is launched through.
 */
#pragma once
#include "overlap.cuh"
#include "sizes.cuh"
#include "entmaxkv.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <type_traits>

extern "C" {
/* from src/core (C) */
ekv_status ekv_fail(ekv_context *ctx, ekv_status status, const char *fmt, ...);
void ekv_clear_error(ekv_context *ctx);
}

#define EKV_CUDA_TRY(plan, call)                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return ekv_fail((plan)->ctx, EKV_ERR_DEVICE, "%s: %s (%s:%d)", #call,                  \
                            cudaGetErrorString(e_), __FILE__, __LINE__);                           \
    } while (0)

#define EKV_CUDA_LAUNCHED(plan)                                                                    \
    do {                                                                                           \
        cudaError_t e_ = cudaGetLastError();                                                       \
        if (e_ != cudaSuccess)                                                                     \
            return ekv_fail((plan)->ctx, EKV_ERR_DEVICE, "kernel launch: %s (%s:%d)",              \
                            cudaGetErrorString(e_), __FILE__, __LINE__);                           \
        (plan)->launches++;                                                                        \
    } while (0)

/* Blocks per row for a grid of `rows` rows that fits one wave of `kernel` (its resident
 * blocks per SM asked once per instance, through *per_sm): where blocks split the work
 * evenly, a second, partial wave would run alone at the end for as long as the first. */
template <typename K>
static inline int ekv_cuda_one_wave(K kernel, int threads, size_t smem, int rows, int sms,
                                    int *per_sm) {
    if (!*per_sm && (cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, threads, smem) !=
                             cudaSuccess ||
                     *per_sm < 1))
        *per_sm = 1;
    const int gx = *per_sm * sms / rows;
    return gx > 1 ? gx : 1;
}

/* A launch of Kernel with `bytes` of dynamic shared memory: where dynamic and static shared
 * memory together pass 48 KB it needs the opt-in, so it is asked for any dynamic size larger
 * than the last granted (a kernel with static arrays and 40-48 KB dynamic failed its launch
 * with 'invalid argument' when only sizes above 48 KB asked). Once per size increase and
 * kernel instance (the static lives in this template's instance for Kernel; a static shared by
 * several kernels would leave all but the first without it). */
template <auto Kernel> static inline cudaError_t ekv_cuda_allow_smem(size_t bytes) {
    static size_t allowed = 0;
    if (bytes <= allowed) return cudaSuccess;
    const cudaError_t e =
            cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (e == cudaSuccess) allowed = bytes;
    return e;
}

/* Calls f(std::integral_constant<int, TG>{}) with the smallest compiled group tile TG >= G (1,
 * 2, 4, 8 or EKV_CUDA_MAX_GROUP): every kernel templated on the group is launched through this
 * one ladder, so the tiles a group maps to are written once. */
template <typename F> static inline auto ekv_cuda_with_group(int G, F &&f) {
    if (G == 1) return f(std::integral_constant<int, 1>{});
    if (G == 2) return f(std::integral_constant<int, 2>{});
    if (G <= 4) return f(std::integral_constant<int, 4>{});
    if (G <= 8) return f(std::integral_constant<int, 8>{});
    return f(std::integral_constant<int, EKV_CUDA_MAX_GROUP>{});
}

/* Calls f(ekv_cuda_type<T>{}) with the storage type T of a K/V dtype: __half, __nv_bfloat16, or
 * float for F32 (the caller has checked the dtype). */
template <typename T> struct ekv_cuda_type { typedef T type; };
template <typename F> static inline auto ekv_cuda_with_dtype(int dtype, F &&f) {
    if (dtype == EKV_DTYPE_F16) return f(ekv_cuda_type<__half>{});
    if (dtype == EKV_DTYPE_BF16) return f(ekv_cuda_type<__nv_bfloat16>{});
    return f(ekv_cuda_type<float>{});
}

/* Calls fast(std::integral_constant<int, LPR>{}) for the head dims the kernels that read a row
 * with LPR lanes specialise (64, 128, 256: 8, 16, 32 lanes of 8 elements), generic() for any
 * other. */
template <typename F, typename G>
static inline void ekv_cuda_with_lanes(int D, F &&fast, G &&generic) {
    if (D == 64)
        fast(std::integral_constant<int, 8>{});
    else if (D == 128)
        fast(std::integral_constant<int, 16>{});
    else if (D == 256)
        fast(std::integral_constant<int, 32>{});
    else
        generic();
}
