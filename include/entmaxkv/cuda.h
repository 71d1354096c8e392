/* entmaxkv CUDA API (built with -DEKV_CUDA=ON; otherwise every call returns
 * EKV_ERR_UNSUPPORTED). Included by <entmaxkv.h>. */
#ifndef ENTMAXKV_CUDA_H
#define ENTMAXKV_CUDA_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------- */
/* CUDA backend (built with -DEKV_CUDA=ON; otherwise every call returns EKV_ERR_UNSUPPORTED) */
/* ---------------------------------------------------------------------------------- */
/*
 * The same stages as the CPU backend (append+summarize, bound, select, attend) on device
 * memory. Plan/run split: ekv_cuda_plan_create allocates every scratch buffer from static
 * shapes and capacities; ekv_cuda_decode then reads all lengths and page ids from device
 * memory, never synchronises with the host, allocates nothing, and can be captured in a
 * CUDA graph (replays with changed lengths give the eager results).
 *
 * In every ekv_cuda_* call, the pointers inside ekv_paged_kv, ekv_page_stats and
 * ekv_page_table, and q, out and ekv_decode_params.alibi_slopes are DEVICE pointers.
 * K/V dtypes: f16, bf16, f32. head_dim: any multiple of 8 up to 512 (64, 128 and 256 have
 * specialised kernels). Page lists are per KV head; with select->per_query_head each query
 * head selects its own pages (as on the CPU), K is read once for their union per KV head, and
 * a head attends only its own pages (topk, gaussian) or the union (certified: exact anyway).
 */
typedef struct ekv_cuda_plan ekv_cuda_plan;

typedef struct ekv_cuda_plan_params {
    int32_t device;            /* CUDA device ordinal (default 0)                           */
    void *stream;              /* cudaStream_t for every launch; NULL = the plan's own, a   */
                               /* blocking stream (ordered after legacy-stream work)        */
    int32_t max_batch;         /* sequences per step (default 1)                            */
    int32_t num_heads;         /* query heads (default 32)                                  */
    int32_t num_kv_heads;      /* default 8                                                 */
    int32_t head_dim;          /* default 128                                               */
    int32_t page_size;         /* default 16                                                */
    int64_t max_pages_per_seq; /* the longest sequence the plan serves, in pages (required) */
    int64_t max_candidates;    /* entmax tau candidates (z >= max - 1) listed per query     */
                               /* head; 0: a quarter of the tokens, at least 16384 (24      */
                               /* bytes an entry and head). A head whose support does not fit*/
                               /* takes the slower whole-row path (ekv_cuda_report.slow_rows) */
    int32_t tensor_cores;      /* 1 (default): scores on tensor cores where they apply (f16 */
                               /* or bf16 K, head_dim 64 or 128, page_size a multiple of 16; */
                               /* as exact as the CUDA-core kernels, docs/math.md §3.1), and */
                               /* screened's screen for groups of 5..16 heads (head_dim 64   */
                               /* or 128, page_size a multiple of 16; §10.2; groups up to 4  */
                               /* take the faster CUDA-core screen);                         */
                               /* 0: CUDA cores everywhere                                   */
    int64_t screen_list_bytes; /* screened: device bytes its candidate lists may take, 12 per */
                               /* entry and query head; 0 = 384 MiB: every token of one     */
                               /* sequence of up to 2^20 tokens x 32 heads. A list of every */
                               /* token never overflows, so the screen runs once; a shorter */
                               /* one (never below max(tokens / 4, 16384)) screens a head   */
                               /* with more candidates again (docs/architecture.md). With   */
                               /* max_candidates > 0 the lists hold max_candidates entries  */
    int32_t fused_attend;      /* 1: a dense entmax step of f16/bf16 K/V, head dim 64 or    */
                               /* 128, groups of <= 8 heads and batch x KV heads <= 8 solves */
                               /* tau and sums the values in one cooperative launch over   */
                               /* every SM after the scores (no candidate lists, so no slow */
                               /* rows); 0 (default): the candidates, tau and values        */
                               /* launches (the fused kernel measured slower so far)        */
    int32_t overlap_launches;  /* 1: each kernel of a step may be launched while the one    */
                               /* before it still runs (programmatic dependent launch; every */
                               /* kernel waits for its predecessor before its first memory  */
                               /* access, so the results are a plain step's); needs compute */
                               /* capability 9.0 and kernels built for it, else the plan is  */
                               /* refused (EKV_ERR_UNSUPPORTED); 0: each launch after the   */
                               /* previous one ends; -1 (default): 1 where supported, else 0 */
    int64_t select_part_pages; /* top-k select (topk, certified): pages of a list one block   */
                               /* ranks; a list of 6 such parts or more is split over       */
                               /* several blocks of one cooperative launch (as many as the  */
                               /* GPU holds at once), on a device with cooperative          */
                               /* launches; a shorter one takes one block. 0 = 2048         */
    int32_t tau_cluster;       /* entmax tau of a head listing more candidates than        */
                               /* tau_spread_min or the tau kernel's shared memory holds  */
                               /* (a flat head): 0 = one                                  */
                               /* block solves over the list in global memory (or compacts */
                               /* an overflowed list); 2, 4 or 8: a cluster of that many   */
                               /* blocks (fewer where the step's heads would not fit one   */
                               /* wave) solves over the list (an overflowed one: the score */
                               /* row), each block a share of it; needs                    */
                               /* compute capability 9.0 and kernels built for it, else the */
                               /* plan is refused (EKV_ERR_UNSUPPORTED); -1 (default) = 8   */
                               /* where supported, else 0 (measured faster: bench/RESULTS)  */
    int64_t tau_spread_min;    /* with tau_cluster's clusters: a head listing more tau      */
                               /* candidates than this is solved by its cluster even where  */
                               /* the list fits one block's shared memory (one block's solve */
                               /* of a flat head's list kept the step waiting on one SM);   */
                               /* fewer, one block. 0 = 4096                                */
} ekv_cuda_plan_params;

