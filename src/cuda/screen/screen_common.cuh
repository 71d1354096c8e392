/*
 * The screen's pieces shared by its kernels (docs/math.md §10.2-§10.3): the CUDA-core kernels
 * (screen.cu: the fast quarter-warp kernel and the generic warp per page) and the tensor-core
 * kernel (screen_mma.cu). All of them bound the same tokens with the same channel terms, keep
 * candidates by the same rule and write the same lists, so the later kernels cannot tell which
 * one ran.
 */
#pragma once
#include "../common/loads.cuh"
#include "../common/plan.cuh"
#include "../common/ranges.cuh"
#include "../common/reduce.cuh"
#include "../common/sizes.cuh"
#include "../../core/codes.h"
#include <math_constants.h>

/* The screen kernels' arguments (screen.cu sets them, every screen kernel reads them). */
struct screen_args : ekv_cuda_shape {
    ekv_cuda_ranges rng; /* kmin/kmax as stored: fp32 or compact */
    const uint8_t *codes;
    const float *q, *slopes;
    double qscale; /* a * scale, as the score kernels form q' */
    float a;
    int64_t scap;       /* candidates kept per query head */
    uint32_t *lkey;     /* [B*H] ordered key of the largest l published */
    uint32_t *scount;   /* [B*H] candidates found (may exceed scap: overflow) */
    uint32_t *acount;   /* the count appended to: scount, or the retry's count */
    int pass2;          /* the retry pass: only heads whose first list overflowed */
    double *fsum;       /* [B*H][EKV_SCREEN_GRID] the retry's F, zeroed by the first pass */
    float *scl, *scu;   /* [B*H][scap] */
    int32_t *sct;       /* [B*H][scap] */
    int64_t *survivors; /* [B*Hk] zeroed here for the tau(l) kernel */
    uint32_t *dropped;  /* [B*Hk] pages the page box dropped (the fast kernel's, screen.cu) */
    int sbase;          /* splits per row of a uniform batch (ekv_seq_splits), set at launch */
};

