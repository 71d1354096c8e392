/*
 * bound stage on the GPU (mirrors src/cpu/stages/bound.c; docs/math.md §2.3, 9.5): an upper bound
 * of every page's z-space scores but the last, per query head, and its max over the GQA group (the
 * key that ranks pages for a KV-head list). Four lanes per (page, KV head), eight pages per
 * warp pass; the page's summaries (kmin, kmax and, with the ball, kmean and the radius) are
 * read once for the G query heads of the group.
 *   box  = sum_d max(q'_d kmin_d, q'_d kmax_d),   q' = a scale q
 *   ball = <q', c> + ||q'|| r
 *   U    = min(box, ball) + slack + bonus  (with the ball; box + bonus without it)
 * The slack is the CPU's: 4 (D + 4) 2^-24 ||q'|| (||c|| + r) + 8 2^-24 |a m_h| (|p ps - i| + ps),
 * which covers the rounding of this pass and of the score kernel in any summation order,
 * so U bounds the *computed* scores and certified decode stays exact. With a lower bound
 * tau_lb of tau and superpage boxes, a page whose superpage bound is already <= tau_lb for
 * every head takes that bound without reading its own summaries (docs/math.md §9.6).
 */
#include "bound.cuh"
#include "../common/launch.cuh"
#include "../common/loads.cuh"
#include "../common/plan.cuh"
#include "../common/ranges.cuh"
#include "../common/reduce.cuh"
#include "../common/sizes.cuh"
#include "../common/splits.cuh"
#include "../common/test_hooks.h" /* the read-backs defined here */
#include "../common/lists.cuh"
#include "../../core/geometry.h"
#include "../../core/stats_rules.h"
#include "../../math/page_bound.h"
#include "../../math/shard_select.h"
#include <math_constants.h>

