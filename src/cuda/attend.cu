/*
 * attend stage on the GPU (mirrors src/cpu/attend_pages.c and decode_dense.c; SPEC 9.7,
 * DESIGN 5). Three kernels per step:
 *   scores: grid (split, sequence x KV head). Reads K of the listed pages once for the whole
 *           GQA group, writes z = a (scale <q,k> + m_h (j - i)) of every listed token into the
 *           score rows and the split's max per query head. Entmax has no (max, sum) merge,
 *           so the splits keep their scores instead of partial outputs.
 *   tau:    one block per query head. The global max M comes from the split maxima; every
 *           support token has z > M - 1, so those candidates are gathered into shared memory
 *           and tau is solved exactly there (falls back to the score row in global memory
 *           when there are more than EKV_CUDA_CAND_CAP). alpha = 1: log-sum-exp.
 *   values: grid (split, sequence x KV head x chunk of 4 group heads). Reads V only for rows
 *           with p > 0 for some head of the group; partial outputs are added atomically
 *           (tau is global, so they simply sum).
 * Lists: with use_list, entry e of list r is logical page list_pages[r*cap + e]; round 1 is
 * entries [0, list_count[2r]), round 2 [list_count[2r], list_count[2r+1]). Without a list the
 * entries are the sequence's pages. Score slot of entry e, token t: e*page_size + t.
 */
#include "cuda_internal.cuh"
#include <math_constants.h>

