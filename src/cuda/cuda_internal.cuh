/*
 * Shared pieces of the CUDA backend: the plan (every scratch buffer, sized once at plan
 * time so a step never allocates or synchronises), element loads, warp/block reductions.
 * The stages live one per file, mirroring src/cpu: append.cu (append + summarize),
 * bound.cu, select.cu (top-k radix select, certified round-2 marking), screen.cu (screened
 * decode's key-code bounds and page lists), attend_*.cu (scores,
 * tau, support-only V), decode.cu (the step orchestration).
 */
#pragma once
#include "entmaxkv.h"
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <type_traits>
#include "../core/geometry.h"
#include "../core/stats_rules.h"
#include "../math/shard_select.h"

extern "C" {
/* from src/core and src/math (C) */
ekv_status ekv_fail(ekv_context *ctx, ekv_status status, const char *fmt, ...);
void ekv_clear_error(ekv_context *ctx);
double ekv_normal_quantile(double p);
}

/* The plan's flags of a query head whose tau candidates overflowed the list (attend_tau.cu sets
 * them, ekv_cuda_read_report counts them as slow_rows and compacted_rows). */
enum { EKV_TAU_FLAG_WHOLE_ROW = 1, EKV_TAU_FLAG_COMPACTED = 2 };

enum {
    EKV_CUDA_THREADS = 256,    /* threads of the attend/bound/select blocks              */
    EKV_CUDA_CAND_CAP = 16384, /* tau candidates (and support rows) listed per query head */
    EKV_CUDA_MAX_GROUP = 16,   /* GQA group sizes the register tiles hold               */
    EKV_CUDA_MAX_DIM = 512,
    EKV_SCREEN_GRID = 64, /* thresholds M - 1 + k / 64 of the screen's retry (screen.cu)     */
    EKV_CUDA_TAU_HIST_BINS = 2048 /* bins of y = z - M in [-1, 0] of tau's count bound       */
};

/* The splits of one step of `batch` sequences (decode.cu, ekv_cuda_step_splits): the plan's
 * one-wave rule at the step's batch, not the plan's max_batch, so a step of one sequence in a
 * plan made for 64 still fills the GPU (docs/architecture.md, CUDA split-KV). */
struct ekv_step_splits {
    int32_t scores; /* per list row of a uniform batch (ekv_seq_splits' base), <= split_cap */
    int32_t values; /* per query head of the support values kernel                      */
    int32_t unions; /* per KV head of the group-union values kernel                     */
};

