/*
 * Dense decode, every CPU ISA against the long-double reference (src/ref), over a case
 * table that walks every dispatch branch: head dims 64/128/256 plus 72 (odd multiple of
 * 8) and 20 (not a multiple of 8: masked tails), GQA groups 1/2/3/4/8/16, page sizes
 * 1/8/16/64, ragged batches with last_page_len == page_size, the three dtypes,
 * alpha in {1, 1.25, 1.5, 2, 3}, ALiBi on/off, 1 and 3 threads, and a zero query.
 * Also: results do not change when the physical pages are shuffled, and bytes_v counts
 * support rows only.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>

static const int dims[] = {64, 128, 256, 72, 20};
static const int groups[] = {1, 2, 3, 4, 8, 16};
static const int pages[] = {1, 8, 16, 64};
static const ekv_dtype dtypes[] = {EKV_DTYPE_F32, EKV_DTYPE_F16, EKV_DTYPE_BF16};
static const double alphas[] = {1.0, 1.25, 1.5, 2.0, 3.0};
#define COUNT(a) (int)(sizeof a / sizeof a[0])

typedef struct {
    ekv_cache *cache;
    int32_t seqs[4];
    int batch;
    int64_t *indptr;
    int32_t *indices, lpl[4];
    ekv_page_table tab;
    ekv_paged_kv kv;
} built_cache;

/* Builds a cache holding `batch` sequences with the given lengths. If interleave, a filler
 * sequence is appended between chunks so the physical pages come in another order. */
static int build(ekv_context *ctx, built_cache *bc, int batch, const int64_t *lens, int Hk, int D,
                 int ps, ekv_dtype dt, uint64_t seed, int interleave) {
    memset(bc, 0, sizeof *bc);
    ekv_cache_params cp = ekv_cache_default_params();
    cp.page_size = ps;
    cp.num_kv_heads = Hk;
    cp.head_dim = D;
    cp.dtype = dt;
    cp.max_seqs = 8;
    int64_t tot = 0;
    for (int b = 0; b < batch; b++) tot += lens[b];
    cp.num_pages = ekv_cache_pages_for(tot, 1, ps) + batch * 2 + (interleave ? tot / ps + 64 : 0);
    if (ekv_cache_create(ctx, &cp, &bc->cache)) return -1;
    int32_t filler = -1;
    if (interleave) ekv_cache_seq_new(bc->cache, &filler);
    bc->batch = batch;
    for (int b = 0; b < batch; b++) ekv_cache_seq_new(bc->cache, &bc->seqs[b]);
    test_rng rng = {seed};
    int64_t row = (int64_t)Hk * D;
    /* zeroed: the filler sequence appends up to 5 rows, more than a short chunk wrote */
    float *k = calloc((size_t)(row * 97), sizeof(float)),
          *v = calloc((size_t)(row * 97), sizeof(float));
    for (int b = 0; b < batch; b++) {
        test_rng r2 = {seed * 31 + (uint64_t)b + 1};
        for (int64_t pos = 0; pos < lens[b];) {
            int64_t n = test_range(&rng, 1, 97);
            if (n > lens[b] - pos) n = lens[b] - pos;
            for (int64_t i = 0; i < n * row; i++) {
                k[i] = (float)test_normal(&r2);
                v[i] = (float)test_normal(&r2);
            }
            if (ekv_cache_append(bc->cache, bc->seqs[b], n, k, v, EKV_DTYPE_F32)) return -1;
            if (interleave && ekv_cache_append(bc->cache, filler, 1 + n % 5, k, v, EKV_DTYPE_F32))
                return -1;
            pos += n;
        }
    }
    free(k);
    free(v);
    int64_t need;
    ekv_cache_page_table(bc->cache, bc->seqs, batch, NULL, NULL, 0, NULL, &need);
    bc->indptr = malloc(sizeof(int64_t) * (size_t)(batch + 1));
    bc->indices = malloc(sizeof(int32_t) * (size_t)need);
    if (ekv_cache_page_table(bc->cache, bc->seqs, batch, bc->indptr, bc->indices, need, bc->lpl,
                             NULL))
        return -1;
    bc->tab = (ekv_page_table){batch, bc->indptr, bc->indices, bc->lpl};
    ekv_cache_kv_view(bc->cache, &bc->kv, NULL);
    return 0;
}

static void release(built_cache *bc) {
    ekv_cache_free(bc->cache);
    free(bc->indptr);
    free(bc->indices);
}

