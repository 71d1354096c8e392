/*
 * The method table and the one support check (docs/architecture.md, "Methods and the stage
 * table"). Every rule about which step a backend serves is written here once: the decode
 * entry points of every backend call ekv_decode_supported before anything else, so "is this
 * supported?" and "what runs?" cannot disagree.
 */
#include "method.h"
#include "../math/gaussian.h"

#define CPU_  (1u << EKV_BACKEND_CPU)
#define REF_  (1u << EKV_BACKEND_REF)
#define CUDA_ (1u << EKV_BACKEND_CUDA)

static const ekv_method_info method_table[EKV_SELECT_METHOD_COUNT] = {
        [EKV_SELECT_DENSE] = {"dense", 0, CPU_ | REF_ | CUDA_, 0, 0, 0},
        [EKV_SELECT_TOPK] = {"topk", EKV_STAGE_BOUND | EKV_STAGE_TOPK, CPU_ | CUDA_,
                             EKV_NEEDS_MINMAX, 0, 1},
        [EKV_SELECT_ORACLE] = {"oracle", EKV_STAGE_ORACLE, CPU_, 0, 0, 0},
        [EKV_SELECT_GAUSSIAN] = {"gaussian", EKV_STAGE_GAUSS, CPU_ | CUDA_, EKV_NEEDS_MOMENTS, 0,
                                 0},
        [EKV_SELECT_CERTIFIED] = {"certified", EKV_STAGE_BOUND | EKV_STAGE_TOPK | EKV_STAGE_ROUND2,
                                  CPU_ | CUDA_, EKV_NEEDS_MINMAX | EKV_NEEDS_BALL, 1, 1},
        [EKV_SELECT_SCREENED] = {"screened", EKV_STAGE_SCREEN, CPU_ | CUDA_,
                                 EKV_NEEDS_MINMAX | EKV_NEEDS_CODES, 1, 0},
};

static const char *const backend_names[] = {"cpu", "ref", "cuda"};

const ekv_method_info *ekv_method_info_of(ekv_select_method m) {
    return (int)m >= 0 && (int)m < EKV_SELECT_METHOD_COUNT ? &method_table[m] : NULL;
}

const char *ekv_method_name(ekv_select_method m) {
    const ekv_method_info *mi = ekv_method_info_of(m);
    return mi ? mi->name : NULL;
}

ekv_status ekv_method_from_name(const char *name, ekv_select_method *out) {
    if (!name || !out) return EKV_ERR_NULL_POINTER;
    for (int i = 0; i < EKV_SELECT_METHOD_COUNT; i++)
        if (!strcmp(name, method_table[i].name)) {
            *out = (ekv_select_method)i;
            return EKV_OK;
        }
    return EKV_ERR_INVALID_ARGUMENT;
}

const char *ekv_backend_name(ekv_backend b) {
    return (int)b >= 0 && (int)b < (int)(sizeof backend_names / sizeof *backend_names)
                   ? backend_names[b]
                   : NULL;
}

ekv_status ekv_backend_from_name(const char *name, ekv_backend *out) {
    if (!name || !out) return EKV_ERR_NULL_POINTER;
    for (int i = 0; i < (int)(sizeof backend_names / sizeof *backend_names); i++)
        if (!strcmp(name, backend_names[i])) {
            *out = (ekv_backend)i;
            return EKV_OK;
        }
    return EKV_ERR_INVALID_ARGUMENT;
}

ekv_status ekv_check_superpages(ekv_context *ctx, const ekv_paged_kv *kv,
                                const ekv_page_stats *st) {
    if (!st->smin || st->superpage_pages <= 0) return EKV_OK;
    const int64_t need = (kv->num_pages + st->superpage_pages - 1) / st->superpage_pages;
    if (!st->smax || st->num_superpages != need)
        return ekv_fail(
                ctx, EKV_ERR_INVALID_ARGUMENT,
                "stats: %lld superpages of %d pages do not cover the %lld physical pages (pass smin/smax "
                "as ekv_cache_kv_view gives them, or smin = NULL)",
                (long long)st->num_superpages, st->superpage_pages, (long long)kv->num_pages);
    return EKV_OK;
}

