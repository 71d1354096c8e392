/*
 * What the fused prefill kernel's passes share (prefill_fused.cu, the candidate scheme and the
 * Newton and output passes; prefill_hist.cu, the histogram scheme, docs/math.md §12.1): the
 * block's arguments and rows, the sweep over its key tiles and the one z function every pass
 * computes (tile_z: every pass sees bitwise the same z, so one pass's counts bound another's
 * lists), the quad reductions.
 */
#pragma once
#include "prefill.cuh"
#include "prefill_common.cuh"
#include "../common/launch.cuh"
#include "../common/loads.cuh"
#include "../common/mma.cuh"
#include "../common/reduce.cuh"
#include "../common/tau_solve.cuh"
#include "../common/weights.cuh"
#include "../common/wgmma.cuh"

enum {
    PF_NW = 4,
    PF_THREADS = 32 * PF_NW,
    PF_ROWS = EKV_PREFILL_MARK_ROWS, /* query rows of a block: 16 a warp */
    PF_KEYS = EKV_PREFILL_MARK_KEYS, /* keys of a tile */
    PF_ROUNDS = 3,                   /* candidate rounds before a row takes Newton passes */
    PF_TAU_THREADS = 256,            /* 8 rows of the tau kernel, a warp each */
    PF_TAU_STAGE = 1024 /* candidates a warp of the tau kernel stages in shared memory */
};
static_assert(PF_ROWS == 16 * PF_NW, "a warp's mma rows are 16");
enum { PF_CANDS, PF_NEWTON, PF_OUT };
enum { PF_GATHER_THREADS = 256 }; /* a warp per row */
/* where a row's tau stands: solved from its candidates (its output gathered) or by Newton
 * passes (its output swept) */
enum { ROW_FRESH = 0, ROW_RETRY = 1, ROW_NEWTON = 2, ROW_SOLVED = 3, ROW_SOLVED_NEWTON = 4 };
/* the histogram scheme's route G (prefill_hist.cu): the row's list slice is sized, not filled */
enum { ROW_LIST = 5 };

struct fused_args : prefill_args {
    const void *k, *v;      /* key and value 0 of KV head 0 of the sequence */
    int64_t kstride;        /* elements between tokens: Hk * D */
    int64_t noncausal_keys; /* 0: causal; else every row sees keys [0, noncausal_keys) */
    int cap, round, last;
    int compact_at; /* a list is compacted when a tile would take it past this (<= cap) */
    float *cand;
    int64_t *cidx; /* the candidates' key positions (gather_out_kernel reads their V rows) */
    int32_t *count, *state;
    float *thr, *rowm;
    double *tau;
    unsigned long long *rows; /* the block's [PF_COUNTERS] (prefill.cuh) */
    /* the pass's rows: NULL = every row of the block; else per KV head g, wcount_in[g] rows
     * (their r in [0, R)) at wlist_in + g R; the tau kernel appends the rows it sends to the
     * next pass to wlist_out / wcount_out */
    const int32_t *wlist_in, *wcount_in;
    int32_t *wlist_out, *wcount_out;
    /* the histogram scheme (prefill_hist.cu): each route-G row's list starts at off[row] of
     * the pool cand/cidx (pool entries; pool_used of them handed out by the route); NULL in
     * the candidate scheme (row * cap) */
    int64_t *off, pool;
    unsigned long long *pool_used;
    int row_cap; /* route G takes rows of at most this many list entries */
    /* the histogram scheme's tile marks (prefill_hist.cu; docs/math.md §12.1, "Tile marks"):
     * mark_words words of bits a (KV head, row block), bit t set by P1 where a row of the block
     * counted a z in key tile t; P2 sweeps those tiles only. NULL: P2 sweeps every tile. */
    uint32_t *marks;
    int64_t mark_words;
    /* rowm holds the max of every row on the Newton list, found by a sweep of the same z (the
     * histogram scheme's P1), or NaN where a row's max is to be found again: the Newton pass
     * then skips its max sweep (0: the candidate scheme and softmax, which have no such max) */
    int max_known;
    /* PF_OUT forms o-hat (w~ weights, into ohat) instead of the output (p~, into att): the
     * Newton rows' o-hat by a second output sweep (docs/math.md §13.3) */
    int ohat_pass;
};

/* The histogram scheme's lists, every row's P1, route, P2 and tau (prefill_hist.cu): the rows
 * of route S are left in ROW_NEWTON on the list wlist_out / wcount_out, route G in ROW_SOLVED. */
cudaError_t prefill_hist_lists(ekv_dtype dt, const fused_args &A, cudaStream_t s);

