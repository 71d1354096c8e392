/*
 * The CUDA plan (docs/architecture.md, "Backends"): every scratch buffer, sized once at plan
 * time so a step never allocates or synchronises, what a step records for the report and the
 * slow paths a caller may count; the step shape every kernel's arguments start with; the
 * host readouts of the last step.
 */
#pragma once
#include "entmaxkv.h"
#include <cuda_runtime.h>
#include <stdint.h>
#include "launch.cuh"
#include "../../core/geometry.h"

/* The plan's flags of a query head whose tau candidates overflowed the list (stages/tau.cu sets
 * them, ekv_cuda_read_report counts them as slow_rows and compacted_rows). */
enum { EKV_TAU_FLAG_WHOLE_ROW = 1, EKV_TAU_FLAG_COMPACTED = 2, EKV_TAU_FLAG_CLUSTER = 4 };

/* The rows of ekv_cuda_plan.scr_state, each [B*H] (ekv_scr_row gives one). */
enum {
    EKV_SCR_LKEY = 0,    /* max l per query head (ordered keys, 0 = none yet)          */
    EKV_SCR_ZKEY = 1,    /* max z per query head (the row scores kernel's)              */
    EKV_SCR_COUNT = 2,   /* candidates of the screen                                   */
    EKV_SCR_COUNT2 = 3,  /* candidates of its retry pass                               */
    EKV_SCR_MARKS = 4,   /* overflow marks (1 retried, 2 every token kept)             */
    EKV_SCR_SHORT = 5,   /* entries of the short list (scr_short)                      */
    EKV_SCR_DROPPED = 6, /* pages the page box dropped, per (sequence, KV head)        */
    EKV_SCR_STATE_ROWS = 7
};

