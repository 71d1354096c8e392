/*
 * screen stage on the GPU (mirrors src/cpu/screen.c and src/select/screened.c; docs/math.md
 * §10): screened decode's page lists from the key codes, with no host round trip.
 *   screen:  grid (2 nsplit, sequence x KV head), one warp per page. The warp forms the page's
 *            channel terms from its range (step s_c, centre m_c + s_c/2, error weight W_c) and
 *            the code weights w'_c = q'_c s_c of the group's heads in shared memory, then its
 *            lanes take the page's tokens (the block layout puts 16 consecutive tokens of one
 *            channel pair in 16 consecutive bytes) and sum w'_c code_tc over slices of the
 *            channels. Per token and head it writes the lower bound l_t into the score row (the
 *            plan's scores buffer, slot p ps + t) and per page and head the width Delta that
 *            bounds z_t - l_t for every token of the page (the plan's bounds buffer), and the
 *            split maxima of l (both halves of split_max).
 *   tau:     the attend stage's candidates + tau kernels over l (as round 2 without a list:
 *            all 2 nsplit split maxima, every page): tau(l) <= tau* (docs/math.md §10.3).
 *   mark:    grid (page chunk, sequence x KV head): token t survives for head g unless
 *            l_t + Delta <= tau(l) (lowered by the solve's tolerance); a page with a survivor
 *            of any head of the group is kept, the last page always; survivors are counted.
 *   compact: one block per list: the kept pages in ascending order, the last page last.
 * The bound (docs/math.md §10.2) is the CPU's in its terms: W_c covers the code error, the score
 * kernel's rounding in any summation order and this kernel's, 2 E_p the ALiBi terms of both,
 * and the centre z^ = (C0 + sum_c w'_c code_c) + bias is widened by E = e + 8u (|z^| + e) for
 * its last roundings. With l = fl(z^ - E): z <= l + (2 + u) E, so Delta = fl(E (2 + 2^-21)),
 * maxed over the page, bounds z - l; a non-finite bound keeps its page whole.
 */
#include "attend_common.cuh"
#include "../core/codes.h"

