/*
 * The fused dense attend (docs/architecture.md, "The fused dense attend"; docs/math.md §0 and
 * §9.1). After the scores kernel, one cooperative launch does what the candidates, refine, tau
 * and values launches do, for steps of few (sequence, KV head) pairs: the model's decode (one
 * sequence, 2 KV heads), where those launches ran one block per head on 6 of 132 SMs and a flat
 * head's candidates overflowed every list. The blocks of a group (sequence b, KV head) own
 * equal ranges of the group's G score rows:
 *   1. each row's max M (the scores kernel's split maxima) and the counts of y = z - M in the
 *      bins of [-1, 0], added into the row's histogram;                        group barrier
 *   2. every block reads the histograms: the count bound t0 <= tau - M (tau_solve.cuh), where
 *      the solver starts; for alpha 1.5 and 2 a first round: the sums above t0 + 4 bins and a
 *      list of the scores between, a barrier, and every block solves each row alone from them
 *      (fused_first_step); the rows it leaves open take rounds: each block's sums over its
 *      range at t, a group barrier, and every block adds the group's sums in one order and
 *      takes the solver's step (tau_step), so all blocks leave after the same round with the
 *      same tau;
 *   3. each block adds p V over its range's support (a V row read once for the group) into out.
 * No list, so nothing overflows: a flat head costs what any head costs. Groups never wait on
 * each other (group_sync.cuh).
 */
#include "attend_common.cuh"
#include "attend_fused.cuh"
#include "../common/group_sync.cuh"
#include "../common/launch.cuh"
#include "../common/loads.cuh"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include "../common/sizes.cuh"
#include "../common/splits.cuh"
#include "../common/tau_solve.cuh"
#include "../common/weights.cuh"
#include <math_constants.h>

namespace {

enum { FUSED_THREADS = 256, FUSED_WARPS = FUSED_THREADS / 32, FUSED_U = 2 };
/* rows of a fused step at most: the partial sums' pitch */
enum { FUSED_ROWS = EKV_CUDA_FUSED_GROUPS * EKV_CUDA_FUSED_GROUP };
/* the first round's window above the count bound, in bins, and its list's entries a row */
enum { FUSED_NEAR_BINS = 4, FUSED_NEAR_CAP = EKV_CUDA_FUSED_NEAR_CAP };
static_assert((int)FUSED_NEAR_CAP <= (int)TAU_HIST_BINS, "a near list fits the block's shared buffer");

struct fused_args : ekv_cuda_shape {
    ekv_paged_kv kv;
    const float *scores, *split_max;
    int nsplit, split_cap; /* the scores launch's splits (ekv_seq_splits' base), their pitch */
    uint32_t *hist;        /* [B*H][TAU_HIST_BINS] counts, zero between steps              */
    double alpha;
    double *tau, *tau_t;
    float *tau_m;
    int64_t *support, *v_rows;
    float *out;
    double *part;  /* [2][FUSED_ROWS][4][per_group] the blocks' sums of a round, by its parity */
    unsigned *bar; /* [groups][2] the groups' barriers                                         */
    float *near;   /* [FUSED_ROWS][FUSED_NEAR_CAP] the first round's scores near the bound      */
    uint32_t *near_count; /* [FUSED_ROWS], zeroed in phase 1                                    */
    int per_group; /* blocks of a group                                                        */
};

/* What a block works on: its group (sequence b, KV head kvh; lrow = b Hk + kvh), the group's
 * first query head row h0, the sequence's first page entry, and its token range [c0, c1). */
struct fused_block {
    int b, kvh, lrow, j;
    int64_t h0, first, c0, c1;
};

__device__ fused_block fused_block_of(const fused_args &A) {
    fused_block k;
    k.lrow = blockIdx.x / A.per_group;
    k.j = blockIdx.x % A.per_group;
    k.b = k.lrow / A.Hk;
    k.kvh = k.lrow % A.Hk;
    k.h0 = (int64_t)k.b * A.H + (int64_t)k.kvh * A.G;
    const ekv_seq_geom sg = ekv_seq(A.t, k.b, A.ps);
    k.first = sg.first;
    const int64_t chunk = ((sg.N + A.per_group - 1) / A.per_group + 31) & ~(int64_t)31;
    k.c0 = sg.N < k.j * chunk ? sg.N : k.j * chunk;
    k.c1 = sg.N < k.c0 + chunk ? sg.N : k.c0 + chunk;
    return k;
}

/* Each row's max from the scores kernel's split maxima (as head_max takes it), warp g for row
 * g, all rows at once. Block-wide. */
__device__ void fused_maxima(const fused_args &A, const fused_block &k, float *sM) {
    const int nsp = ekv_seq_splits(A.t, k.b, A.nsplit, A.split_cap);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int g = warp; g < A.G; g += FUSED_WARPS) {
        const float *sm = split_max_row(A.split_max, k.h0 + g, A.split_cap);
        float m = -CUDART_INF_F;
        for (int i = lane; i < nsp; i += 32) m = fmaxf(m, sm[i]);
        m = ekv_warp_max(m);
        if (lane == 0) sM[g] = m;
    }
    __syncthreads();
}

