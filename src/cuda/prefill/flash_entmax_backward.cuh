/*
 * The tensor-core backward of exact entmax attention (ekv_cuda_flash_entmax_backward,
 * docs/math.md §13.3, "On tensor cores"): what its two kernels share. The entry
 * (flash_entmax_backward.cu) splits q and dout into 16-bit parts of K's dtype where they are not
 * K's dtype already, then runs
 *   1. the rows pass (flash_entmax_bwd_rows.cu): per row, delta = dout . o-hat (the forward's
 *      o-hat, §13.3), then one sweep for S = sum p~ (so 1 / S and S^(alpha - 2)) and
 *      dq = sum ds k in registers;
 *   2. the keys pass (flash_entmax_bwd_keys.cu): per (KV head, 64-key tile) a block that loops
 *      over the 16-row blocks of the group's rows that see the tile: S^T and g^T recomputed,
 *      p, ds, then dV += P^T dO, dK += dS^T Q in registers.
 * Each output element is summed by one thread in a fixed order: no atomics, the same bits on
 * every call (torch's tests compare a compiled graph's gradients with eager ones bitwise).
 * A KV head's rows are r = t G + j (head g G + j, as the forward's fused kernel orders them), so
 * every row block reads the same K/V tiles whatever its head.
 */
#pragma once
#include "flash_entmax.cuh"
#include "../common/mma.cuh"

enum {
    BWD_THREADS = 128, /* 4 warps */
    BWD_WARPS = BWD_THREADS / 32,
    BWD_KEYS = 64,         /* keys of a tile: 16 per warp in the keys pass */
    BWD_ROWS = 16,         /* query rows of a row block of the keys pass */
    BWD_ROW_BLOCK = 64,    /* query rows of a block of the rows pass: 16 per warp */
    BWD_SPLIT_PARTS = 3,   /* parts of a q or dout that is not K's dtype (24 bits and more) */
    BWD_OPERAND_PARTS = 2, /* parts of P and dS as mma operands (docs/math.md §13.3) */
    BWD_KEY_BLOCKS = 1024, /* keys pass: split each tile's rows until about this many blocks */
    BWD_MAX_SPLITS = 8
};

/* The formula of p~ and w~ of a call (bwd_weights), chosen once from alpha. */
enum bwd_wkind {
    BWD_W_SOFTMAX, /* alpha 1: exp */
    BWD_W_SQUARE,  /* beta 2 (alpha 1.5): p~ = x^2, w~ = x */
    BWD_W_LINEAR,  /* beta 1 (alpha 2): p~ = x, w~ = 1 */
    BWD_W_POWER    /* any other beta: w~ = x^(beta - 1), p~ = w~ x */
};

struct bwd_args {
    int64_t B, T, N, H, Hk, G, D, R, pos0; /* R = T G rows per KV head; row t at pos0 + t */
    int causal;
    float qf;                     /* a * scale as the forward's scores take it */
    float scale;                  /* the effective scale: ds is d/d(q.k) */
    double alpha, beta, a;        /* a: z = a s (softmax: 1) */
    int wkind;                    /* bwd_weights' formula: a bwd_wkind */
    float bm1;                    /* beta - 1 (BWD_W_POWER) */
    const float *slopes;          /* [H] device, or NULL */
    const void *q, *g;            /* [NP][B][T][H][D] parts of q and dout in K's dtype */
    int64_t part_stride;          /* elements between parts: B T H D */
    const void *k, *v;            /* [B][N][Hk][D] */
    const double *tau;            /* [B][T][H] */
    const float *ohat;            /* [B][T][H][D] the forward's o-hat: delta = dout . o-hat */
    float *rinv, *wscale, *delta; /* [B][T][H]: 1 / S, S^(alpha - 2), delta (the rows pass) */
    void *dq;                     /* [B][T][H][D] of dtype dq_dtype (q's) */
    int dq_dtype;
    void *dk, *dv;            /* [B][N][Hk][D] K's dtype */
    int key_splits;           /* the keys pass's splits of each tile's rows (1: none) */
    float *dk_part, *dv_part; /* [key_splits][B][N][Hk][D] fp32 partial sums, or NULL */
};

/* The passes' grids, one-dimensional: the rows pass a block per (64-row block, sequence, KV
 * head), the keys pass per (64-key tile, sequence, KV head, split). The entry checks them
 * against 2^31; the launches use them. */
