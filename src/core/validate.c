/* Argument validation shared by every decode backend: each precondition has its own
 * status and message, and nothing is written before all of them pass. */
#include "internal.h"

ekv_decode_params ekv_decode_default_params(void) {
    ekv_decode_params p;
    p.num_heads = 32;
    p.alpha = 1.5;
    p.scale = 0.f;
    p.alibi_slopes = NULL;
    return p;
}

/* The one definition of each rule on the decode parameters (every backend calls this). */
ekv_status ekv_check_params(ekv_context *ctx, const ekv_decode_params *params) {
    ekv_status st = ekv_validate_alpha(ctx, params->alpha);
    if (st) return st;
    if (params->num_heads <= 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "num_heads=%d must be >= 1", params->num_heads);
    if (!(params->scale >= 0.f) || !isfinite(params->scale))
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "scale=%g must be finite and >= 0 (0 = 1/sqrt(D))", (double)params->scale);
    return EKV_OK;
}

ekv_status ekv_check_heads(ekv_context *ctx, int64_t num_heads, int64_t num_kv_heads) {
    if (num_kv_heads <= 0 || num_heads <= 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "num_heads=%lld and num_kv_heads=%lld must be >= 1", (long long)num_heads,
                        (long long)num_kv_heads);
    if (num_heads % num_kv_heads != 0)
        return ekv_fail(
                ctx, EKV_ERR_HEAD_MISMATCH,
                "num_heads=%lld is not a multiple of num_kv_heads=%lld (GQA groups must be equal)",
                (long long)num_heads, (long long)num_kv_heads);
    return EKV_OK;
}

ekv_status ekv_check_head_dim(ekv_context *ctx, int64_t head_dim) {
    if (head_dim <= 0 || head_dim > 65536)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "head_dim=%lld must be in [1, 65536]",
                        (long long)head_dim);
    return EKV_OK;
}

ekv_status ekv_check_page_size(ekv_context *ctx, int64_t page_size) {
    if (page_size < 1 || page_size > EKV_MAX_PAGE_SIZE)
        return ekv_fail(ctx, EKV_ERR_INVALID_PAGE_SIZE, "page_size=%lld must be in [1, %d]",
                        (long long)page_size, EKV_MAX_PAGE_SIZE);
    return EKV_OK;
}

ekv_status ekv_check_cuda_options(ekv_context *ctx, int64_t fused_attend, int64_t overlap_launches,
                                  int64_t tau_cluster) {
    if (fused_attend != 0 && fused_attend != 1)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "fused_attend=%d must be 0 or 1",
                        (int)fused_attend);
    if (overlap_launches < -1 || overlap_launches > 1)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "overlap_launches=%d must be -1 (where the GPU supports it), 0 or 1",
                        (int)overlap_launches);
    if (tau_cluster != -1 && tau_cluster != 0 && tau_cluster != 2 && tau_cluster != 4 &&
        tau_cluster != 8)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                        "tau_cluster=%lld must be -1 (8 where the GPU supports clusters), 0, 2, 4 "
                        "or 8",
                        (long long)tau_cluster);
    return EKV_OK;
}

ekv_status ekv_check_pool_geometry(ekv_context *ctx, const ekv_cache_params *p) {
    if (p->num_pages <= 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "num_pages=%lld must be >= 1",
                        (long long)p->num_pages);
    if (p->num_pages > INT32_MAX)
        return ekv_fail(ctx, EKV_ERR_SIZE_OVERFLOW,
                        "num_pages=%lld exceeds the int32 page-id range", (long long)p->num_pages);
    ekv_status st = ekv_check_page_size(ctx, p->page_size);
    if (st) return st;
    if (p->num_kv_heads <= 0 || p->num_kv_heads > 4096)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "num_kv_heads=%d must be in [1, 4096]",
                        p->num_kv_heads);
    st = ekv_check_head_dim(ctx, p->head_dim);
    if (st) return st;
    if (!ekv_dtype_valid(p->dtype))
        return ekv_fail(ctx, EKV_ERR_INVALID_DTYPE, "dtype=%d is not f32 (0), f16 (1) or bf16 (2)",
                        (int)p->dtype);
    if (p->superpage_pages < 0 || p->superpage_pages > EKV_MAX_SUPERPAGE_PAGES)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "superpage_pages=%d must be in [0, %d] (0 = none)", p->superpage_pages,
                        EKV_MAX_SUPERPAGE_PAGES);
    if (p->code_bits != 0 && p->code_bits != 4 && p->code_bits != 8)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "code_bits=%d must be 0 (none), 4 or 8",
                        p->code_bits);
    if (!ekv_dtype_valid(p->range_dtype))
        return ekv_fail(ctx, EKV_ERR_INVALID_DTYPE,
                        "range_dtype=%d is not f32 (0), f16 (1) or bf16 (2)", (int)p->range_dtype);
    if (p->layout != EKV_LAYOUT_HND && p->layout != EKV_LAYOUT_NHD)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "layout=%d is not HND (0) or NHD (1)",
                        (int)p->layout);
    return EKV_OK;
}