/* Phase 1: each row's max (sM) and the counts of its range into the row's histogram; the
 * group's first block zeroes the rows' outputs and support counts, which phase 3 adds into
 * after the barrier. Block-wide; hist: TAU_HIST_BINS of shared memory. */
__device__ void fused_count(const fused_args &A, const fused_block &k, float *sM, unsigned *hist) {
    fused_maxima(A, k, sM);
    for (int g = 0; g < A.G; g++) {
        const int64_t row = k.h0 + g;
        const float M = sM[g];
        for (int i = threadIdx.x; i < TAU_HIST_BINS; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        const float *z = A.scores + row * A.cap_tokens;
        bool any = false;
        for (int64_t i = k.c0 + threadIdx.x; i < k.c1; i += blockDim.x) {
            const double y = (double)z[i] - (double)M;
            if (y >= -1.0) {
                atomicAdd(hist + tau_hist_bin(y), 1u);
                any = true;
            }
        }
        hist_flush(hist, A.hist + row * TAU_HIST_BINS, any);
        __syncthreads(); /* the flush read hist before the next row clears it */
        if (k.j == 0) {
            for (int d = threadIdx.x; d < A.D; d += blockDim.x) A.out[row * A.D + d] = 0.f;
            if (threadIdx.x == 0) A.support[row] = 0, A.near_count[row] = 0u;
        }
    }
}

/* Phase 2's start, after the barrier: the solver's state of each row from its histogram's count
 * bound (alpha 1.5 and 2; other alphas from -1, always a bound); a row with no tokens is done.
 * Warp g for row g. */
__device__ void fused_start(const fused_args &A, const fused_block &k, const float *sM,
                            tau_iter *sit, int *sdone) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int g = warp; g < A.G; g += FUSED_WARPS) {
        const uint32_t *gh = A.hist + (k.h0 + g) * TAU_HIST_BINS;
        const double t0 =
                tau_by_moments(A.alpha) ? warp_moment_bound(gh, tau_moment_beta(A.alpha)) : -1.0;
        if (lane == 0) {
            sit[g] = tau_start(t0);
            sdone[g] = !(sM[g] > -CUDART_INF_F);
        }
    }
    __syncthreads();
}

/* Where sum q (of 4) of row `row` in a round of this parity lives, block j's at [j]: a warp
 * reads 32 blocks' in one load. */
__device__ __forceinline__ double *fused_part(const fused_args &A, int parity, int64_t row,
                                              int q) {
    return A.part + (((int64_t)parity * FUSED_ROWS + row) * 4 + q) * A.per_group;
}

/* A token's terms of row g's sums at t into q: (1, y, y^2, min y) of y > t for alpha 1.5 and 2
 * (cand_sums'), else (y^beta, y^(beta - 1)) of y = z - M - t > 0 (cand_newton's). */
