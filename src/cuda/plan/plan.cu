/*
 * The CUDA plan (docs/architecture.md, "Backends"): its creation, every device buffer once from
 * one table (plan_buffers) that creation allocates, ekv_cuda_plan_bytes counts and
 * ekv_cuda_plan_free frees, sized from the plan's static shapes (checked first, on the host)
 * and the device's SMs, so that a step never allocates or synchronises; and the splits of the
 * split-KV kernels, the plan's (split_cap) and a step's (ekv_cuda_step_splits).
 */
#include "plan_defaults.h"
#include "../common/launch.cuh"
#include "../common/plan.cuh"
#include "../common/sizes.cuh"
#include "../common/splits.cuh"
#include "../cache/layout.h" /* ekv_cuda_check_head_dim, ekv_cuda_check_device: one rule each */
extern "C" {
#include "../../core/internal.h" /* ekv_check_heads, _page_size, _cuda_options (C) */
}
#include <stdlib.h>
#include <string.h>

extern "C" ekv_cuda_plan_params ekv_cuda_plan_default_params(void) {
    return ekv_cuda_plan_defaults();
}

extern "C" ekv_status ekv_cuda_device_count(ekv_context *ctx, int32_t *count) {
    if (!count)
        return ctx ? ekv_fail(ctx, EKV_ERR_NULL_POINTER, "count must not be NULL")
                   : EKV_ERR_NULL_POINTER;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        n = 0;
    }
    *count = n;
    return EKV_OK;
}

/* Every device buffer of a plan with its size: the one list that plan creation allocates (and
 * zeroes where `zero` says so), ekv_cuda_plan_bytes counts and ekv_cuda_plan_free frees. */
typedef struct {
    void **ptr;
    int64_t bytes;
    int zero = 0; /* zero at creation: a step reads it before writing it (counters, flags,
                     bits, histograms and barriers that the steps leave zero again) */
} plan_buffer;

enum { PLAN_BUFFERS = 58 };

