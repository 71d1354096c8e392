/*
 * The screen on tensor cores (docs/math.md §10.2, "On tensor cores"; docs/architecture.md, CUDA
 * screened): the bounds, candidates and lists of the CUDA-core screen kernels (screen.cu) for
 * GQA groups of 2..16 heads, head dims 64 and 128 and page sizes that are multiples of 16.
 *
 * A warp takes one page at a time. Its lanes form the page's channel terms as the CUDA-core
 * kernels do (C0, e and the code weights w'_gc = fl(q'_gc s_c) of every head), scale each head's
 * w' by the power of two 2^sigma that lifts its largest |w'| into [2^14, 2^15) and write it as
 * f16 parts into the warp's B tile [head][channel]: one part for 4-bit codes, hi + lo for 8-bit;
 * what the parts lose is added to the bound's slack (split_rel in W_c, and smma_e). Per 16-token
 * chunk the lanes turn the 16-byte code rows (16 tokens of one channel, or channel pair) into f16
 * integers, exactly, in an A tile [channel][token] that ldmatrix.trans reads as 16 tokens (M) by
 * 16 channels (K); one mma.m16n8k16 per 16 channels, part and 8 heads (N), each from zero (as
 * the scores kernel, docs/math.md §3.1), is added in fp32; the sum times 2^-sigma plus C0 is the
 * centre, and the bounds, the running maxima and the candidates are the CUDA-core kernels'
 * (screen_common.cuh). Tokens are M, not heads: a group of up to 8 heads fills one N tile, where
 * heads as M would leave 12 of 16 rows empty at G = 4.
 */
#include "../common/launch.cuh"
#include "../common/mma.cuh"
#include "../common/ranges.cuh"
#include "../common/reduce.cuh"
#include "screen_common.cuh"
#include "../common/sizes.cuh"
#include "../common/splits.cuh"
#include <math_constants.h>

namespace {

enum { SMMA_THREADS = 128, SMMA_NW = SMMA_THREADS / 32, SMMA_SHARE = 4 };

/* f16 parts of w' per code width: 4 bits one (it widens W_c by 15 2^-11 s_c, 1.5 % of the half
 * step), 8 bits hi + lo (255 2^-22 s_c; one part would widen it by a quarter). */
template <int BITS> __host__ __device__ constexpr int smma_parts() { return BITS == 8 ? 2 : 1; }

/* A warp's shared memory: the code tile [D][16 tokens] f16, the w' parts [part][8 NT heads]
 * [D + 8] f16 (rows of heads >= G stay zero), the page's terms per head [c0, e, 2^-sigma,
 * slope][16]. */
template <int D, int BITS, int NT> struct smma_layout {
    static constexpr int P = smma_parts<BITS>(), NR = 8 * NT, PITCH = mma_qpitch<D>();
    static constexpr size_t tile = (size_t)D * 32, wp = (size_t)P * NR * PITCH * 2,
                            terms = 4 * 16 * 4, warp = tile + wp + terms;
};

/* Byte offset of half h (tokens 8h .. 8h + 7) of row r of the code tile: the halves swap every
 * 4 rows, so that the 8 rows one ldmatrix phase reads fall in 8 different bank groups. */
__device__ __forceinline__ int ctile_off(int r, int h) {
    return r * 32 + ((h ^ ((r >> 2) & 1)) << 4);
}

/* Two f16 in a register less 1024 each (exact: the results are small integers). */
__device__ __forceinline__ uint32_t less1024(uint32_t v) {
    const __half2 k = __half2half2(__ushort_as_half((unsigned short)0x6400u));
    const __half2 r = __hsub2(*reinterpret_cast<const __half2 *>(&v), k);
    return *reinterpret_cast<const uint32_t *>(&r);
}

/* Four codes (the bytes of w, each < 256) as two f16 pairs, exactly: the f16 0x64cc is
 * 1024 + c (10 mantissa bits), less 1024. */
__device__ __forceinline__ uint2 codes4_f16(uint32_t w) {
    return make_uint2(less1024(__byte_perm(w, 0x64646464u, 0x4140u)),
                      less1024(__byte_perm(w, 0x64646464u, 0x4342u)));
}

/* One code row (16 tokens of one channel, bytes < 256) into row r of the tile as f16. */
__device__ __forceinline__ void tile_row(unsigned char *tile, int r, uint4 v) {
    const uint2 t0 = codes4_f16(v.x), t1 = codes4_f16(v.y), t2 = codes4_f16(v.z),
                t3 = codes4_f16(v.w);
    *reinterpret_cast<uint4 *>(tile + ctile_off(r, 0)) = make_uint4(t0.x, t0.y, t1.x, t1.y);
    *reinterpret_cast<uint4 *>(tile + ctile_off(r, 1)) = make_uint4(t2.x, t2.y, t3.x, t3.y);
}

/* The lane's code rows j = lane + 32 i of a 16-token chunk (blk: the chunk's first slot). */
template <int R>
__device__ __forceinline__ void load_code_rows(const uint8_t *blk, int ps, uint4 *cw) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < R / 32; i++)
        cw[i] = __ldg(reinterpret_cast<const uint4 *>(blk + (int64_t)(lane + 32 * i) * ps));
}