__device__ __forceinline__ void fused_terms(double y, double t, bool moments, double beta,
                                            double (&q)[4]) {
    if (moments) {
        if (y > t) q[0] += 1, q[1] += y, q[2] += y * y, q[3] = y < q[3] ? y : q[3];
    } else if (y - t > 0) {
        const double pb1 = pow(y - t, beta - 1.0);
        q[0] += pb1 * (y - t), q[1] += pb1;
    }
}

/* The block's sums q of its threads (fused_terms' four a row) reduced over the block and
 * stored as its part of the round (parity) for every open row. Block-wide; red: FUSED_WARPS x
 * 4 GM doubles of shared memory. */
template <int GM>
__device__ void fused_store_sums(const fused_args &A, const fused_block &k, int parity,
                                 const int *sdone, double (&q)[GM][4], double *red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int g = 0; g < GM; g++) {
        for (int r = 0; r < 3; r++) q[g][r] = ekv_warp_sum(q[g][r]);
        q[g][3] = ekv_warp_min(q[g][3]);
        if (lane == 0)
            for (int r = 0; r < 4; r++) red[warp * 4 * GM + 4 * g + r] = q[g][r];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 4 * A.G; e += blockDim.x) {
        const int g = e / 4, r = e % 4;
        if (sdone[g]) continue;
        double v = r == 3 ? 1e300 : 0.0;
        for (int w = 0; w < FUSED_WARPS; w++) {
            const double x = red[w * 4 * GM + e];
            v = r == 3 ? fmin(v, x) : v + x;
        }
        fused_part(A, parity, k.h0 + g, r)[k.j] = v;
    }
}

template <int GM> __device__ __forceinline__ void fused_zero_sums(double (&q)[GM][4]) {
#pragma unroll
    for (int g = 0; g < GM; g++) q[g][0] = q[g][1] = q[g][2] = 0.0, q[g][3] = 1e300;
}

/* This block's sums over its range at each open row's t (fused_terms), every row in one pass
 * and one block reduction, into the round's parts. Block-wide. */
template <int GM>
__device__ void fused_sums(const fused_args &A, const fused_block &k, int parity, const float *sM,
                           const tau_iter *sit, const int *sdone, double *red) {
    const bool moments = tau_by_moments(A.alpha);
    const double beta = 1.0 / (A.alpha - 1.0);
    double q[GM][4];
    fused_zero_sums(q);
    for (int64_t i = k.c0 + threadIdx.x; i < k.c1; i += blockDim.x)
#pragma unroll
        for (int g = 0; g < GM; g++)
            if (g < A.G && !sdone[g])
                fused_terms((double)A.scores[(k.h0 + g) * A.cap_tokens + i] - (double)sM[g],
                            sit[g].t, moments, beta, q[g]);
    fused_store_sums<GM>(A, k, parity, sdone, q, red);
}

/* The first round for alpha 1.5 and 2 (docs/architecture.md, "The fused dense attend"): tau - M
 * lies within two bins of the count bound t0, so the scores above U = t0 + FUSED_NEAR_BINS bins
 * are (almost always) all support: the block's sums over them as its part, and the few scores
 * in (t0, U] appended to the row's near list (warp-aggregated; counted past its capacity).
 * Block-wide, in warp-uniform passes. */
template <int GM>
__device__ void fused_first_sums(const fused_args &A, const fused_block &k, const float *sM,
                                 const tau_iter *sit, const int *sdone, double *red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    double q[GM][4];
    fused_zero_sums(q);
    for (int64_t base = k.c0 + (int64_t)warp * 32; base < k.c1; base += blockDim.x) {
        const int64_t i = base + lane;
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g >= A.G || sdone[g]) continue; /* warp-uniform */
            const float z = i < k.c1 ? A.scores[(k.h0 + g) * A.cap_tokens + i] : -CUDART_INF_F;
            const double y = (double)z - (double)sM[g], t0 = sit[g].t;
            const double U = t0 + (double)FUSED_NEAR_BINS / TAU_HIST_BINS;
            if (y > U) fused_terms(y, t0, true, 2.0, q[g]); /* the moments of y > t0 */
            const bool near = y > t0 && y <= U;
            const uint32_t at = ekv_warp_append(near, A.near_count + k.h0 + g);
            if (near && at < FUSED_NEAR_CAP) A.near[(k.h0 + g) * FUSED_NEAR_CAP + at] = z;
        }
    }
    fused_store_sums<GM>(A, k, 0, sdone, q, red);
}

