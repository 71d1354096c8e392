/*
 * Screened decode on the GPU, on token rows (mirrors src/cpu/stages/screen_rows.c and the CPU's row
 * attention; docs/math.md §10), with no host round trip:
 *   memset:  the step's counters (the running maxima as ordered keys, the candidate counts).
 *   screen:  grid (page chunk, sequence x KV head). The fast kernel (page size a multiple of 16,
 *            groups up to 4, head dims with whole 16-byte code rows per lane) gives each page a
 *            quarter warp: its 8 lanes take the page's code rows (the block layout of
 *            src/core/codes.h puts 16 consecutive tokens of one channel (pair) in 16 consecutive
 *            bytes: one 16-byte load), form those channels' terms from the range in registers,
 *            add w'_c code_tc for the 16 tokens and every head of the group, and a reduce-scatter
 *            over the quarter leaves each lane two tokens. The generic kernel (other shapes) is
 *            version 1's warp per page. GQA groups of 2..16 heads (D 64 or 128, pages of
 *            multiples of 16) take the tensor-core kernel instead (screen_mma.cu); screen_kind
 *            chooses, in one place. All bound every token (l, u per head, docs/math.md
 *            §10.2) and keep only the candidates u > M' - 1, M' the largest l any warp has
 *            published (§10.3 Claim 3), appended with l, u and the token to the head's list.
 *   retry:   only in a plan whose lists hold fewer entries than its tokens (the plan's
 *            screen_list_bytes), and there only for heads whose list overflowed (iid keys:
 *            most tokens pass u > M' - 1):
 *            F(t) = sum [l - t]_+^beta over the kept l at t_k = M - 1 + k / 64 (grid (chunk,
 *            head), summed atomically); the largest t_k with F > 1 is below tau of the kept l,
 *            a lower bound of tau(l) (a subset's tau, docs/math.md §10.3). The screen runs
 *            again for those heads only (the others' blocks return at once) and keeps
 *            u > max(M - 1, t_k) (lowered by the solve's tolerance, rounded down): every token
 *            with l or u above tau(l), so tau(l) and the survivors come out as before.
 *   tau(l), survivors, rows: survivors.cu (over splits of each head's list and of each KV
 *            head's bitmap).
 *   then the exact scores of those rows only (stages/scores.cu, candidates z >= M' - 1 listed on
 *   the way), tau over the candidates (stages/tau.cu: a head whose list overflowed has it
 *   rebuilt over every split from the candidates' histogram) and V of the support
 *   (stages/values.cu).
 * The bound is version 1's (and the CPU's) in its terms: W_c covers the code error, the score
 * kernel's rounding in any summation order and this kernel's, 2 E_p the ALiBi terms of both,
 * and the centre z^ = (C0 + sum_c w'_c code_c) + bias is widened by E = e + 8u (|z^| + e) for
 * its last roundings. With l = fl(z^ - E): z <= l + (2 + u) E, so u = l + fl(E (2 + 2^-21))
 * rounded up bounds z; a page whose range is not finite, or a bound that is not, keeps its
 * tokens (l = -inf, u = +inf).
 */
#include "../common/launch.cuh"
#include "../common/plan.cuh"
#include "../common/ranges.cuh"
#include "../common/reduce.cuh"
#include "../stages/scores.cuh"
#include "screen.cuh"
#include "screen_common.cuh"
#include "../common/sizes.cuh"
#include "../common/splits.cuh"
#include "../stages/tau.cuh"
#include "../common/tau_solve.cuh"
#include "../common/test_hooks.h" /* the read-backs defined here */
#include "../stages/values.cuh"
#include "../../core/codes.h"
#include "../../core/geometry.h"
#include <math_constants.h>

