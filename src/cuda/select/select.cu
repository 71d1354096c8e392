/*
 * select stage on the GPU (mirrors src/cpu/select/select.c and src/cpu/methods/certified.c): page lists are
 * written on the device, with no host round trip, into buffers sized at plan time.
 *   topk:   one block per (sequence, KV head). The k-th largest bound is found by a radix
 *           select over the fp32 bit patterns (4 passes of 8 bits, histograms in shared
 *           memory), then one ordered compaction writes the pages above it (ties at the k-th
 *           value: the lowest page numbers), the sink/recent pages and the last page. The
 *           list is in ascending page order (the CPU lists are in bound order: same sets).
 *           With per_query_head, one block per query head ranks by that head's own bounds.
 *   union:  per_query_head: the heads' lists merged per KV head, with a head mask per entry.
 *   round2: certified decode, docs/math.md §9.3: appends every page outside round 1 whose bound
 *           exceeds round 1's tau for some query head of the group.
 */
#include "../common/launch.cuh"
#include "lists.cuh"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include "select.cuh"
#include "../common/splits.cuh"
#include "../../core/geometry.h"
#include "../../math/shard_select.h"

namespace {

enum { SEL_THREADS = 1024, SEL_UNROLL = 8 };
static_assert(SEL_THREADS % 32 == 0, "digit_histogram's warp tiles cover whole warps");

/* the bounds' order as integers, -0 as +0 (the CPU's tie rule; src/math/shard_select.h) */
__device__ __forceinline__ uint32_t order_key(float f) { return ekv_bound_key(f); }

/* Whether page p's bound exceeds tau[h] for a query head h in [h0, h0 + nh) (the heads of a
 * list): a page certified decode must read (docs/math.md §9.3; round 2 with round 1's tau,
 * round 1 with a hint). */
__device__ __forceinline__ bool page_exceeds(const ekv_cuda_shape &S, const float *bounds,
                                             const double *tau, int64_t h0, int nh, int64_t p) {
    for (int64_t h = h0; h < h0 + nh; h++)
        if ((double)bounds[h * S.cap_pages + p] > tau[h]) return true;
    return false;
}

struct topk_args : ekv_cuda_shape {
    const double *hint;  /* certified's tau_hint [B*H] (device) or NULL: the pages it cannot */
    const float *bounds; /* rule out replace the top-k ([B*H][cap_pages] bounds)             */
    int64_t budget_tokens;
    double budget_fraction; /* > 0: each sequence's share (ekv_seq_budget_tokens) */
    int sink, recent;
    const float *keys; /* [lists][cap_pages]: the group's max, or each head's own bounds */
    ekv_cuda_lists out;
};

/* The histogram of digit (key >> shift) & 0xFF over the keys matching prefix under mask, into
 * hist (shared, 256 bins). The top digits of most keys are equal: a warp's equal bins are added
 * by one atomic (ekv_warp_count_bin), where per-warp histograms cost a zeroing and a 32-way
 * sum every pass (a one-block select of 4096 pages took 18.5 us, bench/RESULTS.md). SEL_UNROLL
 * coalesced loads in flight per lane: one block per list is latency-bound. */
__device__ __forceinline__ void digit_histogram(const float *key, int64_t n, int shift,
                                                uint32_t mask, uint32_t prefix, int *hist) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    /* warp-uniform trip count: every lane takes part in the matches */
    for (int64_t base = (int64_t)(threadIdx.x & ~31) * SEL_UNROLL; base < n;
         base += (int64_t)blockDim.x * SEL_UNROLL) {
        uint32_t kk[SEL_UNROLL];
#pragma unroll
        for (int u = 0; u < SEL_UNROLL; u++) {
            const int64_t p = base + 32 * u + lane;
            kk[u] = p < n ? order_key(key[p]) : 0u;
        }
#pragma unroll
        for (int u = 0; u < SEL_UNROLL; u++) {
            const bool counted = base + 32 * u + lane < n && (kk[u] & mask) == prefix;
            ekv_warp_count_bin(hist, counted ? (int)((kk[u] >> shift) & 0xFF) : -1);
        }
    }
    __syncthreads();
}