/* The rows into the tile: 8 bits, row j is channel j; 4 bits, channels 2j (low nibbles) and
 * 2j + 1 (high nibbles). */
template <int BITS, int R>
__device__ __forceinline__ void fill_code_tile(const uint4 *cw, unsigned char *tile) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < R / 32; i++) {
        const int j = lane + 32 * i;
        if (BITS == 8) {
            tile_row(tile, j, cw[i]);
        } else {
            const uint32_t m = 0x0F0F0F0Fu;
            const uint4 v = cw[i];
            tile_row(tile, 2 * j, make_uint4(v.x & m, v.y & m, v.z & m, v.w & m));
            tile_row(tile, 2 * j + 1,
                     make_uint4(v.x >> 4 & m, v.y >> 4 & m, v.z >> 4 & m, v.w >> 4 & m));
        }
    }
}

/* e of one head (page_e) plus what the f16 parts lose below f16's normal range: at most 2^-24
 * per scaled weight, D (2^b - 1) 2^-24 uns over the page's codes (uns = 2^-sigma), added in
 * double and rounded up (docs/math.md §10.2, "On tensor cores"). */
__device__ __forceinline__ float smma_e(float ep, int D, int bits, float slope, int64_t p, int ps,
                                        int64_t N, float uns) {
    const double lost = (double)D * (double)((1 << bits) - 1) * 0x1p-24 * (double)uns;
    return __double2float_ru((double)page_e(ep, D, slope, p, ps, N) + lost);
}

/* Sums V (a power of two, 2..32) values over the warp, leaving lane L the sum of value
 * L >> (5 - log2 V): recursive halving over the lane's high bits, then full sums. */