namespace {

/* A code byte of word w (byte k) as fp32, exactly: 2^23 + c has c in its low mantissa bits. */
__device__ __forceinline__ float code_b(uint32_t w, int k) {
    return __uint_as_float(__byte_perm(w, 0x4B00u, 0x5440u | (unsigned)k)) - 8388608.0f;
}

/* acc[t GM + g] += w'_g code_t over one 16-token code row (4 bits: channels 2j in the low and
 * 2j + 1 in the high nibbles, weights wq0 and wq1; 8 bits: channel j, wq0). */
template <int GM, int BITS>
__device__ __forceinline__ void row_fma(uint4 cw, const float *wq0, const float *wq1, float *acc) {
    const uint32_t w4[4] = {cw.x, cw.y, cw.z, cw.w};
#pragma unroll
    for (int wi = 0; wi < 4; wi++) {
        const uint32_t lo = BITS == 8 ? w4[wi] : w4[wi] & 0x0F0F0F0Fu;
        const uint32_t hi = (w4[wi] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int t = 4 * wi + k;
            const float x0 = code_b(lo, k);
#pragma unroll
            for (int g = 0; g < GM; g++) acc[t * GM + g] = fmaf(wq0[g], x0, acc[t * GM + g]);
            if (BITS == 4) {
                const float x1 = code_b(hi, k);
#pragma unroll
                for (int g = 0; g < GM; g++) acc[t * GM + g] = fmaf(wq1[g], x1, acc[t * GM + g]);
            }
        }
    }
}

/* Sums V values over the 8 lanes of a quarter warp, leaving lane q the values [q V/8, (q+1) V/8)
 * in v[0 .. V/8) (recursive halving; every index a constant, so v stays in registers). */
template <int V> __device__ __forceinline__ void quarter_reduce_scatter(float *v, int q) {
    scatter_level<V / 2>(v, (q & 4) != 0, 4);
    scatter_level<V / 4>(v, (q & 2) != 0, 2);
    scatter_level<V / 8>(v, (q & 1) != 0, 1);
}

/* Sums over the 8 lanes of a quarter warp (every lane gets it). */
__device__ __forceinline__ float quarter_sum(float x) {
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* One 16-token chunk (slots ch .. ch + 15) of the quarter's page: the code rows j = q + 8 k of
 * this lane, RB of them per batch, then the reduce-scatter; this lane's two tokens' bounds go
 * to the candidate lists. */
template <int GM, int BITS, int RB, int RT>
__device__ __forceinline__ void fast_chunk(const screen_args &A, const float *qs, int q, bool live,
                                           int64_t p, int64_t phys, int valid, int ch,
                                           const ekv_seq_geom &sg, int kvh, int64_t h0,
                                           const float *slope,
                                           float *runmax, const float *seen, bool emit) {
    const int D = A.D, G = A.G, ps = A.ps, R = D * BITS / 8;
    const float gamma = 4.0f * (float)(D + 4) * SCREEN_U;
    const int64_t so = (phys * A.Hk + kvh) * D;
    const uint8_t *blk = A.codes + (phys * A.Hk + kvh) * (int64_t)ps * R + ch;
    float acc[16 * GM], c0[GM], ep[GM];
#pragma unroll
    for (int i = 0; i < 16 * GM; i++) acc[i] = 0.f;
#pragma unroll
    for (int g = 0; g < GM; g++) c0[g] = ep[g] = 0.f;
    int ok = 1;
    for (int k0 = 0; k0 < R / 8; k0 += RB) {
        uint4 cw[RB];
        float2 mn[RB], mx[RB];
#pragma unroll
        for (int r = 0; r < RB; r++) {
            const int j = q + 8 * (k0 + r);
            cw[r] = make_uint4(0, 0, 0, 0);
            mn[r] = mx[r] = make_float2(0.f, 0.f);
            if (!live) continue;
            cw[r] = __ldg(reinterpret_cast<const uint4 *>(blk + (int64_t)j * ps));
            float lo2[2] = {0.f, 0.f}, hi2[2] = {0.f, 0.f};
            if (BITS == 4) {
                ekv_range_load<2, RT>(A.rng, false, so + 2 * j, lo2);
                ekv_range_load<2, RT>(A.rng, true, so + 2 * j, hi2);
            } else {
                ekv_range_load<1, RT>(A.rng, false, so + j, lo2);
                ekv_range_load<1, RT>(A.rng, true, so + j, hi2);
            }
            mn[r] = make_float2(lo2[0], lo2[1]);
            mx[r] = make_float2(hi2[0], hi2[1]);
        }
#pragma unroll
        for (int r = 0; r < RB; r++) {
            const int j = q + 8 * (k0 + r);
            float wq0[GM], wq1[GM];
            channel_terms<GM, BITS>(qs, D, G, BITS == 4 ? 2 * j : j, mn[r].x, mx[r].x, gamma, wq0,
                                    c0, ep, ok);
            if (BITS == 4)
                channel_terms<GM, BITS>(qs, D, G, 2 * j + 1, mn[r].y, mx[r].y, gamma, wq1, c0, ep,
                                        ok);
            row_fma<GM, BITS>(cw[r], wq0, wq1, acc);
        }
    }
    quarter_reduce_scatter<16 * GM>(acc, q);
#pragma unroll
    for (int g = 0; g < GM; g++) {
        c0[g] = quarter_sum(c0[g]);
        ep[g] = quarter_sum(ep[g]);
    }
    const unsigned okm = __ballot_sync(0xffffffffu, ok); /* every channel of this page */
    ok = ((okm >> ((threadIdx.x & 31) & ~7)) & 0xffu) == 0xffu;
    const float jpos = (float)(p * ps - (sg.N - 1));
    unsigned m[2][GM]; /* this lane's two tokens, kept (screen_keeps) after every head's bounds */
    float lb[2][GM], ub[2][GM];
    const int64_t tok[2] = {p * ps + ch + 2 * q, p * ps + ch + 2 * q + 1};
#pragma unroll
    for (int g = 0; g < GM; g++) {
        m[0][g] = m[1][g] = 0u;
        lb[0][g] = lb[1][g] = ub[0][g] = ub[1][g] = 0.f;
        if (g >= G) continue;
        const float e = page_e(ep[g], D, slope[g], p, ps, sg.N);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int ts = ch + 2 * q + i;
            const bool on = live && ts < valid;
            token_bounds(c0[g] + acc[i * GM + g], e, slope[g], jpos, ts, ok, &lb[i][g], &ub[i][g]);
            if (on) runmax[g] = fmaxf(runmax[g], lb[i][g]);
            if (emit)
                m[i][g] = __ballot_sync(0xffffffffu,
                                        screen_keeps(g, on, ub[i][g], fmaxf(runmax[g], seen[g])));
        }
    }
    if (emit) screen_append_pass<2, GM>(A, h0, G, m, lb, ub, tok);
}

/* The page box (docs/math.md §10.4, "The page box in the screen") of the quarter's page: true
 * when no token of it can be kept by any head of the group, U_g <= max(M'_g - 1, screen_cut[g])
 * for every head g < G, with M'_g a max of l the warp knows: seen[g] and the keys it peeked this
 * round (pre, lane 0's; the keep test's cut or below it, so a dropped page holds no token the
 * screen would keep). U_g = box + (gamma + gamma_2) sum_c |q'_c| A_c (1 + 2 gamma) + D nu + the
 * largest ALiBi term of the page's valid slots + 2 E_p: box = sum_c max(q'_c m_c, q'_c M_c) in
 * fp32 in any order; every fp32 score of the page is at most U_g. Lane q reads the ranges of its
 * code rows' channels, as fast_chunk does. False for a dead quarter, and where U is not finite
 * (token_bounds keeps such tokens). Warp-uniform call. */
template <int GM, int BITS, int RT>
__device__ bool fast_page_below(const screen_args &A, const float *qs, int q, bool live, int64_t p,
                                int64_t phys, int valid, const ekv_seq_geom &sg, int kvh,
                                const float *slope, const float *seen, const uint32_t *pre) {
    const int D = A.D, G = A.G, R = D * BITS / 8;
    const int64_t so = (phys * A.Hk + kvh) * D;
    float box[GM], qa[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) box[g] = qa[g] = 0.f;
    for (int k = 0; live && k < R / 8; k++) {
        const int j = q + 8 * k;
        float lo2[2] = {0.f, 0.f}, hi2[2] = {0.f, 0.f};
        ekv_range_load<BITS == 4 ? 2 : 1, RT>(A.rng, false, so + (BITS == 4 ? 2 * j : j), lo2);
        ekv_range_load<BITS == 4 ? 2 : 1, RT>(A.rng, true, so + (BITS == 4 ? 2 * j : j), hi2);
#pragma unroll
        for (int i = 0; i < (BITS == 4 ? 2 : 1); i++) {
            const int c = BITS == 4 ? 2 * j + i : j;
            const float Ac = fmaxf(fabsf(lo2[i]), fabsf(hi2[i]));
#pragma unroll
            for (int g = 0; g < GM; g++) {
                const float qv = g < G ? qs[g * D + c] : 0.f;
                box[g] += fmaxf(qv * lo2[i], qv * hi2[i]);
                qa[g] += fabsf(qv) * Ac;
            }
        }
    }
    const double u = 0x1p-24, gam = 4.0 * (D + 4) * u, gam2 = 4.0 * (2 * D + 4) * u;
    const float jpos = (float)(p * A.ps - (sg.N - 1));
    bool below = live;
#pragma unroll
    for (int g = 0; g < GM; g++) {
        const float b = quarter_sum(box[g]), a = quarter_sum(qa[g]); /* every lane, every g */
        const float known = fmaxf(seen[g], ekv_key_float(__shfl_sync(0xffffffffu, pre[g], 0)));
        if (g >= G) continue;
        /* the page's largest ALiBi term: at its newest valid slot for slopes >= 0 */
        const float bias = fmaxf(slope[g] * jpos, slope[g] * (jpos + (float)(valid - 1)));
        const double U = (double)b + (gam + gam2) * (double)a * (1.0 + 2.0 * gam) +
                         (double)D * 0x1p-140 + (double)bias +
                         16.0 * u * (1.0 + 0x1p-20) * fabs((double)slope[g]) *
                                 ((double)llabs(p * A.ps - (sg.N - 1)) + (double)A.ps);
        below &= U - U == 0.0 && U <= fmax((double)known - 1.0, (double)screen_cut[g]);
    }
    return below;
}

/* Whether the fast kernel's warp still tries the page box: only on a group with an ALiBi term
 * (elsewhere old pages are not below), and, as the CPU screen, not once fewer than one page in
 * eight of its first 64 tried fell below. Warp-uniform (counts from ballots). count adds the
 * pages dropped to *dropped_pages (the first pass's only: NULL in the retry). */
struct page_box_state {
    bool trying;
    int tried, dropped;
    __device__ void count(bool live, bool below, uint32_t *dropped_pages) {
        const unsigned first = 0x01010101u; /* lane 0 of each quarter */
        const int t = __popc(__ballot_sync(0xffffffffu, live) & first),
                  d = __popc(__ballot_sync(0xffffffffu, below) & first);
        tried += t;
        dropped += d;
        if ((threadIdx.x & 31) == 0 && d && dropped_pages) atomicAdd(dropped_pages, (uint32_t)d);
        trying = tried < 64 || 8 * dropped >= tried;
    }
};

/* The fast kernel's blocks: 4 warps, 3 per SM (170 registers: its tiles do not spill). */
enum { FAST_THREADS = 128, FAST_MIN_BLOCKS = 3 }; /* 2 (no spills, 8 warps) measured no faster */
/* Blocks a row: two waves' worth, so that where the page box drops most of one KV head's pages
 * (layer 0 of the model's trace drops 16335 of 32768 (page, KV head) pairs) the block scheduler
 * hands the idle SMs the other head's blocks. Layer 0 / layer 7 of the 256K trace: screened
 * 2.2 % / 2.6 % faster than one wave on an H100; 4 and 8 waves were slower (bench/RESULTS.md,
 * fifteenth session). */
enum { FAST_WAVES = 2 };

template <int GM, int BITS, int RB, int RT>
__global__ void __launch_bounds__(FAST_THREADS, FAST_MIN_BLOCKS) screen_fast_kernel(screen_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(16) float smem[]; /* q' [G][D] */
    const ekv_split sp = ekv_block_split(A.t, A.sbase, A.sbase * A.t.batch);
    if (sp.b < 0) return;
    const int b = sp.b, kvh = blockIdx.y, row = b * A.Hk + kvh, G = A.G, ps = A.ps;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int qd = lane >> 3, q = lane & 7;
    if (!screen_prologue(A, sp.s, row, b, kvh, smem)) return;
    const ekv_seq_geom sg = ekv_seq(A.t, b, ps);
    const int64_t per = ((sg.P + sp.n - 1) / sp.n + 3) / 4 * 4;
    const int64_t e0 = (int64_t)sp.s * per, e1 = e0 + per < sg.P ? e0 + per : sg.P;
    const int64_t h0 = (int64_t)b * A.H + kvh * G;
    const int64_t cb = (int64_t)ps * (A.D * BITS / 8);
    float slope[GM], runmax[GM], seen[GM];
    page_box_state box = {false, 0, 0};
#pragma unroll
    for (int g = 0; g < GM; g++) {
        slope[g] = g < G && A.slopes ? A.a * A.slopes[kvh * G + g] : 0.f;
        runmax[g] = seen[g] = -CUDART_INF_F;
        box.trying |= slope[g] != 0.f;
    }
    /* k = -1: a dry pass over the warp's first pages, which only publishes their maxima, so
     * that the first candidates are kept against maxima from the whole first wave (the retry
     * pass knows the final maxima: no dry pass) */
    for (int64_t k = A.pass2 ? 0 : -1;; k++) {
        const int64_t p0 = e0 + 4 * warp + (k < 0 ? 0 : k) * 4 * nw;
        if (p0 >= e1) break;
        uint32_t pre[GM];
        ekv_peek_max<GM>(A.lkey + h0, G, pre);
        const int64_t p = p0 + qd, pn = p + 4 * nw;
        const bool live = p < e1;
        if (pn < e1) { /* the warp's next pages into L2 (their codes only where the page box is
                        * not tried: a dropped page's codes are never read) */
            const int64_t ph = A.t.indices[sg.first + pn], so = (ph * A.Hk + kvh) * A.D;
            if (!box.trying) prefetch_quarter(A.codes + (ph * A.Hk + kvh) * cb, cb, q);
            prefetch_quarter(ekv_range_addr(A.rng, false, so), A.D * A.rng.elem, q);
            prefetch_quarter(ekv_range_addr(A.rng, true, so), A.D * A.rng.elem, q);
        }
        const int64_t phys = live ? A.t.indices[sg.first + p] : 0;
        const int valid = !live ? 0 : p == sg.P - 1 ? (int)(sg.N - p * ps) : ps;
        bool keep = live;           /* the quarter's page screened: not dropped by the page box */
        if (box.trying && k >= 0) { /* the dry pass publishes every first page's maxima */
            const bool below = fast_page_below<GM, BITS, RT>(A, smem, q, live, p, phys, valid, sg,
                                                             kvh, slope, seen, pre);
            box.count(live, below, A.pass2 ? nullptr : A.dropped + row); /* the first pass's */
            keep = live && !below;
        }
        if (__any_sync(0xffffffffu, keep))
            for (int ch = 0; ch < ps; ch += 16)
                fast_chunk<GM, BITS, RB, RT>(A, smem, q, keep, p, phys, valid, ch, sg, kvh, h0,
                                             slope, runmax, seen, k >= 0);
        ekv_share_max<GM>(runmax, seen, A.lkey + h0, G, pre);
    }
}

/* ---- the generic screen (other page sizes, groups and head dims): version 1's warp per page,
 * the page's channel terms and code weights w' [D][GM] in the warp's shared-memory tile ---- */
template <int GM> struct screen_page {
    float c0[GM], e[GM]; /* C0 = <q', centre>; e = the half-width before the last roundings */
    int ok;              /* every step and centre finite */
    int64_t phys;
    int valid;  /* tokens of the page */
    float jpos; /* position of slot 0 relative to the query, as the score kernel forms it */
};

/* The channel terms of the page (lanes over channels) into the warp's tile, C0 and e per head. */
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
    for (int c = lane; c < A.D; c += 32) {
        float mn, mx;
        ekv_range_load<1>(A.rng, false, so + c, &mn);
        ekv_range_load<1>(A.rng, true, so + c, &mx);
        channel_terms<GM, BITS>(qs, A.D, A.G, c, mn, mx, gamma, wq + c * GM, c0, ep, ok);
    }
    pg.ok = __all_sync(0xffffffffu, ok);
#pragma unroll
    for (int g = 0; g < GM; g++) {
        pg.c0[g] = ekv_warp_sum(c0[g]);
        pg.e[g] = page_e(ekv_warp_sum(ep[g]), A.D, slope[g], p, A.ps, N);
    }
    __syncwarp();
}