struct ekv_cuda_plan {
    ekv_context *ctx;
    ekv_cuda_plan_params p;
    cudaStream_t stream;
    int own_stream;
    int32_t split_cap;  /* the most splits a row can get: split_max, flash_part pitch   */
    int32_t sms;        /* the device's SMs (one-wave grids, ekv_cuda_one_wave)     */
    int64_t cap_pages;  /* max_pages_per_seq                                           */
    int64_t cap_tokens; /* cap_pages * page_size: score row length                     */
    /* scratch (device) */
    float *scores;       /* [B*H][cap_tokens] z-space scores of the listed tokens       */
    float *split_max;    /* [B*H][2][split_cap] per split, round 1 then round 2          */
    float *bounds;       /* [B*H][cap_pages] per query head page bounds                 */
    float *list_bounds;  /* [B*Hk][cap_pages] max over the group (ranking key)          */
    int32_t *list_pages; /* [B*Hk][cap_pages] logical pages, round 1 then round 2      */
    int32_t *list_count; /* [B*Hk][2] entries of round 1, round 1 + round 2            */
    uint8_t *in_list;    /* [B*Hk][cap_pages] membership of round 1                     */
    /* per_query_head lists (docs/architecture.md, CUDA per-query-head lists): each query
     * head's own list, then their union per KV head with a head mask per entry, so K is read
     * once for the group and a head's scores outside its own list are -inf */
    int32_t *hlist_pages;  /* [B*H][cap_pages] a query head's list                        */
    int32_t *hlist_count;  /* [B*H][2]                                                    */
    uint8_t *hlist_in;     /* [B*H][cap_pages] its membership                             */
    uint16_t *list_heads;  /* [B*Hk][cap_pages] per union entry: bit g = head g lists it  */
    int last_masked;       /* the last step's heads attended their own lists (list_heads) */
    unsigned long long *sp_count; /* [2] superpage skipping: pages skipped, boxes read      */
    int last_sp_counted;          /* the last step's bound stage skipped against tau_lb     */
    double *tau;         /* [B*H] in z-space (the report, the bounds, tau_lb)           */
    /* [B*H] tau again as (m, t) with tau = m + t, m the head's max score: the weights take
     * z - tau as (z - m) - t, exact at any score scale (docs/math.md §6.2); m = 0 where a
     * stage knows only tau (the sharded agreement) */
    float *tau_m;
    double *tau_t;
    int64_t *support;    /* [B*H]                                                       */
    int64_t *v_rows;     /* [B*Hk]                                                      */
    int32_t *flags;      /* [B*H] EKV_TAU_FLAG_*: how an overflowed head's tau was found  */
    unsigned long long *slow_paths; /* NULL or [EKV_SLOW_PATHS] (ekv_cuda_count_slow_paths) */
    int64_t cand_cap;    /* entries of a candidate / support list (per query head)      */
    uint32_t *ubits;     /* [B*Hk][cap_words] the group's support slots (zero between steps) */
    int32_t *ulist;      /* [B*Hk][cap_tokens] the same slots listed once each (union_mark) */
    int32_t *ucount;     /* [B*Hk] their count (zeroed by the step's score kernel)         */
    float *cand_z;       /* [B*H][cand_cap] scores z >= M - 1                           */
    int64_t *cand_slot;  /* [B*H][cand_cap] their score slots                            */
    int32_t *cand_count; /* [B*H] candidates found (may exceed cand_cap: overflow)      */
    /* an overflowed head's list rebuilt by every split (attend_tau.cu, cand_kernel): the
     * candidates' histogram, the lower bound of tau from it, the refined count; the
     * histograms and the done counts are zero between steps (the last block resets them) */
    uint32_t *cand_hist; /* [B*H][EKV_CUDA_TAU_HIST_BINS] counts of y = z - M in [-1, 0]   */
    uint32_t *cand_done; /* [B*H] candidate blocks of the row that have finished           */
    float *cand_thr;     /* [B*H] the refined list's threshold (-inf: the row fit)         */
    int32_t *refine_count; /* [B*H] scores above cand_thr (may exceed cand_cap)            */
    float *sup_p;        /* [B*H][cand_cap] support list of the final round: p          */
    int64_t *sup_off;    /* [B*H][cand_cap] and V row offset                            */
    int64_t *sup_count;  /* [B*H] support size (> cand_cap: values scan the row)        */
    double *gmu, *gsig;  /* [B*H][cap_pages] gaussian selector page moments             */
    double *gstat;       /* [B*H][3] gaussian: tau-hat, sigma_g, u_avg per query head     */
    int64_t *survivors;  /* [B*Hk] screened: (token, query head) pairs the screen kept    */
    /* screened decode on token rows (screen.cu) */
    uint32_t *scr_state; /* [5][B*H] per step, zeroed by one memset: max l, max z (ordered */
                         /* keys, 0 = none yet), candidates of the screen, of its retry    */
                         /* pass, overflow marks (1 retried, 2 every token kept)          */
    double *scr_f;       /* [B*H][EKV_SCREEN_GRID] F of the kept l at the retry grid      */
    int64_t scap;        /* candidates of the screen kept per query head                 */
    float *scl, *scu;    /* [B*H][scap] their lower and upper bounds                      */
    int32_t *sct;        /* [B*H][scap] and token index                                   */
    int64_t cap_words;   /* cap_tokens / 32, rounded up                                   */
    uint32_t *sbits;     /* [B*Hk][cap_words] survivors of the group (zero between steps) */
    int32_t *rows;       /* [B*Hk][cap_tokens] surviving rows, ascending                   */
    int32_t *row_count;  /* [B*Hk]                                                         */
    int last_screened;   /* the last step ran the screen (the report reads survivors)    */
    int last_screen_kind; /* its screen kernel (screen.cu: generic, fast, tensor cores)  */
    int last_one_pass;   /* the last step's softmax ran in one pass (no score rows)       */
    int32_t last_score_splits; /* the last score pass's splits per row (ekv_cuda_report)   */
    int skip_values;     /* set by a sharded plan (sharded.cu): an entmax step stops after */
                         /* tau (its shard's own), the values come at the agreed tau       */
    int shard_pos;       /* set by a sharded plan for its topk/gaussian stages: where the */
                         /* table stands in its sequence (EKV_SHARD_*, shard_select.h);  */
                         /* 0 (the whole sequence) otherwise                             */
    float *flash_part;   /* [B*H][split_cap][head_dim + 4] one-pass softmax partials       */
    int64_t bytes;
    int32_t launches; /* of the last step                                            */
    int32_t last_batch;
};

/* The slower paths of a decode step that a caller may count, one per (step, query head):
 * the tau kernel's list compacted or solved over the whole row (attend_tau.cu), the screen's
 * list overflowed and retried, or kept every token (screen.cu). */
enum {
    EKV_SLOW_TAU_COMPACTED,
    EKV_SLOW_TAU_WHOLE_ROW,
    EKV_SLOW_SCREEN_RETRIED,
    EKV_SLOW_SCREEN_ALL,
    EKV_SLOW_PATHS
};

