/* ekv_cuda_plan_default_params and ekv_cuda_sharded_default_params, shared by the CUDA build
 * (plan.cu, sharded/sharded.cu) and the stubs of a build without CUDA (cuda_stub.c), so both
 * report the same defaults. */
#ifndef EKV_CUDA_PLAN_DEFAULTS_H
#define EKV_CUDA_PLAN_DEFAULTS_H
#include "entmaxkv.h"
#include <string.h>

static inline ekv_cuda_plan_params ekv_cuda_plan_defaults(void) {
    ekv_cuda_plan_params p;
    memset(&p, 0, sizeof p);
    p.device = 0;
    p.stream = NULL;
    p.max_batch = 1;
    p.num_heads = 32;
    p.num_kv_heads = 8;
    p.head_dim = 128;
    p.page_size = 16;
    p.max_pages_per_seq = 0; /* required: the caller sets it */
    p.max_candidates = 0;    /* EKV_CUDA_CAND_CAP           */
    p.tensor_cores = 1;
    p.screen_list_bytes = 0; /* SCREEN_LIST_BYTES (plan.cu)  */
    p.fused_attend = 0; /* measured slower than the launches it replaces (bench/RESULTS.md) */
    p.overlap_launches = -1; /* where supported: measured faster (bench/RESULTS.md) */
    p.select_part_pages = 0; /* EKV_CUDA_SEL_PART_PAGES (src/cuda/common/sizes.cuh) */
    p.tau_cluster = -1;      /* where supported: measured faster (bench/RESULTS.md) */
    p.tau_spread_min = 0;    /* EKV_CUDA_TAU_SPREAD_MIN (src/cuda/common/sizes.cuh) */
    return p;
}

/* ekv_cuda_sharded_default_params: two shards on the local transport, adaptive rounds */
static inline ekv_cuda_sharded_params ekv_cuda_sharded_defaults(void) {
    ekv_cuda_sharded_params p;
    memset(&p, 0, sizeof p);
    p.plan = ekv_cuda_plan_defaults();
    p.num_shards = 2;
    p.transport = EKV_TRANSPORT_LOCAL;
    p.devices = NULL;
    p.tau_rounds = 0;
    return p;
}
#endif