EKV_API ekv_cuda_plan_params ekv_cuda_plan_default_params(void);
/* Number of CUDA devices (0 when the build has no CUDA or the driver finds none). */
EKV_API ekv_status ekv_cuda_device_count(ekv_context *ctx, int32_t *count);
EKV_API ekv_status ekv_cuda_plan_create(ekv_context *ctx, const ekv_cuda_plan_params *params,
                                        ekv_cuda_plan **out);
EKV_API void ekv_cuda_plan_free(ekv_cuda_plan *plan);
/* Device bytes the plan holds (scratch: scores, bounds, lists). */
EKV_API int64_t ekv_cuda_plan_bytes(const ekv_cuda_plan *plan);

/*
 * One decode step on the device: select->method DENSE, TOPK (box bound, or min(box, ball)
 * with use_ball; budget_tokens as on the CPU), GAUSSIAN (docs/math.md §4, exact tau mode, with
 * auto_margin; with ALiBi the mixture of §4.4), SCREENED (docs/math.md §10: stats->codes, code_bits 4 or 8, as
 * ekv_cuda_append writes them; alpha > 1; the output equals dense entmax) or certified
 * (ekv_cuda_decode_certified below), then exact entmax
 * (alpha > 1) or softmax (alpha = 1) over the listed pages with K read once, tau solved globally
 * from the kept scores and V read for support rows only. q, out: [batch][num_heads][head_dim] fp32
 * (device). Launches are asynchronous on the plan's stream.
 */
EKV_API ekv_status ekv_cuda_decode(ekv_cuda_plan *plan, const ekv_decode_params *params,
                                   const ekv_select_params *select, const ekv_paged_kv *kv,
                                   const ekv_page_stats *stats, const ekv_page_table *table,
                                   const float *q, float *out);