int main(void) {
    ekv_isa best = ekv_cpu_best_isa();
    int ncases = 0, nisa = 0;
    for (int isa = EKV_ISA_SCALAR; isa <= (int)best; isa++) {
        nisa++;
        for (int threads = 1; threads <= 3; threads += 2) {
            ekv_context_params pp = ekv_context_default_params();
            pp.isa = (ekv_isa)isa;
            pp.n_threads = threads;
            ekv_context *ctx, *rctx;
            if (ekv_context_create(&pp, &ctx) || ekv_context_create(NULL, &rctx)) return 1;
            const int ncase = threads == 1 ? 150 : 40;
            for (int c = 0; c < ncase; c++) {
                /* co-prime periods so every value of every axis is visited in many pairings */
                const int D = dims[c % COUNT(dims)], G = groups[(c / 2) % COUNT(groups)];
                const int ps = pages[(c / 3) % COUNT(pages)];
                const ekv_dtype dt = dtypes[(c / 5) % COUNT(dtypes)];
                const double alpha = alphas[(c / 7) % COUNT(alphas)];
                const int alibi = (c / 11) % 2, zero_q = c % 37 == 5;
                const int Hk = 1 + c % 3, H = Hk * G;
                test_rng rng = {(uint64_t)(c + 1) * 0x9e3779b97f4a7c15ull};
                int batch = 1 + (int)(test_next(&rng) % 3);
                int64_t lens[3];
                for (int b = 0; b < batch; b++) {
                    lens[b] = test_range(&rng, 1, 700);
                    if (b == 1)
                        lens[b] = ps * test_range(&rng, 1,
                                                  700 / ps > 1 ? 700 / ps : 1); /* full last page */
                }
                built_cache bc;
                CHECK(build(ctx, &bc, batch, lens, Hk, D, ps, dt, (uint64_t)c + 7, 0) == 0,
                      "build failed: %s", ekv_last_error(ctx));
                int64_t nq = (int64_t)batch * H * D;
                float *q = malloc(sizeof(float) * (size_t)nq),
                      *o = malloc(sizeof(float) * (size_t)nq),
                      *or_ = malloc(sizeof(float) * (size_t)nq), slopes[256];
                double qs = (c % 4 == 0) ? 4.0 : 1.0; /* sharper distributions too */
                for (int64_t i = 0; i < nq; i++)
                    q[i] = zero_q ? 0.f : (float)(qs * test_normal(&rng));
                for (int h = 0; h < H; h++)
                    slopes[h] = h < H / 2
                                        ? (float)pow(2.0, -8.0 * (h + 1) / (H / 2 > 0 ? H / 2 : 1))
                                        : 0.f;
                ekv_decode_params dp = ekv_decode_default_params();
                dp.num_heads = H;
                dp.alpha = alpha;
                dp.alibi_slopes = alibi ? slopes : NULL;
                double *tau = malloc(sizeof(double) * (size_t)(batch * H)),
                       *taur = malloc(sizeof(double) * (size_t)(batch * H));
                int64_t *sup = malloc(sizeof(int64_t) * (size_t)(batch * H)),
                        *supr = malloc(sizeof(int64_t) * (size_t)(batch * H));
                ekv_decode_info info = {.tau = tau, .support = sup},
                                infor = {.tau = taur, .support = supr};
                ekv_status st = ekv_decode_dense(ctx, &dp, &bc.kv, &bc.tab, q, o, &info);
                ekv_status st2 = ekv_decode_dense_ref(rctx, &dp, &bc.kv, &bc.tab, q, or_, &infor);
                CHECK(st == EKV_OK && st2 == EKV_OK, "case %d: status %d/%d: %s", c, st, st2,
                      ekv_last_error(ctx));
                double err = 0, mag = 0;
                for (int64_t i = 0; i < nq; i++) {
                    err = fmax(err, fabs((double)o[i] - (double)or_[i]));
                    mag = fmax(mag, fabs((double)or_[i]));
                }
                CHECK(err <= 2e-4 * (1 + mag),
                      "isa=%s thr=%d case %d (D=%d G=%d Hk=%d ps=%d dt=%s a=%g alibi=%d B=%d): max err %.3g",
                      ekv_isa_name((ekv_isa)isa), threads, c, D, G, Hk, ps, ekv_dtype_name(dt),
                      alpha, alibi, batch, err);
                int64_t maxsup = 0, totlen = 0;
                for (int b = 0; b < batch; b++) totlen += lens[b];
                for (int i = 0; i < batch * H; i++) {
                    CHECK(fabs(tau[i] - taur[i]) <= 1e-4 * (1 + fabs(taur[i])),
                          "case %d head %d: tau %.9g ref %.9g", c, i, tau[i], taur[i]);
                    CHECK(llabs(sup[i] - supr[i]) <= 2, "case %d head %d: support %lld ref %lld", c,
                          i, (long long)sup[i], (long long)supr[i]);
                    if (sup[i] > maxsup) maxsup = sup[i];
                }
                int64_t es = ekv_dtype_size(dt), allv = totlen * Hk * D * es;
                CHECK(info.bytes_k == allv, "case %d: bytes_k %lld expected %lld", c,
                      (long long)info.bytes_k, (long long)allv);
                if (alpha == 1.0)
                    CHECK(info.bytes_v == allv, "case %d: softmax bytes_v %lld != %lld", c,
                          (long long)info.bytes_v, (long long)allv);
                else
                    CHECK(info.bytes_v <= allv && info.bytes_v >= maxsup * D * es,
                          "case %d: bytes_v %lld out of range", c, (long long)info.bytes_v);
                /* page shuffle invariance: same data, physical pages interleaved with a filler */
                if (c % 5 == 0) {
                    built_cache bs;
                    CHECK(build(ctx, &bs, batch, lens, Hk, D, ps, dt, (uint64_t)c + 7, 1) == 0,
                          "build2");
                    float *o2 = malloc(sizeof(float) * (size_t)nq);
                    CHECK(ekv_decode_dense(ctx, &dp, &bs.kv, &bs.tab, q, o2, NULL) == EKV_OK,
                          "shuffled decode");
                    CHECK(memcmp(o, o2, sizeof(float) * (size_t)nq) == 0,
                          "case %d: output changed when pages were shuffled", c);
                    int differs = 0;
                    for (int64_t i = 0; i < bs.indptr[batch] && !differs; i++)
                        differs = bs.indices[i] != bc.indices[i];
                    CHECK(differs, "case %d: the shuffled build did not move pages", c);
                    free(o2);
                    release(&bs);
                }
                free(q);
                free(o);
                free(or_);
                free(tau);
                free(taur);
                free(sup);
                free(supr);
                release(&bc);
                ncases++;
            }
            ekv_context_free(ctx);
            ekv_context_free(rctx);
        }
    }
    printf("decode cases: %d over %d ISA(s)\n", ncases, nisa);
    return test_finish("test_decode");
}