ekv_status ekv_check_stats_shape(ekv_context *ctx, const ekv_paged_kv *kv,
                                 const ekv_page_stats *st) {
    if (st->num_pages >= kv->num_pages && st->num_kv_heads == kv->num_kv_heads &&
        st->head_dim == kv->head_dim && st->page_size == kv->page_size)
        return EKV_OK;
    return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                    "stats cover %lld pages x %d KV heads x %d dims (page size %d), the view "
                    "%lld pages x %d x %d (page size %d): take both from one cache "
                    "(ekv_cache_kv_view), or set the counts of the statistics' pool",
                    (long long)st->num_pages, st->num_kv_heads, st->head_dim, st->page_size,
                    (long long)kv->num_pages, kv->num_kv_heads, kv->head_dim, kv->page_size);
}

/* The page ranges the bounds read: kmin/kmax (fp32), or kmin16/kmax16 in range_dtype. */
static ekv_status check_ranges(ekv_context *ctx, const ekv_method_info *mi,
                               const ekv_page_stats *st) {
    if (st->range_dtype == EKV_DTYPE_F32) {
        if (!st->kmin || !st->kmax)
            return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "stats->kmin/kmax is NULL (needed by %s)",
                            mi->name);
        return EKV_OK;
    }
    if (!ekv_dtype_valid(st->range_dtype))
        return ekv_fail(ctx, EKV_ERR_INVALID_DTYPE,
                        "stats->range_dtype=%d is not f32 (0), f16 (1) or bf16 (2)",
                        (int)st->range_dtype);
    if (!st->kmin16 || !st->kmax16)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER,
                        "stats->kmin16/kmax16 is NULL (range_dtype %s, needed by %s)",
                        ekv_dtype_name(st->range_dtype), mi->name);
    return EKV_OK;
}

ekv_status ekv_check_stats(ekv_context *ctx, const ekv_method_info *mi, int use_ball,
                           const ekv_paged_kv *kv, const ekv_page_stats *st) {
    const unsigned needs = mi->needs | (use_ball ? EKV_NEEDS_BALL : 0);
    if (!needs) return EKV_OK;
    if (!st)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s needs the page statistics (stats is NULL)",
                        mi->name);
    ekv_status s = ekv_check_stats_shape(ctx, kv, st);
    if (!s && (needs & EKV_NEEDS_MINMAX)) s = check_ranges(ctx, mi, st);
    if (s) return s;
    if ((needs & EKV_NEEDS_BALL) && (!st->kmean || !st->radius))
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER,
                        "stats->kmean/radius are needed for the ball bound (%s)", mi->name);
    if ((needs & EKV_NEEDS_MOMENTS) && (!st->kmean || !st->km2 || !st->count))
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER,
                        "stats->kmean/km2/count is NULL (needed by the %s selector)", mi->name);
    if ((needs & EKV_NEEDS_CODES) && (!st->codes || (st->code_bits != 4 && st->code_bits != 8)))
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "%s needs key codes: stats->codes with code_bits 4 or 8 (a cache created "
                        "with code_bits; stats has code_bits %d)",
                        mi->name, st->code_bits);
    return (mi->stages & EKV_STAGE_BOUND) ? ekv_check_superpages(ctx, kv, st) : EKV_OK;
}

/* The budget of a budgeted method: a token count, or a fraction of each sequence. */
static ekv_status check_budget(ekv_context *ctx, const ekv_method_info *mi,
                               const ekv_select_params *s) {
    if (!(s->budget_fraction >= 0.0 && s->budget_fraction <= 1.0))
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "budget_fraction=%g must be in [0, 1] (0 = use budget_tokens)",
                        s->budget_fraction);
    if (s->budget_fraction > 0.0 || s->tau_hint) return EKV_OK; /* a hint replaces the budget */
    if (s->budget_tokens < 1)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "%s: budget_tokens=%lld must be >= 1",
                        mi->name, (long long)s->budget_tokens);
    return EKV_OK;
}

