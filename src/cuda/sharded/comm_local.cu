/*
 * The local transport of the sharded plan (comm.cuh): every shard's buffer on one device, and
 * one stream for all shards, so an allreduce is one kernel that reduces element i over the S
 * buffers (in shard order, as a ring would not, but the sum of doubles of a few shards) and
 * writes it back to every buffer.
 */
#include "comm.cuh"
#include "../common/launch.cuh"
#include <stdlib.h>

namespace {

struct local_args {
    double *b[EKV_COMM_MAX_SHARDS];
    int S, op;
    int64_t n;
};

__global__ void local_allreduce_kernel(local_args A) {
    ekv_grid_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < A.n;
         i += (int64_t)gridDim.x * blockDim.x) {
        double r = A.b[0][i];
        for (int j = 1; j < A.S; j++) {
            const double v = A.b[j][i];
            r = A.op == EKV_COMM_SUM ? r + v : fmax(r, v);
        }
        for (int j = 0; j < A.S; j++) A.b[j][i] = r;
    }
}

ekv_status local_allreduce(ekv_comm *c, double *const *bufs, int64_t n, ekv_comm_op op,
                           const cudaStream_t *streams) {
    local_args A;
    for (int j = 0; j < c->S; j++) A.b[j] = bufs[j];
    A.S = c->S;
    A.op = op;
    A.n = n;
    const int64_t blocks = (n + 255) / 256;
    local_allreduce_kernel<<<(unsigned)(blocks < 1024 ? blocks : 1024), 256, 0, streams[0]>>>(A);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return ekv_fail(c->ctx, EKV_ERR_DEVICE, "local allreduce: %s", cudaGetErrorString(e));
    return EKV_OK;
}

void local_destroy(ekv_comm *c) { free(c); }

} // namespace

ekv_status ekv_comm_create_local(ekv_context *ctx, int S, ekv_comm **out) {
    ekv_comm *c = (ekv_comm *)calloc(1, sizeof *c);
    if (!c) return ekv_fail(ctx, EKV_ERR_OUT_OF_MEMORY, "out of memory");
    c->ctx = ctx;
    c->S = S;
    c->allreduce = local_allreduce;
    c->destroy = local_destroy;
    *out = c;
    return EKV_OK;
}
