/*
 * A page list ranked by several blocks (docs/architecture.md, "The split top-k select"): one
 * block per list left all but a few SMs idle at few KV heads, and a list of 2^16 pages (1M
 * tokens) took ~130 us a layer in one block. The list's pages are cut into contiguous parts, one
 * block each, in one cooperative launch (every block resident, so a waiting block never waits
 * on one that cannot start). The parts of a list meet at a barrier (common/group_sync.cuh):
 *   - once per radix digit: each part's digit histogram is added into the list's histogram
 *     of that digit, and every part picks the same digit from the sum;
 *   - once for the ordered compaction: each part's count of pages taken, so a part knows where
 *     its pages start in the list. The ties at the k-th key are taken in page order, so a part
 *     also needs the ties of the parts before it: its histogram of the last digit, kept per
 *     part as suffix sums, holds them (the last digit's bins count keys equal to the prefix in
 *     all but it). A ranked list with no page forced in (no sink, recent or hinted pages) skips
 *     this meeting: a part's pages are its keys above the k-th, which it counts over the first
 *     three digits (published before the last digit's barrier) and its suffix sums give above
 *     the last digit, plus its share of the ties (ekv_sel_ranked_offset).
 * A list of one part (short, or no cooperative launch) meets nobody and touches no global
 * state. The list histograms of the first three digits and the speculative one are zero
 * between launches (part 0 clears them after the last digit's barrier, when every part has
 * read them); the last digit's, read by every part after that barrier, is cleared by part 0 of
 * the next ranking before its first barrier.
 */
#pragma once
#include "../common/lists.cuh"
#include "../common/group_sync.cuh"
#include "../common/sizes.cuh"
#include <stdint.h>

namespace { /* as group_sync: each including file has its own copy */

/* Parts of `pages` pages at `part_pages` a part: 1 below EKV_CUDA_SEL_MIN_PARTS (no overflow
 * at any part_pages). */
__host__ __device__ __forceinline__ int64_t ekv_sel_part_count(int64_t pages, int64_t part_pages) {
    const int64_t n = pages < 1 ? 1 : 1 + (pages - 1) / part_pages;
    return n < EKV_CUDA_SEL_MIN_PARTS ? 1 : n;
}

/* The plan's state of the split select (ekv_cuda_plan.sel_*) and the launch's blocks a list. */
struct ekv_sel_parts {
    unsigned *bar;  /* [lists][2] */
    int32_t *hist;  /* [lists][EKV_CUDA_SEL_HISTS][256]: the digits', then the speculative one */
    int32_t *last;  /* [blocks][256] each part's last-digit histogram as suffix sums */
    int32_t *count; /* [blocks] each part's pages taken, or (a list placed without its offsets
                       barrier) its keys above the k-th key's first three digits */
    uint8_t *guess; /* [lists of any select] the first digit at the list's last ranking */
    int splits;     /* blocks a list in the launch (1: the one-block select) */
    int64_t part_pages;
};

/* Block blockIdx.x's part of its list: part s of n over pages [p0, p1). A list of n pages takes
 * ceil(n / part_pages) parts, at most the launch's splits; blocks past them have no part. */
struct ekv_sel_part {
    int row, s, n;
    int64_t p0, p1;
};
__device__ __forceinline__ ekv_sel_part ekv_sel_part_of(const ekv_sel_parts &X, int64_t pages) {
    ekv_sel_part pt;
    pt.row = blockIdx.x / X.splits;
    pt.s = blockIdx.x % X.splits;
    const int64_t want = ekv_sel_part_count(pages, X.part_pages);
    pt.n = want > X.splits ? X.splits : (int)want;
    pt.p0 = pages * pt.s / pt.n;
    pt.p1 = pages * (pt.s + 1) / pt.n;
    return pt;
}

/* dst[i] = the sum of hist[i..255] (a part's last-digit histogram as suffix sums: its keys at
 * and above a bin in two loads). Warp 0. */
__device__ __forceinline__ void ekv_sel_store_suffix(const int *hist, int32_t *dst) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    int v[8], s = 0;
#pragma unroll
    for (int k = 7; k >= 0; k--) v[k] = s += hist[8 * lane + k];
    int incl = s; /* the lanes' sums from this lane up */
    for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_down_sync(0xffffffffu, incl, o);
        if (lane + o < 32) incl += x;
    }
