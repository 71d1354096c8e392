/*
 * bound stage on the GPU (mirrors src/cpu/bound.c; docs/math.md §2.3, 9.5): an upper bound of every
 * page's z-space scores but the last, per query head, and its max over the GQA group (the
 * key that ranks pages for a KV-head list). One warp per (page, KV head); the page's
 * summaries (kmin, kmax and, with the ball, kmean and the radius) are read once for the G
 * query heads of the group.
 *   box  = sum_d max(q'_d kmin_d, q'_d kmax_d),   q' = a scale q
 *   ball = <q', c> + ||q'|| r
 *   U    = min(box, ball) + slack + bonus  (with the ball; box + bonus without it)
 * The slack is the CPU's: 4 (D + 4) 2^-24 ||q'|| (||c|| + r) + 8 2^-24 |a m_h| (|p ps - i| + ps),
 * which covers the rounding of this pass and of the score kernel in any summation order,
 * so U bounds the *computed* scores and certified decode stays exact.
 */
#include "cuda_internal.cuh"
#include <math_constants.h>

namespace {

struct bound_args : ekv_cuda_shape {
    ekv_page_stats st;
    ekv_cuda_ranges rng; /* kmin/kmax as stored: fp32 or compact */
    const float *q, *slopes;
    double qscale, a;
    int with_ball, rows;
    float *bounds, *list_bounds;
};

enum {
    BOUND_WARPS = EKV_CUDA_THREADS / 32,
    BOUND_PAGES = 128
}; /* pages per block: the q setup is amortised */

/* Brings a page's summaries (min, max, and the mean for the ball) into L2. */
__device__ __forceinline__ void prefetch_summaries(const bound_args &A, int64_t phys, int kvh,
                                                   int lane) {
    const int64_t sn = (phys * A.Hk + kvh) * A.D;
    for (int d = lane * 4; d < A.D; d += 128) {
        if (d * A.rng.elem % 128 == 0) { /* one per 128-byte line */
            asm volatile("prefetch.global.L2 [%0];" ::"l"(ekv_range_addr(A.rng, false, sn + d)));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(ekv_range_addr(A.rng, true, sn + d)));
        }
        if (A.with_ball) asm volatile("prefetch.global.L2 [%0];" ::"l"(A.st.kmean + sn + d));
    }
}

