/*
 * Context-parallel decode simulated on the CPU (ekv_decode_sharded_sim, docs/math.md §11): for
 * 1 to 8 shards, every alpha path (softmax, 1.25, the closed forms 1.5 and 2, 3), f32/f16,
 * GQA, ALiBi, ragged batches with one-token sequences, and adversarial scores (planted support,
 * every key equal (a flat row, the whole sequence in the support), one dominant key, ties at
 * tau): the output equals dense entmax (<= 1e-5 relative), tau to 1e-9 and the support exactly;
 * the rounds the collectives need are counted (closed forms: few), and bad arguments refused.
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>

static double rel_err(const float *a, const float *b, int64_t n) {
    double e = 0, nb = 0;
    for (int64_t i = 0; i < n; i++) {
        e += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        nb += (double)b[i] * b[i];
    }
    return sqrt(e) / (sqrt(nb) + 1e-12);
}

/* keys by kind: 0 random, 1 a planted direction in 2 % of tokens, 2 every key equal, 3 one
 * dominant key, 4 duplicated pairs (ties at tau) */
static void make_keys(test_rng *r, int kind, float *k, int64_t n, int Hk, int D, const float *dir) {
    for (int64_t t = 0; t < n; t++)
        for (int h = 0; h < Hk; h++)
            for (int d = 0; d < D; d++) {
                float x = (float)test_normal(r);
                if (kind == 1 && test_uniform(r) < 0.02) x += 3 * dir[d];
                if (kind == 2) x = dir[d];
                if (kind == 3) x = t == n / 3 ? 6 * dir[d] : 0.1f * x;
                if (kind == 4 && t % 2) x = k[((t - 1) * Hk + h) * D + d];
                k[(t * Hk + h) * D + d] = x;
            }
}