/* Certified decode (docs/math.md §9.3) on the device: round 1 = the top pages by certified bound
 * within select->budget_tokens (or, with select->tau_hint, a DEVICE array [batch*num_heads],
 * every page whose bound exceeds the hint for a head of the list) plus the last, sink and
 * recent pages; round 2 = every other page whose bound exceeds a lower bound of round 1's tau
 * (its histogram bound, at most 2/2048 below it: docs/math.md §9.3, "On the GPU"; the CPU uses
 * the exact tau, so round 2 may read a few pages more here); K and V each read once. Output
 * equals dense entmax. With superpage boxes in stats (smin/smax, as ekv_cuda_append keeps them)
 * a round 0 over the recent pages first gives a lower bound of tau (the same histogram bound)
 * that lets the bound stage skip the summaries of superpages below it (docs/math.md §9.6), as on
 * the CPU, and unless select->tau_hint is given, round 1 is then every page whose bound exceeds
 * it for a head of the list (plus the last, sink and recent pages) and there is no round 2
 * (docs/math.md §9.3, "Round 1 from round 0's bound"; the budget is still checked but sizes
 * nothing then);
 * select->tau_lb, a DEVICE array [batch*num_heads], replaces that round 0 (and serves
 * topk with use_ball the same way). */
EKV_API ekv_status ekv_cuda_decode_certified(ekv_cuda_plan *plan, const ekv_decode_params *params,
                                             const ekv_select_params *select,
                                             const ekv_paged_kv *kv, const ekv_page_stats *stats,
                                             const ekv_page_table *table, const float *q,
                                             float *out);

/* What the last step did, copied to the host (synchronises the plan's stream). Arrays may
 * be NULL; per head: [batch*num_heads], per list: [batch*num_kv_heads]. */
typedef struct ekv_cuda_report {
    double *tau;              /* threshold in z-space (softmax: log-sum-exp)                  */
    int64_t *support;         /* tokens with p > 0                                            */
    int32_t *pages_round1;    /* pages read in round 1 (or the only round)                    */
    int32_t *pages_round2;    /* certified: pages added in round 2                            */
    int64_t *v_rows;          /* V rows read per KV-head list: entmax, the support rows summed
                                 over the group's heads, or their union where the values read
                                 each row once for the group (docs/architecture.md, CUDA values) */
                              /* over the group's heads; softmax, per 4-head chunk            */
    int32_t *list_pages;      /* [batch*num_kv_heads][max_pages_per_seq]: the page lists'     */
                              /* logical pages, round 1 then round 2 (first pages_round1 +    */
                              /* pages_round2 of each row are valid); ascending, but for      */
                              /* certified's round 1 from round 0's bound (unordered)         */
    int64_t lists_round2;     /* output: lists that needed round 2                            */
    int64_t slow_rows;        /* output: query heads whose tau candidates (z >= max - 1)      */
                              /* overflowed the plan's list since the last report, and so did */
                              /* the scores above the kept ones' threshold, so tau was solved */
                              /* over the whole score row (exact, slower)                     */
    int32_t launches;         /* output: kernel launches of the last step                     */
    int64_t survivors;        /* output, screened: (token, query head) pairs the screen kept  */
    int32_t softmax_one_pass; /* output: the last step was softmax in one pass over K and V */
                              /* (tensor cores, docs/math.md §3.9): no score rows           */
    uint16_t *list_heads;     /* [batch*num_kv_heads][max_pages_per_seq], beside list_pages: */
                              /* bit g set when query head g of the group attended the entry */
                              /* (per_query_head topk/gaussian: the heads whose own list has */
                              /* the page; otherwise every head of the group)                */
    int64_t superpage_skipped; /* output: (page, KV head) summaries the bound stage did not */
                               /* read, their superpage's bound standing in (tau_lb or     */
                               /* certified's round 0, docs/math.md §9.6)                  */
    int64_t superpage_boxes;   /* output: (superpage, KV head) boxes it read to decide      */
    int64_t compacted_rows;    /* output: query heads whose candidates overflowed the list  */
                               /* since the last report but whose scores above a lower bound */
                               /* of tau fit it (the kept ones' threshold, else a           */
                               /* histogram's: two or three passes over the score row;      */
                               /* docs/architecture.md, "Backends")                         */
    int32_t score_splits;      /* output: splits per row of the last step's score pass (K  */
                               /* read in split_grid blocks): from the step's batch, so one */
                               /* sequence in a plan for many still fills the GPU           */
} ekv_cuda_report;
EKV_API ekv_status ekv_cuda_read_report(ekv_cuda_plan *plan, int32_t batch,
                                        ekv_cuda_report *report);