namespace {

struct bound_args : ekv_cuda_shape {
    ekv_page_stats st;
    ekv_cuda_ranges rng; /* kmin/kmax as stored: fp32 or compact */
    ekv_cuda_ranges ctr; /* the ball's centres (kmean, or the compact kmean16) in .mn/.mn16 */
    const float *rad;    /* and its radii (radius, or radius16 around kmean16) */
    const float *q, *slopes;
    double qscale, a;
    int with_ball, rows;
    int64_t chunk_pages; /* pages per block (bound_chunk_pages) */
    int shard_pos;        /* EKV_SHARD_*: a shard before the last ranks its last page too */
    const double *tau_lb; /* [B*H] lower bounds of tau (superpage skipping), or NULL */
    unsigned long long *sp_count; /* with tau_lb: [0] pages skipped, [1] superpage boxes read */
    float *bounds, *list_bounds;
    /* certified's round 1 from round 0's bound (docs/math.md §9.3), listed here: with
     * list.pages, every page whose bound exceeds tau_lb for a head of the group, the sink and
     * recent pages and the last page, appended to the KV-head lists in no particular order
     * (their counts zero before the launch: stages/round0.cu) */
    ekv_cuda_lists list;
    int sink, recent;
};

enum {
    BOUND_WARPS = EKV_CUDA_THREADS / 32,
    BOUND_LANES = 4,              /* lanes per page: 16-byte chunks of its summaries each    */
    BOUND_PPW = 32 / BOUND_LANES, /* pages per warp pass: their loads are in flight together */
    BOUND_STRIDE = BOUND_WARPS * BOUND_PPW, /* pages of one pass of the block             */
    BOUND_PAGES = 1024 /* pages per block at most: the q setup is amortised                  */
};

/* Pages per block for `rows` list rows of cap_pages pages: about four blocks per SM (one
 * block per 1024 pages left most SMs idle at few KV heads: 32 blocks at 256K tokens and 2 KV
 * heads), in whole passes. */
int64_t bound_chunk_pages(int64_t cap_pages, int64_t rows, int sms) {
    const int64_t want = 4 * (int64_t)sms;
    int64_t c = (cap_pages * rows + want - 1) / want;
    c = (c + BOUND_STRIDE - 1) / BOUND_STRIDE * BOUND_STRIDE;
    const int64_t lo = BOUND_STRIDE, hi = BOUND_PAGES;
    return c < lo ? lo : c > hi ? hi : c;
}

/* Sum over the BOUND_LANES lanes of a page (every one of them gets it). */
template <typename T> __device__ __forceinline__ T page_sum(T v) {
#pragma unroll
    for (int o = 1; o < BOUND_LANES; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* This lane's share of a page's box and ball dot products for each head of the group: the
 * summaries' 8-dim chunks sl, sl + BOUND_LANES, ... (so = the page's summary offset). */
template <int GM, int RT>
__device__ __forceinline__ void page_partials(const bound_args &A, const float *qs, int64_t so,
                                              int sl, float *box, float *dot, float *c2) {
    for (int c = sl; c < A.D / 8; c += BOUND_LANES) {
        float mn[8], mx[8], cm[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        ekv_range_load<8, RT>(A.rng, false, so + c * 8, mn);
        ekv_range_load<8, RT>(A.rng, true, so + c * 8, mx);
        if (A.with_ball) {
            ekv_range_load<8>(A.ctr, false, so + c * 8, cm);
#pragma unroll
            for (int i = 0; i < 8; i++) *c2 += cm[i] * cm[i];
        }
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g < A.G) {
                const float4 qa = *reinterpret_cast<const float4 *>(qs + g * A.D + c * 8),
                             qb = *reinterpret_cast<const float4 *>(qs + g * A.D + c * 8 + 4);
                const float qq[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
                for (int i = 0; i < 8; i++) box[g] += fmaxf(qq[i] * mn[i], qq[i] * mx[i]);
                if (A.with_ball)
#pragma unroll
                    for (int i = 0; i < 8; i++) dot[g] += qq[i] * cm[i];
            }
        }
    }
}

/* Superpages (docs/math.md §9.6, as src/cpu/stages/bound.c): page p (logical, physical `phys`)
 * takes its superpage's bound, and its own summaries are not read, when that bound is already <=
 * tau_lb for every head of the group; spu[g] = the superpage bound of head g with p's ALiBi
 * term and slack, rounded up. Warp-collective: the pages of a pass that share a superpage
 * (__match_any_sync) read its box once, on the lanes of the first of them. */
template <int GM>
__device__ __forceinline__ bool superpage_skip(const bound_args &A, const float *qs,
                                               const double *qn1, const ekv_seq_geom &sg, int b,
                                               int kvh, int64_t p, int64_t phys, bool ranked,
                                               int sl, float *spu, bool *read_box) {
    const int lane = threadIdx.x & 31, D = A.D;
    const long long sid = ranked ? (long long)(phys / A.st.superpage_pages) : -1;
    const int leader = __ffs(__match_any_sync(0xffffffffu, sid)) - 1; /* lane 0 of a page */
    float box[GM], amax = 0.f;
#pragma unroll
    for (int g = 0; g < GM; g++) box[g] = 0.f;
    *read_box = ranked && (lane & ~(BOUND_LANES - 1)) == leader;
    if (*read_box) {
        const int64_t so = ((int64_t)sid * A.Hk + kvh) * D;
        for (int c = sl; c < D / 8; c += BOUND_LANES) {
            float mn[8], mx[8];
            const ekv_cuda_ranges sr = {A.st.smin, A.st.smax, NULL, NULL, EKV_DTYPE_F32};
            ekv_range_load<8, EKV_RANGE_F32>(sr, false, so + c * 8, mn);
            ekv_range_load<8, EKV_RANGE_F32>(sr, true, so + c * 8, mx);
#pragma unroll
            for (int i = 0; i < 8; i++) amax = fmaxf(amax, fmaxf(fabsf(mn[i]), fabsf(mx[i])));
#pragma unroll
            for (int g = 0; g < GM; g++)
                if (g < A.G)
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const float qd = qs[g * D + c * 8 + i];
                        box[g] += fmaxf(qd * mn[i], qd * mx[i]);
                    }
        }
    }
#pragma unroll
    for (int o = 1; o < BOUND_LANES; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    amax = __shfl_sync(0xffffffffu, amax, leader);
#pragma unroll
    for (int g = 0; g < GM; g++) box[g] = __shfl_sync(0xffffffffu, page_sum(box[g]), leader);
    if (!ranked) return false;
    const double u24 = 5.9604644775390625e-8;
    const int64_t N = sg.N, ps = A.ps, last = (p + 1) * ps - 1 < N - 1 ? (p + 1) * ps - 1 : N - 1;
    bool all = true;
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= A.G) break;
        /* slack 4 (D + 4) u ||q'||_1 max_d |k_d| >= 4 (D + 4) u sum_d |q'_d k_d| */
        const float cur = (float)((double)box[g] + 4.0 * (double)(D + 4) * u24 * qn1[g] * amax +
                                  1e-30);
        const double am = A.slopes ? A.a * (double)A.slopes[kvh * A.G + g] : 0.0;
        const double ub = ekv_page_bound_or_inf(
                (double)cur + am * (double)(last - (N - 1)) +
                8.0 * u24 * fabs(am) * ((double)llabs(p * ps - (N - 1)) + (double)ps));
        float uf = (float)ub;
        if ((double)uf < ub) uf = nextafterf(uf, CUDART_INF_F);
        spu[g] = uf;
        all = all && (double)uf <= A.tau_lb[(int64_t)b * A.H + kvh * A.G + g];
    }
    return all;
}