namespace {

/* The parts of q' (NP) and of P as mma operands: f16 2, bf16 3 (docs/math.md §12); q' takes
 * one when q is exact in K's dtype (nq 1, the flash op's 16-bit q). */
template <typename T> __host__ __device__ constexpr int split_parts() {
    return std::is_same<T, __half>::value ? 2 : 3;
}
template <typename T, int NP> struct query_split {
    typedef T type;
    static constexpr int np = NP;
};
/* f(query_split<T, NP>()) for K's dtype dt and nq parts of q' (1, or the dtype's split_parts;
 * the caller sets nparts: src/model/model_gpu.cu, src/cuda/prefill/flash_entmax.cu). */
template <typename F> cudaError_t with_query_split(ekv_dtype dt, int nq, F f) {
    if (dt == EKV_DTYPE_F16)
        return nq == 1 ? f(query_split<__half, 1>()) : f(query_split<__half, 2>());
    return nq == 1 ? f(query_split<__nv_bfloat16, 1>()) : f(query_split<__nv_bfloat16, 3>());
}

/* Blocks per SM the registers must allow: the sweeps are latency-bound (ncu: the tensor pipe
 * busy 10-15 %), and without a bound ptxas took 255 registers (2 blocks of 4 warps per SM) and
 * spilled anyway; at 3 the candidate and Newton passes take 168 (f16, D 64: 52 and 204 bytes of
 * spill stores). The output pass keeps 2 (its P V accumulators). One part of q' holds a third
 * (bf16) of the query fragments' registers: the candidate (and histogram) sweeps take one block
 * more at 128 registers (40-250 bytes of spill stores); the Newton pass spilled 750 there, so it
 * keeps 3. */
template <int MODE, int NP> constexpr int fused_min_blocks() {
    return (MODE == PF_OUT ? 2 : 3) + (NP == 1 && MODE == PF_CANDS ? 1 : 0);
}

/* A warp's list of n values at cs, staged in its shared memory when they fit (PF_TAU_STAGE):
 * where the tau kernels read it. Warp-uniform. */
__device__ __forceinline__ const float *stage_list(const float *cs, int64_t n, float *stage) {
    if (n > PF_TAU_STAGE) return cs;
    for (int64_t j = threadIdx.x & 31; j < n; j += 32) stage[j] = cs[j];
    __syncwarp();
    return stage;
}

/* Where row's list starts in cand / cidx: its slice of the pool (histogram scheme) or its own
 * cap entries (candidate scheme). */
__device__ __forceinline__ int64_t list_at(const fused_args &A, int64_t row) {
    return A.off ? A.off[row] : row * A.cap;
}

/* Row onto its KV head's list of rows for the next pass (wlist_out / wcount_out), one atomic
 * (the histogram route appends many rows at once: route_newton, prefill_hist.cu). */
__device__ __forceinline__ void list_for_next_pass(const fused_args &A, int64_t row) {
    const int64_t g = row / A.R;
    A.wlist_out[g * A.R + atomicAdd(A.wcount_out + g, 1)] = (int32_t)(row % A.R);
}

/* Support keys whose V rows gather_row_output loads at once: one load in flight a warp left
 * each row's latency exposed (the flat heads' lists of 1-4K keys, 10 % of the model's prefill). */
enum { GATHER_ILP = 4 };

/* o += p_k v_k over the support keys of the warp's mask m (bit: the lane holding p and key),
 * GATHER_ILP rows loaded before their fmas; the fmas in the lanes' order, so the sum is the one
 * a key at a time gives, bit for bit. OHAT: oh += w_k v_k too, from the same loads. Warp-uniform
 * call. */
template <typename T, int NPAIR, bool OHAT>
__device__ __forceinline__ void gather_rows(unsigned m, float p, float w, int64_t key, const T *V,
                                            int64_t kstride, float *o, float *oh) {
    typedef typename ekv_pair_of<T>::type T2;
    const int lane = threadIdx.x & 31;
    while (m) {
        int src[GATHER_ILP], cnt = 0;
#pragma unroll
        for (int u = 0; u < GATHER_ILP; u++) {
            src[u] = m ? __ffs(m) - 1 : 0;
            cnt += m != 0;
            m &= m - 1;
        }
        float pk[GATHER_ILP], wk[GATHER_ILP];
        float2 v[GATHER_ILP][NPAIR];
#pragma unroll
        for (int u = 0; u < GATHER_ILP; u++) {
            pk[u] = __shfl_sync(0xffffffffu, p, src[u]);
            if (OHAT) wk[u] = __shfl_sync(0xffffffffu, w, src[u]);
            const T *vr = V + __shfl_sync(0xffffffffu, key, src[u]) * kstride;
#pragma unroll
            for (int c = 0; c < NPAIR; c++)
                v[u][c] = u < cnt ? ekv_pair_f32(
                                            *reinterpret_cast<const T2 *>(vr + 64 * c + 2 * lane))
                                  : make_float2(0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < GATHER_ILP; u++)
#pragma unroll
            for (int c = 0; c < NPAIR && u < cnt; c++) {
                o[2 * c] = fmaf(pk[u], v[u][c].x, o[2 * c]);
                o[2 * c + 1] = fmaf(pk[u], v[u][c].y, o[2 * c + 1]);
                if (OHAT) {
                    oh[2 * c] = fmaf(wk[u], v[u][c].x, oh[2 * c]);
                    oh[2 * c + 1] = fmaf(wk[u], v[u][c].y, oh[2 * c + 1]);
                }
            }
    }
}

/* Step 3 for one row solved from its list (warp-uniform call): the list (cz, ck: n entries)
 * holds every z > tau with its key (round 0's candidates z > m - 1 with m <= M, a retry's above
 * a lower bound of tau; the histogram scheme's z >= an edge <= tau), so o = sum p v / sum p over
 * it reads only the support's V rows. Each support key's row is one coalesced load by the warp
 * (lane: D / 64 pairs of elements; gather_rows); p in fp32, not split into parts as the sweep's
 * tensor cores need. OHAT: o-hat = sum w~ v / sum w~ from the same rows into A.ohat
 * (docs/math.md §13.3). tau in z-space. */
template <typename T, int D, bool OHAT>
__device__ __forceinline__ void gather_row_output(const fused_args &A, int64_t row, const float *cz,
                                                  const int64_t *ck, int64_t n, double tau) {
    constexpr int NPAIR = D / 64;
    const int lane = threadIdx.x & 31;
    const int64_t g = row / A.R, r = row % A.R, t = r / A.G, h = g * A.G + r % A.G;
    const double beta = 1.0 / (A.alpha - 1.0);
    const T *V = static_cast<const T *>(A.v) + g * A.D;
    float o[2 * NPAIR], oh[2 * NPAIR];
#pragma unroll
    for (int c = 0; c < 2 * NPAIR; c++) o[c] = oh[c] = 0.f;
    double sum = 0, wsum = 0;
    for (int64_t base = 0; base < n; base += 32) {
        const int64_t i = base + lane;
        const float p = i < n ? attn_weight(cz[i], tau, A.alpha, beta) : 0.f;
        /* w~ where p > 0: the support as the output takes it */
        const float w = OHAT && p > 0.f ? attn_jweight(cz[i], tau, A.alpha, beta) : 0.f;
        const int64_t key = p > 0.f ? ck[i] : 0;
        sum += p, wsum += w;
        gather_rows<T, NPAIR, OHAT>(__ballot_sync(0xffffffffu, p > 0.f), p, w, key, V, A.kstride, o,
                                    oh);
    }
    const float f = (float)(1.0 / ekv_warp_sum(sum));
    const int64_t at = (t * A.H + h) * A.D;
    const float fw = OHAT ? (float)(1.0 / ekv_warp_sum(wsum)) : 0.f;
#pragma unroll
    for (int c = 0; c < NPAIR; c++) {
        *reinterpret_cast<float2 *>(A.att + at + 64 * c + 2 * lane) =
                make_float2(o[2 * c] * f, o[2 * c + 1] * f);
        if (OHAT)
            *reinterpret_cast<float2 *>(A.ohat + at + 64 * c + 2 * lane) =
                    make_float2(oh[2 * c] * fw, oh[2 * c + 1] * fw);
    }
}

/* Calls f(ekv_cuda_type<T>, D, OHAT) (the integral constants of the head dim, 64 or 128, and of
 * whether o-hat is asked for) for V's 16-bit dtype dt: the launches of the kernels that end in
 * gather_row_output. */
template <typename F> cudaError_t with_gather_kernel(ekv_dtype dt, const fused_args &A, F f) {
    auto by_dim = [&](auto ty) {
        auto by_ohat = [&](auto d) {
            return A.ohat ? f(ty, d, std::true_type{}) : f(ty, d, std::false_type{});
        };
        return A.D == 64 ? by_ohat(std::integral_constant<int, 64>{})
                         : by_ohat(std::integral_constant<int, 128>{});
    };
    return dt == EKV_DTYPE_F16 ? by_dim(ekv_cuda_type<__half>{})
                               : by_dim(ekv_cuda_type<__nv_bfloat16>{});
}

/* A pass kernel of bytes of dynamic shared memory over the grid of row blocks x KV heads. */
template <auto Kernel>
cudaError_t launch_row_blocks(const fused_args &A, size_t bytes, cudaStream_t s) {
    const cudaError_t e = ekv_cuda_allow_smem<Kernel>(bytes);
    if (e != cudaSuccess) return e;
    Kernel<<<dim3((unsigned)ekv_prefill_row_blocks(A.R), (unsigned)A.Hk), PF_THREADS, bytes,
             s>>>(A);
    return cudaGetLastError();
}

template <int D> __host__ __device__ constexpr int tile_bytes() { return PF_KEYS * D * 2; }
/* The stages start on a 1024-byte boundary (wgmma's swizzled tiles, common/wgmma.cuh): so much
 * slack before them. */
enum { PF_STAGE_ALIGN = 1024 };
/* the q tile [np][PF_ROWS][pitch] is read into registers before the stages reuse its memory */
template <int D, int NP, bool WITH_V> __host__ __device__ constexpr size_t fused_smem_bytes() {
    constexpr size_t q = (size_t)NP * PF_ROWS * mma_qpitch<D>() * 2,
                     st = (size_t)2 * (WITH_V ? 2 : 1) * tile_bytes<D>();
    return (q > st ? q : st) + PF_STAGE_ALIGN;
}
/* p moved up to the next ALIGN boundary (a power of two) of the shared window's addresses, static
 * shared memory before the dynamic included: the caller leaves ALIGN - 1 bytes of slack. */
template <uint32_t ALIGN> __device__ __forceinline__ unsigned char *smem_aligned(unsigned char *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    return p + ((ALIGN - (a & (ALIGN - 1))) & (ALIGN - 1));
}
/* The stages' start in the block's dynamic shared memory at raw: aligned where the swizzle reads
 * it. */
__device__ __forceinline__ unsigned char *pf_stages(unsigned char *raw) {
    return smem_aligned<PF_STAGE_ALIGN>(raw);
}

/* Each lane's stage of one row's z of a tile for store_kept, after a K-only sweep's stages
 * (fused_smem_bytes<D, NP, false>): PF_KEPT_PITCH floats a lane, 16 used. The pitch of 20 puts
 * the 8 lanes of a quarter warp's 16-byte stores in distinct banks. */
enum { PF_KEPT_PITCH = 20, PF_KEPT_BYTES = PF_THREADS * PF_KEPT_PITCH * 4 };
template <int D, int NP> __device__ __forceinline__ float *kept_stage(unsigned char *raw) {
    return reinterpret_cast<float *>(raw + fused_smem_bytes<D, NP, false>()) +
           threadIdx.x * PF_KEPT_PITCH;
}

/* Whether a sweep's scores run on Hopper's warpgroup MMA (common/wgmma.cuh): code for sm_90a,
 * head dim 64, q' in any number of parts (the flash op's 16-bit q: one; the model's fp32 q: 2
 * for f16 caches, 3 for bf16). Device code only. */
template <int D, int NP> __device__ constexpr bool pf_wgmma() {
#if defined(EKV_HAVE_WGMMA)
    return D == 64 && NP <= 3;
#else
    return false;
#endif
}

/* The lane's two rows (lane / 4 and lane / 4 + 8 of its warp's 16): global row g R + r (-1
 * past R), the query's position, 2^-s of its split, a m_h, and whether the pass works on it. */
struct pf_lane {
    int64_t row[2], pos[2], t[2], h[2];
    float shift[2], am[2];
    bool on[2];
};

/* The block's tile of PF_ROWS rows: the listed rows in the tau kernel's order, or every row,
 * the last tile first. A causal block's later rows sweep the most keys and blocks start in
 * index order, so the long sweeps start first and the short ones fill the SMs behind them. */
__device__ __forceinline__ int64_t block_tile(const fused_args &A) {
    return A.wlist_in ? (int64_t)blockIdx.x : (int64_t)(gridDim.x - 1 - blockIdx.x);
}

/* Row rr of the block (0 .. PF_ROWS - 1): its r in [0, R) of KV head blockIdx.y, or -1. */
__device__ __forceinline__ int64_t block_row(const fused_args &A, int rr) {
    const int64_t g = blockIdx.y, i = block_tile(A) * PF_ROWS + rr;
    if (!A.wlist_in) return i < A.R ? i : -1;
    return i < A.wcount_in[g] ? (int64_t)A.wlist_in[g * A.R + i] : -1;
}

__device__ __forceinline__ pf_lane lane_rows(const fused_args &A, int want) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t g = blockIdx.y;
    pf_lane L;
    for (int k = 0; k < 2; k++) {
        const int64_t r0 = block_row(A, warp * 16 + (lane >> 2) + 8 * k);
        const bool in = r0 >= 0;
        const int64_t r = in ? r0 : 0;
        L.row[k] = in ? g * A.R + r : -1;
        L.t[k] = r / A.G;
        L.pos[k] = A.pos0 + L.t[k];
        L.h[k] = g * A.G + r % A.G;
        L.shift[k] = in ? A.qshift[L.row[k]] : 0.f;
        L.am[k] = in && A.slopes ? (float)(A.a * (double)A.slopes[L.h[k]]) : 0.f;
        L.on[k] = in && (want < 0 || A.state[L.row[k]] == want);
    }
    return L;
}

/* The block's query rows, np parts each, from qparts into shared memory (zero past R), then the
 * warp's A fragments into registers. */
template <typename T, int D, int NP>
__device__ __forceinline__ void load_queries(const fused_args &A, T *qs,
                                             uint32_t (*qa)[D / 16][4]) {
    constexpr int CH = D / 8, P = mma_qpitch<D>();
    const int64_t g = blockIdx.y;
    const T *src = static_cast<const T *>(A.qparts);
    for (int i = threadIdx.x; i < NP * PF_ROWS * CH; i += PF_THREADS) {
        const int part = i / (PF_ROWS * CH), rr = i / CH % PF_ROWS, c = i % CH;
        const int64_t r = block_row(A, rr);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r >= 0)
            v = *reinterpret_cast<const uint4 *>(src + part * A.Hk * A.R * A.D +
                                                 (g * A.R + r) * A.D + c * 8);
        *reinterpret_cast<uint4 *>(qs + (part * PF_ROWS + rr) * P + c * 8) = v;
    }
    __syncthreads();
    load_q_frags<T, D, NP>(qs + (threadIdx.x >> 5) * 16 * P, PF_ROWS * P, qa);
    __syncthreads(); /* the stages reuse qs */
}