struct ekv_cuda_plan {
    ekv_context *ctx;
    ekv_cuda_plan_params p;
    cudaStream_t stream;
    int own_stream;
    int32_t split_cap;  /* the most splits a row can get: split_max, flash_part pitch   */
    int32_t sms;        /* the device's SMs (one-wave grids, ekv_cuda_one_wave)     */
    int32_t smem_optin; /* the device's shared memory a block may opt in to (bytes)    */
    int64_t tau_k_rows; /* the tau kernel's rows a launch for which tau_k was found, 0 none */
    int32_t tau_k;      /* its blocks a row (stages/tau.cu, tau_cluster_blocks)          */
    int32_t cooperative; /* the device launches cooperative kernels (the fused attend)   */
    int64_t cap_pages;  /* max_pages_per_seq                                           */
    int64_t cap_tokens; /* cap_pages * page_size: score row length                     */
    /* scratch (device) */
    float *scores;       /* [B*H][cap_tokens] z-space scores of the listed tokens       */
    float *split_max;    /* [B*H][2][split_cap] per split, round 1 then round 2          */
    float *bounds;       /* [B*H][cap_pages] per query head page bounds                 */
    float *list_bounds;  /* [B*Hk][cap_pages] max over the group (ranking key)          */
    int32_t *list_pages; /* [B*Hk][cap_pages] logical pages, round 1 then round 2      */
    int32_t *list_count; /* [B*Hk][2] entries of round 1, round 1 + round 2            */
    uint8_t *in_list;    /* [B*Hk][cap_pages] membership of round 1                     */
    /* per_query_head lists (docs/architecture.md, CUDA per-query-head lists): each query
     * head's own list, then their union per KV head with a head mask per entry, so K is read
     * once for the group and a head's scores outside its own list are -inf */
    int32_t *hlist_pages;  /* [B*H][cap_pages] a query head's list                        */
    int32_t *hlist_count;  /* [B*H][2]                                                    */
    uint8_t *hlist_in;     /* [B*H][cap_pages] its membership                             */
    uint16_t *list_heads;  /* [B*Hk][cap_pages] per union entry: bit g = head g lists it  */
    int last_masked;       /* the last step's heads attended their own lists (list_heads) */
    unsigned long long *sp_count; /* [2] superpage skipping: pages skipped, boxes read      */
    int last_sp_counted;          /* the last step's bound stage skipped against tau_lb     */
    double *tau;         /* [B*H] in z-space (the report, the bounds, tau_lb)           */
    double *round0_tau;  /* [B*H] certified round 0's lower bounds of tau (round 1's hint) */
    /* [B*H] tau again as (m, t) with tau = m + t, m the head's max score: the weights take
     * z - tau as (z - m) - t, exact at any score scale (docs/math.md §6.2); m = 0 where a
     * stage knows only tau (the sharded agreement) */
    float *tau_m;
    double *tau_t;
    int64_t *support;    /* [B*H]                                                       */
    int64_t *v_rows;     /* [B*Hk]                                                      */
    int32_t *flags;      /* [B*H] EKV_TAU_FLAG_*: how an overflowed head's tau was found  */
    unsigned long long *slow_paths; /* NULL or [EKV_SLOW_PATHS] (ekv_cuda_count_slow_paths) */
    int64_t cand_cap;    /* entries of a candidate / support list (per query head)      */
    uint32_t *ubits;     /* [B*Hk][cap_words] the group's support slots (zero between steps) */
    int32_t *ulist;      /* [B*Hk][cap_tokens] the same slots listed once each (union_mark) */
    int32_t *ucount;     /* [B*Hk] their count (zeroed by the step's score kernel)         */
    float *cand_z;       /* [B*H][cand_cap] scores z >= M - 1                           */
    int64_t *cand_slot;  /* [B*H][cand_cap] their score slots                            */
    int32_t *cand_count; /* [B*H] candidates found (may exceed cand_cap: overflow)      */
    /* an overflowed or long list rebuilt by every split (stages/tau.cu, cand_kernel): the
     * candidates' histogram, whose lower bound of tau the refine pass lists above, and the
     * refined count, zero between steps (the tau kernel resets them; a bound round's
     * histograms, tau_bound_kernel); the done counts of the screen's tau(l) count, which
     * shares the histograms (its last block resets both) */
    uint32_t *cand_hist; /* [B*H][EKV_CUDA_TAU_HIST_BINS] counts of y = z - M in [-1, 0]   */
    uint32_t *cand_done; /* [B*H] the screen tau(l) count blocks of the row that finished   */
    int32_t *refine_count; /* [B*H] scores above a refined row's bound (may exceed cap)    */
    float *cand_start;     /* [B*H][2] a row's max M and its histogram bound of tau (or -inf),
                            * from the refine pass for the tau kernel (tau.cu)             */
    float *sup_p;        /* [B*H][cand_cap] support list of the final round: p          */
    int64_t *sup_off;    /* [B*H][cand_cap] and V row offset                            */
    int64_t *sup_count;  /* [B*H] support size (> cand_cap: values scan the row)        */
    double *gmu, *gsig;  /* [B*H][cap_pages] gaussian selector page moments             */
    double *gstat;       /* [B*H][3] gaussian: tau-hat, sigma_g, u_avg per query head     */
    int64_t *survivors;  /* [B*Hk] screened: (token, query head) pairs the screen kept    */
    /* screened decode on token rows (screen/screen.cu) */
    uint32_t *scr_state; /* [EKV_SCR_STATE_ROWS][B*H] per step, zeroed by one memset; its */
                         /* rows are EKV_SCR_* (above), ekv_scr_row gives one             */
    double *scr_f;       /* [B*H][EKV_SCREEN_GRID] F of the kept l at the retry grid      */
    int64_t scap;        /* candidates of the screen kept per query head                 */
    float *scl, *scu;    /* [B*H][scap] their lower and upper bounds                      */
    int32_t *sct;        /* [B*H][scap] and token index                                   */
    int64_t cap_words;   /* cap_tokens / 32, rounded up                                   */
    uint32_t *sbits;     /* [B*Hk][cap_words] survivors of the group (zero between steps) */
    float *scr_thr;      /* [B*H] the l tau(l)'s solve keeps (survivors.cu)               */
    int64_t short_cap;   /* min(scap, EKV_SCREEN_SOLVE_MAX)                               */
    float *scr_short;    /* [B*H][short_cap] those l, listed over splits for the solve    */
    double *scr_tl;      /* [B*H] tau(l) less the solve's tolerance                       */
    int64_t row_chunks;  /* cap_words / EKV_CUDA_ROW_CHUNK_WORDS, rounded up              */
    int32_t *row_chunk_count; /* [B*Hk][row_chunks] survivors per chunk of the bitmap    */
    int32_t *rows;       /* [B*Hk][cap_tokens] surviving rows, ascending                   */
    int32_t *row_count;  /* [B*Hk]                                                         */
    int last_screened;   /* the last step ran the screen (the report reads survivors)    */
    int last_screen_kind; /* its screen kernel (screen/screen.cu: generic, fast, tensor cores)  */
    int last_one_pass;   /* the last step's softmax ran in one pass (no score rows)       */
    int32_t last_score_splits; /* the last score pass's splits per row (ekv_cuda_report)   */
    int skip_values;     /* set by a sharded plan (sharded/sharded.cu): the values launcher */
                         /* does nothing, so a step stops after tau (its shard's own); the */
                         /* values come at the agreed tau                                  */
    int shard_pos;       /* set by a sharded plan for its topk/gaussian stages: where the */
                         /* table stands in its sequence (EKV_SHARD_*, shard_select.h);  */
                         /* 0 (the whole sequence) otherwise                             */
    float *flash_part;   /* [B*H][split_cap][head_dim + 4] one-pass softmax partials       */
    /* the fused dense attend (stages/attend_fused.cu): its blocks' sums of a solver round,
     * [2][EKV_CUDA_FUSED_GROUPS * EKV_CUDA_FUSED_GROUP][4][up to EKV_CUDA_FUSED_PER_SM sms]
     * (a sum's blocks side by side), and the
     * barriers of its groups, [EKV_CUDA_FUSED_GROUPS][2] (zero between steps) */
    double *fused_part;
    unsigned *fused_bar;
    /* and its first round's near lists, [rows][EKV_CUDA_FUSED_NEAR_CAP], and their counts */
    float *fused_near;
    uint32_t *fused_near_count;
    /* the split top-k select (select/select_parts.cuh): a long list ranked by several blocks of
     * one cooperative launch, at most sel_blocks blocks (the resident ones) over at most
     * sel_blocks / 2 lists; per list its barrier [2] and digit histograms
     * [EKV_CUDA_SEL_HISTS][256] (zero between launches but the last digit's, cleared at the
     * next ranking's start), per block its last digit's histogram as suffix sums [256] and its
     * count (pages taken, or keys above the k-th key's first three digits); per list of any
     * select (up to
     * max_batch x num_heads) its first digit at its last ranking, the guess under which the
     * second digit is counted with the first */
    int32_t sel_blocks;
    unsigned *sel_bar;
    int32_t *sel_hist;
    int32_t *sel_last;
    int32_t *sel_count;
    uint8_t *sel_guess;
    int64_t bytes;
    int32_t launches; /* of the last step                                            */
    int32_t last_batch;
};