/*
 * Append + summarize in one kernel. items[n_items] (device) say, for each touched physical
 * page, where the new tokens go: slots [first_slot, first_slot + n_new) take tokens
 * [src_token, src_token + n_new) of k_new/v_new ([tokens][num_kv_heads][head_dim] fp32,
 * device). The kernel writes K/V in the storage dtype and recomputes that page's statistics
 * (min, max, mean, M2, radius, count) over its first first_slot + n_new tokens, as the CPU
 * cache does, and with stats->codes (code_bits 4 or 8) the page's key codes, byte for byte the
 * CPU cache's (docs/math.md §10.1; stats->code_bits 0 with codes NULL: none). A prefill
 * build is the same call with every page as an item. The stats pointers must be writable
 * device memory. With stats->smin/smax (superpage_pages, num_superpages as ekv_cache_kv_view
 * gives them) a second launch rebuilds the box of each touched page's superpage from its pages
 * with count > 0 (the count of a page never written must be 0).
 * The items live in device memory, so they cannot be checked on the host without a
 * synchronisation: an item whose page or slots are out of range is skipped by the kernel.
 */
typedef struct ekv_cuda_append_item {
    int32_t page;       /* physical page                                     */
    int32_t first_slot; /* tokens already in the page                         */
    int32_t n_new;      /* tokens added, first_slot + n_new <= page_size      */
    int32_t reserved;
    int64_t src_token; /* row of k_new / v_new holding the first new token   */
} ekv_cuda_append_item;
EKV_API ekv_status ekv_cuda_append(ekv_cuda_plan *plan, const ekv_paged_kv *kv,
                                   const ekv_page_stats *stats, const ekv_cuda_append_item *items,
                                   int32_t n_items, const float *k_new, const float *v_new);

/* ---------------------------------------------------------------------------------- */
/* The device cache: K/V pools, page statistics and key codes in device memory         */
/* ---------------------------------------------------------------------------------- */
/*
 * One object holds the layout that ekv_cuda_append writes and every ekv_cuda_decode reads:
 * the K and V pools (ekv_paged_kv, in `layout`) and one statistics block (ekv_page_stats: kmin,
 * kmax, kmean, km2, radius, count; with compact ranges kmin16/kmax16, and with compact_ball
 * kmean16/radius16 too; superpage boxes; key codes), each array 256-byte aligned inside the
 * block (docs/architecture.md, "The device cache"). It keeps no sequences: the caller's page
 * tables say which physical pages a sequence owns (the model engine keeps them on the device,
 * the Python package on the host). ekv_cuda_cache_create allocates the memory (cudaMalloc, on
 * params->device, which becomes the calling thread's current device, as ekv_cuda_plan_create
 * does); ekv_cuda_cache_adopt wraps the caller's (e.g. torch tensors) and never frees it.
 */
