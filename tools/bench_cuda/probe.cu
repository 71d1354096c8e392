/*
 * bench --backend cuda, the bandwidth probe (bench_cuda.cu): the device-to-device copy bandwidth
 * measured in the same process (read + write: 2 x bytes copied / time), and the byte roofline
 * it gives a step.
 */
#include "bench_cuda.cuh"

double copy_bandwidth(void) {
    const size_t n = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    if (cudaMalloc(&a, n) != cudaSuccess || cudaMalloc(&b, n) != cudaSuccess) {
        cudaFree(a);
        return 0;
    }
    cudaMemset(a, 1, n);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    std::vector<double> ts;
    for (int i = 0; i < 13; i++) {
        cudaEventRecord(e0);
        cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        if (i >= 3) ts.push_back(ms);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return 2.0 * (double)n / (median(ts) * 1e-3) / 1e9; /* GB/s, read + write */
}

/* The byte roofline: the ms of reading `bytes` at the copy bandwidth bw (GB/s). */
double roofline_ms(int64_t bytes, double bw) { return (double)bytes / (bw * 1e9) * 1e3; }