/* ALiBi slopes are finite, >= 0, and small enough that the bias over the longest distance
 * (at most 3 * m * N in z-space) cannot overflow fp32 (docs/math.md §6.2). */
ekv_status ekv_check_slopes(ekv_context *ctx, const float *slopes, int64_t num_heads,
                            int64_t max_len) {
    if (!slopes) return EKV_OK;
    for (int64_t h = 0; h < num_heads; h++) {
        const float m = slopes[h];
        if (!(m >= 0.f) || !isfinite(m))
            return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                            "alibi_slopes[%lld]=%g must be finite and >= 0", (long long)h,
                            (double)m);
        if (3.0 * (double)m * (double)max_len > 1e37)
            return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                            "alibi_slopes[%lld]=%g is too large: the bias over %lld tokens "
                            "overflows fp32",
                            (long long)h, (double)m, (long long)max_len);
    }
    return EKV_OK;
}

/* The shapes and parameters of exact attention of many query rows (the CPU reference and the
 * CUDA flash entry, docs/math.md §13): alpha, scale, heads, head dim, T and N, causal with
 * T <= N, and T x H x D and N x Hk x D elements, twice over in doubles, fit int64 bytes. The
 * slopes' values are the caller's to check where they are host memory (ekv_check_slopes). */
ekv_status ekv_check_attention_params(ekv_context *ctx, const ekv_attention_params *p) {
    const ekv_decode_params dp = {.num_heads = p->num_heads, .alpha = p->alpha, .scale = p->scale};
    ekv_status st = ekv_check_params(ctx, &dp);
    if (!st) st = ekv_check_heads(ctx, p->num_heads, p->num_kv_heads);
    if (!st) st = ekv_check_head_dim(ctx, p->head_dim);
    if (st) return st;
    if (p->num_queries < 1 || p->num_keys < 1)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "num_queries=%lld and num_keys=%lld must be >= 1",
                        (long long)p->num_queries, (long long)p->num_keys);
    if (p->causal != 0 && p->causal != 1)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "causal=%d must be 0 or 1", p->causal);
    if (p->causal && p->num_queries > p->num_keys)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE,
                        "causal attention needs num_queries=%lld <= num_keys=%lld (row t sits at "
                        "position num_keys - num_queries + t and sees the keys up to it)",
                        (long long)p->num_queries, (long long)p->num_keys);
    int64_t nq, nk, bytes;
    if (ekv_mul_i64(p->num_queries, (int64_t)p->num_heads * p->head_dim, &nq) ||
        ekv_mul_i64(p->num_keys, (int64_t)p->num_kv_heads * p->head_dim, &nk) ||
        ekv_mul_i64(nq > nk ? nq : nk, 2 * (int64_t)sizeof(double), &bytes))
        return ekv_fail(
                ctx, EKV_ERR_SIZE_OVERFLOW,
                "num_queries=%lld or num_keys=%lld x heads x head_dim overflows int64 bytes",
                (long long)p->num_queries, (long long)p->num_keys);
    return EKV_OK;
}

/* The slopes against the longest sequence of the table. */
static ekv_status check_slopes(ekv_context *ctx, const ekv_decode_params *params,
                               const ekv_paged_kv *kv, const ekv_page_table *t) {
    if (!params->alibi_slopes) return EKV_OK;
    int64_t maxN = 1;
    for (int32_t b = 0; b < t->batch; b++) {
        const int64_t n = ekv_seq_len(t->indptr, t->last_page_len, b, kv->page_size);
        maxN = n > maxN ? n : maxN;
    }
    return ekv_check_slopes(ctx, params->alibi_slopes, params->num_heads, maxN);
}

/* Every element the view addresses, as a byte offset from k or v, fits int64: the kernels form
 * page * stride_page + head * stride_head + slot * stride_token + d (and each term alone) in
 * int64 and scale it by the element size. The sum of the terms' largest values bounds them all. */
static ekv_status check_extent(ekv_context *ctx, const ekv_paged_kv *kv) {
    int64_t e = kv->head_dim, t;
    if (ekv_mul_i64(kv->num_pages, kv->stride_page, &t) || ekv_add_i64(e, t, &e) ||
        ekv_mul_i64(kv->num_kv_heads, kv->stride_head, &t) || ekv_add_i64(e, t, &e) ||
        ekv_mul_i64(kv->page_size, kv->stride_token, &t) || ekv_add_i64(e, t, &e) ||
        ekv_mul_i64(e, ekv_dtype_size(kv->dtype), &t))
        return ekv_fail(ctx, EKV_ERR_SIZE_OVERFLOW,
                        "the view's byte offsets overflow int64 (num_pages %lld x stride_page "
                        "%lld + num_kv_heads %d x stride_head %lld + page_size %d x stride_token "
                        "%lld elements of %lld bytes)",
                        (long long)kv->num_pages, (long long)kv->stride_page, kv->num_kv_heads,
                        (long long)kv->stride_head, kv->page_size, (long long)kv->stride_token,
                        (long long)ekv_dtype_size(kv->dtype));
    return EKV_OK;
}