/* Where the next steps' kernels count their slow paths: events[EKV_SLOW_*] on the device; NULL
 * stops counting. Launches read the pointer, so each captured graph node keeps the one it was
 * captured with (the model points it at each layer's counters). */
static inline void ekv_cuda_count_slow_paths(ekv_cuda_plan *pl, unsigned long long *events) {
    pl->slow_paths = events;
}

/* Calls f(std::integral_constant<int, TG>{}) with the smallest compiled group tile TG >= G (1,
 * 2, 4, 8 or EKV_CUDA_MAX_GROUP): every kernel templated on the group is launched through this
 * one ladder, so the tiles a group maps to are written once. */
/* Blocks per row for a grid of `rows` rows that fits one wave of `kernel` (its resident
 * blocks per SM asked once per instance, through *per_sm): where blocks split the work
 * evenly, a second, partial wave would run alone at the end for as long as the first. */
template <typename K>
static inline int ekv_cuda_one_wave(K kernel, int threads, size_t smem, int rows, int sms,
                                    int *per_sm) {
    if (!*per_sm && (cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, threads, smem) !=
                             cudaSuccess ||
                     *per_sm < 1))
        *per_sm = 1;
    const int gx = *per_sm * sms / rows;
    return gx > 1 ? gx : 1;
}

/* A launch of Kernel with `bytes` of dynamic shared memory: above 48 KB it needs the opt-in,
 * asked once per kernel instance (the static lives in this template's instance for Kernel;
 * a static shared by several kernels would leave all but the first without it). */
template <auto Kernel> static inline cudaError_t ekv_cuda_allow_smem(size_t bytes) {
    static size_t allowed = 48 * 1024;
    if (bytes <= allowed) return cudaSuccess;
    const cudaError_t e =
            cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (e == cudaSuccess) allowed = bytes;
    return e;
}

template <typename F> static inline auto ekv_cuda_with_group(int G, F &&f) {
    if (G == 1) return f(std::integral_constant<int, 1>{});
    if (G == 2) return f(std::integral_constant<int, 2>{});
    if (G <= 4) return f(std::integral_constant<int, 4>{});
    if (G <= 8) return f(std::integral_constant<int, 8>{});
    return f(std::integral_constant<int, EKV_CUDA_MAX_GROUP>{});
}

/* The checks of a host readout of the plan's last step (report, rows, overflow): the plan, the
 * output pointer and the batch. */
static inline ekv_status ekv_cuda_check_readout(const ekv_cuda_plan *pl, const void *outp,
                                                const char *name, int32_t batch) {
    if (!pl) return EKV_ERR_NULL_POINTER;
    if (!outp) return ekv_fail(pl->ctx, EKV_ERR_NULL_POINTER, "%s must not be NULL", name);
    if (batch < 1 || batch > pl->p.max_batch)
        return ekv_fail(pl->ctx, EKV_ERR_INVALID_SIZE, "batch=%d must be in [1, %d]", batch,
                        pl->p.max_batch);
    return EKV_OK;
}

#define EKV_CUDA_TRY(plan, call)                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return ekv_fail((plan)->ctx, EKV_ERR_DEVICE, "%s: %s (%s:%d)", #call,                  \
                            cudaGetErrorString(e_), __FILE__, __LINE__);                           \
    } while (0)

/* A per-query-head readout of the last step ([batch * num_heads] rows of row_bytes from src,
 * device) into out (host), after the plan's stream: the GPU tests' score rows and bounds. */
static inline ekv_status ekv_cuda_read_head_rows(ekv_cuda_plan *pl, int32_t batch, void *out,
                                                 const void *src, int64_t row_bytes) {
    const ekv_status cs = ekv_cuda_check_readout(pl, out, "out", batch);
    if (cs) return cs;
    EKV_CUDA_TRY(pl, cudaStreamSynchronize(pl->stream));
    EKV_CUDA_TRY(pl, cudaMemcpy(out, src, (size_t)(batch * pl->p.num_heads * row_bytes),
                                cudaMemcpyDeviceToHost));
    return EKV_OK;
}

#define EKV_CUDA_LAUNCHED(plan)                                                                    \
    do {                                                                                           \
        cudaError_t e_ = cudaGetLastError();                                                       \
        if (e_ != cudaSuccess)                                                                     \
            return ekv_fail((plan)->ctx, EKV_ERR_DEVICE, "kernel launch: %s (%s:%d)",              \
                            cudaGetErrorString(e_), __FILE__, __LINE__);                           \
        (plan)->launches++;                                                                        \
    } while (0)

/* ---- element loads: 8 consecutive elements as fp32 (16-byte aligned for 16-bit types).
 * load8 reads global memory through the read-only path; unpack8 converts 8 elements already
 * loaded (e.g. staged in shared memory by cp.async). ---- */