__host__ __device__ inline int64_t bwd_row_blocks(int64_t R) {
    return (R + BWD_ROW_BLOCK - 1) / BWD_ROW_BLOCK;
}
__host__ __device__ inline int64_t bwd_key_tiles(int64_t N) {
    return (N + BWD_KEYS - 1) / BWD_KEYS;
}
inline int64_t bwd_rows_grid(int64_t B, int64_t R, int64_t Hk) {
    return B * bwd_row_blocks(R) * Hk;
}
inline int64_t bwd_keys_grid(int64_t B, int64_t N, int64_t Hk, int64_t splits) {
    return B * bwd_key_tiles(N) * Hk * splits;
}

/* The passes (NP: parts of q and dout, 1 or BWD_SPLIT_PARTS), launched on stream s. */
cudaError_t flash_bwd_rows(const bwd_args &A, ekv_dtype kv, int np, cudaStream_t s);
cudaError_t flash_bwd_keys(const bwd_args &A, ekv_dtype kv, int np, cudaStream_t s);

/* Pass::launch<T, D, NP, W>(A, s) with the storage type T of K's dtype kv (F16, else BF16), the
 * head dim D = A.D (64, else 128), the parts NP = np (1, else BWD_SPLIT_PARTS) and the weights'
 * formula W = A.wkind (a bwd_wkind: no branch on it a score): the one ladder that both passes'
 * kernels are launched through. */
template <typename Pass>
static inline cudaError_t bwd_launch(const bwd_args &A, ekv_dtype kv, int np, cudaStream_t s) {
    auto with_kind = [&](auto ty, auto d, auto p) {
        typedef typename decltype(ty)::type T;
        constexpr int D = decltype(d)::value, NP = decltype(p)::value;
        switch (A.wkind) {
        case BWD_W_SOFTMAX: return Pass::template launch<T, D, NP, BWD_W_SOFTMAX>(A, s);
        case BWD_W_SQUARE: return Pass::template launch<T, D, NP, BWD_W_SQUARE>(A, s);
        case BWD_W_LINEAR: return Pass::template launch<T, D, NP, BWD_W_LINEAR>(A, s);
        default: return Pass::template launch<T, D, NP, BWD_W_POWER>(A, s);
        }
    };
    auto with_type = [&](auto ty) {
        typedef std::integral_constant<int, 1> one;
        typedef std::integral_constant<int, BWD_SPLIT_PARTS> split;
        typedef std::integral_constant<int, 64> d64;
        typedef std::integral_constant<int, 128> d128;
        if (A.D == 64) return np == 1 ? with_kind(ty, d64{}, one{}) : with_kind(ty, d64{}, split{});
        return np == 1 ? with_kind(ty, d128{}, one{}) : with_kind(ty, d128{}, split{});
    };
    return kv == EKV_DTYPE_F16 ? with_type(ekv_cuda_type<__half>{})
                               : with_type(ekv_cuda_type<__nv_bfloat16>{});
}

