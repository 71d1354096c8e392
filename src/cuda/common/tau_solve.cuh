/*
 * The entmax threshold solver of the GPU backend (docs/math.md §0, §9.8): tau - M over a set
 * of scores (candidates or a whole row) with M their max, by one block, or with WARP by one
 * warp (a set of a few thousand values: no barriers, many rows per block), and a lower bound
 * on it from a histogram of the scores for sets too large to solve fast. Shared by the attend
 * stage's tau kernel (stages/tau.cu), the screen's tau of the lower bounds (screen.cu) and the
 * prefill's (prefill/prefill*.cu).
 */
#pragma once
#include "reduce.cuh"
#include "sizes.cuh"

namespace {

/* Whether the solver works from the moments of the candidates (tau_sums: alpha 2 and 1.5, whose
 * F is a polynomial of degree 1 or 2 on a fixed support), not from F and F' (cand_newton); and
 * the exponent beta = 1 / (alpha - 1) of those two as an integer. The rule of every solver
 * caller. */
__device__ __forceinline__ bool tau_by_moments(double alpha) { return alpha == 2.0 || alpha == 1.5; }
__device__ __forceinline__ int tau_moment_beta(double alpha) { return alpha == 1.5 ? 2 : 1; }

/* Sums over the candidates y = z - M > tau' (tau' relative to M), one block reduction */
struct tau_sums {
    double n, s1, s2, mn;
};

/* The threads that share a solve: the block, or with WARP the calling thread's warp. */
template <bool WARP> __device__ __forceinline__ int solver_rank() {
    return WARP ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
}
template <bool WARP> __device__ __forceinline__ int solver_size() {
    return WARP ? 32 : (int)blockDim.x;
}
template <bool WARP> __device__ __forceinline__ double solver_sum(double v, double *scratch) {
    return WARP ? ekv_warp_sum(v) : ekv_block_sum(v, scratch);
}

/* Visits v[i] for the solver's share of i < n (rank, rank + size, ... in that order, so the
 * sums do not depend on the unrolling). A block over a list in global memory (one longer than
 * the tau kernel's shared copy) keeps U loads in flight a thread: one L2 load at a time, the tau
 * kernel took 74 us a step on the model's 256K layer 0 (this text's flat heads), 51 with 8
 * (bench/RESULTS.md, "2026-12-06 (eighth session)"); over shared memory 8 made the short lists
 * of the other layers 1.6 us slower, and a warp's solves (the prefill's, the fused attend's)
 * keep one: their kernels are sized by registers. */
enum { SOLVER_UNROLL = 8 };
template <int U, bool WARP, typename F>
__device__ __forceinline__ void solver_scan_u(const float *v, int64_t n, F f) {
    const int64_t size = solver_size<WARP>();
    for (int64_t base = solver_rank<WARP>(); base < n; base += size * U) {
        float x[U];
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int64_t i = base + k * size;
            x[k] = i < n ? v[i] : -INFINITY;
        }
#pragma unroll
        for (int k = 0; k < U; k++)
            if (base + k * size < n) f(x[k]);
    }
}
template <bool WARP, typename F>
__device__ __forceinline__ void solver_scan(const float *v, int64_t n, F f) {
    if (!WARP && !__isShared(v)) /* block-uniform */
        solver_scan_u<SOLVER_UNROLL, WARP>(v, n, f);
    else
        solver_scan_u<1, WARP>(v, n, f);
}

template <bool WARP = false>
__device__ tau_sums cand_sums(const float *v, int64_t n, float M, double t, double *scratch) {
    double c = 0, s1 = 0, s2 = 0, mn = 1e300;
    solver_scan<WARP>(v, n, [&](float x) {
        const double y = (double)x - (double)M;
        if (y > t) {
            c += 1;
            s1 += y;
            s2 += y * y;
            mn = y < mn ? y : mn;
        }
    });
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    c = ekv_warp_sum(c);
    s1 = ekv_warp_sum(s1);
    s2 = ekv_warp_sum(s2);
    mn = ekv_warp_min(mn);
    if (WARP) return tau_sums{c, s1, s2, mn};
    __syncthreads(); /* scratch is reused by the caller's previous reduction */
    if (lane == 0) {
        scratch[warp] = c;
        scratch[32 + warp] = s1;
        scratch[64 + warp] = s2;
        scratch[96 + warp] = mn;
    }
    __syncthreads();
    tau_sums r;
    r.n = ekv_warp_sum(lane < nw ? scratch[lane] : 0.0);
    r.s1 = ekv_warp_sum(lane < nw ? scratch[32 + lane] : 0.0);
    r.s2 = ekv_warp_sum(lane < nw ? scratch[64 + lane] : 0.0);
    r.mn = ekv_warp_min(lane < nw ? scratch[96 + lane] : 1e300);
    return r;
}