/* The Gaussian selector's own parameters (docs/math.md §4.13). */
static ekv_status check_gaussian(ekv_context *ctx, double alpha, const ekv_select_params *s) {
    if (!ekv_gauss_supported(alpha))
        return ekv_fail(
                ctx, EKV_ERR_UNSUPPORTED,
                "the gaussian selector has closed forms for alpha = 2, 1.5 and 4/3 only (alpha=%.17g)",
                alpha);
    if (!(s->max_quantile > 0 && s->max_quantile < 1) ||
        !(s->clamp_quantile > 0 && s->clamp_quantile < 1))
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "max_quantile=%g and clamp_quantile=%g must be in (0, 1)", s->max_quantile,
                        s->clamp_quantile);
    if (!(s->margin_z >= 0) || !isfinite(s->margin_z) || !(s->excess_fraction >= 0) ||
        !isfinite(s->excess_fraction))
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "margin_z=%g and excess_fraction=%g must be finite and >= 0", s->margin_z,
                        s->excess_fraction);
    if (s->correction_iters < -1 || s->correction_iters > 100)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "correction_iters=%d must be -1 (auto) or in [0, 100]",
                        s->correction_iters);
    return EKV_OK;
}

/* What a valid request needs from the select params, whatever the backend. */
static ekv_status check_select(ekv_context *ctx, const ekv_method_info *mi,
                               const ekv_decode_params *p, const ekv_select_params *s) {
    if (mi->entmax_only && !(p->alpha > 1.0))
        return ekv_fail(ctx, EKV_ERR_INVALID_ALPHA,
                        "%s needs entmax (alpha > 1): softmax has no exact zeros", mi->name);
    if (s->tau_mode != EKV_TAU_EXACT && s->tau_mode != EKV_TAU_FIXED &&
        s->tau_mode != EKV_TAU_CORRECTED)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "tau_mode=%d is not exact (0), fixed (1) or corrected (2)",
                        (int)s->tau_mode);
    if (s->sink_pages < 0 || s->recent_pages < 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "sink_pages=%d and recent_pages=%d must be >= 0", s->sink_pages,
                        s->recent_pages);
    ekv_status st = mi->budgeted ? check_budget(ctx, mi, s) : EKV_OK;
    if (!st && (mi->stages & EKV_STAGE_GAUSS)) st = check_gaussian(ctx, p->alpha, s);
    return st;
}

/* What the CUDA backend does not serve (docs/architecture.md, "Backends"). */
static ekv_status check_cuda(ekv_context *ctx, const ekv_select_params *s) {
    if (!s) return EKV_OK;
    return s->tau_mode != EKV_TAU_EXACT
                   ? ekv_fail(ctx, EKV_ERR_UNSUPPORTED,
                              "tau modes fixed/corrected: not on the CUDA backend (CPU only)")
                   : EKV_OK;
}

ekv_status ekv_decode_supported(ekv_context *ctx, ekv_backend backend, const ekv_decode_params *p,
                                const ekv_select_params *s) {
    if (!p) return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "params is NULL");
    const char *bname = ekv_backend_name(backend);
    if (!bname)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "backend=%d is not cpu (0), ref (1) or cuda (2)", (int)backend);
    const ekv_method_info *mi = ekv_method_info_of(ekv_step_method(s));
    if (!mi)
        return ekv_fail(
                ctx, EKV_ERR_INVALID_ARGUMENT,
                "select method %d is not dense (0), topk (1), oracle (2), gaussian (3), certified (4) or "
                "screened (5)",
                (int)s->method);
    ekv_status st = ekv_check_params(ctx, p);
    if (!st && s) st = check_select(ctx, mi, p, s);
    if (st) return st;
    if (!(mi->backends & (1u << backend)))
        return ekv_fail(ctx, EKV_ERR_UNSUPPORTED, "select method %s is not on the %s backend",
                        mi->name, bname);
    return backend == EKV_BACKEND_CUDA ? check_cuda(ctx, s) : EKV_OK;
}
