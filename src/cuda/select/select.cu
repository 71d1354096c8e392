/*
 * select stage on the GPU (mirrors src/cpu/select/select.c and src/cpu/methods/certified.c):
 * page lists are written on the device, with no host round trip, into buffers sized at plan
 * time.
 *   topk:   one block per part of a (sequence, KV head) list: a long list is cut into parts
 *           ranked together by the blocks of one cooperative launch (select_parts.cuh,
 *           docs/architecture.md "The split top-k select"). The k-th largest bound is found by
 *           a radix select over the fp32 bit patterns (4 digits of 8 bits, histograms in
 *           shared memory, summed over the parts; the second digit counted in the first
 *           one's pass when the list's last first digit holds), then an ordered compaction
 *           writes the pages above it (ties at the k-th value: the lowest page numbers), the
 *           sink/recent pages and the last page. The list is in ascending page order (the CPU
 *           lists are in bound order: same sets). With per_query_head, the lists are per
 *           query head, each ranked by that head's own bounds.
 *   union:  per_query_head: the heads' lists merged per KV head, with a head mask per entry.
 *   round2: certified decode, docs/math.md §9.3: appends every page outside round 1 whose bound
 *           exceeds round 1's lower bound of tau (its histogram bound, "On the GPU") for some
 *           query head of the group (in parts as topk).
 */
#include "../common/launch.cuh"
#include "../common/lists.cuh"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include "select.cuh"
#include "select_parts.cuh"
#include "../common/splits.cuh"
#include "../../core/geometry.h"
#include "../../math/shard_select.h"

namespace {

enum { SEL_THREADS = EKV_CUDA_SEL_THREADS, SEL_UNROLL = 8 };
static_assert(SEL_THREADS % 32 == 0, "digit_histogram's warp tiles cover whole warps");

/* the bounds' order as integers, -0 as +0 (the CPU's tie rule; src/math/shard_select.h) */
__device__ __forceinline__ uint32_t order_key(float f) { return ekv_bound_key(f); }

/* Whether page p's bound exceeds tau[h] for a query head h in [h0, h0 + nh) (the heads of a
 * list): a page certified decode must read (docs/math.md §9.3; round 2 with round 1's lower
 * bound of tau, round 1 with a hint). */
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
    ekv_sel_parts parts; /* the blocks of a list (select_parts.cuh) */
};

/* The histogram of digit (key >> shift) & 0xFF over the keys matching prefix under mask, into
 * hist (shared, 256 bins). The top digits of most keys are equal: a warp's equal bins are added
 * by one atomic (ekv_warp_count_bin), where per-warp histograms cost a zeroing and a 32-way
 * sum every pass (a one-block select of 4096 pages took 18.5 us, bench/RESULTS.md). SEL_UNROLL
 * coalesced loads in flight per lane: one block per list is latency-bound. */
__device__ __forceinline__ void digit_histogram(const float *key, int64_t n, int shift,
                                                uint32_t mask, uint32_t prefix, int *hist,
                                                int *spec = nullptr, uint32_t guess = 0) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        hist[i] = 0;
        if (spec) spec[i] = 0;
    }
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
            if (spec) /* the first digit's round: the second digit under the guess */
                ekv_warp_count_bin(spec, base + 32 * u + lane < n && (kk[u] >> 24) == guess
                                                 ? (int)((kk[u] >> 16) & 0xFF)
                                                 : -1);
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

/* What decides whether page p of a top-k list is taken (topk_kernel): the k-th key `prefix`
 * and the ties at it still to take, or no ranking (take_all, or certified's hint), plus the
 * sink, recent and hinted pages. */
struct topk_rule {
    uint32_t prefix;
    int remaining;
    bool ranked, take_all;
    int64_t P, h0;
};

/* take[] of one tile: this thread's SEL_UNROLL consecutive pages from lo (those >= hi are not
 * the part's). *ties_seen counts the ties at the k-th key in page order before the tile (the
 * first `remaining` are taken) and advances by the tile's. Block-wide (one scan). */
