/*
 * The page ranges as the kernels read them (docs/math.md §1.2, mirrors
 * src/cpu/stages/ranges.h): fp32 kmin/kmax, or the compact copies, loaded as fp32.
 */
#pragma once
#include "entmaxkv.h"
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>

/* The page ranges as the kernels read them (docs/math.md §1.2): fp32 kmin/kmax, or the compact
 * copies (f16/bf16, rounded outward), converted to fp32 exactly on the way in. */
struct ekv_cuda_ranges {
    const float *mn, *mx;
    const uint16_t *mn16, *mx16;
    int dtype;    /* ekv_dtype: F32 reads mn/mx, F16/BF16 mn16/mx16 */
    int64_t elem; /* bytes per value, for prefetching */
};
static inline ekv_cuda_ranges ekv_cuda_ranges_of(const ekv_page_stats *st) {
    const int c = st->range_dtype != EKV_DTYPE_F32;
    return ekv_cuda_ranges{st->kmin, st->kmax, st->kmin16, st->kmax16, (int)st->range_dtype,
                           c ? 2 : 4};
}
/* A 16-bit range value as fp32 (exact), f16 or bf16 chosen without a branch. */
__device__ __forceinline__ float ekv_range16_f32(uint32_t h, int dtype) {
    const float bf = __uint_as_float(h << 16),
                f = __half2float(__ushort_as_half((unsigned short)h));
    return dtype == EKV_DTYPE_BF16 ? bf : f;
}
/* How a kernel reads the ranges, fixed at compile time where it is hot: fp32, f16, bf16, or
 * either 16-bit type (a branch on r.dtype per value). */
enum { EKV_RANGE_F32 = 0, EKV_RANGE_F16 = 1, EKV_RANGE_BF16 = 2, EKV_RANGE_ANY = 3 };
/* A 16-bit range value as fp32 (exact) for the variant RT. */
template <int RT> __device__ __forceinline__ float ekv_range16_as(uint32_t h, int dtype) {
    if (RT == EKV_RANGE_BF16) return __uint_as_float(h << 16);
    if (RT == EKV_RANGE_F16) return __half2float(__ushort_as_half((unsigned short)h));
    return ekv_range16_f32(h, dtype);
}
/* N consecutive values (N = 1, 2, 4 or 8) of the minima (hi = false) or maxima at flat index i,
 * a multiple of N, into o; RT as above (the stats' dtype must match it). */
template <int N, int RT = EKV_RANGE_ANY>
__device__ __forceinline__ void ekv_range_load(const ekv_cuda_ranges &r, bool hi, int64_t i,
                                               float *o) {
    if (RT == EKV_RANGE_F32 || (RT == EKV_RANGE_ANY && r.dtype == EKV_DTYPE_F32)) {
        const float *p = (hi ? r.mx : r.mn) + i;
        if (N == 8) {
            const float4 v = __ldg(reinterpret_cast<const float4 *>(p)),
                         w = __ldg(reinterpret_cast<const float4 *>(p) + 1);
            o[0] = v.x, o[1] = v.y, o[2] = v.z, o[3] = v.w;
            o[4] = w.x, o[5] = w.y, o[6] = w.z, o[7] = w.w;
        } else if (N == 4) {
            const float4 v = __ldg(reinterpret_cast<const float4 *>(p));
            o[0] = v.x, o[1] = v.y, o[2] = v.z, o[3] = v.w;
        } else if (N == 2) {
            const float2 v = __ldg(reinterpret_cast<const float2 *>(p));
            o[0] = v.x, o[1] = v.y;
        } else {
            o[0] = __ldg(p);
        }
        return;
    }
    const uint16_t *p = (hi ? r.mx16 : r.mn16) + i;
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (N == 8) {
        const uint4 v = __ldg(reinterpret_cast<const uint4 *>(p));
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if (N == 4) {
        const uint2 v = __ldg(reinterpret_cast<const uint2 *>(p));
        w[0] = v.x, w[1] = v.y;
    } else if (N == 2) {
        w[0] = __ldg(reinterpret_cast<const unsigned int *>(p));
    } else {
        o[0] = ekv_range16_as<RT>(__ldg(reinterpret_cast<const unsigned short *>(p)), r.dtype);
        return;
    }
#pragma unroll
    for (int k = 0; k < N / 2; k++) {
        o[2 * k] = ekv_range16_as<RT>(w[k] & 0xffffu, r.dtype);
        o[2 * k + 1] = ekv_range16_as<RT>(w[k] >> 16, r.dtype);
    }
}
/* The kernel variant for these ranges: calls f with std::integral_constant<int, RT>. */
template <typename F> static inline auto ekv_cuda_with_ranges(const ekv_cuda_ranges &r, F &&f) {
    if (r.dtype == EKV_DTYPE_F16) return f(std::integral_constant<int, EKV_RANGE_F16>());
    if (r.dtype == EKV_DTYPE_BF16) return f(std::integral_constant<int, EKV_RANGE_BF16>());
    return f(std::integral_constant<int, EKV_RANGE_F32>());
}
/* Where the minima (hi = false) or maxima of flat index i start, for prefetching. */
__device__ __forceinline__ const void *ekv_range_addr(const ekv_cuda_ranges &r, bool hi,
                                                      int64_t i) {
    return r.dtype == EKV_DTYPE_F32 ? (const void *)((hi ? r.mx : r.mn) + i)
                                    : (const void *)((hi ? r.mx16 : r.mn16) + i);
}
