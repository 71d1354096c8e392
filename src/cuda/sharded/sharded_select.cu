/*
 * The top-k page lists of the sharded plan (docs/math.md §11, "Top-k across shards"): the
 * global k-th largest bound key T of every list found digit by digit from histograms summed
 * over the shards, the rule of src/math/shard_select.h (the CPU simulation's, written once).
 * Per shard and step, after its bound stage (which ranks a shard's own last page unless it is
 * the sequence's, shard_pos):
 *   hist:   one block per list, the 256-bin histogram of the next digit over the shard's ranked
 *           keys that match the agreed prefix (level 0: every key; its payload also carries the
 *           shard's pages and tokens of each sequence, which a shard's table alone lacks);
 *   update: one thread per list, the same step on every shard from the summed histogram
 *           (level 0 first starts the list: k from the sequence's global length and pages);
 *   ties:   one block per list, the shard's count of keys equal to T in its slot of S;
 *   write:  one block per list, the ordered compaction: keys above T, and the ties whose rank
 *           over the earlier shards' ties and this shard's earlier pages is below what remains;
 *           the last shard closes the list with the sequence's last page.
 * The sharded plan runs 4 levels and the tie round always (5 allreduce-sums), so a step reads
 * nothing on the host and stays capturable; a list that agreed early sends zeros.
 */
#include "../common/launch.cuh"
#include "../common/lists.cuh"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include "sharded.cuh"
#include "../common/splits.cuh"
#include "../../core/geometry.h"
#include "../../math/shard_select.h"

