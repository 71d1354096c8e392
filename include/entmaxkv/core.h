/*
 * entmaxkv core API: status codes, dtypes, the context, exact alpha-entmax, views over paged
 * KV memory, the paged KV cache, and decode on the CPU (one entry point, ekv_decode, plus
 * each stage on its own). Included by <entmaxkv.h>; the CUDA API is in entmaxkv/cuda.h, the
 * model and safetensors API in entmaxkv/model.h.
 *
 * Conventions:
 *   - every symbol is prefixed ekv_; objects are opaque handles;
 *   - functions return ekv_status (0 = OK, negative = error) and, when a context is
 *     given, leave a message saying what was wrong in ekv_last_error(ctx);
 *   - on error, outputs are left untouched; the library never aborts or exits;
 *   - sizes and offsets are int64_t; page ids are int32_t;
 *   - every params struct has a *_default_params() function;
 *   - a context is single-threaded: use one context per thread (docs/architecture.md).
 *
 * entmax convention (docs/math.md §0): for scores s, z = (alpha - 1) * s and
 *   p_j = [z_j - tau]_+ ^ (1 / (alpha - 1)),  sum_j p_j = 1.
 * tau is reported in z-space. For alpha = 1 (softmax) tau is log(sum_j exp(s_j)), so
 * that p_j = exp(s_j - tau) holds with the same reading.
 */
#ifndef ENTMAXKV_CORE_H
#define ENTMAXKV_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(EKV_SHARED_BUILD)
#define EKV_API __declspec(dllexport)
#elif defined(__GNUC__)
#define EKV_API __attribute__((visibility("default")))
#else
#define EKV_API
#endif

#define EKV_VERSION_MAJOR 0
#define EKV_VERSION_MINOR 1
#define EKV_VERSION_PATCH 0

/* ---------------------------------------------------------------------------------- */
/* Status codes                                                                        */
/* ---------------------------------------------------------------------------------- */
typedef enum ekv_status {
    EKV_OK = 0,
    EKV_ERR_NULL_POINTER = -1,      /* a required pointer argument was NULL            */
    EKV_ERR_INVALID_SIZE = -2,      /* a size was zero, negative or out of range        */
    EKV_ERR_HEAD_MISMATCH = -3,     /* heads not divisible by KV heads, or bad head id  */
    EKV_ERR_INVALID_ALPHA = -4,     /* alpha outside [1, 4] or NaN                      */
    EKV_ERR_INVALID_PAGE_SIZE = -5, /* page size outside [1, 256]                       */
    EKV_ERR_INVALID_DTYPE = -6,     /* unknown dtype                                    */
    EKV_ERR_SIZE_OVERFLOW = -7,     /* a byte count would overflow int64/size_t          */
    EKV_ERR_OUT_OF_MEMORY = -8,     /* allocation failed                                */
    EKV_ERR_NAN_INPUT = -9,         /* NaN (or +inf) in an input that must be finite     */
    EKV_ERR_EMPTY_INPUT = -10,      /* every entry masked (-inf), or an empty sequence   */
    EKV_ERR_INVALID_SEQUENCE = -11, /* unknown or freed sequence id                      */
    EKV_ERR_CACHE_FULL = -12,       /* no free page left in the pool                     */
    EKV_ERR_INVALID_ARGUMENT = -13, /* any other invalid argument (message says which)   */
    EKV_ERR_UNSUPPORTED = -14,      /* valid request this build/backend cannot serve     */
    EKV_ERR_INTERNAL = -15,         /* a bug: please report                              */
    EKV_ERR_DEVICE = -16            /* the CUDA runtime failed (the message has its text) */
} ekv_status;

/* A static English description of a status code ("invalid page size", ...). */
EKV_API const char *ekv_status_string(ekv_status status);

/* ---------------------------------------------------------------------------------- */
/* Element types                                                                       */
/* ---------------------------------------------------------------------------------- */
typedef enum ekv_dtype {
    EKV_DTYPE_F32 = 0,
    EKV_DTYPE_F16 = 1, /* IEEE binary16 */
    EKV_DTYPE_BF16 = 2 /* bfloat16      */
} ekv_dtype;

EKV_API const char *ekv_dtype_name(ekv_dtype dtype); /* "f32", "f16", "bf16", NULL if unknown */
EKV_API int64_t ekv_dtype_size(ekv_dtype dtype);     /* bytes per element, 0 if unknown */
/* Parses "f32"/"fp32"/"float32", "f16"/"fp16"/"float16", "bf16"/"bfloat16". */
EKV_API ekv_status ekv_dtype_from_name(const char *name, ekv_dtype *out);

/* ---------------------------------------------------------------------------------- */
/* Context: threads, SIMD level, last error                                            */
/* ---------------------------------------------------------------------------------- */
/*
 * A context is single-threaded: its thread pool runs one call at a time and its scratch
 * memory belongs to the call in progress. Use one context per thread (contexts are
 * independent; caches and models created with a context share it). A call that finds
 * another thread inside a call on the same context (directly, or through a cache or model
 * created with it) returns EKV_ERR_INVALID_ARGUMENT, "context used from two threads at
 * once", and changes nothing.
 */
typedef struct ekv_context ekv_context;

typedef enum ekv_isa {
    EKV_ISA_AUTO = 0, /* best the CPU supports (runtime detection) */
    EKV_ISA_SCALAR = 1,
    EKV_ISA_AVX2 = 2,  /* AVX2 + FMA + F16C */
    EKV_ISA_AVX512 = 3 /* AVX-512 F/BW/VL   */
} ekv_isa;

