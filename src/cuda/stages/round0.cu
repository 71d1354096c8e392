/*
 * Certified round 0 on the GPU (docs/math.md §9.3, "Round 0 on the GPU"): for each query head,
 * a lower bound L0 of tau* from the scores of the sequence's last tokens (the last page and the
 * `recent` pages before it, at most RECENT_CAP tokens: any token set's threshold bounds tau*,
 * §9.1), for the bound stage's superpage skip and the select's round 1 (the plan's round0_tau).
 * One block a (sequence, KV head): the block scores the tokens for the group's heads
 * (recent_scores, each key loaded once), then one warp a head solves for the largest t it can
 * check with F(t) = sum_j [z_j - t]_+^beta >= 1, and L0 is that t less the scores' rounding
 * bound, so that L0 bounds the tau of the scores kernel's own scores (recent_bound). One
 * launch, where round 0 took four (its page list, scores, histogram and bound); computed instead by
 * every block of the bound stage it made that stage 25 us slower at 256K tokens (bench/RESULTS.md).
 */
#include "round0.cuh"
#include "../common/launch.cuh"
#include "../common/plan.cuh"
#include "../common/splits.cuh"
#include "../common/lists.cuh"
#include "scores_common.cuh"
#include "../common/loads.cuh"
#include "../common/reduce.cuh"
#include <math_constants.h>

