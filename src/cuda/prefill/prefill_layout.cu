/*
 * The dense prefill's scratch (ekv_cuda_prefill, prefill.cuh) laid out once for its two owners:
 * the model engine allocates one device block of the total (src/model/model_gpu.cu), the flash
 * entry carves it from the caller's workspace (flash_entmax.cu). Both point the struct's members
 * into their block with ekv_cuda_prefill_place, so a buffer's size is written here only.
 * Rows are the H * chunk query rows of one block (docs/math.md §12); the sizes are the ones the
 * struct's members document.
 */
#include "prefill.cuh"

ekv_cuda_prefill_layout ekv_cuda_prefill_layout_of(const ekv_cuda_prefill *pf, int64_t H,
                                                   int64_t Hk, int64_t D, ekv_dtype kv) {
    const int64_t rows = H * pf->chunk, np = pf->nparts, es = ekv_dtype_size(kv);
    ws_carver c;
    ekv_cuda_prefill_layout L;
    L.qparts = c.take(np * rows * D * es);
    L.qshift = c.take(2 * rows * 4);
    L.bad = c.take(4);
    /* the path not taken gets no memory: its members stay NULL */
    const int gemm = !pf->fused, fused = pf->fused;
    const int64_t ld = pf->ld_cap, cap = pf->cand_cap;
    L.scores = gemm ? c.take(rows * ld * 4) : -1;
    L.pparts = gemm ? c.take(np * rows * ld * es) : -1;
    L.obuf = gemm ? c.take(rows * D * 4) : -1;
    L.cand = fused ? c.take(rows * cap * 4) : -1;
    L.cidx = fused ? c.take(rows * cap * 8) : -1;
    L.count = fused ? c.take(rows * 4) : -1;
    L.state = fused ? c.take(rows * 4) : -1;
    L.thr = fused ? c.take(rows * 4) : -1;
    L.m = fused ? c.take(rows * 4) : -1;
    L.tau = fused ? c.take(rows * 8) : -1;
    L.off = fused ? c.take(rows * 8) : -1; /* the histogram scheme's list slices */
    L.wlist = fused ? c.take(2 * rows * 4) : -1;
    L.wcount = fused ? c.take(2 * Hk * 4) : -1;
    L.pool_used = fused ? c.take(8) : -1;
    const int64_t mark_bytes =
            Hk * ekv_prefill_row_blocks(rows / Hk) * ekv_prefill_mark_words(pf->key_cap) * 4;
    L.marks = fused && pf->key_cap > 0 ? c.take(mark_bytes) : -1; /* the histogram scheme's */
    L.kbound = fused ? c.take(Hk * 4) : -1;                       /* its ALiBi reach */
    L.qbound = fused ? c.take(rows * 4) : -1;
    L.total = c.at;
    return L;
}

/* base + offset, or NULL for a piece the layout left out. */
template <typename T> static T *piece(void *base, int64_t offset) {
    return offset < 0 ? nullptr : reinterpret_cast<T *>(static_cast<char *>(base) + offset);
}

void ekv_cuda_prefill_place(ekv_cuda_prefill *pf, const ekv_cuda_prefill_layout *L, void *base) {
    pf->qparts = piece<char>(base, L->qparts);
    pf->qshift = piece<float>(base, L->qshift);
    pf->bad = piece<int32_t>(base, L->bad);
    pf->scores = piece<float>(base, L->scores);
    pf->pparts = piece<char>(base, L->pparts);
    pf->obuf = piece<float>(base, L->obuf);
    pf->cand = piece<float>(base, L->cand);
    pf->cidx = piece<int64_t>(base, L->cidx);
    pf->count = piece<int32_t>(base, L->count);
    pf->state = piece<int32_t>(base, L->state);
    pf->thr = piece<float>(base, L->thr);
    pf->m = piece<float>(base, L->m);
    pf->tau = piece<double>(base, L->tau);
    pf->off = piece<int64_t>(base, L->off);
    pf->wlist = piece<int32_t>(base, L->wlist);
    pf->wcount = piece<int32_t>(base, L->wcount);
    pf->pool_used = piece<unsigned long long>(base, L->pool_used);
    pf->marks = piece<uint32_t>(base, L->marks);
    pf->kbound = piece<float>(base, L->kbound);
    pf->qbound = piece<float>(base, L->qbound);
}