/* q' = a scale q of the group's heads into qs ([G][D], shared), ||q'||_2 and ||q'||_1 in double,
 * rounded up (the ball's and the superpage slack's); block-wide, ends with a barrier. */
__device__ __forceinline__ void load_group_query(const bound_args &A, int b, int kvh, float *qs,
                                                 double *qn, double *qn1) {
    const int G = A.G, D = A.D, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    ekv_group_query(A.q + ((int64_t)b * A.H + kvh * G) * D, A.qscale, G * D, qs);
    __syncthreads();
    for (int g = warp; g < G; g += BOUND_WARPS) {
        double s = 0, s1 = 0;
        for (int d = lane; d < D; d += 32) {
            s += (double)qs[g * D + d] * qs[g * D + d];
            s1 += fabs((double)qs[g * D + d]);
        }
        s = ekv_warp_sum(s);
        s1 = ekv_warp_sum(s1);
        if (lane == 0) {
            qn[g] = sqrt(s) * (1 + 1e-12);
            qn1[g] = s1 * (1 + 1e-12);
        }
    }
    __syncthreads();
}

/* Page p's bounds given, not computed: u[g] per head (a skipped page's superpage bound), or
 * -inf for every head with u = nullptr (the last page and beyond are not ranked); the list's
 * key is their max. */
__device__ __forceinline__ void store_given_bounds(const bound_args &A, int b, int kvh, int row,
                                                   int64_t p, const float *u) {
    float best = -CUDART_INF_F;
    for (int g = 0; g < A.G; g++) {
        const float v = u ? u[g] : -CUDART_INF_F;
        A.bounds[((int64_t)b * A.H + kvh * A.G + g) * A.cap_pages + p] = v;
        best = fmaxf(best, v);
    }
    A.list_bounds[(int64_t)row * A.cap_pages + p] = best;
}

/* The warp's superpage counts (pages skipped, boxes read) into the step's two counters: one
 * atomic each per warp. Warp-collective. */
__device__ __forceinline__ void flush_superpage_counts(const bound_args &A,
                                                       unsigned long long n_skip,
                                                       unsigned long long n_box) {
    n_skip = ekv_warp_sum(n_skip);
    n_box = ekv_warp_sum(n_box);
    if ((threadIdx.x & 31) == 0 && (n_skip || n_box)) {
        atomicAdd(A.sp_count, n_skip);
        atomicAdd(A.sp_count + 1, n_box);
    }
}

/* Reserves n entries at the end of list `row` (A.list: its round-1 and total counts move
 * together); returns the first. One thread. */
__device__ __forceinline__ int reserve_list(const bound_args &A, int row, int n) {
    atomicAdd(A.list.count + 2 * row + 1, n);
    return atomicAdd(A.list.count + 2 * row, n);
}

/* Appends the pages whose lanes have take set to list `row` (A.list; warp-collective: one
 * atomic a warp pass, the pages in lane order after the ones already there). */
__device__ __forceinline__ void append_pages(const bound_args &A, int row, bool take, int64_t p) {
    const unsigned m = __ballot_sync(0xffffffffu, take);
    if (!m) return;
    const int lane = threadIdx.x & 31;
    int at = 0;
    if (lane == __ffs(m) - 1) at = reserve_list(A, row, __popc(m));
    at = __shfl_sync(0xffffffffu, at, __ffs(m) - 1);
    if (take)
        A.list.pages[(int64_t)row * A.cap_pages + at + __popc(m & ((1u << lane) - 1))] = (int32_t)p;
}

/* Appends page p to list `row` (A.list) alone: one thread. */
__device__ __forceinline__ void append_pages_one(const bound_args &A, int row, int64_t p) {
    const int at = reserve_list(A, row, 1);
    A.list.pages[(int64_t)row * A.cap_pages + at] = (int32_t)p;
}

