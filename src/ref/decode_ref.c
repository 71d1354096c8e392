/*
 * The readable truth for decode: scalar, single-threaded, long double everywhere.
 * Shares no numerical code with the CPU backend (its own sort-based thresholds and its
 * own bisection), so that agreement between the two means something.
 */
#include "../core/internal.h"
#include <stdlib.h>

typedef long double real;

static int cmp_desc_ld(const void *a, const void *b) {
    real x = *(const real *)a, y = *(const real *)b;
    return (x < y) - (x > y);
}

/* Exact tau (z-space) by sorting (alpha 1.5, 2: docs/math.md §8) or bisection (other alpha). */
static real ref_tau(const real *z, int64_t n, double alpha, real *tmp) {
    real m = z[0];
    for (int64_t i = 1; i < n; i++)
        if (z[i] > m) m = z[i];
    if (alpha == 1.0) {
        real s = 0;
        for (int64_t i = 0; i < n; i++) s += expl(z[i] - m);
        return m + logl(s);
    }
    if (alpha == 2.0 || alpha == 1.5) {
        memcpy(tmp, z, sizeof(real) * (size_t)n);
        qsort(tmp, (size_t)n, sizeof(real), cmp_desc_ld);
        real c = 0, q = 0, best = tmp[0] - 1;
        for (int64_t k = 0; k < n; k++) {
            real kk = (real)(k + 1), t;
            c += tmp[k];
            q += tmp[k] * tmp[k];
            if (alpha == 2.0) {
                t = (c - 1) / kk;
            } else {
                real mean = c / kk, ss = q - kk * mean * mean, d = (1 - ss) / kk;
                t = mean - sqrtl(d > 0 ? d : 0);
            }
            if (t < tmp[k])
                best = t;
            else
                break;
        }
        return best;
    }
    real beta = 1.0L / ((real)alpha - 1.0L), lo = m - 1, hi = m;
    for (int it = 0; it < 200; it++) {
        real mid = (lo + hi) / 2, f = 0;
        for (int64_t i = 0; i < n; i++)
            if (z[i] > mid) f += powl(z[i] - mid, beta);
        if (f > 1)
            lo = mid;
        else
            hi = mid;
    }
    return (lo + hi) / 2;
}

ekv_status ekv_decode_dense_ref(ekv_context *ctx, const ekv_decode_params *prm,
                                const ekv_paged_kv *kv, const ekv_page_table *tab, const float *q,
                                float *out, ekv_decode_info *info) {
    ekv_status st = ekv_decode_supported(ctx, EKV_BACKEND_REF, prm, NULL);
    if (!st) st = ekv_validate_decode(ctx, prm, kv, tab, q, out);
    if (st) return st;
    const int64_t H = prm->num_heads, Hk = kv->num_kv_heads, G = H / Hk, D = kv->head_dim;
    const int64_t ps = kv->page_size, es = ekv_dtype_size(kv->dtype);
    const real a = prm->alpha == 1.0 ? 1.0L : (real)prm->alpha - 1.0L;
    const real scale = prm->scale > 0 ? (real)prm->scale : 1.0L / sqrtl((real)D);
    const int64_t nmax = ekv_table_max_len(tab->indptr, tab->last_page_len, tab->batch, ps);
    real *z = malloc(sizeof(real) * (size_t)nmax), *tmp = malloc(sizeof(real) * (size_t)nmax);
    real *o = malloc(sizeof(real) * (size_t)D);
    float *res = malloc(sizeof(float) * (size_t)(tab->batch * H * D));
    if (!z || !tmp || !o || !res) {
        free(z);
        free(tmp);
        free(o);
        free(res);
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "reference decode: out of memory");
    }
    int64_t bytes_k = 0, bytes_v = 0;
    for (int32_t b = 0; b < tab->batch; b++) {
        const int64_t N = ekv_seq_len(tab->indptr, tab->last_page_len, b, ps);
        bytes_k += N * Hk * D * es;
        for (int64_t h = 0; h < H; h++) {
            const int64_t kvh = h / G;
            const float *qh = q + ((int64_t)b * H + h) * D;
            for (int64_t j = 0; j < N; j++) {
                int32_t page = tab->indices[tab->indptr[b] + j / ps];
                int64_t off = (int64_t)page * kv->stride_page + kvh * kv->stride_head +
                              (j % ps) * kv->stride_token;
                real s = 0;
                for (int64_t d = 0; d < D; d++)
                    s += (real)qh[d] * (real)ekv_load_f32(kv->k, kv->dtype, off + d);
                s *= scale;
                if (prm->alibi_slopes) s += (real)prm->alibi_slopes[h] * (real)(j - (N - 1));
                z[j] = a * s;
            }
            /* shifted coordinates (docs/math.md §6.2): z - max, so that a huge score scale
             * cannot swallow the -1 of the bracket or cancel in the closed forms */
            real zmax = z[0];
            for (int64_t j = 1; j < N; j++) zmax = z[j] > zmax ? z[j] : zmax;
            for (int64_t j = 0; j < N; j++) z[j] -= zmax;
            real tau = ref_tau(z, N, prm->alpha, tmp), psum = 0;
            int64_t sup = 0;
            for (int64_t d = 0; d < D; d++) o[d] = 0;
            for (int64_t j = 0; j < N; j++) {
                real p;
                if (prm->alpha == 1.0)
                    p = expl(z[j] - tau);
                else
                    p = z[j] > tau ? powl(z[j] - tau, 1.0L / a) : 0;
                if (p <= 0) continue;
                sup++;
                psum += p;
                int32_t page = tab->indices[tab->indptr[b] + j / ps];
                int64_t off = (int64_t)page * kv->stride_page + kvh * kv->stride_head +
                              (j % ps) * kv->stride_token;
                for (int64_t d = 0; d < D; d++)
                    o[d] += p * (real)ekv_load_f32(kv->v, kv->dtype, off + d);
            }
            /* bisection leaves sum p = 1 +- 1e-18; renormalise like docs/math.md §9.8 */
            for (int64_t d = 0; d < D; d++)
                res[((int64_t)b * H + h) * D + d] = (float)(o[d] / psum);
            if (info && info->tau) info->tau[(int64_t)b * H + h] = (double)(tau + zmax);
            if (info && info->support) info->support[(int64_t)b * H + h] = sup;
            bytes_v += sup * D * es; /* per query head (the ref does not share rows) */
        }
    }
    memcpy(out, res, sizeof(float) * (size_t)(tab->batch * H * D));
    if (info) {
        info->bytes_k = bytes_k;
        info->bytes_v = bytes_v;
    }
    free(z);
    free(tmp);
    free(o);
    free(res);
    ekv_clear_error(ctx);
    return EKV_OK;
}