template <typename T> struct ekv_elem;

/* The two 16-bit storage types convert by pairs: __half2 and __nv_bfloat162 to float2. */
__device__ __forceinline__ float2 ekv_pair_f32(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ float2 ekv_pair_f32(__nv_bfloat162 h) { return __bfloat1622float2(h); }
template <typename T> struct ekv_pair_of;
template <> struct ekv_pair_of<__half> { typedef __half2 type; };
template <> struct ekv_pair_of<__nv_bfloat16> { typedef __nv_bfloat162 type; };

/* 2 N2 16-bit elements of type T held in the registers r (a uint2 or uint4), as fp32. */
template <typename T, int N2, typename R>
__device__ __forceinline__ void ekv_unpack_pairs(const R &r, float *o) {
    typedef typename ekv_pair_of<T>::type P;
    const P *h = reinterpret_cast<const P *>(&r);
#pragma unroll
    for (int i = 0; i < N2; i++) {
        const float2 f = ekv_pair_f32(h[i]);
        o[2 * i] = f.x;
        o[2 * i + 1] = f.y;
    }
}

/* unpack8 / load8 of the 16-bit types (16-byte aligned). */
template <typename T> struct ekv_elem16 {
    static __device__ __forceinline__ void unpack8(const T *p, float *o) {
        ekv_unpack_pairs<T, 4>(*reinterpret_cast<const uint4 *>(p), o);
    }
    static __device__ __forceinline__ void load8(const T *p, float *o) {
        ekv_unpack_pairs<T, 4>(__ldg(reinterpret_cast<const uint4 *>(p)), o);
    }
};
template <> struct ekv_elem<__half> : ekv_elem16<__half> {
    static __device__ __forceinline__ __half from(float x) { return __float2half_rn(x); }
    static __device__ __forceinline__ float to(__half x) { return __half2float(x); }
};
template <> struct ekv_elem<__nv_bfloat16> : ekv_elem16<__nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ float to(__nv_bfloat16 x) { return __bfloat162float(x); }
};
template <> struct ekv_elem<float> {
    static __device__ __forceinline__ void unpack8(const float *p, float *o) {
        const float4 a = *reinterpret_cast<const float4 *>(p),
                     b = *(reinterpret_cast<const float4 *>(p) + 1);
        o[0] = a.x;
        o[1] = a.y;
        o[2] = a.z;
        o[3] = a.w;
        o[4] = b.x;
        o[5] = b.y;
        o[6] = b.z;
        o[7] = b.w;
    }
    static __device__ __forceinline__ void load8(const float *p, float *o) {
        const float4 r[2] = {__ldg(reinterpret_cast<const float4 *>(p)),
                             __ldg(reinterpret_cast<const float4 *>(p) + 1)};
        unpack8(reinterpret_cast<const float *>(r), o);
    }
    static __device__ __forceinline__ float from(float x) { return x; }
    static __device__ __forceinline__ float to(float x) { return x; }
};

/* ---- reductions ---- */
/* The page ranges as the kernels read them (docs/math.md §1.2): fp32 kmin/kmax, or the compact
 * copies (f16/bf16, rounded outward), converted to fp32 exactly on the way in. */
struct ekv_cuda_ranges {
    const float *mn, *mx;
    const uint16_t *mn16, *mx16;
    int dtype;    /* ekv_dtype: F32 reads mn/mx, F16/BF16 mn16/mx16 */
    int64_t elem; /* bytes per value, for prefetching */
};
static inline ekv_cuda_ranges ekv_cuda_ranges_of(const ekv_page_stats *st) {
    const int c = st->range_dtype != EKV_DTYPE_F32;
    return ekv_cuda_ranges{st->kmin, st->kmax, st->kmin16, st->kmax16, (int)st->range_dtype,
                           c ? 2 : 4};
}
/* A 16-bit range value as fp32 (exact), f16 or bf16 chosen without a branch. */
__device__ __forceinline__ float ekv_range16_f32(uint32_t h, int dtype) {
    const float bf = __uint_as_float(h << 16),
                f = __half2float(__ushort_as_half((unsigned short)h));
    return dtype == EKV_DTYPE_BF16 ? bf : f;
}
/* How a kernel reads the ranges, fixed at compile time where it is hot: fp32, f16, bf16, or
 * either 16-bit type (a branch on r.dtype per value). */
enum { EKV_RANGE_F32 = 0, EKV_RANGE_F16 = 1, EKV_RANGE_BF16 = 2, EKV_RANGE_ANY = 3 };
/* A 16-bit range value as fp32 (exact) for the variant RT. */
template <int RT> __device__ __forceinline__ float ekv_range16_as(uint32_t h, int dtype) {
    if (RT == EKV_RANGE_BF16) return __uint_as_float(h << 16);
    if (RT == EKV_RANGE_F16) return __half2float(__ushort_as_half((unsigned short)h));
    return ekv_range16_f32(h, dtype);
}
/* N consecutive values (N = 1, 2, 4 or 8) of the minima (hi = false) or maxima at flat index i,
 * a multiple of N, into o; RT as above (the stats' dtype must match it). */