template <int GM, int RT> /* compile-time bound of the group size; how the ranges are stored */
__global__ void __launch_bounds__(EKV_CUDA_THREADS) bound_kernel(bound_args A) {
    extern __shared__ float qs[]; /* [G][D] q' */
    __shared__ double qn[GM];
    /* one-dimensional grid, the list row fastest: the blocks in flight together read the same
     * pages for every KV head, which are adjacent in the summary arrays ([page][kv head][D]) */
    const int nrows = A.rows, row = (int)(blockIdx.x % nrows), b = row / A.Hk, kvh = row % A.Hk,
              G = A.G, D = A.D, ps = A.ps;
    const int64_t chunk = blockIdx.x / nrows;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        qs[i] = (float)(A.qscale * A.q[((int64_t)b * A.H + kvh * G + g) * D + d]);
    }
    __syncthreads();
    for (int g = warp; g < G; g += BOUND_WARPS) { /* ||q'|| in double, rounded up */
        double s = 0;
        for (int d = lane; d < D; d += 32) s += (double)qs[g * D + d] * qs[g * D + d];
        s = ekv_warp_sum(s);
        if (lane == 0) qn[g] = sqrt(s) * (1 + 1e-12);
    }
    __syncthreads();
    const int64_t pend =
            (chunk + 1) * BOUND_PAGES < A.cap_pages ? (chunk + 1) * BOUND_PAGES : A.cap_pages;
    for (int64_t p = chunk * BOUND_PAGES + warp; p < pend; p += BOUND_WARPS) {
        if (p >= sg.P - 1) { /* the last page and beyond: not ranked */
            if (lane < G)
                A.bounds[((int64_t)b * A.H + kvh * G + lane) * A.cap_pages + p] = -CUDART_INF_F;
            if (lane == 0) A.list_bounds[(int64_t)row * A.cap_pages + p] = -CUDART_INF_F;
            continue;
        }
        const int64_t phys = A.t.indices[sg.first + p];
        const int64_t so = (phys * A.Hk + kvh) * D;
        /* prefetch the warp's next page into L2: two pages of summaries in flight per warp */
        if (p + BOUND_WARPS < pend && p + BOUND_WARPS < sg.P - 1)
            prefetch_summaries(A, A.t.indices[sg.first + p + BOUND_WARPS], kvh, lane);
        float box[GM], dot[GM];
#pragma unroll
        for (int g = 0; g < GM; g++) box[g] = dot[g] = 0.f;
        float c2 = 0.f;
        for (int d = lane * 4; d < D; d += 128) {
            float mn4[4], mx4[4];
            ekv_range_load<4, RT>(A.rng, false, so + d, mn4);
            ekv_range_load<4, RT>(A.rng, true, so + d, mx4);
            const float4 mn = make_float4(mn4[0], mn4[1], mn4[2], mn4[3]);
            const float4 mx = make_float4(mx4[0], mx4[1], mx4[2], mx4[3]);
            float4 c = make_float4(0.f, 0.f, 0.f, 0.f);
            if (A.with_ball) {
                c = *reinterpret_cast<const float4 *>(A.st.kmean + so + d);
                c2 += c.x * c.x + c.y * c.y + c.z * c.z + c.w * c.w;
            }
#pragma unroll
            for (int g = 0; g < GM; g++) {
                if (g < G) {
                    const float4 qq = *reinterpret_cast<const float4 *>(qs + g * D + d);
                    box[g] += fmaxf(qq.x * mn.x, qq.x * mx.x) + fmaxf(qq.y * mn.y, qq.y * mx.y) +
                              fmaxf(qq.z * mn.z, qq.z * mx.z) + fmaxf(qq.w * mn.w, qq.w * mx.w);
                    dot[g] += qq.x * c.x + qq.y * c.y + qq.z * c.z + qq.w * c.w;
                }
            }
        }
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g < G) {
                box[g] = ekv_warp_sum(box[g]);
                dot[g] = ekv_warp_sum(dot[g]);
            }
        }
        c2 = ekv_warp_sum(c2);
        /* lane 0: page p's bound for each head, min(box, ball) + the rounding slack (docs/math.md
         * §9.5) + ALiBi, rounded up to stay a bound; with the box alone (paper-faithful top-k)
         * a ranking key without slack, as on the CPU. The list's key is the max over the group.
         * (Kept inline: as a helper taking the arguments by reference it ran 7% slower.) */
        if (lane != 0) continue;
        const double u24 = 5.9604644775390625e-8;
        const int64_t last = (p + 1) * ps - 1 < sg.N - 1 ? (p + 1) * ps - 1 : sg.N - 1;
        const double cn = sqrt((double)c2) * (1 + 1e-5);
        const double rr = A.with_ball ? (double)A.st.radius[phys * A.Hk + kvh] : 0.0;
        float best = -CUDART_INF_F;
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g >= G) break;
            const double am = A.slopes ? A.a * (double)A.slopes[kvh * G + g] : 0.0;
            double u = box[g];
            if (A.with_ball) {
                const double ub = (double)dot[g] + qn[g] * rr;
                u = u < ub ? u : ub;
                u += 4.0 * (double)(D + 4) * u24 * qn[g] * (cn + rr) + 1e-30;
                u += 8.0 * u24 * fabs(am) * ((double)llabs(p * ps - (sg.N - 1)) + (double)ps);
            }
            u += am * (double)(last - (sg.N - 1));
            float uf = (float)u;
            if (A.with_ball && (double)uf < u) uf = nextafterf(uf, CUDART_INF_F);
            A.bounds[((int64_t)b * A.H + kvh * G + g) * A.cap_pages + p] = uf;
            best = fmaxf(best, uf);
        }
        A.list_bounds[(int64_t)row * A.cap_pages + p] = best;
    }
}

} // namespace

ekv_status ekv_cuda_launch_bound(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                 const ekv_paged_kv *kv, const ekv_page_stats *st,
                                 const ekv_page_table *t, const float *q, int with_ball,
                                 int batch) {
    bound_args A;
    ekv_cuda_set_shape(A, pl, t);
    A.st = *st;
    A.rng = ekv_cuda_ranges_of(st);
    A.q = q;
    A.slopes = prm->alibi_slopes;
    A.a = prm->alpha == 1.0 ? 1.0 : prm->alpha - 1.0;
    const double scale = ekv_effective_scale(prm->scale, kv->head_dim);
    A.qscale = A.a * scale;
    A.with_ball = with_ball;
    A.bounds = pl->bounds;
    A.list_bounds = pl->list_bounds;
    A.rows = batch * A.Hk;
    const int64_t nblocks = (pl->cap_pages + BOUND_PAGES - 1) / BOUND_PAGES * A.rows;
    if (nblocks > INT32_MAX)
        return ekv_fail(pl->ctx, EKV_ERR_INVALID_SIZE, "bound: %lld blocks exceed the grid limit",
                        (long long)nblocks);
    const dim3 grid((unsigned)nblocks);
    const size_t sm = (size_t)A.G * A.D * sizeof(float);
    ekv_cuda_with_group(A.G, [&](auto tg) {
        ekv_cuda_with_ranges(A.rng, [&](auto rt) {
            bound_kernel<decltype(tg)::value, decltype(rt)::value>
                    <<<grid, EKV_CUDA_THREADS, sm, pl->stream>>>(A);
        });
    });
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}