/* A code as fp32, exactly. */
__device__ __forceinline__ float code_f(uint32_t c) {
    return __uint_as_float(0x4B000000u | c) - 8388608.0f;
}

enum { SCREEN_LOADS = 8 }; /* code bytes in flight per lane */

/* sum_c w'_gc code_tc over the code bytes j = j0, j0 + CS, ... < R of slot t. */
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
        for (int u = 0; u < SCREEN_LOADS; u++) {
            const int j = jb + u * CS;
            if (j >= R) continue;
            if (BITS == 8) {
                const float x = code_f(byte[u]);
#pragma unroll
                for (int g = 0; g < GM; g++) acc[g] += wq[j * GM + g] * x;
            } else {
                const float x0 = code_f(byte[u] & 15u), x1 = code_f(byte[u] >> 4);
#pragma unroll
                for (int g = 0; g < GM; g++) {
                    acc[g] += wq[2 * j * GM + g] * x0;
                    acc[g] += wq[(2 * j + 1) * GM + g] * x1;
                }
            }
        }
    }
}

/* The bounds of one page's tokens: TL lanes over tokens, CS slices over the code bytes, summed
 * into the slice-0 lanes, whose tokens go to the candidate lists. */
template <int GM, int BITS>
__device__ __forceinline__ void
page_bounds(const screen_args &A, const screen_page<GM> &pg, const float *wq, const float *slope,
            int64_t p, int64_t h0, float *runmax, const float *seen, bool emit) {
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
        const bool on = slice == 0 && t < pg.valid;
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g >= A.G) break;
            float l, u;
            token_bounds(pg.c0[g] + acc[g], pg.e[g], slope[g], pg.jpos, t, pg.ok, &l, &u);
            if (on) runmax[g] = fmaxf(runmax[g], l);
            if (emit) screen_emit(A, h0 + g, g, on, l, u, fmaxf(runmax[g], seen[g]), p * ps + t);
        }
    }
}