template <int V> __host__ __device__ constexpr int log2_of() {
    return V >= 32 ? 5 : V >= 16 ? 4 : V >= 8 ? 3 : V >= 4 ? 2 : 1;
}
template <int V> __device__ __forceinline__ float warp_reduce_scatter(float *v) {
    const int lane = threadIdx.x & 31;
    constexpr int LV = log2_of<V>();
    scatter_level<V / 2>(v, (lane & 16) != 0, 16);
    if constexpr (LV >= 2) scatter_level<V / 4>(v, (lane & 8) != 0, 8);
    if constexpr (LV >= 3) scatter_level<V / 8>(v, (lane & 4) != 0, 4);
    if constexpr (LV >= 4) scatter_level<V / 16>(v, (lane & 2) != 0, 2);
    if constexpr (LV >= 5) scatter_level<V / 32>(v, (lane & 1) != 0, 1);
    float x = v[0];
#pragma unroll
    for (int o = 16 >> LV; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* The page's channel terms (lanes over channel pairs 2 lane + 64 i): w' of every head scaled
 * and split into the warp's B tile, C0, e and 2^-sigma per head into ht. Returns whether every
 * step and centre of the page is finite (warp-uniform). */
template <int D, int BITS, int GM>
__device__ __forceinline__ int smma_terms(const screen_args &A, const float *qs, __half *wp,
                                          float *ht, int64_t so, int64_t p, int64_t N) {
    constexpr int P = smma_parts<BITS>(), CP = D / 64, NR = 8 * (GM > 8 ? 2 : 1);
    constexpr int PITCH = mma_qpitch<D>();
    const int lane = threadIdx.x & 31, G = A.G;
    const float gamma = 4.0f * (float)(D + 4) * SCREEN_U;
    float c0[GM], ep[GM], w[CP][2][GM];
#pragma unroll
    for (int g = 0; g < GM; g++) c0[g] = ep[g] = 0.f;
    int ok = 1;
#pragma unroll
    for (int i = 0; i < CP; i++) {
        const int c = 2 * lane + 64 * i;
        float mn[2], mx[2];
        ekv_range_load<2>(A.rng, false, so + c, mn);
        ekv_range_load<2>(A.rng, true, so + c, mx);
        channel_terms<GM, BITS, P>(qs, D, G, c, mn[0], mx[0], gamma, w[i][0], c0, ep, ok);
        channel_terms<GM, BITS, P>(qs, D, G, c + 1, mn[1], mx[1], gamma, w[i][1], c0, ep, ok);
    }
    __syncwarp(); /* the last page's mma have read the B tile */
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= G) break;
        unsigned mb = 0u; /* the largest |w'| as bits (ordered as integers; NaN above inf) */
#pragma unroll
        for (int i = 0; i < CP; i++)
            mb = max(mb,
                     max(__float_as_uint(fabsf(w[i][0][g])), __float_as_uint(fabsf(w[i][1][g]))));
        mb = __reduce_max_sync(0xffffffffu, mb);
        /* 2^sigma |w'| in [2^14, 2^15) for the largest; sigma in [-126, 126] (inf, NaN: -114) */
        const int sigma = min(126, max(-126, 141 - (int)(mb >> 23)));
        const float sc = __int_as_float((127 + sigma) << 23);
#pragma unroll
        for (int i = 0; i < CP; i++) {
            const int c = 2 * lane + 64 * i;
            const float x0 = w[i][0][g] * sc, x1 = w[i][1][g] * sc; /* exact: powers of two */
            const __half2 hi = __floats2half2_rn(x0, x1);
            *reinterpret_cast<__half2 *>(wp + (size_t)g * PITCH + c) = hi;
            if (P == 2) { /* x - hi is exact in fp32 */
                const float2 hf = __half22float2(hi);
                *reinterpret_cast<__half2 *>(wp + (size_t)(NR + g) * PITCH + c) =
                        __floats2half2_rn(x0 - hf.x, x1 - hf.y);
            }
        }
        if (lane == 0) ht[32 + g] = __int_as_float((127 - sigma) << 23); /* 2^-sigma */
    }
    /* C0 and e of every head at once: lane L gets value L >> (5 - log2 2GM) (c0 of heads 0..GM,
     * then ep), and the lanes holding an ep form that head's e */
    float v[2 * GM];
#pragma unroll
    for (int g = 0; g < GM; g++) {
        v[g] = c0[g];
        v[GM + g] = ep[g];
    }
    float x = warp_reduce_scatter<2 * GM>(v);
    constexpr int LV = log2_of<2 * GM>();
    const int idx = lane >> (5 - LV), h = idx < GM ? idx : idx - GM;
    __syncwarp(); /* 2^-sigma is in ht */
    if (idx >= GM && h < G) x = smma_e(x, D, BITS, ht[48 + h], p, A.ps, N, ht[32 + h]);
    if (h < G && (lane & ((1 << (5 - LV)) - 1)) == 0) ht[(idx < GM ? 0 : 16) + h] = x;
    return __all_sync(0xffffffffu, ok);
}

/* acc[nt][i] = sum_c w'_gc code_tc (scaled by 2^sigma_g) for the lane's C-fragment slots of the
 * chunk: tokens lane/4 and lane/4 + 8 (i / 2), heads nt 8 + 2 (lane % 4) + i % 2. */
template <int D, int NT, int P>
__device__ __forceinline__ void smma_dots(const unsigned char *tile, const __half *wp,
                                          float (*acc)[4]) {
    constexpr int NR = 8 * NT, PITCH = mma_qpitch<D>();
    const int lane = threadIdx.x & 31, mi = lane >> 3, mj = lane & 7;
    const int qrow = lane >> 2, qcol = (lane & 3) * 2;
    mma_zero<NT>(acc);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        /* matrices: tokens 0-7 / 8-15 (mi & 1) by channels kk 16 + 0-7 / 8-15 (mi >> 1) */
        uint32_t a[4];
        ldmatrix_x4<true>(a, tile + ctile_off(kk * 16 + mj + 8 * (mi >> 1), mi & 1));
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int part = 0; part < P; part++) {
                const __half *bp =
                        wp + (size_t)(part * NR + nt * 8 + qrow) * PITCH + kk * 16 + qcol;
                float c[4];
                mma_16816<__half>(c, a, *reinterpret_cast<const uint32_t *>(bp),
                                  *reinterpret_cast<const uint32_t *>(bp + 8));
#pragma unroll
                for (int i = 0; i < 4; i++) acc[nt][i] += c[i];
            }
    }
}

/* The chunk's bounds (slots ch + lane/4 + 8 h of the lane's heads), then per head of the group
 * the running maxima and the candidates (warp-uniform calls). */
