/* The page ranges as the CPU bounds read them (docs/math.md §1.2): fp32, or compact (f16/bf16,
 * rounded outward) converted to fp32 on the way in, exactly. */
#ifndef EKV_CPU_RANGES_H
#define EKV_CPU_RANGES_H
#include "../kernels/kernels.h"

/* kmin/kmax of one (page, KV head) at flat offset off ((page * Hk + head) * D) as fp32: the
 * stats' own arrays when they are fp32, else buf [2 D] holding the compact ones converted. */
static inline void ekv_cpu_page_range(const ekv_cpu_kernels *k, const ekv_page_stats *st,
                                      int64_t off, int64_t D, float *buf, const float **mn,
                                      const float **mx) {
    if (st->range_dtype == EKV_DTYPE_F32) {
        *mn = st->kmin + off;
        *mx = st->kmax + off;
        return;
    }
    k->convert(st->kmin16 + off, st->range_dtype, buf, EKV_DTYPE_F32, D, NULL);
    k->convert(st->kmax16 + off, st->range_dtype, buf + D, EKV_DTYPE_F32, D, NULL);
    *mn = buf;
    *mx = buf + D;
}

/* Where the minima (hi = 0) or the maxima of (page, KV head) at flat offset off start, as
 * stored (for prefetching). */
static inline const char *ekv_cpu_range_addr(const ekv_page_stats *st, int hi, int64_t off) {
    if (st->range_dtype == EKV_DTYPE_F32) return (const char *)((hi ? st->kmax : st->kmin) + off);
    return (const char *)((hi ? st->kmax16 : st->kmin16) + off);
}
#endif