/* Blocks per SM the registers must allow: small groups trade a few spilled registers for
 * twice the warps in flight. */
constexpr int screen_min_blocks(int GM) { return GM <= 4 ? 4 : GM <= 8 ? 2 : 1; }

template <int GM, int BITS>
__global__ void __launch_bounds__(EKV_CUDA_THREADS, screen_min_blocks(GM))
        screen_kernel(screen_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(16) float smem[]; /* q' [G][D], then a w' tile [D][GM] per warp */
    const ekv_split sp = ekv_block_split(A.t, A.sbase, A.sbase * A.t.batch);
    if (sp.b < 0) return;
    const int b = sp.b, kvh = blockIdx.y, row = b * A.Hk + kvh, G = A.G, D = A.D;
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float *qs = smem, *wq = smem + G * D + (int64_t)warp * D * GM;
    if (!screen_prologue(A, sp.s, row, b, kvh, qs)) return;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    int64_t e0, e1;
    ekv_split_range(sp, 0, sg.P, &e0, &e1);
    const int64_t h0 = (int64_t)b * A.H + kvh * G;
    float slope[GM], runmax[GM], seen[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) {
        slope[g] = g < G && A.slopes ? A.a * A.slopes[kvh * G + g] : 0.f;
        runmax[g] = seen[g] = -CUDART_INF_F;
    }
    for (int64_t k = A.pass2 ? 0 : -1;; k++) { /* k = -1: a dry pass, as the fast kernel */
        const int64_t p = e0 + warp + (k < 0 ? 0 : k) * nw;
        if (p >= e1) break;
        uint32_t pre[GM];
        ekv_peek_max<GM>(A.lkey + h0, G, pre);
        screen_page<GM> pg;
        pg.phys = A.t.indices[sg.first + p];
        pg.valid = p == sg.P - 1 ? (int)(sg.N - p * A.ps) : A.ps;
        pg.jpos = (float)(p * A.ps - (sg.N - 1));
        page_terms<GM, BITS>(A, qs, wq, (pg.phys * A.Hk + kvh) * D, slope, p, sg.N, pg);
        page_bounds<GM, BITS>(A, pg, wq, slope, p, h0, runmax, seen, k >= 0);
        ekv_share_max<GM>(runmax, seen, A.lkey + h0, G, pre);
        __syncwarp(); /* the tile is rewritten by the next page */
    }
}

