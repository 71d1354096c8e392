/*
 * attend, step 2 on the GPU: the candidates and tau kernels (see attend_common.cuh).
 */
#include "attend_common.cuh"
#include "../common/launch.cuh"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include "../common/splits.cuh"
#include "tau.cuh"
#include "../common/tau_solve.cuh"
#include "../common/test_hooks.h" /* ekv_cuda_tau_cluster_rows, defined here */
#include "values.cuh"
#include "../common/weights.cuh"
#include <cooperative_groups.h>
#include <stdlib.h>
#include <math_constants.h>

namespace cg = cooperative_groups;

namespace {

/* ---- candidates: tokens with z >= M - 1 (every support token has z > M - 1) ----
 * A flat head has more of them than its list holds (real attention: most keys of a layer-0
 * head within 1 of its max). Its list is then rebuilt by every split, not by one block: the
 * candidates kernel also counts them into the row's histogram of y = z - M (cand_hist), and the
 * refine pass (the same kernel, CAND_REFINE), a launch later when every split has counted, turns
 * the counts into a lower bound of tau (hist_bound, docs/math.md §9.1, within two bins of it) and
 * lists the scores above it: the support and a few bins more. Screened decode's row scores
 * kernel lists its candidates itself; there the histogram is counted by a pass of its own
 * (CAND_COUNT) for the rows that want the bound. A list that fit starts its solve at the bound
 * too (reads_bound: every listed row, alpha 1.5 and 2), and a long one is refined as an
 * overflowed list is (TAU_REFINE_MIN). The refine pass's first split of every row hands the row's M
 * and that bound to the tau kernel (cand_start): its one block spent ~5 us on them (head_max, and
 * the bins read and scanned), the refine pass's splits run beside the refined rows' own. The tau
 * kernel leaves the histogram and the refine count zero for the next step. No block waits for the
 * row's others (a last-block hand-over cost the B = 1 dense step 12 us, bench/RESULTS.md). */
struct cand_args : ekv_cuda_shape {
    int nsplit, split_cap; /* the score splits (ekv_seq_splits) whose maxima give M */
    int cbase;             /* this kernel's splits per row of a uniform batch (its grid) */
    int round;             /* round 1: round 1's entries; 3: everything listed */
    int64_t ccap;
    double alpha;
    const int32_t *list_count;
    const int32_t *row_count; /* screened: the score slots are the row list's (NULL: pages) */
    const float *scores, *split_max;
    float *cand_z;
    int64_t *cand_slot; /* the token's score slot */
    int32_t *cand_count;
    uint32_t *hist;        /* the plan's cand_hist (zero between passes: the tau kernel or
                            * tau_bound_kernel resets it) */
    int32_t *refine_count; /* zero between steps (the tau kernel) */
    float *start;          /* the refine pass: each row's M and bound (the plan's cand_start) */
    int count_all;         /* CAND_COUNT: every row's histogram (a bound round, tau_bound_kernel),
                            * not only the rows that want the bound */
    double *tau;           /* tau_bound_kernel: each row's lower bound of tau (the plan's tau) */
};

/* 8 values per thread and batch, 4 blocks an SM: at 16 values 72 registers gave 3 (a third
 * fewer warps hiding the loads of a latency-bound pass), and 16 within 64 registers spill */
enum { CAND_THREADS = 256, CAND_UNROLL = 8, CAND_MIN_BLOCKS = 4 };

/* Slot of value k (< CAND_UNROLL) of this lane in a warp batch starting at base: with VEC the
 * lane reads CAND_UNROLL / 4 float4 (values base + 4 (32 j + lane) + c, k = 4 j + c), else
 * CAND_UNROLL floats at stride 32. Either way a warp batch covers 32 CAND_UNROLL consecutive
 * slots. */
template <bool VEC> __device__ __forceinline__ int64_t cand_slot(int64_t base, int k, int lane) {
    return VEC ? base + 4 * ((k >> 2) * 32 + lane) + (k & 3) : base + k * 32 + lane;
}

/* The scores of slots [c0, c1) of row z in warp batches: x[k] of slot cand_slot(base, k, lane),
 * -inf past c1. VEC: the score rows and every split boundary are multiples of 4 slots (page
 * size a multiple of 4), so a float4 lies wholly inside or outside [c0, c1). */
template <bool VEC>
__device__ __forceinline__ void cand_load(const float *z, int64_t base, int64_t c1, int lane,
                                          float (&x)[CAND_UNROLL]) {
    if constexpr (VEC) {
#pragma unroll
        for (int j = 0; j < CAND_UNROLL / 4; j++) {
            const int64_t i = cand_slot<true>(base, 4 * j, lane);
            const float4 v = i < c1 ? *reinterpret_cast<const float4 *>(z + i)
                                    : make_float4(-CUDART_INF_F, -CUDART_INF_F, -CUDART_INF_F,
                                                  -CUDART_INF_F);
            x[4 * j] = v.x, x[4 * j + 1] = v.y, x[4 * j + 2] = v.z, x[4 * j + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < CAND_UNROLL; k++) {
            const int64_t i = cand_slot<false>(base, k, lane);
            x[k] = i < c1 ? z[i] : -CUDART_INF_F;
        }
    }
}

/* The threshold of a row that wants the histogram's bound (wants_bound): list_bound of its lower
 * bound of tau, from the row's complete histogram gh (read, not reset: hist_threshold resets it).
 * The refine pass's list and the tau kernel's first iterate: the same value for alpha 1.5 and 2
 * (exact moments), within a bin of each other for other alphas (block sums over 256 and 512
 * threads), each a lower bound of tau. Block-wide. */
__device__ float row_bound_thr(const uint32_t *gh, float M, double alpha, unsigned *hist,
                               float *pw, double *scratch) {
    return list_bound((double)M + hist_read_bound(gh, hist, alpha, pw, scratch), M);
}

/* What a candidates launch does over one split of a row (cand_kernel). */
enum cand_mode {
    CAND_LIST,  /* append z >= M - 1 to the head's list (cand_count) and count them in the
                 * histogram */
    CAND_COUNT, /* the histogram only: the row scores kernel listed the candidates (screened
                 * rows; rows that want no bound return at once), or every row's for a bound
                 * round (count_all) */
    CAND_REFINE /* a row whose list overflowed or is long (refines): append z > its bound
                 * (refine_count); others return */
};

template <bool VEC, int MODE>
__global__ void __launch_bounds__(CAND_THREADS, CAND_MIN_BLOCKS) cand_kernel(cand_args A) {
    ekv_grid_begin();
    constexpr bool REFINE = MODE == CAND_REFINE;
    __shared__ float fscratch[32];
    __shared__ double scratch[128];
    __shared__ __align__(16) unsigned hist[TAU_HIST_BINS]; /* hist_read_bound: 16-byte loads */
    __shared__ float pw[REFINE ? TAU_HIST_BINS : 1]; /* the bound's power table (refine only) */
    const ekv_split sp = ekv_block_split(A.t, A.cbase, A.cbase * A.t.batch);
    if (sp.b < 0) return;
    const int b = sp.b, h = blockIdx.y, kvh = h / A.G, lrow = b * A.Hk + kvh;
    const int64_t row = (int64_t)b * A.H + h;
    /* the refine pass: a row's first split hands its M and bound to the tau kernel (cand_start),
     * its other splits work only where the row refines */
    bool refine = false, reads = false;
    if constexpr (REFINE) {
        const int64_t nc = A.cand_count[row];
        refine = refines(nc, A.ccap);
        reads = reads_bound(nc, A.ccap, A.alpha, A.row_count != NULL);
        if (!refine && sp.s != 0) return; /* its list is solved as it is */
    } else {
        if (MODE == CAND_COUNT && !A.count_all && !wants_bound(A.cand_count[row], A.ccap)) return;
        for (int k = threadIdx.x; k < TAU_HIST_BINS; k += blockDim.x) hist[k] = 0u;
    }
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    int64_t begin, end;
    entry_range(A.list_count, sg.P, lrow, A.round, &begin, &end);
    const int64_t ntok = A.row_count ? (int64_t)A.row_count[lrow] : end * A.ps;
    /* its barrier ends the zeroing */
    const float M = head_max(A.split_max, row, ekv_seq_splits(A.t, b, A.nsplit, A.split_cap),
                             A.split_cap, A.round == 1 ? 1 : 2, fscratch);
    const float thr =
            reads ? row_bound_thr(A.hist + row * TAU_HIST_BINS, M, A.alpha, hist, pw, scratch)
                  : -CUDART_INF_F;
    if (REFINE && sp.s == 0 && threadIdx.x == 0) A.start[2 * row] = M, A.start[2 * row + 1] = thr;
    if (REFINE && !refine) return; /* block-uniform */
    const double lo_z = (double)M - 1.0;
    bool counted = false;
    int32_t *count = REFINE ? A.refine_count + row : A.cand_count + row;
    const int64_t per = ((ntok + sp.n - 1) / sp.n + 31) / 32 * 32;
    const int64_t c0 = (int64_t)sp.s * per, c1 = c0 + per < ntok ? c0 + per : ntok;
    const float *z = A.scores + row * A.cap_tokens;
    const int lane = threadIdx.x & 31;
    /* warp-uniform trip count: every lane takes part in the ballots */
    for (int64_t base = c0 + (threadIdx.x & ~31) * CAND_UNROLL; base < c1;
         base += (int64_t)blockDim.x * CAND_UNROLL) {
        float x[CAND_UNROLL];
        cand_load<VEC>(z, base, c1, lane, x);
        /* one atomic per warp and batch (a round trip per 32-token group made this kernel
         * latency-bound) */
        unsigned m[CAND_UNROLL];
        int tot = 0;
#pragma unroll
        for (int k = 0; k < CAND_UNROLL; k++) {
            /* the refined scores are candidates too (thr may lie a rounding below M - 1), so a
             * refined count never passes the first */
            const bool in = x[k] > -CUDART_INF_F && (double)x[k] >= lo_z && (!REFINE || x[k] > thr);
            m[k] = __ballot_sync(0xffffffffu, in);
            tot += __popc(m[k]);
            if (!REFINE && in) {
                atomicAdd(hist + tau_hist_bin((double)x[k] - (double)M), 1u);
                counted = true;
            }
        }
        if (!tot || MODE == CAND_COUNT) continue;
        int at = ekv_warp_reserve(count, tot);
#pragma unroll
        for (int k = 0; k < CAND_UNROLL; k++) {
            const int pos = at + ekv_lane_rank(m[k]);
            if (((m[k] >> lane) & 1u) && pos < A.ccap) {
                A.cand_z[row * A.ccap + pos] = x[k];
                A.cand_slot[row * A.ccap + pos] = cand_slot<VEC>(base, k, lane);
            }
            at += __popc(m[k]);
        }
    }
    if constexpr (!REFINE) hist_flush(hist, A.hist + row * TAU_HIST_BINS, counted);
}

/* A bound round (certified's round 1 without superpage boxes, whose tau is read only as a lower
 * bound of tau*: round 2's pages, docs/math.md §9.3): the row's histogram
 * bound (row_bound_thr, at most two bins below the round's own tau, docs/math.md §9.1) from
 * every split's counts (CAND_COUNT with count_all) is its tau, instead of the list, its refine
 * pass and the solve. The histogram is left zero for the next count. One block a row. */
__global__ void __launch_bounds__(CAND_THREADS) tau_bound_kernel(cand_args A) {
    ekv_grid_begin();
    __shared__ float fscratch[32];
    __shared__ double scratch[128];
    __shared__ __align__(16) unsigned hist[TAU_HIST_BINS]; /* hist_read_bound: 16-byte loads */
    __shared__ float pw[TAU_HIST_BINS]; /* the bound's power table (alphas other than 1.5, 2) */
    const int64_t row = blockIdx.x;
    const int b = (int)(row / A.H);
    const float M = head_max(A.split_max, row, ekv_seq_splits(A.t, b, A.nsplit, A.split_cap),
                             A.split_cap, A.round == 1 ? 1 : 2, fscratch);
    uint32_t *gh = A.hist + row * TAU_HIST_BINS;
    const float thr = row_bound_thr(gh, M, A.alpha, hist, pw, scratch);
    hist_zero_row(gh); /* every thread's reads of gh came before hist_read_bound's barrier */
    if (threadIdx.x == 0) A.tau[row] = (double)thr;
}

struct tau_args : ekv_cuda_shape {
    ekv_paged_kv kv;
    int64_t ccap;
    int64_t smem_cand; /* the candidates kept in shared memory at most (tau_smem_floats) */
    int64_t spread_at; /* a row listing more goes to its cluster (tau_spread_at)           */
    int nsplit, split_cap, round; /* the score splits (ekv_seq_splits) whose maxima give M */
    const int32_t *list_pages, *list_count;
    double alpha;
    const float *scores, *split_max;
    float *cand_z; /* an overflowed head's list is rewritten (compact_list) */
    int64_t *cand_slot;
    int32_t *cand_count; /* a long list's refined count is written back (the sharded kernels) */
    uint32_t *hist;      /* the candidates' histograms (cand_hist): reset here */
    int32_t *refine_count; /* a refined row's list's count (refines): read and reset here */
    const float *start;    /* each row's M and bound from the refine pass (cand_start) */
    double *tau;
    float *tau_m; /* tau as (the head's max, tau - max): what the values kernels read */
    double *tau_t;
    int64_t *support;
    int64_t *v_rows;
    int32_t *flags;
    unsigned long long *slow_paths; /* the plan's (ekv_cuda_count_slow_paths) or NULL */
    float *sup_p; /* support list of the final round: p, V row offset */
    int64_t *sup_off;
    int64_t *sup_count;
    float *out_zero; /* the final round: zero the output row (the values kernel adds into it) */
    const int32_t *rows, *row_count; /* screened: score slots are these rows (NULL: pages) */
    uint32_t *ubits; /* the final round with the group-union values kernel: the support's slots */
    int64_t cap_words; /* (marked per KV head, instead of the support lists and v_rows) */
    int32_t *ulist, *ucount; /* and listed once per KV head (union_mark) */
    int cluster;             /* blocks a row (tau_cluster_blocks): > 1 in clusters (tau_spread) */
};

/* TAU_SMEM_MAX: the candidates the solve keeps in shared memory at most (dynamic: the plan's
 * list, up to 128 KB; a solve over a list in global memory took 69 us on the model's layer 0,
 * bench/RESULTS.md "Real attention, round 2"; with up to the device's 227 KB screened's layer-0
 * step was 50 us slower and dense's no faster, "2026-12-06 (eighth session)") */
enum { TAU_THREADS = 512, TAU_SMEM_MAX = 32768, TAU_UNROLL = 8 };

/* One pass over the score row z[0, n): the scores above thr (a lower bound of tau: they hold
 * the support and the max, so tau over them is exact, as over the z >= M - 1 candidates;
 * docs/architecture.md, "Backends") replace the head's list. Returns their count; above ccap
 * the list holds the first ccap of them. Block-wide; the caller has read the old list. */
__device__ int64_t compact_above(const tau_args &A, int64_t row, const float *z, int64_t n,
                                 float thr, unsigned long long *s_n) {
    float *cz = A.cand_z + row * A.ccap;
    int64_t *cs = A.cand_slot + row * A.ccap;
    if (threadIdx.x == 0) *s_n = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int64_t step = (int64_t)blockDim.x * TAU_UNROLL;
    /* warp-uniform trip count (the ballots); TAU_UNROLL coalesced loads in flight per lane */
    for (int64_t base = (int64_t)(threadIdx.x & ~31) * TAU_UNROLL; base < n; base += step) {
        float x[TAU_UNROLL];
#pragma unroll
        for (int k = 0; k < TAU_UNROLL; k++) {
            const int64_t i = base + 32 * k + lane;
            x[k] = i < n ? z[i] : -CUDART_INF_F;
        }
#pragma unroll
        for (int k = 0; k < TAU_UNROLL; k++) {
            const bool in = x[k] > thr;
            const unsigned m = __ballot_sync(0xffffffffu, in);
            if (!m) continue;
            unsigned long long at = 0;
            if (lane == __ffs(m) - 1) at = atomicAdd(s_n, (unsigned long long)__popc(m));
            at = __shfl_sync(0xffffffffu, at, __ffs(m) - 1) + __popc(m & ((1u << lane) - 1));
            if (in && at < (unsigned long long)A.ccap) {
                cz[at] = x[k];
                cs[at] = base + 32 * k + lane;
            }
        }
    }
    __syncthreads();
    const int64_t count = (int64_t)*s_n;
    __syncthreads(); /* read by all before a later pass resets it */
    return count;
}

/* A head whose list overflowed even above the histogram's bound hist_thr (the refine pass's nc
 * scores above it; flat attention, e.g. real attention at 1M tokens): its list rebuilt from the
 * scores above the kept ccap's own threshold (a subset of the row: a lower bound of tau,
 * docs/math.md §9.1) where that is higher. Returns the count, above ccap when the list cannot
 * fit (a support larger than the list, or a run of equal scores); *t0 the best lower bound of
 * tau - M, where the whole-row solve then starts. One read of the row, none when the kept
 * threshold is no higher (a count of the row's histogram again would give hist_thr). */
__device__ int64_t compact_list(const tau_args &A, int64_t row, const float *z, int64_t n, float M,
                                float hist_thr, int64_t nc, double *t0, double *scratch,
                                float *fscratch, unsigned long long *s_n) {
    const double kept =
            subset_threshold(A.cand_z + row * A.ccap, A.ccap, A.alpha, scratch, fscratch);
    __syncthreads(); /* every thread has read the kept list before it is overwritten */
    const float thr = list_bound(kept, M);
    if (!(thr > hist_thr)) return nc; /* block-uniform */
    *t0 = fmax(*t0, (double)thr - (double)M);
    return compact_above(A, row, z, n, thr, s_n);
}

/* Visits (i, z[i]) for i < n, TAU_UNROLL loads in flight a thread: one block per head is
 * latency-bound otherwise (a load at a time behind a store to shared memory, which the compiler
 * cannot move a load past, made the copy of a flat head's list of ~10K candidates wait on L2
 * tens of times a thread). */
template <typename F> __device__ __forceinline__ void scan_row(const float *z, int64_t n, F f) {
    const int64_t step = (int64_t)blockDim.x * TAU_UNROLL;
    for (int64_t base = threadIdx.x; base < n; base += step) {
        float x[TAU_UNROLL];
#pragma unroll
        for (int k = 0; k < TAU_UNROLL; k++) {
            const int64_t i = base + (int64_t)k * blockDim.x;
            x[k] = i < n ? z[i] : 0.f;
        }
#pragma unroll
        for (int k = 0; k < TAU_UNROLL; k++) {
            const int64_t i = base + (int64_t)k * blockDim.x;
            if (i < n) f(i, x[k]);
        }
    }
}

/* The support pass's elements per lane and pass: their loads, and with the union their
 * atomicOr round trips (union_mark), in flight together. A pass is three round trips (the
 * slots, the marks, the list's reservation): at 4 a flat head's final support of ~10K tokens
 * took five passes, 9 us of its one block (bench/RESULTS.md, "the tau kernel's fixed cost"). */
enum { SUP_UNROLL = 8 };

/* The row's support, v[i - i0] - M > t over i0 <= i < nv (v: element i0 of its candidates, or
 * with whole_row of the score row itself): this thread's share of its count, and on the final round
 * (final_round) its listing for the values kernel: the group's union (mark), or the (p, V row
 * offset) pairs counted in *s_nsup (zero; shared memory of this block or, in a cluster, of its
 * first). Block-wide. */
__device__ double support_pass(const tau_args &A, int64_t row, const float *v, int64_t i0,
                               int64_t nv, bool whole_row, float M, double t, bool final_round,
                               bool mark, int64_t first, int *s_nsup) {
    const int b = (int)(row / A.H), kvh = (int)(row % A.H) / A.G, lrow = b * A.Hk + kvh;
    const double beta = 1.0 / (A.alpha - 1.0);
    const int lane = threadIdx.x & 31;
    double c = 0;
    for (int64_t base = i0 + (int64_t)(threadIdx.x & ~31) * SUP_UNROLL; base < nv;
         base += (int64_t)blockDim.x * SUP_UNROLL) {
        float x[SUP_UNROLL];
        bool in[SUP_UNROLL];
        int64_t slot[SUP_UNROLL];
#pragma unroll
        for (int k = 0; k < SUP_UNROLL; k++) {
            const int64_t i = base + 32 * k + lane;
            x[k] = i < nv ? v[i - i0] : 0.f;
            in[k] = i < nv && (double)x[k] - (double)M > t;
            c += in[k];
        }
        if (!final_round) continue;
#pragma unroll
        for (int k = 0; k < SUP_UNROLL; k++) {
            const int64_t i = base + 32 * k + lane;
            slot[k] = !in[k] ? 0 : whole_row ? i : A.cand_slot[row * A.ccap + i];
        }
        if (mark) {
            union_mark<SUP_UNROLL>(A.ubits + lrow * A.cap_words, A.ulist + lrow * A.cap_tokens,
                                   A.ucount + lrow, slot, in);
            continue;
        }
        unsigned m[SUP_UNROLL];
        int tot = 0;
#pragma unroll
        for (int k = 0; k < SUP_UNROLL; k++) {
            m[k] = __ballot_sync(0xffffffffu, in[k]);
            tot += __popc(m[k]);
        }
        if (!tot) continue;
        int at = ekv_warp_reserve(s_nsup, tot);
#pragma unroll
        for (int k = 0; k < SUP_UNROLL; k++) {
            const int pos = at + ekv_lane_rank(m[k]);
            at += __popc(m[k]);
            if (!in[k] || pos >= A.ccap) continue;
            A.sup_p[row * A.ccap + pos] = entmax_p_split(x[k], M, t, beta);
            A.sup_off[row * A.ccap + pos] =
                    A.rows ? row_offset(A.t, A.kv, A.rows, A.cap_tokens, lrow, first, kvh, A.ps,
                                        slot[k])
                           : slot_offset(A.t, A.kv, A.list_pages, A.cap_pages, lrow, first, kvh,
                                         A.ps, slot[k]);
        }
    }
    return c;
}

/* The lower bound of tau where the tau kernel starts row (nc: its first count): the refine
 * pass's histogram bound for a row that reads one (reads_bound; row_bound_thr: for a row that
 * wants it the refine pass listed the scores above it), else -inf. The row's histogram is reset
 * for the next step either way: every bin of a row that read the bound, in 16-byte stores (no
 * read: the refine pass read it), else the bins of its listed candidates, all it counted (a row
 * that reads no bound wants none: its candidates fit the list). Block-wide. */
__device__ float start_bound(const tau_args &A, int64_t row, int64_t nc, float M) {
    uint32_t *gh = A.hist + row * TAU_HIST_BINS;
    if (!reads_bound(nc, A.ccap, A.alpha, A.rows != NULL)) {
        const float *cz = A.cand_z + row * A.ccap;
        for (int64_t i = threadIdx.x; i < nc; i += blockDim.x) {
            const double y = (double)cz[i] - (double)M;
            if (y >= -1.0) gh[tau_hist_bin(y)] = 0u;
        }
        return -CUDART_INF_F;
    }
    hist_zero_row(gh);
    return A.start[2 * row + 1];
}

/* The final round's output row of `row` zeroed (the values kernels add into it). Block-wide. */
__device__ __forceinline__ void zero_out_row(const tau_args &A, int64_t row) {
    if (A.out_zero)
        for (int d = threadIdx.x; d < A.D; d += blockDim.x) A.out_zero[row * A.D + d] = 0.f;
}

/* An overflowed row's path: its EKV_TAU_FLAG_* bits (the report's) and, on the final round, its
 * EKV_SLOW_TAU_* count. One thread. */
__device__ __forceinline__ void flag_row(const tau_args &A, int64_t row, int32_t flags, int slow) {
    atomicOr(&A.flags[row], flags);
    if (A.out_zero && A.slow_paths) atomicAdd(A.slow_paths + slow, 1ull);
}

/* The row's path in its flags: a row whose candidates overflowed the list (overflowed) solved
 * over its compacted list or its whole score row (whole_row), and `extra` (EKV_TAU_FLAG_CLUSTER
 * for a cluster's row, which need not have overflowed: a long list in global memory). One
 * thread. */
__device__ __forceinline__ void flag_path(const tau_args &A, int64_t row, bool overflowed,
                                          bool whole_row, int32_t extra) {
    if (overflowed)
        flag_row(A, row, extra | (whole_row ? EKV_TAU_FLAG_WHOLE_ROW : EKV_TAU_FLAG_COMPACTED),
                 whole_row ? EKV_SLOW_TAU_WHOLE_ROW : EKV_SLOW_TAU_COMPACTED);
    else if (extra)
        atomicOr(&A.flags[row], extra);
}

/* What the tau kernel leaves for row (list row lrow) with tau = M + t and c support tokens: tau,
 * (M, t) for the values kernels, the support, the refine count reset for the next step, and on
 * the final round the support's count (and, without the group's union, its V rows). relisted
 * >= 0: the count of a long list that fit and was rewritten above the histogram's bound, so that
 * the sharded kernels (sharded_tau.cu) read the list as left (an overflowed one keeps its count
 * above the cap: they read its score row). One thread, after every thread of the row (every
 * block of its cluster) has read the refine count and the candidates' count. */
__device__ void put_row(const tau_args &A, int64_t row, int lrow, float M, double t, int64_t c,
                        int64_t relisted) {
    if (relisted >= 0) A.cand_count[row] = (int32_t)relisted;
    A.tau[row] = (double)M + t;
    A.tau_m[row] = M;
    A.tau_t[row] = t;
    A.support[row] = c;
    A.refine_count[row] = 0;
    if (A.out_zero) {
        A.sup_count[row] = c;
        if (!A.ubits) /* the union kernel counts the rows it reads */
            atomicAdd(reinterpret_cast<unsigned long long *>(&A.v_rows[lrow]),
                      (unsigned long long)c);
    }
}

/* ---- A flat head's tau over a cluster of blocks (ekv_cuda_plan_params.tau_cluster;
 * docs/architecture.md, "Backends", CUDA tau over a cluster). One block per head solves a list
 * too long for its shared memory (or compacts an overflowed one) alone: 51-74 us of the model's
 * 256K layer-0 step under ncu, one SM of 132 busy (bench/RESULTS.md, "2026-12-06 (eighth
 * session)" and "(ninth session)"); one that fits it, past tau_spread_at, still 21.7 us
 * ("2026-12-07 (eleventh session)"). ---- */

/* The cluster's barrier, and p (in this block's shared memory) in its first block's. Clusters
 * exist from compute capability 9.0; an older build never launches them (the plan refuses
 * tau_cluster there), so these are the block's own there. */
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::this_cluster().sync();
#endif
}
__device__ __forceinline__ int *in_first_block(int *p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    return cg::this_cluster().map_shared_rank(p, 0);
#else
    return p;
#endif
}

/* v[0..2] summed and v[3] minimised over the blocks of the cluster, so every block gets the same
 * values: lane k of every warp reads block k's four (the reads in flight together, not one block
 * after another), then the warp's butterfly, which leaves the same bits in every lane of every
 * warp and block (each step adds the same two values in either order). part: two [4] buffers of
 * this block's shared memory, taken by turns (*turn): a buffer is written again only after the
 * barrier that follows every block's read of it. One cluster barrier; cluster-wide; at most 32
 * blocks (tau_cluster is 2, 4 or 8: ekv_check_cuda_options). */
__device__ void cluster_combine(double (&v)[4], double (*part)[4], int *turn) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::cluster_group cl = cg::this_cluster();
    double *mine = part[*turn];
    if (threadIdx.x == 0)
        for (int j = 0; j < 4; j++) mine[j] = v[j];
    cl.sync();
    const unsigned lane = threadIdx.x & 31;
    double r[4] = {0.0, 0.0, 0.0, 1e300};
    if (lane < cl.num_blocks()) {
        const double *o = cl.map_shared_rank(mine, lane);
        for (int j = 0; j < 4; j++) r[j] = o[j];
    }
    v[0] = ekv_warp_sum(r[0]);
    v[1] = ekv_warp_sum(r[1]);
    v[2] = ekv_warp_sum(r[2]);
    v[3] = ekv_warp_min(r[3]);
    *turn ^= 1;
#endif
}