/* The keys of the block's rows: [0, pos0 + t of its last row + 1); a listed block's rows are
 * in the tau kernel's order, so the largest t is found by a block reduction (block-uniform:
 * every thread calls it). */
__device__ __forceinline__ int64_t block_keys(const fused_args &A) {
    if (A.noncausal_keys) return A.noncausal_keys;
    if (!A.wlist_in) {
        const int64_t last = block_tile(A) * PF_ROWS + PF_ROWS - 1;
        return A.pos0 + (last < A.R ? last : A.R - 1) / A.G + 1;
    }
    __shared__ int s_last;
    if (threadIdx.x == 0) s_last = 0;
    __syncthreads();
    const int64_t r = threadIdx.x < PF_ROWS ? block_row(A, threadIdx.x) : -1;
    if (r >= 0) atomicMax(&s_last, (int)(r / A.G));
    __syncthreads();
    const int64_t keys = A.pos0 + s_last + 1;
    __syncthreads(); /* s_last is read before a later call resets it */
    return keys;
}

/* A lane's share of copying a sweep's tiles (tile_copy's chunks and swizzle: each warp 16 rows,
 * chunk i = lane + 32 u of them at row i / CH and column lane % CH), with what depends only on
 * the lane worked out once for the sweep: its first chunk's row, column and element offset from
 * a tile's first key, and the step to its next chunk. Per tile that leaves a pointer add and a
 * copy a chunk, where tile_copy's general form cost the sweep ~150 instructions a tile (its 64-bit
 * offsets and the lane's indices recomputed for every chunk: bench/RESULTS.md 2026-12-05). The
 * chunk order is tile_copy's, written again here: tile_copy itself is left alone, since routing
 * it through a helper shared with this changed the decode kernels' code (softmax_mma's spills 92
 * to 100 bytes under ptxas), which no GPU run has measured. */
