/*
 * The report of a plan's last step (ekv_cuda_read_report, include/entmaxkv/cuda.h): tau,
 * support, the page lists and their head masks, the slow rows, the screen's survivors, the
 * launches and the superpages skipped, read back after the plan's stream.
 */
#include "../common/launch.cuh"
#include "../common/plan.cuh"
#include <stdlib.h>

/* The report's head masks: the device's when the last step masked heads to their own lists,
 * else every head of the group. */
static ekv_status read_list_heads(ekv_cuda_plan *pl, int64_t nl, uint16_t *heads) {
    if (!heads) return EKV_OK;
    const int64_t n = nl * pl->cap_pages;
    if (pl->last_masked) {
        EKV_CUDA_TRY(pl, cudaMemcpy(heads, pl->list_heads, (size_t)n * sizeof(uint16_t),
                                    cudaMemcpyDeviceToHost));
        return EKV_OK;
    }
    const uint16_t all = (uint16_t)((1u << (pl->p.num_heads / pl->p.num_kv_heads)) - 1u);
    for (int64_t i = 0; i < n; i++) heads[i] = all;
    return EKV_OK;
}

extern "C" ekv_status ekv_cuda_read_report(ekv_cuda_plan *pl, int32_t batch, ekv_cuda_report *r) {
    const ekv_status cs = ekv_cuda_check_readout(pl, r, "report", batch);
    if (cs) return cs;
    EKV_CUDA_TRY(pl, cudaStreamSynchronize(pl->stream));
    const int64_t nh = (int64_t)batch * pl->p.num_heads, nl = (int64_t)batch * pl->p.num_kv_heads;
    if (r->tau)
        EKV_CUDA_TRY(pl, cudaMemcpy(r->tau, pl->tau, (size_t)nh * sizeof(double),
                                    cudaMemcpyDeviceToHost));
    if (r->support)
        EKV_CUDA_TRY(pl, cudaMemcpy(r->support, pl->support, (size_t)nh * sizeof(int64_t),
                                    cudaMemcpyDeviceToHost));
    if (r->v_rows)
        EKV_CUDA_TRY(pl, cudaMemcpy(r->v_rows, pl->v_rows, (size_t)nl * sizeof(int64_t),
                                    cudaMemcpyDeviceToHost));
    int32_t *cnt = (int32_t *)malloc((size_t)nl * 2 * sizeof(int32_t));
    if (!cnt) return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    cudaError_t e = cudaMemcpy(cnt, pl->list_count, (size_t)nl * 2 * sizeof(int32_t),
                               cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        free(cnt);
        return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "cudaMemcpy: %s", cudaGetErrorString(e));
    }
    if (r->list_pages) {
        e = cudaMemcpy(r->list_pages, pl->list_pages,
                       (size_t)(nl * pl->cap_pages) * sizeof(int32_t), cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) {
            free(cnt);
            return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "cudaMemcpy: %s", cudaGetErrorString(e));
        }
    }
    r->slow_rows = 0;
    r->compacted_rows = 0;
    {
        int32_t *fl = (int32_t *)malloc((size_t)nh * sizeof(int32_t));
        if (!fl) {
            free(cnt);
            return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
        }
        e = cudaMemcpy(fl, pl->flags, (size_t)nh * sizeof(int32_t), cudaMemcpyDeviceToHost);
        /* on the plan's stream: the next step's kernels (which may set flags) come after it */
        if (e == cudaSuccess)
            e = cudaMemsetAsync(pl->flags, 0, (size_t)nh * sizeof(int32_t), pl->stream);
        if (e != cudaSuccess) {
            free(fl);
            free(cnt);
            return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "cudaMemcpy: %s", cudaGetErrorString(e));
        }
        for (int64_t i = 0; i < nh; i++) {
            r->slow_rows += (fl[i] & EKV_TAU_FLAG_WHOLE_ROW) != 0;
            r->compacted_rows += (fl[i] & EKV_TAU_FLAG_COMPACTED) != 0;
        }
        free(fl);
    }
    r->lists_round2 = 0;
    for (int64_t l = 0; l < nl; l++) {
        if (r->pages_round1) r->pages_round1[l] = cnt[2 * l];
        if (r->pages_round2) r->pages_round2[l] = cnt[2 * l + 1] - cnt[2 * l];
        r->lists_round2 += cnt[2 * l + 1] > cnt[2 * l];
    }
    free(cnt);
    r->survivors = 0;
    if (pl->last_screened) {
        int64_t *sv = (int64_t *)malloc((size_t)nl * sizeof(int64_t));
        if (!sv) return ekv_fail(pl->ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
        e = cudaMemcpy(sv, pl->survivors, (size_t)nl * sizeof(int64_t), cudaMemcpyDeviceToHost);
        for (int64_t l = 0; e == cudaSuccess && l < nl; l++) r->survivors += sv[l];
        free(sv);
        if (e != cudaSuccess)
            return ekv_fail(pl->ctx, EKV_ERR_DEVICE, "cudaMemcpy: %s", cudaGetErrorString(e));
    }
    r->launches = pl->launches;
    r->softmax_one_pass = pl->last_one_pass;
    r->score_splits = pl->last_score_splits;
    r->superpage_skipped = r->superpage_boxes = 0;
    if (pl->last_sp_counted) {
        unsigned long long sc[2];
        EKV_CUDA_TRY(pl, cudaMemcpy(sc, pl->sp_count, sizeof sc, cudaMemcpyDeviceToHost));
        r->superpage_skipped = (int64_t)sc[0];
        r->superpage_boxes = (int64_t)sc[1];
    }
    return read_list_heads(pl, nl, r->list_heads);
}