template <int N, int RT = EKV_RANGE_ANY>
__device__ __forceinline__ void ekv_range_load(const ekv_cuda_ranges &r, bool hi, int64_t i,
                                               float *o) {
    if (RT == EKV_RANGE_F32 || (RT == EKV_RANGE_ANY && r.dtype == EKV_DTYPE_F32)) {
        const float *p = (hi ? r.mx : r.mn) + i;
        if (N == 8) {
            const float4 v = __ldg(reinterpret_cast<const float4 *>(p)),
                         w = __ldg(reinterpret_cast<const float4 *>(p) + 1);
            o[0] = v.x, o[1] = v.y, o[2] = v.z, o[3] = v.w;
            o[4] = w.x, o[5] = w.y, o[6] = w.z, o[7] = w.w;
        } else if (N == 4) {
            const float4 v = __ldg(reinterpret_cast<const float4 *>(p));
            o[0] = v.x, o[1] = v.y, o[2] = v.z, o[3] = v.w;
        } else if (N == 2) {
            const float2 v = __ldg(reinterpret_cast<const float2 *>(p));
            o[0] = v.x, o[1] = v.y;
        } else {
            o[0] = __ldg(p);
        }
        return;
    }
    const uint16_t *p = (hi ? r.mx16 : r.mn16) + i;
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (N == 8) {
        const uint4 v = __ldg(reinterpret_cast<const uint4 *>(p));
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if (N == 4) {
        const uint2 v = __ldg(reinterpret_cast<const uint2 *>(p));
        w[0] = v.x, w[1] = v.y;
    } else if (N == 2) {
        w[0] = __ldg(reinterpret_cast<const unsigned int *>(p));
    } else {
        o[0] = ekv_range16_as<RT>(__ldg(reinterpret_cast<const unsigned short *>(p)), r.dtype);
        return;
    }
#pragma unroll
    for (int k = 0; k < N / 2; k++) {
        o[2 * k] = ekv_range16_as<RT>(w[k] & 0xffffu, r.dtype);
        o[2 * k + 1] = ekv_range16_as<RT>(w[k] >> 16, r.dtype);
    }
}
/* The kernel variant for these ranges: calls f with std::integral_constant<int, RT>. */
template <typename F> static inline auto ekv_cuda_with_ranges(const ekv_cuda_ranges &r, F &&f) {
    if (r.dtype == EKV_DTYPE_F16) return f(std::integral_constant<int, EKV_RANGE_F16>());
    if (r.dtype == EKV_DTYPE_BF16) return f(std::integral_constant<int, EKV_RANGE_BF16>());
    return f(std::integral_constant<int, EKV_RANGE_F32>());
}
/* Where the minima (hi = false) or maxima of flat index i start, for prefetching. */
__device__ __forceinline__ const void *ekv_range_addr(const ekv_cuda_ranges &r, bool hi,
                                                      int64_t i) {
    return r.dtype == EKV_DTYPE_F32 ? (const void *)((hi ? r.mx : r.mn) + i)
                                    : (const void *)((hi ? r.mx16 : r.mn16) + i);
}

template <typename T> __device__ __forceinline__ T ekv_warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <typename T> __device__ __forceinline__ T ekv_warp_max(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        T w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}
template <typename T> __device__ __forceinline__ T ekv_warp_min(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        T w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}
/* Block-wide reductions (sum, max); every thread gets the result. scratch: >= 32
 * elements of shared memory; identity: the value of an empty warp slot. */
template <typename T, typename WarpOp>
__device__ __forceinline__ T ekv_block_reduce(T v, T *scratch, T identity, WarpOp warp_op) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_op(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_op(lane < nw ? scratch[lane] : identity);
}
template <typename T> __device__ __forceinline__ T ekv_block_sum(T v, T *scratch) {
    return ekv_block_reduce(v, scratch, T(0), [](T x) { return ekv_warp_sum(x); });
}
template <typename T> __device__ __forceinline__ T ekv_block_max(T v, T *scratch, T lowest) {
    return ekv_block_reduce(v, scratch, lowest, [](T x) { return ekv_warp_max(x); });
}

/* Running maxima shared through device memory as ordered keys: atomicMax on the key orders
 * like the float; key 0 (what a memset gives) is below every float ("none yet"). */
__device__ __forceinline__ uint32_t ekv_float_key(float x) {
    const uint32_t b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float ekv_key_float(uint32_t k) {
    if (k == 0) return -__int_as_float(0x7f800000);
    return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

/* The largest values published to keys[g] so far, read early by lane 0 (pre[g]) so that the
 * load's latency hides behind the warp's work until ekv_share_max uses it. */
template <int GM>
__device__ __forceinline__ void ekv_peek_max(const uint32_t *keys, int G, uint32_t *pre) {
#pragma unroll
    for (int g = 0; g < GM; g++)
        pre[g] = (threadIdx.x & 31) == 0 && g < G
                         ? *reinterpret_cast<const volatile uint32_t *>(keys + g)
                         : 0u;
}

/* The warp's maxima mine[g] (any lanes) published to keys[g] (atomicMax where they beat what
 * the warp knows), and seen[g] (every lane) raised to the largest value known: the peeked
 * keys pre[g] (ekv_peek_max) and the warp's own. Only ever a max of values some warp holds.
 * Warp-uniform call. */
template <int GM>
__device__ __forceinline__ void ekv_share_max(const float *mine, float *seen, uint32_t *keys, int G,
                                              const uint32_t *pre) {
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= G) break;
        const float m = ekv_warp_max(mine[g]);
        const float s = fmaxf(seen[g], ekv_key_float(__shfl_sync(0xffffffffu, pre[g], 0)));
        if (m > s && (threadIdx.x & 31) == 0) atomicMax(keys + g, ekv_float_key(m));
        seen[g] = fmaxf(s, m);
    }
}

/* Warp-aggregated append: the lanes with take get consecutive slots of a list whose length is
 * *count (one atomic per warp); returns the lane's slot. Warp-uniform call. */
__device__ __forceinline__ uint32_t ekv_warp_append(bool take, uint32_t *count) {
    const unsigned m = __ballot_sync(0xffffffffu, take);
    if (!m) return 0;
    const int lane = threadIdx.x & 31, leader = __ffs(m) - 1;
    uint32_t at = 0;
    if (lane == leader) at = atomicAdd(count, (uint32_t)__popc(m));
    at = __shfl_sync(0xffffffffu, at, leader);
    return at + (uint32_t)__popc(m & ((1u << lane) - 1));
}

/* Exclusive block scan of per-thread counts: returns the sum over lower threads, *total the
 * block's sum. wsum: 32 ints of shared memory. */
__device__ __forceinline__ int ekv_block_exclusive_scan(int v, int *wsum, int *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
    }
    __syncthreads();
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < nw; w++) {
        const int c = wsum[w];
        before += w < warp ? c : 0;
        all += c;
    }
    *total = all;
    return before + incl - v;
}