namespace {

#define SCREEN_U  0x1p-24f  /* fp32 unit roundoff                                    */
#define SCREEN_NU 0x1p-140f /* the underflow floor per channel (docs/math.md §10.2) */

struct screen_args : ekv_cuda_shape {
    const float *kmin, *kmax;
    const uint8_t *codes;
    const float *q, *slopes;
    double qscale; /* a * scale, as the score kernels form q' */
    float a;
    int nsplit;   /* the plan's: split_max rows are 2 nsplit wide, this grid fills both halves */
    int nwarps;   /* warps per block (shared memory: a weight tile per warp) */
    float *lo;    /* [B*H][cap_tokens] */
    float *delta; /* [B*H][cap_pages] */
    float *split_max;
    int32_t *cand_count; /* zeroed for the candidates kernel over l */
    int64_t *survivors;  /* [B*Hk] zeroed for the mark kernel */
};

/* What the warp's lanes need of one page: the range-derived sums per head and the page's
 * geometry. */
template <int GM> struct screen_page {
    float c0[GM], e[GM]; /* C0 = <q', centre>; e = the half-width before the last roundings */
    int ok;              /* every step and centre finite */
    int64_t phys;
    int valid;  /* tokens of the page */
    float jpos; /* position of slot 0 relative to the query, as the score kernel forms it */
};

/* The channel terms of the page (lanes over channels): the code weights w' [D][GM] into the
 * warp's tile, C0 and e per head (warp sums). W_c is the CPU's (src/cpu/screen.c). */
template <int GM, int BITS>
__device__ __forceinline__ void page_terms(const screen_args &A, const float *qs, float *wq,
                                           int64_t so, const float *slope, int64_t p, int64_t N,
                                           screen_page<GM> &pg) {
    const int lane = threadIdx.x & 31;
    const float gamma = 4.0f * (float)(A.D + 4) * SCREEN_U;
    float c0[GM], ep[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) c0[g] = ep[g] = 0.f;
    int ok = 1;
#pragma unroll 4
    for (int c = lane; c < A.D; c += 32) {
        const float mn = A.kmin[so + c], mx = A.kmax[so + c];
        const float s = ekv_code_step(mn, mx, BITS), Ac = fmaxf(fabsf(mn), fabsf(mx));
        const float mid = mn + 0.5f * s;
        ok &= (s - s == 0.f) & (mid - mid == 0.f);
        const float w = (0.5f * s + 6.0f * SCREEN_U * Ac + 2.0f * gamma * (4.0f * Ac + s)) *
                                (1.0f + 0x1p-20f) +
                        SCREEN_NU;
#pragma unroll
        for (int g = 0; g < GM; g++) {
            const float qv = g < A.G ? qs[g * A.D + c] : 0.f;
            wq[c * GM + g] = qv * s;
            c0[g] += qv * mid;
            ep[g] += fabsf(qv) * w;
        }
    }
    pg.ok = __all_sync(0xffffffffu, ok);
    const double gd = 4.0 * (double)(A.D + 4) * 0x1p-24;
    const double pos = (double)llabs(p * A.ps - (N - 1)) + (double)A.ps;
#pragma unroll
    for (int g = 0; g < GM; g++) {
        pg.c0[g] = ekv_warp_sum(c0[g]);
        /* e in double: the fp32 sum of non-negative terms (1 + 2 gamma), the D underflow floors
         * and 2 E_p = 16 u |a m_h| (|p ps - (N-1)| + ps) for the ALiBi terms */
        const double e = (double)ekv_warp_sum(ep[g]) * (1.0 + 2.0 * gd) + (double)A.D * 0x1p-140 +
                         16.0 * 0x1p-24 * (1.0 + 0x1p-20) * fabs((double)slope[g]) * pos;
        pg.e[g] = __double2float_ru(e);
    }
    __syncwarp();
}

/* A code as fp32, exactly: 2^23 + c has c in its low mantissa bits. */
__device__ __forceinline__ float code_f(uint32_t c) {
    return __uint_as_float(0x4B000000u | c) - 8388608.0f;
}

enum { SCREEN_LOADS = 8 }; /* code bytes in flight per lane: the screen is latency-bound */

/* w'_c code_c of one code byte j (channel j, or channels 2j and 2j + 1) added to acc. */
template <int GM, int BITS>
__device__ __forceinline__ void code_fma(uint32_t byte, int j, const float *wq, float *acc) {
    if (BITS == 8) {
        const float x = code_f(byte);
#pragma unroll
        for (int g = 0; g < GM; g++) acc[g] += wq[j * GM + g] * x;
    } else {
        const float x0 = code_f(byte & 15u), x1 = code_f(byte >> 4);
#pragma unroll
        for (int g = 0; g < GM; g++) {
            acc[g] += wq[2 * j * GM + g] * x0;
            acc[g] += wq[(2 * j + 1) * GM + g] * x1;
        }
    }
}

/* sum_c w'_gc code_tc over the code bytes j = j0, j0 + CS, ... < R of slot t (the slices
 * interleave, so the lanes of different slices read different shared-memory banks), loaded
 * SCREEN_LOADS at a time before they are used. */
template <int GM, int BITS>
__device__ __forceinline__ void code_dots(const uint8_t *blk, int ps, int t, int j0, int CS, int R,
                                          const float *wq, float *acc) {
    for (int jb = j0; jb < R; jb += SCREEN_LOADS * CS) {
        uint32_t byte[SCREEN_LOADS];
#pragma unroll
        for (int u = 0; u < SCREEN_LOADS; u++) {
            const int j = jb + u * CS;
            byte[u] = j < R ? __ldg(blk + j * ps + t) : 0u;
        }
#pragma unroll
        for (int u = 0; u < SCREEN_LOADS; u++)
            if (jb + u * CS < R) code_fma<GM, BITS>(byte[u], jb + u * CS, wq, acc);
    }
}

/* The bounds of one page's tokens: TL lanes over tokens, CS slices over the code bytes,
 * summed into the slice-0 lanes, which write l and keep the maxima of l (runmax) and of Delta
 * over the page (dmax). */
template <int GM, int BITS>
__device__ __forceinline__ void page_bounds(const screen_args &A, const screen_page<GM> &pg,
                                            const float *wq, const float *slope, int64_t p,
                                            float *lrow, float *runmax, float *dmax) {
    const int lane = threadIdx.x & 31, ps = A.ps, TL = ps < 32 ? ps : 32, CS = 32 / TL;
    const int tl = lane % TL, slice = lane / TL;
    const int R = (int)ekv_code_row_bytes(A.D, BITS), j0 = slice < CS ? slice : R;
    const uint8_t *blk = A.codes + (pg.phys * A.Hk + (blockIdx.y % A.Hk)) * ps * R;
    for (int tb = 0; tb < ps; tb += TL) {
        const int t = tb + tl;
        float acc[GM];
#pragma unroll
        for (int g = 0; g < GM; g++) acc[g] = 0.f;
        if (pg.ok && t < pg.valid) code_dots<GM, BITS>(blk, ps, t, j0, CS, R, wq, acc);
#pragma unroll
        for (int g = 0; g < GM; g++) {
            const float mine = acc[g];
            for (int k = 1; k < CS; k++) acc[g] += __shfl_sync(0xffffffffu, mine, tl + k * TL);
        }
        if (slice != 0 || t >= ps) continue;
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g >= A.G) break;
            float l = -CUDART_INF_F, d = CUDART_INF_F;
            if (t >= pg.valid)
                d = -CUDART_INF_F; /* no token: -inf in the row, nothing to the width */
            else if (pg.ok) {
                const float bias = slope[g] * (pg.jpos + (float)t);
                const float z = (pg.c0[g] + acc[g]) + bias;
                const float E = pg.e[g] + 8.0f * SCREEN_U * (fabsf(z) + pg.e[g]);
                l = z - E;
                d = E * (2.0f + 0x1p-21f);
                if (!(l - l == 0.f) || !(d - d == 0.f)) { /* overflow or NaN: keep the page */
                    l = -CUDART_INF_F;
                    d = CUDART_INF_F;
                }
            }
            lrow[(int64_t)g * A.cap_tokens + p * ps + t] = l;
            runmax[g] = fmaxf(runmax[g], l);
            dmax[g] = fmaxf(dmax[g], d);
        }
    }
}

