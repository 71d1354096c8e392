/* bench --backend cuda in a build without the CUDA backend. */
#include "cli.h"

int cli_bench_cuda(const bench_opts *o) {
    (void)o;
    fprintf(stderr,
            "entmaxkv bench: --backend cuda: this build has no CUDA backend (configure with -DEKV_CUDA=ON)\n");
    return CLI_USAGE;
}