template <int D> struct tile_lane_copy {
    static constexpr int CH = D / 8, PER = 16 * CH / 32, RS = 32 / CH; /* rows between chunks */
    int64_t src;  /* elements from a tile's first key to the lane's first chunk */
    int64_t step; /* elements between the lane's chunks: RS keys */
    int row, col; /* the lane's first chunk: its row in the tile, its column */
    __device__ __forceinline__ explicit tile_lane_copy(int64_t stride) {
        const int lane = threadIdx.x & 31;
        row = (threadIdx.x >> 5) * 16 + lane / CH;
        col = lane % CH;
        src = row * stride + col * 8;
        step = RS * stride;
    }
    /* The tile whose first key is at `tile` into dst (the stage); rows at or past valid as
     * tile_copy leaves them (ZERO_TAIL: zeroed). */
    template <typename T, bool ZERO_TAIL>
    __device__ __forceinline__ void copy(unsigned char *dst, const T *tile, int valid) const {
        const T *from = tile + src;
#pragma unroll
        for (int u = 0; u < PER; u++, from += step) {
            const int r = row + u * RS;
            if (r < valid)
                cp_async16(dst + tile_chunk<D>(r, col), from);
            else if (ZERO_TAIL)
                *reinterpret_cast<uint4 *>(dst + tile_chunk<D>(r, col)) = make_uint4(0, 0, 0, 0);
        }
    }
};