/* The sums of row `row` over the group's blocks from a round's parts (parity), in one order so
 * that every block gets the same bits: the first three added, the fourth's minimum (for alpha
 * other than 1.5 and 2 the first two are F + 1 and F'). Warp-collective. */
__device__ tau_sums fused_group_sums(const fused_args &A, int parity, int64_t row) {
    const double *p[4];
#pragma unroll
    for (int r = 0; r < 4; r++) p[r] = fused_part(A, parity, row, r);
    double q[4] = {0, 0, 0, 1e300};
#pragma unroll 2
    for (int j = threadIdx.x & 31; j < A.per_group; j += 32) {
        const double a = __ldcg(p[0] + j), b = __ldcg(p[1] + j), c = __ldcg(p[2] + j),
                     d = __ldcg(p[3] + j); /* the four loads in flight together */
        q[0] += a, q[1] += b, q[2] += c, q[3] = fmin(q[3], d);
    }
    return tau_sums{ekv_warp_sum(q[0]), ekv_warp_sum(q[1]), ekv_warp_sum(q[2]), ekv_warp_min(q[3])};
}

/* After the first round's barrier, one warp: row g's solve over its sure sums S (the scores
 * above U) and its n near scores (in shared memory), from t0 (sit); false where an iterate
 * passes U (tau - M above the window: S would hold scores below tau) and the rounds take
 * over. Every block gets the same bits (the same list in the same order). */
__device__ bool fused_near_solve(const float *near, int n, float M, const tau_sums &S, double U,
                                 double alpha, tau_iter *it) {
    for (int r = 0; r < tau_max_iters(alpha); r++) {
        const tau_sums l = cand_sums<true>(near, n, M, it->t, nullptr);
        const tau_sums s = {S.n + l.n, S.s1 + l.s1, S.s2 + l.s2, fmin(S.mn, l.mn)};
        const int done = tau_step(alpha, s, 0.0, 0.0, it);
        if (it->t > U) return false;
        if (done) return true;
    }
    return true; /* the cap, as the rounds take it */
}

/* The first round's end, in every block alike, row after row: the sure sums over the group's
 * blocks, the near list into shared memory (buf: FUSED_NEAR_CAP floats) and fused_near_solve;
 * a row whose list overflowed or whose solve left the window restarts from t0 in the rounds.
 * Block-wide. */
__device__ void fused_first_step(const fused_args &A, const fused_block &k, const float *sM,
                                 tau_iter *sit, int *sdone, float *buf) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int g = 0; g < A.G; g++) {
        if (sdone[g]) continue; /* block-uniform */
        const int64_t row = k.h0 + g;
        const uint32_t n = __ldcg(A.near_count + row);
        if (n > FUSED_NEAR_CAP) continue; /* block-uniform: the rounds from t0 */
        for (uint32_t e = threadIdx.x; e < n; e += blockDim.x)
            buf[e] = __ldcg(A.near + row * FUSED_NEAR_CAP + e);
        __syncthreads();
        if (warp == 0) {
            const tau_sums S = fused_group_sums(A, 0, row);
            tau_iter it = sit[g];
            const double U = it.t + (double)FUSED_NEAR_BINS / TAU_HIST_BINS;
            const bool ok = fused_near_solve(buf, (int)n, sM[g], S, U, A.alpha, &it);
            if (lane == 0 && ok) sit[g] = it, sdone[g] = 1;
        }
        __syncthreads(); /* buf is the next row's */
    }
}

/* After the round's barrier, in every block alike: each open row's sums over the group's blocks
 * (fused_group_sums) and the solver's step; a row stays open at most tau_max_iters rounds. Warp g
 * for row g. */
