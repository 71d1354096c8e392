/*
 * The NCCL transport of the sharded plan (comm.cuh): one process drives every GPU, so the
 * communicators come from one ncclCommInitAll at plan creation, and an allreduce is one
 * ncclAllReduce per shard inside a group (in place, fp64, on each shard's stream). NCCL
 * enqueues without host synchronisation and supports CUDA graph capture; what capture of a
 * multi-device step needs is left to the caller (docs/architecture.md). Without -DEKV_NCCL=ON
 * the transport says the build has none.
 */
#include "comm.cuh"
#include "../common/launch.cuh"
#include <stdlib.h>
#ifdef EKV_NCCL
#include <nccl.h>
#endif

#ifdef EKV_NCCL
namespace {

struct nccl_impl {
    ncclComm_t comm[EKV_COMM_MAX_SHARDS];
};

ekv_status nccl_allreduce(ekv_comm *c, double *const *bufs, int64_t n, ekv_comm_op op,
                          const cudaStream_t *streams) {
    nccl_impl *im = (nccl_impl *)c->impl;
    ncclResult_t r = ncclGroupStart();
    for (int j = 0; j < c->S && r == ncclSuccess; j++)
        r = ncclAllReduce(bufs[j], bufs[j], (size_t)n, ncclFloat64,
                          op == EKV_COMM_SUM ? ncclSum : ncclMax, im->comm[j], streams[j]);
    const ncclResult_t r2 = ncclGroupEnd();
    if (r == ncclSuccess) r = r2;
    if (r != ncclSuccess)
        return ekv_fail(c->ctx, EKV_ERR_DEVICE, "ncclAllReduce: %s", ncclGetErrorString(r));
    return EKV_OK;
}

void nccl_destroy(ekv_comm *c) {
    nccl_impl *im = (nccl_impl *)c->impl;
    if (im)
        for (int j = 0; j < c->S; j++)
            if (im->comm[j]) ncclCommDestroy(im->comm[j]);
    free(im);
    free(c);
}

} // namespace
#endif

ekv_status ekv_comm_create_nccl(ekv_context *ctx, int S, const int32_t *devices, ekv_comm **out) {
#ifdef EKV_NCCL
    ekv_comm *c = (ekv_comm *)calloc(1, sizeof *c);
    nccl_impl *im = (nccl_impl *)calloc(1, sizeof *im);
    if (!c || !im) {
        free(c);
        free(im);
        return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    }
    int dev[EKV_COMM_MAX_SHARDS];
    for (int j = 0; j < S; j++) dev[j] = devices[j];
    const ncclResult_t r = ncclCommInitAll(im->comm, S, dev);
    if (r != ncclSuccess) {
        free(im);
        free(c);
        return ekv_fail(ctx, EKV_ERR_DEVICE, "ncclCommInitAll over %d devices: %s", S,
                        ncclGetErrorString(r));
    }
    c->ctx = ctx;
    c->S = S;
    c->impl = im;
    c->allreduce = nccl_allreduce;
    c->destroy = nccl_destroy;
    *out = c;
    return EKV_OK;
#else
    (void)S;
    (void)devices;
    (void)out;
    return ekv_fail(ctx, EKV_ERR_UNSUPPORTED,
                    "the NCCL transport needs a build with -DEKV_NCCL=ON (NCCL was not built in)");
#endif
}