/* ---- the retry's sums: F(t_k) over the kept l of the heads whose list overflowed ---- */
struct retry_args {
    int64_t scap;
    int mode; /* 0: beta = 2, 1: beta = 1, 2: pow */
    double beta;
    const uint32_t *lkey, *scount;
    const float *scl;
    double *fsum; /* [B*H][EKV_SCREEN_GRID] */
};

enum { RETRY_THREADS = 256, RETRY_CHUNK = RETRY_THREADS * 16 };

template <int MODE> __device__ __forceinline__ double retry_pow(double x, double beta) {
    return MODE == 0 ? x * x : MODE == 1 ? x : pow(x, beta);
}

/* grid (chunk of RETRY_CHUNK kept entries, query head); every term is >= 0, so the atomic sums
 * are within a relative 2^-30 of F at these sizes (retry_cut asks for F > 1 + 1e-6). */
template <int MODE> __global__ void __launch_bounds__(RETRY_THREADS) retry_kernel(retry_args A) {
    ekv_grid_begin();
    __shared__ double part[EKV_SCREEN_GRID];
    const int64_t row = blockIdx.y;
    if (A.scount[row] <= A.scap) return; /* block-uniform */
    const float M = ekv_key_float(A.lkey[row]);
    if (!(M > -CUDART_INF_F)) return;
    if (threadIdx.x < EKV_SCREEN_GRID) part[threadIdx.x] = 0.0;
    __syncthreads();
    double f[EKV_SCREEN_GRID];
#pragma unroll
    for (int k = 0; k < EKV_SCREEN_GRID; k++) f[k] = 0.0;
    const int64_t i0 = (int64_t)blockIdx.x * RETRY_CHUNK;
    const int64_t i1 = i0 + RETRY_CHUNK < A.scap ? i0 + RETRY_CHUNK : A.scap;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        const double l = (double)A.scl[row * A.scap + i];
        if (!(l > retry_t(M, 0))) continue;
#pragma unroll
        for (int k = 0; k < EKV_SCREEN_GRID; k++) {
            const double x = l - retry_t(M, k);
            if (x > 0) f[k] += retry_pow<MODE>(x, A.beta);
        }
    }
#pragma unroll
    for (int k = 0; k < EKV_SCREEN_GRID; k++) {
        const double v = ekv_warp_sum(f[k]);
        if ((threadIdx.x & 31) == 0 && v > 0) atomicAdd(&part[k], v);
    }
    __syncthreads();
    if (threadIdx.x < EKV_SCREEN_GRID && part[threadIdx.x] > 0)
        atomicAdd(A.fsum + row * EKV_SCREEN_GRID + threadIdx.x, part[threadIdx.x]);
}