typedef struct ekv_context_params {
    int32_t n_threads; /* worker threads for CPU stages; 0 = number of online CPUs */
    ekv_isa isa;       /* SIMD level; AUTO picks the best available                */
} ekv_context_params;

EKV_API ekv_context_params ekv_context_default_params(void);
/* Fails with EKV_ERR_UNSUPPORTED if the requested ISA is not available on this CPU. */
EKV_API ekv_status ekv_context_create(const ekv_context_params *params, ekv_context **out);
EKV_API void ekv_context_free(ekv_context *ctx);
/* Message of the last failed call made with this context ("" if none). */
EKV_API const char *ekv_last_error(const ekv_context *ctx);
EKV_API ekv_isa ekv_context_isa(const ekv_context *ctx);
EKV_API int32_t ekv_context_threads(const ekv_context *ctx);
EKV_API const char *ekv_isa_name(ekv_isa isa);
/* Best ISA this CPU supports. */
EKV_API ekv_isa ekv_cpu_best_isa(void);

/* ---------------------------------------------------------------------------------- */
/* Exact alpha-entmax on one row (docs/math.md §0, 8, 9.8)                                      */
/* ---------------------------------------------------------------------------------- */
/*
 * p = alpha-entmax(x). alpha = 1 softmax, 1.5 (closed form), 2 sparsemax (closed form),
 * any other alpha in (1, 4]: safeguarded Halley + bisection in double precision, then
 * renormalised. Entries equal to -inf are masked (p = 0). NaN or +inf in x is an error.
 * Any finite x works: the row is shifted by its maximum before it is scaled, so p is finite
 * and exact for every magnitude. tau (z-space, (alpha-1)*x scale) is (alpha-1)*max(x) plus a
 * small offset; when that overflows a double the call fails with EKV_ERR_INVALID_ARGUMENT
 * (only possible for ekv_entmax_f64 with |x| > DBL_MAX/3; pass tau = NULL there).
 * ctx may be NULL (then no message is kept). tau and support may be NULL.
 */
EKV_API ekv_status ekv_entmax(ekv_context *ctx, const float *x, int64_t n, double alpha, float *p,
                              double *tau, int64_t *support);
/* Same in double precision (used by the reference backend and the tests). */
EKV_API ekv_status ekv_entmax_f64(ekv_context *ctx, const double *x, int64_t n, double alpha,
                                  double *p, double *tau, int64_t *support);
/* p = alpha-entmax of each of `rows` contiguous rows of n entries (x and p are [rows][n]).
 * Every row is checked before any is written: a NaN or +inf, or a row of -inf only, fails with
 * the row's index in the message and p untouched. */
EKV_API ekv_status ekv_entmax_rows(ekv_context *ctx, const float *x, int64_t rows, int64_t n,
                                   double alpha, float *p);
EKV_API ekv_status ekv_entmax_rows_f64(ekv_context *ctx, const double *x, int64_t rows, int64_t n,
                                       double alpha, double *p);

/* sizeof a public struct, by its name ("ekv_paged_kv", "ekv_page_stats", "ekv_page_table",
 * "ekv_cache_params", "ekv_decode_params", "ekv_decode_info", "ekv_select_params",
 * "ekv_context_params", "ekv_attention_params", and cuda.h's "ekv_cuda_plan_params",
 * "ekv_cuda_report", "ekv_cuda_append_item", "ekv_cuda_sharded_params", "ekv_cuda_sharded_report",
 * "ekv_cuda_cache_params", declared in every build), or -1 for another name: bindings that mirror
 * the structs (the Python package) check their layouts against it when they load the library. */
EKV_API int64_t ekv_abi_sizeof(const char *type_name);

/* ---------------------------------------------------------------------------------- */
/* Layer 1: views over caller-owned paged KV memory (FlashInfer-style CSR)            */
/* ---------------------------------------------------------------------------------- */
/*
 * K and V of page `pg`, KV head `h`, slot `t` (0 <= t < page_size), dim `d` live at
 *   base + pg*stride_page + h*stride_head + t*stride_token + d      (in elements)
 * The dimension stride is 1. stride_page = num_kv_heads*page_size*head_dim in the cache, with
 * stride_token = head_dim, stride_head = page_size*head_dim in its default HND layout, and
 * stride_token = num_kv_heads*head_dim, stride_head = head_dim in NHD (ekv_kv_layout).
 */
typedef struct ekv_paged_kv {
    const void *k;
    const void *v;
    ekv_dtype dtype;
    int32_t page_size;
    int32_t num_kv_heads;
    int32_t head_dim;
    int64_t num_pages; /* physical pages addressable through k/v */
    int64_t stride_page, stride_head, stride_token;
} ekv_paged_kv;

/*
 * Per physical page and KV head statistics of the keys (fp32), indexed
 * [(page*num_kv_heads + head)*head_dim + d] (radius: [page*num_kv_heads + head]).
 * std is derived: sqrt(m2 / count), clamped below at 1e-6 (docs/math.md §1.2).
 * radius: max_j ||k_j - kmean||_2 over the tokens of the page, rounded up (docs/math.md §9.5).
 */
