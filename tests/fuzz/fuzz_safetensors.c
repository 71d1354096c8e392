/* libFuzzer target for the safetensors reader: build with -DEKV_BUILD_FUZZ=ON (clang), run
 * build/tests/fuzz_safetensors -max_total_time=60. Any crash or sanitizer report is a bug. */
#include "entmaxkv.h"
#include <stddef.h>
#include <stdint.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ekv_safetensors *st = NULL;
    if (ekv_safetensors_parse(NULL, data, (int64_t)size, &st) == EKV_OK) {
        for (int64_t i = 0; i < ekv_safetensors_count(st); i++) {
            ekv_tensor_info t;
            ekv_safetensors_at(st, i, &t);
            volatile uint8_t acc = 0;
            for (int64_t k = 0; k < t.nbytes; k++) acc ^= ((const uint8_t *)t.data)[k];
            (void)acc;
        }
        for (int64_t i = 0; i < ekv_safetensors_metadata_count(st); i++) {
            const char *k, *v;
            ekv_safetensors_metadata_at(st, i, &k, &v);
            /* keys are unique, so a lookup finds this very pair */
            if (ekv_safetensors_metadata(st, k) != v) __builtin_trap();
            volatile size_t n = strlen(k) + strlen(v);
            (void)n;
        }
        ekv_safetensors_free(st);
    }
    return 0;
}