#pragma unroll
    for (int k = 0; k < 8; k++) dst[8 * lane + k] = v[k] + incl - s;
}

/* Digit `digit` of the list's ranking: this part's histogram `hist` (shared, complete) summed
 * over the list's parts into `sum` (shared), which is returned; `hist` itself for one part. The
 * last digit's histogram is also kept per part, as suffix sums (ekv_sel_store_suffix). With `spec`
 * (the first digit's round), the part's speculative histogram of the second digit is summed at the
 * same barrier into spec_sum (for one part spec_sum is not written: spec is the sum). Block-wide.
 */
__device__ __forceinline__ const int *
ekv_sel_digit_sum(const ekv_sel_parts &X, const ekv_sel_part &pt, int digit, const int *hist,
                  int *sum, const int *spec = nullptr, int *spec_sum = nullptr) {
    if (pt.n == 1) return hist;
    int32_t *g = X.hist + ((int64_t)pt.row * EKV_CUDA_SEL_HISTS + digit) * 256,
            *gs = X.hist + ((int64_t)pt.row * EKV_CUDA_SEL_HISTS + EKV_CUDA_SEL_DIGITS) * 256;
    const bool last = digit == EKV_CUDA_SEL_DIGITS - 1;
    int32_t *list = X.hist + (int64_t)pt.row * EKV_CUDA_SEL_HISTS * 256;
    if (digit == 0 && pt.s == 0) /* the last ranking's last digit (see the file's comment) */
        for (int i = threadIdx.x; i < 256; i += blockDim.x)
            list[(EKV_CUDA_SEL_DIGITS - 1) * 256 + i] = 0;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        if (hist[i]) atomicAdd(g + i, hist[i]);
        if (spec && spec[i]) atomicAdd(gs + i, spec[i]);
    }
    if (last) ekv_sel_store_suffix(hist, X.last + (int64_t)blockIdx.x * 256);
    group_sync(X.bar + 2 * (int64_t)pt.row, (unsigned)pt.n);
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        sum[i] = __ldcg(g + i);
        if (spec) spec_sum[i] = __ldcg(gs + i);
    }
    if (last && pt.s == 0) /* every part read them before this barrier */
        for (int i = threadIdx.x; i < EKV_CUDA_SEL_HISTS * 256; i += blockDim.x)
            if (i / 256 != EKV_CUDA_SEL_DIGITS - 1) list[i] = 0;
    __syncthreads();
    return sum;
}

/* Warp-wide (every lane gets it): the sum of v[first + i] over the parts i < n, loaded through
 * L2 (other blocks wrote them before a barrier). */
__device__ __forceinline__ int ekv_sel_parts_sum(const int32_t *v, int64_t first, int64_t stride,
                                                 int n) {
    int s = 0;
    for (int i = threadIdx.x & 31; i < n; i += 32) s += __ldcg(v + (first + i) * stride);
    return ekv_warp_sum(s);
}

/* Warp-wide (every lane gets them): over the parts before this one, their keys above the
 * k-th key T (with `counted`, their counts above T's first three digits in X.count, plus their
 * last digit's suffix sums above `bin`, T's last digit; else 0) and their keys equal to T (the
 * ties: bin's own count), from their suffix rows (after ekv_sel_digit_sum of the last digit). */
__device__ __forceinline__ void ekv_sel_parts_before(const ekv_sel_parts &X, const ekv_sel_part &pt,
                                                     int bin, bool counted, int *above, int *ties) {
    const int64_t first = (int64_t)blockIdx.x - pt.s;
    int a = 0, t = 0;
    for (int j = threadIdx.x & 31; j < pt.s; j += 32) {
        const int32_t *suf = X.last + (first + j) * 256;
        const int at = __ldcg(suf + bin), up = bin < 255 ? __ldcg(suf + bin + 1) : 0;
        t += at - up;
        if (counted) a += __ldcg(X.count + first + j) + up;
    }
    *above = ekv_warp_sum(a);
    *ties = ekv_warp_sum(t);
}

/* The keys equal to the k-th (the ties) in the parts before this one (T's last digit `bin`).
 * Block-wide; 0 for one part or part 0. */