/* Which of a block's key tiles a sweep visits, last first (the diagonal tile holds each row's
 * nearest keys: with ALiBi the row's max comes early, which keeps round 0's candidates few):
 * every tile of nk keys. issue_k0(j) and use_k0(j) give the j-th tile's first key, each called
 * once for j = 0, 1, ... in turn (sweep's order). */
struct every_tile {
    int64_t n; /* tiles */
    __device__ __forceinline__ explicit every_tile(int64_t nk) : n(ekv_prefill_tiles(nk)) {}
    __device__ __forceinline__ int64_t count() const { return n; }
    __device__ __forceinline__ int64_t issue_k0(int64_t j) { return (n - 1 - j) * PF_KEYS; }
    __device__ __forceinline__ int64_t use_k0(int64_t j) const { return (n - 1 - j) * PF_KEYS; }
};

/* The block's key tiles: K (and V) of each tile [k0, k0 + PF_KEYS) that `tiles` names (every_tile,
 * or the marked tiles of prefill_hist.cu) lands in a stage, then use(k0, kt, vt) runs in every
 * warp (block-uniform); `more` may end the sweep early (cp_async_two_stages). */
template <typename T, int D, bool WITH_V, bool ASYNC_READ, typename Tiles, typename Use,
          typename More>
__device__ __forceinline__ void sweep(const fused_args &A, int64_t nk, Tiles &tiles,
                                      unsigned char *raw, Use use, const More &more) {
    constexpr int TB = tile_bytes<D>(), SB = (WITH_V ? 2 : 1) * TB;
    unsigned char *stages = pf_stages(raw);
    const int64_t ntiles = tiles.count(), g = blockIdx.y; /* >= 1 */
    const T *K = static_cast<const T *>(A.k) + g * A.D, *V = static_cast<const T *>(A.v) + g * A.D;
    const tile_lane_copy<D> cp(A.kstride);
    auto issue = [&](int64_t j) {
        const int64_t k0 = tiles.issue_k0(j);
        const int valid = (int)(nk - k0 < PF_KEYS ? nk - k0 : PF_KEYS);
        unsigned char *st = stages + (j & 1) * SB;
        if constexpr (!WITH_V) {
            cp.template copy<T, false>(st, K + k0 * A.kstride, valid);
        } else { /* the output sweeps (255 registers) spill with cp's offsets held */
            const int warp = threadIdx.x >> 5;
            st += warp * 16 * D * 2;
            tile_copy<T, D, false>(st, K + k0 * A.kstride, A.kstride, warp * 16, valid);
            tile_copy<T, D, true>(st + TB, V + k0 * A.kstride, A.kstride, warp * 16, valid);
        }
    };
    auto landed = [] { /* ASYNC_READ: the tiles read by wgmma, through the async proxy */
#if defined(EKV_HAVE_WGMMA)
                       if (ASYNC_READ) wgmma_fence_smem();
#endif
    };
    cp_async_two_stages(
            ntiles, issue,
            [&](int64_t j) {
                const unsigned char *st = stages + (j & 1) * SB;
                use(tiles.use_k0(j), st, st + TB);
            },
            landed, more);
}

