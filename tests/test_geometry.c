/*
 * The step-geometry rules of src/core/geometry.h that only the CUDA backend runs, checked on the
 * CPU: the split-KV count of a sequence (ekv_split_count, docs/architecture.md "CUDA split-KV")
 * over random ragged batches (empty sequences, one dominant sequence, caps that bind): every
 * count in [1, cap]; the batch's counts fit the flat grid (ekv_split_grid: a block past it would
 * never run and its rows would be lost; from base 3 on it is base * batch, the one wave the plan
 * sizes); a uniform batch gets base each; and no split holds more than all / S pages (S the
 * batch's shares, ekv_split_shares) unless the cap binds (a count rounded down broke that).
 */
#include "test_util.h"
#include "core/geometry.h"

static void split_batch(test_rng *r, int64_t base, int64_t batch, int64_t cap, int shape) {
    int64_t pages[64], all = 0;
    for (int64_t b = 0; b < batch; b++) {
        const double u = test_uniform(r);
        pages[b] = shape == 0   ? 1 + (int64_t)(u * 100000)     /* ragged */
                   : shape == 1 ? (b == 0 ? 1 << 20 : (int64_t)(u * 3)) /* one dominant, empties */
                                : 777;                          /* uniform */
        all += pages[b];
    }
    int64_t sum = 0;
    const double share = (double)all / (double)ekv_split_shares(base, batch);
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = ekv_split_count(base, batch, pages[b], all, cap);
        CHECK(n >= 1 && n <= cap, "split count %lld outside [1, %lld]", (long long)n, (long long)cap);
        if (shape == 2 && base <= cap)
            CHECK(n == base, "uniform batch: %lld splits, expected base %lld", (long long)n,
                  (long long)base);
        if (n < cap)
            CHECK((double)pages[b] / (double)n <= share * (1 + 1e-12),
                  "sequence of %lld pages: %lld splits of %.1f pages, above a share's %.1f",
                  (long long)pages[b], (long long)n, (double)pages[b] / (double)n, share);
        sum += n;
    }
    CHECK(sum <= ekv_split_grid(base, batch) &&
                  (base < EKV_SPLIT_ONE_WAVE_MIN || ekv_split_grid(base, batch) == base * batch),
          "base %lld batch %lld: %lld splits, the grid has %lld", (long long)base,
          (long long)batch, (long long)sum, (long long)ekv_split_grid(base, batch));
}

int main(void) {
    test_rng r = {12345u};
    for (int it = 0; it < 20000; it++) {
        const int64_t batch = 1 + (int64_t)(test_uniform(&r) * 64);
        const int64_t base = 1 + (int64_t)(test_uniform(&r) * 264);
        const int64_t cap = it % 3 == 0 ? base : base * (1 + (int64_t)(test_uniform(&r) * 64));
        split_batch(&r, base, batch, cap, it % 3);
    }
    /* the bench's ragged batch: B = 16 from 8192 to 65536 tokens, pages of 16, base 2 */
    int64_t all = 0, worst = 0;
    for (int b = 0; b < 16; b++) all += (8192 + (65536 - 8192) * b / 15) / 16;
    for (int b = 0; b < 16; b++) {
        const int64_t p = (8192 + (65536 - 8192) * b / 15) / 16, n = ekv_split_count(2, 16, p, all, 32);
        worst = (p + n - 1) / n > worst ? (p + n - 1) / n : worst;
    }
    CHECK(worst <= 65536 / 16 / 2, "ragged bench batch: a split of %lld pages, above the equal "
                                   "splits' longest (%d)", (long long)worst, 65536 / 16 / 2);
    return test_finish("test_geometry");
}