/* Brings a page's range and code block into L2 (one 128-byte line per lane and pass), so the
 * warp's next page waits on L2, not DRAM. */
template <int BITS>
__device__ __forceinline__ void prefetch_page(const screen_args &A, int64_t phys, int kvh) {
    const int lane = threadIdx.x & 31;
    const int64_t so = (phys * A.Hk + kvh) * A.D,
                  cb = (int64_t)A.ps * ekv_code_row_bytes(A.D, BITS);
    const uint8_t *blk = A.codes + (phys * A.Hk + kvh) * cb;
    for (int64_t o = lane * 32; o < A.D; o += 32 * 32) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(A.kmin + so + o));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(A.kmax + so + o));
    }
    for (int64_t o = lane * 128; o < cb; o += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(blk + o));
}

/* Blocks per SM the registers must allow: the screen is latency-bound, so small groups trade
 * a few spilled registers for twice the warps in flight. */
constexpr int screen_min_blocks(int GM) { return GM <= 4 ? 4 : GM <= 8 ? 2 : 1; }

template <int GM, int BITS>
__global__ void __launch_bounds__(EKV_CUDA_THREADS, screen_min_blocks(GM))
        screen_kernel(screen_args A) {
    extern __shared__ __align__(16) float smem[]; /* q' [G][D], then a w' tile [D][GM] per warp */
    const int row = blockIdx.y, b = row / A.Hk, kvh = row % A.Hk, G = A.G, D = A.D;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float *qs = smem, *wq = smem + G * D + (int64_t)warp * D * GM,
          *red = smem + G * D + nw * D * GM;
    if (blockIdx.x == 0) { /* the counters of the kernels that follow */
        if (threadIdx.x < G) A.cand_count[(int64_t)b * A.H + kvh * G + threadIdx.x] = 0;
        if (threadIdx.x == 0) A.survivors[row] = 0;
    }
    for (int i = threadIdx.x; i < G * D; i += blockDim.x)
        qs[i] = (float)(A.qscale * A.q[((int64_t)b * A.H + kvh * G) * D + i]); /* as scores */
    __syncthreads();
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const int64_t per = (sg.P + gridDim.x - 1) / gridDim.x, e0 = (int64_t)blockIdx.x * per;
    const int64_t e1 = e0 + per < sg.P ? e0 + per : sg.P;
    float slope[GM], runmax[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) {
        slope[g] = g < G && A.slopes ? A.a * A.slopes[kvh * G + g] : 0.f;
        runmax[g] = -CUDART_INF_F;
    }
    float *lrow = A.lo + ((int64_t)b * A.H + kvh * G) * A.cap_tokens;
    for (int64_t p = e0 + warp; p < e1; p += nw) {
        if (p + nw < e1) prefetch_page<BITS>(A, A.t.indices[sg.first + p + nw], kvh);
        screen_page<GM> pg;
        pg.phys = A.t.indices[sg.first + p];
        pg.valid = p == sg.P - 1 ? (int)(sg.N - p * A.ps) : A.ps;
        pg.jpos = (float)(p * A.ps - (sg.N - 1));
        page_terms<GM, BITS>(A, qs, wq, (pg.phys * A.Hk + kvh) * D, slope, p, sg.N, pg);
        float dmax[GM];
#pragma unroll
        for (int g = 0; g < GM; g++) dmax[g] = -CUDART_INF_F;
        page_bounds<GM, BITS>(A, pg, wq, slope, p, lrow, runmax, dmax);
#pragma unroll
        for (int g = 0; g < GM; g++) {
            const float d = ekv_warp_max(dmax[g]);
            if (lane == 0 && g < G) A.delta[((int64_t)b * A.H + kvh * G + g) * A.cap_pages + p] = d;
        }
        __syncwarp(); /* the tile is rewritten by the next page */
    }
#pragma unroll
    for (int g = 0; g < GM; g++) {
        const float m = ekv_warp_max(runmax[g]);
        if (lane == 0) red[warp * GM + g] = m;
    }
    __syncthreads();
    if (threadIdx.x < G) {
        float m = -CUDART_INF_F;
        for (int w = 0; w < nw; w++) m = fmaxf(m, red[w * GM + threadIdx.x]);
        A.split_max[((int64_t)b * A.H + kvh * G + threadIdx.x) * 2 * A.nsplit + blockIdx.x] = m;
    }
}