template <int GM, int NT>
__device__ __forceinline__ void smma_bounds(const screen_args &A, const float (*acc)[4],
                                            const float *ht, int ok, int64_t h0, int ch, int valid,
                                            float jpos, int64_t tok0, float *runmax,
                                            const float *seen, bool emit) {
    const int lane = threadIdx.x & 31;
    float l[NT][4], u[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int g = nt * 8 + 2 * (lane & 3) + (i & 1), ts = ch + (lane >> 2) + 8 * (i >> 1);
            token_bounds(ht[g] + acc[nt][i] * ht[32 + g], ht[16 + g], ht[48 + g], jpos, ts, ok,
                         &l[nt][i], &u[nt][i]);
        }
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= A.G) break;
        const bool mine = (lane & 3) == ((g & 7) >> 1);
        bool on[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            on[h] = mine && ch + (lane >> 2) + 8 * h < valid;
            if (on[h]) runmax[g] = fmaxf(runmax[g], l[g >> 3][2 * h + (g & 1)]);
        }
        if (!emit) continue;
        /* screen_emit's keep test u > max(M' - 1, screen_cut) once per head and chunk, the cut
         * rounded down to fp32 (a lower cut keeps more: never fewer) */
        const float cut = __double2float_rd(
                fmax((double)fmaxf(runmax[g], seen[g]) - 1.0, (double)screen_cut[g]));
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int i = 2 * h + (g & 1);
            screen_append(A, h0 + g, on[h] && !(u[g >> 3][i] <= cut), l[g >> 3][i], u[g >> 3][i],
                          tok0 + ch + (lane >> 2) + 8 * h);
        }
    }
}

/* The warp's next page (pn) into L2: lanes 0-7 its codes, 8-15 its minima, 16-23 its maxima. */
__device__ __forceinline__ void smma_prefetch(const screen_args &A, const ekv_seq_geom &sg,
                                              int64_t pn, int64_t e1, int kvh, int64_t cb) {
    if (pn >= e1) return;
    const int lane = threadIdx.x & 31, q = lane & 7, grp = lane >> 3;
    const int64_t ph = A.t.indices[sg.first + pn], so = (ph * A.Hk + kvh) * A.D;
    if (grp == 0)
        prefetch_quarter(A.codes + (ph * A.Hk + kvh) * cb, cb, q);
    else if (grp < 3)
        prefetch_quarter(ekv_range_addr(A.rng, grp == 2, so), A.D * A.rng.elem, q);
}

/* One page: its terms, then its 16-token chunks through the tile and the mma. */
template <int D, int BITS, int GM>
__device__ __forceinline__ void smma_page(const screen_args &A, const float *qs,
                                          unsigned char *tile, __half *wp, float *ht, int64_t p,
                                          int64_t phys, int valid, const ekv_seq_geom &sg, int kvh,
                                          int64_t h0, float *runmax, const float *seen, bool emit) {
    constexpr int R = D * BITS / 8, NT = GM > 8 ? 2 : 1;
    const int ps = A.ps;
    const uint8_t *blk = A.codes + (phys * A.Hk + kvh) * (int64_t)ps * R;
    uint4 cw[R / 32];
    load_code_rows<R>(blk, ps, cw); /* in flight while the terms are formed */
    const int ok = smma_terms<D, BITS, GM>(A, qs, wp, ht, (phys * A.Hk + kvh) * D, p, sg.N);
    const float jpos = (float)(p * ps - (sg.N - 1));
    for (int ch = 0; ch < valid; ch += 16) { /* chunks past the last token: none */
        if (ch > 0) load_code_rows<R>(blk + ch, ps, cw);
        __syncwarp(); /* the last chunk's ldmatrix have read the tile */
        fill_code_tile<BITS, R>(cw, tile);
        __syncwarp(); /* the tile, the B tile and the terms are written */
        float acc[NT][4];
        smma_dots<D, NT, smma_parts<BITS>()>(tile, wp, acc);
        smma_bounds<GM, NT>(A, acc, ht, ok, h0, ch, valid, jpos, p * ps, runmax, seen, emit);
    }
}