typedef struct ekv_page_stats {
    const float *kmin;
    const float *kmax;
    const float *kmean;
    const float *km2; /* Welford sum of squared deviations from the mean */
    const float *radius;
    const int32_t *count; /* tokens currently in each physical page */
    /* Superpages (docs/math.md §9.6, optional): physical pages [s*superpage_pages,
     * (s+1)*superpage_pages) form superpage s; smin/smax [(s*num_kv_heads + head)*head_dim + d]
     * bound every key of those pages (possibly loosely: freed pages may still count). 0 = none. */
    int32_t superpage_pages;
    const float *smin;
    const float *smax;
    /* Key codes (docs/math.md §10.1, optional): code_bits 4 or 8 (0 = none), relative to the
     * page's range as the bounds read it (kmin16/kmax16 with compact ranges, else kmin/kmax).
     * Physical page pg, KV head h has the block at codes + (pg*num_kv_heads + h) * page_size * R, R
     * = ceil(head_dim*code_bits/8); byte j*page_size + t of a block is channel j (8-bit) or
     * channels 2j (low nibble) and 2j+1 (high nibble) of token slot t. */
    const uint8_t *codes;
    int32_t code_bits;
    int64_t num_superpages; /* superpages smin/smax hold (ekv_cache_kv_view sets it); the bound
                             * stage checks it covers every physical page */
    /* Compact key ranges (docs/math.md §1.2, optional): with range_dtype f16 or bf16,
     * kmin16/kmax16 (laid out as kmin/kmax) hold every page range rounded outward to that
     * dtype, and the box bounds, the screen and the key codes read them instead of kmin/kmax:
     * half the bytes, exact when it is K's dtype. f32 (0, the default): kmin/kmax. */
    ekv_dtype range_dtype;
    const uint16_t *kmin16;
    const uint16_t *kmax16;
    /* Compact ball (docs/math.md §9.5, optional, with compact ranges): kmean16 (laid out as
     * kmean) holds each page's centre as the mean rounded to the nearest finite range_dtype
     * value, radius16 (laid out as radius) max_j ||k_j - centre|| rounded up; the ball bounds read
     * them instead of kmean/radius (half the centre's bytes, and still exact: the radius is
     * measured from the rounded centre). NULL: the fp32 ball. */
    const uint16_t *kmean16;
    const float *radius16;
    /* The pool the arrays describe (required; ekv_cache_kv_view sets them): num_pages physical
     * pages of num_kv_heads KV heads, head_dim channels and page_size token slots. Every call
     * that takes a view and statistics checks them against the view (at least its num_pages,
     * the same heads, dim and page size) and fails with EKV_ERR_INVALID_ARGUMENT otherwise:
     * statistics of another cache would be read out of their bounds. */
    int64_t num_pages;
    int32_t num_kv_heads;
    int32_t head_dim;
    int32_t page_size;
} ekv_page_stats;

/*
 * CSR page table of a batch: sequence b owns pages indices[indptr[b] .. indptr[b+1]) in
 * order; its last page holds last_page_len[b] tokens (1..page_size); its length is
 * (npages-1)*page_size + last_page_len[b].
 */
typedef struct ekv_page_table {
    int32_t batch;
    const int64_t *indptr;        /* [batch + 1] */
    const int32_t *indices;       /* [indptr[batch]] physical page ids */
    const int32_t *last_page_len; /* [batch] */
} ekv_page_table;

/* ---------------------------------------------------------------------------------- */
/* Layer 2: the paged KV cache (page pool, sequences, append, summaries)               */
/* ---------------------------------------------------------------------------------- */
typedef struct ekv_cache ekv_cache;

/* Where (page, KV head, slot) lives in a page: HND [page][kv head][slot][dim] (the default, one
 * head's keys contiguous), or NHD [page][slot][kv head][dim] (FlashInfer's and vLLM's). */
typedef enum ekv_kv_layout { EKV_LAYOUT_HND = 0, EKV_LAYOUT_NHD = 1 } ekv_kv_layout;

/* The largest superpage_pages a cache takes (ekv_cache_params; the tools' --superpage). */
#define EKV_MAX_SUPERPAGE_PAGES 4096

typedef struct ekv_cache_params {
    int64_t num_pages;       /* pages in the pool (capacity = num_pages * page_size tokens) */
    int32_t page_size;       /* tokens per page, 1..256 (default 16)                       */
    int32_t num_kv_heads;    /* default 8                                                  */
    int32_t head_dim;        /* default 128                                                */
    ekv_dtype dtype;         /* storage dtype of K and V (default f16)                      */
    int32_t max_seqs;        /* sequences alive at once (default 64)                       */
    int32_t superpage_pages; /* physical pages per superpage summary, 0 = none (default 16) */
    int32_t code_bits;       /* per-token key codes for screened decode (docs/math.md §10):  */
                             /* 0 = none (default), 4 or 8 bits per channel                   */
    ekv_dtype range_dtype;   /* the page ranges decode reads (docs/math.md §1.2): f32        */
                             /* (default), or f16/bf16 rounded outward: half the bytes, and  */
                             /* exact when it is K's dtype (ekv_cache_compact_ranges)         */
    ekv_kv_layout layout;    /* of K and V within a page (default HND)                     */
    /* The caller's memory for K and V (both or neither; 16-byte aligned; num_pages *         */
    /* page_size * num_kv_heads * head_dim elements of dtype each, in `layout`, the two not   */
    /* overlapping: EKV_ERR_INVALID_ARGUMENT if they share a byte), or NULL: the              */
    /* cache allocates them. Appends write there; the cache never frees them. The caller may  */
    /* read them (e.g. run another attention kernel on the same pages), not write them.      */
    void *k_pool, *v_pool;
} ekv_cache_params;

EKV_API ekv_cache_params ekv_cache_default_params(void);
/* The range dtype that halves the range bytes at no cost for K stored as `dtype`: that dtype
 * for f16/bf16 (every stored key, hence every range, is representable), f32 for f32. */
