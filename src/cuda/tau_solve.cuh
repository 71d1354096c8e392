/*
 * The entmax threshold solver of the GPU backend (docs/math.md §0, §9.8): tau - M over a set
 * of scores (candidates or a whole row) with M their max, one block. Shared by the attend
 * stage's tau kernel (attend_tau.cu) and the screen's tau of the lower bounds (screen.cu).
 */
#pragma once
#include "cuda_internal.cuh"

namespace {

/* Sums over the candidates y = z - M > tau' (tau' relative to M), one block reduction */
struct tau_sums {
    double n, s1, s2, mn;
};

__device__ tau_sums cand_sums(const float *v, int64_t n, float M, double t, double *scratch) {
    double c = 0, s1 = 0, s2 = 0, mn = 1e300;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const double y = (double)v[i] - (double)M;
        if (y > t) {
            c += 1;
            s1 += y;
            s2 += y * y;
            mn = y < mn ? y : mn;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    c = ekv_warp_sum(c);
    s1 = ekv_warp_sum(s1);
    s2 = ekv_warp_sum(s2);
    mn = ekv_warp_min(mn);
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
__device__ void cand_newton(const float *v, int64_t n, float M, double t, double beta,
                            double *scratch, double *F, double *Fp) {
    double f = 0, fp = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const double y = (double)v[i] - (double)M - t;
        if (y > 0) {
            const double pb1 = pow(y, beta - 1.0);
            f += pb1 * y;
            fp += pb1;
        }
    }
    *F = ekv_block_sum(f, scratch) - 1.0;
    *Fp = -beta * ekv_block_sum(fp, scratch);
}

/* tau - M over the values v[0..n) (candidates or a whole score row) for entmax alpha > 1 */
__device__ double solve_tau(const float *v, int64_t n, float M, double alpha, double *scratch) {
    const double beta = 1.0 / (alpha - 1.0);
    double t = -1.0; /* F(-1) >= 0 because the max alone gives 1 */
    if (alpha == 2.0) {
        /* Michelot: the closed form over a superset of the support is a lower bound of tau */
        double prev_n = -1;
        for (int it = 0; it < 200; it++) {
            const tau_sums s = cand_sums(v, n, M, t, scratch);
            const double tn = (s.s1 - 1.0) / s.n;
            if (s.n == prev_n || !(tn > t)) {
                t = tn > t ? tn : t;
                break;
            }
            prev_n = s.n;
            t = tn;
        }
    } else if (alpha == 1.5) {
        /* Newton from the left (monotone, F convex) on F = sum (y-t)^2 - 1; the closed form on
         * the current support is exact as soon as it keeps that support */
        for (int it = 0; it < 100; it++) {
            const tau_sums s = cand_sums(v, n, M, t, scratch);
            const double disc = s.s1 * s.s1 - s.n * (s.s2 - 1.0);
            const double tc = (s.s1 - sqrt(disc > 0 ? disc : 0.0)) / s.n;
            if (tc >= t && s.mn > tc) {
                t = tc;
                break;
            }
            const double F = s.s2 - 2.0 * t * s.s1 + s.n * t * t - 1.0,
                         Fp = -2.0 * (s.s1 - s.n * t);
            const double tn = t - F / Fp;
            if (!(tn > t)) break;
            t = tn;
        }
    } else {
        /* safeguarded Newton inside the bracket [lo, hi] */
        double lo = -1.0, hi = 0.0;
        for (int it = 0; it < 200; it++) {
            double F, Fp;
            cand_newton(v, n, M, t, beta, scratch, &F, &Fp);
            if (F > 0)
                lo = t;
            else
                hi = t;
            if (F == 0 || hi - lo <= 1e-15 * (1.0 + fabs(t))) break;
            double tn = Fp < 0 ? t - F / Fp : 0.5 * (lo + hi);
            if (!(tn > lo && tn < hi)) tn = 0.5 * (lo + hi);
            t = tn;
        }
    }
    return t;
}

} // namespace
