/*
 * Certified round 0 inside the bound stage (docs/math.md §9.3, "Round 0 on the GPU"): before its
 * pages' bounds, each block of a (sequence, KV head) list computes for every head of the group
 * a lower bound L0 of tau* from the scores of the sequence's last tokens (the last page and the
 * `recent` pages before it, at most RECENT_CAP tokens: any token set's threshold bounds tau*,
 * §9.1). One warp a head: each lane scores up to RECENT_PER_LANE tokens, then a bisection keeps
 * the largest t with F(t) = sum_j [z_j - t]_+^beta >= 1 it has checked, and L0 is that t less
 * the scores' rounding bound, so L0 bounds the tau the scores kernel's own scores give.
 * Every block of a list computes the same L0 (the same loads and sums in the same order), so the
 * blocks agree without a meeting, and the list's first block writes it as round 1's hint. A
 * separate round 0 took four launches (its list, scores, histogram and bound).
 */
#pragma once
#include "scores_common.cuh"
#include "../common/loads.cuh"
#include "../common/reduce.cuh"
#include <math_constants.h>

enum {
    RECENT_PER_LANE = 8,               /* tokens a lane scores at most       */
    RECENT_CAP = 32 * RECENT_PER_LANE, /* tokens of round 0 at most          */
    RECENT_STEPS = 20                  /* bisection steps: within 2^-20 of tau */
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

/* F(t) over the lane's scores, summed over the warp: every lane gets the same sum (the xor
 * butterfly adds each pair alike in both of its lanes), so the lanes' bisections agree. */
__device__ __forceinline__ double recent_mass(const float (&z)[RECENT_PER_LANE], double t,
                                              double beta) {
    double f = 0;
#pragma unroll
    for (int i = 0; i < RECENT_PER_LANE; i++) {
        const double y = (double)z[i] - t; /* -inf for no token */
        if (y > 0) f += beta == 2.0 ? y * y : beta == 1.0 ? y : pow(y, beta);
    }
    return ekv_warp_sum(f);
}

/* Warp-collective: L0 for the query head whose q' (a scale q) is qg (shared, [D]) and whose
 * z-space ALiBi slope is `slope`, from the last n <= RECENT_CAP tokens of sequence sg in KV
 * head kvh. The score is the scores kernel's expression (score_z); its difference from that
 * kernel's own is at most twice the rounding bound of docs/math.md §9.5 (4 (D + 4) u sum_d
 * |q'_d k_d| + 8 u |a m| (|position| + ps)), and tau moves by at most the largest shift of the
 * scores, so L0 = t - that bound. -inf when there is no token. */
__device__ double recent_head_bound(const ekv_paged_kv &kv, const ekv_seq_geom &sg,
                                    const int32_t *indices, int kvh, int D, int ps, const float *qg,
                                    float slope, double beta, int64_t n) {
    const int lane = threadIdx.x & 31;
    const double u24 = 5.9604644775390625e-8;
    float z[RECENT_PER_LANE], m = -CUDART_INF_F;
    double err = 0; /* this lane's largest bound of a score's difference */
#pragma unroll
    for (int i = 0; i < RECENT_PER_LANE; i++) {
        const int64_t j = sg.N - n + lane + 32 * i; /* the token's position */
        z[i] = -CUDART_INF_F;
        if (j >= sg.N) continue;
        const int64_t lp = j / ps;
        const int tt = (int)(j - lp * ps);
        const int64_t off = (int64_t)indices[sg.first + lp] * kv.stride_page +
                            kvh * kv.stride_head + tt * kv.stride_token;
        float dot = 0.f, mag = 0.f;
        for (int c = 0; c < D; c += 8) {
            float k8[8];
            recent_load8(kv, off + c, k8);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                dot = fmaf(qg[c + e], k8[e], dot);
                mag += fabsf(qg[c + e] * k8[e]);
            }
        }
        const int64_t dist = lp * ps - (sg.N - 1);
        z[i] = score_z(dot, slope, (float)dist, tt, true);
        m = fmaxf(m, z[i]);
        /* mag's own rounding: at most D u of it, inside the factor 1 + 1e-5 */
        const double e = 4.0 * (D + 4) * u24 * (double)mag * (1 + 1e-5) +
                         8.0 * u24 * fabs((double)slope) * ((double)llabs(dist) + ps);
        err = fmax(err, 2 * e);
    }
    m = ekv_warp_max(m);
    err = ekv_warp_max(err);
    if (n <= 0) return -CUDART_INF;
    /* tau >= M - 1 always (docs/math.md §9.1); a checked t has F(t) >= 1 beyond F's rounding */
    double lo = (double)m - 1.0, hi = (double)m;
    for (int s = 0; s < RECENT_STEPS; s++) {
        const double mid = 0.5 * (lo + hi);
        if (recent_mass(z, mid, beta) >= 1.0 + 1e-9)
            lo = mid;
        else
            hi = mid;
    }
    return lo - err;
}