EKV_API ekv_dtype ekv_cache_compact_ranges(ekv_dtype dtype);
/* Pages needed to hold `tokens` tokens in each of `seqs` sequences. */
EKV_API int64_t ekv_cache_pages_for(int64_t tokens, int64_t seqs, int32_t page_size);
/* Bytes the pool would allocate for these params (K, V and summaries), or -1 if invalid.
 * ekv_cache_create refuses (EKV_ERR_OUT_OF_MEMORY) a pool larger than physical memory. */
EKV_API int64_t ekv_cache_bytes_needed(const ekv_cache_params *params);
EKV_API ekv_status ekv_cache_create(ekv_context *ctx, const ekv_cache_params *params,
                                    ekv_cache **out);
EKV_API void ekv_cache_free(ekv_cache *cache);

/* Every call on a cache, the ones that only read it too, runs on its context: while another
 * thread is inside a call on that context it returns EKV_ERR_INVALID_ARGUMENT ("context used
 * from two threads at once") and reads and changes nothing. */
EKV_API ekv_status ekv_cache_seq_new(ekv_cache *cache, int32_t *seq_out);
/* Frees a sequence and returns its pages to the pool. */
EKV_API ekv_status ekv_cache_seq_free(ekv_cache *cache, int32_t seq);
EKV_API ekv_status ekv_cache_seq_length(const ekv_cache *cache, int32_t seq, int64_t *len_out);
/*
 * The version of a live sequence: a number (never 0) that every change to it replaces with one
 * it never had, and that no other sequence of the cache ever had (new, append, truncate, adopt;
 * an id freed and created again is a new sequence). A page table built by ekv_cache_page_table
 * is current while each of its sequences keeps the version it had then; its length alone does
 * not say that (a sequence freed, created again and refilled to the same length holds other
 * pages). A plan that keeps a table compares the versions before each step.
 */
EKV_API ekv_status ekv_cache_seq_version(const ekv_cache *cache, int32_t seq,
                                         uint64_t *version_out);
/* Free pages in the pool: 0 for a NULL cache, -1 while another thread uses its context. */
EKV_API int64_t ekv_cache_free_pages(const ekv_cache *cache);

/*
 * Appends n_tokens tokens (a prefill chunk or one decode token) to a sequence.
 * k and v are [n_tokens][num_kv_heads][head_dim] contiguous in src_dtype; they are
 * converted to the storage dtype. Page summaries are updated incrementally. Fails
 * without changing anything if the pool has too few free pages or the input has NaN/inf.
 */
EKV_API ekv_status ekv_cache_append(ekv_cache *cache, int32_t seq, int64_t n_tokens, const void *k,
                                    const void *v, ekv_dtype src_dtype);

/*
 * Keeps the first n_tokens tokens of a sequence (0 <= n_tokens <= its length): the later pages
 * go back to the pool, and a last page kept in part gets its summaries and key codes rebuilt
 * from the keys it keeps, so the cache is what appending those n_tokens tokens would have
 * built (decode over it gives the same results). Appends continue at position n_tokens: one
 * prompt, several continuations. Fails without changing anything (EKV_ERR_INVALID_SIZE) when
 * n_tokens is out of range.
 */
EKV_API ekv_status ekv_cache_truncate(ekv_cache *cache, int32_t seq, int64_t n_tokens);

/*
 * A sequence over pages already filled by the caller's engine (a pool in the caller's memory,
 * ekv_cache_params.k_pool): `seq` (new, empty) takes the free pages pages[0..n_pages) in order,
 * each full but the last, which holds last_page_len tokens; their summaries and key codes are
 * built from the stored keys, as appends would have built them. Fails without changing
 * anything if a page is out of range, listed twice or not free, or holds a NaN or inf.
 * Further tokens are added with ekv_cache_append.
 */
EKV_API ekv_status ekv_cache_seq_adopt(ekv_cache *cache, int32_t seq, const int32_t *pages,
                                       int64_t n_pages, int32_t last_page_len);

/* Views of the pool and of its statistics (valid until the cache is freed). */
EKV_API ekv_status ekv_cache_kv_view(const ekv_cache *cache, ekv_paged_kv *kv_out,
                                     ekv_page_stats *stats_out);
/*
 * Builds the CSR page table of the given sequences into caller arrays:
 * indptr[n_seqs+1], indices[capacity], last_page_len[n_seqs]. Pass indices = NULL to only
 * learn the number of page ids needed (written to *needed).
 */
EKV_API ekv_status ekv_cache_page_table(const ekv_cache *cache, const int32_t *seqs, int32_t n_seqs,
                                        int64_t *indptr, int32_t *indices, int64_t indices_capacity,
                                        int32_t *last_page_len, int64_t *needed);

/* ---------------------------------------------------------------------------------- */
/* Decode attention                                                                    */
/* ---------------------------------------------------------------------------------- */
typedef struct ekv_decode_params {
    int32_t num_heads;         /* query heads H; must be a multiple of num_kv_heads     */
    double alpha;              /* 1 = softmax, (1, 4] = entmax (default 1.5)            */
    float scale;               /* score scale; 0 = 1/sqrt(head_dim)                     */
    const float *alibi_slopes; /* [num_heads] slopes m_h >= 0, or NULL for none         */
} ekv_decode_params;

EKV_API ekv_decode_params ekv_decode_default_params(void);