namespace {

struct score_args {
    ekv_paged_kv kv;
    ekv_page_table t;
    const float *q;
    const float *slopes;   /* device, [H] or NULL */
    double qscale;         /* a * scale */
    float a;
    int H, Hk, G, D, ps;
    int64_t cap_pages, cap_tokens;
    int nsplit;
    const int32_t *list_pages, *list_count; /* NULL: dense */
    int round;             /* 1 or 2 */
    float *scores, *split_max;
};

__device__ __forceinline__ void entry_range(const int32_t *list_count, int64_t P, int row, int round, int64_t *begin,
                                            int64_t *end) {
    if (!list_count) { *begin = 0; *end = P; return; }
    const int64_t c1 = list_count[2 * row], c2 = list_count[2 * row + 1];
    if (round == 1) { *begin = 0; *end = c1; }
    else if (round == 2) { *begin = c1; *end = c2; }
    else { *begin = 0; *end = c2; } /* round 3: everything listed */
}

/* LPR lanes per key row (D = 8*LPR); LPR = 0: generic (32 lanes, loop over 8-element chunks) */
/* GM: compile-time bound of the group size (register tiles); G <= GM at run time */
template <typename T, int LPR, int GM>
__global__ void __launch_bounds__(EKV_CUDA_THREADS, 2) scores_kernel(score_args A) {
    extern __shared__ float smem[];             /* q' [G][D], then red [nwarps][G] */
    float *qs = smem;
    float *red = smem + A.G * A.D;
    const int row = blockIdx.y, b = row / A.Hk, kvh = row % A.Hk, G = A.G, D = A.D, ps = A.ps;
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    int64_t begin, end;
    entry_range(A.list_count, sg.P, row, A.round, &begin, &end);
    const int64_t n = end - begin, per = (n + A.nsplit - 1) / A.nsplit;
    const int64_t e0 = begin + (int64_t)blockIdx.x * per, e1 = e0 + per < end ? e0 + per : end;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int half = A.round == 2 ? A.nsplit : 0;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        qs[i] = (float)(A.qscale * A.q[((int64_t)b * A.H + kvh * G + g) * D + d]); /* as bound.cu */
    }
    __syncthreads();
    float runmax[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) runmax[g] = -CUDART_INF_F;
    const T *K = static_cast<const T *>(A.kv.k);
    constexpr int RPW = LPR ? 32 / LPR : 1;      /* rows per warp pass */
    constexpr int L = LPR ? LPR : 32;
    const int sub = lane / L, sl = lane % L;
    float slope[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) slope[g] = (g < G && A.slopes) ? A.a * A.slopes[kvh * G + g] : 0.f;
    /* A warp takes whole pages (entries): one page-table lookup per page, then its rows, RPW
     * rows per warp pass and U passes loaded before any is reduced (LPR > 0: every lane holds
     * one 8-element chunk of a row), so a page of 16 x 128 fp16 keys is 8 loads in flight per
     * lane with no per-row index arithmetic. */
    constexpr int U = LPR ? (GM <= 2 ? 8 : 4) : 1;
    float *srow = A.scores + ((int64_t)b * A.H + kvh * G) * A.cap_tokens; /* + g * cap_tokens */
    for (int64_t e = e0 + warp; e < e1; e += nw) {
        const int64_t lp = A.list_pages ? A.list_pages[(int64_t)row * A.cap_pages + e] : e;
        const int valid = lp == sg.P - 1 ? (int)(sg.N - lp * ps) : ps; /* tokens in the page */
        const T *pbase = K + (int64_t)A.t.indices[sg.first + lp] * A.kv.stride_page + (int64_t)kvh * A.kv.stride_head;
        const float jbase = (float)(lp * ps - (sg.N - 1));
        float *sbase = srow + e * ps;
        for (int t0 = 0; t0 < ps; t0 += RPW * U) {
            float k8[U][8];
#pragma unroll
            for (int r = 0; r < U; r++) {
                const int t = t0 + r * RPW + sub;
#pragma unroll
                for (int i = 0; i < 8; i++) k8[r][i] = 0.f;
                if (LPR && t < valid) ekv_elem<T>::load8(pbase + (int64_t)t * A.kv.stride_token + sl * 8, k8[r]);
            }
#pragma unroll
            for (int r = 0; r < U; r++) {
                const int t = t0 + r * RPW + sub;
                float acc[GM];
#pragma unroll
                for (int g = 0; g < GM; g++) acc[g] = 0.f;
                if (LPR) {
#pragma unroll
                    for (int g = 0; g < GM; g++) {
                        if (g < G) {
                            const float4 qa = *reinterpret_cast<const float4 *>(qs + g * D + sl * 8);
                            const float4 qb = *reinterpret_cast<const float4 *>(qs + g * D + sl * 8 + 4);
                            acc[g] = qa.x * k8[r][0] + qa.y * k8[r][1] + qa.z * k8[r][2] + qa.w * k8[r][3] +
                                     qb.x * k8[r][4] + qb.y * k8[r][5] + qb.z * k8[r][6] + qb.w * k8[r][7];
                        }
                    }
                } else if (t < valid) { /* generic head dim: the lanes stride over the row's chunks */
                    const T *krow = pbase + (int64_t)t * A.kv.stride_token;
                    for (int c = sl; c < D / 8; c += L) {
                        float kk[8];
                        ekv_elem<T>::load8(krow + c * 8, kk);
#pragma unroll
                        for (int g = 0; g < GM; g++) {
                            if (g < G) {
                                const float4 qa = *reinterpret_cast<const float4 *>(qs + g * D + c * 8);
                                const float4 qb = *reinterpret_cast<const float4 *>(qs + g * D + c * 8 + 4);
                                acc[g] += qa.x * kk[0] + qa.y * kk[1] + qa.z * kk[2] + qa.w * kk[3] + qb.x * kk[4] +
                                          qb.y * kk[5] + qb.z * kk[6] + qb.w * kk[7];
                            }
                        }
                    }
                }
#pragma unroll
                for (int g = 0; g < GM; g++) {
                    if (g < G) {
#pragma unroll
                        for (int o = L / 2; o > 0; o >>= 1) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], o);
                    }
                }
                if (t < ps && sl == 0) {
#pragma unroll
                    for (int g = 0; g < GM; g++) {
                        if (g < G) {
                            const float z = t < valid ? acc[g] + slope[g] * (jbase + (float)t) : -CUDART_INF_F;
                            sbase[(int64_t)g * A.cap_tokens + t] = z;
                            runmax[g] = fmaxf(runmax[g], z);
                        }
                    }
                }
            }
        }
    }
    /* split maxima per query head */
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g < G) {
            float m = ekv_warp_max(runmax[g]);
            if (lane == 0) red[warp * G + g] = m;
        }
    }
    __syncthreads();
    if (threadIdx.x < G) {
        float m = -CUDART_INF_F;
        for (int w = 0; w < nw; w++) m = fmaxf(m, red[w * G + threadIdx.x]);
        A.split_max[((int64_t)b * A.H + kvh * G + threadIdx.x) * 2 * A.nsplit + half + blockIdx.x] = m;
    }
}

