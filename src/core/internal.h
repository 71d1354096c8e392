/* Internal declarations shared by the library's stages. Not installed. */
#ifndef EKV_INTERNAL_H
#define EKV_INTERNAL_H

#include "entmaxkv.h"
#include "geometry.h"
#include "stats_rules.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __GNUC__
#define EKV_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define EKV_PRINTF(a, b)
#endif

/* ---- thread pool (src/core/threadpool.c) ---- */
typedef struct ekv_pool ekv_pool;
/* fn(arg, task, worker) is called once for every task in [0, n_tasks); worker is in
 * [0, n_workers) and identifies a per-thread scratch slot. Blocks until all are done. */
typedef void (*ekv_task_fn)(void *arg, int64_t task, int worker);
ekv_pool *ekv_pool_create(int n_threads);
void ekv_pool_free(ekv_pool *pool);
void ekv_pool_run(ekv_pool *pool, int64_t n_tasks, ekv_task_fn fn, void *arg);
int ekv_pool_threads(const ekv_pool *pool);

/* ---- context (src/core/context.c) ---- */
struct ekv_context {
    ekv_isa isa;
    int32_t n_threads;
    ekv_pool *pool;
    /* Two scratch arenas, grown on demand and reused across calls (docs/architecture.md,
     * "Scratch memory"): the workspace belongs to the stage running now, so any nested
     * library call invalidates it; the step arena belongs to the public entry point of the
     * step (ekv_decode, ekv_decode_certified, ekv_dense_probs) and holds what must survive
     * from one stage to the next (page lists, bounds). Stages never touch the step arena. */
    void *workspace;
    size_t workspace_bytes;
    void *step_buf;
    size_t step_bytes;
    char last_error[512];
    /* A context is single-threaded (its pool runs one job, its arenas hold one call's
     * scratch). ekv_ctx_enter/leave detect a second thread: owner is the entering thread's
     * token (0 = free), depth counts nested library calls of that thread. */
    uintptr_t owner; /* accessed with __atomic builtins only */
    int32_t depth;
};

/* Records a formatted message in ctx (if not NULL) and returns status. */
ekv_status ekv_fail(ekv_context *ctx, ekv_status status, const char *fmt, ...) EKV_PRINTF(3, 4);
void ekv_clear_error(ekv_context *ctx);
/* Brackets every public call that uses the context's thread pool or arenas. enter returns
 * EKV_ERR_INVALID_ARGUMENT (with a message) when another thread is inside a call on ctx; the
 * caller then returns that status without calling leave. Nested calls from the owning thread
 * are fine. ctx may be NULL (nothing is checked). */
ekv_status ekv_ctx_enter(ekv_context *ctx);
/* st = call, inside ekv_ctx_enter/leave, when st is still OK (the public entry points' run). */
#define EKV_GUARDED(ctx, st, call)                                                                 \
    do {                                                                                           \
        if (!(st) && !((st) = ekv_ctx_enter(ctx))) {                                               \
            (st) = (call);                                                                         \
            ekv_ctx_leave(ctx);                                                                    \
        }                                                                                          \
    } while (0)
void ekv_ctx_leave(ekv_context *ctx);
/* Physical memory of this machine in bytes (sysconf), or INT64_MAX when unknown. */
int64_t ekv_phys_mem_bytes(void);
/* Returns a workspace of at least `bytes` (64-byte aligned), or NULL on OOM. */
void *ekv_context_workspace(ekv_context *ctx, size_t bytes);
/* Lays out n blocks of sizes[i] bytes, each 64-byte aligned, in the context workspace:
 * block i starts at base + offsets[i]. Returns base, or NULL with *status set (overflow or
 * out of memory, the message naming `what`). */
char *ekv_workspace_blocks(ekv_context *ctx, const int64_t *sizes, int n, int64_t *offsets,
                           const char *what, ekv_status *status);
/* The same in the step arena (entry points only, see struct ekv_context). */
char *ekv_step_blocks(ekv_context *ctx, const int64_t *sizes, int n, int64_t *offsets,
                      const char *what, ekv_status *status);

/* Checked int64 arithmetic: returns 0 and sets *out, or -1 on overflow. */
static inline int ekv_mul_i64(int64_t a, int64_t b, int64_t *out) {
    return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}
static inline int ekv_add_i64(int64_t a, int64_t b, int64_t *out) {
    return __builtin_add_overflow(a, b, out) ? -1 : 0;
}

/* ---- dtype conversion (scalar; SIMD versions live in src/cpu) ---- */
/* The bits of a float and back, through memcpy (type punning through a union or a pointer
 * cast is not defined behaviour in every compiler mode). */