/* Optional per-step outputs. Any pointer may be NULL. */
typedef struct ekv_decode_info {
    double *tau;      /* [batch*num_heads] threshold in z-space (softmax: log-sum-exp)  */
    int64_t *support; /* [batch*num_heads] tokens with p > 0                            */
    int64_t bytes_k;  /* bytes of K read                                                */
    int64_t bytes_v;  /* bytes of V read (entmax: support rows only, union per KV head) */
    /* ekv_decode (and ekv_decode_certified for bytes_summary, lists_round2); the other calls
     * leave these as they are: */
    int64_t bytes_summary; /* output: page statistics read by the bound stage           */
    int64_t survivors;     /* output, screened: (token, query head) pairs the screen kept */
    int64_t pages_touched; /* output, screened (cpu): (page, list) pairs whose K rows were read */
    int64_t lists_round2;  /* output, certified: page lists that needed round 2         */
    int32_t *pages_round1; /* certified, [one per page list]: pages read in round 1     */
    int32_t *pages_round2; /* certified, [one per page list]: pages added in round 2    */
} ekv_decode_info;

/*
 * Dense decode: for every sequence b and query head h, attends q[b][h] over all tokens of
 * the sequence. q and out are [batch][num_heads][head_dim] fp32. The query position is the
 * last token (ALiBi bias m_h * (j - (len-1))). Entmax reads K once, keeps the scores,
 * solves tau exactly and reads V only for support rows (docs/math.md §9.7).
 */
EKV_API ekv_status ekv_decode_dense(ekv_context *ctx, const ekv_decode_params *params,
                                    const ekv_paged_kv *kv, const ekv_page_table *table,
                                    const float *q, float *out, ekv_decode_info *info);

/* The same computation in long double, scalar, single-threaded (backend `ref`). */
EKV_API ekv_status ekv_decode_dense_ref(ekv_context *ctx, const ekv_decode_params *params,
                                        const ekv_paged_kv *kv, const ekv_page_table *table,
                                        const float *q, float *out, ekv_decode_info *info);

/* ---------------------------------------------------------------------------------- */
/* Page selection and attention over selected pages (docs/math.md §2, 3)                         */
/* ---------------------------------------------------------------------------------- */
/*
 * The select methods (docs/architecture.md, "Methods and the stage table"):
 *   dense      every page
 *   topk       the pages with the largest box bound within a token budget
 *   oracle     the pages holding the dense entmax support (evaluation only)
 *   gaussian   the Gaussian-aware selector of docs/math.md §4 (alpha 2, 1.5 or 4/3)
 *   certified  top-k by certified bounds, then every page the bounds cannot rule out
 *              (docs/math.md §9.3); equals dense entmax
 *   screened   per-token bounds from the cache's key codes rule tokens out in one pass
 *              (docs/math.md §10); the pages with a surviving token are attended; equals
 *              dense entmax. Needs a cache with code_bits 4 or 8 and alpha > 1.
 */
typedef enum ekv_select_method {
    EKV_SELECT_DENSE = 0,
    EKV_SELECT_TOPK = 1,
    EKV_SELECT_ORACLE = 2,
    EKV_SELECT_GAUSSIAN = 3,
    EKV_SELECT_CERTIFIED = 4,
    EKV_SELECT_SCREENED = 5
} ekv_select_method;
#define EKV_SELECT_METHOD_COUNT 6

/* "dense", "topk", "oracle", "gaussian", "certified", "screened"; NULL if unknown. */
EKV_API const char *ekv_method_name(ekv_select_method method);
EKV_API ekv_status ekv_method_from_name(const char *name, ekv_select_method *out);

/* Where a decode step runs: the CPU (SIMD + threads), the long-double reference (dense
 * only), or the CUDA backend (entmaxkv/cuda.h). */
typedef enum ekv_backend {
    EKV_BACKEND_CPU = 0,
    EKV_BACKEND_REF = 1,
    EKV_BACKEND_CUDA = 2
} ekv_backend;
EKV_API const char *
ekv_backend_name(ekv_backend backend); /* "cpu", "ref", "cuda"; NULL if unknown */
EKV_API ekv_status ekv_backend_from_name(const char *name, ekv_backend *out);

/* How attention over a list sets tau (docs/math.md §4.11). */
typedef enum ekv_tau_mode {
    EKV_TAU_EXACT = 0,    /* solve tau exactly on the listed tokens (default)                */
    EKV_TAU_FIXED = 1,    /* use the selector's (clamped) tau-hat as is                      */
    EKV_TAU_CORRECTED = 2 /* tau-hat plus unbounded Halley corrections on the listed tokens  */
} ekv_tau_mode;