static void plan_buffers(ekv_cuda_plan *pl, plan_buffer *b) {
    const int64_t B = pl->p.max_batch, H = pl->p.num_heads, Hk = pl->p.num_kv_heads,
                  ns = pl->split_cap;
    const int64_t BH = B * H, BHk = B * Hk, P = pl->cap_pages, C = pl->cand_cap;
    const int64_t sel_lists = ekv_sel_lists(pl);
    const plan_buffer t[] = {
            {(void **)&pl->scores, BH * pl->cap_tokens * (int64_t)sizeof(float)},
            {(void **)&pl->split_max, BH * 2 * ns * (int64_t)sizeof(float)},
            {(void **)&pl->bounds, BH * P * (int64_t)sizeof(float)},
            {(void **)&pl->list_bounds, BHk * P * (int64_t)sizeof(float)},
            {(void **)&pl->list_pages, BHk * P * (int64_t)sizeof(int32_t)},
            {(void **)&pl->list_count, BHk * 2 * (int64_t)sizeof(int32_t), 1},
            {(void **)&pl->in_list, BHk * P},
            {(void **)&pl->tau, BH * (int64_t)sizeof(double)},
            {(void **)&pl->round0_tau, BH * (int64_t)sizeof(double)},
            {(void **)&pl->tau_m, BH * (int64_t)sizeof(float)},
            {(void **)&pl->tau_t, BH * (int64_t)sizeof(double)},
            {(void **)&pl->support, BH * (int64_t)sizeof(int64_t)},
            {(void **)&pl->v_rows, BHk * (int64_t)sizeof(int64_t)},
            {(void **)&pl->flags, BH * (int64_t)sizeof(int32_t), 1},
            {(void **)&pl->gmu, BH * P * (int64_t)sizeof(double)},
            {(void **)&pl->gsig, BH * P * (int64_t)sizeof(double)},
            {(void **)&pl->cand_z, BH * C * (int64_t)sizeof(float)},
            {(void **)&pl->cand_slot, BH * C * (int64_t)sizeof(int64_t)},
            {(void **)&pl->cand_count, BH * (int64_t)sizeof(int32_t)},
            {(void **)&pl->cand_hist, BH * EKV_CUDA_TAU_HIST_BINS * (int64_t)sizeof(uint32_t), 1},
            {(void **)&pl->cand_done, BH * (int64_t)sizeof(uint32_t), 1},
            {(void **)&pl->refine_count, BH * (int64_t)sizeof(int32_t), 1},
            {(void **)&pl->cand_start, BH * 2 * (int64_t)sizeof(float)},
            {(void **)&pl->sup_p, BH * C * (int64_t)sizeof(float)},
            {(void **)&pl->sup_off, BH * C * (int64_t)sizeof(int64_t)},
            {(void **)&pl->sup_count, BH * (int64_t)sizeof(int64_t)},
            {(void **)&pl->survivors, BHk * (int64_t)sizeof(int64_t)},
            {(void **)&pl->scr_state, EKV_SCR_STATE_ROWS * BH * (int64_t)sizeof(uint32_t)},
            {(void **)&pl->scr_f, BH * EKV_SCREEN_GRID * (int64_t)sizeof(double)},
            {(void **)&pl->scl, BH * pl->scap * (int64_t)sizeof(float)},
            {(void **)&pl->scu, BH * pl->scap * (int64_t)sizeof(float)},
            {(void **)&pl->sct, BH * pl->scap * (int64_t)sizeof(int32_t)},
            {(void **)&pl->sbits, BHk * pl->cap_words * (int64_t)sizeof(uint32_t), 1},
            {(void **)&pl->scr_thr, BH * (int64_t)sizeof(float)},
            {(void **)&pl->scr_short, BH * pl->short_cap * (int64_t)sizeof(float)},
            {(void **)&pl->scr_tl, BH * (int64_t)sizeof(double)},
            {(void **)&pl->row_chunk_count, BHk * pl->row_chunks * (int64_t)sizeof(int32_t)},
            {(void **)&pl->rows, BHk * pl->cap_tokens * (int64_t)sizeof(int32_t)},
            {(void **)&pl->row_count, BHk * (int64_t)sizeof(int32_t), 1},
            {(void **)&pl->gstat, BH * 3 * (int64_t)sizeof(double)},
            {(void **)&pl->flash_part, BH * ns * (pl->p.head_dim + 4) * (int64_t)sizeof(float)},
            {(void **)&pl->hlist_pages, BH * P * (int64_t)sizeof(int32_t)},
            {(void **)&pl->hlist_count, BH * 2 * (int64_t)sizeof(int32_t)},
            {(void **)&pl->hlist_in, BH * P},
            {(void **)&pl->list_heads, BHk * P * (int64_t)sizeof(uint16_t)},
            {(void **)&pl->sp_count, 2 * (int64_t)sizeof(unsigned long long)},
            {(void **)&pl->ubits, BHk * pl->cap_words * (int64_t)sizeof(uint32_t), 1},
            {(void **)&pl->ulist, BHk * pl->cap_tokens * (int64_t)sizeof(int32_t)},
            {(void **)&pl->ucount, BHk * (int64_t)sizeof(int32_t)},
            {(void **)&pl->fused_part, 2 * EKV_CUDA_FUSED_GROUPS * EKV_CUDA_FUSED_GROUP *
                                               EKV_CUDA_FUSED_PER_SM * (int64_t)pl->sms * 4 *
                                               (int64_t)sizeof(double)},
            {(void **)&pl->fused_bar, 2 * EKV_CUDA_FUSED_GROUPS * (int64_t)sizeof(unsigned), 1},
            {(void **)&pl->fused_near, EKV_CUDA_FUSED_GROUPS * EKV_CUDA_FUSED_GROUP *
                                               EKV_CUDA_FUSED_NEAR_CAP * (int64_t)sizeof(float)},
            {(void **)&pl->fused_near_count,
             EKV_CUDA_FUSED_GROUPS * EKV_CUDA_FUSED_GROUP * (int64_t)sizeof(uint32_t)},
            {(void **)&pl->sel_bar, sel_lists * 2 * (int64_t)sizeof(unsigned), 1},
            {(void **)&pl->sel_hist,
             sel_lists * EKV_CUDA_SEL_HISTS * 256 * (int64_t)sizeof(int32_t), 1},
            {(void **)&pl->sel_last, pl->sel_blocks * 256 * (int64_t)sizeof(int32_t)},
            {(void **)&pl->sel_count, pl->sel_blocks * (int64_t)sizeof(int32_t)},
            {(void **)&pl->sel_guess, BH, 1}, /* any guess is exact (select.cu): zero for
                                                 memcheck's initcheck */
    };
    static_assert(sizeof t / sizeof t[0] == PLAN_BUFFERS, "PLAN_BUFFERS counts the table");
    memcpy(b, t, sizeof t);
}

