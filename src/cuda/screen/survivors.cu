/*
 * Screened decode on the GPU, after the screen (screen.cu): tau(l) of each query head's
 * candidates, the survivors it keeps, and the KV head's row list (mirrors the CPU's
 * src/cpu/stages/screen_rows.c; docs/math.md §10.3). Every stage runs over splits of a row, not
 * one block per head: the model's attention has 6 query heads and 2 KV heads, so a block per
 * head left ~126 of 132 SMs idle while it walked lists of up to 64K lower bounds.
 *   count:  grid (split, query head): each split counts its share of the head's l >= M - 1
 *           into the row's histogram of l - M (the plan's cand_hist, zero between kernels);
 *           the row's last block turns the counts into a lower bound of tau(l) within two bins
 *           (hist_bound, docs/math.md §9.1) for a list longer than TAU_BOUND_MIN, and resets
 *           the histogram.
 *   short:  grid (split, query head): each split lists its share of the l above that bound
 *           (and above M - 1) in the head's short list (scr_short): at most the support of
 *           tau(l) and two bins more, where the list may hold every token (a flat head's
 *           list of 200K l was read whole by the solve's one block).
 *   solve:  one block per query head: the short list into shared memory and tau(l) over it
 *           from the bound, exact (docs/math.md §9.1: a value at or below a lower bound adds
 *           nothing to F there). A head whose retry list overflowed too keeps every token
 *           (exact, slow), and one whose short list overflowed (more l above the bound than
 *           shared memory holds) solves over its whole list in global memory.
 *   mark:   grid (split, query head): every candidate whose u exceeds tau(l) (lowered by the
 *           solve's tolerance) sets its bit in the KV head's survivor bitmap.
 *   rows:   grid (word chunk, KV head), two passes: each chunk's survivor count, then each
 *           chunk writes its tokens in ascending order at the sum of the counts before it, and
 *           clears its words for the next step.
 */
#include "../common/launch.cuh"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include "../common/sizes.cuh"
#include "../common/splits.cuh"
#include "../common/tau_solve.cuh"
#include "screen.cuh"
#include <math_constants.h>