typedef struct ekv_select_params {
    ekv_select_method method;
    /* topk / certified (round 1): tokens read besides the always-read last page, >= 1;
     * floor(budget/page_size) scored pages are taken (at least one when budget >= 1 and P > 1).
     * Every budgeted method, on every backend, clamps a sequence's budget to its length: a
     * budget longer than a (short) sequence reads all of it, each sequence of a batch its own. */
    int64_t budget_tokens;
    /* topk / certified: when > 0, sequence b's budget is max(1, floor(budget_fraction * its
     * length)) instead of budget_tokens (a batch of prefix views each reads the same share) */
    double budget_fraction;
    /* 0 (default): one page list per KV head, ranking pages by the max bound over the GQA
     * group's query heads (gaussian: the union of the group's pages). 1: one list per query head.
     */
    int32_t per_query_head;
    /* gaussian (docs/math.md §4), defaults as in the paper's API; the user's margin and quantile
     * take effect unless auto_margin asks for the rule of docs/math.md §4.5 (which the reference
     * always uses) */
    double margin_z;     /* safety margin, in units of sigma_g (default 0)              */
    double max_quantile; /* q_max of the page rule, in (0, 1) (default 0.995)           */
    int32_t auto_margin; /* 1: docs/math.md §4.5 picks margin_z and q_max from sigma-bar         */
    int32_t reference_m3; /* 1: the reference's (wrong) alpha = 4/3 moment (docs/math.md §6.1-1)  */
    double excess_fraction; /* rho of docs/math.md §4.9 (default 0.2) */
    int32_t clamp_tau; /* clamp tau-hat to the selected pages, docs/math.md §4.10 (default 1)  */
    double clamp_quantile;    /* q_c of docs/math.md §4.10, in (0, 1) (default 0.5)    */
    ekv_tau_mode tau_mode;    /* how ekv_decode_pages sets tau for this list (default exact) */
    int32_t correction_iters; /* corrected mode: -1 = 1 without ALiBi, 2 with (docs/math.md §4.11)
                               */
    /* top-k / certified: rank by min(box, ball) + rounding slack (docs/math.md §9.5), a bound on
     * the computed scores, instead of the box alone (default 0 for top-k: paper-faithful) */
    int32_t use_ball;
    /* certified round 1 also reads the first sink_pages and the last recent_pages pages */
    int32_t sink_pages, recent_pages;
    /* certified bounds (use_ball): with a lower bound tau_lb[b*num_heads + h] of each head's tau
     * (z-space), the bound stage skips the page summaries of every superpage whose bound is
     * already <= tau_lb, giving its pages the superpage bound instead (docs/math.md §9.6).
     * Certified decode computes it from the recent pages when the cache has superpages. */
    const double *tau_lb;
    /* certified, adaptive round 1: when not NULL, round 1 is every page whose certified bound
     * exceeds tau_hint[b*num_heads + h] (z-space) for a head of the list, instead of a token
     * budget. A hint at or below the true tau (the previous step's tau, the gaussian tau-hat)
     * leaves round 2 empty; any hint keeps the result exact. */
    const double *tau_hint;
} ekv_select_params;

EKV_API ekv_select_params ekv_select_default_params(void);

/*
 * Selected pages, as a CSR over (sequence, list head): list l = b*heads + h holds logical
 * page numbers (0 = the sequence's first page) pages[indptr[l] .. indptr[l+1]), the scored
 * pages in descending bound order and the last page at the end. heads = num_kv_heads, or
 * num_heads when per_query_head. The caller allocates indptr[batch*heads + 1] and
 * pages[capacity]; ekv_page_list_capacity() says how many page numbers can be written.
 */
typedef struct ekv_page_list {
    int32_t heads; /* lists per sequence (set by ekv_select_pages)          */
    int64_t *indptr;
    int32_t *pages;
    int64_t capacity;
    int64_t bytes_summary; /* output: bytes of page statistics the bound stage read  */
    int64_t survivors;     /* output, screened: (token, query head) pairs the screen kept */
    int64_t pages_touched; /* output, screened (cpu): (page, list) pairs whose K rows were read */
    /* tau for the fixed/corrected modes: tau[b*num_heads + h] (z-space), written by the
     * gaussian selector when the caller provides the array ([batch*num_heads]). */
    double *tau;
    int32_t tau_mode; /* ekv_tau_mode, set by ekv_select_pages                  */
    int32_t correction_iters;
    /* optional output of top-k selection: the certified page bounds (min(box, ball) + slack,
     * z-space) bounds[(b*num_heads + h)*bounds_stride + p] for p < P_b - 1; asking for them
     * makes top-k rank by these bounds. bounds_stride >= the most pages of a sequence. */
    float *bounds;
    int64_t bounds_stride;
} ekv_page_list;

/* Page numbers needed for `heads` lists per sequence of this table (the dense total). */
EKV_API int64_t ekv_page_list_capacity(const ekv_page_table *table, int32_t heads);

/*
 * Bound + select: scores every page but the last with the Quest box bound on the query's
 * z-space scores (scale and ALiBi consistent with decode, docs/math.md §2.3 without bug 6.1-7) and
 * writes the page lists. stats are the cache's per-page key statistics (ekv_cache_kv_view).
 */
EKV_API ekv_status ekv_select_pages(ekv_context *ctx, const ekv_decode_params *params,
                                    const ekv_select_params *select, const ekv_paged_kv *kv,
                                    const ekv_page_stats *stats, const ekv_page_table *table,
                                    const float *q, ekv_page_list *list);

/*
 * Attention over page lists. Mode exact: for every query head, the exact alpha-entmax (or
 * softmax) over the tokens of its list, V read for support rows only; softmax over a top-k
 * list is the softmax top-k baseline. Modes fixed/corrected (list->tau_mode, from the
 * gaussian selector): p_j = [z_j - tau]_+^beta with tau = list->tau (after
 * list->correction_iters unbounded Halley steps), not renormalised, as in docs/math.md §3.10.
 * info->bytes_k counts the listed tokens; info->tau reports the tau used.
 */
EKV_API ekv_status ekv_decode_pages(ekv_context *ctx, const ekv_decode_params *params,
                                    const ekv_paged_kv *kv, const ekv_page_table *table,
                                    const ekv_page_list *list, const float *q, float *out,
                                    ekv_decode_info *info);

/*
 * The certified bound on the dropped mass of a budgeted step (docs/math.md §9.4): for every query
 * head, delta_bar = sum over the pages p outside its list of n_p * [U_p - tau]_+^beta, with U
 * the list's certified bounds (list->bounds) and tau the exact tau of the step (info->tau of
 * ekv_decode_pages in exact mode). delta <= delta_bar, and delta_bar = 0 proves the step exact.
 * alpha > 1 only. No memory traffic beyond the bounds already computed.
 */
EKV_API ekv_status ekv_delta_bound(ekv_context *ctx, const ekv_decode_params *params,
                                   const ekv_paged_kv *kv, const ekv_page_table *table,
                                   const ekv_page_list *list, const double *tau, double *delta_bar);