/* Warp 0: the digit holding the remaining-th largest key. Lane l sums bins 255-8l ..
 * 248-8l, a scan finds the lane whose bins cross `remaining`, and that lane walks its 8
 * bins; it writes the extended prefix and what remains to take below it. */
__device__ __forceinline__ void pick_digit(const int *hist, int remaining, uint32_t prefix,
                                           int shift, uint32_t *s_prefix, int *s_remaining) {
    const int lane = threadIdx.x;
    int sum = 0;
    for (int i = 0; i < 8; i++) sum += hist[255 - 8 * lane - i];
    int incl = sum;
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    const int excl = incl - sum;
    const unsigned hit = __ballot_sync(0xffffffffu, excl < remaining && incl >= remaining);
    if (lane == __ffs(hit) - 1) {
        int cum = excl, d = 255 - 8 * lane;
        for (int i = 0; i < 7; i++, d--) {
            if (cum + hist[d] >= remaining) break;
            cum += hist[d];
        }
        *s_prefix = prefix | ((uint32_t)d << shift);
        *s_remaining = remaining - cum;
    }
}

__global__ void __launch_bounds__(SEL_THREADS) topk_kernel(topk_args A) {
    ekv_grid_begin();
    __shared__ int hist[256];
    __shared__ int wsum[32];
    __shared__ uint32_t s_prefix;
    __shared__ int s_remaining;
    const int row = blockIdx.x, b = row / A.out.lps;
    const int64_t h0 = (int64_t)b * A.H + (row % A.out.lps) * A.out.lh; /* the list's heads */
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const int64_t n = sg.P - 1; /* scored pages */
    const int64_t budget = ekv_seq_budget_tokens(A.budget_fraction, A.budget_tokens, sg.N);
    int64_t k = ekv_topk_page_count(budget, A.ps, n);
    if (A.hint) k = 0; /* no ranking: the hint picks the pages */
    const float *key = A.keys + (int64_t)row * A.cap_pages;
    uint32_t prefix = 0, mask = 0;
    int remaining = (int)k;
    if (k > 0 && k < n) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            digit_histogram(key, n, shift, mask, prefix, hist);
            if (threadIdx.x < 32)
                pick_digit(hist, remaining, prefix, shift, &s_prefix, &s_remaining);
            __syncthreads();
            prefix = s_prefix;
            remaining = s_remaining;
            mask |= 0xFFu << shift;
            __syncthreads();
        }
    }
    /* ordered compaction: key > T, the first `remaining` keys == T (in page order), sink and
     * recent pages. Tiles of SEL_THREADS x SEL_UNROLL pages, each thread SEL_UNROLL consecutive
     * ones, two block scans per tile (ties, then pages taken) keep the page order. */
    const bool take_all = k >= n && !A.hint;
    const bool ranked = !take_all && k > 0;
    int32_t *out = A.out.pages + (int64_t)row * A.cap_pages;
    uint8_t *in = A.out.in + (int64_t)row * A.cap_pages;
    int written = 0, ties_seen = 0;
    for (int64_t t0 = 0; t0 < n; t0 += (int64_t)blockDim.x * SEL_UNROLL) {
        const int64_t lo = t0 + (int64_t)threadIdx.x * SEL_UNROLL;
        uint32_t kk[SEL_UNROLL];
        int nties = 0;
#pragma unroll
        for (int u = 0; u < SEL_UNROLL; u++) {
            kk[u] = lo + u < n && ranked ? order_key(key[lo + u]) : 0u;
            nties += lo + u < n && ranked && kk[u] == prefix;
        }
        int tile_ties;
        int tie_i = ties_seen + ekv_block_exclusive_scan(nties, wsum, &tile_ties);
        bool take[SEL_UNROLL];
#pragma unroll
        for (int u = 0; u < SEL_UNROLL; u++) {
            const int64_t p = lo + u;
            bool t = p < n && (take_all || p < A.sink || p >= sg.P - 1 - A.recent);
            if (p < n && ranked) t |= kk[u] > prefix || (kk[u] == prefix && tie_i++ < remaining);
            if (p < n && A.hint && !t) t = page_exceeds(A, A.bounds, A.hint, h0, A.out.lh, p);
            take[u] = t;
        }
        ekv_compact_tile<SEL_UNROLL>(take, lo, n, out, in, &written, wsum);
        ties_seen += tile_ties;
    }
    if (threadIdx.x == 0) ekv_close_list(out, in, written, sg.P, A.out.count, row);
}