struct tau_args {
    ekv_page_table t;
    int H, Hk, G, D, ps;
    int64_t cap_tokens;
    int nsplit, round;
    const int32_t *list_count;
    double alpha;
    const float *scores, *split_max;
    double *tau;
    int64_t *support;
    int64_t *v_rows;
    int32_t *flags;
    float *out_zero; /* zero the output row (the values kernel adds into it), or NULL */
};

/* Sums over the candidates y = z - M > tau' (tau' relative to M) */
struct tau_sums { double n, s1, s2, mn; };

__device__ tau_sums cand_sums(const float *v, int64_t n, float M, double t, double *scratch) {
    double c = 0, s1 = 0, s2 = 0, mn = 1e300;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const double y = (double)v[i] - (double)M;
        if (y > t) { c += 1; s1 += y; s2 += y * y; mn = y < mn ? y : mn; }
    }
    tau_sums r;
    r.n = ekv_block_sum(c, scratch);
    r.s1 = ekv_block_sum(s1, scratch);
    r.s2 = ekv_block_sum(s2, scratch);
    r.mn = ekv_block_min(mn, scratch, 1e300);
    return r;
}

/* F = sum [y - t]_+^beta - 1 and its derivative */
__device__ void cand_newton(const float *v, int64_t n, float M, double t, double beta, double *scratch, double *F,
                            double *Fp) {
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

enum { TAU_THREADS = 1024, TAU_UNROLL = 8 };

/* Visits z[i] for i < n, TAU_UNROLL loads in flight per thread (the scan is latency-bound
 * with one block per head otherwise). */
template <typename F> __device__ __forceinline__ void scan_row(const float *z, int64_t n, F f) {
    const int64_t step = (int64_t)blockDim.x * TAU_UNROLL;
    for (int64_t base = threadIdx.x; base < n; base += step) {
        float x[TAU_UNROLL];
#pragma unroll
        for (int k = 0; k < TAU_UNROLL; k++) {
            const int64_t i = base + (int64_t)k * blockDim.x;
            x[k] = i < n ? z[i] : -CUDART_INF_F;
        }
#pragma unroll
        for (int k = 0; k < TAU_UNROLL; k++) f(x[k]);
    }
}

__global__ void __launch_bounds__(TAU_THREADS) tau_kernel(tau_args A) {
    __shared__ float cand[EKV_CUDA_CAND_CAP];
    __shared__ double scratch[32];
    __shared__ float fscratch[32];
    __shared__ int ncand;
    const int row = blockIdx.x, b = row / A.H, h = row % A.H, lrow = b * A.Hk + h / A.G;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    int64_t begin, end;
    entry_range(A.list_count, sg.P, lrow, A.round == 1 ? 1 : 3, &begin, &end);
    const int64_t ntok = end * A.ps;
    const float *z = A.scores + (int64_t)row * A.cap_tokens;
    float m = -CUDART_INF_F;
    const int halves = A.round == 1 ? 1 : 2;
    for (int i = threadIdx.x; i < halves * A.nsplit; i += blockDim.x)
        m = fmaxf(m, A.split_max[(int64_t)row * 2 * A.nsplit + i]);
    const float M = ekv_block_max(m, fscratch, -CUDART_INF_F);
    if (A.out_zero)
        for (int d = threadIdx.x; d < A.D; d += blockDim.x) A.out_zero[(int64_t)row * A.D + d] = 0.f;
    if (A.out_zero && h % A.G == 0 && threadIdx.x == 0) A.v_rows[lrow] = 0;
    if (A.alpha == 1.0) { /* softmax: tau = log-sum-exp */
        double s = 0;
        int64_t cnt = 0;
        scan_row(z, ntok, [&](float x) {
            if (x > -CUDART_INF_F) { s += exp((double)x - (double)M); cnt++; }
        });
        s = ekv_block_sum(s, scratch);
        const double c = ekv_block_sum((double)cnt, scratch);
        if (threadIdx.x == 0) { A.tau[row] = (double)M + log(s); A.support[row] = (int64_t)c; }
        return;
    }
    /* gather the candidates z > M - 1 */
    if (threadIdx.x == 0) ncand = 0;
    __syncthreads();
    const double lo_z = (double)M - 1.0;
    scan_row(z, ntok, [&](float x) {
        if ((double)x >= lo_z) {
            const int k = atomicAdd(&ncand, 1);
            if (k < EKV_CUDA_CAND_CAP) cand[k] = x;
        }
    });
    __syncthreads();
    const float *v = cand;
    int64_t nv = ncand;
    if (ncand > EKV_CUDA_CAND_CAP) { /* too many: iterate over the whole row */
        v = z;
        nv = ntok;
        if (threadIdx.x == 0) atomicOr(&A.flags[row], 1);
    }
    const double alpha = A.alpha, beta = 1.0 / (alpha - 1.0);
    double t = -1.0; /* tau - M; F(-1) >= 0 because the max alone gives 1 */
    if (alpha == 2.0) {
        /* Michelot: the closed form over a superset of the support is a lower bound of tau */
        double prev_n = -1;
        for (int it = 0; it < 200; it++) {
            const tau_sums s = cand_sums(v, nv, M, t, scratch);
            const double tn = (s.s1 - 1.0) / s.n;
            if (s.n == prev_n || !(tn > t)) { t = tn > t ? tn : t; break; }
            prev_n = s.n;
            t = tn;
        }
    } else if (alpha == 1.5) {
        /* Newton from the left (monotone, F convex) on F = sum (y-t)^2 - 1; the closed form on
         * the current support is exact as soon as it keeps that support */
        for (int it = 0; it < 100; it++) {
            const tau_sums s = cand_sums(v, nv, M, t, scratch);
            const double disc = s.s1 * s.s1 - s.n * (s.s2 - 1.0);
            const double tc = (s.s1 - sqrt(disc > 0 ? disc : 0.0)) / s.n;
            if (tc >= t && s.mn > tc) { t = tc; break; }
            const double F = s.s2 - 2.0 * t * s.s1 + s.n * t * t - 1.0, Fp = -2.0 * (s.s1 - s.n * t);
            const double tn = t - F / Fp;
            if (!(tn > t)) break;
            t = tn;
        }
    } else {
        /* safeguarded Newton inside the bracket [lo, hi] */
        double lo = -1.0, hi = 0.0;
        for (int it = 0; it < 200; it++) {
            double F, Fp;
            cand_newton(v, nv, M, t, beta, scratch, &F, &Fp);
            if (F > 0) lo = t; else hi = t;
            if (F == 0 || hi - lo <= 1e-15 * (1.0 + fabs(t))) break;
            double tn = Fp < 0 ? t - F / Fp : 0.5 * (lo + hi);
            if (!(tn > lo && tn < hi)) tn = 0.5 * (lo + hi);
            t = tn;
        }
    }
    /* support count on the final tau */
    double c = 0;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) c += ((double)v[i] - (double)M > t) ? 1.0 : 0.0;
    c = ekv_block_sum(c, scratch);
    if (threadIdx.x == 0) { A.tau[row] = (double)M + t; A.support[row] = (int64_t)c; }
}