namespace {

/* The scale of P before its split into parts: f16's 2^14, so that the parts of p <= 1 stay
 * normal (as the forward's pscale, prefill.cu), 1 for bf16 (fp32's range); exact, undone on dV.
 * docs/math.md §13.3, "On tensor cores". */
template <typename T> __device__ constexpr float bwd_pscale() {
    return std::is_same<T, __half>::value ? 16384.f : 1.f;
}

/* Bytes of a 16-row tile of D 16-bit elements (tile_chunk's swizzled layout, mma.cuh). */
template <int D> __host__ __device__ constexpr int bwd_tile16() { return 16 * D * 2; }

/* Row r of a KV head's R rows as its query position t = r / G and its head j = r % G in the
 * group. A thread that visits rows a fixed stride apart steps (t, j) by the stride's
 * bwd_rowstep instead of dividing by G at each row (the keys pass copies its rows anew for
 * every stage). */
struct bwd_rowpos {
    int64_t t;
    int j;
};
struct bwd_rowstep { /* a stride of n rows: n / G, n % G */
    int64_t dt;
    int dj;
};
__device__ __forceinline__ bwd_rowpos bwd_rowpos_of(const bwd_args &A, int64_t r) {
    const int64_t t = r / A.G;
    return {t, (int)(r - t * A.G)};
}
__device__ __forceinline__ bwd_rowstep bwd_rowstep_of(const bwd_args &A, int64_t n) {
    const int64_t dt = n / A.G;
    return {dt, (int)(n - dt * A.G)};
}
__device__ __forceinline__ void bwd_rowpos_add(const bwd_args &A, bwd_rowpos &p, bwd_rowstep s) {
    p.t += s.dt, p.j += s.dj;
    if (p.j >= A.G) p.t++, p.j -= (int)A.G;
}

/* The row at p (of KV head g, sequence b) in [B][T][H] (tau, rinv, wscale, delta). */
__device__ __forceinline__ int64_t bwd_rowpos_index(const bwd_args &A, int64_t b, int64_t g,
                                                    bwd_rowpos p) {
    return (b * A.T + p.t) * A.H + g * A.G + p.j;
}
/* Row r the same way, and as an element offset into [B][T][H][D]. */
__device__ __forceinline__ int64_t bwd_row_index(const bwd_args &A, int64_t b, int64_t g,
                                                 int64_t r) {
    return bwd_rowpos_index(A, b, g, bwd_rowpos_of(A, r));
}
__device__ __forceinline__ int64_t bwd_row_offset(const bwd_args &A, int64_t b, int64_t g,
                                                  int64_t r) {
    return bwd_row_index(A, b, g, r) * A.D;
}

/* a m_h of head j of KV head g's group: the ALiBi slope in z-space as the forward forms it (0
 * without). */
__device__ __forceinline__ float bwd_row_am(const bwd_args &A, int64_t g, int j) {
    return A.slopes ? (float)(A.a * (double)A.slopes[g * A.G + j]) : 0.f;
}

/* The rows a thread of a block of BWD_THREADS copies in bwd_load_rows: from r0 + threadIdx.x / CH
 * (its first), bwd_load_stride<D>() apart, chunk threadIdx.x % CH of each (CH = D / 8). */
template <int D> __host__ __device__ constexpr int bwd_load_stride() {
    return BWD_THREADS / (D / 8);
}
template <int D> __device__ __forceinline__ int bwd_load_first() {
    return (int)threadIdx.x / (D / 8);
}

/* Rows [r0, r0 + nrows) of a [.][T][H][D] tensor's NP parts (part p at src + p part_stride) into
 * NP consecutive swizzled tiles of nrows rows at dst, by cp.async over the block's BWD_THREADS
 * threads; rows at or past R are zero-filled (their scores are masked, but 0 x stale NaN is
 * NaN). first: the position of the thread's first row (bwd_load_first), step: of
 * bwd_load_stride rows. */
template <typename T, int D, int NP>
__device__ __forceinline__ void bwd_load_rows(const bwd_args &A, const void *src, int64_t b,
                                              int64_t g, int64_t r0, int nrows, bwd_rowpos first,
                                              bwd_rowstep step, unsigned char *dst) {
    constexpr int CH = D / 8;
    const T *s = static_cast<const T *>(src);
    const int c = threadIdx.x % CH;
    bwd_rowpos p = first;
    for (int rr = bwd_load_first<D>(); rr < nrows;
         rr += bwd_load_stride<D>(), bwd_rowpos_add(A, p, step)) {
        const int64_t o = bwd_rowpos_index(A, b, g, p) * D + c * 8;
#pragma unroll
        for (int part = 0; part < NP; part++) {
            unsigned char *d = dst + part * nrows * D * 2 + tile_chunk<D>(rr, c);
            if (r0 + rr < A.R)
                cp_async16(d, s + part * A.part_stride + o);
            else
                *reinterpret_cast<uint4 *>(d) = make_uint4(0, 0, 0, 0);
        }
    }
}
/* The same, the thread's first row and the step found here (two divisions by G). */
template <typename T, int D, int NP>
__device__ __forceinline__ void bwd_load_rows(const bwd_args &A, const void *src, int64_t b,
                                              int64_t g, int64_t r0, int nrows,
                                              unsigned char *dst) {
    bwd_load_rows<T, D, NP>(A, src, b, g, r0, nrows, bwd_rowpos_of(A, r0 + bwd_load_first<D>()),
                            bwd_rowstep_of(A, bwd_load_stride<D>()), dst);
}

/* Keys [k0, k0 + BWD_KEYS) of KV head g of K or V ([B][N][Hk][D]) into a swizzled 64-row tile,
 * by cp.async over the block's threads; keys at or past N zero-filled (as bwd_load_rows). */
template <typename T, int D>
__device__ __forceinline__ void bwd_load_keys(const bwd_args &A, const void *src, int64_t b,
                                              int64_t g, int64_t k0, unsigned char *dst) {
    constexpr int CH = D / 8;
    const T *s = static_cast<const T *>(src);
    for (int i = threadIdx.x; i < BWD_KEYS * CH; i += blockDim.x) {
        const int rr = i / CH, c = i % CH;
        unsigned char *d = dst + tile_chunk<D>(rr, c);
        if (k0 + rr < A.N)
            cp_async16(d, s + ((b * A.N + k0 + rr) * A.Hk + g) * A.D + c * 8);
        else
            *reinterpret_cast<uint4 *>(d) = make_uint4(0, 0, 0, 0);
    }
}

/* s[nt][i] += <a_m, b_n> over D for m = lane / 4 + 8 (i / 2), n = nt 8 + 2 (lane % 4) + i % 2:
 * rows m of the 16-row tile at at (the A operand) against rows n of the 16-row tile at bt (the
 * B operand), both swizzled 16-bit tiles, summed in the tensor cores' fp32 accumulator (the
 * products are exact, docs/math.md §3.1; the sums' rounding: §13.3, "On tensor cores"). */
template <typename T, int D>
__device__ __forceinline__ void bwd_tile_dot(const unsigned char *at, const unsigned char *bt,
                                             float (*s)[4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[4], b[4]; /* b: n 0-7 (b[0], b[1]) and n 8-15 (b[2], b[3]) */
        ldmatrix_x4(a, at + tile_chunk<D>(lane & 15, 2 * kk + (lane >> 4)));
        ldmatrix_x4(
                b, bt + tile_chunk<D>((lane & 7) + ((lane >> 4) << 3), 2 * kk + ((lane >> 3) & 1)));
#pragma unroll
        for (int nt = 0; nt < 2; nt++) mma_16816_acc<T>(s[nt], a, b[2 * nt], b[2 * nt + 1]);
    }
}

/* The same over NP parts (part p of the A tile at at + p astride bytes, of the B tile at
 * bt + p bstride; one of the strides 0): a row's scores or dout . v with q or dout in parts. */
template <typename T, int D, int NP>
__device__ __forceinline__ void bwd_tile_dot_parts(const unsigned char *at, int astride,
                                                   const unsigned char *bt, int bstride,
                                                   float (*s)[4]) {
    mma_zero<2>(s);
#pragma unroll
    for (int p = 0; p < NP; p++) bwd_tile_dot<T, D>(at + p * astride, bt + p * bstride, s);
}

/* tau as two floats, hi + lo (hi = rn(tau), lo = rn(tau - hi)): z - tau in fp32 as
 * (z - hi) - lo, within an ulp or two of x = z - tau (docs/math.md §13.3, "On tensor cores") */
struct bwd_tau {
    float hi, lo;
};
__device__ __forceinline__ bwd_tau bwd_tau_of(double tau) {
    const float hi = (float)tau;
    return {hi, (float)(tau - (double)hi)};
}

/* p~ and w~ of a score z (-inf: a key the row does not see) given tau, in fp32 (docs/math.md
 * §13.3): p~ = [z - tau]_+^beta (softmax: exp(z - tau)), w~ = p~^(2 - alpha) = x^(beta - 1) on
 * the support, 0 outside (a key at tau gets no gradient, §13.4); W = A.wkind picks the formula. */
template <int W>
__device__ __forceinline__ void bwd_weights(const bwd_args &A, float z, bwd_tau t, float *p,
                                            float *w) {
    const float x = (z - t.hi) - t.lo;
    if (W == BWD_W_SOFTMAX) {
        *p = *w = expf(x);
        return;
    }
    const bool in = x > 0.f; /* false for NaN and -inf too */
    if (W == BWD_W_SQUARE) {
        *p = in ? x * x : 0.f, *w = in ? x : 0.f;
    } else if (W == BWD_W_LINEAR) {
        *p = in ? x : 0.f, *w = in ? 1.f : 0.f;
    } else {
        *w = in ? powf(x, A.bm1) : 0.f;
        *p = in ? *w * x : 0.f; /* x may be -inf */
    }
}

/* ds of a score from its w~ and g: dsmul = scale S^(alpha - 2) of its row (docs/math.md §13.3);
 * 0 off the support (w~ = 0), whatever g is. */
__device__ __forceinline__ float bwd_ds(float dsmul, float w, float g, float delta) {
    return w != 0.f ? dsmul * w * (g - delta) : 0.f;
}

/* z of a (row, key) pair from s = q . k: a (scale q.k - m_h |j - i|) as the forward forms it
 * (docs/math.md §12), with rel = j - i as a float (exact below 2^24, and within z's own
 * rounding past it); -inf where the row does not see the key (in false: causal, past N, or no
 * row). am is 0 without ALiBi. */
__device__ __forceinline__ float bwd_z(const bwd_args &A, float s, float am, float rel, bool in) {
    return in ? fmaf(s, A.qf, -am * fabsf(rel)) : -CUDART_INF_F;
}

/* How many of the 64 keys of the tile from k0 a row at position pos sees (0 for no row, !on):
 * those before N and, causal, at or before pos; a row sees a prefix of every tile. */
__device__ __forceinline__ int bwd_visible(const bwd_args &A, int64_t pos, bool on, int64_t k0) {
    const int64_t end = A.causal && pos + 1 < A.N ? pos + 1 : A.N;
    const int64_t n = on ? end - k0 : 0;
    return n <= 0 ? 0 : n >= BWD_KEYS ? BWD_KEYS : (int)n;
}

} // namespace