extern "C" void ekv_cuda_plan_free(ekv_cuda_plan *pl) {
    if (!pl) return;
    plan_buffer bufs[PLAN_BUFFERS];
    plan_buffers(pl, bufs);
    for (int i = 0; i < PLAN_BUFFERS; i++)
        if (*bufs[i].ptr) cudaFree(*bufs[i].ptr);
    if (pl->own_stream && pl->stream) cudaStreamDestroy(pl->stream);
    free(pl);
}

extern "C" int64_t ekv_cuda_plan_bytes(const ekv_cuda_plan *pl) { return pl ? pl->bytes : 0; }

/* The plan's static shapes, checked on the host before anything is allocated. */
static ekv_status check_plan_params(ekv_context *ctx, const ekv_cuda_plan_params *p) {
    if (p->max_batch < 1)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "max_batch=%d must be >= 1", p->max_batch);
    ekv_status st = ekv_check_heads(ctx, p->num_heads, p->num_kv_heads);
    if (!st) st = ekv_check_page_size(ctx, p->page_size);
    if (st) return st;
    if (p->num_heads / p->num_kv_heads > EKV_CUDA_MAX_GROUP)
        return ekv_fail(ctx, EKV_ERR_UNSUPPORTED,
                        "GQA group %d > %d is not supported by the CUDA backend",
                        p->num_heads / p->num_kv_heads, (int)EKV_CUDA_MAX_GROUP);
    st = ekv_cuda_check_head_dim(ctx, p->head_dim);
    if (st) return st;
    if (p->max_pages_per_seq < 1 || p->max_pages_per_seq * p->page_size >= INT32_MAX)
        return ekv_fail(
                ctx, EKV_ERR_INVALID_SIZE,
                "max_pages_per_seq=%lld must be >= 1 with max_pages_per_seq * page_size < 2^31 tokens",
                (long long)p->max_pages_per_seq);
    if (p->max_candidates < 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "max_candidates=%lld must be >= 0 (0 = the default)",
                        (long long)p->max_candidates);
    if (p->screen_list_bytes < 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "screen_list_bytes=%lld must be >= 0 (0 = the default)",
                        (long long)p->screen_list_bytes);
    if (p->select_part_pages < 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "select_part_pages=%lld must be >= 0 (0 = the default)",
                        (long long)p->select_part_pages);
    if (p->tau_spread_min < 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "tau_spread_min=%lld must be >= 0 (0 = the default)",
                        (long long)p->tau_spread_min);
    if (p->tensor_cores != 0 && p->tensor_cores != 1)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "tensor_cores=%d must be 0 or 1",
                        p->tensor_cores);
    return ekv_check_cuda_options(ctx, p->fused_attend, p->overlap_launches, p->tau_cluster);
}

/* The scores kernel's splits per row for `batch` sequences of Hk KV heads. The kernel (2
 * blocks per SM) streams K best in one wave of long-lived blocks: ramping a block's pipeline
 * up and down costs more than the tail of a single wave (the softmax values and the screen
 * size their one wave at launch, ekv_cuda_one_wave). Never more splits than pages. */
static int64_t score_splits(int sms, int64_t batch, int64_t Hk, int64_t pages) {
    int64_t ns = 2 * (int64_t)sms / (batch * Hk);
    if (ns > pages) ns = pages;
    return ns < 1 ? 1 : ns;
}