__device__ void fused_step(const fused_args &A, const fused_block &k, int parity, int round,
                           tau_iter *sit, int *sdone) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const double beta = 1.0 / (A.alpha - 1.0);
    for (int g = warp; g < A.G; g += FUSED_WARPS) {
        if (sdone[g]) continue;
        const tau_sums s = fused_group_sums(A, parity, k.h0 + g);
        if (lane == 0) {
            sdone[g] = tau_step(A.alpha, s, s.n - 1.0, -beta * s.s1, &sit[g]) ||
                       round + 1 >= tau_max_iters(A.alpha);
        }
    }
    __syncthreads();
}

/* Phase 2: the first round (alpha 1.5 and 2), then the rounds of every row's solve that it left
 * open, until each is done. Block-wide; buf: FUSED_NEAR_CAP floats of shared memory. */
template <int GM>
__device__ void fused_solve(const fused_args &A, const fused_block &k, const float *sM,
                            tau_iter *sit, int *sdone, double *red, float *buf) {
    int round = 0;
    if (tau_by_moments(A.alpha)) {
        fused_first_sums<GM>(A, k, sM, sit, sdone, red);
        group_sync(A.bar + 2 * k.lrow, A.per_group);
        fused_first_step(A, k, sM, sit, sdone, buf);
        round = 1;
    }
    for (;; round++) {
        bool open = false;
        for (int g = 0; g < A.G; g++) open |= !sdone[g];
        if (!open) return; /* block-uniform, and alike in every block of the group */
        fused_sums<GM>(A, k, round & 1, sM, sit, sdone, red);
        group_sync(A.bar + 2 * k.lrow, A.per_group);
        fused_step(A, k, round & 1, round, sit, sdone);
    }
}

/* The group's histograms zeroed for the next step, a share per block: every block of the group
 * read them (fused_start) before the first round's barrier, which precedes this. */
__device__ void fused_clear_hist(const fused_args &A, const fused_block &k) {
    uint32_t *gh = A.hist + k.h0 * TAU_HIST_BINS;
    const int64_t n = (int64_t)A.G * TAU_HIST_BINS;
    for (int64_t i = (int64_t)k.j * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)A.per_group * blockDim.x)
        gh[i] = 0u;
}

/* The support counts of one pass (each token once: the lanes of its row's first sub-lane),
 * into the block's shared counts; in[g]: z - M > t in double, the tau kernel's test (a weight
 * may round to 0 in fp32 above tau). Warp-uniform call. */
template <int GM>
__device__ __forceinline__ void fused_count_support(const bool (&in)[GM], bool first_lane,
                                                    int *scnt) {
#pragma unroll
    for (int g = 0; g < GM; g++) {
        const unsigned m = __ballot_sync(0xffffffffu, first_lane && in[g]);
        if ((threadIdx.x & 31) == 0 && m) atomicAdd(scnt + g, __popc(m));
    }
}

/* The block's sums (acc, a warp's rows of LPR lanes of 8 dims) added over its warps and into
 * out; red: FUSED_WARPS GM D floats of shared memory. Block-wide. */
template <int LPR, int GM>
__device__ void fused_out(const fused_args &A, const fused_block &k, float (&acc)[GM][8],
                          float *red) {
    constexpr int D = 8 * LPR;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sl = lane % LPR;
#pragma unroll
    for (int g = 0; g < GM; g++)
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int o = LPR; o < 32; o <<= 1)
                acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], o);
    __syncthreads(); /* red shares its memory with phase 1's histogram */
    if (lane < LPR)
#pragma unroll
        for (int g = 0; g < GM; g++)
#pragma unroll
            for (int i = 0; i < 8; i++) red[(warp * GM + g) * D + sl * 8 + i] = acc[g][i];
    __syncthreads();
    for (int e = threadIdx.x; e < A.G * D; e += blockDim.x) {
        float s = 0.f;
        for (int w = 0; w < FUSED_WARPS; w++) s += red[w * GM * D + e];
        if (s != 0.f) atomicAdd(A.out + k.h0 * D + e, s);
    }
}

/* Phase 3: p V over the block's range for the group's G heads: each token's G weights from the
 * solved (M, t) (entmax_p_split, as the values kernels form them), its V row read once where
 * any is positive; the support counts, the V rows read and the sums into out. Block-wide. */