namespace {

enum {
    RECENT_PER_LANE = 8,               /* scores a lane sums in the solve       */
    RECENT_CAP = 32 * RECENT_PER_LANE, /* tokens of round 0 at most            */
    RECENT_STEPS = 14,                 /* bisection steps (beta < 1): within 2^-14 of tau */
    RECENT_NEWTON = 12,                /* Newton steps at most (beta >= 1)      */
    RECENT_PASSES = 8,                 /* block passes whose loads are in flight together */
    ROUND0_THREADS = 256,
    ROUND0_HEADS = ROUND0_THREADS / 32 /* heads scored together: one warp a head solves */
};

/* The tokens round 0 scores: the last page's and `recent` full pages' before it, at most
 * RECENT_CAP (the last ones). */
__device__ __forceinline__ int64_t recent_tokens(const ekv_seq_geom &sg, int ps, int recent) {
    if (sg.N <= 0) return 0;
    const int64_t n = sg.N - (sg.P - 1) * ps + (int64_t)recent * ps;
    const int64_t m = n < sg.N ? n : sg.N;
    return m < RECENT_CAP ? m : RECENT_CAP;
}

/* 8 consecutive elements of K from element offset off, as fp32, for K of any storage type. */
__device__ __forceinline__ void recent_load8(const ekv_paged_kv &kv, int64_t off, float *o) {
    if (kv.dtype == EKV_DTYPE_F16)
        ekv_elem<__half>::load8(static_cast<const __half *>(kv.k) + off, o);
    else if (kv.dtype == EKV_DTYPE_BF16)
        ekv_elem<__nv_bfloat16>::load8(static_cast<const __nv_bfloat16 *>(kv.k) + off, o);
    else
        ekv_elem<float>::load8(static_cast<const float *>(kv.k) + off, o);
}

/* F(t) = sum_j [z_j - t]_+^beta and -F'(t) over the lane's scores, each summed over the warp:
 * every lane gets the same sums (the xor butterfly adds each pair alike in both of its lanes),
 * so the lanes' solves agree. */
__device__ __forceinline__ void recent_mass(const float (&z)[RECENT_PER_LANE], double t,
                                            double beta, double *f, double *slope) {
    double fs = 0, ds = 0;
#pragma unroll
    for (int i = 0; i < RECENT_PER_LANE; i++) {
        const double y = (double)z[i] - t; /* -inf for no token */
        if (y > 0) {
            const double p = beta == 2.0 ? y : beta == 1.0 ? 1.0 : pow(y, beta - 1.0);
            fs += p * y;
            ds += beta * p;
        }
    }
    *f = ekv_warp_sum(fs);
    *slope = ekv_warp_sum(ds);
}

/* The block's scores of the last n <= RECENT_CAP tokens of sequence sg in KV head kvh for the
 * gc <= ROUND0_HEADS query heads whose q' (a scale q) are qg (shared, [gc][D]) and whose z-space
 * ALiBi slopes are a slopes[g] (0 without slopes), into zs[g][token] (shared), and each score's
 * bound of its difference from the scores kernel's, rounded up to float, into es[g][token]. The
 * score is that kernel's expression (score_z); the difference is at most twice the rounding bound
 * of docs/math.md §9.5 (4 (D + 4) u sum_d |q'_d k_d| + 8 u |a m| (|position| + ps)). A key is split
 * over `lpt` lanes (its 16-byte chunks) and loaded once for every head; the block's
 * RECENT_PASSES passes' page indices, then their keys' first chunks, are all in flight before
 * any sum: with one warp a head, each scoring its tokens in turn, the dependent loads (index,
 * then key) waited on each other (15-28 us a launch under ncu on the model's trace,
 * bench/RESULTS.md). */
__device__ void recent_scores(const ekv_paged_kv &kv, const ekv_seq_geom &sg,
                              const int32_t *indices, int kvh, int D, int ps, const float *qg,
                              const float *slopes, float a, int gc, int64_t n,
                              float (*zs)[RECENT_CAP], float (*es)[RECENT_CAP]) {
    const int C = D / 8;
    int lpt = 1;
    while (lpt * 2 <= C && lpt < 32) lpt *= 2;
    const int tpb = ROUND0_THREADS / lpt, sub = threadIdx.x % lpt, grp = threadIdx.x / lpt;
    const double u24 = 5.9604644775390625e-8;
    for (int64_t p0 = 0; p0 * tpb < n; p0 += RECENT_PASSES) {
        /* passes holding a token (block-uniform): the others' sums and shuffles were most of
         * the kernel's instructions at the model's 64 tokens (2 of 8 passes) */
        const int64_t left = (n - p0 * tpb + tpb - 1) / tpb;
        const int np = left < RECENT_PASSES ? (int)left : RECENT_PASSES;
        int64_t off[RECENT_PASSES];
#pragma unroll
        for (int u = 0; u < RECENT_PASSES; u++) {
            const int64_t jl = (p0 + u) * tpb + grp; /* the token, counted from N - n */
            off[u] = -1;
            if (jl >= n) continue;
            const int64_t j = sg.N - n + jl, lp = j / ps;
            off[u] = (int64_t)indices[sg.first + lp] * kv.stride_page + kvh * kv.stride_head +
                     (j - lp * ps) * kv.stride_token;
        }
        float k8[RECENT_PASSES]
                [8]; /* each pass's first chunk (sub < lpt <= C: every lane has one) */
#pragma unroll
        for (int u = 0; u < RECENT_PASSES; u++)
            if (off[u] >= 0) recent_load8(kv, off[u] + 8 * sub, k8[u]);
        for (int g = 0; g < gc; g++) {
            const float *qh = qg + g * D;
            const float sl = slopes ? a * slopes[g] : 0.f;
#pragma unroll
            for (int u = 0; u < RECENT_PASSES; u++) {
                if (u >= np) break;
                float dot = 0.f, mag = 0.f;
                if (off[u] >= 0) {
#pragma unroll
                    for (int e = 0; e < 8; e++) {
                        dot = fmaf(qh[8 * sub + e], k8[u][e], dot);
                        mag += fabsf(qh[8 * sub + e] * k8[u][e]);
                    }
                    for (int c = sub + lpt; c < C; c += lpt) { /* D > 256 or C not 2^k */
                        float kx[8];
                        recent_load8(kv, off[u] + 8 * c, kx);
#pragma unroll
                        for (int e = 0; e < 8; e++) {
                            dot = fmaf(qh[8 * c + e], kx[e], dot);
                            mag += fabsf(qh[8 * c + e] * kx[e]);
                        }
                    }
                }
                for (int o = 1; o < lpt; o <<= 1) { /* within the token's lanes */
                    dot += __shfl_xor_sync(0xffffffffu, dot, o);
                    mag += __shfl_xor_sync(0xffffffffu, mag, o);
                }
                const int64_t jl = (p0 + u) * tpb + grp;
                if (sub != 0 || jl >= n) continue;
                const int64_t j = sg.N - n + jl, lp = j / ps, dist = lp * ps - (sg.N - 1);
                zs[g][jl] = score_z(dot, sl, (float)dist, (int)(j - lp * ps), true);
                /* mag's own rounding: a few dozen u of it (the lanes' sums, then their tree),
                 * inside the factor 1 + 1e-5 */
                const double e = 4.0 * (D + 4) * u24 * (double)mag * (1 + 1e-5) +
                                 8.0 * u24 * fabs((double)sl) * ((double)llabs(dist) + ps);
                es[g][jl] = __double2float_ru(2 * e);
            }
        }
    }
    for (int i = threadIdx.x; i < gc * RECENT_CAP; i += ROUND0_THREADS)
        if (i % RECENT_CAP >= n) {
            zs[i / RECENT_CAP][i % RECENT_CAP] = -CUDART_INF_F;
            es[i / RECENT_CAP][i % RECENT_CAP] = 0.f;
        }
}

/* The largest t the solve checks with F(t) >= 1 beyond F's rounding, from t = M - 1 (tau >=
 * M - 1 always, docs/math.md §9.1, so it needs no check). For beta >= 1 F is convex and
 * decreasing on [M - 1, M], so Newton's steps towards F = 1 + 2e-9 from the left never pass
 * that root: 4-9 steps, each checked, stop when a step is below 1e-12 (the bisection took 14
 * steps to come within 2^-14). For beta < 1 F is concave there and Newton's steps can pass
 * tau: those bisect. */
__device__ double recent_solve(const float (&z)[RECENT_PER_LANE], double m, double beta) {
    double lo = m - 1.0, f, slope;
    if (beta >= 1.0) {
        double t = lo;
        for (int s = 0; s < RECENT_NEWTON; s++) {
            recent_mass(z, t, beta, &f, &slope);
            if (!(f >= 1.0 + 1e-9)) break; /* t not checked: lo stays */
            lo = t;
            const double step = (f - (1.0 + 2e-9)) / slope;
            if (!(step > 1e-12)) break;
            t += step;
        }
        return lo;
    }
    double hi = m;
    for (int s = 0; s < RECENT_STEPS; s++) {
        const double mid = 0.5 * (lo + hi);
        recent_mass(z, mid, beta, &f, &slope);
        if (f >= 1.0 + 1e-9)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* Warp-collective: L0 from one head's scores z (recent_scores; e their difference bounds): a t
 * recent_solve checked is at most tau of these scores, and tau moves by at most the largest
 * shift of the scores, so L0 = t - max e. -inf when there is no token. */
__device__ double recent_bound(const float *zs, const float *es, double beta, int64_t n) {
    if (n <= 0) return -CUDART_INF;
    float z[RECENT_PER_LANE], m = -CUDART_INF_F, err = 0.f;
#pragma unroll
    for (int i = 0; i < RECENT_PER_LANE; i++) {
        z[i] = zs[(threadIdx.x & 31) + 32 * i];
        m = fmaxf(m, z[i]);
        err = fmaxf(err, es[(threadIdx.x & 31) + 32 * i]);
    }
    m = ekv_warp_max(m);
    err = ekv_warp_max(err);
    /* a score that overflowed makes M or err infinite: no bound then (nothing skipped) */
    if (!isfinite(m) || !isfinite(err)) return -CUDART_INF;
    return recent_solve(z, (double)m, beta) - (double)err;
}

struct round0_args : ekv_cuda_shape {
    ekv_paged_kv kv;
    const float *q, *slopes;
    double qscale, a;
    int recent; /* pages before the last */
    double *lb; /* [B*H] the bounds (the plan's round0_tau) */
    int32_t *counts; /* the KV-head lists' counts [B*Hk][2], zeroed for the bound stage's
                        hinted lists, or NULL */
};

/* One block a (sequence, KV head): the block scores the recent tokens for up to ROUND0_HEADS
 * heads of the group at once, then one warp a head solves (recent_bound). */
__global__ void __launch_bounds__(ROUND0_THREADS) round0_kernel(round0_args A) {
    ekv_grid_begin();
    extern __shared__ float qs[]; /* [G][D] q' = a scale q, as the scores kernel forms it */
    __shared__ float zbuf[ROUND0_HEADS][RECENT_CAP], ebuf[ROUND0_HEADS][RECENT_CAP];
    const int row = blockIdx.x, b = row / A.Hk, kvh = row % A.Hk;
    const int64_t h0 = (int64_t)b * A.H + (int64_t)kvh * A.G;
    if (A.counts && threadIdx.x < 2) A.counts[2 * row + threadIdx.x] = 0;
    ekv_group_query(A.q + h0 * A.D, A.qscale, A.G * A.D, qs);
    __syncthreads();
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const int64_t n = recent_tokens(sg, A.ps, A.recent);
    const int w = threadIdx.x >> 5;
    for (int g0 = 0; g0 < A.G; g0 += ROUND0_HEADS) {
        const int gc = A.G - g0 < ROUND0_HEADS ? A.G - g0 : ROUND0_HEADS;
        const float *slopes = A.slopes ? A.slopes + kvh * A.G + g0 : NULL;
        recent_scores(A.kv, sg, A.t.indices, kvh, A.D, A.ps, qs + g0 * A.D, slopes, (float)A.a, gc,
                      n, zbuf, ebuf);
        __syncthreads();
        if (w < gc) {
            const double l = recent_bound(zbuf[w], ebuf[w], 1.0 / A.a, n);
            if ((threadIdx.x & 31) == 0) A.lb[h0 + g0 + w] = l;
        }
        __syncthreads(); /* the scores read before the next heads' */
    }
}

} // namespace

ekv_status ekv_cuda_launch_round0(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                  const ekv_paged_kv *kv, const ekv_page_table *t, const float *q,
                                  int batch, int recent, int zero_lists) {
    round0_args A;
    ekv_cuda_set_shape(A, pl, t);
    ekv_cuda_set_query(A, prm, kv->head_dim, q);
    A.kv = *kv;
    A.recent = recent;
    A.lb = pl->round0_tau;
    A.counts = zero_lists ? ekv_cuda_lists_of(pl, 0).count : NULL;
    const size_t sm = (size_t)A.G * A.D * sizeof(float);
    return ekv_cuda_launch(pl, round0_kernel, dim3((unsigned)(batch * A.Hk)), ROUND0_THREADS, sm,
                           A);
}

/* Certified round 0's lower bounds of tau of the plan's last step with superpage boxes
 * ([batch * num_heads], z-space), copied to the host. Internal, for the GPU tests (each at
 * most the step's tau); synchronises the plan's stream. */
extern "C" EKV_API ekv_status ekv_cuda_round0_bounds(ekv_cuda_plan *pl, int32_t batch,
                                                     double *out) {
    return ekv_cuda_read_head_rows(pl, batch, out, pl ? pl->round0_tau : NULL,
                                   (int64_t)sizeof(double));
}