/* The slower paths of a decode step that a caller may count, one per (step, query head):
 * the tau kernel's list compacted or solved over the whole row (stages/tau.cu), the screen's
 * list overflowed and retried, or kept every token (screen/screen.cu). */
enum {
    EKV_SLOW_TAU_COMPACTED,
    EKV_SLOW_TAU_WHOLE_ROW,
    EKV_SLOW_SCREEN_RETRIED,
    EKV_SLOW_SCREEN_ALL,
    EKV_SLOW_PATHS
};

/* Where the next steps' kernels count their slow paths: events[EKV_SLOW_*] on the device; NULL
 * stops counting. Launches read the pointer, so each captured graph node keeps the one it was
 * captured with (the model points it at each layer's counters). */
static inline void ekv_cuda_count_slow_paths(ekv_cuda_plan *pl, unsigned long long *events) {
    pl->slow_paths = events;
}

/* The step shape every kernel's arguments start with (they derive from it): the page table
 * and the plan's static shapes, set on the host by ekv_cuda_set_shape. */
struct ekv_cuda_shape {
    ekv_page_table t;
    int H, Hk, G, D, ps;           /* query heads, KV heads, group, head dim, page size */
    int64_t cap_pages, cap_tokens; /* the plan's pages (and tokens) per sequence        */
};
template <typename Args>
inline void ekv_cuda_set_shape(Args &a, const ekv_cuda_plan *pl, const ekv_page_table *t) {
    ekv_cuda_shape &s = a;
    if (t) s.t = *t; /* NULL: a kernel that reads no page table keeps it zero */
    s.H = pl->p.num_heads;
    s.Hk = pl->p.num_kv_heads;
    s.G = s.H / s.Hk;
    s.D = pl->p.head_dim;
    s.ps = pl->p.page_size;
    s.cap_pages = pl->cap_pages;
    s.cap_tokens = pl->cap_tokens;
}