namespace {

#define SCREEN_U  0x1p-24f  /* fp32 unit roundoff                                    */
#define SCREEN_NU 0x1p-140f /* the underflow floor per channel (docs/math.md §10.2) */

/* The bounds of one token for one head from its centre sum zc = C0 + sum_c w'_c code_c, e the
 * page's half-width, bias slope (jpos + ts) as the score kernels form it (docs/math.md §10.2). */
__device__ __forceinline__ void token_bounds(float zc, float e, float slope, float jpos, int ts,
                                             int ok, float *l, float *u) {
    *l = -CUDART_INF_F;
    *u = CUDART_INF_F;
    if (!ok) return;
    const float z = zc + slope * (jpos + (float)ts);
    const float E = e + 8.0f * SCREEN_U * (fabsf(z) + e);
    const float lo = z - E, d = E * (2.0f + 0x1p-21f);
    if (!(lo - lo == 0.f) || !(d - d == 0.f)) return; /* overflow or NaN: keep the token */
    *l = lo;
    *u = __fadd_ru(lo, d);
}

/* The block's extra floor of the keep test per head of the group: -inf in the first pass; in
 * the retry pass the head's retry threshold, or +inf for a head that does not retry. */
__shared__ float screen_cut[EKV_CUDA_MAX_GROUP];

/* Grid point k of the retry: t_k = M - 1 + k / EKV_SCREEN_GRID (double, the same everywhere). */
__device__ __forceinline__ double retry_t(float M, int k) {
    return ((double)M - 1.0) + (double)k * (1.0 / EKV_SCREEN_GRID);
}

/* The retry threshold of head h (+inf when its first list did not overflow): the largest t_k
 * whose F over the kept l exceeds 1 by far more than its rounding (so t_k < tau of the kept l
 * <= tau(l)), else M - 1 (Claim 3); lowered by the solve's tolerance and rounded down to fp32
 * (docs/math.md §10.3). */
__device__ __forceinline__ float retry_cut(const screen_args &A, int64_t h) {
    if (A.scount[h] <= A.scap) return CUDART_INF_F;
    const float M = ekv_key_float(A.lkey[h]);
    double t = (double)M - 1.0;
    for (int k = EKV_SCREEN_GRID - 1; k > 0; k--)
        if (A.fsum[h * EKV_SCREEN_GRID + k] > 1.0 + 1e-6) {
            t = retry_t(M, k);
            break;
        }
    t -= 1e-12 * (1.0 + fabs(t));
    return __double2float_rd(t);
}

/* Appends token tok of head hrow with its bounds where take (one atomic per warp). Warp-uniform
 * call. */
__device__ __forceinline__ void screen_append(const screen_args &A, int64_t hrow, bool take,
                                              float l, float u, int64_t tok) {
    const uint32_t at = ekv_warp_append(take, A.acount + hrow);
    if (take && at < A.scap) {
        A.scl[hrow * A.scap + at] = l;
        A.scu[hrow * A.scap + at] = u;
        A.sct[hrow * A.scap + at] = (int32_t)tok;
    }
}

/* Whether a token (where on) of head g of the block's group with upper bound u is kept: u > M' -
 * 1 and u > screen_cut[g] (a bound that is not a number keeps it). */
__device__ __forceinline__ bool screen_keeps(int g, bool on, float u, float Mp) {
    const double cut = fmax((double)Mp - 1.0, (double)screen_cut[g]);
    return on && !((double)u <= cut);
}

/* Keeps token tok of head hrow (head g of the block's group) where screen_keeps. Warp-uniform
 * call. */
__device__ __forceinline__ void screen_emit(const screen_args &A, int64_t hrow, int g, bool on,
                                            float l, float u, float Mp, int64_t tok) {
    screen_append(A, hrow, screen_keeps(g, on, u, Mp), l, u, tok);
}

/* N tokens a lane (tok[i]) of the G heads h0 + g: those kept (m[i][g], the ballots of
 * screen_keeps) appended with their bounds (l, u) to the heads' lists in token order, each
 * head's places by one atomic, the heads' atomics in flight together (screen_emit a token and
 * head made a chunk wait on N G round trips). Warp-uniform call. */
template <int N, int GM>
__device__ __forceinline__ void
screen_append_pass(const screen_args &A, int64_t h0, int G, const unsigned (&m)[N][GM],
                   const float (&l)[N][GM], const float (&u)[N][GM], const int64_t (&tok)[N]) {
    const int lane = threadIdx.x & 31;
    uint32_t first[GM];
    ekv_warp_reserve_ballots<N, GM>(A.acount + h0, G, m, first);
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= G) break;
        uint32_t at = first[g];
        const int64_t hrow = h0 + g;
#pragma unroll
        for (int i = 0; i < N; i++) {
            const uint32_t pos = at + (uint32_t)ekv_lane_rank(m[i][g]);
            if (((m[i][g] >> lane) & 1u) && pos < A.scap) {
                A.scl[hrow * A.scap + pos] = l[i][g];
                A.scu[hrow * A.scap + pos] = u[i][g];
                A.sct[hrow * A.scap + pos] = (int32_t)tok[i];
            }
            at += (uint32_t)__popc(m[i][g]);
        }
    }
}

/* One level of the reduce-scatter: lanes with up keep the upper H values, the others the lower
 * H, each adding its partner's (lane ^ o) copy of them; the kept values move to v[0 .. H). */