/* Per-step report of certified decode. Arrays may be NULL; they hold one value per list. */
typedef struct ekv_certified_info {
    int32_t *pages_round1; /* pages read in round 1                                     */
    int32_t *pages_round2; /* pages added in round 2 (0 when round 1 was already proven) */
    int64_t lists_round2;  /* output: how many lists needed round 2                      */
    int64_t bytes_summary; /* output: page statistics read by the bound stage            */
    int32_t certified;     /* output: 1 when every list is proven exact                  */
} ekv_certified_info;

/*
 * Certified decode (docs/math.md §9.3): bound every page (min(box, ball) + slack), read a candidate
 * set (the top pages by bound within select->budget_tokens, the last page, and the optional
 * sink/recent pages), solve tau_C exactly, then read every page whose bound still exceeds
 * tau_C and re-solve. The output equals dense entmax over all tokens (alpha > 1). info as in
 * ekv_decode_pages (bytes of both rounds).
 */
EKV_API ekv_status ekv_decode_certified(ekv_context *ctx, const ekv_decode_params *params,
                                        const ekv_select_params *select, const ekv_paged_kv *kv,
                                        const ekv_page_stats *stats, const ekv_page_table *table,
                                        const float *q, float *out, ekv_decode_info *info,
                                        ekv_certified_info *cinfo);

/*
 * Context-parallel decode, simulated on the CPU (docs/math.md §11): each sequence's pages are
 * split into n_shards contiguous ranges (1..64) that never see each other's scores, as GPUs
 * holding a shard each; they agree on tau through allreduces of a few scalars per head (each
 * shard's own threshold is a lower bound of tau), and their partial outputs are summed.
 * select (NULL = dense) chooses what is attended, with stats as in ekv_decode:
 *   dense, certified, screened: every token: the output is dense attention's within the
 *              rounding of tau, with the same support (these methods are exact);
 *   topk:      the global top-k pages by bound, agreed by histogram allreduces: the very pages
 *              of ekv_select_pages (ties: the lower page), then attention over them;
 *   gaussian:  the selector's moments summed across the shards, each shard applying the page
 *              rule to its own pages; the exact, fixed and corrected tau modes.
 * For topk and gaussian the output equals ekv_decode's for the method (fp32 rounding), the
 * support too. lists (may be NULL; topk and gaussian only): the agreed page lists, laid out as
 * ekv_select_pages writes them (the same sets; each list in ascending page order, the last page
 * last); list->tau receives tau-hat in the fixed/corrected modes as there. info: tau and
 * support as in ekv_decode_dense. report (may be NULL): what the collectives would carry: the
 * most allreduce rounds a head needed (of them, select_rounds to agree on the lists) and the
 * payload bytes one shard sends per step. oracle is refused (EKV_ERR_UNSUPPORTED).
 * Single-threaded: a model of the communication, not a fast path.
 */
typedef struct ekv_shard_report {
    int32_t rounds_max;    /* output: most allreduce rounds one query head needed          */
    double rounds_mean;    /* output: allreduce rounds per query head, on average           */
    int64_t bytes;         /* output: payload bytes each shard sends per step, all heads    */
    int32_t select_rounds; /* output: topk/gaussian: rounds agreeing on the lists (most)    */
} ekv_shard_report;
/* The pages shard `shard` of num_shards holds of a sequence of `pages` pages: [first, first +
 * count) = [j P / S, (j + 1) P / S), contiguous (the CPU simulation's and the CUDA sharded
 * plan's rule). EKV_ERR_INVALID_SIZE unless 1 <= num_shards <= 64, 0 <= shard < num_shards and
 * pages >= 0. */
EKV_API ekv_status ekv_shard_pages(int64_t pages, int32_t num_shards, int32_t shard, int64_t *first,
                                   int64_t *count);
EKV_API ekv_status ekv_decode_sharded_sim(ekv_context *ctx, const ekv_decode_params *params,
                                          const ekv_select_params *select, const ekv_paged_kv *kv,
                                          const ekv_page_stats *stats, const ekv_page_table *table,
                                          const float *q, float *out, int32_t n_shards,
                                          ekv_page_list *lists, ekv_decode_info *info,
                                          ekv_shard_report *report);

/* ---------------------------------------------------------------------------------- */
/* One decode step: the select method chooses the stages (docs/architecture.md)         */
/* ---------------------------------------------------------------------------------- */
/*
 * EKV_OK when `backend` can run this step, else EKV_ERR_UNSUPPORTED (a valid request the
 * backend cannot serve) or EKV_ERR_INVALID_ARGUMENT / EKV_ERR_INVALID_ALPHA (a request no
 * backend can serve), with the reason in ekv_last_error(ctx). select NULL means dense. It
 * is the very check ekv_decode, ekv_decode_dense_ref and ekv_cuda_decode run first, so its
 * answer is the dispatchers' answer. Only host-side fields are read (never a pointer's data).
 */
EKV_API ekv_status ekv_decode_supported(ekv_context *ctx, ekv_backend backend,
                                        const ekv_decode_params *params,
                                        const ekv_select_params *select);

/*
 * One decode step on the CPU with select->method choosing the stages (select NULL = dense):
 *   dense      attend over every token                     (ekv_decode_dense)
 *   topk       bound + top-k select + attend over the list (ekv_select_pages + ekv_decode_pages)
 *   gaussian   Gaussian-aware select + attend over the list
 *   oracle     the dense support's pages + attend (evaluation)
 *   certified  bound + top-k + attend + round 2            (ekv_decode_certified)
 * Page lists, bounds and scratch come from the context (nothing is allocated per step once
 * the context has grown to the shape). info as in ekv_decode_dense, plus bytes_summary and
 * the certified fields.
 */