static inline uint32_t ekv_f32_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    return x;
}
static inline float ekv_f32_from_bits(uint32_t x) {
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static inline float ekv_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while ((man & 0x400u) == 0);
            man &= 0x3ffu;
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | (man << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    return ekv_f32_from_bits(bits);
}

/* Round to nearest even. */
static inline uint16_t ekv_f32_to_f16(float f) {
    const uint32_t x = ekv_f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
    if (absx >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (absx < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (absx < 0x33000000u) return (uint16_t)sign; /* < 2^-25 rounds to 0 */
        uint32_t e = absx >> 23;
        uint32_t m = (absx & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e; /* 14..24 */
        uint32_t half = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t r = absx - 0x38000000u; /* rebias exponent by 112 */
    uint32_t half = r >> 13;
    uint32_t rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) half++;
    return (uint16_t)(sign | half);
}

static inline float ekv_bf16_to_f32(uint16_t b) { return ekv_f32_from_bits((uint32_t)b << 16); }

static inline uint16_t ekv_f32_to_bf16(float f) {
    uint32_t x = ekv_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    uint32_t lsb = (x >> 16) & 1u;
    x += 0x7fffu + lsb;
    return (uint16_t)(x >> 16);
}

/* Bytes of one page range (kmin and kmax of one page and KV head, D channels) as stored. */
static inline int64_t ekv_range_bytes(ekv_dtype range_dtype, int64_t D) {
    return 2 * D * (range_dtype == EKV_DTYPE_F32 ? 4 : 2);
}

/* x rounded to f16 or bf16 outward (docs/math.md §1.2): towards -inf for dir < 0 (a range's
 * minimum), towards +inf for dir > 0 (its maximum), as the dtype's bits. Round to nearest, then
 * one step on the bits when that went the wrong way (+-inf stay; a finite x beyond the dtype's
 * range becomes +-inf on its own side and the largest finite value on the other). */
static inline uint16_t ekv_round16_outward(float x, ekv_dtype dt, int dir) {
    uint16_t h = dt == EKV_DTYPE_F16 ? ekv_f32_to_f16(x) : ekv_f32_to_bf16(x);
    const float back = dt == EKV_DTYPE_F16 ? ekv_f16_to_f32(h) : ekv_bf16_to_f32(h);
    if (dir < 0 && back > x) /* one step down: away from 0 if negative, towards it if positive */
        h = h == 0x0000u ? 0x8001u : (h & 0x8000u) ? (uint16_t)(h + 1) : (uint16_t)(h - 1);
    if (dir > 0 && back < x)
        h = h == 0x8000u ? 0x0001u : (h & 0x8000u) ? (uint16_t)(h - 1) : (uint16_t)(h + 1);
    return h;
}

/* x rounded to the nearest f16 or bf16 that is finite (a finite x beyond the dtype's range
 * becomes its largest finite value on that side): a compact ball's centre, which only has to
 * be some point its radius is measured from (docs/math.md §9.5). */
static inline uint16_t ekv_round16_nearest_finite(float x, ekv_dtype dt) {
    const uint16_t h = dt == EKV_DTYPE_F16 ? ekv_f32_to_f16(x) : ekv_f32_to_bf16(x);
    const uint16_t expo = dt == EKV_DTYPE_F16 ? 0x7c00u : 0x7f80u;
    if ((h & expo) != expo || x != x) return h; /* finite (a NaN never reaches a summary) */
    return (uint16_t)((h & 0x8000u) | (expo - 1u)); /* the largest finite magnitude */
}

/* Reads element i of a typed buffer as float. The buffer may be unaligned (a safetensors
 * file's data starts wherever its header ends, and user buffers carry no promise), so each
 * element is copied out with memcpy: the same single load on x86, and defined behaviour. */
static inline float ekv_load_f32(const void *base, ekv_dtype dt, int64_t i) {
    const char *b = (const char *)base;
    uint16_t h;
    float f;
    switch (dt) {
    case EKV_DTYPE_F16: memcpy(&h, b + 2 * i, 2); return ekv_f16_to_f32(h);
    case EKV_DTYPE_BF16: memcpy(&h, b + 2 * i, 2); return ekv_bf16_to_f32(h);
    default: memcpy(&f, b + 4 * i, 4); return f;
    }
}

static inline void ekv_store_f32(void *base, ekv_dtype dt, int64_t i, float v) {
    char *b = (char *)base;
    uint16_t h;
    switch (dt) {
    case EKV_DTYPE_F16:
        h = ekv_f32_to_f16(v);
        memcpy(b + 2 * i, &h, 2);
        break;
    case EKV_DTYPE_BF16:
        h = ekv_f32_to_bf16(v);
        memcpy(b + 2 * i, &h, 2);
        break;
    default: memcpy(b + 4 * i, &v, 4); break;
    }
}

static inline int ekv_dtype_valid(ekv_dtype dt) {
    return dt == EKV_DTYPE_F32 || dt == EKV_DTYPE_F16 || dt == EKV_DTYPE_BF16;
}

/* The head and token strides of a page in `layout` (ekv_paged_kv, include/entmaxkv/core.h): the
 * host cache's and the device cache's, written once. */
static inline void ekv_layout_strides(ekv_kv_layout layout, int64_t num_kv_heads, int64_t page_size,
                                      int64_t head_dim, int64_t *head, int64_t *token) {
    const int nhd = layout == EKV_LAYOUT_NHD;
    *head = nhd ? head_dim : page_size * head_dim;
    *token = nhd ? num_kv_heads * head_dim : head_dim;
}

/* ---- the sizes every decode stage derives from its (validated) arguments ---- */
typedef struct ekv_step_shape {
    int64_t B, H, Hk, G, D, ps, esize; /* batch, heads, KV heads, group, dim, page, element bytes */
    double alpha, a;                   /* a = alpha - 1, or 1 for softmax (z = s) */
} ekv_step_shape;

static inline ekv_step_shape ekv_step_shape_of(const ekv_decode_params *prm, const ekv_paged_kv *kv,
                                               const ekv_page_table *t) {
    ekv_step_shape s;
    s.B = t->batch;
    s.H = prm->num_heads;
    s.Hk = kv->num_kv_heads;
    s.G = s.H / s.Hk;
    s.D = kv->head_dim;
    s.ps = kv->page_size;
    s.esize = ekv_dtype_size(kv->dtype);
    s.alpha = prm->alpha;
    s.a = prm->alpha == 1.0 ? 1.0 : prm->alpha - 1.0;
    return s;
}

/* ---- validation shared by decode backends (src/core/validate.c) ----
 * Every public decode call runs ekv_decode_supported (the parameters and the method, for its
 * backend) and then ekv_validate_decode or ekv_validate_step (the memory it is given: views,
 * table, queries); the runners behind them only assume. */
ekv_status ekv_validate_decode(ekv_context *ctx, const ekv_decode_params *params,
                               const ekv_paged_kv *kv, const ekv_page_table *table, const float *q,
                               const float *out);
/* Everything ekv_validate_decode checks but the output pointer, for stages that write no
 * attention output (selection, bounds, reference probabilities). q may be NULL when the
 * stage takes no query; then it is not checked. */
ekv_status ekv_validate_step(ekv_context *ctx, const ekv_decode_params *params,
                             const ekv_paged_kv *kv, const ekv_page_table *t, const float *q);
ekv_status ekv_validate_alpha(ekv_context *ctx, double alpha);
/* The view alone (the one check of its shapes and strides, every backend): dtype, page size,
 * head dim, KV heads, pages, positive strides, and every byte offset it addresses fits int64. */
ekv_status ekv_check_kv_view(ekv_context *ctx, const ekv_paged_kv *kv);
/* The one definition of each rule (validate.c): alpha, num_heads and scale of the decode
 * parameters (host fields only: the slopes are checked where they are host memory); heads
 * divisibility; page size. */
#define EKV_MAX_PAGE_SIZE 256
ekv_status ekv_check_params(ekv_context *ctx, const ekv_decode_params *params);
ekv_status ekv_check_heads(ekv_context *ctx, int64_t num_heads, int64_t num_kv_heads);
ekv_status ekv_check_page_size(ekv_context *ctx, int64_t page_size);
/* The CUDA launch options a plan takes and the model passes on to its plan (ekv_cuda_plan_params,
 * ekv_model_params): fused_attend 0 or 1, overlap_launches -1, 0 or 1, tau_cluster -1, 0, 2, 4
 * or 8 (EKV_ERR_INVALID_ARGUMENT otherwise; what the device supports is the plan's check). */
ekv_status ekv_check_cuda_options(ekv_context *ctx, int64_t fused_attend, int64_t overlap_launches,
                                  int64_t tau_cluster);
/* head_dim in [1, 65536] (views, pools, attention shapes). */
ekv_status ekv_check_head_dim(ekv_context *ctx, int64_t head_dim);
/* ALiBi slopes (host memory, NULL = none): finite, >= 0, and the bias over max_len tokens of
 * distance fits fp32 (docs/math.md §6.2). */
ekv_status ekv_check_slopes(ekv_context *ctx, const float *slopes, int64_t num_heads,
                            int64_t max_len);
/* The shapes and parameters of exact attention of many query rows (docs/math.md §13), every
 * host field of p; not the slopes' values (ekv_check_slopes, where they are host memory). */
ekv_status ekv_check_attention_params(ekv_context *ctx, const ekv_attention_params *p);
/* The geometry of a page pool (the host cache's, and the device cache's through it): pages,
 * page size, KV heads, head dim, dtype, superpages, key code bits, range dtype, layout. Not
 * the caller's memory or max_seqs, which only the host cache has. */
ekv_status ekv_check_pool_geometry(ekv_context *ctx, const ekv_cache_params *p);
#endif