/* Ordered compaction of one tile of a page list (top-k select, gaussian rule): each thread
 * holds UNROLL consecutive pages from lo, take[u] says whether page lo + u (< n) is kept. The
 * kept pages go to out[*written ...] in page order, in[] records membership, and *written
 * advances by the tile's total (the same in every thread). One block scan per tile. With
 * mask_out, each kept page's mask[u] goes to mask_out at its list position. */
template <int UNROLL>
__device__ __forceinline__ void ekv_compact_tile(const bool *take, int64_t lo, int64_t n,
                                                 int32_t *out, uint8_t *in, int *written,
                                                 int *wsum, const uint16_t *mask = nullptr,
                                                 uint16_t *mask_out = nullptr) {
    int cnt = 0;
#pragma unroll
    for (int u = 0; u < UNROLL; u++) cnt += lo + u < n && take[u];
    int tile_taken;
    int pos = *written + ekv_block_exclusive_scan(cnt, wsum, &tile_taken);
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        if (lo + u < n) {
            if (take[u]) {
                if (mask_out) mask_out[pos] = mask[u];
                out[pos++] = (int32_t)(lo + u);
            }
            in[lo + u] = take[u];
        }
    }
    *written += tile_taken;
}

/* Closes a round-1 page list of `written` pages: the last page (P - 1) is always read and
 * always last. One thread. */
__device__ __forceinline__ void ekv_close_list(int32_t *out, uint8_t *in, int written, int64_t P,
                                               int32_t *list_count, int row) {
    out[written] = (int32_t)(P - 1);
    if (P >= 1) in[P - 1] = 1;
    list_count[2 * row] = written + 1;
    list_count[2 * row + 1] = written + 1;
}

/* Closes a selector's round-1 list of `written` pages of a table at `pos` in its sequence
 * (EKV_SHARD_*, src/math/shard_select.h): ekv_close_list, except that a shard before the last
 * forces no page (its last page was ranked like the others; its list may be empty). */
__device__ __forceinline__ void ekv_close_shard_list(int32_t *out, uint8_t *in, int written,
                                                     int64_t P, int32_t *list_count, int row,
                                                     int pos) {
    if (pos != EKV_SHARD_INNER) {
        ekv_close_list(out, in, written, P, list_count, row);
        return;
    }
    list_count[2 * row] = written;
    list_count[2 * row + 1] = written;
}