template <int D, int BITS, int GM>
__global__ void __launch_bounds__(SMMA_THREADS) screen_mma_kernel(screen_args A) {
    ekv_grid_begin();
    typedef smma_layout<D, BITS, (GM > 8 ? 2 : 1)> L;
    extern __shared__ __align__(16) unsigned char smem_raw[]; /* q' [G][D], then the warps' */
    const ekv_split sp = ekv_block_split(A.t, A.sbase, A.sbase * A.t.batch);
    if (sp.b < 0) return;
    const int b = sp.b, kvh = blockIdx.y, row = b * A.Hk + kvh, G = A.G, ps = A.ps;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float *qs = reinterpret_cast<float *>(smem_raw);
    unsigned char *tile = smem_raw + (size_t)G * D * 4 + (size_t)warp * L::warp;
    __half *wp = reinterpret_cast<__half *>(tile + L::tile);
    float *ht = reinterpret_cast<float *>(tile + L::tile + L::wp);
    if (!screen_prologue(A, sp.s, row, b, kvh, qs)) return;
    for (int i = lane; i < (int)(L::wp / 16); i += 32)
        reinterpret_cast<uint4 *>(wp)[i] = make_uint4(0u, 0u, 0u, 0u);
    float runmax[GM], seen[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) runmax[g] = seen[g] = -CUDART_INF_F;
    if (lane < 16) { /* the slopes; heads >= G: zero terms, never written again */
        ht[lane] = ht[16 + lane] = 0.f;
        ht[32 + lane] = 1.f;
        ht[48 + lane] = lane < G && A.slopes ? A.a * A.slopes[kvh * G + lane] : 0.f;
    }
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    int64_t e0, e1;
    ekv_split_range(sp, 0, sg.P, &e0, &e1);
    const int64_t h0 = (int64_t)b * A.H + kvh * G, cb = (int64_t)ps * (D * BITS / 8);
    uint32_t pre[GM];
    int since = 0;                             /* pages since the maxima were last shared */
    for (int64_t k = A.pass2 ? 0 : -1;; k++) { /* k = -1: a dry pass, as the fast kernel */
        const int64_t p = e0 + warp + (k < 0 ? 0 : k) * nw;
        if (p >= e1) break;
        if (since == 0) ekv_peek_max<GM>(A.lkey + h0, G, pre);
        smma_prefetch(A, sg, p + nw, e1, kvh, cb);
        const int valid = p == sg.P - 1 ? (int)(sg.N - p * ps) : ps;
        smma_page<D, BITS, GM>(A, qs, tile, wp, ht, p, A.t.indices[sg.first + p], valid, sg, kvh,
                               h0, runmax, seen, k >= 0);
        /* the maxima every SMMA_SHARE pages (a page is a fast kernel's quarter), after the dry
         * pass and after the warp's last page */
        if (k < 0 || ++since == SMMA_SHARE || p + nw >= e1) {
            ekv_share_max<GM>(runmax, seen, A.lkey + h0, G, pre);
            since = 0;
        }
    }
}

template <int D, int BITS, int GM>
cudaError_t launch_smma(const screen_args &A, int sms, int rows, const ekv_launch_stream &s) {
    constexpr auto kernel = screen_mma_kernel<D, BITS, GM>;
    static int per_sm = 0;
    const size_t sm = (size_t)A.G * D * 4 + SMMA_NW * smma_layout<D, BITS, (GM > 8 ? 2 : 1)>::warp;
    const cudaError_t e = ekv_cuda_allow_smem<kernel>(sm);
    if (e != cudaSuccess) return e;
    screen_args B = A; /* splits per row proportional to length (ekv_seq_splits) */
    B.sbase = ekv_cuda_one_wave(kernel, SMMA_THREADS, sm, rows, sms, &per_sm);
    ekv_launch(s, kernel, dim3(ekv_cuda_split_grid(B.sbase, A.t.batch), rows / A.t.batch),
               SMMA_THREADS, sm, B);
    return cudaGetLastError();
}

template <int D, int BITS>
cudaError_t launch_smma_d(const screen_args &A, int sms, int rows, const ekv_launch_stream &s) {
    return ekv_cuda_with_group(A.G, [&](auto tg) {
        constexpr int GM = decltype(tg)::value;
        if constexpr (GM == 1)
            return cudaErrorInvalidValue; /* G = 1 is the CUDA-core kernels' (applies) */
        else
            return launch_smma<D, BITS, GM>(A, sms, rows, s);
    });
}

} // namespace

bool ekv_cuda_screen_mma_applies(int G, int D, int ps) {
    return G >= 2 && G <= EKV_CUDA_MAX_GROUP && (D == 64 || D == 128) && ps % 16 == 0;
}

cudaError_t ekv_cuda_screen_mma(const screen_args &A, int code_bits, int sms, int rows,
                                const ekv_launch_stream &s) {
    if (A.D == 64)
        return code_bits == 8 ? launch_smma_d<64, 8>(A, sms, rows, s)
                              : launch_smma_d<64, 4>(A, sms, rows, s);
    return code_bits == 8 ? launch_smma_d<128, 8>(A, sms, rows, s)
                          : launch_smma_d<128, 4>(A, sms, rows, s);
}