__device__ __forceinline__ void topk_tile(const topk_args &A, const float *key, const topk_rule &r,
                                          int64_t lo, int64_t hi, int *ties_seen, int *wsum,
                                          bool *take) {
    uint32_t kk[SEL_UNROLL];
    int nties = 0;
#pragma unroll
    for (int u = 0; u < SEL_UNROLL; u++) {
        kk[u] = lo + u < hi && r.ranked ? order_key(key[lo + u]) : 0u;
        nties += lo + u < hi && r.ranked && kk[u] == r.prefix;
    }
    int tile_ties;
    int tie_i = *ties_seen + ekv_block_exclusive_scan(nties, wsum, &tile_ties);
#pragma unroll
    for (int u = 0; u < SEL_UNROLL; u++) {
        const int64_t p = lo + u;
        bool t = p < hi && (r.take_all || ekv_list_forces_page(p, r.P, A.sink, A.recent));
        if (p < hi && r.ranked)
            t |= kk[u] > r.prefix || (kk[u] == r.prefix && tie_i++ < r.remaining);
        if (p < hi && A.hint && !t) t = page_exceeds(A, A.bounds, A.hint, r.h0, A.out.lh, p);
        take[u] = t;
    }
    *ties_seen += tile_ties;
}

/* Part pt's pages of the list in page order (ekv_sel_compact_part: written, or with out NULL
 * counted); ties_seen: the ties at the k-th key in the parts before it. */
__device__ __forceinline__ void topk_compact(const topk_args &A, const float *key,
                                             const topk_rule &r, const ekv_sel_part &pt,
                                             int ties_seen, int32_t *out, uint8_t *in, int *written,
                                             int *wsum) {
    ekv_sel_compact_part<SEL_UNROLL>(
            pt,
            [&](int64_t lo, bool *take) {
                topk_tile(A, key, r, lo, pt.p1, &ties_seen, wsum, take);
            },
            out, in, written, wsum);
}

/* The shared memory of a top-k block. */
struct topk_smem {
    int hist[256], sum[256], spec[256], spec_sum[256];
    int wsum[32], parts[2];
    uint32_t prefix;
    int remaining;
};

/* Warp 0 (every lane gets it): the keys of histogram h in bins above d. */
__device__ __forceinline__ int bins_above(const int *h, int d) {
    int s = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int bin = 8 * (int)(threadIdx.x & 31) + k;
        if (bin > d) s += h[bin];
    }
    return ekv_warp_sum(s);
}

/* Part pt's share of its list's radix select: r.prefix (the k-th key T) and r.remaining (the
 * ties at T still to take) after the four digits, the parts' histograms summed at each
 * (ekv_sel_digit_sum). The first digit rarely moves from step to step: its round also counts
 * the second digit under the list's last first digit (the guess), and when the guess holds the
 * second digit needs no pass and no barrier of its own; exact either way. Every part reads the
 * guess before the first barrier, part 0 writes the new one after it. With `direct`, the part's
 * keys above T's first three digits go to X.count before the last digit's barrier
 * (ekv_sel_ranked_offset). Block-wide. */
__device__ void rank_part(const topk_args &A, const float *key, const ekv_sel_part &pt, int row,
                          bool direct, topk_rule &r, topk_smem &S) {
    const int last = EKV_CUDA_SEL_DIGITS - 1;
    const uint32_t guess = A.parts.guess[row];
    const int *next = nullptr; /* the second digit's histogram when the guess held */
    uint32_t mask = 0;
    int above = 0; /* warp 0: this part's keys above T's digits picked so far */
    for (int digit = 0; digit <= last; digit++) {
        const int shift = 24 - 8 * digit;
        const int *h = next, *own = next ? S.spec : S.hist;
        if (!h) {
            const bool first = digit == 0;
            digit_histogram(key + pt.p0, pt.p1 - pt.p0, shift, mask, r.prefix, S.hist,
                            first ? S.spec : nullptr, guess);
            if (direct && digit == last && threadIdx.x == 0) A.parts.count[blockIdx.x] = above;
            h = ekv_sel_digit_sum(A.parts, pt, digit, S.hist, S.sum, first ? S.spec : nullptr,
                                  S.spec_sum);
        }
        if (threadIdx.x < 32) pick_digit(h, r.remaining, r.prefix, shift, &S.prefix, &S.remaining);
        __syncthreads();
        r.prefix = S.prefix;
        r.remaining = S.remaining;
        mask |= 0xFFu << shift;
        if (direct && digit < last && threadIdx.x < 32)
            above += bins_above(own, (int)((r.prefix >> shift) & 0xFFu));
        next = digit == 0 && (r.prefix >> 24) == guess ? (pt.n == 1 ? S.spec : S.spec_sum)
                                                       : nullptr;
        if (digit == 0 && pt.s == 0 && threadIdx.x == 0)
            A.parts.guess[row] = (uint8_t)(r.prefix >> 24);
        __syncthreads();
    }
}