__device__ __forceinline__ int ekv_sel_ties_before(const ekv_sel_parts &X, const ekv_sel_part &pt,
                                                   int bin, int *s_out) {
    if (pt.n == 1 || pt.s == 0) return 0;
    if (threadIdx.x < 32) {
        int a, t;
        ekv_sel_parts_before(X, pt, bin, false, &a, &t);
        if (threadIdx.x == 0) *s_out = t;
    }
    __syncthreads();
    const int t = *s_out;
    __syncthreads();
    return t;
}

/* Where part pt's pages start in a ranked list with no page forced in, without a meeting of its
 * own (the file's comment): the keys above T of the parts before it, and of the `remaining`
 * ties at T still to take (after the last digit's pick) those of the parts before it, in page
 * order; *ties_before: the ties before it. The parts' counts above T's first three digits must
 * be in X.count before the last digit's barrier. Block-wide. */
__device__ __forceinline__ int ekv_sel_ranked_offset(const ekv_sel_parts &X, const ekv_sel_part &pt,
                                                     int bin, int remaining, int *ties_before,
                                                     int *s_out) {
    if (threadIdx.x < 32) {
        int a, t;
        ekv_sel_parts_before(X, pt, bin, true, &a, &t);
        if (threadIdx.x == 0) {
            s_out[0] = a + (t < remaining ? t : remaining);
            s_out[1] = t;
        }
    }
    __syncthreads();
    const int before = s_out[0];
    *ties_before = s_out[1];
    __syncthreads();
    return before;
}

/* The ordered compaction of part pt in tiles of blockDim.x x UNROLL pages, each thread UNROLL
 * consecutive ones from lo: take_tile(lo, take) decides them (take[u] false at and past pt.p1).
 * The pages taken go to out[*written ...] in page order and in[] (unless NULL) records each
 * page's membership; with out NULL they are only counted into *written. Block-wide. */
template <int UNROLL, typename TakeTile>
__device__ __forceinline__ void ekv_sel_compact_part(const ekv_sel_part &pt, TakeTile &&take_tile,
                                                     int32_t *out, uint8_t *in, int *written,
                                                     int *wsum) {
    for (int64_t t0 = pt.p0; t0 < pt.p1; t0 += (int64_t)blockDim.x * UNROLL) {
        const int64_t lo = t0 + (int64_t)threadIdx.x * UNROLL;
        bool take[UNROLL];
        take_tile(lo, take);
        if (out)
            ekv_compact_tile<UNROLL>(take, lo, pt.p1, out, in, written, wsum);
        else
            ekv_count_tile<UNROLL>(take, written, wsum);
    }
}

/* Where this part's `mine` pages start in the list (the parts before it), and the list's total
 * in *total. Every part of the list must call it. Block-wide; one part: 0 and mine. */
__device__ __forceinline__ int ekv_sel_part_offset(const ekv_sel_parts &X, const ekv_sel_part &pt,
                                                   int mine, int *total, int *s_out) {
    if (pt.n == 1) {
        *total = mine;
        return 0;
    }
    const int64_t first = (int64_t)blockIdx.x - pt.s;
    if (threadIdx.x == 0) X.count[blockIdx.x] = mine;
    group_sync(X.bar + 2 * (int64_t)pt.row, (unsigned)pt.n);
    if (threadIdx.x < 32) {
        const int before = ekv_sel_parts_sum(X.count, first, 1, pt.s);
        const int all = ekv_sel_parts_sum(X.count, first, 1, pt.n);
        if (threadIdx.x == 0) {
            s_out[0] = before;
            s_out[1] = all;
        }
    }
    __syncthreads();
    const int before = s_out[0];
    *total = s_out[1];
    __syncthreads();
    return before;
}

/* Part pt's pages written into its list after the parts before it: compact(out, in, written)
 * runs one ordered compaction of the part (ekv_sel_compact_part: written, or with out NULL
 * counted); with several parts each counts first and they meet at ekv_sel_part_offset. Returns
 * the list's total pages. Every part of the list calls it. Block-wide. */
template <typename Compact>
__device__ __forceinline__ int ekv_sel_write_part(const ekv_sel_parts &X, const ekv_sel_part &pt,
                                                  Compact &&compact, int32_t *out, uint8_t *in,
                                                  int *s_out) {
    int mine = 0, total;
    if (pt.n > 1) compact(nullptr, nullptr, &mine);
    int written = ekv_sel_part_offset(X, pt, mine, &total, s_out);
    compact(out, in, &written);
    return pt.n == 1 ? written : total;
}

} // namespace