struct mark_args : ekv_cuda_shape {
    const float *lo, *delta;
    const double *tau; /* [B*H] tau(l) */
    uint8_t *in_list;  /* [B*Hk][cap_pages] */
    int64_t *survivors;
    int mpages; /* pages per block */
};

enum { MARK_THREADS = 256, MARK_MAX_PAGES = 256, COMPACT_THREADS = 1024 };

__global__ void __launch_bounds__(MARK_THREADS) mark_kernel(mark_args A) {
    __shared__ int keep[MARK_MAX_PAGES];
    __shared__ double tl[EKV_CUDA_MAX_GROUP];
    __shared__ double scratch[32];
    const int row = blockIdx.y, b = row / A.Hk, kvh = row % A.Hk, G = A.G, ps = A.ps;
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    const int64_t p0 = (int64_t)blockIdx.x * A.mpages;
    if (p0 >= sg.P) return; /* the whole block */
    const int np = (int)(sg.P - p0 < A.mpages ? sg.P - p0 : A.mpages);
    const int64_t h0 = (int64_t)b * A.H + kvh * G;
    for (int i = threadIdx.x; i < np; i += blockDim.x) keep[i] = 0;
    if (threadIdx.x < G) { /* tau(l), lowered by the solve's tolerance (docs/math.md §10.3) */
        const double t = A.tau[h0 + threadIdx.x];
        tl[threadIdx.x] = t - 1e-12 * (1.0 + fabs(t));
    }
    __syncthreads();
    double cnt = 0;
    for (int i = threadIdx.x; i < np * G * ps; i += blockDim.x) {
        const int pl = i / (G * ps), g = (i / ps) % G, t = i % ps;
        const int64_t p = p0 + pl;
        if (t >= (p == sg.P - 1 ? sg.N - p * ps : ps)) continue;
        const double x = (double)A.lo[(h0 + g) * A.cap_tokens + p * ps + t] +
                         (double)A.delta[(h0 + g) * A.cap_pages + p];
        if (!(x <= tl[g])) { /* a NaN keeps its token */
            keep[pl] = 1;
            cnt += 1;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < np; i += blockDim.x)
        A.in_list[(int64_t)row * A.cap_pages + p0 + i] = keep[i] || p0 + i == sg.P - 1;
    cnt = ekv_block_sum(cnt, scratch);
    if (threadIdx.x == 0 && cnt > 0)
        atomicAdd(reinterpret_cast<unsigned long long *>(&A.survivors[row]),
                  (unsigned long long)cnt);
}

struct compact_args : ekv_cuda_shape {
    int32_t *list_pages, *list_count;
    uint8_t *in_list;
};

/* The kept pages but the last in ascending order, then the last (ekv_close_list). */
__global__ void __launch_bounds__(COMPACT_THREADS) compact_kernel(compact_args A) {
    __shared__ int wsum[32];
    const int row = blockIdx.x, b = row / A.Hk;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const int64_t n = sg.P - 1;
    uint8_t *in = A.in_list + (int64_t)row * A.cap_pages;
    int32_t *out = A.list_pages + (int64_t)row * A.cap_pages;
    const int64_t chunk = (n + blockDim.x - 1) / blockDim.x;
    const int64_t lo = (int64_t)threadIdx.x * chunk, hi = lo + chunk < n ? lo + chunk : n;
    int cnt = 0;
    for (int64_t p = lo; p < hi; p++) cnt += in[p] != 0;
    int written;
    int pos = ekv_block_exclusive_scan(cnt, wsum, &written);
    for (int64_t p = lo; p < hi; p++)
        if (in[p]) out[pos++] = (int32_t)p;
    if (threadIdx.x == 0) ekv_close_list(out, in, written, sg.P, A.list_count, row);
}

/* Warps per screen block: a w' tile [D][GM] each beside q' [G][D], within 96 KB (two blocks
 * per SM) where the shapes allow. */
int screen_warps(int G, int D, int GM) {
    const size_t fixed = (size_t)G * D * 4, per = (size_t)D * GM * 4 + GM * 4;
    int nw = EKV_CUDA_THREADS / 32;
    while (nw > 1 && fixed + nw * per > 96 * 1024) nw--;
    return nw;
}

template <int GM, int BITS>
cudaError_t launch_screen_g(const screen_args &A, dim3 grid, cudaStream_t s) {
    const int nw = screen_warps(A.G, A.D, GM);
    const size_t sm = (size_t)A.G * A.D * 4 + (size_t)nw * ((size_t)A.D * GM * 4 + GM * 4);
    static bool opted = false; /* above 48 KB needs the opt-in, once per instance */
    if (sm > 48 * 1024 && !opted) {
        const cudaError_t e = cudaFuncSetAttribute(
                screen_kernel<GM, BITS>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);
        if (e != cudaSuccess) return e;
        opted = true;
    }
    screen_kernel<GM, BITS><<<grid, nw * 32, sm, s>>>(A);
    return cudaGetLastError();
}

template <int BITS> cudaError_t launch_screen_b(const screen_args &A, dim3 grid, cudaStream_t s) {
    if (A.G == 1) return launch_screen_g<1, BITS>(A, grid, s);
    if (A.G == 2) return launch_screen_g<2, BITS>(A, grid, s);
    if (A.G <= 4) return launch_screen_g<4, BITS>(A, grid, s);
    if (A.G <= 8) return launch_screen_g<8, BITS>(A, grid, s);
    return launch_screen_g<EKV_CUDA_MAX_GROUP, BITS>(A, grid, s);
}

/* The screen kernel: the bounds into the plan's scores (l) and bounds (Delta) buffers. */
ekv_status launch_screen_bounds(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                const ekv_paged_kv *kv, const ekv_page_stats *st,
                                const ekv_page_table *t, const float *q, int batch) {
    screen_args A;
    ekv_cuda_set_shape(A, pl, t);
    A.kmin = st->kmin;
    A.kmax = st->kmax;
    A.codes = st->codes;
    A.q = q;
    A.slopes = prm->alibi_slopes;
    const double a = prm->alpha - 1.0; /* entmax only (the method table refuses alpha = 1) */
    A.qscale = a * ekv_effective_scale(prm->scale, kv->head_dim);
    A.a = (float)a;
    A.nsplit = pl->nsplit;
    A.lo = pl->scores;
    A.delta = pl->bounds;
    A.split_max = pl->split_max;
    A.cand_count = pl->cand_count;
    A.survivors = pl->survivors;
    const dim3 grid(2 * pl->nsplit, batch * A.Hk);
    const cudaError_t e = st->code_bits == 8 ? launch_screen_b<8>(A, grid, pl->stream)
                                             : launch_screen_b<4>(A, grid, pl->stream);
    if (e != cudaSuccess)
        return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "screen kernel: %s", cudaGetErrorString(e));
    pl->launches++;
    return EKV_OK;
}