/* The values kernels' splits per row over `rows` rows: 2 blocks per SM at most (their resident
 * blocks), at most cap. Rounded down: rounded up, 32 rows of 9 splits made 288 blocks for 264
 * slots, a second wave of 24 blocks as long as the first. */
static int32_t value_splits(int sms, int64_t rows, int64_t cap) {
    const int64_t vs = 2 * (int64_t)sms / rows;
    return (int32_t)(vs < 1 ? 1 : vs > cap ? cap : vs);
}

/* Computed at every launch from the step's batch (a graph captures the batch with its
 * arguments, so replays stay consistent); the score splits are capped by split_cap, the
 * pitch of the per-row split buffers sized at the plan's max_batch. */
ekv_step_splits ekv_cuda_step_splits(const ekv_cuda_plan *pl, int batch) {
    const int64_t H = pl->p.num_heads, Hk = pl->p.num_kv_heads;
    int64_t ns = score_splits(pl->sms, batch, Hk, pl->cap_pages);
    if (ns > pl->split_cap) ns = pl->split_cap;
    ekv_step_splits s;
    s.scores = (int32_t)ns;
    s.values = value_splits(pl->sms, batch * H, 64);
    /* the union kernel's, up to 256 a KV head: a flat KV head's union of thousands of rows
     * spreads over the device (the model's layer 0 at 256K: 15.8 -> 9.9 us with the kernel's
     * staged loads, bench/RESULTS.md "tenth session"); a block past its list's end returns */
    s.unions = value_splits(pl->sms, batch * Hk, 256);
    return s;
}

/* The default of ekv_cuda_plan_params.screen_list_bytes: every token of one sequence of 2^20
 * tokens and 32 query heads, at SCREEN_ENTRY_BYTES each. */
enum { SCREEN_ENTRY_BYTES = 12 }; /* a list entry: l, u (fp32) and the token (int32) */
static const int64_t SCREEN_LIST_BYTES = (int64_t)SCREEN_ENTRY_BYTES * 32 << 20;

/* The tau candidates (and support entries) listed per query head: max_candidates when given;
 * else a quarter of the tokens (the lists then take 1.5x the score rows' bytes), never below
 * EKV_CUDA_CAND_CAP nor above every token: a flat head's support (real attention: tens of
 * thousands of tokens at 256K on the model's layer 0) is then solved from its list, not over
 * the whole row on one block (bench/RESULTS.md: the 256K trace's layer 0 took 0.99 ms a step
 * with 16384 entries, 0.39 with an eighth of the tokens, 0.16 with a quarter). */
enum { CAND_TOKENS_PER_ENTRY = 4 };
static int64_t cand_list_cap(const ekv_cuda_plan_params *p, int64_t cap_tokens) {
    int64_t cap = p->max_candidates;
    if (cap <= 0) {
        cap = cap_tokens / CAND_TOKENS_PER_ENTRY;
        if (cap < EKV_CUDA_CAND_CAP) cap = EKV_CUDA_CAND_CAP;
    }
    return cap < cap_tokens ? cap : cap_tokens;
}

/* The screen's candidates kept per query head (u > max l - 1, docs/math.md §10.3 Claim 3):
 * max_candidates when given; else as many as screen_list_bytes holds over the plan's heads,
 * between max(a quarter of the tokens, the default list) and every token. A list of every token
 * cannot overflow, so such a plan never launches the retry (screen.cu); with a shorter one a
 * head with more candidates is retried against a higher threshold (docs/architecture.md, CUDA
 * screened). */
static int64_t screen_list_cap(const ekv_cuda_plan_params *p, int64_t cap_tokens,
                               int64_t cand_cap) {
    if (p->max_candidates > 0) return cand_cap;
    const int64_t budget = p->screen_list_bytes > 0 ? p->screen_list_bytes : SCREEN_LIST_BYTES;
    const int64_t fit = budget / (SCREEN_ENTRY_BYTES * (int64_t)p->max_batch * p->num_heads);
    const int64_t least = cap_tokens / 4 > cand_cap ? cap_tokens / 4 : cand_cap;
    return fit < least ? least : fit > cap_tokens ? cap_tokens : fit;
}