template <int GM, int RT> /* compile-time bound of the group size; how the ranges are stored */
__global__ void __launch_bounds__(EKV_CUDA_THREADS) bound_kernel(bound_args A) {
    ekv_grid_begin();
    extern __shared__ float qs[]; /* [G][D] q' */
    __shared__ double qn[GM], qn1[GM];
    /* one-dimensional grid, the list row fastest: the blocks in flight together read the same
     * pages for every KV head, which are adjacent in the summary arrays ([page][kv head][D]) */
    const int nrows = A.rows, row = (int)(blockIdx.x % nrows), b = row / A.Hk, kvh = row % A.Hk,
              G = A.G, D = A.D, ps = A.ps;
    const int64_t chunk = blockIdx.x / nrows;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int u = lane / BOUND_LANES, sl = lane % BOUND_LANES;
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    /* the last page, unless ranked as any other (a shard before the last, docs/math.md §11) */
    if (A.list.pages && chunk == 0 && threadIdx.x == 0 && sg.P >= 1 &&
        ekv_shard_ranked_pages(sg.P, A.shard_pos) < sg.P)
        append_pages_one(A, row, sg.P - 1);
    load_group_query(A, b, kvh, qs, qn, qn1);
    /* every page but the sequence's last; a shard before the last ranks its own last page;
     * pages past the sequence's are read by no stage and not written */
    const int64_t nrank = ekv_shard_ranked_pages(sg.P, A.shard_pos);
    const int64_t cend = (chunk + 1) * A.chunk_pages, pend = cend < sg.P ? cend : sg.P;
    /* BOUND_PPW pages per warp pass, BOUND_LANES lanes on each: their loads are in flight
     * together, one shuffle serves every page of the pass, and the pages' final (double)
     * arithmetic runs on one lane of each page in parallel */
    constexpr int STRIDE = BOUND_STRIDE;
    /* the page's physical index, loaded a pass ahead (its latency would precede the loads) */
    auto phys_of = [&](int64_t p) -> int64_t {
        return p < pend && p < nrank ? A.t.indices[sg.first + p] : 0;
    };
    int64_t next = phys_of(chunk * A.chunk_pages + warp * BOUND_PPW + u);
    unsigned long long n_skip = 0, n_box = 0; /* superpages: this lane's pages skipped, boxes read */
    for (int64_t base = chunk * A.chunk_pages + warp * BOUND_PPW; base < pend; base += STRIDE) {
        const int64_t p = base + u;
        const bool ranked = p < pend && p < nrank; /* the last page and beyond: not ranked */
        const int64_t phys = next;
        next = phys_of(p + STRIDE);
        float box[GM], dot[GM], spu[GM], c2 = 0.f;
#pragma unroll
        for (int g = 0; g < GM; g++) box[g] = dot[g] = 0.f;
        bool read_box = false;
        const bool skip = A.tau_lb && superpage_skip<GM>(A, qs, qn1, sg, b, kvh, p, phys, ranked,
                                                         sl, spu, &read_box);
        if (sl == 0) {
            n_skip += skip;
            n_box += read_box;
        }
        if (ranked && !skip)
            page_partials<GM, RT>(A, qs, (phys * A.Hk + kvh) * D, sl, box, dot, &c2);
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g < G) {
                box[g] = page_sum(box[g]);
                if (A.with_ball) dot[g] = page_sum(dot[g]);
            }
        }
        if (A.with_ball) c2 = page_sum(c2);
        bool take = false; /* the hinted list's pages (A.list), on each page's lane 0 */
        if (A.list.pages && sl == 0 && ranked)
            take = ekv_list_forces_page(p, sg.P, A.sink, A.recent);
        do { /* left by break, so that every lane reaches append_pages */
            if (sl != 0 || p >= pend) break;
            if (!ranked || skip) { /* no bound (-inf), or the superpage's stands for the page */
                store_given_bounds(A, b, kvh, row, p, ranked ? spu : nullptr);
                break;
            }
            /* page p's bound for each head, min(box, ball) + the rounding slack (docs/math.md §9.5)
             * + ALiBi, rounded up to stay a bound; with the box alone (paper-faithful top-k) a
             * ranking key without slack, as on the CPU. The list's key is the max over the group.
             * (Kept inline: as a helper taking the arguments by reference it ran 7% slower.) */
            const double u24 = 5.9604644775390625e-8;
            const int64_t last = (p + 1) * ps - 1 < sg.N - 1 ? (p + 1) * ps - 1 : sg.N - 1;
            const double cn = sqrt((double)c2) * (1 + 1e-5);
            const double rr = A.with_ball ? (double)A.rad[phys * A.Hk + kvh] : 0.0;
            float best = -CUDART_INF_F;
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g >= G) break;
            const double am = A.slopes ? A.a * (double)A.slopes[kvh * G + g] : 0.0;
            double ub = box[g];
            if (A.with_ball) {
                const double ball = (double)dot[g] + qn[g] * rr;
                ub = ub < ball ? ub : ball;
                ub += 4.0 * (double)(D + 4) * u24 * qn[g] * (cn + rr) + 1e-30;
                ub += 8.0 * u24 * fabs(am) * ((double)llabs(p * ps - (sg.N - 1)) + (double)ps);
            }
            ub += am * (double)(last - (sg.N - 1));
            if (A.with_ball) ub = ekv_page_bound_or_inf(ub);
            float uf = (float)ub;
            if (A.with_ball && (double)uf < ub) uf = nextafterf(uf, CUDART_INF_F);
            A.bounds[((int64_t)b * A.H + kvh * G + g) * A.cap_pages + p] = uf;
            best = fmaxf(best, uf);
            take = take || (A.list.pages && (double)uf > A.tau_lb[(int64_t)b * A.H + kvh * G + g]);
        }
        A.list_bounds[(int64_t)row * A.cap_pages + p] = best;
        } while (0);
        if (A.list.pages) append_pages(A, row, take, p);
    }
    if (A.tau_lb) flush_superpage_counts(A, n_skip, n_box);
}

} // namespace