/* tau - M of a row over the cluster: solve_tau's steps from t0, each step's sums over this
 * block's share x[0, n) of the row's values combined over the cluster (the same sums in another
 * order, less F's 1 taken off and put back a block, so the same exact tau to the last bits of a
 * double, docs/math.md §0). Cluster-wide. */
__device__ double spread_solve(const tau_args &A, const float *x, int64_t n, float M, double t0,
                               double *scratch, double (*part)[4], int *turn) {
    const double beta = 1.0 / (A.alpha - 1.0);
    tau_iter it = tau_start(t0);
    const int cap = tau_max_iters(A.alpha);
    for (int k = 0; k < cap; k++) {
        double v[4] = {0.0, 0.0, 0.0, 1e300};
        if (tau_by_moments(A.alpha)) {
            const tau_sums s = cand_sums(x, n, M, it.t, scratch);
            v[0] = s.n, v[1] = s.s1, v[2] = s.s2, v[3] = s.mn;
        } else {
            double F, Fp;
            cand_newton(x, n, M, it.t, beta, scratch, &F, &Fp);
            v[0] = F + 1.0, v[1] = Fp; /* this block's sum of [y - t]_+^beta, and its F' */
        }
        cluster_combine(v, part, turn);
        const tau_sums s = {v[0], v[1], v[2], v[3]};
        if (tau_step(A.alpha, s, v[0] - 1.0, v[1], &it)) break;
    }
    return it.t;
}