/* per_query_head: the union per KV head of its query heads' lists (each head's membership
 * flags hlist_in), in page order, with each entry's head mask. The last page is every head's
 * (a shard before the last: no page is forced, docs/math.md §11). */
struct union_args : ekv_cuda_shape {
    int shard_pos;          /* EKV_SHARD_*: a shard before the last forces no page */
    const uint8_t *head_in; /* [B*H][cap_pages] */
    ekv_cuda_lists out;     /* the KV heads' lists (ekv_cuda_lists_of(pl, 0)) */
    uint16_t *list_heads;
};

__global__ void __launch_bounds__(SEL_THREADS) union_kernel(union_args A) {
    ekv_grid_begin();
    __shared__ int wsum[32];
    const int row = blockIdx.x, b = row / A.Hk, kvh = row % A.Hk;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const int64_t n = ekv_shard_ranked_pages(sg.P, A.shard_pos);
    const uint8_t *hin = A.head_in + ((int64_t)b * A.H + kvh * A.G) * A.cap_pages;
    int32_t *out = A.out.pages + (int64_t)row * A.cap_pages;
    uint8_t *in = A.out.in + (int64_t)row * A.cap_pages;
    uint16_t *heads = A.list_heads + (int64_t)row * A.cap_pages;
    int written = 0;
    for (int64_t t0 = 0; t0 < n; t0 += (int64_t)blockDim.x * SEL_UNROLL) {
        const int64_t lo = t0 + (int64_t)threadIdx.x * SEL_UNROLL;
        bool take[SEL_UNROLL];
        uint16_t mask[SEL_UNROLL];
#pragma unroll
        for (int u = 0; u < SEL_UNROLL; u++) {
            unsigned m = 0;
            for (int g = 0; g < A.G && lo + u < n; g++)
                m |= (unsigned)(hin[(int64_t)g * A.cap_pages + lo + u] != 0) << g;
            mask[u] = (uint16_t)m;
            take[u] = m != 0;
        }
        ekv_compact_tile<SEL_UNROLL>(take, lo, n, out, in, &written, wsum, mask, heads);
    }
    if (threadIdx.x == 0) {
        if (A.shard_pos != EKV_SHARD_INNER) heads[written] = (uint16_t)((1u << A.G) - 1u);
        ekv_close_shard_list(out, in, written, sg.P, A.out.count, row, A.shard_pos);
    }
}

struct round2_args : ekv_cuda_shape {
    const float *bounds; /* [B*H][cap_pages] */
    const double *tau;   /* [B*H] round 1 */
    ekv_cuda_lists out;  /* the KV heads' lists: round 2 appended after round 1 */
};

/* The pages of round 2 in page order after round 1's c1 entries. A thread takes SEL_UNROLL
 * consecutive pages a tile, their loads in flight together, as the top-k compaction does (a
 * thread's own run of n / 1024 pages, read twice by a dependent loop, took 34 us of 16K pages
 * on the model's trace at 256K, bench/RESULTS.md). in[] is round 1's membership: left as it is. */