ekv_status ekv_cuda_launch_bound(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                 const ekv_paged_kv *kv, const ekv_page_stats *st,
                                 const ekv_page_table *t, const float *q, int with_ball,
                                 const double *tau_lb, const ekv_select_params *hinted, int batch) {
    bound_args A;
    ekv_cuda_set_shape(A, pl, t);
    A.st = *st;
    A.rng = ekv_cuda_ranges_of(st);
    /* the compact ball with compact ranges and its centres kept (docs/math.md §9.5) */
    const int cball = ekv_compact_ball(st);
    A.ctr = ekv_cuda_ranges{st->kmean, st->kmean, st->kmean16, st->kmean16,
                            cball ? (int)st->range_dtype : (int)EKV_DTYPE_F32, cball ? 2 : 4};
    A.rad = cball ? st->radius16 : st->radius;
    ekv_cuda_set_query(A, prm, kv->head_dim, q);
    A.with_ball = with_ball;
    /* superpage skipping needs the ball bound and the boxes, as on the CPU */
    A.tau_lb = with_ball && st->smin && st->superpage_pages > 0 ? tau_lb : NULL;
    A.sp_count = pl->sp_count;
    pl->last_sp_counted = A.tau_lb != NULL;
    if (A.tau_lb)
        EKV_CUDA_TRY(pl, cudaMemsetAsync(pl->sp_count, 0, 2 * sizeof(unsigned long long), pl->stream));
    A.bounds = pl->bounds;
    A.list_bounds = pl->list_bounds;
    A.list = ekv_cuda_lists_of(pl, 0);
    if (!hinted || !A.tau_lb) A.list.pages = NULL; /* no hinted list: the select writes one */
    A.sink = hinted ? hinted->sink_pages : 0;
    A.recent = hinted ? hinted->recent_pages : 0;
    A.shard_pos = pl->shard_pos;
    A.rows = batch * A.Hk;
    A.chunk_pages = bound_chunk_pages(pl->cap_pages, A.rows, pl->sms);
    const int64_t nblocks = (pl->cap_pages + A.chunk_pages - 1) / A.chunk_pages * A.rows;
    if (nblocks > INT32_MAX)
        return ekv_fail(pl->ctx, EKV_ERR_INVALID_SIZE, "bound: %lld blocks exceed the grid limit",
                        (long long)nblocks);
    const dim3 grid((unsigned)nblocks);
    const size_t sm = (size_t)A.G * A.D * sizeof(float);
    ekv_cuda_with_group(A.G, [&](auto tg) {
        ekv_cuda_with_ranges(A.rng, [&](auto rt) {
            ekv_launch(ekv_plan_stream(pl), bound_kernel<decltype(tg)::value, decltype(rt)::value>,
                       grid, EKV_CUDA_THREADS, sm, A);
        });
    });
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

/* The page bounds of the plan's last step with a bound stage ([batch * num_heads][cap_pages],
 * z-space; the last page of a sequence and beyond: -inf), copied to the host. Internal, for the
 * GPU tests (superpage skipping against the CPU's bounds); synchronises the plan's stream. */
extern "C" EKV_API ekv_status ekv_cuda_page_bounds(ekv_cuda_plan *pl, int32_t batch, float *out) {
    return ekv_cuda_read_head_rows(pl, batch, out, pl ? pl->bounds : NULL,
                                   pl ? pl->cap_pages * (int64_t)sizeof(float) : 0);
}