/* One block per part of a (sequence, list) (select_parts.cuh; one part = one block per list).
 * The k-th largest key is found by a radix select over the fp32 bit patterns (a digit of 8
 * bits a pass, the parts' histograms summed: rank_part), then each part compacts its pages in
 * order: where they start is known from the ranking itself when no page is forced in (sink,
 * recent; a hint ranks nothing), else from the parts' counts at one more meeting. */
__global__ void __launch_bounds__(SEL_THREADS) topk_kernel(topk_args A) {
    ekv_grid_begin();
    __shared__ topk_smem S;
    const int row = blockIdx.x / A.parts.splits, b = row / A.out.lps;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const int64_t n = sg.P - 1; /* scored pages */
    const ekv_sel_part pt = ekv_sel_part_of(A.parts, n);
    if (pt.s >= pt.n) return; /* the list has fewer parts than the launch's splits */
    const int64_t budget = ekv_seq_budget_tokens(A.budget_fraction, A.budget_tokens, sg.N);
    int64_t k = ekv_topk_page_count(budget, A.ps, n);
    if (A.hint) k = 0; /* no ranking: the hint picks the pages */
    const float *key = A.keys + (int64_t)row * A.cap_pages;
    topk_rule r;
    r.prefix = 0;
    r.remaining = (int)k;
    r.take_all = k >= n && !A.hint;
    r.ranked = !r.take_all && k > 0;
    r.P = sg.P;
    r.h0 = (int64_t)b * A.H + (row % A.out.lps) * A.out.lh; /* the list's heads */
    const bool direct = pt.n > 1 && r.ranked && !A.sink && !A.recent;
    if (r.ranked) rank_part(A, key, pt, row, direct, r, S);
    int32_t *out = A.out.pages + (int64_t)row * A.cap_pages;
    uint8_t *in = A.out.in + (int64_t)row * A.cap_pages;
    int total;
    if (direct) { /* the last part's pages end where the list does */
        int ties;
        total = ekv_sel_ranked_offset(A.parts, pt, (int)(r.prefix & 0xFFu), r.remaining, &ties,
                                      S.parts);
        topk_compact(A, key, r, pt, ties, out, in, &total, S.wsum);
    } else {
        const int ties =
                r.ranked ? ekv_sel_ties_before(A.parts, pt, (int)(r.prefix & 0xFFu), S.parts) : 0;
        total = ekv_sel_write_part(
                A.parts, pt,
                [&](int32_t *o, uint8_t *i, int *w) {
                    topk_compact(A, key, r, pt, ties, o, i, w, S.wsum);
                },
                out, in, S.parts);
    }
    if (pt.s == pt.n - 1 && threadIdx.x == 0)
        ekv_close_list(out, in, total, sg.P, A.out.count, row);
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
    const double *tau;   /* [B*H] round 1's lower bound of tau (tau_bound_kernel) */
    ekv_cuda_lists out;  /* the KV heads' lists: round 2 appended after round 1 */
    ekv_sel_parts parts; /* the blocks of a list (select_parts.cuh) */
};

/* Round 2's pages of part pt in page order (ekv_sel_compact_part: written, or with out NULL
 * counted): those outside round 1 (in[], left as it is) whose bound exceeds round 1's lower
 * bound of tau for a head of the group. SEL_UNROLL loads a thread in flight together, as the top-k
 * compaction (a thread's own run of n / 1024 pages, read twice by a dependent loop, took 34 us of
 * 16K pages on the model's trace at 256K, bench/RESULTS.md). */
__device__ __forceinline__ void round2_compact(const round2_args &A, const ekv_sel_part &pt,
                                               const uint8_t *in, int64_t h0, int32_t *out,
                                               int *written, int *wsum) {
    ekv_sel_compact_part<SEL_UNROLL>(
            pt,
            [&](int64_t lo, bool *take) {
#pragma unroll
                for (int u = 0; u < SEL_UNROLL; u++) take[u] = lo + u < pt.p1 && !in[lo + u];
#pragma unroll
                for (int u = 0; u < SEL_UNROLL; u++)
                    take[u] = take[u] && page_exceeds(A, A.bounds, A.tau, h0, A.G, lo + u);
            },
            out, nullptr, written, wsum);
}

/* The pages of round 2 after round 1's c1 entries, one block per part of a list
 * (select_parts.cuh): each part counts its pages, then writes them after the parts before it. */