/* The most lists a split top-k launch ranks with several blocks each (two blocks a list or
 * more within the plan's sel_blocks): the pitch of its barriers and digit histograms. */
inline int64_t ekv_sel_lists(const ekv_cuda_plan *pl) { return pl->sel_blocks / 2; }

/* Row `row` (EKV_SCR_*) of the plan's screen counters. */
inline uint32_t *ekv_scr_row(const ekv_cuda_plan *pl, int row) {
    return pl->scr_state + (int64_t)row * pl->p.max_batch * pl->p.num_heads;
}

/* The plan's stream and its overlap_launches, where every launch of its steps goes
 * (common/overlap.cuh). */
inline ekv_launch_stream ekv_plan_stream(const ekv_cuda_plan *pl) {
    return ekv_launch_stream{pl->stream, pl->p.overlap_launches};
}

/* kernel<<<grid, threads, smem, the plan's stream>>>(A) in clusters of cluster_x blocks
 * (ekv_launch_clusters; 1: none) and its check (EKV_CUDA_LAUNCHED): the tail of every launcher
 * whose last act is one launch. */
template <typename Args>
inline ekv_status ekv_cuda_launch_clusters(ekv_cuda_plan *pl, void (*kernel)(Args), dim3 grid,
                                           int threads, size_t smem, unsigned cluster_x,
                                           const Args &A) {
    ekv_launch_clusters(ekv_plan_stream(pl), kernel, grid, threads, smem, cluster_x, A);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}
template <typename Args>
inline ekv_status ekv_cuda_launch(ekv_cuda_plan *pl, void (*kernel)(Args), dim3 grid, int threads,
                                  size_t smem, const Args &A) {
    return ekv_cuda_launch_clusters(pl, kernel, grid, threads, smem, 1u, A);
}

/* The query side of the arguments of every kernel that scores keys (bound, scores, screen,
 * one-pass softmax): q, the ALiBi slopes, a = alpha - 1 (1 for softmax) and q' = a scale q's
 * factor, the scale as the CPU takes it (ekv_effective_scale), so that they all form the same
 * q' (docs/math.md §3.1). */
template <typename Args>
inline void ekv_cuda_set_query(Args &A, const ekv_decode_params *prm, int64_t head_dim,
                               const float *q) {
    const double a = prm->alpha == 1.0 ? 1.0 : prm->alpha - 1.0;
    A.q = q;
    A.slopes = prm->alibi_slopes;
    A.qscale = a * ekv_effective_scale(prm->scale, head_dim);
    A.a = a; /* double or float, as the kernel takes it */
}

/* The checks of a host readout of the plan's last step (report, rows, overflow): the plan, the
 * output pointer and the batch. */
static inline ekv_status ekv_cuda_check_readout(const ekv_cuda_plan *pl, const void *outp,
                                                const char *name, int32_t batch) {
    if (!pl) return EKV_ERR_NULL_POINTER;
    if (!outp) return ekv_fail(pl->ctx, EKV_ERR_NULL_POINTER, "%s must not be NULL", name);
    if (batch < 1 || batch > pl->p.max_batch)
        return ekv_fail(pl->ctx, EKV_ERR_INVALID_SIZE, "batch=%d must be in [1, %d]", batch,
                        pl->p.max_batch);
    return EKV_OK;
}

/* A per-query-head readout of the last step ([batch * num_heads] rows of row_bytes from src,
 * device) into out (host), after the plan's stream: the GPU tests' score rows and bounds. */
static inline ekv_status ekv_cuda_read_head_rows(ekv_cuda_plan *pl, int32_t batch, void *out,
                                                 const void *src, int64_t row_bytes) {
    const ekv_status cs = ekv_cuda_check_readout(pl, out, "out", batch);
    if (cs) return cs;
    EKV_CUDA_TRY(pl, cudaStreamSynchronize(pl->stream));
    EKV_CUDA_TRY(pl, cudaMemcpy(out, src, (size_t)(batch * pl->p.num_heads * row_bytes),
                                cudaMemcpyDeviceToHost));
    return EKV_OK;
}