namespace {

struct taul_args : ekv_cuda_shape {
    double alpha;
    int64_t scap, cap_words;
    int nsplit;  /* blocks per query head of the count, short and mark kernels */
    int smem_cap; /* l values the solve keeps in shared memory: the short list's length */
    const uint32_t *lkey, *scount, *scount2;
    float *short_l;        /* scr_short [B*H][smem_cap]: short -> solve */
    uint32_t *short_count; /* [B*H] its entries (may exceed smem_cap: overflow) */
    const float *scl, *scu;
    const int32_t *sct;
    uint32_t *hist, *done; /* the plan's cand_hist and cand_done (zero between kernels) */
    float *thr;            /* scr_thr: count -> solve, the l kept (-inf: every l >= M - 1) */
    double *tl;            /* scr_tl: solve -> mark, tau(l) less the solve's tolerance */
    uint32_t *marks;       /* [B*H] 1: the first list overflowed, 2: the retry's too */
    unsigned long long *slow_paths; /* the plan's (ekv_cuda_count_slow_paths) or NULL */
    uint32_t *sbits;       /* [B*Hk][cap_words] */
    int64_t *survivors;    /* [B*Hk] */
    int32_t *cand_count;   /* [B*H] zeroed here for the row scores kernel */
};

enum { SPLIT_THREADS = 256, SOLVE_THREADS = 512 };
enum { ROWS_THREADS = EKV_CUDA_ROW_CHUNK_WORDS }; /* a thread per bitmap word */

/* The length of query head row's list: the retry's for a head that retried; above scap when
 * the retry's overflowed too (then every token survives). */
__device__ __forceinline__ int64_t list_length(const taul_args &A, int64_t row) {
    const int64_t n1 = A.scount[row];
    return n1 > A.scap ? (int64_t)A.scount2[row] : n1;
}

/* This block's share [*c0, *c1) of a list of n entries (whole warps of entries). */
__device__ __forceinline__ void split_range(int64_t n, int nsplit, int64_t *c0, int64_t *c1) {
    const int64_t per = ((n + nsplit - 1) / nsplit + 31) / 32 * 32;
    *c0 = (int64_t)blockIdx.x * per;
    *c1 = *c0 + per < n ? *c0 + per : n;
}

/* Bits of tokens [32 w, 32 w + 32) below N. */
__device__ __forceinline__ uint32_t word_mask(int64_t w, int64_t N) {
    const int64_t left = N - 32 * w;
    return left >= 32 ? 0xffffffffu : left <= 0 ? 0u : (1u << left) - 1u;
}

/* The row's last count block: the l kept by the solve, above a lower bound of tau(l) when the
 * l >= M - 1 outnumber its shared memory or TAU_BOUND_MIN (the solve then starts at the bound;
 * -inf otherwise); the histogram reset. Block-wide. */
__device__ void count_finish(const taul_args &A, int64_t row, float M, unsigned *hist, float *pw,
                             double *scratch) {
    const double total = hist_take(A.hist + row * TAU_HIST_BINS, A.done + row, hist, scratch);
    float thr = -CUDART_INF_F;
    if (wants_bound((int64_t)total, A.smem_cap))
        thr = list_bound((double)M + hist_bound(hist, A.alpha, pw, scratch), M);
    if (threadIdx.x == 0) A.thr[row] = thr;
}

__global__ void __launch_bounds__(SPLIT_THREADS) count_kernel(taul_args A) {
    ekv_grid_begin();
    __shared__ unsigned hist[TAU_HIST_BINS];
    __shared__ float pw[TAU_HIST_BINS];
    __shared__ double scratch[128];
    __shared__ bool s_last;
    const int64_t row = blockIdx.y;
    const int64_t n = list_length(A, row);
    const float M = ekv_key_float(A.lkey[row]);
    if (n > A.scap || !(M > -CUDART_INF_F)) return; /* the row's every block returns */
    for (int k = threadIdx.x; k < TAU_HIST_BINS; k += blockDim.x) hist[k] = 0u;
    __syncthreads();
    int64_t c0, c1;
    split_range(n, A.nsplit, &c0, &c1);
    const float *lv = A.scl + row * A.scap;
    for (int64_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
        const double y = (double)lv[i] - (double)M;
        if (y >= -1.0) atomicAdd(hist + tau_hist_bin(y), 1u);
    }
    if (hist_flush_last(hist, A.hist + row * TAU_HIST_BINS, A.done + row, A.nsplit, &s_last))
        count_finish(A, row, M, hist, pw, scratch);
}

/* Every token of the sequence survives: a head whose retry list overflowed too. Block-wide;
 * returns this thread's share of the count. */
__device__ double keep_every_token(uint32_t *bits, int64_t N) {
    for (int64_t w = threadIdx.x; w < (N + 31) / 32; w += blockDim.x)
        atomicOr(bits + w, word_mask(w, N));
    return threadIdx.x == 0 ? (double)N : 0.0;
}

/* grid (split, query head): this split's l above the count's bound lo and above M - 1 (only
 * they can be in the support of entmax(l), docs/math.md §10.3 Claim 3 and §9.1) appended to
 * the head's short list, SHORT_UNROLL loads a lane in flight and one atomic a warp for them (a
 * load and a round trip a 32 of them made a long list wait on both in turn). Their order is
 * free: the solve's sums take any order (the list was filled by atomics before too). */
enum { SHORT_UNROLL = 4 };
__global__ void __launch_bounds__(SPLIT_THREADS) short_kernel(taul_args A) {
    ekv_grid_begin();
    const int64_t row = blockIdx.y;
    const int64_t n = list_length(A, row);
    const float M = ekv_key_float(A.lkey[row]);
    if (n > A.scap || !(M > -CUDART_INF_F)) return; /* the solve reads no list */
    const float lo = A.thr[row];
    const float *lv = A.scl + row * A.scap;
    float *out = A.short_l + row * A.smem_cap;
    int64_t c0, c1;
    split_range(n, A.nsplit, &c0, &c1);
    /* warp-uniform trip count (the append's ballots): c0 is a multiple of 32 */
    const int lane = threadIdx.x & 31;
    for (int64_t base = c0 + (int64_t)(threadIdx.x & ~31) * SHORT_UNROLL; base < c1;
         base += (int64_t)blockDim.x * SHORT_UNROLL) {
        float x[SHORT_UNROLL];
        unsigned m[SHORT_UNROLL];
        uint32_t tot = 0;
#pragma unroll
        for (int k = 0; k < SHORT_UNROLL; k++) {
            const int64_t i = base + 32 * k + lane;
            x[k] = i < c1 ? lv[i] : -CUDART_INF_F;
        }
#pragma unroll
        for (int k = 0; k < SHORT_UNROLL; k++) {
            m[k] = __ballot_sync(0xffffffffu, x[k] > lo && (double)x[k] > (double)M - 1.0);
            tot += (uint32_t)__popc(m[k]);
        }
        if (!tot) continue;
        uint32_t at = ekv_warp_reserve(A.short_count + row, tot);
#pragma unroll
        for (int k = 0; k < SHORT_UNROLL; k++) {
            const uint32_t pos = at + (uint32_t)ekv_lane_rank(m[k]);
            if (((m[k] >> lane) & 1u) && pos < (uint32_t)A.smem_cap) out[pos] = x[k];
            at += (uint32_t)__popc(m[k]);
        }
    }
}

/* tau(l) - M over the head's short list (the l above lo), from lo's bound: in shared memory,
 * or, when the short list overflowed, over the whole list of n in global memory. */
__device__ double solve_taul(const taul_args &A, int64_t row, int64_t n, float M, float *cand,
                             double *scratch) {
    const int64_t nk = A.short_count[row];
    const double t0 = fmax(-1.0, (double)A.thr[row] - (double)M); /* -inf: from M - 1 */
    if (nk > A.smem_cap) return solve_tau(A.scl + row * A.scap, n, M, A.alpha, scratch, t0);
    const float *sl = A.short_l + row * A.smem_cap;
    for (int64_t i = threadIdx.x; i < nk; i += blockDim.x) cand[i] = sl[i];
    __syncthreads();
    return solve_tau(cand, nk, M, A.alpha, scratch, t0);
}

__global__ void __launch_bounds__(SOLVE_THREADS) solve_kernel(taul_args A) {
    ekv_grid_begin();
    extern __shared__ float cand[];
    __shared__ double scratch[128];
    const int64_t row = blockIdx.x;
    const int b = (int)(row / A.H), lrow = b * A.Hk + (int)(row % A.H) / A.G;
    if (threadIdx.x == 0) A.cand_count[row] = 0;
    const int64_t n1 = A.scount[row], n = list_length(A, row);
    if (threadIdx.x == 0) {
        A.marks[row] = (n1 > A.scap ? 1u : 0u) | (n > A.scap ? 2u : 0u);
        if (A.slow_paths && n1 > A.scap)
            atomicAdd(A.slow_paths + (n > A.scap ? EKV_SLOW_SCREEN_ALL : EKV_SLOW_SCREEN_RETRIED),
                      1ull);
    }
    if (n > A.scap) { /* the mark kernel skips this row */
        const double c = keep_every_token(A.sbits + (int64_t)lrow * A.cap_words,
                                          ekv_seq(A.t, b, A.ps).N);
        if (threadIdx.x == 0)
            atomicAdd(reinterpret_cast<unsigned long long *>(&A.survivors[lrow]),
                      (unsigned long long)c);
        return;
    }
    const float M = ekv_key_float(A.lkey[row]);
    double tl = -HUGE_VAL; /* no finite l: nothing is dropped */
    if (M > -CUDART_INF_F && n > 0) {
        const double tau = (double)M + solve_taul(A, row, n, M, cand, scratch);
        tl = tau - 1e-12 * (1.0 + fabs(tau)); /* the solve's tolerance (docs/math.md §10.3) */
    }
    if (threadIdx.x == 0) A.tl[row] = tl;
}

__global__ void __launch_bounds__(SPLIT_THREADS) mark_kernel(taul_args A) {
    ekv_grid_begin();
    __shared__ double scratch[32];
    const int64_t row = blockIdx.y;
    const int64_t n = list_length(A, row);
    if (n > A.scap) return; /* the solve kept every token */
    const int lrow = (int)(row / A.H) * A.Hk + (int)(row % A.H) / A.G;
    uint32_t *bits = A.sbits + (int64_t)lrow * A.cap_words;
    const double tl = A.tl[row];
    int64_t c0, c1;
    split_range(n, A.nsplit, &c0, &c1);
    double cnt = 0;
    for (int64_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
        if ((double)A.scu[row * A.scap + i] <= tl) continue;
        const int32_t tok = A.sct[row * A.scap + i];
        atomicOr(bits + (tok >> 5), 1u << (tok & 31));
        cnt += 1;
    }
    cnt = ekv_block_sum(cnt, scratch);
    if (threadIdx.x == 0 && cnt > 0)
        atomicAdd(reinterpret_cast<unsigned long long *>(&A.survivors[lrow]),
                  (unsigned long long)cnt);
}

struct rows_args : ekv_cuda_shape {
    int64_t cap_words, chunks; /* chunks: the plan's word chunks per KV head */
    uint32_t *sbits;
    int32_t *chunk_count; /* [B*Hk][chunks] survivors per chunk (count -> write) */
    int32_t *rows, *row_count, *list_count;
    int64_t *v_rows;
    int32_t *ucount; /* the group's union list (union_mark), zeroed here */
};

/* This thread's word of the row's bitmap (one word per thread, ROWS_THREADS per chunk), the
 * tokens past the sequence masked off; *w its index, past W when none. */
__device__ __forceinline__ uint32_t rows_word(const rows_args &A, const uint32_t *bits, int64_t N,
                                              int64_t *w) {
    *w = (int64_t)blockIdx.x * ROWS_THREADS + threadIdx.x;
    return *w < (N + 31) / 32 ? bits[*w] & word_mask(*w, N) : 0u;
}

/* The chunks of a row of N tokens. */
__device__ __forceinline__ int64_t chunks_used(int64_t N) {
    return ((N + 31) / 32 + ROWS_THREADS - 1) / ROWS_THREADS;
}

__global__ void __launch_bounds__(ROWS_THREADS) rows_count_kernel(rows_args A) {
    ekv_grid_begin();
    __shared__ double scratch[32];
    const int row = blockIdx.y;
    const ekv_seq_geom sg = ekv_seq(A.t, row / A.Hk, A.ps);
    if ((int64_t)blockIdx.x >= chunks_used(sg.N)) return;
    int64_t w;
    const uint32_t x = rows_word(A, A.sbits + (int64_t)row * A.cap_words, sg.N, &w);
    const double c = ekv_block_sum((double)__popc(x), scratch);
    if (threadIdx.x == 0) A.chunk_count[(int64_t)row * A.chunks + blockIdx.x] = (int32_t)c;
}

/* The survivors in the chunks of the row before this one (all of them for the last). */
__device__ int64_t chunks_before(const rows_args &A, int row, int64_t upto, double *scratch) {
    double s = 0;
    for (int64_t k = threadIdx.x; k < upto; k += blockDim.x)
        s += A.chunk_count[(int64_t)row * A.chunks + k];
    return (int64_t)ekv_block_sum(s, scratch);
}

__global__ void __launch_bounds__(ROWS_THREADS) rows_write_kernel(rows_args A) {
    ekv_grid_begin();
    __shared__ double scratch[32];
    __shared__ int wsum[32];
    const int row = blockIdx.y;
    const ekv_seq_geom sg = ekv_seq(A.t, row / A.Hk, A.ps);
    const int64_t used = chunks_used(sg.N);
    if (blockIdx.x == 0) { /* the row's count and the attend kernels' counters of the step */
        const int64_t total = chunks_before(A, row, used, scratch);
        if (threadIdx.x == 0) {
            A.row_count[row] = (int32_t)total;
            A.v_rows[row] = 0;
            A.ucount[row] = 0;
            A.list_count[2 * row] = A.list_count[2 * row + 1] = 0; /* no page lists */
        }
    }
    if ((int64_t)blockIdx.x >= used) return;
    const int64_t before = chunks_before(A, row, blockIdx.x, scratch);
    uint32_t *bits = A.sbits + (int64_t)row * A.cap_words;
    int64_t w;
    const uint32_t x = rows_word(A, bits, sg.N, &w);
    int total;
    int64_t pos = before + ekv_block_exclusive_scan(__popc(x), wsum, &total);
    if (w < (sg.N + 31) / 32) bits[w] = 0;
    int32_t *out = A.rows + (int64_t)row * A.cap_tokens;
    for (uint32_t y = x; y; y &= y - 1) out[pos++] = (int32_t)(32 * w + __ffs(y) - 1);
}

/* Blocks per query head of the count, short and mark kernels: about two waves over the step's heads. */
int taul_splits(const ekv_cuda_plan *pl, int heads) {
    const int s = (2 * pl->sms + heads - 1) / heads;
    return s < 1 ? 1 : s > 256 ? 256 : s;
}

void set_taul_args(taul_args &T, ekv_cuda_plan *pl, const ekv_decode_params *prm,
                   const ekv_page_table *t, int batch) {
    ekv_cuda_set_shape(T, pl, t);
    T.alpha = prm->alpha;
    T.scap = pl->scap;
    T.cap_words = pl->cap_words;
    T.nsplit = taul_splits(pl, batch * T.H);
    T.smem_cap = (int)pl->short_cap;
    T.lkey = ekv_scr_row(pl, EKV_SCR_LKEY);
    T.scount = ekv_scr_row(pl, EKV_SCR_COUNT);
    T.scount2 = ekv_scr_row(pl, EKV_SCR_COUNT2);
    T.marks = ekv_scr_row(pl, EKV_SCR_MARKS);
    T.short_count = ekv_scr_row(pl, EKV_SCR_SHORT);
    T.short_l = pl->scr_short;
    T.slow_paths = pl->slow_paths;
    T.scl = pl->scl;
    T.scu = pl->scu;
    T.sct = pl->sct;
    T.hist = pl->cand_hist;
    T.done = pl->cand_done;
    T.thr = pl->scr_thr;
    T.tl = pl->scr_tl;
    T.sbits = pl->sbits;
    T.survivors = pl->survivors;
    T.cand_count = pl->cand_count;
}

ekv_status launch_taul(ekv_cuda_plan *pl, const ekv_decode_params *prm, const ekv_page_table *t,
                       int batch) {
    taul_args T;
    set_taul_args(T, pl, prm, t, batch);
    const dim3 split_grid((unsigned)T.nsplit, (unsigned)(batch * T.H));
    const size_t smem = (size_t)T.smem_cap * sizeof(float);
    EKV_CUDA_TRY(pl, ekv_cuda_allow_smem<solve_kernel>(smem));
    ekv_status s = ekv_cuda_launch(pl, count_kernel, split_grid, SPLIT_THREADS, 0, T);
    if (!s) s = ekv_cuda_launch(pl, short_kernel, split_grid, SPLIT_THREADS, 0, T);
    if (!s) s = ekv_cuda_launch(pl, solve_kernel, batch * T.H, SOLVE_THREADS, smem, T);
    return s ? s : ekv_cuda_launch(pl, mark_kernel, split_grid, SPLIT_THREADS, 0, T);
}

ekv_status launch_rows(ekv_cuda_plan *pl, const ekv_page_table *t, int batch) {
    rows_args R;
    ekv_cuda_set_shape(R, pl, t);
    R.cap_words = pl->cap_words;
    R.chunks = pl->row_chunks;
    R.sbits = pl->sbits;
    R.chunk_count = pl->row_chunk_count;
    R.rows = pl->rows;
    R.row_count = pl->row_count;
    R.list_count = pl->list_count;
    R.v_rows = pl->v_rows;
    R.ucount = pl->ucount;
    const dim3 grid((unsigned)R.chunks, (unsigned)(batch * R.Hk));
    const ekv_status s = ekv_cuda_launch(pl, rows_count_kernel, grid, ROWS_THREADS, 0, R);
    return s ? s : ekv_cuda_launch(pl, rows_write_kernel, grid, ROWS_THREADS, 0, R);
}

} // namespace

ekv_status ekv_cuda_launch_survivors(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                     const ekv_page_table *t, int batch) {
    const ekv_status s = launch_taul(pl, prm, t, batch);
    return s ? s : launch_rows(pl, t, batch);
}