/* Warps per generic screen block: a w' tile [D][GM] each beside q' [G][D], within 96 KB. */
int screen_warps(int G, int D, int GM) {
    const size_t fixed = (size_t)G * D * 4, per = (size_t)D * GM * 4;
    int nw = EKV_CUDA_THREADS / 32;
    while (nw > 1 && fixed + nw * per > 96 * 1024) nw--;
    return nw;
}

template <int GM, int BITS>
cudaError_t launch_generic(const screen_args &A, int gx, int rows, const ekv_launch_stream &s) {
    const int nw = screen_warps(A.G, A.D, GM);
    const size_t sm = (size_t)A.G * A.D * 4 + (size_t)nw * A.D * GM * 4;
    const cudaError_t e = ekv_cuda_allow_smem<screen_kernel<GM, BITS>>(sm);
    if (e != cudaSuccess) return e;
    screen_args B = A;
    B.sbase = gx;
    ekv_launch(s, screen_kernel<GM, BITS>,
               dim3(ekv_cuda_split_grid(gx, A.t.batch), rows / A.t.batch), nw * 32, sm, B);
    return cudaGetLastError();
}

template <int GM, int BITS, int RB, int RT>
cudaError_t launch_fast(const screen_args &A, int sms, int rows, const ekv_launch_stream &s) {
    static int per_sm = 0;
    const size_t sm = (size_t)A.G * A.D * 4;
    screen_args B = A;
    B.sbase = FAST_WAVES * ekv_cuda_one_wave(screen_fast_kernel<GM, BITS, RB, RT>, FAST_THREADS, sm,
                                             rows, sms, &per_sm);
    ekv_launch(s, screen_fast_kernel<GM, BITS, RB, RT>,
               dim3(ekv_cuda_split_grid(B.sbase, A.t.batch), rows / A.t.batch), FAST_THREADS, sm,
               B);
    return cudaGetLastError();
}

/* The fast kernel for these bits and ranges (RT): its tile by the group and the row count. */
template <int BITS, int RT>
cudaError_t launch_fast_b(const screen_args &A, int sms, int rows, const ekv_launch_stream &s) {
    const bool rb8 = A.D * BITS / 8 % 64 == 0;
    if (A.G == 1)
        return rb8 ? launch_fast<1, BITS, 8, RT>(A, sms, rows, s)
                   : launch_fast<1, BITS, 4, RT>(A, sms, rows, s);
    if (A.G == 2)
        return rb8 ? launch_fast<2, BITS, 8, RT>(A, sms, rows, s)
                   : launch_fast<2, BITS, 4, RT>(A, sms, rows, s);
    return launch_fast<4, BITS, 4, RT>(A, sms, rows, s);
}

template <int BITS>
cudaError_t launch_screen_b(const screen_args &A, int kind, int gx, int sms, int rows,
                            const ekv_launch_stream &s) {
    if (kind == EKV_SCREEN_MMA) return ekv_cuda_screen_mma(A, BITS, sms, rows, s);
    if (kind == EKV_SCREEN_FAST)
        return ekv_cuda_with_ranges(A.rng, [&](auto rt) {
            return launch_fast_b<BITS, decltype(rt)::value>(A, sms, rows, s);
        });
    return ekv_cuda_with_group(A.G, [&](auto tg) {
        return launch_generic<decltype(tg)::value, BITS>(A, gx, rows, s);
    });
}

/* Which screen kernel serves the step, the one place that decides: tensor cores for GQA groups
 * where they apply and the plan allows them (tensor_cores), else the fast CUDA-core kernel (page
 * size a multiple of 16, groups up to 4, whole 16-byte code rows per lane), else the generic one.
 */
int screen_kind(const ekv_cuda_plan *pl, int G, int D, int ps, int code_bits) {
    /* the fast CUDA-core kernel first: at G = 4 it beat the tensor-core screen (1.05x at 1M,
     * 1.14x at 128K); tensor cores where it does not apply (G = 8: 1.65x the generic kernel),
     * bench/RESULTS.md "The screen on tensor cores" */
    if (ps % 16 == 0 && G <= 4 && D * code_bits / 8 % 32 == 0) return EKV_SCREEN_FAST;
    if (pl->p.tensor_cores && ekv_cuda_screen_mma_applies(G, D, ps)) return EKV_SCREEN_MMA;
    return EKV_SCREEN_GENERIC;
}

/* The retry's sums over the kept l of the heads whose list overflowed (the others' blocks
 * return at once). */
ekv_status launch_retry_sums(ekv_cuda_plan *pl, const ekv_decode_params *prm, int batch) {
    retry_args R;
    R.scap = pl->scap;
    R.beta = 1.0 / (prm->alpha - 1.0);
    R.mode = prm->alpha == 1.5 ? 0 : prm->alpha == 2.0 ? 1 : 2;
    R.lkey = ekv_scr_row(pl, EKV_SCR_LKEY);
    R.scount = ekv_scr_row(pl, EKV_SCR_COUNT);
    R.scl = pl->scl;
    R.fsum = pl->scr_f;
    const dim3 grid((unsigned)((pl->scap + RETRY_CHUNK - 1) / RETRY_CHUNK),
                    (unsigned)(batch * pl->p.num_heads));
    if (R.mode == 0)
        ekv_launch(ekv_plan_stream(pl), retry_kernel<0>, grid, RETRY_THREADS, 0, R);
    else if (R.mode == 1)
        ekv_launch(ekv_plan_stream(pl), retry_kernel<1>, grid, RETRY_THREADS, 0, R);
    else
        ekv_launch(ekv_plan_stream(pl), retry_kernel<2>, grid, RETRY_THREADS, 0, R);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

/* One pass of the screen kernel (the first, or the retry). */
ekv_status launch_screen_pass(ekv_cuda_plan *pl, const screen_args &A, int code_bits, int batch) {
    const int rows = batch * A.Hk, sms = pl->sms;
    const int kind = screen_kind(pl, A.G, A.D, A.ps, code_bits);
    pl->last_screen_kind = kind;
    const int base = 2 * ekv_cuda_step_splits(pl, batch).scores;
    const cudaError_t e =
            code_bits == 8 ? launch_screen_b<8>(A, kind, base, sms, rows, ekv_plan_stream(pl))
                           : launch_screen_b<4>(A, kind, base, sms, rows, ekv_plan_stream(pl));
    if (e != cudaSuccess)
        return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "screen kernel: %s", cudaGetErrorString(e));
    pl->launches++;
    return EKV_OK;
}