/* A row with a long list (listed: its refined list's count, or its candidates' when not
 * refined, above A.spread_at, tau_spread_at), on a cluster of A.cluster blocks (rank: this
 * block's), instead of one block's solve (over global memory where the list passes the shared
 * list: 69 us on a flat head of the model's layer 0) or, for a list that overflowed (listed >
 * ccap), its compaction and whole-row solve. The row's values (its list, or its score row when the
 * list overflowed) are shared out: block r takes [n r / K, n (r + 1) / K), in its shared memory
 * cand when the share fits (the solve reads it every iteration); the solve runs over the cluster
 * from the histogram's bound where the row reads it (a refined row does: refines implies
 * reads_bound), else from -1, and each block counts and lists (or marks) its share's support; the
 * first block does what the one block does for any row (the output row zeroed, the histogram and
 * refine count reset, the flags, the results; nc: the row's first count). Cluster-wide. */
__device__ void tau_spread(const tau_args &A, int64_t row, int rank, int64_t nc, int64_t listed,
                           int64_t ntok, float M, int64_t first, float *cand, double *scratch,
                           double (*part)[4], int *s_nsup) {
    const bool final_round = A.out_zero != NULL, mark = final_round && A.ubits;
    const bool overflowed = nc > A.ccap, whole_row = listed > A.ccap;
    const int lrow = (int)(row / A.H) * A.Hk + (int)(row % A.H) / A.G;
    const bool bound = reads_bound(nc, A.ccap, A.alpha, A.rows != NULL);
    const double t0 = bound ? fmax(-1.0, (double)A.start[2 * row + 1] - (double)M) : -1.0;
    if (rank == 0) {
        zero_out_row(A, row);
        start_bound(A, row, nc, M); /* for its histogram's reset */
        if (threadIdx.x == 0) {
            *s_nsup = 0; /* before the solve's first barrier: the support pass comes after it */
            flag_path(A, row, overflowed, whole_row, EKV_TAU_FLAG_CLUSTER);
        }
    }
    const float *v = whole_row ? A.scores + row * A.cap_tokens : A.cand_z + row * A.ccap;
    const int64_t n = whole_row ? ntok : listed;
    const int64_t i0 = n * rank / A.cluster, i1 = n * (rank + 1) / A.cluster;
    const float *x = v + i0;
    if (i1 - i0 <= A.smem_cand) {
        scan_row(x, i1 - i0, [&](int64_t i, float z) { cand[i] = z; });
        __syncthreads();
        x = cand;
    }
    int turn = 0;
    const double t = spread_solve(A, x, i1 - i0, M, t0, scratch, part, &turn);
    int *nsup = in_first_block(s_nsup);
    double c[4] = {support_pass(A, row, x, i0, i1, whole_row, M, t, final_round, mark, first, nsup),
                   0.0, 0.0, 1e300};
    c[0] = ekv_block_sum(c[0], scratch);
    cluster_combine(c, part, &turn);
    /* every block read the refine count and the candidates' count before the solve's barriers */
    if (rank == 0 && threadIdx.x == 0)
        put_row(A, row, lrow, M, t, (int64_t)c[0],
                refines(nc, A.ccap) && !overflowed ? listed : -1);
    cluster_barrier(); /* no block leaves while another reads its shared memory */
}

