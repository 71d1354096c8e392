/*
 * The warpgroup MMA block (src/cuda/common/wgmma.cuh) against the mma.sync path it would replace
 * (tile_scores_q, src/cuda/common/mma.cuh) and a double reference: 64 query rows (4 warps' A
 * fragments by load_q_frags) in 1, 2 or 3 parts (an fp32 q split as the prefill splits it)
 * against a 64-key tile of head dim 64 copied by tile_copy into shared memory on a 1024-byte
 * boundary, then again at the next 1024 bytes (the descriptor's address), bf16 and f16, several
 * draws. Checks per score:
 *   |wgmma - ref| <= 2^-20 sum_d |q_d k_d| + 1e-30 (products of 16-bit values are exact in fp32;
 *   64 of them a part summed in the tensor core's fp32 accumulator: well inside 2^-20 of the
 *   terms; ref: the double sum over the parts' exact values);
 *   |wgmma - mma| within the same (both fp32 sums of the same exact products).
 * Prints how many scores are bitwise equal between the two paths (the accumulation order may
 * differ). Then the rows moved to other warps and lanes: every score keeps its bits. Built for
 * sm_90a only; skipped (77) without a device of compute capability 9.0.
 */
#include "cuda/common/wgmma.cuh"
#include "test_util.h" /* CHECK, test_finish */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { ROWS = 64, KEYS = 64, DIM = 64, THREADS = 128, MAX_PARTS = 3 };

/* Shared memory: the q parts' rows [MAX_PARTS][ROWS][mma_qpitch], then two 1024-aligned key
 * tiles. */
__host__ __device__ constexpr size_t q_bytes() {
    return (size_t)MAX_PARTS * ROWS * mma_qpitch<DIM>() * 2;
}
__host__ __device__ constexpr size_t smem_bytes() {
    return q_bytes() + 1024 + 2 * (size_t)KEYS * DIM * 2;
}

/* The lane's s[n8][i] (tile_z's layout) into out [ROWS][KEYS]. */
__device__ void store_scores(const float (*s)[4], float *out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int n8 = 0; n8 < KEYS / 8; n8++)
        for (int i = 0; i < 4; i++)
            out[(warp * 16 + lane / 4 + 8 * (i >> 1)) * KEYS + n8 * 8 + 2 * (lane & 3) + (i & 1)] =
                    s[n8][i];
}

/* q [NP][ROWS][DIM] (its parts), k [KEYS][DIM] (T) -> by the mma path into mma_out, by wgmma
 * from tile `which` (0: the first 1024-aligned tile, 1: the next) into wg_out. */