template <int H> __device__ __forceinline__ void scatter_level(float *v, bool up, int o) {
#pragma unroll
    for (int i = 0; i < H; i++) {
        const float send = up ? v[i] : v[i + H], keep = up ? v[i + H] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
}

/* The relative error, per unit of w' times the largest code, of w' held in SPLIT f16 parts
 * (the tensor-core screen, docs/math.md §10.2 "On tensor cores"): 2^-11 per part. */
template <int BITS, int SPLIT> __host__ __device__ constexpr float split_rel() {
    return (float)((1 << BITS) - 1) * (SPLIT == 1 ? 0x1p-11f : 0x1p-22f);
}

/* The channel terms of channel c (docs/math.md §10.2, version 1's): the code weights w' of the
 * group's heads, and C0 and e summed into c0 and ep. SPLIT > 0 (the tensor-core screen, w' in
 * SPLIT f16 parts) widens W_c by that split's error, split_rel s_c. */
template <int GM, int BITS, int SPLIT = 0>
__device__ __forceinline__ void channel_terms(const float *qs, int D, int G, int c, float mn,
                                              float mx, float gamma, float *wq, float *c0,
                                              float *ep, int &ok) {
    const float s = ekv_code_step(mn, mx, BITS), Ac = fmaxf(fabsf(mn), fabsf(mx));
    const float mid = mn + 0.5f * s;
    ok &= (s - s == 0.f) & (mid - mid == 0.f);
    float w;
    if constexpr (SPLIT == 0)
        w = (0.5f * s + 6.0f * SCREEN_U * Ac + 2.0f * gamma * (4.0f * Ac + s)) * (1.0f + 0x1p-20f) +
            SCREEN_NU;
    else
        w = (0.5f * s + 6.0f * SCREEN_U * Ac + 2.0f * gamma * (4.0f * Ac + s) +
             split_rel<BITS, SPLIT>() * s) *
                    (1.0f + 0x1p-20f) +
            SCREEN_NU;
#pragma unroll
    for (int g = 0; g < GM; g++) {
        const float qv = g < G ? qs[g * D + c] : 0.f;
        wq[g] = qv * s;
        c0[g] += qv * mid;
        ep[g] += fabsf(qv) * w;
    }
}

/* e of one head in double from the fp32 sum of |q'_c| W_c: (1 + 2 gamma) for that sum, the D
 * underflow floors and 2 E_p = 16 u |a m_h| (|p ps - (N-1)| + ps) for the ALiBi terms. */
__device__ __forceinline__ float page_e(float ep, int D, float slope, int64_t p, int ps,
                                        int64_t N) {
    const double gd = 4.0 * (double)(D + 4) * 0x1p-24;
    const double pos = (double)llabs(p * ps - (N - 1)) + (double)ps;
    const double e = (double)ep * (1.0 + 2.0 * gd) + (double)D * 0x1p-140 +
                     16.0 * 0x1p-24 * (1.0 + 0x1p-20) * fabs((double)slope) * pos;
    return __double2float_ru(e);
}

/* Brings bytes [0, n) at p into L2, the 8 lanes of a quarter one 128-byte line each per pass. */
__device__ __forceinline__ void prefetch_quarter(const void *p, int64_t n, int q) {
    for (int64_t o = (int64_t)q * 128; o < n; o += 8 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)p + o));
}

/* The step's per-block prologue: q' of the group into shared memory ([G][D]) and the keep
 * floors (screen_cut); block 0 of the row zeroes the survivor count and, in the first pass,
 * the retry's sums. Returns false when the block has nothing to do (a retry pass with no head
 * of the group retrying): block-uniform. */
__device__ __forceinline__ bool screen_prologue(const screen_args &A, int split, int row, int b,
                                                int kvh, float *qs) {
    const int64_t h0 = (int64_t)b * A.H + kvh * A.G;
    if (split == 0 && threadIdx.x == 0) A.survivors[row] = 0;
    if (split == 0 && !A.pass2)
        for (int i = threadIdx.x; i < A.G * EKV_SCREEN_GRID; i += blockDim.x)
            A.fsum[h0 * EKV_SCREEN_GRID + i] = 0.0;
    if (threadIdx.x < A.G)
        screen_cut[threadIdx.x] = A.pass2 ? retry_cut(A, h0 + threadIdx.x) : -CUDART_INF_F;
    ekv_group_query(A.q + h0 * A.D, A.qscale, A.G * A.D, qs);
    __syncthreads();
    bool any = !A.pass2;
    for (int g = 0; g < A.G; g++) any |= screen_cut[g] < CUDART_INF_F;
    return any;
}

} // namespace

/* The screen kernels, chosen in one place (screen_kernel_of in screen.cu; the plan records the
 * choice, ekv_cuda_screen_kernel reads it back). */
enum { EKV_SCREEN_GENERIC = 0, EKV_SCREEN_FAST = 1, EKV_SCREEN_MMA = 2 };

/* The screen on tensor cores (screen_mma.cu): whether it serves a group of G heads with head dim
 * D and page size ps, and its launch (one pass, the first or the retry). */
bool ekv_cuda_screen_mma_applies(int G, int D, int ps);
cudaError_t ekv_cuda_screen_mma(const screen_args &A, int code_bits, int sms, int rows,
                                const ekv_launch_stream &s);