struct value_args {
    ekv_paged_kv kv;
    ekv_page_table t;
    int H, Hk, G, D, ps, gchunks;
    int64_t cap_pages, cap_tokens;
    int nsplit;
    const int32_t *list_pages, *list_count;
    double alpha;
    const float *scores;
    const double *tau;
    int64_t *v_rows;
    float *out;
};

template <typename T> __device__ __forceinline__ void load4(const T *p, float *o);
template <> __device__ __forceinline__ void load4<__half>(const __half *p, float *o) {
    uint2 r = __ldg(reinterpret_cast<const uint2 *>(p));
    const __half2 *h = reinterpret_cast<const __half2 *>(&r);
    float2 a = __half22float2(h[0]), c = __half22float2(h[1]);
    o[0] = a.x; o[1] = a.y; o[2] = c.x; o[3] = c.y;
}
template <> __device__ __forceinline__ void load4<__nv_bfloat16>(const __nv_bfloat16 *p, float *o) {
    uint2 r = __ldg(reinterpret_cast<const uint2 *>(p));
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&r);
    float2 a = __bfloat1622float2(h[0]), c = __bfloat1622float2(h[1]);
    o[0] = a.x; o[1] = a.y; o[2] = c.x; o[3] = c.y;
}
template <> __device__ __forceinline__ void load4<float>(const float *p, float *o) {
    float4 a = __ldg(reinterpret_cast<const float4 *>(p));
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
}

