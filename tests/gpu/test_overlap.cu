/*
 * Overlapped launches themselves (src/cuda/common/overlap.cuh; docs/architecture.md,
 * "Overlapped launches"), deterministically: a writer kernel spins ~200 us, then writes a marker;
 * a reader launched right after it reads the marker after its ekv_grid_begin. With overlap the
 * reader's block must start before the writer ends (the launch really overlapped: its start time,
 * taken before the wait, is earlier than the writer's end) and must still read the new marker
 * (the wait held); without overlap it starts after the writer's end. Eagerly and from a captured
 * graph, with a new marker each round. Skipped (77) without a device of compute capability 9.0.
 */
#include "cuda/common/overlap.cuh"
#include "test_util.h" /* CHECK, test_finish */
#include <stdint.h>
#include <stdio.h>

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

struct probe {
    unsigned long long writer_end, reader_start;
    int marker, seen;
};

__global__ void writer_kernel(probe *p, int value, unsigned long long spin_ns) {
    ekv_grid_begin();
    const unsigned long long t0 = now_ns();
    while (now_ns() - t0 < spin_ns) {}
    p->marker = value;
    __threadfence();
    p->writer_end = now_ns();
}

__global__ void reader_kernel(probe *p) {
    const unsigned long long start = ekv_grid_begin_with([] { return now_ns(); });
    p->reader_start = start;
    p->seen = p->marker;
}

/* One writer-reader pair on s with the given overlap; the launches' errors checked. */
static void launch_pair(cudaStream_t s, int overlap, probe *p, int value) {
    const ekv_launch_stream on = {s, overlap};
    const cudaError_t w = ekv_launch(on, writer_kernel, 1, 32, 0, p, value, 200000ull);
    const cudaError_t r = ekv_launch(on, reader_kernel, 1, 32, 0, p);
    CHECK(w == cudaSuccess && r == cudaSuccess, "launch (overlap %d): %s / %s", overlap,
          cudaGetErrorString(w), cudaGetErrorString(r));
}

static void check_round(const probe &h, int value, int overlap, const char *how) {
    CHECK(h.seen == value, "%s, overlap %d: the reader saw %d, not the writer's %d", how, overlap,
          h.seen, value);
    if (overlap)
        CHECK(h.reader_start < h.writer_end,
              "%s: the reader started %lld ns after the writer ended: not overlapped", how,
              (long long)(h.reader_start - h.writer_end));
    else
        CHECK(h.reader_start >= h.writer_end,
              "%s, plain: the reader started %lld ns before the writer ended", how,
              (long long)(h.writer_end - h.reader_start));
}

static void run(cudaStream_t s, int overlap, int graph, probe *d, int *value) {
    const char *how = graph ? "graph" : "eager";
    cudaGraphExec_t exec = NULL;
    if (graph) {
        cudaGraph_t g;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess, "capture");
        launch_pair(s, overlap, d, 0); /* the marker is a kernel argument: rounds write 0 */
        CHECK(cudaStreamEndCapture(s, &g) == cudaSuccess, "end capture: %s",
              cudaGetErrorString(cudaGetLastError()));
        CHECK(cudaGraphInstantiate(&exec, g, 0) == cudaSuccess, "graph instantiate");
        cudaGraphDestroy(g);
    }
    for (int round = 0; round < 8; round++) {
        const int v = graph ? 0 : ++*value;
        cudaMemsetAsync(d, 0xff, sizeof *d, s); /* junk: a reader before the writer sees -1 */
        if (graph)
            cudaGraphLaunch(exec, s);
        else
            launch_pair(s, overlap, d, v);
        probe h;
        CHECK(cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, s) == cudaSuccess &&
                      cudaStreamSynchronize(s) == cudaSuccess,
              "%s round %d: %s", how, round, cudaGetErrorString(cudaGetLastError()));
        check_round(h, v, overlap, how);
    }
    if (exec) cudaGraphExecDestroy(exec);
}

int main(void) {
    int n = 0, major = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0 ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
        major < 9) {
        printf("test_overlap: no device of compute capability 9.0 or later, skipped\n");
        return 77;
    }
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    probe *d = NULL;
    cudaMalloc(&d, sizeof *d);
    int value = 0;
    for (int graph = 0; graph < 2; graph++)
        for (int overlap = 0; overlap < 2; overlap++) run(s, overlap, graph, d, &value);
    cudaFree(d);
    cudaStreamDestroy(s);
    return test_finish("test_overlap");
}