/* F = sum [y - t]_+^beta - 1 and its derivative */
template <bool WARP = false>
__device__ void cand_newton(const float *v, int64_t n, float M, double t, double beta,
                            double *scratch, double *F, double *Fp) {
    double f = 0, fp = 0;
    solver_scan<WARP>(v, n, [&](float x) {
        const double y = (double)x - (double)M - t;
        if (y > 0) {
            const double pb1 = pow(y, beta - 1.0);
            f += pb1 * y;
            fp += pb1;
        }
    });
    *F = solver_sum<WARP>(f, scratch) - 1.0;
    *Fp = -beta * solver_sum<WARP>(fp, scratch);
}

/* The solver's state between iterations: t = tau' (relative to M), the bracket of the generic
 * Newton and the support size of Michelot's previous step. */
struct tau_iter {
    double t, lo, hi, prev_n;
};

/* The start from a lower bound t0 of tau - M (t0 = -1 always is one: F(-1) >= 1 because the
 * max alone gives 1). */
__device__ __forceinline__ tau_iter tau_start(double t0) { return tau_iter{t0, t0, 0.0, -1.0}; }

/* One iteration of the solver for alpha from the sums at it->t (alpha 2 and 1.5: s, the
 * candidates above t; otherwise F and Fp of cand_newton); returns 1 when it->t is tau - M.
 * Written for one thread: every caller's lanes that hold the same sums take the same step. */
__device__ __forceinline__ int tau_step(double alpha, const tau_sums &s, double F, double Fp,
                                        tau_iter *it) {
    const double t = it->t;
    if (alpha == 2.0) {
        /* Michelot: the closed form over a superset of the support is a lower bound of tau */
        const double tn = (s.s1 - 1.0) / s.n;
        if (s.n == it->prev_n || !(tn > t)) {
            it->t = tn > t ? tn : t;
            return 1;
        }
        it->prev_n = s.n;
        it->t = tn;
        return 0;
    }
    if (alpha == 1.5) {
        /* Newton from the left (monotone, F convex) on F = sum (y-t)^2 - 1; the closed form on
         * the current support is exact as soon as it keeps that support */
        const double disc = s.s1 * s.s1 - s.n * (s.s2 - 1.0);
        const double tc = (s.s1 - sqrt(disc > 0 ? disc : 0.0)) / s.n;
        if (tc >= t && s.mn > tc) {
            it->t = tc;
            return 1;
        }
        const double F2 = s.s2 - 2.0 * t * s.s1 + s.n * t * t - 1.0, Fp2 = -2.0 * (s.s1 - s.n * t);
        const double tn = t - F2 / Fp2;
        if (!(tn > t)) return 1;
        it->t = tn;
        return 0;
    }
    /* safeguarded Newton inside the bracket [lo, hi] */
    if (F > 0)
        it->lo = t;
    else
        it->hi = t;
    if (F == 0 || it->hi - it->lo <= 1e-15 * (1.0 + fabs(t))) return 1;
    double tn = Fp < 0 ? t - F / Fp : 0.5 * (it->lo + it->hi);
    if (!(tn > it->lo && tn < it->hi)) tn = 0.5 * (it->lo + it->hi);
    it->t = tn;
    return 0;
}

/* The iteration cap of the solver for alpha. */
__device__ __forceinline__ int tau_max_iters(double alpha) { return alpha == 1.5 ? 100 : 200; }