enum { VCH = 4, VDIM = EKV_CUDA_MAX_DIM / 128 }; /* heads per block, 4-element chunks per lane */

/* VD: 4-element chunks per lane (D <= 128 VD); the accumulators are VCH x VD x 4 registers */
template <typename T, int VD>
__global__ void __launch_bounds__(EKV_CUDA_THREADS) values_kernel(value_args A) {
    const int y = blockIdx.y, gc = y % A.gchunks, row = y / A.gchunks, b = row / A.Hk, kvh = row % A.Hk;
    const int D = A.D, ps = A.ps, g0 = gc * VCH, ng = A.G - g0 < VCH ? A.G - g0 : VCH;
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    int64_t begin, end;
    entry_range(A.list_count, sg.P, row, 3, &begin, &end);
    const int64_t n = end - begin, per = (n + A.nsplit - 1) / A.nsplit;
    const int64_t e0 = begin + (int64_t)blockIdx.x * per, e1 = e0 + per < end ? e0 + per : end;
    if (e1 <= e0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    double tau[VCH];
    const float *zr[VCH];
    for (int g = 0; g < VCH; g++) {
        const int64_t hrow = (int64_t)b * A.H + kvh * A.G + g0 + (g < ng ? g : 0);
        tau[g] = A.tau[hrow];
        zr[g] = A.scores + hrow * A.cap_tokens;
    }
    const bool softmax = A.alpha == 1.0;
    const double beta = softmax ? 1.0 : 1.0 / (A.alpha - 1.0);
    float acc[VCH][VD][4];
#pragma unroll
    for (int g = 0; g < VCH; g++)
#pragma unroll
        for (int c = 0; c < VD; c++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[g][c][i] = 0.f;
    const T *V = static_cast<const T *>(A.kv.v);
    int64_t rows = 0;
    bool any_w = false;
    const int64_t t0 = e0 * ps, t1 = e1 * ps;
    constexpr int VU = 4; /* warp-rows of scores loaded ahead */
    for (int64_t base0 = t0 + (int64_t)warp * 32; base0 < t1; base0 += (int64_t)nw * 32 * VU) {
    float zpre[VU][VCH];
#pragma unroll
    for (int v = 0; v < VU; v++)
#pragma unroll
        for (int g = 0; g < VCH; g++) {
            const int64_t u = base0 + (int64_t)v * nw * 32 + lane;
            zpre[v][g] = (g < ng && u < t1) ? zr[g][u] : -CUDART_INF_F;
        }
#pragma unroll
    for (int v = 0; v < VU; v++) {
        const int64_t base = base0 + (int64_t)v * nw * 32;
        if (base >= t1) break;
        const int64_t u = base + lane;
        float p[VCH];
        bool any = false;
#pragma unroll
        for (int g = 0; g < VCH; g++) {
            p[g] = 0.f;
            if (g < ng && u < t1) {
                const float zz = zpre[v][g];
                const double x = (double)zz - tau[g];
                if (softmax) p[g] = zz > -CUDART_INF_F ? (float)exp(x) : 0.f;
                else if (x > 0) p[g] = beta == 2.0 ? (float)(x * x) : beta == 1.0 ? (float)x : (float)pow(x, beta);
                any |= p[g] > 0.f;
            }
        }
        unsigned mask = __ballot_sync(0xffffffffu, any);
        if (mask) any_w = true;
        if (lane == 0) rows += __popc(mask);
        while (mask) {
            const int src = __ffs(mask) - 1;
            mask &= mask - 1;
            const int rel = (int)(base + src - t0); /* 32-bit division: a split holds < 2^31 tokens */
            const int64_t e = e0 + rel / ps, slot = rel % ps;
            const int64_t lp = A.list_pages ? A.list_pages[(int64_t)row * A.cap_pages + e] : e;
            const int64_t phys = A.t.indices[sg.first + lp];
            const T *vrow = V + phys * A.kv.stride_page + (int64_t)kvh * A.kv.stride_head + slot * A.kv.stride_token;
            float pg[VCH];
#pragma unroll
            for (int g = 0; g < VCH; g++) pg[g] = __shfl_sync(0xffffffffu, p[g], src);
#pragma unroll
            for (int c = 0; c < VD; c++) {
                const int d = c * 128 + lane * 4;
                if (d < D) {
                    float v4[4];
                    load4<T>(vrow + d, v4);
#pragma unroll
                    for (int g = 0; g < VCH; g++)
#pragma unroll
                        for (int i = 0; i < 4; i++) acc[g][c][i] += pg[g] * v4[i];
                }
            }
        }
    }
    }
    if (lane == 0 && rows) atomicAdd(reinterpret_cast<unsigned long long *>(&A.v_rows[row]), (unsigned long long)rows);
    if (!any_w) return;
#pragma unroll
    for (int g = 0; g < VCH; g++) {
        if (g < ng) {
            float *o = A.out + ((int64_t)b * A.H + kvh * A.G + g0 + g) * D;
#pragma unroll
            for (int c = 0; c < VD; c++) {
                const int d = c * 128 + lane * 4;
                if (d < D)
#pragma unroll
                    for (int i = 0; i < 4; i++) atomicAdd(o + d + i, acc[g][c][i]);
            }
        }
    }
}

template <typename T, int LPR>
void launch_scores_g(const score_args &A, dim3 grid, size_t sm, cudaStream_t st) {
    if (A.G == 1) scores_kernel<T, LPR, 1><<<grid, EKV_CUDA_THREADS, sm, st>>>(A);
    else if (A.G == 2) scores_kernel<T, LPR, 2><<<grid, EKV_CUDA_THREADS, sm, st>>>(A);
    else if (A.G <= 4) scores_kernel<T, LPR, 4><<<grid, EKV_CUDA_THREADS, sm, st>>>(A);
    else if (A.G <= 8) scores_kernel<T, LPR, 8><<<grid, EKV_CUDA_THREADS, sm, st>>>(A);
    else scores_kernel<T, LPR, EKV_CUDA_MAX_GROUP><<<grid, EKV_CUDA_THREADS, sm, st>>>(A);
}

template <typename T>
cudaError_t launch_scores_t(const score_args &A, dim3 grid, cudaStream_t st) {
    const size_t sm = (size_t)(A.G * A.D + (EKV_CUDA_THREADS / 32) * A.G) * sizeof(float);
    switch (A.D) {
    case 64: launch_scores_g<T, 8>(A, grid, sm, st); break;
    case 128: launch_scores_g<T, 16>(A, grid, sm, st); break;
    case 256: launch_scores_g<T, 32>(A, grid, sm, st); break;
    default: scores_kernel<T, 0, EKV_CUDA_MAX_GROUP><<<grid, EKV_CUDA_THREADS, sm, st>>>(A); break;
    }
    return cudaGetLastError();
}

template <typename T>
void launch_values_t(const value_args &A, dim3 grid, cudaStream_t st) {
    if (A.D <= 128) values_kernel<T, 1><<<grid, EKV_CUDA_THREADS, 0, st>>>(A);
    else if (A.D <= 256) values_kernel<T, 2><<<grid, EKV_CUDA_THREADS, 0, st>>>(A);
    else values_kernel<T, VDIM><<<grid, EKV_CUDA_THREADS, 0, st>>>(A);
}

} // namespace

ekv_status ekv_cuda_launch_scores(ekv_cuda_plan *pl, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                                  const ekv_page_table *t, const float *q, int batch, int use_list, int round) {
    score_args A;
    A.kv = *kv;
    A.t = *t;
    A.q = q;
    A.slopes = prm->alibi_slopes;
    const double a = prm->alpha == 1.0 ? 1.0 : prm->alpha - 1.0;
    const double scale = prm->scale > 0 ? prm->scale : 1.0 / sqrt((double)kv->head_dim);
    A.qscale = a * scale;
    A.a = (float)a;
    A.H = prm->num_heads;
    A.Hk = kv->num_kv_heads;
    A.G = A.H / A.Hk;
    A.D = kv->head_dim;
    A.ps = kv->page_size;
    A.cap_pages = pl->cap_pages;
    A.cap_tokens = pl->cap_tokens;
    A.nsplit = pl->nsplit;
    A.list_pages = use_list ? pl->list_pages : NULL;
    A.list_count = use_list ? pl->list_count : NULL;
    A.round = round;
    A.scores = pl->scores;
    A.split_max = pl->split_max;
    dim3 grid(pl->nsplit, batch * A.Hk);
    cudaError_t e;
    switch (kv->dtype) {
    case EKV_DTYPE_F16: e = launch_scores_t<__half>(A, grid, pl->stream); break;
    case EKV_DTYPE_BF16: e = launch_scores_t<__nv_bfloat16>(A, grid, pl->stream); break;
    default: e = launch_scores_t<float>(A, grid, pl->stream); break;
    }
    if (e != cudaSuccess) return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "scores kernel: %s", cudaGetErrorString(e));
    pl->launches++;
    return EKV_OK;
}