/* Entmax: tau over the head's candidates (in shared memory when they fit), then the support
 * list. A head whose candidates overflowed the list has it rebuilt from the scores above a
 * lower bound of tau (compact_list); only when those overflow too does it take the whole
 * score row, the solve starting from that bound. */
__global__ void __launch_bounds__(TAU_THREADS) tau_entmax_kernel(tau_args A) {
    ekv_grid_begin();
    extern __shared__ float cand[]; /* A.smem_cand floats (tau_smem_floats) */
    __shared__ double scratch[128];
    __shared__ float fscratch[32];
    __shared__ int s_nsup;
    __shared__ unsigned long long s_ncomp;
    __shared__ double cpart[2][4];              /* tau_spread's sums */
    const int64_t row = blockIdx.x / A.cluster; /* a cluster of A.cluster blocks a row */
    const int rank = (int)(blockIdx.x % A.cluster);
    const int b = (int)(row / A.H), h = (int)(row % A.H), kvh = h / A.G, lrow = b * A.Hk + kvh;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    int64_t begin, end;
    entry_range(A.list_count, sg.P, lrow, A.round == 1 ? 1 : 3, &begin, &end);
    const int64_t ntok = A.rows ? (int64_t)A.row_count[lrow] : end * A.ps;
    const float M = A.start[2 * row]; /* the refine pass's head_max: the candidates' own M */
    int64_t nc = A.cand_count[row];
    const int64_t listed = refines(nc, A.ccap) ? (int64_t)A.refine_count[row] : nc;
    if (A.cluster > 1 && listed > A.spread_at) { /* block-uniform */
        tau_spread(A, row, rank, nc, listed, ntok, M, sg.first, cand, scratch, cpart, &s_nsup);
        return;
    }
    if (rank) return; /* block-uniform: the row is the first block's alone */
    const bool final_round = A.out_zero != NULL, mark = final_round && A.ubits;
    zero_out_row(A, row);
    /* a lower bound of tau - M where the solve starts (tau_start): for a row that reads it
     * (reads_bound) the histogram's (a refined row's list threshold too), else -1 */
    const float hist_thr = start_bound(A, row, nc, M);
    /* the solve's first iterate: a lower bound of tau - M (tau_start) */
    double t0 = fmax(-1.0, (double)hist_thr - (double)M);
    const bool overflowed = nc > A.ccap; /* flat attention: more candidates than the list holds */
    const bool refined = refines(nc, A.ccap);
    if (refined) nc = listed; /* every split listed the scores above hist_thr */
    if (nc > A.ccap) /* on one block: the kept list's own bound */
        nc = compact_list(A, row, A.scores + row * A.cap_tokens, ntok, M, hist_thr, nc, &t0,
                          scratch, fscratch, &s_ncomp);
    if (threadIdx.x == 0) flag_path(A, row, overflowed, nc > A.ccap, 0);
    const bool whole_row = nc > A.ccap; /* the compacted list overflowed too */
    const float *v;
    int64_t nv;
    if (!whole_row) {
        const float *cz = A.cand_z + row * A.ccap;
        if (nc <= A.smem_cand) {
            scan_row(cz, nc, [&](int64_t i, float x) { cand[i] = x; });
            __syncthreads();
            v = cand;
        } else
            v = cz;
        nv = nc;
    } else {
        v = A.scores + row * A.cap_tokens;
        nv = ntok;
    }
    const double t = solve_tau(v, nv, M, A.alpha, scratch, t0);
    /* support: count, and on the final round the list (p, V row offset) for the values kernel */
    if (threadIdx.x == 0) s_nsup = 0;
    __syncthreads();
    double c =
            support_pass(A, row, v, 0, nv, whole_row, M, t, final_round, mark, sg.first, &s_nsup);
    c = ekv_block_sum(c, scratch);
    if (threadIdx.x == 0) /* every thread read the refine count before */
        put_row(A, row, lrow, M, t, (int64_t)c, refined && !overflowed ? nc : -1);
}