namespace {

enum { TK_THREADS = 256, TW_THREADS = 1024, TW_UNROLL = 8 };

struct topk_shard_args : ekv_cuda_shape {
    int shard_pos;     /* EKV_SHARD_* of this shard's table                          */
    int shard, S;      /* this shard and the shard count (the tie round's slots)     */
    int level;         /* 0 .. EKV_TOPK_LEVELS - 1                                   */
    int64_t lists;     /* batch x lists per sequence                                 */
    int lps;           /* lists per sequence (KV heads, or query heads per_query_head) */
    const float *keys; /* [lists][cap_pages] the lists' bounds (the group's max, or a head's) */
    int64_t budget_tokens;
    double budget_fraction;
    ekv_topk_agree *ag; /* [lists] this shard's copy of the agreement                 */
    double *red;        /* the allreduce payload                                      */
    ekv_cuda_lists out;
};

/* The payload offset of the shards' pages and tokens per sequence (level 0 only). */
__device__ __forceinline__ int64_t geometry_at(const topk_shard_args &A) {
    return A.lists * EKV_TOPK_BINS;
}

/* A list that has not started counts every ranked key at level 0. */
__device__ __forceinline__ ekv_topk_agree state_of(const topk_shard_args &A, int64_t row) {
    if (A.level > 0) return A.ag[row];
    ekv_topk_agree s;
    s.prefix = 0;
    s.bits = 0;
    s.need = 1;
    s.phase = EKV_TOPK_RUNNING;
    return s;
}

__global__ void __launch_bounds__(TK_THREADS) hist_kernel(topk_shard_args A) {
    ekv_grid_begin();
    __shared__ int hist[EKV_TOPK_BINS];
    const int64_t row = blockIdx.x;
    const int b = (int)(row / A.lps);
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const int64_t n = ekv_shard_ranked_pages(sg.P, A.shard_pos);
    const ekv_topk_agree s = state_of(A, row);
    for (int i = threadIdx.x; i < EKV_TOPK_BINS; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    const float *key = A.keys + row * A.cap_pages;
    if (s.phase == EKV_TOPK_RUNNING)
        for (int64_t p = threadIdx.x; p < n; p += blockDim.x) {
            const int bin = ekv_topk_bin(&s, ekv_bound_key(key[p]));
            if (bin >= 0) atomicAdd(&hist[bin], 1);
        }
    __syncthreads();
    for (int i = threadIdx.x; i < EKV_TOPK_BINS; i += blockDim.x)
        A.red[row * EKV_TOPK_BINS + i] = (double)hist[i];
    if (A.level == 0 && row % A.lps == 0 && threadIdx.x == 0) {
        A.red[geometry_at(A) + 2 * b] = (double)sg.P;
        A.red[geometry_at(A) + 2 * b + 1] = (double)sg.N;
    }
}

__global__ void update_kernel(topk_shard_args A) {
    ekv_grid_begin();
    const int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (row >= A.lists) return;
    ekv_topk_agree s;
    if (A.level == 0) { /* the sequence's pages and tokens, summed over the shards */
        const int64_t b = row / A.lps;
        const int64_t P = (int64_t)A.red[geometry_at(A) + 2 * b],
                      N = (int64_t)A.red[geometry_at(A) + 2 * b + 1];
        const int64_t ranked = ekv_shard_ranked_pages(P, EKV_SHARD_WHOLE);
        const int64_t budget = ekv_seq_budget_tokens(A.budget_fraction, A.budget_tokens, N);
        ekv_topk_agree_start(&s, ranked, ekv_topk_page_count(budget, A.ps, ranked));
    } else {
        s = A.ag[row];
    }
    ekv_topk_agree_step(&s, A.red + row * EKV_TOPK_BINS);
    A.ag[row] = s;
}

__global__ void __launch_bounds__(TK_THREADS) ties_kernel(topk_shard_args A) {
    ekv_grid_begin();
    __shared__ int count;
    const int64_t row = blockIdx.x;
    const ekv_seq_geom sg = ekv_seq(A.t, (int)(row / A.lps), A.ps);
    const int64_t n = ekv_shard_ranked_pages(sg.P, A.shard_pos);
    const ekv_topk_agree s = A.ag[row];
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    const float *key = A.keys + row * A.cap_pages;
    int mine = 0;
    if (s.phase == EKV_TOPK_TIES)
        for (int64_t p = threadIdx.x; p < n; p += blockDim.x)
            mine += ekv_topk_take(&s, ekv_bound_key(key[p])) < 0;
    if (mine) atomicAdd(&count, mine);
    __syncthreads();
    for (int i = threadIdx.x; i < A.S; i += blockDim.x)
        A.red[row * A.S + i] = i == A.shard ? (double)count : 0.0;
}

__global__ void __launch_bounds__(TW_THREADS) write_kernel(topk_shard_args A) {
    ekv_grid_begin();
    __shared__ int wsum[32];
    const int64_t row = blockIdx.x;
    const ekv_seq_geom sg = ekv_seq(A.t, (int)(row / A.lps), A.ps);
    const int64_t n = ekv_shard_ranked_pages(sg.P, A.shard_pos);
    const ekv_topk_agree s = A.ag[row];
    int64_t before = 0; /* the ties on earlier shards (the tie round's slots) */
    if (s.phase == EKV_TOPK_TIES)
        for (int i = 0; i < A.shard; i++) before += (int64_t)A.red[row * A.S + i];
    const float *key = A.keys + row * A.cap_pages;
    int32_t *out = A.out.pages + row * A.cap_pages;
    uint8_t *in = A.out.in + row * A.cap_pages;
    int written = 0;
    int64_t ties_seen = 0;
    /* tiles of TW_THREADS x TW_UNROLL pages, each thread TW_UNROLL consecutive ones: a block
     * scan ranks the tile's ties in page order, ekv_compact_tile keeps the list in page order */
    for (int64_t t0 = 0; t0 < n; t0 += (int64_t)blockDim.x * TW_UNROLL) {
        const int64_t lo = t0 + (int64_t)threadIdx.x * TW_UNROLL;
        int tk[TW_UNROLL], nties = 0;
#pragma unroll
        for (int u = 0; u < TW_UNROLL; u++) {
            tk[u] = lo + u < n ? ekv_topk_take(&s, ekv_bound_key(key[lo + u])) : 0;
            nties += tk[u] < 0;
        }
        int tile_ties;
        int64_t tie_i = before + ties_seen + ekv_block_exclusive_scan(nties, wsum, &tile_ties);
        bool take[TW_UNROLL];
#pragma unroll
        for (int u = 0; u < TW_UNROLL; u++)
            take[u] = tk[u] > 0 || (tk[u] < 0 && ekv_topk_tie_taken(&s, tie_i++));
        ekv_compact_tile<TW_UNROLL>(take, lo, n, out, in, &written, wsum);
        ties_seen += tile_ties;
    }
    if (threadIdx.x == 0)
        ekv_close_shard_list(out, in, written, sg.P, A.out.count, (int)row, A.shard_pos);
}

topk_shard_args topk_args_of(const ekv_cuda_plan *pl, const ekv_page_table *t, int batch,
                             int per_head, ekv_topk_agree *ag, double *red) {
    topk_shard_args A;
    memset(&A, 0, sizeof A);
    ekv_cuda_set_shape(A, pl, t);
    A.shard_pos = pl->shard_pos;
    A.out = ekv_cuda_lists_of(pl, per_head);
    A.lps = A.out.lps;
    A.lists = (int64_t)batch * A.lps;
    A.keys = per_head ? pl->bounds : pl->list_bounds; /* as ekv_cuda_launch_topk ranks */
    A.ag = ag;
    A.red = red;
    return A;
}

} // namespace

int64_t ekv_shard_topk_payload(int batch, int lists_per_seq, int level) {
    const int64_t L = (int64_t)batch * lists_per_seq;
    return L * EKV_TOPK_BINS + (level == 0 ? 2 * (int64_t)batch : 0);
}

ekv_status ekv_shard_launch_topk_level(ekv_cuda_plan *pl, const ekv_page_table *t, int batch,
                                       int per_head, int level, int update,
                                       const ekv_select_params *sel, ekv_topk_agree *ag,
                                       double *red) {
    topk_shard_args A = topk_args_of(pl, t, batch, per_head, ag, red);
    A.level = level;
    if (!update) {
        hist_kernel<<<(unsigned)A.lists, TK_THREADS, 0, pl->stream>>>(A);
        EKV_CUDA_LAUNCHED(pl);
        return EKV_OK;
    }
    A.budget_tokens = sel->budget_tokens;
    A.budget_fraction = sel->budget_fraction;
    update_kernel<<<(unsigned)((A.lists + 127) / 128), 128, 0, pl->stream>>>(A);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

ekv_status ekv_shard_launch_topk_ties(ekv_cuda_plan *pl, const ekv_page_table *t, int batch,
                                      int per_head, int shard, int S, int write, ekv_topk_agree *ag,
                                      double *red) {
    topk_shard_args A = topk_args_of(pl, t, batch, per_head, ag, red);
    A.shard = shard;
    A.S = S;
    if (!write)
        ties_kernel<<<(unsigned)A.lists, TK_THREADS, 0, pl->stream>>>(A);
    else
        write_kernel<<<(unsigned)A.lists, TW_THREADS, 0, pl->stream>>>(A);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}