/* tau - M over the values v[0..n) (candidates or a whole score row) for entmax alpha > 1,
 * from t0, a lower bound of it (-1 always is one); scratch: shared memory of 128 doubles
 * (unused with WARP) */
template <bool WARP = false>
__device__ double solve_tau(const float *v, int64_t n, float M, double alpha, double *scratch,
                            double t0 = -1.0) {
    const double beta = 1.0 / (alpha - 1.0);
    tau_iter it = tau_start(t0);
    const int cap = tau_max_iters(alpha);
    for (int k = 0; k < cap; k++) {
        tau_sums s = {0, 0, 0, 0};
        double F = 0, Fp = 0;
        if (tau_by_moments(alpha))
            s = cand_sums<WARP>(v, n, M, it.t, scratch);
        else
            cand_newton<WARP>(v, n, M, it.t, beta, scratch, &F, &Fp);
        if (tau_step(alpha, s, F, Fp, &it)) break;
    }
    return it.t;
}

/* The threshold (absolute, not relative to a max) of the n values at v, any subset of a row's
 * scores: a lower bound on the row's own threshold (docs/math.md §9.1). Block-wide, or with
 * WARP warp-wide (scratch and fscratch unused). */
template <bool WARP = false>
__device__ double subset_threshold(const float *v, int64_t n, double alpha, double *scratch,
                                   float *fscratch) {
    float ms = -INFINITY;
    solver_scan<WARP>(v, n, [&](float x) { ms = fmaxf(ms, x); });
    ms = WARP ? ekv_warp_max(ms) : ekv_block_max(ms, fscratch, -INFINITY);
    return (double)ms + solve_tau<WARP>(v, n, ms, alpha, scratch);
}

/* The fp32 threshold just below lb, a lower bound of tau from these solves (less a margin for
 * their rounding, then rounded down to the scores' precision): every score above lb is above
 * it, so a list of the scores above it holds the support. */
__device__ __forceinline__ float bound_f32(double lb) {
    return __double2float_rd(lb - 1e-6 * (1.0 + fabs(lb)));
}

/* The threshold a candidate list is rebuilt above, from lb, a lower bound of tau over a row with
 * max M: bound_f32(lb), and never below M - 1's (every support score is above M - 1, docs/math.md
 * §0, and a subset's threshold need not be). */
__device__ __forceinline__ float list_bound(double lb, float M) {
    return fmaxf(bound_f32(lb), bound_f32((double)M - 1.0));
}

/* bins of y = z - M over [-1, 0] of the histogram bounds (their callers' shared arrays) */
enum { TAU_HIST_BINS = EKV_CUDA_TAU_HIST_BINS };

/* The bin of y = z - M in [-1, 0] (callers count only y >= -1). */
__device__ __forceinline__ int tau_hist_bin(double y) {
    const int k = (int)((y + 1.0) * TAU_HIST_BINS);
    return k < TAU_HIST_BINS ? k : TAU_HIST_BINS - 1;
}

/* pw[d] = (d / TAU_HIST_BINS)^beta rounded down to float, for d < TAU_HIST_BINS: the bin
 * search's terms looked up instead of a pow each (rounded down, the sums stay below F, so the
 * bound stays one). Block-wide; a barrier follows. */
__device__ void hist_power_table(float *pw, double alpha) {
    const double beta = 1.0 / (alpha - 1.0);
    for (int d = threadIdx.x; d < TAU_HIST_BINS; d += blockDim.x) {
        const double x = (double)d / TAU_HIST_BINS; /* exact: the bins are a power of two */
        /* alpha 1.5 and 2 exactly (d^2 < 2^24), other alphas by pow (a double pow per entry
         * was most of the cost of a row's last candidates block) */
        pw[d] = beta == 2.0 ? (float)(x * x) : beta == 1.0 ? (float)x : __double2float_rd(pow(x, beta));
    }
    __syncthreads();
}

/* A lower bound on tau - M from the counts hist[j] of y = z - M in bin j of [-1, 0] (shared
 * memory; pw from hist_power_table): every y of bin j is at least e_j = -1 + j / NB, so
 * F(e_k) >= sum_{j >= k} c_j (e_j - e_k)^beta, and where that reaches 1, e_k <= tau - M (F
 * falls through 1 at tau - M; docs/math.md §0). The bound falls as k grows, so a binary search
 * finds the largest such k (-1 when none: tau - M >= -1 always). Always within two bins of
 * tau - M (docs/math.md §9.1, "A bound from counts"); any alpha > 1. Block-wide. */