/* Whether the warp's tile from k0 is whole for every lane: each of its rows live and seeing
 * every key of the tile (no mask), and every distance j - pos of the lane's keys, e + c with c =
 * 8 n8 + i % 2 in [0, 57], an integer below 2^24 in magnitude, so e + c in float is exactly the
 * conversion of j - pos (the same z as the masked path's, whichever path a pass takes: its rows
 * are listed in other blocks in another pass). e[k]: the lane's e of row k as float. */
__device__ __forceinline__ bool tile_whole(const pf_lane &L, int64_t k0, int64_t noncausal_keys,
                                           float *e) {
    constexpr int64_t EXACT = (int64_t)1 << 24;
    bool whole = true;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const int64_t ek = k0 + 2 * (threadIdx.x & 3) - L.pos[k];
        const int64_t last = noncausal_keys ? noncausal_keys - 1 : L.pos[k];
        whole = whole && L.row[k] >= 0 && k0 + PF_KEYS - 1 <= last && ek > -EXACT + PF_KEYS &&
                ek < EXACT - PF_KEYS;
        e[k] = (float)ek;
    }
    return __all_sync(0xffffffffu, whole);
}

/* z of the lane's scores of a 64-key tile from k0 (s[n8][i]: row k = i / 2, key k0 + 8 n8 +
 * 2 (lane % 4) + i % 2, tile_scores_q's layout), -inf where masked (past the row's position, or
 * with noncausal_keys past the last key); *bad |= a z that is not finite where not masked. The
 * bias -a m_h |j - i| is a m_h (j - i) on the causal side, bit for bit. A whole tile (tile_whole:
 * most of a long sweep) takes no mask and its distances by one float add: the same z without a
 * 64-bit compare and conversion a score (the sweeps' time is in this epilogue, not in the mma:
 * bench/RESULTS.md 2026-12-05); rows without ALiBi (m_h 0) skip the bias, whose -0 changes no
 * sum. Warp-uniform call. */
