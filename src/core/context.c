/* Context: thread pool, SIMD level, per-context error message, reusable workspace. */
#include "internal.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

ekv_status ekv_fail(ekv_context *ctx, ekv_status status, const char *fmt, ...) {
    if (ctx) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(ctx->last_error, sizeof ctx->last_error, fmt, ap);
        va_end(ap);
    }
    return status;
}

void ekv_clear_error(ekv_context *ctx) {
    if (ctx) ctx->last_error[0] = '\0';
}

const char *ekv_last_error(const ekv_context *ctx) { return ctx ? ctx->last_error : ""; }

ekv_isa ekv_cpu_best_isa(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return EKV_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return EKV_ISA_AVX2; /* every AVX2 CPU we target has F16C */
#endif
    return EKV_ISA_SCALAR;
}

const char *ekv_isa_name(ekv_isa isa) {
    switch (isa) {
    case EKV_ISA_AUTO: return "auto";
    case EKV_ISA_SCALAR: return "scalar";
    case EKV_ISA_AVX2: return "avx2";
    case EKV_ISA_AVX512: return "avx512";
    }
    return "unknown";
}

ekv_context_params ekv_context_default_params(void) {
    ekv_context_params p;
    p.n_threads = 0;
    p.isa = EKV_ISA_AUTO;
    return p;
}

ekv_status ekv_context_create(const ekv_context_params *params, ekv_context **out) {
    if (!out) return EKV_ERR_NULL_POINTER;
    ekv_context_params p = params ? *params : ekv_context_default_params();
    if (p.n_threads < 0 || p.n_threads > 1024) return EKV_ERR_INVALID_SIZE;
    if (p.isa < EKV_ISA_AUTO || p.isa > EKV_ISA_AVX512) return EKV_ERR_INVALID_ARGUMENT;
    ekv_isa best = ekv_cpu_best_isa();
    if (p.isa == EKV_ISA_AUTO) p.isa = best;
    if (p.isa > best) return EKV_ERR_UNSUPPORTED;
    if (p.n_threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        p.n_threads = n > 0 ? (int32_t)(n > 256 ? 256 : n) : 1;
    }
    ekv_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return EKV_ERR_OUT_OF_MEMORY;
    ctx->isa = p.isa;
    ctx->n_threads = p.n_threads;
    ctx->pool = ekv_pool_create(p.n_threads);
    if (!ctx->pool) {
        free(ctx);
        return EKV_ERR_OUT_OF_MEMORY;
    }
    *out = ctx;
    return EKV_OK;
}

void ekv_context_free(ekv_context *ctx) {
    if (!ctx) return;
    ekv_pool_free(ctx->pool);
    free(ctx->workspace);
    free(ctx->step_buf);
    free(ctx);
}

/* One distinct address per thread identifies the owner (pthread_t is not an integer). */
static _Thread_local char thread_token;

ekv_status ekv_ctx_enter(ekv_context *ctx) {
    if (!ctx) return EKV_OK;
    uintptr_t self = (uintptr_t)&thread_token, free_ = 0;
    if (__atomic_load_n(&ctx->owner, __ATOMIC_ACQUIRE) == self) { /* a nested call */
        ctx->depth++;
        return EKV_OK;
    }
    if (!__atomic_compare_exchange_n(&ctx->owner, &free_, self, 0, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED))
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "context used from two threads at once; use one context per thread");
    ctx->depth = 1;
    return EKV_OK;
}

void ekv_ctx_leave(ekv_context *ctx) {
    if (!ctx || --ctx->depth > 0) return;
    __atomic_store_n(&ctx->owner, (uintptr_t)0, __ATOMIC_RELEASE);
}

int64_t ekv_phys_mem_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    int64_t bytes;
    if (pages <= 0 || size <= 0 || ekv_mul_i64(pages, size, &bytes)) return INT64_MAX;
    return bytes;
}

ekv_isa ekv_context_isa(const ekv_context *ctx) { return ctx ? ctx->isa : EKV_ISA_SCALAR; }
int32_t ekv_context_threads(const ekv_context *ctx) { return ctx ? ctx->n_threads : 0; }

/* Grows a context buffer to at least `bytes` (64-byte aligned, with headroom so that slowly
 * growing steps do not reallocate every time). The old contents are not kept. */
static void *arena_grow(void **buf, size_t *have, size_t bytes) {
    if (bytes <= *have) return *buf;
    size_t want = bytes + bytes / 4 + 64;
    want = (want + 63) & ~(size_t)63;
    void *p = NULL;
    if (posix_memalign(&p, 64, want) != 0) return NULL;
    free(*buf);
    *buf = p;
    *have = want;
    return p;
}

void *ekv_context_workspace(ekv_context *ctx, size_t bytes) {
    return arena_grow(&ctx->workspace, &ctx->workspace_bytes, bytes);
}

static char *arena_blocks(ekv_context *ctx, void **buf, size_t *have, const int64_t *sizes, int n,
                          int64_t *offsets, const char *what, ekv_status *status) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        offsets[i] = total;
        if (sizes[i] < 0 || ekv_add_i64(total, (sizes[i] + 63) & ~(int64_t)63, &total)) {
            *status = ekv_fail(ctx, EKV_ERR_SIZE_OVERFLOW, "%s: workspace size overflows", what);
            return NULL;
        }
    }
    char *ws = arena_grow(buf, have, (size_t)(total > 0 ? total : 64));
    if (!ws) {
        *status = ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "%s: cannot allocate %.1f MiB of workspace",
                           what, (double)total / (1 << 20));
        return NULL;
    }
    *status = EKV_OK;
    return ws;
}

char *ekv_workspace_blocks(ekv_context *ctx, const int64_t *sizes, int n, int64_t *offsets,
                           const char *what, ekv_status *status) {
    return arena_blocks(ctx, &ctx->workspace, &ctx->workspace_bytes, sizes, n, offsets, what,
                        status);
}

char *ekv_step_blocks(ekv_context *ctx, const int64_t *sizes, int n, int64_t *offsets,
                      const char *what, ekv_status *status) {
    return arena_blocks(ctx, &ctx->step_buf, &ctx->step_bytes, sizes, n, offsets, what, status);
}
