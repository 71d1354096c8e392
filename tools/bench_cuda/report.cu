/*
 * bench --backend cuda, reporting (bench_cuda.cu): the bytes a step read (from the plan's report
 * and the screen's read-backs), the table row and the JSON object of one length.
 */
#include "bench_cuda.cuh"
extern "C" {
#include "core/stats_rules.h" /* the ball bytes the bound reads (one rule) */
}
#include "cuda/common/test_hooks.h" /* the screen's rows, overflows and kernel (not public API) */

/* Bytes: K of the listed tokens, V rows read, summaries read by the bound, and the score
 * traffic (written once; entmax reads it once for the candidates, two-pass softmax twice:
 * log-sum-exp and values; one-pass softmax keeps no scores). The summary bytes per page follow the
 * kernels of each stage (src/cuda). */
static void cuda_bytes(const bench_opts *o, const cuda_len *c, const std::vector<int32_t> &r1,
                       const std::vector<int32_t> &r2, const std::vector<int64_t> &vrows,
                       const std::vector<int64_t> &srows, cuda_result *r) {
    const int64_t Hk = o->w.kv_heads, D = o->w.dim, es = ekv_dtype_size(o->w.dtype);
    const int listed = o->method != EKV_SELECT_DENSE, cert = o->method == EKV_SELECT_CERTIFIED;
    const int64_t rb = ekv_dtype_size(wl_range_dtype(&o->w)); /* the ranges as stored */
    const int64_t ball = ekv_ball_bytes(&c->st, D); /* centre and radius, as the bound reads them */
    const int64_t per_page = 2 * D * rb + (cert ? ball : o->method == EKV_SELECT_GAUSSIAN ? 4 : 0);
    int64_t ktok = 0, vrow = 0;
    r->round2 = 0;
    for (int64_t l = 0; l < o->w.batch * Hk; l++) {
        const int64_t b = l / Hk, P = c->indptr[b + 1] - c->indptr[b];
        const int64_t pages = listed ? r1[l] + r2[l] : P;
        /* screened reads K of its rows only (src/cuda/screen/screen.cu) */
        ktok += o->method == EKV_SELECT_SCREENED ? srows[l]
                                                 : std::min(pages * o->w.page, c->lens[b]);
        vrow += vrows[l];
        r->round2 += r2[l];
    }
    r->summary = 0;
    const int screened = o->method == EKV_SELECT_SCREENED;
    /* screened: every page's range, and the codes of those its page box did not drop (the
     * candidates and row lists are small) */
    const int64_t page_codes = o->w.page * ((D * o->code_bits + 7) / 8);
    const int64_t screen_page = 2 * D * rb + page_codes;
    if (listed)
        for (int64_t b = 0; b < o->w.batch; b++)
            r->summary += screened ? (c->indptr[b + 1] - c->indptr[b]) * Hk * screen_page
                                   : (c->indptr[b + 1] - c->indptr[b] - 1) * Hk * per_page;
    if (screened) r->summary -= r->screen_dropped * page_codes;
    /* superpages: the summaries the bound skipped, the boxes it read instead, and certified's
     * round 0 (the last 4 pages' K, docs/math.md §9.6) */
    r->summary += r->rep.superpage_boxes * 2 * D * 4 - r->rep.superpage_skipped * per_page;
    if (cert && c->st.smin)
        for (int64_t b = 0; b < o->w.batch; b++)
            ktok += Hk * std::min<int64_t>(4 * o->w.page, c->lens[b]);
    r->kbytes = ktok * D * es;
    r->vbytes = vrow * D * es;
    r->scores = r->rep.softmax_one_pass
                        ? 0
                        : (o->alpha == 1.0 ? 3 : 2) * (ktok * (o->w.heads / Hk)) * 4;
}

/* The plan's report of its last step (support, V rows, the pages of each round) and the bytes
 * it read (cuda_bytes) over c's pages. */
int cuda_read_bytes(ekv_context *ctx, ekv_cuda_plan *plan, const bench_opts *o, const cuda_len *c,
                    cuda_result *r) {
    const int64_t BH = o->w.batch * o->w.heads, BHk = o->w.batch * o->w.kv_heads;
    std::vector<double> tau(BH);
    std::vector<int64_t> sup(BH), vrows(BHk);
    std::vector<int32_t> r1(BHk), r2(BHk);
    std::vector<int64_t> srows(BHk);
    memset(&r->rep, 0, sizeof r->rep);
    r->rep.tau = tau.data();
    r->rep.support = sup.data();
    r->rep.v_rows = vrows.data();
    r->rep.pages_round1 = r1.data();
    r->rep.pages_round2 = r2.data();
    if (ekv_cuda_read_report(plan, (int32_t)o->w.batch, &r->rep) ||
        ekv_cuda_screen_rows(plan, (int32_t)o->w.batch, srows.data()) ||
        ekv_cuda_screen_overflow(plan, (int32_t)o->w.batch, r->screen_over) ||
        ekv_cuda_screen_dropped(plan, (int32_t)o->w.batch, &r->screen_dropped) ||
        ekv_cuda_screen_kernel(plan, &r->screen_kind)) {
        fprintf(stderr, "entmaxkv bench: %s\n", ekv_last_error(ctx));
        return 1;
    }
    r->rep.tau = NULL;
    r->rep.support = NULL;
    r->rep.v_rows = NULL; /* the vectors die here */
    r->rep.pages_round1 = r->rep.pages_round2 = NULL;
    r->sup_mean = 0;
    for (int64_t i = 0; i < BH; i++) r->sup_mean += (double)sup[i] / (double)BH;
    cuda_bytes(o, c, r1, r2, vrows, srows, r);
    return 0;
}