ekv_status ekv_cuda_launch_tau(ekv_cuda_plan *pl, const ekv_decode_params *prm, const ekv_page_table *t, int batch,
                               int use_list, int round, float *out_zero) {
    tau_args A;
    A.t = *t;
    A.H = prm->num_heads;
    A.Hk = pl->p.num_kv_heads;
    A.G = A.H / A.Hk;
    A.D = pl->p.head_dim;
    A.ps = pl->p.page_size;
    A.cap_tokens = pl->cap_tokens;
    A.nsplit = pl->nsplit;
    A.round = round;
    A.list_count = use_list ? pl->list_count : NULL;
    A.alpha = prm->alpha;
    A.scores = pl->scores;
    A.split_max = pl->split_max;
    A.tau = pl->tau;
    A.support = pl->support;
    A.v_rows = pl->v_rows;
    A.flags = pl->flags;
    A.out_zero = out_zero;
    tau_kernel<<<batch * A.H, TAU_THREADS, 0, pl->stream>>>(A);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

ekv_status ekv_cuda_launch_values(ekv_cuda_plan *pl, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                                  const ekv_page_table *t, int batch, int use_list, float *out) {
    value_args A;
    A.kv = *kv;
    A.t = *t;
    A.H = prm->num_heads;
    A.Hk = kv->num_kv_heads;
    A.G = A.H / A.Hk;
    A.D = kv->head_dim;
    A.ps = kv->page_size;
    A.gchunks = (A.G + VCH - 1) / VCH;
    A.cap_pages = pl->cap_pages;
    A.cap_tokens = pl->cap_tokens;
    A.nsplit = pl->nsplit;
    A.list_pages = use_list ? pl->list_pages : NULL;
    A.list_count = use_list ? pl->list_count : NULL;
    A.alpha = prm->alpha;
    A.scores = pl->scores;
    A.tau = pl->tau;
    A.v_rows = pl->v_rows;
    A.out = out;
    dim3 grid(pl->nsplit, batch * A.Hk * A.gchunks);
    switch (kv->dtype) {
    case EKV_DTYPE_F16: launch_values_t<__half>(A, grid, pl->stream); break;
    case EKV_DTYPE_BF16: launch_values_t<__nv_bfloat16>(A, grid, pl->stream); break;
    default: launch_values_t<float>(A, grid, pl->stream); break;
    }
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}