/* Sequence geometry read from the device page table (lengths live in device memory). */
struct ekv_seq_geom {
    int64_t first; /* indptr[b] */
    int64_t P;     /* pages */
    int64_t N;     /* tokens */
};
__device__ __forceinline__ ekv_seq_geom ekv_seq(const ekv_page_table &t, int b, int ps) {
    ekv_seq_geom g;
    g.first = t.indptr[b];
    g.P = ekv_seq_pages(t.indptr, b);
    g.N = g.P > 0 ? ekv_seq_len(t.indptr, t.last_page_len, b, ps) : 0;
    return g;
}

/* ---- split-KV work partitioning (docs/architecture.md, CUDA split-KV): the splits of a
 * sequence's rows are proportional to its pages, `base` per row for a uniform batch (so B = 1
 * and uniform batches keep their count), ekv_split_count's rule (src/core/geometry.h: rounded
 * up; a floor left rows of just under two splits' worth one block, longer than the longest
 * block of equal splits). Every kernel that splits a row, and every reader of per-split
 * partials, takes the count from here, on the device from the page table (nothing is read
 * back: a step stays graph-safe). ---- */
__device__ __forceinline__ int ekv_seq_splits(const ekv_page_table &t, int b, int base, int cap) {
    return (int)ekv_split_count(base, t.batch, ekv_seq_pages(t.indptr, b),
                                t.indptr[t.batch] - t.indptr[0], cap);
}
/* A grid's x for splits by ekv_seq_splits: the flat splits of every sequence, in sequence order
 * (ekv_split_grid: enough for any lengths). */
static inline int ekv_cuda_split_grid(int base, int batch) { return (int)ekv_split_grid(base, batch); }
/* The split of flat block blockIdx.x: its sequence b (b < 0: none, the block returns at once),
 * its split s of the sequence's rows and their count n. Every warp finds it alone (32
 * sequences per pass, a prefix sum over the lanes), so no barrier is needed; warp-uniform
 * call with every lane of the warp. */
struct ekv_split {
    int b, s, n;
};
__device__ __forceinline__ ekv_split ekv_block_split(const ekv_page_table &t, int base, int cap) {
    const int lane = threadIdx.x & 31;
    const int64_t f = blockIdx.x;
    int64_t before = 0;
    for (int c = 0; c < t.batch; c += 32) {
        const int n = c + lane < t.batch ? ekv_seq_splits(t, c + lane, base, cap) : 0;
        int incl = n;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int x = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += x;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, n > 0 && before + incl > f);
        if (hit) {
            const int l = __ffs(hit) - 1, nl = __shfl_sync(0xffffffffu, n, l),
                      il = __shfl_sync(0xffffffffu, incl, l);
            return ekv_split{c + l, (int)(f - (before + il - nl)), nl};
        }
        before += __shfl_sync(0xffffffffu, incl, 31);
    }
    return ekv_split{-1, 0, 0};
}
/* Part sp.s of sp.n of the entries [begin, end): [*e0, *e1), empty (*e1 <= *e0) past the end. */
__device__ __forceinline__ void ekv_split_range(const ekv_split &sp, int64_t begin, int64_t end,
                                                int64_t *e0, int64_t *e1) {
    const int64_t per = (end - begin + sp.n - 1) / sp.n;
    *e0 = begin + (int64_t)sp.s * per;
    *e1 = *e0 + per < end ? *e0 + per : end;
}

/* The step shape every kernel's arguments start with (they derive from it): the page table
 * and the plan's static shapes, set on the host by ekv_cuda_set_shape. */
struct ekv_cuda_shape {
    ekv_page_table t;
    int H, Hk, G, D, ps;           /* query heads, KV heads, group, head dim, page size */
    int64_t cap_pages, cap_tokens; /* the plan's pages (and tokens) per sequence        */
};
template <typename Args>
inline void ekv_cuda_set_shape(Args &a, const ekv_cuda_plan *pl, const ekv_page_table *t) {
    ekv_cuda_shape &s = a;
    if (t) s.t = *t; /* NULL: a kernel that reads no page table keeps it zero */
    s.H = pl->p.num_heads;
    s.Hk = pl->p.num_kv_heads;
    s.G = s.H / s.Hk;
    s.D = pl->p.head_dim;
    s.ps = pl->p.page_size;
    s.cap_pages = pl->cap_pages;
    s.cap_tokens = pl->cap_tokens;
}

/* host-side launchers (one per stage file) */
ekv_status ekv_cuda_launch_bound(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                 const ekv_paged_kv *kv, const ekv_page_stats *st,
                                 const ekv_page_table *t, const float *q, int with_ball,
                                 const double *tau_lb, int batch);