/* The mark and compact kernels: the page lists from the bounds and tau(l). */
ekv_status launch_lists(ekv_cuda_plan *pl, const ekv_page_table *t, int batch) {
    mark_args M;
    ekv_cuda_set_shape(M, pl, t);
    M.lo = pl->scores;
    M.delta = pl->bounds;
    M.tau = pl->tau;
    M.in_list = pl->in_list;
    M.survivors = pl->survivors;
    int mp = 2048 / (M.G * M.ps); /* about 2048 bounds per block */
    M.mpages = mp < 1 ? 1 : mp > MARK_MAX_PAGES ? MARK_MAX_PAGES : mp;
    const int64_t chunks = (pl->cap_pages + M.mpages - 1) / M.mpages;
    mark_kernel<<<dim3((unsigned)chunks, batch * M.Hk), MARK_THREADS, 0, pl->stream>>>(M);
    EKV_CUDA_LAUNCHED(pl);
    compact_args C;
    ekv_cuda_set_shape(C, pl, t);
    C.list_pages = pl->list_pages;
    C.list_count = pl->list_count;
    C.in_list = pl->in_list;
    compact_kernel<<<batch * C.Hk, COMPACT_THREADS, 0, pl->stream>>>(C);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

} // namespace

ekv_status ekv_cuda_launch_screen(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                  const ekv_paged_kv *kv, const ekv_page_stats *st,
                                  const ekv_page_table *t, const float *q, int batch) {
    ekv_status s = launch_screen_bounds(pl, prm, kv, st, t, q, batch);
    /* tau(l): the attend stage's tau over every page and both halves of split_max */
    if (!s) s = ekv_cuda_launch_tau(pl, prm, kv, t, batch, 0, 2, NULL);
    if (!s) s = launch_lists(pl, t, batch);
    return s;
}