/* The memset of the step's counters, the screen kernel, and where the plan's lists are shorter
 * than the tokens, the retry's sums and the retry pass. */
ekv_status launch_screen_bounds(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                const ekv_paged_kv *kv, const ekv_page_stats *st,
                                const ekv_page_table *t, const float *q, int batch) {
    const int64_t BH = (int64_t)pl->p.max_batch * pl->p.num_heads;
    EKV_CUDA_TRY(pl,
                 cudaMemsetAsync(pl->scr_state, 0,
                                 (size_t)(EKV_SCR_STATE_ROWS * BH) * sizeof(uint32_t), pl->stream));
    pl->launches++;
    screen_args A;
    ekv_cuda_set_shape(A, pl, t);
    A.rng = ekv_cuda_ranges_of(st);
    A.codes = st->codes;
    ekv_cuda_set_query(A, prm, kv->head_dim, q); /* entmax only (the method table) */
    A.scap = pl->scap;
    A.lkey = ekv_scr_row(pl, EKV_SCR_LKEY);
    A.scount = A.acount = ekv_scr_row(pl, EKV_SCR_COUNT);
    A.pass2 = 0;
    A.fsum = pl->scr_f;
    A.scl = pl->scl;
    A.scu = pl->scu;
    A.sct = pl->sct;
    A.survivors = pl->survivors;
    A.dropped = ekv_scr_row(pl, EKV_SCR_DROPPED);
    ekv_status s = launch_screen_pass(pl, A, st->code_bits, batch);
    /* a list of every token cannot overflow (a token is appended once per head): such a plan
     * (plan.cu, screen_list_cap) never retries, decided at plan time so a graph keeps it */
    if (s || pl->scap >= pl->cap_tokens) return s;
    s = launch_retry_sums(pl, prm, batch);
    A.pass2 = 1;
    A.acount = ekv_scr_row(pl, EKV_SCR_COUNT2); /* the retry's list overwrites the first one */
    if (!s) s = launch_screen_pass(pl, A, st->code_bits, batch);
    return s;
}

} // namespace

ekv_status ekv_cuda_launch_screened(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                    const ekv_paged_kv *kv, const ekv_page_stats *st,
                                    const ekv_page_table *t, const float *q, int batch,
                                    float *out) {
    ekv_status s = launch_screen_bounds(pl, prm, kv, st, t, q, batch);
    if (!s) s = ekv_cuda_launch_survivors(pl, prm, t, batch);
    if (!s) s = ekv_cuda_launch_row_scores(pl, prm, kv, t, q, batch);
    if (!s) s = ekv_cuda_launch_tau_rows(pl, prm, kv, t, batch, 0, 1, out, 1);
    if (!s) s = ekv_cuda_launch_values_rows(pl, prm, kv, t, batch, 0, out, 1); /* none on a shard */
    return s;
}

extern "C" ekv_status ekv_cuda_screen_rows(ekv_cuda_plan *pl, int32_t batch, int64_t *rows) {
    const ekv_status cs = ekv_cuda_check_readout(pl, rows, "rows", batch);
    if (cs) return cs;
    const int64_t nl = (int64_t)batch * pl->p.num_kv_heads;
    int32_t *c = (int32_t *)malloc((size_t)nl * sizeof(int32_t));
    if (!c) return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    cudaError_t e = cudaStreamSynchronize(pl->stream);
    if (e == cudaSuccess)
        e = cudaMemcpy(c, pl->row_count, (size_t)nl * sizeof(int32_t), cudaMemcpyDeviceToHost);
    for (int64_t l = 0; l < nl; l++) rows[l] = pl->last_screened && e == cudaSuccess ? c[l] : 0;
    free(c);
    if (e != cudaSuccess)
        return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "screen rows: %s", cudaGetErrorString(e));
    return EKV_OK;
}

/* n entries of row `at` (EKV_SCR_*) of the plan's scr_state into *out, a
 * host copy the caller frees, after the plan's stream. */
static ekv_status scr_state_read(ekv_cuda_plan *pl, int at, int64_t n, const char *what,
                                 uint32_t **out) {
    *out = (uint32_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(uint32_t));
    if (!*out) return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    cudaError_t e = cudaStreamSynchronize(pl->stream);
    if (e == cudaSuccess)
        e = cudaMemcpy(*out, ekv_scr_row(pl, at), (size_t)n * sizeof(uint32_t),
                       cudaMemcpyDeviceToHost);
    if (e == cudaSuccess) return EKV_OK;
    free(*out);
    *out = NULL;
    return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "%s: %s", what, cudaGetErrorString(e));
}

