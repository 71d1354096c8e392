/*
 * The ISA dispatch: the kernel table of an ISA (the context's: ekv_context_create takes the best
 * the CPU reports, ekv_cpu_best_isa in core/context.c, unless the caller asks for less). The
 * tables are kernels_scalar.c and, on x86-64, kernels_avx2.c and kernels_avx512.c (each built
 * with its own ISA flags): one contract, kernels.h.
 */
#include "kernels.h"

const ekv_cpu_kernels *ekv_cpu_kernels_for(ekv_isa isa) {
#if defined(__x86_64__)
    if (isa == EKV_ISA_AVX512) return &ekv_cpu_kernels_avx512;
    if (isa == EKV_ISA_AVX2) return &ekv_cpu_kernels_avx2;
#endif
    (void)isa;
    return &ekv_cpu_kernels_scalar;
}