typedef struct ekv_cuda_cache ekv_cuda_cache;
typedef struct ekv_cuda_cache_params {
    int32_t device;          /* CUDA device ordinal (default 0)                              */
    int64_t num_pages;       /* physical pages (required)                                    */
    int32_t page_size;       /* tokens per page, 1..256 (default 16)                         */
    int32_t num_kv_heads;    /* default 8                                                    */
    int32_t head_dim;        /* a multiple of 8 up to 512, the CUDA backend's (default 128)  */
    ekv_dtype dtype;         /* storage dtype of K and V (default f16)                       */
    ekv_kv_layout layout;    /* of K and V within a page (default HND)                       */
    ekv_dtype range_dtype;   /* f32 (default): no compact ranges; f16/bf16: kmin16/kmax16    */
                             /* (docs/math.md §1.2; ekv_cache_compact_ranges)                */
    int32_t compact_ball;    /* with compact ranges, 1 (default): kmean16/radius16 too, as the */
                             /* host cache keeps them (docs/math.md §9.5); 0: the fp32 ball   */
    int32_t superpage_pages; /* physical pages per superpage box, 0 = none (default)         */
    int32_t code_bits;       /* key codes for screened decode: 0 (default), 4 or 8           */
} ekv_cuda_cache_params;

EKV_API ekv_cuda_cache_params ekv_cuda_cache_default_params(void);
/* The bytes of one pool (K or V) and of the statistics block for these params, in every build
 * (host arithmetic). Invalid params: their status, with a message when ctx is not NULL. */
EKV_API ekv_status ekv_cuda_cache_sizes(ekv_context *ctx, const ekv_cuda_cache_params *params,
                                        int64_t *pool_bytes, int64_t *stats_bytes);
/* A cache in new device memory: K and V uninitialised, the statistics zeroed (every page
 * counts 0 tokens). Fails with EKV_ERR_OUT_OF_MEMORY, saying how much, when the device has
 * too little free memory. */
EKV_API ekv_status ekv_cuda_cache_create(ekv_context *ctx, const ekv_cuda_cache_params *params,
                                         ekv_cuda_cache **out);
/* A cache over the caller's device memory on params->device: k_pool and v_pool of pool_bytes
 * each, stats of stats_bytes (ekv_cuda_cache_sizes), the three not overlapping; k_pool and
 * v_pool 16-byte aligned, stats 256-byte aligned and zeroed (a page never written must count
 * 0 tokens). Pages the caller wrote itself get their statistics from ekv_cuda_cache_append
 * (items with first_slot = the tokens already there and n_new = 0). The memory must outlive
 * the cache; ekv_cuda_cache_free leaves it alone. */
EKV_API ekv_status ekv_cuda_cache_adopt(ekv_context *ctx, const ekv_cuda_cache_params *params,
                                        void *k_pool, void *v_pool, void *stats,
                                        ekv_cuda_cache **out);
EKV_API void ekv_cuda_cache_free(ekv_cuda_cache *cache);
/* The views ekv_cuda_decode and ekv_cuda_append take (device pointers; valid until the cache is
 * freed). kv or stats may be NULL. */
EKV_API ekv_status ekv_cuda_cache_view(const ekv_cuda_cache *cache, ekv_paged_kv *kv,
                                       ekv_page_stats *stats);
/* ekv_cuda_append over the cache's views, on the plan's stream (the plan's device and shapes:
 * KV heads, head dim and page size as the cache's). */
EKV_API ekv_status ekv_cuda_cache_append(ekv_cuda_plan *plan, ekv_cuda_cache *cache,
                                         const ekv_cuda_append_item *items, int32_t n_items,
                                         const float *k_new, const float *v_new);
/*
 * A sequence keeps its first n_tokens tokens, as ekv_cache_truncate: pages[0..n_pages) (host)
 * are its physical pages in order and `length` its tokens ((n_pages - 1) * page_size <
 * length <= n_pages * page_size), 0 <= n_tokens <= length. The pages past the first
 * ceil(n_tokens / page_size) count 0 tokens again (statistics emptied, superpage boxes rebuilt
 * without them; the caller takes them back into its free list), and a last page kept in part
 * gets its statistics and key codes rebuilt from the n_tokens % page_size keys it keeps, so the
 * cache holds what appending those n_tokens tokens would have built. K and V rows are not
 * moved. One launch of the append kernel on the plan's stream (its items copied from the host
 * first: not capturable in a CUDA graph); nothing changes when a check fails.
 */