/* Buffer capacities from the plan's shapes and the device's SM count. */
static void plan_geometry(ekv_cuda_plan *pl, int sms) {
    const ekv_cuda_plan_params *p = &pl->p;
    const int64_t B = p->max_batch, Hk = p->num_kv_heads;
    const int64_t ns = score_splits(sms, B, Hk, p->max_pages_per_seq);
    /* ragged batches (ekv_seq_splits): a row takes at most the splits that fill the GPU with
     * its KV heads alone, and never more than T = ns B or the pages */
    int64_t cap = 2 * (int64_t)sms / Hk;
    if (cap < ns) cap = ns;
    if (cap > ns * B) cap = ns * B;
    if (cap > p->max_pages_per_seq) cap = p->max_pages_per_seq;
    pl->split_cap = (int32_t)cap;
    pl->sms = sms;
    pl->cap_pages = p->max_pages_per_seq;
    pl->cap_tokens = pl->cap_pages * p->page_size;
    pl->cand_cap = cand_list_cap(p, pl->cap_tokens);
    pl->scap = screen_list_cap(p, pl->cap_tokens, pl->cand_cap);
    pl->short_cap = pl->scap < EKV_SCREEN_SOLVE_MAX ? pl->scap : (int64_t)EKV_SCREEN_SOLVE_MAX;
    pl->cap_words = (pl->cap_tokens + 31) / 32;
    pl->row_chunks = (pl->cap_words + EKV_CUDA_ROW_CHUNK_WORDS - 1) / EKV_CUDA_ROW_CHUNK_WORDS;
    pl->sel_blocks = EKV_CUDA_SEL_BLOCKS_PER_SM * sms;
}

namespace {
/* A kernel of this build, asked which PTX its loaded code came from (sm90_kernels). */
__global__ void overlap_probe_kernel(int) { ekv_grid_begin(); }
} // namespace

/* Whether device p->device runs this build's kernels as compute capability 9.0 code (what
 * ekv_grid_begin's wait and thread block clusters need): a build whose kernels the driver
 * compiles from older PTX (e.g. compute_80 on a newer GPU) has neither. *major and *ptx: what
 * was found, for the messages. */
static ekv_status sm90_kernels(ekv_context *ctx, const ekv_cuda_plan_params *p, bool *ok,
                               int *major, int *ptx) {
    cudaFuncAttributes fa;
    *major = 0;
    if (cudaSetDevice(p->device) != cudaSuccess ||
        cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, p->device) !=
                cudaSuccess ||
        cudaFuncGetAttributes(&fa, overlap_probe_kernel) != cudaSuccess) {
        const cudaError_t e = cudaGetLastError();
        return ekv_fail(ctx, EKV_ERR_DEVICE, "device %d: %s", p->device, cudaGetErrorString(e));
    }
    *ptx = fa.ptxVersion;
    *ok = *major >= 9 && fa.ptxVersion >= 90;
    return EKV_OK;
}

/* overlap_launches = 1 needs compute capability 9.0 code (sm90_kernels): refused elsewhere, not
 * launched without the wait; -1 (the default: measured faster, bench/RESULTS.md) is 1 where it
 * is supported and 0 elsewhere. tau_cluster > 0 needs the same (clusters); its -1 (the default,
 * likewise) is 8 where supported, else 0. *on, *cluster: the settings the plan runs with. */