__global__ void __launch_bounds__(SEL_THREADS) round2_kernel(round2_args A) {
    ekv_grid_begin();
    __shared__ int wsum[32];
    const int row = blockIdx.x, b = row / A.Hk, kvh = row % A.Hk;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const int64_t n = sg.P - 1;
    const int64_t c1 = A.out.count[2 * row];
    int32_t *out = A.out.pages + (int64_t)row * A.cap_pages + c1;
    const uint8_t *in = A.out.in + (int64_t)row * A.cap_pages;
    const int64_t h0 = (int64_t)b * A.H + kvh * A.G;
    int written = 0;
    for (int64_t t0 = 0; t0 < n; t0 += (int64_t)blockDim.x * SEL_UNROLL) {
        const int64_t lo = t0 + (int64_t)threadIdx.x * SEL_UNROLL;
        bool take[SEL_UNROLL];
#pragma unroll
        for (int u = 0; u < SEL_UNROLL; u++) take[u] = lo + u < n && !in[lo + u];
#pragma unroll
        for (int u = 0; u < SEL_UNROLL; u++)
            take[u] = take[u] && page_exceeds(A, A.bounds, A.tau, h0, A.G, lo + u);
        ekv_compact_tile<SEL_UNROLL>(take, lo, n, out, nullptr, &written, wsum);
    }
    if (threadIdx.x == 0) A.out.count[2 * row + 1] = (int32_t)(c1 + written);
}

} // namespace

ekv_cuda_lists ekv_cuda_lists_of(const ekv_cuda_plan *pl, int per_head) {
    ekv_cuda_lists l;
    l.lps = per_head ? pl->p.num_heads : pl->p.num_kv_heads;
    l.lh = per_head ? 1 : pl->p.num_heads / pl->p.num_kv_heads;
    l.pages = per_head ? pl->hlist_pages : pl->list_pages;
    l.count = per_head ? pl->hlist_count : pl->list_count;
    l.in = per_head ? pl->hlist_in : pl->in_list;
    return l;
}

/* A selection kernel writing the lists ekv_cuda_lists_of(pl, per_head): one block per
 * (sequence, list), the tail of every launcher here. */
template <typename Args>
static ekv_status launch_lists(ekv_cuda_plan *pl, void (*kernel)(Args), int batch, int per_head,
                               Args &A) {
    A.out = ekv_cuda_lists_of(pl, per_head);
    return ekv_cuda_launch(pl, kernel, batch * A.out.lps, SEL_THREADS, 0, A);
}

ekv_status ekv_cuda_launch_topk(ekv_cuda_plan *pl, const ekv_page_table *t, int batch,
                                int64_t budget_tokens, double budget_fraction, int32_t sink_pages,
                                int32_t recent_pages, const double *hint, int per_head) {
    topk_args A;
    ekv_cuda_set_shape(A, pl, t);
    A.hint = hint;
    A.bounds = pl->bounds;
    A.budget_tokens = budget_tokens;
    A.budget_fraction = budget_fraction;
    A.sink = sink_pages;
    A.recent = recent_pages;
    A.keys = per_head ? pl->bounds : pl->list_bounds; /* each head ranks by its own bounds */
    return launch_lists(pl, topk_kernel, batch, per_head, A);
}

ekv_status ekv_cuda_launch_union(ekv_cuda_plan *pl, const ekv_page_table *t, int batch) {
    union_args A;
    ekv_cuda_set_shape(A, pl, t);
    A.shard_pos = pl->shard_pos;
    A.head_in = pl->hlist_in;
    A.list_heads = pl->list_heads;
    return launch_lists(pl, union_kernel, batch, 0, A);
}

ekv_status ekv_cuda_launch_round2(ekv_cuda_plan *pl, const ekv_page_table *t, int batch) {
    round2_args A;
    ekv_cuda_set_shape(A, pl, t);
    A.bounds = pl->bounds;
    A.tau = pl->tau;
    return launch_lists(pl, round2_kernel, batch, 0, A);
}