EKV_API ekv_status ekv_cuda_cache_truncate(ekv_cuda_plan *plan, ekv_cuda_cache *cache,
                                           const int32_t *pages, int64_t n_pages, int64_t length,
                                           int64_t n_tokens);

/* ---------------------------------------------------------------------------------- */
/* Exact entmax attention of many query rows on the device, forward and backward        */
/* (docs/math.md §12, §13; the CPU reference: ekv_entmax_attention_forward/backward)     */
/* ---------------------------------------------------------------------------------- */
/*
 * Flash attention's interface for exact alpha-entmax (softmax at alpha 1): B sequences of T
 * query rows over N keys each, every tensor a DEVICE pointer, contiguous:
 *   q, out, dout, dq [B][T][H][D]; k, v, dk, dv [B][N][Hk][D]; tau [B][T][H] (double).
 * Row t sits at position N - T + t (causal: it sees the keys j <= N - T + t), ALiBi adds
 * -m_h |j - i|, head h reads KV head h / (H / Hk): the conventions of the reference, whose
 * parameter struct `shape` is (its alibi_slopes a DEVICE array [H] here, or NULL; their
 * values are not read on the host, so not checked). tau is each row's threshold in z-space
 * (softmax: log-sum-exp), as the reference's: the forward writes it, the backward reads it.
 * Runs on the fused prefill kernel (docs/math.md §12): head_dim 64 or 128, K and V f16 or
 * bf16 (others: EKV_ERR_UNSUPPORTED). Scratch is the caller's `workspace` (device memory of
 * at least the bytes ekv_cuda_flash_entmax_workspace gives, 256-byte aligned; it may be
 * reused once the stream has passed the call): a call allocates nothing and never
 * synchronises, and every launch goes on `stream` (a cudaStream_t; NULL: the legacy stream).
 * The calls check every host-side field and leave the outputs untouched on an error. Non-finite
 * inputs are not detected (that would need a synchronisation): their rows come out NaN.
 */
typedef struct ekv_flash_entmax_args {
    ekv_attention_params shape; /* T, N, H, Hk, D, causal, alpha, scale, alibi_slopes (device) */
    int32_t batch;              /* B >= 1 sequences of the same T and N                        */
    ekv_dtype q_dtype;          /* q: f32, f16 or bf16 (dq the same)                           */
    ekv_dtype kv_dtype;         /* k, v: f16 or bf16 (dk, dv the same)                         */
    ekv_dtype out_dtype;        /* out (dout the same): f32 or q_dtype                         */
    int64_t block_tokens;       /* query tokens of one pass (0: automatic, about 32768 rows of */
                                /* H tokens; tau_scheme 1: x 4096 / row_cap, at most x 4): it  */
                                /* bounds the forward's workspace                              */
    const void *q, *k, *v;      /* inputs                                                      */
    void *out;                  /* forward: written                                            */
    double *tau;                /* forward: written; backward: read                            */
    /* How the forward finds each row's tau (docs/math.md §12, §12.1), the same result either
     * way: 0 (default) candidate lists of z > running max - 1; 1 a histogram pass and an
     * exact-size list per row. row_cap (scheme 1): the most list entries a row may take before
     * it is solved by Newton passes instead (0: 1024; at most 4096); tests force that route. */
    int32_t tau_scheme;
    int32_t row_cap;
    /* o-hat = sum w v / sum w of every row, [B][T][H][D] fp32, w = p^(2 - alpha) on the support
     * (softmax: o-hat = out): the w-weighted mean of the support's V rows, so that the backward's
     * delta = dout . o-hat needs no sweep of its own (docs/math.md §13.3). Forward: written when
     * not NULL (the rows solved by Newton passes take one more sweep for it); backward: read,
     * and required (as flash attention's backward takes out). 16-byte aligned. */
    float *ohat;
} ekv_flash_entmax_args;

