/*
 * The collectives of the sharded CUDA plan (docs/architecture.md, "The sharded CUDA plan"):
 * in-place allreduces (sum or max) of doubles, one buffer per shard on that shard's device,
 * enqueued on the shards' streams with no host synchronisation (capturable where the transport
 * is). Two transports behind this one interface:
 *   local: every shard on one device and one stream; a kernel reduces the S buffers and writes
 *          the result back to each (comm_local.cu). It makes the whole sharded path testable
 *          on one GPU.
 *   nccl:  one communicator per device, created once (ncclCommInitAll: one process drives every
 *          GPU), ncclAllReduce in a group (comm_nccl.cu; built with -DEKV_NCCL=ON).
 * Each call counts its payload (bytes one shard sends) so the plan can report a step's traffic.
 */
#pragma once
#include "entmaxkv.h"
#include <cuda_runtime.h>
#include <stdint.h>

enum ekv_comm_op { EKV_COMM_SUM = 0, EKV_COMM_MAX = 1 };
enum { EKV_COMM_MAX_SHARDS = 64 };

struct ekv_comm {
    ekv_context *ctx;
    int S;
    /* bufs[j]: n doubles on shard j's device, reduced in place on streams[j] */
    ekv_status (*allreduce)(ekv_comm *c, double *const *bufs, int64_t n, ekv_comm_op op,
                            const cudaStream_t *streams);
    void (*destroy)(ekv_comm *c);
    void *impl;
    int32_t calls; /* since the plan last reset them: allreduce calls ...     */
    int64_t bytes; /* ... and the payload bytes one shard sent                */
};

/* local: S shards on the current device */
ekv_status ekv_comm_create_local(ekv_context *ctx, int S, ekv_comm **out);
/* nccl: shard j on devices[j]; EKV_ERR_UNSUPPORTED in a build without -DEKV_NCCL=ON */
ekv_status ekv_comm_create_nccl(ekv_context *ctx, int S, const int32_t *devices, ekv_comm **out);

static inline ekv_status ekv_comm_allreduce(ekv_comm *c, double *const *bufs, int64_t n,
                                            ekv_comm_op op, const cudaStream_t *streams) {
    c->calls++;
    c->bytes += n * (int64_t)sizeof(double);
    return c->allreduce(c, bufs, n, op, streams);
}
static inline void ekv_comm_free(ekv_comm *c) {
    if (c) c->destroy(c);
}