/* Softmax: tau = log-sum-exp over the whole row; every token is in the support. */
__global__ void __launch_bounds__(1024) tau_softmax_kernel(tau_args A) {
    ekv_grid_begin();
    __shared__ double scratch[32];
    __shared__ float fscratch[32];
    const int64_t row = blockIdx.x;
    const int b = (int)(row / A.H), h = (int)(row % A.H), lrow = b * A.Hk + h / A.G;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    int64_t begin, end;
    entry_range(A.list_count, sg.P, lrow, A.round == 1 ? 1 : 3, &begin, &end);
    const int64_t ntok = end * A.ps;
    const float *z = A.scores + row * A.cap_tokens;
    const float M = head_max(A.split_max, row, ekv_seq_splits(A.t, b, A.nsplit, A.split_cap),
                             A.split_cap, A.round == 1 ? 1 : 2, fscratch);
    if (A.out_zero)
        for (int d = threadIdx.x; d < A.D; d += blockDim.x) A.out_zero[row * A.D + d] = 0.f;
    double s = 0;
    int64_t cnt = 0;
    scan_row(z, ntok, [&](int64_t, float x) {
        if (x > -CUDART_INF_F) {
            s += exp((double)x - (double)M);
            cnt++;
        }
    });
    s = ekv_block_sum(s, scratch);
    const double c = ekv_block_sum((double)cnt, scratch);
    if (threadIdx.x == 0) {
        A.tau[row] = (double)M + log(s);
        A.tau_m[row] = M;
        A.tau_t[row] = log(s);
        A.support[row] = (int64_t)c;
    }
}
} // namespace