/* Workspace bytes of the forward and of the backward for these args (host arithmetic; either
 * pointer may be NULL). Fails as the calls would on the args' shapes and dtypes. */
EKV_API ekv_status ekv_cuda_flash_entmax_workspace(ekv_context *ctx,
                                                   const ekv_flash_entmax_args *args,
                                                   int64_t *forward_bytes,
                                                   int64_t *backward_bytes);
/* out and tau of every row (exact; out divided by the computed sum of p, docs/math.md §0). */
EKV_API ekv_status ekv_cuda_flash_entmax_forward(ekv_context *ctx,
                                                 const ekv_flash_entmax_args *args,
                                                 void *workspace, int64_t workspace_bytes,
                                                 void *stream);
/* dq, dk, dv (overwritten) of a loss given dout = dL/dout, from the forward's tau
 * (args->tau; args->out is not read): p recomputed from tau, w = p^(2 - alpha) on the support,
 * ds_j = w_j (dout.v_j - delta), delta = sum w dout.v / sum w, then as the CPU reference
 * (docs/math.md §13.2-13.3) on tensor cores: a row-major pass for delta and dq, a key-major
 * pass for dk and dv over the rows that see each key (no atomics: the same bits on every
 * call). P and ds enter the mma as
 * two 16-bit parts of K's dtype, q and dout as they are or in three parts (§13.3, "On tensor
 * cores": within 1.5e-5 of the sums' scale); with f16 K and V, q, dout and ds must stay
 * within f16's range (|x| < 65504; the parts of smaller ones keep 2^-25 absolutely). */
EKV_API ekv_status ekv_cuda_flash_entmax_backward(ekv_context *ctx,
                                                  const ekv_flash_entmax_args *args,
                                                  const void *dout, void *dq, void *dk, void *dv,
                                                  void *workspace, int64_t workspace_bytes,
                                                  void *stream);

/* ---------------------------------------------------------------------------------- */
/* Context-parallel decode: one step over S shards (docs/math.md §11, docs/architecture.md,
 * "The sharded CUDA plan")                                                            */
/* ---------------------------------------------------------------------------------- */
/*
 * Each sequence's pages are split into contiguous ranges, shard j holding pages
 * [j P / S, (j + 1) P / S) (ekv_shard_pages) in its own paged K/V pool on its device: an
 * ordinary CUDA cache with its own page table, and an ordinary plan (its shapes, with
 * max_pages_per_seq the shard's capacity). One process drives every shard. A step runs each
 * shard's method on its pages, then agrees on tau: an allreduce-max of the shards' own
 * thresholds and maxima, rounds of allreduce-sums of 6 moments per head, the values at the
 * agreed tau on each shard and an allreduce-sum of the partial outputs. The output equals the
 * one-GPU plan's over the whole sequence (fp32 rounding; the same support). Every shard must
 * hold at least one page of every sequence (P >= S; as on one GPU an empty sequence is not
 * checked on the device). New tokens go to the last shard, which owns the newest page.
 * Methods: dense, certified, screened, topk and gaussian (entmax, alpha > 1; gaussian in its
 * exact tau mode, as on one GPU) and softmax over dense. topk and gaussian agree on their page
 * lists across the shards first: the lists the shards take together are the one-GPU plan's
 * (shard j's part, in its own page numbers, through ekv_cuda_read_report of
 * ekv_cuda_sharded_shard(plan, j); a shard's list may be empty). Refused
 * (EKV_ERR_UNSUPPORTED): ALiBi (positions are the shard's own) and select->tau_lb / tau_hint
 * (bounds of the whole sequence's tau; the shards agree on it from their own thresholds).
 */