static ekv_status resolve_sm90_options(ekv_context *ctx, const ekv_cuda_plan_params *p, int32_t *on,
                                       int32_t *cluster) {
    *on = 0;
    *cluster = 0;
    if (!p->overlap_launches && !p->tau_cluster) return EKV_OK;
    bool ok = false;
    int major = 0, ptx = 0;
    const ekv_status st = sm90_kernels(ctx, p, &ok, &major, &ptx);
    if (st) return st;
    const char *what = p->overlap_launches == 1 ? "overlap_launches=1"
                       : p->tau_cluster > 0     ? "tau_cluster > 0"
                                                : NULL;
    if (!ok && what)
        return ekv_fail(ctx, EKV_ERR_UNSUPPORTED,
                        "%s needs a GPU of compute capability 9.0 or later running kernels built "
                        "for it (device %d: %d.x; this build's kernels: PTX compute_%d; build "
                        "with CMAKE_CUDA_ARCHITECTURES 90 or later)",
                        what, p->device, major, ptx);
    *on = ok && p->overlap_launches != 0;
    *cluster = !ok ? 0 : p->tau_cluster < 0 ? 8 : p->tau_cluster;
    return EKV_OK;
}

extern "C" ekv_status ekv_cuda_plan_create(ekv_context *ctx, const ekv_cuda_plan_params *p,
                                           ekv_cuda_plan **out) {
    if (!ctx) return EKV_ERR_NULL_POINTER;
    if (!p || !out) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "params and out must not be NULL");
    *out = NULL;
    ekv_status st = check_plan_params(ctx, p);
    if (st) return st;
    st = ekv_cuda_check_device(ctx, p->device);
    if (st) return st;
    int32_t overlap, cluster;
    st = resolve_sm90_options(ctx, p, &overlap, &cluster);
    if (st) return st;
    ekv_cuda_plan *pl = (ekv_cuda_plan *)calloc(1, sizeof *pl);
    if (!pl) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    pl->ctx = ctx;
    pl->p = *p;
    pl->p.overlap_launches = overlap; /* -1 resolved: what the launches read */
    pl->p.tau_cluster = cluster;
    cudaError_t e = cudaSetDevice(p->device);
    if (e != cudaSuccess) {
        free(pl);
        return ekv_fail(ctx, EKV_ERR_DEVICE, "cudaSetDevice: %s", cudaGetErrorString(e));
    }
    if (p->stream)
        pl->stream = (cudaStream_t)p->stream;
    else {
        /* a blocking stream: ordered after the caller's work on the legacy default stream
         * (cudaMemcpy, cudaMemset, torch's default stream), whose pageable copies may still be
         * in flight when cudaMemcpy returns; a non-blocking one raced them */
        e = cudaStreamCreate(&pl->stream);
        if (e != cudaSuccess) {
            free(pl);
            return ekv_fail(ctx, EKV_ERR_DEVICE, "cudaStreamCreate: %s", cudaGetErrorString(e));
        }
        pl->own_stream = 1;
    }
    int sms = 132, optin = 48 << 10;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p->device);
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, p->device);
    pl->smem_optin = optin;
    cudaDeviceGetAttribute(&pl->cooperative, cudaDevAttrCooperativeLaunch, p->device);
    plan_geometry(pl, sms);
    plan_buffer want[PLAN_BUFFERS];
    plan_buffers(pl, want);
    for (int i = 0; i < PLAN_BUFFERS; i++) {
        e = cudaMalloc(want[i].ptr, (size_t)want[i].bytes);
        if (e != cudaSuccess) {
            ekv_cuda_plan_free(pl);
            return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "cudaMalloc(%lld bytes) for the plan: %s",
                            (long long)want[i].bytes, cudaGetErrorString(e));
        }
        pl->bytes += want[i].bytes;
    }
    /* on the plan's stream, then waited for: a caller's non-blocking stream (torch's side
     * streams) is not ordered after the legacy stream a plain cudaMemset uses, so the first
     * step could read the buffers before they are zero */
    e = cudaSuccess;
    for (int i = 0; i < PLAN_BUFFERS && e == cudaSuccess; i++)
        if (want[i].zero) e = cudaMemsetAsync(*want[i].ptr, 0, (size_t)want[i].bytes, pl->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(pl->stream);
    if (e != cudaSuccess) {
        ekv_cuda_plan_free(pl);
        return ekv_fail(ctx, EKV_ERR_DEVICE, "cudaMemset: %s", cudaGetErrorString(e));
    }
    *out = pl;
    return EKV_OK;
}