/* One candidates pass (cand_mode MODE) over the splits of its rows (C.cbase per row of a uniform
 * batch). */
template <bool VEC, int MODE>
static ekv_status launch_cand_pass(ekv_cuda_plan *pl, const cand_args &C, int batch) {
    const dim3 grid(ekv_cuda_split_grid(C.cbase, batch), C.H);
    ekv_launch(ekv_plan_stream(pl), cand_kernel<VEC, MODE>, grid, CAND_THREADS, 0, C);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

/* The first candidates pass (FIRST: CAND_LIST or CAND_COUNT), then the refine pass, over the same
 * splits. */
template <bool VEC, int FIRST>
static ekv_status launch_cand_pair(ekv_cuda_plan *pl, const cand_args &C, int batch) {
    const ekv_status s = launch_cand_pass<VEC, FIRST>(pl, C, batch);
    return s ? s : launch_cand_pass<VEC, CAND_REFINE>(pl, C, batch);
}

/* The candidates kernels' arguments over a launch's rows: their entries (list_count, or the
 * sequences' pages), screened's token rows (row_count) or NULL, round 1 or the final. */
static cand_args cand_setup(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                            const ekv_page_table *t, int nsplit, const int32_t *list_count,
                            const int32_t *row_count, int round) {
    cand_args C;
    ekv_cuda_set_shape(C, pl, t);
    C.nsplit = nsplit;
    C.split_cap = pl->split_cap;
    C.round = round == 1 ? 1 : 3;
    C.ccap = pl->cand_cap;
    C.alpha = prm->alpha;
    C.list_count = list_count;
    C.row_count = row_count;
    C.scores = pl->scores;
    C.split_max = pl->split_max;
    C.cand_z = pl->cand_z;
    C.cand_slot = pl->cand_slot;
    C.cand_count = pl->cand_count;
    C.hist = pl->cand_hist;
    C.refine_count = pl->refine_count;
    C.start = pl->cand_start;
    C.count_all = 0;
    C.tau = pl->tau;
    return C;
}

/* float4 loads need every split boundary at a multiple of 4 slots: pages of 4k, not rows */
static bool cand_vec(const ekv_cuda_plan *pl, int rows) {
    return !rows && pl->p.page_size % 4 == 0;
}

/* The candidates passes' splits a row (cand_args.cbase): with float4 loads one wave of the
 * first pass's kernel (MODE) over the launch's rows, else the score splits. */
template <int MODE>
static int cand_base(ekv_cuda_plan *pl, const cand_args &C, int batch, bool vec) {
    static int per_sm = 0; /* asked once for this instance */
    return vec ? ekv_cuda_one_wave(cand_kernel<true, MODE>, CAND_THREADS, 0, batch * C.H, pl->sms,
                                   &per_sm)
               : C.nsplit;
}

/* The candidates of the tau launch's rows, then the refine pass of the rows whose list
 * overflowed, over the same splits; with rows (screened: the row scores kernel listed them) a
 * pass that counts the histogram of the overflowed rows instead of the first. */
static ekv_status launch_candidates(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                    const ekv_page_table *t, const tau_args &A, int batch,
                                    int round, int rows) {
    cand_args C = cand_setup(pl, prm, t, A.nsplit, A.list_count, A.row_count, round);
    const bool vec = cand_vec(pl, rows);
    C.cbase = cand_base<CAND_LIST>(pl, C, batch, vec);
    if (vec) return launch_cand_pair<true, CAND_LIST>(pl, C, batch);
    return rows ? launch_cand_pair<false, CAND_COUNT>(pl, C, batch)
                : launch_cand_pair<false, CAND_LIST>(pl, C, batch);
}

/* A step that stopped after the candidates counted but before the tau kernel reset them: the
 * histograms and refine counts zeroed (errors ignored: the step's own is reported), so that the
 * next step's bounds count its own scores only. */
static void reset_tau_counts(ekv_cuda_plan *pl, int batch) {
    const size_t rows = (size_t)batch * pl->p.num_heads;
    cudaMemsetAsync(pl->cand_hist, 0, rows * EKV_CUDA_TAU_HIST_BINS * sizeof(uint32_t), pl->stream);
    cudaMemsetAsync(pl->refine_count, 0, rows * sizeof(int32_t), pl->stream);
}

ekv_status ekv_cuda_launch_tau_bound(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                     const ekv_page_table *t, int batch) {
    cand_args C =
            cand_setup(pl, prm, t, ekv_cuda_step_splits(pl, batch).scores, pl->list_count, NULL, 1);
    C.count_all = 1;
    const bool vec = cand_vec(pl, 0);
    C.cbase = cand_base<CAND_COUNT>(pl, C, batch, vec);
    ekv_status s = vec ? launch_cand_pass<true, CAND_COUNT>(pl, C, batch)
                       : launch_cand_pass<false, CAND_COUNT>(pl, C, batch);
    if (!s) s = ekv_cuda_launch(pl, tau_bound_kernel, dim3(batch * C.H), CAND_THREADS, 0, C);
    if (s) reset_tau_counts(pl, batch);
    return s;
}

/* The floats of the tau kernel's shared candidates: the whole list when it fits TAU_SMEM_MAX and
 * the device's room beside the kernel's static arrays (99 KB a block on some GPUs, 227 KB on
 * Hopper). */
static int64_t tau_smem_floats(const ekv_cuda_plan *pl) {
    /* the kernel's own shared arrays, asked once (a failed query is asked again, 16 KB assumed
     * meanwhile, its error cleared) */
    static int64_t static_bytes = -1;
    cudaFuncAttributes fa;
    if (static_bytes < 0 && cudaFuncGetAttributes(&fa, tau_entmax_kernel) == cudaSuccess)
        static_bytes = (int64_t)fa.sharedSizeBytes;
    if (static_bytes < 0) cudaGetLastError();
    const int64_t taken = static_bytes < 0 ? (int64_t)16 << 10 : static_bytes;
    const int64_t room = ((int64_t)pl->smem_optin - taken) / (int64_t)sizeof(float);
    int64_t n = pl->cand_cap < TAU_SMEM_MAX ? pl->cand_cap : (int64_t)TAU_SMEM_MAX;
    if (n > room) n = room;
    return n > 0 ? n : 0;
}

/* The listed candidates past which a row goes to its cluster (tau_spread): the plan's
 * tau_spread_min (0: EKV_CUDA_TAU_SPREAD_MIN), and at most what the kernel's shared memory holds
 * (a longer list would be one block's solve over global memory). A list of thousands of
 * candidates (a flat head's) left one block solving and listing it while the launch's other
 * SMs waited: bench/RESULTS.md, "2026-12-07 (eleventh session)". */
static int64_t tau_spread_at(const ekv_cuda_plan *pl, int64_t smem_cand) {
    const int64_t m =
            pl->p.tau_spread_min > 0 ? pl->p.tau_spread_min : (int64_t)EKV_CUDA_TAU_SPREAD_MIN;
    return m < smem_cand ? m : smem_cand;
}

/* Blocks a row of the tau kernel: the plan's tau_cluster, halved until the launch's rows fit one
 * wave of clusters the device can hold at once (cudaOccupancyMaxActiveClusters >= rows: a GPC's
 * SMs bound how many clusters of 4 or 8 fit), else 1: no cluster, one block a row (a batch of
 * many heads fills the GPU with them anyway). Asked once for each launch size (the plan keeps the
 * last: a step's rounds launch the same rows; a size whose query failed, e.g. inside a stream
 * capture, is asked again), and not while an earlier launch's error waits (the launch reports
 * it; the query's own failures are cleared). */
static int tau_cluster_blocks(ekv_cuda_plan *pl, int64_t rows, size_t smem) {
    if (pl->p.tau_cluster < 2) return 1;
    if (pl->tau_k_rows == rows) return pl->tau_k;
    if (cudaPeekAtLastError() != cudaSuccess) return 1;
    int found = 1;
    bool failed = false;
    for (int k = pl->p.tau_cluster; k > 1 && found == 1; k /= 2) {
        if (rows * k > pl->sms) continue;
        cudaLaunchAttribute at = ekv_cluster_attr((unsigned)k);
        const cudaLaunchConfig_t cfg = ekv_launch_config(
                dim3((unsigned)(rows * k)), dim3(TAU_THREADS), smem, pl->stream, &at, 1);
        int n = 0;
        if (cudaOccupancyMaxActiveClusters(&n, tau_entmax_kernel, &cfg) != cudaSuccess) {
            cudaGetLastError(); /* this size cannot be placed, or not asked now: a smaller one */
            failed = true;
        } else if (n >= rows)
            found = k;
    }
    if (found > 1 || !failed) { /* a failed query is asked again at the next launch */
        pl->tau_k_rows = rows;
        pl->tau_k = found;
    }
    return found;
}

ekv_status ekv_cuda_launch_tau(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                               const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                               int use_list, int round, float *out_zero) {
    return ekv_cuda_launch_tau_rows(pl, prm, kv, t, batch, use_list, round, out_zero, 0);
}

ekv_status ekv_cuda_launch_tau_rows(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                    const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                                    int use_list, int round, float *out_zero, int rows) {
    tau_args A;
    ekv_cuda_set_shape(A, pl, t);
    A.kv = *kv;
    A.ccap = pl->cand_cap;
    A.nsplit = ekv_cuda_step_splits(pl, batch).scores;
    A.split_cap = pl->split_cap;
    A.round = round;
    ekv_cuda_set_support(A, pl, use_list, rows, out_zero && ekv_cuda_values_union(pl, prm->alpha));
    A.alpha = prm->alpha;
    A.split_max = pl->split_max;
    A.cand_z = pl->cand_z;
    A.cand_slot = pl->cand_slot;
    A.cand_count = pl->cand_count;
    A.hist = pl->cand_hist;
    A.refine_count = pl->refine_count;
    A.start = pl->cand_start;
    A.tau = pl->tau;
    A.support = pl->support;
    A.v_rows = pl->v_rows;
    A.flags = pl->flags;
    A.slow_paths = pl->slow_paths;
    A.out_zero = out_zero;
    A.cluster = 1;
    if (prm->alpha == 1.0) {
        ekv_launch(ekv_plan_stream(pl), tau_softmax_kernel, batch * A.H, 1024, 0, A);
        EKV_CUDA_LAUNCHED(pl);
        return EKV_OK;
    }
    /* the shared memory allowed before the candidates launch: once they have counted, the tau
     * kernel must run (it resets their histograms and counts for the next step) */
    A.smem_cand = tau_smem_floats(pl);
    const size_t smem = (size_t)A.smem_cand * sizeof(float);
    EKV_CUDA_TRY(pl, ekv_cuda_allow_smem<tau_entmax_kernel>(smem));
    A.cluster = tau_cluster_blocks(pl, (int64_t)batch * A.H, smem);
    A.spread_at = tau_spread_at(pl, A.smem_cand);
    ekv_status s = launch_candidates(pl, prm, t, A, batch, round, rows);
    if (!s)
        s = ekv_cuda_launch_clusters(pl, tau_entmax_kernel,
                                     dim3((unsigned)(batch * A.H * A.cluster)), TAU_THREADS, smem,
                                     (unsigned)A.cluster, A);
    if (s) reset_tau_counts(pl, batch);
    return s;
}

/* Query heads flagged EKV_TAU_FLAG_CLUSTER by the steps since the last report (test_hooks.h). */
extern "C" EKV_API ekv_status ekv_cuda_tau_cluster_rows(ekv_cuda_plan *pl, int32_t batch,
                                                        int64_t *rows) {
    const ekv_status cs = ekv_cuda_check_readout(pl, rows, "rows", batch);
    if (cs) return cs;
    const int64_t n = (int64_t)batch * pl->p.num_heads;
    int32_t *fl = (int32_t *)malloc(sizeof(int32_t) * (size_t)n);
    if (!fl) return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    const ekv_status s =
            ekv_cuda_read_head_rows(pl, batch, fl, pl->flags, (int64_t)sizeof(int32_t));
    *rows = 0;
    for (int64_t i = 0; !s && i < n; i++) *rows += (fl[i] & EKV_TAU_FLAG_CLUSTER) != 0;
    free(fl);
    return s;
}