int main(void) {
    ekv_context *ctx;
    if (ekv_context_create(NULL, &ctx)) return 1;
    test_rng r = {0x5eed5};
    const double alphas[5] = {1.0, 1.25, 1.5, 2.0, 3.0};
    int rounds_closed = 0, rounds_generic = 0, n_closed = 0, n_generic = 0;
    double mean_closed = 0, mean_generic = 0;
    int64_t bytes_seen = 0;
    for (int c = 0; c < 120; c++) {
        const int Hk = 1 + c % 2, G = 1 + (c / 2) % 3, H = Hk * G, D = 16, ps = c % 4 ? 16 : 3;
        const double alpha = alphas[c % 5];
        const int kind = (c / 5) % 5, alibi = (c / 25) % 2, S = 1 + (c * 7) % 8;
        const ekv_dtype dt = c % 3 ? EKV_DTYPE_F16 : EKV_DTYPE_F32;
        const int64_t lens[3] = {1 + (int64_t)test_range(&r, 0, 700), 1, 97};
        ekv_cache_params cp = ekv_cache_default_params();
        cp.page_size = ps;
        cp.num_kv_heads = Hk;
        cp.head_dim = D;
        cp.dtype = dt;
        cp.num_pages = 800;
        cp.superpage_pages = 0;
        ekv_cache *cache = NULL;
        CHECK(ekv_cache_create(ctx, &cp, &cache) == EKV_OK, "cache: %s", ekv_last_error(ctx));
        float dir[16], slopes[16];
        for (int d = 0; d < D; d++) dir[d] = (float)test_normal(&r);
        for (int h = 0; h < H; h++) slopes[h] = 0.02f * (float)(h + 1);
        int32_t seqs[3];
        for (int b = 0; b < 3; b++) {
            float *k = malloc(sizeof(float) * lens[b] * Hk * D),
                  *v = malloc(sizeof(float) * lens[b] * Hk * D);
            make_keys(&r, kind, k, lens[b], Hk, D, dir);
            for (int64_t i = 0; i < lens[b] * Hk * D; i++) v[i] = (float)test_normal(&r);
            ekv_cache_seq_new(cache, &seqs[b]);
            CHECK(ekv_cache_append(cache, seqs[b], lens[b], k, v, EKV_DTYPE_F32) == EKV_OK,
                  "append: %s", ekv_last_error(ctx));
            free(k);
            free(v);
        }
        ekv_paged_kv kv;
        ekv_cache_kv_view(cache, &kv, NULL);
        int64_t indptr[4], lpl_need;
        int32_t indices[800], lpl[3];
        ekv_cache_page_table(cache, seqs, 3, indptr, indices, 800, lpl, &lpl_need);
        const ekv_page_table tab = {3, indptr, indices, lpl};
        float q[3 * 8 * 16], ref[3 * 8 * 16], out[3 * 8 * 16];
        for (int i = 0; i < 3 * H * D; i++) q[i] = (float)test_normal(&r) * 2;
        ekv_decode_params dp = ekv_decode_default_params();
        dp.num_heads = H;
        dp.alpha = alpha;
        dp.alibi_slopes = alibi ? slopes : NULL;
        double tr[24], ts[24];
        int64_t sr[24], ss[24];
        ekv_decode_info ri = {.tau = tr, .support = sr}, si = {.tau = ts, .support = ss};
        ekv_shard_report rep;
        CHECK(ekv_decode_dense(ctx, &dp, &kv, &tab, q, ref, &ri) == EKV_OK, "dense: %s",
              ekv_last_error(ctx));
        CHECK(ekv_decode_sharded_sim(ctx, &dp, &kv, &tab, q, out, S, &si, &rep) == EKV_OK,
              "sharded: %s", ekv_last_error(ctx));
        const double e = rel_err(out, ref, 3 * H * D);
        CHECK(e <= 1e-5, "case %d (alpha %g, kind %d, %d shards, alibi %d): rel err %.3g", c, alpha,
              kind, S, alibi, e);
        for (int i = 0; i < 3 * H; i++) {
            /* softmax: dense sums its log-sum-exp in fp32 */
            const double tol = alpha == 1.0 ? 1e-6 : 1e-9;
            CHECK(fabs(ts[i] - tr[i]) <= tol * (1 + fabs(tr[i])),
                  "case %d head %d: tau %.17g vs dense %.17g", c, i, ts[i], tr[i]);
            CHECK(ss[i] == sr[i], "case %d head %d: support %lld vs dense %lld", c, i,
                  (long long)ss[i], (long long)sr[i]);
        }
        if (alpha == 1.5 || alpha == 2.0) {
            rounds_closed = rep.rounds_max > rounds_closed ? rep.rounds_max : rounds_closed;
            mean_closed += rep.rounds_mean;
            n_closed++;
        } else if (alpha != 1.0) {
            rounds_generic = rep.rounds_max > rounds_generic ? rep.rounds_max : rounds_generic;
            mean_generic += rep.rounds_mean;
            n_generic++;
        }
        if (alpha == 1.0) CHECK(rep.rounds_max == 3, "softmax: %d rounds", rep.rounds_max);
        CHECK(rep.bytes > 0, "no bytes counted");
        bytes_seen += rep.bytes;
        if (c == 0) { /* refusals */
            CHECK(ekv_decode_sharded_sim(ctx, &dp, &kv, &tab, q, out, 0, NULL, NULL) ==
                          EKV_ERR_INVALID_SIZE,
                  "0 shards accepted");
            CHECK(ekv_decode_sharded_sim(ctx, &dp, &kv, &tab, q, out, 65, NULL, NULL) ==
                          EKV_ERR_INVALID_SIZE,
                  "65 shards accepted");
            CHECK(ekv_decode_sharded_sim(ctx, &dp, &kv, &tab, q, NULL, 2, NULL, NULL) ==
                          EKV_ERR_NULL_POINTER,
                  "a NULL output accepted");
        }
        ekv_cache_free(cache);
    }
    printf("allreduce rounds per head: with the closed forms (alpha 1.5, 2) %.2f on average, %d "
           "at most; alpha 1.25 and 3 (bracketed Newton) %.2f, %d; %lld payload bytes in all\n",
           mean_closed / n_closed, rounds_closed, mean_generic / n_generic, rounds_generic,
           (long long)bytes_seen);
    CHECK(rounds_closed <= 10, "the closed forms took %d rounds", rounds_closed);
    ekv_context_free(ctx);
    return test_finish("test_sharded");
}