EKV_API ekv_status ekv_decode(ekv_context *ctx, const ekv_decode_params *params,
                              const ekv_select_params *select, const ekv_paged_kv *kv,
                              const ekv_page_stats *stats, const ekv_page_table *table,
                              const float *q, float *out, ekv_decode_info *info);

/*
 * Dense reference distribution for evaluation: p[(b*num_heads + h)*stride + j] for every
 * token j of sequence b (stride = the longest sequence's length), and tau per head.
 */
EKV_API ekv_status ekv_dense_probs(ekv_context *ctx, const ekv_decode_params *params,
                                   const ekv_paged_kv *kv, const ekv_page_table *table,
                                   const float *q, int64_t stride, float *p, double *tau);

/* ---------------------------------------------------------------------------------- */
/* Exact entmax attention of many query rows, forward and backward (docs/math.md §13)  */
/* ---------------------------------------------------------------------------------- */
/*
 * The reference that prefill kernels and a training op are checked against: dense, exact,
 * computed in double, single-threaded. Contiguous tensors: q [T][H][D], k and v [N][Hk][D],
 * out, dout and dq [T][H][D], dk and dv [N][Hk][D], tau [T][H].
 */
typedef struct ekv_attention_params {
    int64_t num_queries;       /* T query rows per head, >= 1                                 */
    int64_t num_keys;          /* N keys, >= 1                                                */
    int32_t num_heads;         /* H query heads; a multiple of num_kv_heads                    */
    int32_t num_kv_heads;      /* Hk (query head h reads KV head h / (H / Hk))                 */
    int32_t head_dim;          /* D, 1..65536                                                 */
    int32_t causal;            /* 1: row t, at position i = N - T + t, sees keys j <= i (then  */
                               /* T <= N); 0: every row sees all N keys                        */
    double alpha;              /* 1 = softmax, (1, 4] = entmax (default 1.5)                   */
    float scale;               /* score scale; 0 = 1/sqrt(head_dim)                            */
    const float *alibi_slopes; /* [num_heads] slopes m_h >= 0 (bias -m_h |j - i|), or NULL     */
} ekv_attention_params;

/* T = N = 1, H = Hk = 1, D = 64, causal, alpha 1.5, scale 0, no ALiBi. */
EKV_API ekv_attention_params ekv_attention_default_params(void);

/*
 * out = entmax attention of every (row, head): s_j = scale q.k_j - m_h |j - i| over the keys
 * the row sees, p = alpha-entmax(s) with tau solved exactly (z-space, docs/math.md §0;
 * softmax: log-sum-exp), out = sum_j p_j v_j / sum_j p_j. tau (may be NULL) receives each
 * row's tau, [T][H], for the backward. q, k, v must be finite.
 */
EKV_API ekv_status ekv_entmax_attention_forward(ekv_context *ctx,
                                                const ekv_attention_params *params, const float *q,
                                                const float *k, const float *v, float *out,
                                                double *tau);
EKV_API ekv_status ekv_entmax_attention_forward_f64(ekv_context *ctx,
                                                    const ekv_attention_params *params,
                                                    const double *q, const double *k,
                                                    const double *v, double *out, double *tau);
/*
 * Gradients of a loss L(out) given dout = dL/dout (docs/math.md §13): p is recomputed from the
 * forward's tau, then with w_j = p_j^(2 - alpha) on the support (0 outside),
 * ds_j = w_j (dout.v_j - sum_S w dout.v / sum_S w), dq = scale sum_j ds_j k_j,
 * dk_j = scale sum over rows and the group's heads of ds_j q, dv_j = sum p_j dout. dq, dk and
 * dv are overwritten. A tau that is not the row's threshold (its weights sum to 0 or differ from
 * 1 by more than 1e-3) fails with EKV_ERR_INVALID_ARGUMENT; so does a gradient that overflows the
 * output type (alpha > 2 only: the Jacobian is unbounded near the support's edge, §13).
 */
EKV_API ekv_status ekv_entmax_attention_backward(ekv_context *ctx,
                                                 const ekv_attention_params *params, const float *q,
                                                 const float *k, const float *v, const double *tau,
                                                 const float *dout, float *dq, float *dk,
                                                 float *dv);
EKV_API ekv_status ekv_entmax_attention_backward_f64(
        ekv_context *ctx, const ekv_attention_params *params, const double *q, const double *k,
        const double *v, const double *tau, const double *dout, double *dq, double *dk, double *dv);

/*
 * o-hat = sum_S w_j v_j / sum_S w_j of every (row, head), [T][H][D], with w_j = p_j^(2 - alpha)
 * on the support from the forward's tau (as the backward recomputes them): the w-weighted mean
 * of the support's V rows, so that the backward's delta = dout . o-hat (docs/math.md §13.3);
 * the reference for the CUDA forward's (ekv_flash_entmax_args.ohat). Softmax: o-hat = out. A tau
 * that is not the forward's fails as in the backward.
 */
EKV_API ekv_status ekv_entmax_attention_ohat(ekv_context *ctx, const ekv_attention_params *params,
                                             const float *q, const float *k, const float *v,
                                             const double *tau, float *ohat);
EKV_API ekv_status ekv_entmax_attention_ohat_f64(ekv_context *ctx,
                                                 const ekv_attention_params *params,
                                                 const double *q, const double *k, const double *v,
                                                 const double *tau, double *ohat);

#ifdef __cplusplus
}
#endif
#endif /* ENTMAXKV_CORE_H */