typedef struct ekv_cuda_sharded_plan ekv_cuda_sharded_plan;
typedef enum ekv_cuda_transport {
    EKV_TRANSPORT_LOCAL = 0, /* every shard on plan.device, one stream: device-side reductions */
    EKV_TRANSPORT_NCCL = 1   /* shard j on devices[j], NCCL allreduces (-DEKV_NCCL=ON builds)  */
} ekv_cuda_transport;
typedef struct ekv_cuda_sharded_params {
    ekv_cuda_plan_params plan; /* every shard's plan; device and stream: the local transport's */
    int32_t num_shards;        /* 1 .. 64 (default 2)                                          */
    int32_t transport;         /* ekv_cuda_transport (default local)                           */
    const int32_t *devices;    /* nccl: host array of num_shards ordinals (NULL: 0 .. S - 1)   */
    int32_t tau_rounds;        /* 0 (default): rounds until every head agreed, the host reading */
                               /* one word per round (not capturable); R > 0: exactly R rounds, */
                               /* no host read (capturable); heads not agreed by then take the  */
                               /* bracket's lower bound and are counted (unconverged)           */
} ekv_cuda_sharded_params;
EKV_API ekv_cuda_sharded_params ekv_cuda_sharded_default_params(void);
EKV_API ekv_status ekv_cuda_sharded_create(ekv_context *ctx, const ekv_cuda_sharded_params *params,
                                           ekv_cuda_sharded_plan **out);
EKV_API void ekv_cuda_sharded_free(ekv_cuda_sharded_plan *plan);
/* Shard j's own plan (its device's ekv_cuda_append, ekv_cuda_read_report), or NULL. */
EKV_API ekv_cuda_plan *ekv_cuda_sharded_shard(ekv_cuda_sharded_plan *plan, int32_t shard);
/* Shard j's device ordinal, or -1. */
EKV_API int32_t ekv_cuda_sharded_device(const ekv_cuda_sharded_plan *plan, int32_t shard);
/*
 * One step. kv, stats, tables: [num_shards], shard j's pool, statistics and page table (device
 * pointers on its device; the same batch in every table). q[j], out[j]: shard j's copy of the
 * queries and of the output ([batch][num_heads][head_dim] fp32 on its device); every shard gets
 * the whole output. select as for ekv_cuda_decode (NULL: dense).
 */
EKV_API ekv_status ekv_cuda_sharded_decode(ekv_cuda_sharded_plan *plan,
                                           const ekv_decode_params *params,
                                           const ekv_select_params *select, const ekv_paged_kv *kv,
                                           const ekv_page_stats *stats,
                                           const ekv_page_table *tables, const float *const *q,
                                           float *const *out);
/* Appends through the last shard (the owner of the newest page): ekv_cuda_append on its plan
 * with its pool (kv[num_shards - 1], stats[...]); items are its physical pages. */
EKV_API ekv_status ekv_cuda_sharded_append(ekv_cuda_sharded_plan *plan, const ekv_paged_kv *kv,
                                           const ekv_page_stats *stats,
                                           const ekv_cuda_append_item *items, int32_t n_items,
                                           const float *k_new, const float *v_new);
/* What the last step did (synchronises every shard): per head the agreed tau and the whole
 * support, as ekv_cuda_report's (report may be NULL; its other fields are shard 0's). */
typedef struct ekv_cuda_sharded_report {
    int32_t rounds;       /* output: agreement rounds of moments (all heads together)      */
    int32_t allreduces;   /* output: collective calls of the step (select, max, rounds, merge) */
    int64_t bytes;        /* output: payload bytes one shard sent                          */
    int64_t unconverged;  /* output: heads whose agreement had not converged (tau_rounds)  */
} ekv_cuda_sharded_report;
EKV_API ekv_status ekv_cuda_sharded_read_report(ekv_cuda_sharded_plan *plan, int32_t batch,
                                                ekv_cuda_report *report,
                                                ekv_cuda_sharded_report *sharded);
#ifdef __cplusplus
}
#endif
#endif /* ENTMAXKV_CUDA_H */