__global__ void __launch_bounds__(SEL_THREADS) round2_kernel(round2_args A) {
    ekv_grid_begin();
    __shared__ int wsum[32], s_parts[2];
    const int row = blockIdx.x / A.parts.splits, b = row / A.Hk, kvh = row % A.Hk;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const ekv_sel_part pt = ekv_sel_part_of(A.parts, sg.P - 1);
    if (pt.s >= pt.n) return; /* the list has fewer parts than the launch's splits */
    const int64_t c1 = A.out.count[2 * row];
    int32_t *out = A.out.pages + (int64_t)row * A.cap_pages + c1;
    const uint8_t *in = A.out.in + (int64_t)row * A.cap_pages;
    const int64_t h0 = (int64_t)b * A.H + kvh * A.G;
    const int total = ekv_sel_write_part(
            A.parts, pt,
            [&](int32_t *o, uint8_t *, int *w) { round2_compact(A, pt, in, h0, o, w, wsum); }, out,
            nullptr, s_parts);
    if (pt.s == pt.n - 1 && threadIdx.x == 0) A.out.count[2 * row + 1] = (int32_t)(c1 + total);
}

} // namespace

/* A selection kernel writing the lists ekv_cuda_lists_of(pl, per_head): one block per
 * (sequence, list), the tail of every launcher here. */
template <typename Args>
static ekv_status launch_lists(ekv_cuda_plan *pl, void (*kernel)(Args), int batch, int per_head,
                               Args &A) {
    A.out = ekv_cuda_lists_of(pl, per_head);
    return ekv_cuda_launch(pl, kernel, batch * A.out.lps, SEL_THREADS, 0, A);
}

/* The blocks a list of a parted select kernel for `lists` lists (select_parts.cuh): as many as
 * the GPU holds at once over the lists, no more than the plan's longest list has parts; 1 (one
 * block a list, a plain launch) without cooperative launches or with too many lists to split.
 * Kernel's resident blocks an SM are asked once per instance. */
template <auto Kernel> static ekv_sel_parts sel_parts_of(ekv_cuda_plan *pl, int lists) {
    ekv_sel_parts X;
    X.bar = pl->sel_bar;
    X.hist = pl->sel_hist;
    X.last = pl->sel_last;
    X.count = pl->sel_count;
    X.guess = pl->sel_guess;
    X.part_pages = pl->p.select_part_pages > 0 ? pl->p.select_part_pages
                                               : (int64_t)EKV_CUDA_SEL_PART_PAGES;
    X.splits = 1;
    static int per_sm = 0;
    if (!per_sm && (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, SEL_THREADS,
                                                                  0) != cudaSuccess ||
                    per_sm < 1)) {
        cudaGetLastError(); /* not the step's error: one block a list serves every list */
        per_sm = -1;
    }
    if (!pl->cooperative || per_sm < 1 || lists > ekv_sel_lists(pl)) return X;
    int64_t resident = (int64_t)per_sm * pl->sms;
    if (resident > pl->sel_blocks) resident = pl->sel_blocks;
    int64_t s = resident / lists;
    const int64_t parts = ekv_sel_part_count(pl->cap_pages - 1, X.part_pages);
    if (s > parts) s = parts;
    X.splits = s > 1 ? (int)s : 1;
    return X;
}

/* A parted select kernel writing the lists ekv_cuda_lists_of(pl, per_head): A.parts.splits
 * blocks a (sequence, list), one cooperative launch when that is more than one. */
template <auto Kernel, typename Args>
static ekv_status launch_parted(ekv_cuda_plan *pl, int batch, int per_head, Args &A) {
    A.out = ekv_cuda_lists_of(pl, per_head);
    const int lists = batch * A.out.lps;
    A.parts = sel_parts_of<Kernel>(pl, lists);
    if (A.parts.splits > 1) {
        void *args[] = {&A};
        const cudaError_t e =
                cudaLaunchCooperativeKernel((const void *)Kernel, dim3(lists * A.parts.splits),
                                            dim3(SEL_THREADS), args, 0, pl->stream);
        if (e == cudaSuccess) {
            pl->launches++;
            return EKV_OK;
        }
        /* fewer SMs than the device has (MPS limits): the same lists, one block each */
        if (e != cudaErrorCooperativeLaunchTooLarge)
            return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "cudaLaunchCooperativeKernel: %s",
                            cudaGetErrorString(e));
        cudaGetLastError();
        A.parts.splits = 1;
    }
    return launch_lists(pl, Kernel, batch, per_head, A);
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
    return launch_parted<topk_kernel>(pl, batch, per_head, A);
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
    return launch_parted<round2_kernel>(pl, batch, 0, A);
}