__device__ double hist_count_bound(const unsigned *hist, const float *pw, double *scratch) {
    int lo = -1, hi = TAU_HIST_BINS; /* lo: a bin whose edge is a bound (-1: e = -1) */
    while (hi - lo > 1) {            /* block-uniform */
        const int mid = (lo + hi) / 2;
        double f = 0;
        for (int j = mid + 1 + threadIdx.x; j < TAU_HIST_BINS; j += blockDim.x)
            f += (double)hist[j] * (double)pw[j - mid];
        if (ekv_block_sum(f, scratch) >= 1.0 + 1e-9) /* a margin for the sum's rounding */
            lo = mid;
        else
            hi = mid;
    }
    return -1.0 + (double)(lo < 0 ? 0 : lo) / TAU_HIST_BINS;
}

/* The moment test of bin k (count c) for the bounds below: adds bin k to the running moments
 * run (the bins before it, then through it) and returns whether F at bin k's edge, from the
 * suffix moments tot - run, reaches 1 with a margin for the sums' rounding (terms up to 4 S0). */
__device__ __forceinline__ bool moment_bound_holds(double c, int k, int beta, double (&run)[3],
                                                   const double (&tot)[3]) {
    const double x = (double)k / TAU_HIST_BINS;
    run[0] += c, run[1] += c * x, run[2] += c * x * x;
    const double S0 = tot[0] - run[0], S1 = tot[1] - run[1], S2 = tot[2] - run[2];
    const double f = beta == 2 ? S2 - 2.0 * x * S1 + x * x * S0 : S1 - x * S0;
    return f >= 1.0 + 1e-9 + 1e-13 * tot[0];
}

/* The bound of hist_count_bound for beta 1 and 2 (alpha 2 and 1.5) in one pass instead of a
 * binary search of block sums: with x_j = j / NB (e_j - e_k = x_j - x_k), sum_{j>k} c_j (x_j -
 * x_k)^beta is S1 - x_k S0 or S2 - 2 x_k S1 + x_k^2 S0 in the suffix moments S_m = sum_{j>k} c_j
 * x_j^m, so a block scan of the moments tests every k at once. The margin covers the sums'
 * rounding (terms up to 4 S0 in size). Block-wide; scratch: 96 doubles; hist complete. */
__device__ double hist_moment_bound(const unsigned *hist, int beta, double *scratch) {
    const int per = (TAU_HIST_BINS + blockDim.x - 1) / blockDim.x, j0 = threadIdx.x * per;
    const int j1 = j0 + per < TAU_HIST_BINS ? j0 + per : TAU_HIST_BINS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    double m[3] = {0, 0, 0}, run[3], tot[3];
    for (int j = j0; j < j1; j++) {
        const double c = hist[j], x = (double)j / TAU_HIST_BINS;
        m[0] += c, m[1] += c * x, m[2] += c * x * x;
    }
    __syncthreads(); /* scratch is reused by the caller's previous reduction */
    for (int r = 0; r < 3; r++) { /* inclusive warp scan, then the warps' totals */
        double v = m[r];
        for (int o = 1; o < 32; o <<= 1) {
            const double y = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += y;
        }
        run[r] = v - m[r]; /* this warp's lanes before this thread */
        if (lane == 31) scratch[32 * r + warp] = v;
    }
    __syncthreads();
    for (int r = 0; r < 3; r++) {
        tot[r] = 0;
        for (int w = 0; w < nw; w++) {
            const double c = scratch[32 * r + w];
            run[r] += w < warp ? c : 0.0;
            tot[r] += c;
        }
    }
    double best = -1.0; /* the largest bin k whose edge is a bound */
    for (int k = j0; k < j1; k++)
        if (moment_bound_holds(hist[k], k, beta, run, tot)) best = (double)k;
    best = ekv_block_max(best, scratch, -1.0); /* its first barrier: every thread read scratch */
    return -1.0 + (best < 0 ? 0.0 : best) / TAU_HIST_BINS;
}