/* bytes_read of a step: K, V, summaries and score traffic (cuda_bytes). */
int64_t cuda_result_bytes(const cuda_result *r) {
    return r->kbytes + r->vbytes + r->summary + r->scores;
}

/* K + V bytes of c's sequences (kv_frac's denominator). */
int64_t kv_bytes(const bench_opts *o, const cuda_len *c) {
    return 2 * c->total_tokens * o->w.kv_heads * o->w.dim * ekv_dtype_size(o->w.dtype);
}

/* The table row of one length, and its JSON object (after json_rows others). */
void cuda_report_row(const bench_opts *o, const cudaDeviceProp &prop, double bw, int json_rows,
                     const cuda_len *c, const cuda_result *r, const cli_out *out) {
    const int64_t Hk = o->w.kv_heads, D = o->w.dim;
    const int64_t bytes = cuda_result_bytes(r);
    const double best = r->g_ms > 0 ? std::min(r->ms, r->g_ms) : r->ms;
    const double gbps = bytes / (best * 1e-3) / 1e9;
    const double roof = best / roofline_ms(bytes, bw);
    const double kvfrac = (double)bytes / (double)kv_bytes(o, c);
    if (o->method == EKV_SELECT_SCREENED)
        fprintf(stderr,
                "entmaxkv bench: len %lld: screen survivors %.3f%% of (token, head) pairs\n",
                (long long)c->len,
                100.0 * (double)r->rep.survivors / (double)(c->total_tokens * o->w.heads));
    if (o->method == EKV_SELECT_SCREENED) {
        static const char *kinds[] = {"generic (CUDA cores)", "fast (CUDA cores)", "tensor cores"};
        fprintf(stderr,
                "entmaxkv bench: len %lld: screen kernel: %s; page box dropped %lld of "
                "%lld (page, KV head) pairs unread\n",
                (long long)c->len,
                r->screen_kind >= 0 && r->screen_kind < 3 ? kinds[r->screen_kind] : "none",
                (long long)r->screen_dropped, (long long)(c->indptr[o->w.batch] * o->w.kv_heads));
    }
    if (o->method == EKV_SELECT_SCREENED && r->screen_over[0])
        fprintf(stderr,
                "entmaxkv bench: len %lld: %lld query heads overflowed the screen lists (retry pass), %lld of them kept every token\n",
                (long long)c->len, (long long)r->screen_over[0], (long long)r->screen_over[1]);
    if (r->rep.slow_rows || r->rep.compacted_rows)
        fprintf(stderr,
                "entmaxkv bench: query heads whose tau candidates overflowed the list: %lld "
                "compacted (rebuilt from the scores above a bound), %lld over the whole row\n",
                (long long)r->rep.compacted_rows, (long long)r->rep.slow_rows);
    fprintf(out->text, "%9lld %9.4f %9.4f %9.4f %13lld %8.0f %9.2f %9.4f %8d %9.1f\n",
            (long long)c->len, r->ms, r->msmin, r->g_ms, (long long)bytes, gbps, roof, kvfrac,
            r->rep.launches, r->sup_mean);
    fflush(out->text);
    if (!out->json) return;
    fprintf(out->json,
            "%s  {\"backend\":\"cuda\",\"device\":\"%s\",\"method\":\"%s\",\"alpha\":%g,\"len\":%lld,\"batch\":%lld,"
            "\"ragged_min\":%lld,\"total_tokens\":%lld,\"heads\":%lld,\"kv_heads\":%lld,\"dim\":%lld,\"page\":%lld,"
            "\"dtype\":\"%s\",\"workload\":\"%s\",\"budget_tokens\":%lld,\"ms_median\":%.5f,\"ms_min\":%.5f,"
            "\"ms_graph_median\":%.5f,\"bytes_read\":%lld,\"bytes_k\":%lld,\"bytes_v\":%lld,"
            "\"bytes_summary\":%lld,\"bytes_scores\":%lld,\"gbps\":%.1f,\"copy_bw_gbps\":%.1f,"
            "\"roofline_ratio\":%.3f,\"kv_fraction\":%.5f,\"launches\":%d,\"support_mean\":%.2f,"
            "\"pages_round2\":%lld,\"lists_round2\":%lld,\"slow_rows\":%lld,\"compacted_rows\":%lld,\"summary_build_ms\":%.3f,\"iters\":%lld,"
            "\"code_bits\":%d,\"survivors\":%lld,\"ranges\":\"%s\",\"tensor_cores\":%d,"
            "\"superpage\":%lld,\"superpage_skipped\":%lld}",
            json_rows ? ",\n" : "", prop.name, ekv_method_name(o->method), o->alpha,
            (long long)c->len, (long long)o->w.batch, (long long)o->ragged_min,
            (long long)c->total_tokens, (long long)o->w.heads, (long long)Hk, (long long)D,
            (long long)o->w.page, ekv_dtype_name(o->w.dtype), o->w.workload, (long long)r->budget,
            r->ms, r->msmin, r->g_ms, (long long)bytes, (long long)r->kbytes, (long long)r->vbytes,
            (long long)r->summary, (long long)r->scores, gbps, bw, roof, kvfrac, r->rep.launches,
            r->sup_mean, (long long)r->round2, (long long)r->rep.lists_round2,
            (long long)r->rep.slow_rows, (long long)r->rep.compacted_rows, r->build_ms,
            (long long)r->iters, cli_method_codes(o->method) ? o->code_bits : 0,
            (long long)r->rep.survivors, ekv_dtype_name(wl_range_dtype(&o->w)), o->tensor_cores,
            (long long)o->superpage, (long long)r->rep.superpage_skipped);
}