__device__ __forceinline__ void tile_z(const pf_lane &L, int64_t k0, int64_t noncausal_keys,
                                       float (*s)[4], int *bad) {
    const int lane = threadIdx.x & 31;
    float e[2];
    if (tile_whole(L, k0, noncausal_keys, e)) {
        /* chk[i] = fmaf(z, 0, chk[i]) stays 0 while every z is finite and turns NaN at the first
         * inf or NaN (inf x 0): one fma a z instead of a compare chained through a predicate, in
         * four independent chains. The two loops are separate so that the unbiased one (most
         * rows) is not compiled as the biased one with its bias predicated off (each such
         * instruction still issues). */
        float chk[4] = {0.f, 0.f, 0.f, 0.f};
        if (__any_sync(0xffffffffu, L.am[0] != 0.f || L.am[1] != 0.f)) {
#pragma unroll
            for (int n8 = 0; n8 < PF_KEYS / 8; n8++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int k = i >> 1;
                    const float b = -L.am[k] * fabsf(e[k] + (float)(n8 * 8 + (i & 1)));
                    s[n8][i] = fmaf(s[n8][i], L.shift[k], b);
                    chk[i] = fmaf(s[n8][i], 0.f, chk[i]);
                }
        } else {
#pragma unroll
            for (int n8 = 0; n8 < PF_KEYS / 8; n8++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    s[n8][i] = fmaf(s[n8][i], L.shift[i >> 1], -0.f);
                    chk[i] = fmaf(s[n8][i], 0.f, chk[i]);
                }
        }
        *bad |= !(chk[0] + chk[1] + chk[2] + chk[3] == 0.f); /* NaN if any is */
        return;
    }
#pragma unroll
    for (int n8 = 0; n8 < PF_KEYS / 8; n8++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int k = i >> 1;
            const int64_t j = k0 + n8 * 8 + 2 * (lane & 3) + (i & 1);
            const bool in = L.row[k] >= 0 && j <= (noncausal_keys ? noncausal_keys - 1 : L.pos[k]);
            const float z = fmaf(s[n8][i], L.shift[k], -L.am[k] * fabsf((float)(j - L.pos[k])));
            *bad |= in && !isfinite(z);
            s[n8][i] = in ? z : -CUDART_INF_F;
        }
}

/* A row's max and min over its quad (ekv_quad_fold); fmaxf and fmin skip a NaN operand. */
__device__ __forceinline__ float quad_max(float v) {
    return ekv_quad_fold(v, [](float a, float b) { return fmaxf(a, b); });
}
__device__ __forceinline__ double quad_min(double v) {
    return ekv_quad_fold(v, [](double a, double b) { return fmin(a, b); });
}

/* The scores of the warp's 16 rows against a 64-key tile (s[n8][i], tile_z's layout): 4
 * mma.sync tiles of 16 keys. */
template <typename T, int D, int NP>
__device__ __forceinline__ void tile_scores(const unsigned char *kt,
                                            const uint32_t (*qa)[D / 16][4], float (*s)[4]) {
#pragma unroll
    for (int q = 0; q < PF_KEYS / 16; q++)
        tile_scores_q<T, D, NP>(kt + q * 16 * D * 2, qa, s + 2 * q);
}