/* The page lists a select kernel writes: one per KV head (the group's max decides), or with
 * per_query_head one per query head (then ekv_cuda_launch_union merges them per KV head). */
struct ekv_cuda_lists {
    int lps, lh; /* lists per sequence (Hk or H), query heads per list (G or 1) */
    int32_t *pages, *count;
    uint8_t *in;
};
ekv_cuda_lists ekv_cuda_lists_of(const ekv_cuda_plan *pl, int per_head);
ekv_status ekv_cuda_launch_topk(ekv_cuda_plan *pl, const ekv_page_table *t, int batch,
                                int64_t budget_tokens, double budget_fraction, int32_t sink_pages,
                                int32_t recent_pages, const double *hint, int per_head);
ekv_status ekv_cuda_launch_gaussian(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                    const ekv_select_params *sel, const ekv_paged_kv *kv,
                                    const ekv_page_stats *st, const ekv_page_table *t,
                                    const float *q, int batch, int per_head);
/* The gaussian on a shard of the sharded plan (docs/math.md §11): part 0 the page moments and
 * the shard's partial sums into red ([B*H][4], then [B][2] its pages and tokens), part 1, after
 * their allreduce-sum, the global stats from red and the page rule on the shard's pages. */
ekv_status ekv_cuda_launch_gaussian_shard(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                          const ekv_select_params *sel, const ekv_paged_kv *kv,
                                          const ekv_page_stats *st, const ekv_page_table *t,
                                          const float *q, int batch, int per_head, int part,
                                          double *red);
/* The checks of a step and the plan's record of it (decode.cu: what the report reads). */
ekv_status ekv_cuda_step_begin(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                               const ekv_select_params *sel, const ekv_paged_kv *kv,
                               const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                               const float *out);
/* The stages after a page-list select: the union of per-query-head lists, scores, tau (then
 * certified's round 2 and the values, unless skip_values). */
ekv_status ekv_cuda_step_attend(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                const ekv_select_params *sel, const ekv_paged_kv *kv,
                                const ekv_page_table *t, const float *q, float *out);
/* The union per KV head of the query heads' lists, in page order, with each entry's head mask
 * (list_heads); round 2 (certified) extends it as any KV-head list. */
ekv_status ekv_cuda_launch_union(ekv_cuda_plan *pl, const ekv_page_table *t, int batch);
ekv_status ekv_cuda_launch_round2(ekv_cuda_plan *pl, const ekv_page_table *t, int batch);
/* screened (screen.cu, docs/math.md §10): the code bounds, tau of the lower bounds (the tau
 * launch over them), then the page lists of the pages with a surviving token (5 launches) */
ekv_status ekv_cuda_launch_screened(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                    const ekv_paged_kv *kv, const ekv_page_stats *st,
                                    const ekv_page_table *t, const float *q, int batch, float *out);
/* the exact scores of screened decode's rows, the candidates z >= M - 1 listed on the way
 * (attend_scores.cu) */
ekv_status ekv_cuda_launch_row_scores(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                      const ekv_paged_kv *kv, const ekv_page_table *t,
                                      const float *q, int batch);
/* masked: the heads' scores outside their own lists are -inf (list_heads, per_query_head) */
ekv_step_splits ekv_cuda_step_splits(const ekv_cuda_plan *pl, int batch);
ekv_status ekv_cuda_launch_scores(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                  const ekv_paged_kv *kv, const ekv_page_table *t, const float *q,
                                  int batch, int use_list, int round, int masked);
/* entmax: candidates + tau (2 launches); softmax: log-sum-exp (1 launch); with rows
 * (screened) tau alone over the candidates the row scores kernel listed */
ekv_status ekv_cuda_launch_tau(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                               const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                               int use_list, int round, float *out_zero);
ekv_status ekv_cuda_launch_tau_rows(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                    const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                                    int use_list, int round, float *out_zero, int rows);
ekv_status ekv_cuda_launch_values_rows(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                       const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                                       int use_list, float *out, int rows);
/* softmax in one pass over K and V on tensor cores (attend_softmax_mma.cu): whether it serves
 * the plan's shapes and this dtype, and its two launches (the splits, then their merge) */
bool ekv_cuda_softmax_one_pass_applies(const ekv_cuda_plan *pl, int dtype);
ekv_status ekv_cuda_launch_softmax_one_pass(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                            const ekv_paged_kv *kv, const ekv_page_table *t,
                                            const float *q, int batch, int use_list, float *out);
/* whether the values stage reads each V row once for the GQA group (attend_values.cu); the
 * final tau launch then marks the support slots in ubits instead of listing them */
bool ekv_cuda_values_union(const ekv_cuda_plan *pl, double alpha);
ekv_status ekv_cuda_launch_values(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                  const ekv_paged_kv *kv, const ekv_page_table *t, int batch,
                                  int use_list, float *out);