template <typename T, int NP>
__global__ void scores_kernel(const T *q, const T *k, int which, float *mma_out, float *wg_out) {
#if defined(EKV_HAVE_WGMMA)
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5;
    T *qs = reinterpret_cast<T *>(smem);
    const uintptr_t at = ((uintptr_t)(smem + q_bytes()) + 1023) & ~(uintptr_t)1023;
    unsigned char *tile = reinterpret_cast<unsigned char *>(at) + (size_t)which * KEYS * DIM * 2;
    for (int i = threadIdx.x; i < NP * ROWS * DIM; i += THREADS)
        qs[(i / DIM) * mma_qpitch<DIM>() + i % DIM] = q[i]; /* part p's rows after p - 1's */
    /* each warp copies its 16 key rows, as the prefill's sweep does */
    tile_copy<T, DIM, false>(tile + warp * 16 * DIM * 2, k, DIM, warp * 16, KEYS);
    /* the other tile NaN: a descriptor pointing there fails the checks */
    unsigned char *other =
            reinterpret_cast<unsigned char *>(at) + (size_t)(1 - which) * KEYS * DIM * 2;
    for (int i = threadIdx.x; i < KEYS * DIM * 2 / 16; i += THREADS)
        reinterpret_cast<uint4 *>(other)[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
    cp_async_commit();
    cp_async_wait<0>();
    wgmma_fence_smem(); /* each writer, before the barrier */
    __syncthreads();
    uint32_t qa[NP][DIM / 16][4];
    load_q_frags<T, DIM, NP>(qs + warp * 16 * mma_qpitch<DIM>(), ROWS * mma_qpitch<DIM>(), qa);
    float s[KEYS / 8][4];
#pragma unroll
    for (int c = 0; c < KEYS / 16; c++)
        tile_scores_q<T, DIM, NP>(tile + c * 16 * DIM * 2, qa, s + 2 * c);
    store_scores(s, mma_out);
    float d[KEYS / 8][4];
    wgmma_tile_scores64<T, NP>(tile, qa, d);
    store_scores(d, wg_out);
#endif
}

/* n values of deviation sd in np parts of T (x_1 = rn(x), x_{p+1} = rn(x - x_1 - .. - x_p), as
 * the prefill splits q'): out [np][n], vals[i] the parts' exact sum. */
template <typename T>
static void draw(uint16_t *out, double *vals, int n, int np, double sd, unsigned *seed) {
    for (int i = 0; i < n; i++) {
        double u1 = (rand_r(seed) + 1.0) / ((double)RAND_MAX + 2.0),
               u2 = rand_r(seed) / (double)RAND_MAX;
        float x = (float)(sd * sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
        vals[i] = 0;
        for (int p = 0; p < np; p++) {
            const T h = T(x); /* rounded to nearest, as the device's conversions */
            memcpy(out + (size_t)p * n + i, &h, 2);
            vals[i] += (double)(float)h;
            x -= (float)h; /* exact: removes x's leading bits */
        }
    }
}

/* The kernel on q's NP parts hq (host), d* device buffers; the two paths' scores into hm, hw. */
template <typename T, int NP>
static cudaError_t scores(const uint16_t *hq, T *dq, const T *dk, int which, float *dm, float *dw,
                          float *hm, float *hw) {
    cudaMemcpy(dq, hq, (size_t)NP * ROWS * DIM * 2, cudaMemcpyHostToDevice);
    cudaMemset(dw, 0xFF, ROWS * KEYS * 4); /* NaN where the kernel writes nothing */
    cudaMemset(dm, 0xFF, ROWS * KEYS * 4);
    cudaFuncSetAttribute(scores_kernel<T, NP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         (int)smem_bytes());
    scores_kernel<T, NP><<<1, THREADS, smem_bytes()>>>(dq, dk, which, dm, dw);
    const cudaError_t e = cudaDeviceSynchronize();
    cudaMemcpy(hm, dm, ROWS * KEYS * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(hw, dw, ROWS * KEYS * 4, cudaMemcpyDeviceToHost);
    return e;
}

/* Every score against the reference and the mma path; prints the bitwise agreement. */
static void check_scores(const char *name, const double *fq, const double *fk, const float *hm,
                         const float *hw) {
    int same = 0;
    double worst = 0;
    for (int r = 0; r < ROWS; r++)
        for (int t = 0; t < KEYS; t++) {
            double ref = 0, mag = 0;
            for (int d = 0; d < DIM; d++) {
                ref += fq[r * DIM + d] * fk[t * DIM + d];
                mag += fabs(fq[r * DIM + d] * fk[t * DIM + d]);
            }
            const double tol = ldexp(mag, -20) + 1e-30, w = hw[r * KEYS + t], m = hm[r * KEYS + t];
            CHECK(fabs(w - ref) <= tol, "%s: row %d key %d: wgmma %.9g, reference %.9g (tol %.3g)",
                  name, r, t, w, ref, tol);
            CHECK(fabs(w - m) <= tol, "%s: row %d key %d: wgmma %.9g, mma %.9g", name, r, t, w, m);
            same += w == m;
            worst = fmax(worst, fabs(w - ref) / (mag + 1e-30));
        }
    printf("%s: %d of %d scores bitwise the mma path's; worst |wgmma - ref| / sum|q k| %.3g\n",
           name, same, ROWS * KEYS, worst);
}

template <typename T, int NP> static void run_case(unsigned seed, int which, const char *name) {
    static uint16_t hq[MAX_PARTS * ROWS * DIM], hq2[MAX_PARTS * ROWS * DIM], hk[KEYS * DIM];
    static double fq[ROWS * DIM], fk[KEYS * DIM];
    static float hm[ROWS * KEYS], hw[ROWS * KEYS], hw2[ROWS * KEYS];
    draw<T>(hq, fq, ROWS * DIM, NP, 3.0, &seed);
    draw<T>(hk, fk, KEYS * DIM, 1, 1.0, &seed);
    T *dq, *dk;
    float *dm, *dw;
    cudaMalloc(&dq, sizeof hq);
    cudaMalloc(&dk, sizeof hk);
    cudaMalloc(&dm, ROWS * KEYS * 4);
    cudaMalloc(&dw, ROWS * KEYS * 4);
    cudaMemcpy(dk, hk, sizeof hk, cudaMemcpyHostToDevice);
    cudaError_t e = scores<T, NP>(hq, dq, dk, which, dm, dw, hm, hw);
    CHECK(e == cudaSuccess, "%s: kernel: %s", name, cudaGetErrorString(e));
    check_scores(name, fq, fk, hm, hw);
    /* the same rows moved to other warps and lanes (row r now at (r + 19) % 64, in every part):
     * the prefill's passes list rows in other places, and every pass must see the same z bit
     * for bit */
    for (int p = 0; p < NP; p++)
        for (int r = 0; r < ROWS; r++)
            memcpy(hq2 + (p * ROWS + (r + 19) % ROWS) * DIM, hq + (p * ROWS + r) * DIM, DIM * 2);
    e = scores<T, NP>(hq2, dq, dk, which, dm, dw, hm, hw2);
    CHECK(e == cudaSuccess, "%s: moved rows: kernel: %s", name, cudaGetErrorString(e));
    int moved = 0;
    for (int r = 0; r < ROWS; r++)
        for (int t = 0; t < KEYS; t++)
            moved += memcmp(hw2 + ((r + 19) % ROWS) * KEYS + t, hw + r * KEYS + t, 4) != 0;
    CHECK(moved == 0, "%s: %d scores changed bits when their rows moved to other warps", name,
          moved);
    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dm);
    cudaFree(dw);
}

int main(void) {
    int n = 0, major = 0, minor = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0 ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess ||
        major != 9 || minor != 0) {
        printf("test_wgmma: no device of compute capability 9.0 (sm_90a code), skipped\n");
        return 77;
    }
    char name[64];
    for (unsigned seed = 1; seed <= 4; seed++)
        for (int which = 0; which < 2; which++) {
            snprintf(name, sizeof name, "bf16 seed %u tile %d", seed, which);
            run_case<__nv_bfloat16, 1>(seed, which, name);
            snprintf(name, sizeof name, "f16 seed %u tile %d", seed, which);
            run_case<__half, 1>(seed, which, name);
            /* the model's fp32 q: 3 parts of bf16, 2 of f16 (docs/math.md §12) */
            snprintf(name, sizeof name, "bf16 3 parts seed %u tile %d", seed, which);
            run_case<__nv_bfloat16, 3>(seed, which, name);
            snprintf(name, sizeof name, "f16 2 parts seed %u tile %d", seed, which);
            run_case<__half, 2>(seed, which, name);
        }
    return test_finish("test_wgmma");
}