/* A sweep whose every tile's z (the warp's rows against the tile's keys: tile_scores or, where
 * pf_wgmma, the block's 4 warps as one warpgroup; then tile_z) goes to use(k0, s, vt), over the
 * tiles `tiles` names, until `more` ends it (cp_async_all: every tile). A warp without a live
 * row skips the rest (and, off wgmma, the mma) but still copies its share of each tile and meets
 * the barriers (sweep). */
template <typename T, int D, int NP, bool WITH_V, typename Tiles, typename Use,
          typename More = cp_async_all>
__device__ __forceinline__ void
sweep_z_tiles(const fused_args &A, const pf_lane &L, const uint32_t (*qa)[D / 16][4], int64_t nk,
              Tiles &tiles, unsigned char *stages, int *bad, Use use, const More &more = More()) {
    const bool warp_on = __any_sync(0xffffffffu, L.on[0] || L.on[1]);
    constexpr bool WG = pf_wgmma<D, NP>();
    sweep<T, D, WITH_V, WG>(
            A, nk, tiles, stages,
            [&](int64_t k0, const unsigned char *kt, const unsigned char *vt) {
                float s[PF_KEYS / 8][4];
#if defined(EKV_HAVE_WGMMA)
                if constexpr (WG) {
                    static_assert(D == 64, "wgmma_tile_scores64: head dim 64");
                    wgmma_tile_scores64<T, NP>(kt, qa, s);
                }
#endif
                if (!warp_on) return;
                if constexpr (!WG) tile_scores<T, D, NP>(kt, qa, s);
                tile_z(L, k0, A.noncausal_keys, s, bad);
                use(k0, s, vt);
            },
            more);
}
/* sweep_z_tiles over the tiles of nk keys, last first (every_tile). */
template <typename T, int D, int NP, bool WITH_V, typename Use, typename More = cp_async_all>
__device__ __forceinline__ void
sweep_z(const fused_args &A, const pf_lane &L, const uint32_t (*qa)[D / 16][4], int64_t nk,
        unsigned char *stages, int *bad, Use use, const More &more = More()) {
    every_tile tiles(nk);
    sweep_z_tiles<T, D, NP, WITH_V>(A, L, qa, nk, tiles, stages, bad, use, more);
}

/* The exclusive prefix sum of c over the 4 lanes of a quad (the lanes of one query row), and
 * in *total their sum. Every lane of the warp calls it. */
__device__ __forceinline__ int quad_exclusive(int c, int *total) {
    const int q = threadIdx.x & 3;
    int v = c, t = __shfl_up_sync(0xffffffffu, v, 1, 4);
    if (q >= 1) v += t;
    t = __shfl_up_sync(0xffffffffu, v, 2, 4);
    if (q >= 2) v += t;
    *total = __shfl_sync(0xffffffffu, v, 3, 4);
    return v - c;
}

/* The keys of row k in a tile that the lane's mask m keeps (bit 2 n8 + b: tile_z's layout),
 * appended to the row's list at base in cand / cidx from slot at (the lane's quad_exclusive
 * place) on; a slot at or past room is counted but not written. The lane's 16 z go to its stage
 * (kept_stage: read back by this lane only), then the lane visits its kept bits alone: the warp
 * takes as many rounds as its busiest lane keeps keys, where stores predicated on every bit took
 * ~12 instructions a z for any tile with one kept key in the warp (P2 of a flat head keeps a few
 * keys of most tiles). Every lane of the warp calls it. */
__device__ __forceinline__ void store_kept(const fused_args &A, unsigned m, int at, int room,
                                           int64_t base, int k, int64_t k0, float (*s)[4],
                                           float *stage) {
    if (!__any_sync(0xffffffffu, m != 0u)) return; /* most tiles of most rows keep nothing */
#pragma unroll
    for (int n8 = 0; n8 < PF_KEYS / 8; n8 += 2)
        *reinterpret_cast<float4 *>(stage + 2 * n8) =
                make_float4(s[n8][2 * k], s[n8][2 * k + 1], s[n8 + 1][2 * k], s[n8 + 1][2 * k + 1]);
    const int64_t key = k0 + 2 * (threadIdx.x & 3);
    for (; m; m &= m - 1, at++) {
        const int j = __ffs(m) - 1; /* bit j: key 8 (j / 2) + j % 2 of the lane's */
        if (at < room) {
            A.cand[base + at] = stage[j];
            A.cidx[base + at] = key + (j >> 1) * 8 + (j & 1);
        }
    }
}

} // namespace