/* Query heads of the plan's last screened step whose candidate list overflowed (out[0]: they
 * took the retry pass) and whose retry list overflowed too (out[1]: every token kept). Internal,
 * for the bench and the GPU tests; synchronises the plan's stream. */
extern "C" EKV_API ekv_status ekv_cuda_screen_overflow(ekv_cuda_plan *pl, int32_t batch, int64_t *out) {
    const ekv_status cs = ekv_cuda_check_readout(pl, out, "out", batch);
    if (cs) return cs;
    const int64_t nh = (int64_t)batch * pl->p.num_heads;
    out[0] = out[1] = 0;
    uint32_t *m = NULL;
    const ekv_status st = scr_state_read(pl, EKV_SCR_MARKS, nh, "screen overflow", &m);
    if (st) return st;
    for (int64_t h = 0; pl->last_screened && h < nh; h++) {
        out[0] += (m[h] & 1u) != 0;
        out[1] += (m[h] & 2u) != 0;
    }
    free(m);
    return EKV_OK;
}

/* Pages the page box of the plan's last screened step dropped unread, over its batch's (sequence,
 * KV head) rows (the fast kernel's; 0 elsewhere). Internal, for the GPU tests and the bench;
 * synchronises the plan's stream. */
extern "C" EKV_API ekv_status ekv_cuda_screen_dropped(ekv_cuda_plan *pl, int32_t batch,
                                                      int64_t *pages) {
    const ekv_status cs = ekv_cuda_check_readout(pl, pages, "pages", batch);
    if (cs) return cs;
    const int64_t rows = (int64_t)batch * pl->p.num_kv_heads;
    *pages = 0;
    uint32_t *d = NULL;
    const ekv_status st = scr_state_read(pl, EKV_SCR_DROPPED, rows, "screen dropped", &d);
    if (st) return st;
    for (int64_t r = 0; pl->last_screened && r < rows; r++) *pages += d[r];
    free(d);
    return EKV_OK;
}

/* The screen kernel of the plan's last screened step (EKV_SCREEN_GENERIC, _FAST or _MMA of
 * screen_common.cuh: 0, 1, 2; -1 before any). Internal, for the GPU tests and the bench. */
extern "C" EKV_API ekv_status ekv_cuda_screen_kernel(const ekv_cuda_plan *pl, int32_t *kind) {
    if (!pl) return EKV_ERR_NULL_POINTER;
    if (!kind) return ekv_fail(pl->ctx, EKV_ERR_NULL_POINTER, "kind must not be NULL");
    *kind = pl->last_screened ? pl->last_screen_kind : -1;
    return EKV_OK;
}

/* The candidate lists of the plan's last screened step, per query head: l, u and token of the
 * first n[h] entries ([batch * num_heads][scap] each; the retry's list for a head that retried;
 * n[h] = min(count, scap)). Internal, for the GPU tests' check l <= z <= u; synchronises. */
extern "C" EKV_API ekv_status ekv_cuda_screen_lists(ekv_cuda_plan *pl, int32_t batch, float *l,
                                                    float *u, int32_t *tok, int64_t *n) {
    const ekv_status cs = ekv_cuda_check_readout(pl, n, "n", batch);
    if (cs) return cs;
    if (!l || !u || !tok)
        return ekv_fail(pl->ctx, EKV_ERR_NULL_POINTER, "l, u, tok must not be NULL");
    const int64_t BH = (int64_t)pl->p.max_batch * pl->p.num_heads,
                  nh = (int64_t)batch * pl->p.num_heads;
    uint32_t *c = (uint32_t *)malloc((size_t)(2 * BH) * sizeof(uint32_t));
    if (!c) return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    cudaError_t e = cudaStreamSynchronize(pl->stream);
    if (e == cudaSuccess) /* the first pass's counts, then the retry's */
        e = cudaMemcpy(c, ekv_scr_row(pl, EKV_SCR_COUNT), (size_t)(2 * BH) * sizeof(uint32_t),
                       cudaMemcpyDeviceToHost);
    const size_t bytes = (size_t)(nh * pl->scap) * 4;
    if (e == cudaSuccess) e = cudaMemcpy(l, pl->scl, bytes, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess) e = cudaMemcpy(u, pl->scu, bytes, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess) e = cudaMemcpy(tok, pl->sct, bytes, cudaMemcpyDeviceToHost);
    for (int64_t h = 0; h < nh; h++) {
        const int64_t n1 = c[h], m = n1 > pl->scap ? (int64_t)c[BH + h] : n1;
        n[h] = pl->last_screened && e == cudaSuccess ? (m < pl->scap ? m : pl->scap) : 0;
    }
    free(c);
    if (e != cudaSuccess)
        return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "screen lists: %s", cudaGetErrorString(e));
    return EKV_OK;
}

/* The row lists of the plan's last screened step ([batch * num_kv_heads][cap_tokens]: the union
 * of the group's survivors, ascending; ekv_cuda_screen_rows says how many). Internal, for the
 * GPU tests' check that they hold the support; synchronises. */
extern "C" EKV_API ekv_status ekv_cuda_screen_row_list(ekv_cuda_plan *pl, int32_t batch,
                                                       int32_t *rows) {
    const ekv_status cs = ekv_cuda_check_readout(pl, rows, "rows", batch);
    if (cs) return cs;
    const size_t bytes = (size_t)batch * pl->p.num_kv_heads * pl->cap_tokens * sizeof(int32_t);
    EKV_CUDA_TRY(pl, cudaStreamSynchronize(pl->stream));
    EKV_CUDA_TRY(pl, cudaMemcpy(rows, pl->rows, bytes, cudaMemcpyDeviceToHost));
    return EKV_OK;
}