/* 16 counts of a histogram in global memory from gh (16-byte aligned), through L2 (other blocks
 * counted them): four loads in flight. */
__device__ __forceinline__ void load_bins16(const uint32_t *gh, uint32_t (&w)[16]) {
    uint4 v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = __ldcg(reinterpret_cast<const uint4 *>(gh) + i);
#pragma unroll
    for (int i = 0; i < 4; i++) w[4 * i] = v[i].x, w[4 * i + 1] = v[i].y, w[4 * i + 2] = v[i].z,
                                 w[4 * i + 3] = v[i].w;
}

/* hist_moment_bound by one warp over a histogram in global memory (gh, complete, 16-byte
 * aligned): a lane's run of NB / 32 bins in loads of 16 (a loop of single loads, each waiting
 * on L2, cost ~25 us a row), the same test. */
__device__ double warp_moment_bound(const uint32_t *gh, int beta) {
    constexpr int PER = TAU_HIST_BINS / 32;
    const int lane = threadIdx.x & 31, j0 = lane * PER;
    double m[3] = {0, 0, 0}, run[3], tot[3];
    for (int c = 0; c < PER; c += 16) {
        uint32_t w[16];
        load_bins16(gh + j0 + c, w);
#pragma unroll
        for (int e = 0; e < 16; e++) {
            const double x = (double)(j0 + c + e) / TAU_HIST_BINS;
            m[0] += w[e], m[1] += w[e] * x, m[2] += w[e] * x * x;
        }
    }
    for (int r = 0; r < 3; r++) { /* exclusive warp scan and total */
        double v = m[r];
        for (int o = 1; o < 32; o <<= 1) {
            const double y = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += y;
        }
        run[r] = v - m[r];
        tot[r] = __shfl_sync(0xffffffffu, v, 31);
    }
    double best = -1.0;
    for (int c = 0; c < PER; c += 16) {
        uint32_t w[16];
        load_bins16(gh + j0 + c, w);
#pragma unroll
        for (int e = 0; e < 16; e++)
            if (moment_bound_holds(w[e], j0 + c + e, beta, run, tot)) best = (double)(j0 + c + e);
    }
    best = ekv_warp_max(best);
    return -1.0 + (best < 0 ? 0.0 : best) / TAU_HIST_BINS;
}

/* hist_count_bound for any alpha > 1: by the moments for alpha 1.5 and 2, else by the power
 * table (pw: TAU_HIST_BINS floats of shared memory). Block-wide; hist complete in shared memory
 * after a barrier; scratch: 128 doubles. */
__device__ double hist_bound(const unsigned *hist, double alpha, float *pw, double *scratch) {
    if (tau_by_moments(alpha)) return hist_moment_bound(hist, tau_moment_beta(alpha), scratch);
    hist_power_table(pw, alpha);
    return hist_count_bound(hist, pw, scratch);
}

/* A split's counts (hist, shared) added into its row's histogram (gh, global): its nonzero bins,
 * none when the block counted nothing (any: this thread counted some). Block-wide. */
__device__ void hist_flush(const unsigned *hist, uint32_t *gh, bool any) {
    if (!__syncthreads_or(any)) return; /* its barrier: the block's counts are complete */
    for (int k = threadIdx.x; k < TAU_HIST_BINS; k += blockDim.x)
        if (hist[k]) atomicAdd(gh + k, hist[k]);
}

/* hist_flush, then whether this block is the last of the row's nsplit to finish (done: the
 * row's counter): that block sees every split's counts (hist_take). Block-wide; s_last: a
 * shared flag. */
__device__ bool hist_flush_last(const unsigned *hist, uint32_t *gh, uint32_t *done, int nsplit,
                                bool *s_last) {
    hist_flush(hist, gh, true);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *s_last = atomicAdd(done, 1u) == (unsigned)nsplit - 1;
    __syncthreads();
    return *s_last;
}

/* The last block's view of its row's histogram: gh (complete) into hist, gh and the done count
 * zeroed for the next step; returns the row's count. Block-wide (a barrier at the end). */