ekv_status ekv_check_kv_view(ekv_context *ctx, const ekv_paged_kv *kv) {
    if (!ekv_dtype_valid(kv->dtype))
        return ekv_fail(ctx, EKV_ERR_INVALID_DTYPE, "kv->dtype=%d is not f32, f16 or bf16",
                        (int)kv->dtype);
    ekv_status st = ekv_check_page_size(ctx, kv->page_size);
    if (st) return st;
    st = ekv_check_head_dim(ctx, kv->head_dim);
    if (st) return st;
    if (kv->num_kv_heads <= 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "num_kv_heads=%d must be >= 1",
                        kv->num_kv_heads);
    if (kv->num_pages <= 0 || kv->num_pages > INT32_MAX)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "num_pages=%lld must be in [1, 2^31-1]",
                        (long long)kv->num_pages);
    if (kv->stride_token < kv->head_dim || kv->stride_head <= 0 || kv->stride_page <= 0)
        return ekv_fail(
                ctx, EKV_ERR_INVALID_SIZE,
                "strides (page %lld, head %lld, token %lld) must be positive and token >= head_dim",
                (long long)kv->stride_page, (long long)kv->stride_head,
                (long long)kv->stride_token);
    return check_extent(ctx, kv);
}

ekv_status ekv_validate_decode(ekv_context *ctx, const ekv_decode_params *params,
                               const ekv_paged_kv *kv, const ekv_page_table *t, const float *q,
                               const float *out) {
    if (!params || !kv || !t || !q || !out)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL",
                        !params ? "params"
                        : !kv   ? "kv"
                        : !t    ? "table"
                        : !q    ? "q"
                                : "out");
    return ekv_validate_step(ctx, params, kv, t, q);
}

ekv_status ekv_validate_step(ekv_context *ctx, const ekv_decode_params *params,
                             const ekv_paged_kv *kv, const ekv_page_table *t, const float *q) {
    if (!params || !kv || !t)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "%s is NULL",
                        !params ? "params"
                        : !kv   ? "kv"
                                : "table");
    if (!kv->k || !kv->v)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "kv->%s is NULL", !kv->k ? "k" : "v");
    if (!t->indptr || !t->indices || !t->last_page_len)
        return ekv_fail(ctx, EKV_ERR_NULL_POINTER, "table->%s is NULL",
                        !t->indptr    ? "indptr"
                        : !t->indices ? "indices"
                                      : "last_page_len");
    ekv_status st = ekv_check_kv_view(ctx, kv);
    if (!st) st = ekv_check_heads(ctx, params->num_heads, kv->num_kv_heads);
    if (st) return st;
    if (t->batch <= 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_SIZE, "batch=%d must be >= 1", t->batch);
    if (t->indptr[0] != 0)
        return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "indptr[0]=%lld must be 0",
                        (long long)t->indptr[0]);
    for (int32_t b = 0; b < t->batch; b++) {
        int64_t np = t->indptr[b + 1] - t->indptr[b];
        if (np < 0)
            return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT, "indptr decreases at sequence %d", b);
        if (np == 0) return ekv_fail(ctx, EKV_ERR_EMPTY_INPUT, "sequence %d has no tokens", b);
        if (t->last_page_len[b] < 1 || t->last_page_len[b] > kv->page_size)
            return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                            "last_page_len[%d]=%d must be in [1, page_size=%d]", b,
                            t->last_page_len[b], kv->page_size);
        for (int64_t i = t->indptr[b]; i < t->indptr[b + 1]; i++)
            if (t->indices[i] < 0 || t->indices[i] >= kv->num_pages)
                return ekv_fail(ctx, EKV_ERR_INVALID_ARGUMENT,
                                "indices[%lld]=%d is outside [0, num_pages=%lld)", (long long)i,
                                t->indices[i], (long long)kv->num_pages);
    }
    st = check_slopes(ctx, params, kv, t);
    if (st) return st;
    int64_t nq = q ? (int64_t)t->batch * params->num_heads * kv->head_dim : 0;
    for (int64_t i = 0; i < nq; i++)
        if (!isfinite(q[i]))
            return ekv_fail(ctx, EKV_ERR_NAN_INPUT, "q[%lld] is NaN or infinite", (long long)i);
    return EKV_OK;
}
