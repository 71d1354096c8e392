/*
 * Certified round 0 on the GPU (docs/math.md §9.3, "Round 0 on the GPU"): for each query head,
 * a lower bound L0 of tau* from the scores of the sequence's last tokens (the last page and the
 * `recent` pages before it, at most RECENT_CAP tokens: any token set's threshold bounds tau*,
 * §9.1), for the bound stage's superpage skip and the select's round 1 (the plan's round0_tau).
 * One block a (sequence, KV head), one warp a head: each lane scores up to RECENT_PER_LANE
 * tokens, then a bisection keeps the largest t it has checked with F(t) = sum_j [z_j - t]_+^beta
 * >= 1, and L0 is that t less the scores' rounding bound, so that L0 bounds the tau of the
 * scores kernel's own scores. One launch, where round 0 took four (its page list, scores,
 * histogram and bound); computed instead by every block of the bound stage it made that stage
 * 25 us slower at 256K tokens (bench/RESULTS.md).
 */
#include "round0.cuh"
#include "../common/launch.cuh"
#include "../common/plan.cuh"
#include "../common/splits.cuh"
#include "scores_common.cuh"
#include "../common/loads.cuh"
#include "../common/reduce.cuh"
#include <math_constants.h>

namespace {

enum {
    RECENT_PER_LANE = 8,               /* tokens a lane scores at most         */
    RECENT_CAP = 32 * RECENT_PER_LANE, /* tokens of round 0 at most            */
    RECENT_STEPS = 14,                 /* bisection steps: within 2^-14 of tau */
    ROUND0_THREADS = 256
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

struct round0_args : ekv_cuda_shape {
    ekv_paged_kv kv;
    const float *q, *slopes;
    double qscale, a;
    int recent; /* pages before the last */
    double *lb; /* [B*H] the bounds (the plan's round0_tau) */
};

__global__ void __launch_bounds__(ROUND0_THREADS) round0_kernel(round0_args A) {
    ekv_grid_begin();
    extern __shared__ float qs[]; /* [G][D] q' = a scale q, as the scores kernel forms it */
    const int row = blockIdx.x, b = row / A.Hk, kvh = row % A.Hk;
    const int64_t h0 = (int64_t)b * A.H + (int64_t)kvh * A.G;
    for (int i = threadIdx.x; i < A.G * A.D; i += blockDim.x)
        qs[i] = (float)(A.qscale * A.q[h0 * A.D + i]);
    __syncthreads();
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const int64_t n = recent_tokens(sg, A.ps, A.recent);
    for (int g = threadIdx.x >> 5; g < A.G; g += ROUND0_THREADS / 32) {
        const float slope = A.slopes ? (float)A.a * A.slopes[kvh * A.G + g] : 0.f;
        const double l = recent_head_bound(A.kv, sg, A.t.indices, kvh, A.D, A.ps, qs + g * A.D,
                                           slope, 1.0 / A.a, n);
        if ((threadIdx.x & 31) == 0) A.lb[h0 + g] = l;
    }
}

} // namespace

ekv_status ekv_cuda_launch_round0(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                  const ekv_paged_kv *kv, const ekv_page_table *t, const float *q,
                                  int batch, int recent) {
    round0_args A;
    ekv_cuda_set_shape(A, pl, t);
    ekv_cuda_set_query(A, prm, kv->head_dim, q);
    A.kv = *kv;
    A.recent = recent;
    A.lb = pl->round0_tau;
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