template <typename T, int LPR, int GM>
__device__ void fused_values(const fused_args &A, const fused_block &k, const float *sM,
                             const tau_iter *sit, float *red, int *scnt) {
    constexpr int RPW = 32 / LPR; /* tokens a warp pass */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / LPR, sl = lane % LPR;
    const double beta = 1.0 / (A.alpha - 1.0);
    const T *V = static_cast<const T *>(A.kv.v);
    float acc[GM][8];
    zero_acc(acc);
    int64_t rows = 0;
    for (int64_t base = k.c0 + (int64_t)warp * RPW * FUSED_U; base < k.c1;
         base += (int64_t)FUSED_WARPS * RPW * FUSED_U) {
        float p[FUSED_U][GM], v8[FUSED_U][8];
        bool on[FUSED_U];
#pragma unroll
        for (int r = 0; r < FUSED_U; r++) {
            const int64_t i = base + r * RPW + sub;
            on[r] = false;
            bool in[GM];
#pragma unroll
            for (int g = 0; g < GM; g++) {
                const float z = i < k.c1 && g < A.G ? A.scores[(k.h0 + g) * A.cap_tokens + i]
                                                    : -CUDART_INF_F;
                in[g] = (double)z - (double)sM[g] > sit[g].t;
                p[r][g] = in[g] ? entmax_p_split(z, sM[g], sit[g].t, beta) : 0.f;
                on[r] |= p[r][g] > 0.f;
            }
            fused_count_support<GM>(in, sl == 0, scnt);
            rows += on[r] && sl == 0;
            const int64_t off = on[r] ? slot_offset(A.t, A.kv, NULL, A.cap_pages, k.lrow, k.first,
                                                    k.kvh, A.ps, i)
                                      : 0;
            if (on[r])
                ekv_elem<T>::load8(V + off + sl * 8, v8[r]);
            else
#pragma unroll
                for (int e = 0; e < 8; e++) v8[r][e] = 0.f;
        }
#pragma unroll
        for (int r = 0; r < FUSED_U; r++)
#pragma unroll
            for (int g = 0; g < GM; g++)
#pragma unroll
                for (int e = 0; e < 8; e++) acc[g][e] += p[r][g] * v8[r][e];
    }
    rows = ekv_warp_sum(rows);
    if (lane == 0 && rows)
        atomicAdd(reinterpret_cast<unsigned long long *>(&A.v_rows[k.lrow]), (unsigned long long)rows);
    fused_out<LPR, GM>(A, k, acc, red);
}

/* The kernel: grid (groups x per_group), FUSED_THREADS; D = 8 LPR, groups of G <= GM heads. */
template <typename T, int LPR, int GM>
__global__ void __launch_bounds__(FUSED_THREADS) fused_attend_kernel(fused_args A) {
    ekv_grid_begin();
    constexpr int RED = FUSED_WARPS * GM * 8 * LPR;
    __shared__ __align__(16) float buf[RED > TAU_HIST_BINS ? RED : TAU_HIST_BINS];
    __shared__ double red4[FUSED_WARPS * 4 * GM];
    __shared__ float sM[GM];
    __shared__ tau_iter sit[GM];
    __shared__ int sdone[GM], scnt[GM];
    const fused_block k = fused_block_of(A);
    if (threadIdx.x < GM) scnt[threadIdx.x] = 0;
    fused_count(A, k, sM, reinterpret_cast<unsigned *>(buf));
    group_sync(A.bar + 2 * k.lrow, A.per_group);
    fused_start(A, k, sM, sit, sdone);
    fused_solve<GM>(A, k, sM, sit, sdone, red4, buf);
    fused_clear_hist(A, k);
    fused_values<T, LPR, GM>(A, k, sM, sit, buf, scnt);
    __syncthreads(); /* scnt is complete */
    if (threadIdx.x < A.G) {
        const int64_t row = k.h0 + threadIdx.x;
        if (scnt[threadIdx.x])
            atomicAdd(reinterpret_cast<unsigned long long *>(&A.support[row]),
                      (unsigned long long)scnt[threadIdx.x]);
        if (k.j == 0) {
            A.tau[row] = (double)sM[threadIdx.x] + sit[threadIdx.x].t;
            A.tau_m[row] = sM[threadIdx.x];
            A.tau_t[row] = sit[threadIdx.x].t;
        }
    }
}

