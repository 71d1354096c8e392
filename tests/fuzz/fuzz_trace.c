/* libFuzzer target for the trace workload opener (tools/workload.c wl_open with a trace:
 * spec): the safetensors reader plus the trace's name, dtype and shape checks, as
 * `eval`/`bench --workload trace:FILE[@PREFIX]` run them on a user's file. The input goes to a
 * temporary file because the opener takes a path; byte 0 picks the prefix ("" or "l0.", the names
 * `entmaxkv trace` writes). Build with -DEKV_BUILD_FUZZ=ON (clang). */
#include "cli.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char path[64];
    static ekv_context *ctx;
    if (!ctx) {
        ekv_context_params cp = ekv_context_default_params();
        cp.n_threads = 1;
        if (ekv_context_create(&cp, &ctx)) __builtin_trap();
        /* wl_open explains every refusal on stderr: drop those lines (sanitizer reports
         * write to file descriptor 2 directly and still come through) */
        stderr = fopen("/dev/null", "w");
        if (!stderr) __builtin_trap();
        /* tmpfs where there is one: a disk file costs 50x the parse */
        snprintf(path, sizeof path, "%s/ekv_fuzz_trace_%ld.safetensors",
                 access("/dev/shm", W_OK) ? "/tmp" : "/dev/shm", (long)getpid());
    }
    if (size < 1) return 0;
    FILE *f = fopen(path, "wb");
    if (!f) __builtin_trap();
    if (fwrite(data + 1, 1, size - 1, f) != size - 1) __builtin_trap();
    fclose(f);
    char spec[128];
    snprintf(spec, sizeof spec, "trace:%s%s", path, data[0] & 1 ? "@l0." : "");
    wl_state w;
    if (wl_open(&w, ctx, spec, 0, 0, 0, 1, "fuzz") == 0) {
        /* the opener's promises: shapes consistent with each other, data inside the file */
        if (w.kind != WL_TRACE || w.heads % w.kv_heads || w.trace_len < 1 || w.trace_steps < 1)
            __builtin_trap();
        volatile uint8_t acc = 0;
        const ekv_tensor_info *t[3] = {&w.tq, &w.tk, &w.tv};
        for (int i = 0; i < 3; i++)
            for (int64_t k = 0; k < t[i]->nbytes; k++) acc ^= ((const uint8_t *)t[i]->data)[k];
        if (w.has_slopes)
            for (int64_t h = 0; h < w.heads; h++) acc ^= (uint8_t)(w.slopes[h] > 0);
        (void)acc;
    }
    wl_free(&w);
    return 0;
}
