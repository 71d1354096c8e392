/* libFuzzer target for the model loader: ekv_safetensors_parse, then
 * ekv_model_from_safetensors (config metadata, tensor names, dtypes, shapes, finiteness),
 * and for a model that loads, one two-token step (a block: prefill through every layer).
 * Seeds: the safetensors files in tests/data. Build with -DEKV_BUILD_FUZZ=ON (clang). */
#include "entmaxkv.h"
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static ekv_context *ctx;
    if (!ctx) {
        ekv_context_params cp = ekv_context_default_params();
        cp.n_threads = 1;
        if (ekv_context_create(&cp, &ctx)) __builtin_trap();
    }
    ekv_safetensors *st = NULL;
    if (ekv_safetensors_parse(ctx, data, (int64_t)size, &st) != EKV_OK) return 0;
    ekv_model_params mp = ekv_model_default_params();
    mp.max_tokens = 8;
    ekv_model *m = NULL;
    ekv_status s = ekv_model_from_safetensors(ctx, st, &mp, &m);
    ekv_safetensors_free(st); /* the model keeps copies of the weights */
    if (s == EKV_OK) {
        const ekv_model_config *c = ekv_model_get_config(m);
        float *logits = malloc(sizeof(float) * 2 * (size_t)c->vocab);
        int32_t tok[2] = {0, c->vocab - 1};
        if (!logits) __builtin_trap();
        s = ekv_model_step(m, tok, 2, logits);
        if (s != EKV_OK && !ekv_last_error(ctx)[0]) __builtin_trap(); /* a failure says why */
        free(logits);
        ekv_model_free(m);
    } else if (!ekv_last_error(ctx)[0]) {
        __builtin_trap();
    }
    return 0;
}