/* One cooperative launch of the kernel for (T, LPR, GM): the blocks an SM (occupancy, at most
 * EKV_CUDA_FUSED_PER_SM: more makes each barrier longer) split evenly over the groups. */
template <typename T, int LPR, int GM>
ekv_status launch_fused(ekv_cuda_plan *pl, fused_args &A, int groups) {
    constexpr auto kernel = fused_attend_kernel<T, LPR, GM>;
    static int per_sm = 0; /* asked once per instance */
    if (!per_sm)
        EKV_CUDA_TRY(pl, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                                       FUSED_THREADS, 0));
    if (per_sm < 1)
        return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "fused attend: no block of it fits an SM");
    const int blocks = (per_sm < EKV_CUDA_FUSED_PER_SM ? per_sm : EKV_CUDA_FUSED_PER_SM) * pl->sms;
    A.per_group = blocks / groups;
    void *args[] = {&A};
    EKV_CUDA_TRY(pl, cudaLaunchCooperativeKernel((const void *)kernel, dim3(A.per_group * groups),
                                                 dim3(FUSED_THREADS), args, 0, pl->stream));
    pl->launches++;
    return EKV_OK;
}

/* The ladder of (T, LPR) for the plan's dtype and head dim, GM from the group. */
template <int GM> ekv_status launch_fused_group(ekv_cuda_plan *pl, fused_args &A, int dtype, int groups) {
    if (dtype == EKV_DTYPE_F16)
        return A.D == 64 ? launch_fused<__half, 8, GM>(pl, A, groups)
                         : launch_fused<__half, 16, GM>(pl, A, groups);
    return A.D == 64 ? launch_fused<__nv_bfloat16, 8, GM>(pl, A, groups)
                     : launch_fused<__nv_bfloat16, 16, GM>(pl, A, groups);
}

} // namespace

bool ekv_cuda_fused_attend_applies(const ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                   int dtype, int batch) {
    const int G = pl->p.num_heads / pl->p.num_kv_heads;
    return pl->p.fused_attend && pl->cooperative && prm->alpha > 1.0 && !pl->skip_values &&
           (dtype == EKV_DTYPE_F16 || dtype == EKV_DTYPE_BF16) &&
           (pl->p.head_dim == 64 || pl->p.head_dim == 128) && G <= EKV_CUDA_FUSED_GROUP &&
           (int64_t)batch * pl->p.num_kv_heads <= EKV_CUDA_FUSED_GROUPS;
}

ekv_status ekv_cuda_launch_fused_attend(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                        const ekv_paged_kv *kv, const ekv_page_table *t,
                                        int batch, float *out) {
    fused_args A;
    ekv_cuda_set_shape(A, pl, t);
    A.kv = *kv;
    A.scores = pl->scores;
    A.split_max = pl->split_max;
    A.nsplit = ekv_cuda_step_splits(pl, batch).scores;
    A.split_cap = pl->split_cap;
    A.hist = pl->cand_hist;
    A.alpha = prm->alpha;
    A.tau = pl->tau;
    A.tau_t = pl->tau_t;
    A.tau_m = pl->tau_m;
    A.support = pl->support;
    A.v_rows = pl->v_rows;
    A.out = out;
    A.part = pl->fused_part;
    A.bar = pl->fused_bar;
    A.near = pl->fused_near;
    A.near_count = pl->fused_near_count;
    const int groups = batch * A.Hk;
    return ekv_cuda_with_group(A.G, [&](auto tg) -> ekv_status {
        constexpr int GM = decltype(tg)::value;
        if constexpr (GM <= EKV_CUDA_FUSED_GROUP)
            return launch_fused_group<GM>(pl, A, kv->dtype, groups);
        else
            return ekv_fail(pl->ctx, EKV_ERR_UNSUPPORTED, "fused attend: group %d", A.G);
    });
}