__device__ double hist_take(uint32_t *gh, uint32_t *done, unsigned *hist, double *scratch) {
    __threadfence(); /* the other blocks' counts (they fenced before their done increment) */
    double total = 0;
    for (int k = threadIdx.x; k < TAU_HIST_BINS; k += blockDim.x) {
        hist[k] = __ldcg(gh + k);
        total += hist[k];
        gh[k] = 0u;
    }
    if (threadIdx.x == 0) *done = 0u;
    return ekv_block_sum(total, scratch); /* its barriers: hist is complete */
}

/* Zeroes a row histogram gh for the next count, in 16-byte stores (its reader already read it:
 * no read here). Block-wide; the caller orders the block's reads of gh before it. */
__device__ __forceinline__ void hist_zero_row(uint32_t *gh) {
    for (int k = threadIdx.x; k < TAU_HIST_BINS / 4; k += blockDim.x)
        reinterpret_cast<uint4 *>(gh)[k] = make_uint4(0u, 0u, 0u, 0u);
}

/* The lower bound of tau - M (hist_bound) of a row histogram gh that a launch before completed,
 * read into hist (shared, 16-byte aligned); gh is left as it is (several blocks read it).
 * Block-wide. */
__device__ double hist_read_bound(const uint32_t *gh, unsigned *hist, double alpha, float *pw,
                                  double *scratch) {
    /* 16-byte loads: a block of 512 threads reads the row in one load each, not four in turn */
    for (int k = threadIdx.x; k < TAU_HIST_BINS / 4; k += blockDim.x)
        reinterpret_cast<uint4 *>(hist)[k] = __ldcg(reinterpret_cast<const uint4 *>(gh) + k);
    __syncthreads();
    return hist_bound(hist, alpha, pw, scratch);
}

/* Rows with more candidates than this want the histogram's bound where it is not counted for
 * every row: screened rows' candidates (CAND_COUNT) and the screen's tau(l), whose solves then
 * start there (a few iterations from within two bins of tau instead of Newton's from M - 1). */
enum { TAU_BOUND_MIN = 1024 };

/* Whether a row of count candidates takes the histogram's bound: they overflow the room they
 * are solved in (cap: a list, or shared memory), or are many enough that the solve should start
 * there (TAU_BOUND_MIN). The candidates kernel's and the screen's tau(l) rule. */
__device__ __forceinline__ bool wants_bound(int64_t count, int64_t cap) {
    return count > cap || count > TAU_BOUND_MIN;
}

/* Rows with more candidates than this have their list rebuilt above the histogram's bound by the
 * refine pass, as an overflowed row has: the tau kernel's one block then solves and marks over
 * the support and a few bins, not over every z >= M - 1 (tens of thousands on a flat head; with
 * lists of a quarter of the tokens that made the model's layers 2-7 at 256K 1.3-1.9x slower).
 * The candidates kernel's and the tau kernel's rule. */
enum { TAU_REFINE_MIN = 4096 };

__device__ __forceinline__ bool refines(int64_t count, int64_t cap) {
    return count > cap || count > TAU_REFINE_MIN;
}

/* Whether the tau kernel starts a row of count candidates (listed in a list of cap) from the
 * histogram's bound: a row that wants it (wants_bound), and for alpha 1.5 and 2 (the bound one
 * scan of moments; other alphas' bisection of block sums costs more than the iterations it
 * saves on a short list) every row whose histogram was counted: every listed row, not a
 * screened row (`screened`: the candidates kernel counted none of a row that wants no bound).
 * Newton from M - 1 takes 4-8 iterations over 32-4096 candidates and 5 us on a row of 12 (the
 * model's trace, bench/RESULTS.md "the tau kernel's fixed cost"), 1-2 from within two bins of
 * tau, each a block reduction; the refine pass computes the bound, beside the rows it refines,
 * so the tau kernel only reads it. Every refined row reads it (refines implies wants_bound). */
__device__ __forceinline__ bool reads_bound(int64_t count, int64_t cap, double alpha,
                                            bool screened) {
    return wants_bound(count, cap) || (!screened && tau_by_moments(alpha));
}

} // namespace
