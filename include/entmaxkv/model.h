/* entmaxkv safetensors reader and model engine API. Included by <entmaxkv.h>. */
#ifndef ENTMAXKV_MODEL_H
#define ENTMAXKV_MODEL_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------- */
/* safetensors files (traces, model weights)                                            */
/* ---------------------------------------------------------------------------------- */
/*
 * A strict reader of the safetensors format: an 8-byte little-endian header length, a JSON
 * header {"name": {"dtype": "F16", "shape": [...], "data_offsets": [begin, end]}, ...,
 * "__metadata__": {...}}, then the data. Every field is validated (JSON syntax, known dtypes,
 * shape products against byte ranges, ranges inside the file and not overlapping, unique
 * names); a bad or truncated file gives EKV_ERR_INVALID_ARGUMENT with a message and never
 * crashes. The whole file is held in memory.
 */
typedef struct ekv_safetensors ekv_safetensors;

typedef struct ekv_tensor_info {
    const char *name;
    const char *dtype_name; /* as in the file: "F32", "F16", "BF16", "I64", ...           */
    int32_t dtype;          /* the ekv_dtype, or -1 for dtypes the library does not compute */
    int32_t ndim;           /* 0..8                                                        */
    int64_t shape[8];
    int64_t numel;
    const void *data; /* little-endian elements, valid until ekv_safetensors_free    */
    int64_t nbytes;
} ekv_tensor_info;

EKV_API ekv_status ekv_safetensors_open(ekv_context *ctx, const char *path, ekv_safetensors **out);
/* Parses a copy of buf[0..len). */
EKV_API ekv_status ekv_safetensors_parse(ekv_context *ctx, const void *buf, int64_t len,
                                         ekv_safetensors **out);
EKV_API int64_t ekv_safetensors_count(const ekv_safetensors *st);
EKV_API ekv_status ekv_safetensors_at(const ekv_safetensors *st, int64_t index,
                                      ekv_tensor_info *out);
/* EKV_ERR_INVALID_ARGUMENT if there is no tensor of that name. */
EKV_API ekv_status ekv_safetensors_find(const ekv_safetensors *st, const char *name,
                                        ekv_tensor_info *out);
/*
 * The file's "__metadata__": an object of string keys and string values (the format allows
 * nothing else: any other value, a repeated key or a NUL byte makes the file invalid).
 * ekv_safetensors_metadata returns the value of key, or NULL when the key is absent;
 * strings stay valid until ekv_safetensors_free.
 */
EKV_API const char *ekv_safetensors_metadata(const ekv_safetensors *st, const char *key);
EKV_API int64_t ekv_safetensors_metadata_count(const ekv_safetensors *st);
EKV_API ekv_status ekv_safetensors_metadata_at(const ekv_safetensors *st, int64_t index,
                                               const char **key, const char **value);
EKV_API void ekv_safetensors_free(ekv_safetensors *st);

/* ---- model engine ---- */
/*
 * The entmaxkv language model (train/MODEL.md): a decoder-only, pre-norm transformer with
 * RMSNorm, SwiGLU, GQA, NAPE positions (half the query heads ALiBi, half none) and alpha-entmax
 * attention, over a byte-level vocabulary. Weights come from safetensors (F16, BF16 or F32;
 * the hyper-parameters from its __metadata__, arch tag "entmaxkv-lm-v1"); the forward pass is
 * fp32 on the CPU, and attention runs through one ekv_cache per layer with any decode method.
 * The model holds one sequence: every ekv_model_step appends tokens at the next positions.
 */
typedef struct ekv_model ekv_model;

/* Attention methods are the select methods of entmaxkv/core.h (dense, topk, gaussian,
 * certified, screened; oracle is for evaluation and not a model method). screened needs
 * key codes in the caches: ekv_model_params.code_bits 4 or 8. */

/* The most layers a model file may have (its n_layers metadata). */
#define EKV_MODEL_MAX_LAYERS 1024

/* The largest cuda list sizes of ekv_model_params (prefill_candidates and prefill_compact;
 * decode_candidates). */
#define EKV_MODEL_MAX_PREFILL_CANDIDATES 65536
#define EKV_MODEL_MAX_DECODE_CANDIDATES  16384

/* Hyper-parameters, as read from the file's metadata. */
typedef struct ekv_model_config {
    int32_t vocab, d_model, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim;
    int32_t train_ctx;       /* 0 when the file does not say */
    int32_t tied_embeddings; /* 1: the output projection is tok_embeddings.weight */
    double alpha, norm_eps;
} ekv_model_config;

/* The kernel of a cuda dense prefill (docs/math.md §12): fused (S and P stay on the chip) or
 * the GEMM path (S and P in device memory, cuBLAS). EKV_PREFILL_FUSED_HIST is the fused kernel
 * with the histogram tau scheme (docs/math.md §12.1: a pass for each row's max and histogram,
 * then exact-size lists) instead of candidate rounds. A fused kernel where it does not apply
 * fails the load with EKV_ERR_UNSUPPORTED: nothing falls back silently. */
typedef enum {
    EKV_PREFILL_AUTO = 0,
    EKV_PREFILL_FUSED = 1,
    EKV_PREFILL_GEMM = 2,
    EKV_PREFILL_FUSED_HIST = 3
} ekv_prefill_kernel;

typedef struct ekv_model_params {
    int64_t max_tokens;       /* KV cache capacity of the sequence, in tokens (default 4096)      */
    int32_t page_size;        /* KV cache page size (default 16)                                  */
    ekv_dtype kv_dtype;       /* KV cache storage (default f16)                                   */
    int32_t superpage_pages;  /* superpage summaries for certified decode, 0 = none (default 16) */
    ekv_select_method method; /* default dense                                                  */
    double budget;            /* topk: fraction of each step's tokens to read; certified: sizes its
                                 round 1 (default 1/16)                                           */
    int32_t code_bits;        /* per-token key codes in every layer's cache (ekv_cache_params):
                                 0 = none (default), 4 or 8; method screened needs 4 or 8        */
    /* Where the forward pass runs (docs/architecture.md, "The model on the GPU"):
     * EKV_BACKEND_CPU (default) or EKV_BACKEND_CUDA (a build with -DEKV_CUDA=ON and a device;
     * otherwise loading fails with EKV_ERR_UNSUPPORTED). On CUDA the weights and the KV caches
     * live on the device; a block of n > 1 tokens with method dense is the tensor-core prefill
     * (exact entmax per query row), any other method runs its decode stages over the block's
     * prefix views as the CPU does; n = 1 is one decode step. Every method but oracle runs on
     * CUDA (gaussian's ALiBi mixture solved on the device); oracle is refused. */
    ekv_backend backend;
    int32_t device;        /* cuda: device ordinal (default 0)                                   */
    int32_t cuda_graphs;   /* cuda: 1 (default) = each decode step (n = 1, or a batched step)
                              replays a CUDA graph captured for its batch size, method and
                              budget (a few kept, the least recently used dropped); 0 = eager
                              launches                                                          */
    int64_t prefill_chunk; /* cuda dense prefill: query tokens per block; 0 (default) = as many
                              as fit the score buffers (docs/math.md §12)                       */
    int32_t max_seqs;      /* sequences the model holds, each of up to max_tokens tokens
                              (default 1, at most 4096); more than one on cuda only
                              (ekv_model_batch_step)                                            */
    ekv_prefill_kernel prefill_kernel; /* cuda dense prefill (docs/architecture.md, "The model
                              on the GPU"): EKV_PREFILL_AUTO (default) = the fused kernel with
                              the histogram scheme (as EKV_PREFILL_FUSED_HIST) where it
                              applies (f16/bf16 caches, head_dim 64 or 128), else the GEMMs    */
    /* cuda list sizes (docs/architecture.md, "The model on the GPU"): tests and benchmarks
     * shrink them to drive the slow paths or tune a trade. 0 = the default; a value outside
     * [0, most] fails the load with EKV_ERR_INVALID_SIZE on every backend. */
    int32_t prefill_candidates; /* fused dense prefill: tau candidates kept per query row,
                                   1 .. EKV_MODEL_MAX_PREFILL_CANDIDATES (0 = 32768 with the
                                   histogram scheme, at most max_tokens rounded up to 16,
                                   halved down to 4096 while its scratch passes a quarter of
                                   the free device memory; 4096 with the candidate scheme); a row
                                   with more is retried or solved by Newton passes
                                   (ekv_model_stats)                                           */
    int32_t prefill_compact;    /* fused dense prefill: the fill at which a row's list is
                                   compacted inside the sweep (docs/math.md §12),
                                   1 .. EKV_MODEL_MAX_PREFILL_CANDIDATES (0 = 1024), at most
                                   the candidates kept                                         */
    int32_t decode_candidates;  /* decode stages: tau candidates listed per query head (the
                                   plan's max_candidates, entmaxkv/cuda.h; also screened's
                                   screen list), 1 .. EKV_MODEL_MAX_DECODE_CANDIDATES
                                   (0 = the plan's default: a quarter of the context, at
                                   least 16384)                            */
    int32_t fused_attend;       /* cuda dense decode: 1 = tau and the values in one cooperative
                                   launch where it applies (ekv_cuda_plan_params.fused_attend,
                                   entmaxkv/cuda.h), 0 (default) = the candidates, tau and
                                   values launches; another value fails the load with
                                   EKV_ERR_INVALID_ARGUMENT on every backend                  */
    int32_t overlap_launches;   /* cuda: 1 = each kernel of a step may be launched while the one
                                   before it still runs (ekv_cuda_plan_params.overlap_launches;
                                   the same results; refused with EKV_ERR_UNSUPPORTED below
                                   compute capability 9.0), 0 = after it ends, -1 (default) = 1
                                   where the GPU supports it, else 0; another value fails the
                                   load with EKV_ERR_INVALID_ARGUMENT on every backend        */
    int32_t tau_cluster;        /* cuda entmax decode: 2, 4 or 8 = a head listing more than
                                   4096 tau candidates (the plan's tau_spread_min) solved by a
                                   cluster of that many blocks (ekv_cuda_plan_params.tau_cluster;
                                   refused below compute capability 9.0), 0 = one block, -1
                                   (default) = 8 where the GPU supports clusters, else 0;
                                   another value fails the load with EKV_ERR_INVALID_ARGUMENT
                                   on every backend                                           */
} ekv_model_params;

/* What attention read, summed over steps since the last reset. */
typedef struct ekv_model_stats {
    int64_t steps;        /* (token, layer) attention steps                                      */
    int64_t bytes_read;   /* K and V bytes read plus the page statistics read by selection       */
    int64_t bytes_kv;     /* K + V bytes of the attended tokens: what reading everything costs    */
    int64_t lists_round2; /* certified: page lists that needed round 2                           */
    int64_t lists;        /* certified: page lists (one per KV head and step)                    */
    int64_t survivors;    /* screened: (token, query head) pairs the screen kept                 */
    int64_t prefill_fused; /* cuda: (token, layer) dense prefill steps the fused kernel ran       */
    int64_t prefill_gemm;  /* cuda: (token, layer) dense prefill steps the GEMM path ran          */
    int64_t prefill_retry_rows;  /* fused: (token, head, layer) rows whose candidates overflowed
                                    (solved on a second round or by Newton passes)            */
    int64_t prefill_newton_rows; /* fused: rows solved by Newton passes over their keys        */
    int64_t tau_compacted_rows;  /* cuda decode stages: (token, query head, layer) rows whose tau
                                    candidates overflowed the list and were compacted (rebuilt
                                    from the scores above a lower bound of tau)               */
    int64_t tau_whole_rows;      /* cuda: rows whose compacted list overflowed too (tau solved
                                    over the whole score row: the slow path)                  */
    int64_t screen_retry_rows;   /* cuda screened: rows whose screen list overflowed and took the
                                    retry pass                                                */
    int64_t screen_all_rows;     /* cuda screened: rows whose retry list overflowed too (every
                                    token kept: a dense step for that head)                   */
    int64_t prefill_compacted_rows; /* fused: rows whose candidate list was compacted inside
                                       round 0's sweep (to the scores above the threshold of
                                       the kept ones); most need no retry then            */
    int64_t graph_steps; /* cuda: (token, layer) decode steps replayed from a captured CUDA
                            graph (cuda_graphs 1; the others ran their launches eagerly)    */
    int64_t prefill_tiles_skipped; /* fused, histogram scheme: (64-row block, 64-key tile)
                                      pairs its list sweep skipped (no row counted a z there:
                                      docs/math.md §12.1, "Tile marks")                     */
    int64_t prefill_tiles_unreached; /* fused, histogram scheme: (64-row block, 64-key tile)
                                        pairs its first sweep stopped before (past ALiBi's
                                        reach: docs/math.md §12.1, "ALiBi's reach")         */
} ekv_model_stats;

EKV_API ekv_model_params ekv_model_default_params(void);
/*
 * Loads and validates a model: the arch tag and every hyper-parameter, then every tensor's
 * presence, dtype, shape and finiteness (no unknown tensors). A bad file gives
 * EKV_ERR_INVALID_ARGUMENT (EKV_ERR_UNSUPPORTED for another arch tag) with a message in
 * ekv_last_error(ctx). The model keeps ctx (its threads) until ekv_model_free.
 */
EKV_API ekv_status ekv_model_load(ekv_context *ctx, const char *path,
                                  const ekv_model_params *params, ekv_model **out);
/* The same from an opened file; the weights are copied, st may be freed afterwards. */
EKV_API ekv_status ekv_model_from_safetensors(ekv_context *ctx, const ekv_safetensors *st,
                                              const ekv_model_params *params, ekv_model **out);
EKV_API void ekv_model_free(ekv_model *model);
EKV_API const ekv_model_config *ekv_model_get_config(const ekv_model *model);
/* Where the model runs (ekv_model_params.backend). On EKV_BACKEND_CUDA the statistics count
 * steps and bytes_kv only: what the device stages read is not measured (bytes_read,
 * lists_round2, lists and survivors stay 0). */
EKV_API ekv_backend ekv_model_backend(const ekv_model *model);
/* Changes the decode method for the next steps (budget as in ekv_model_params). screened
 * fails (EKV_ERR_INVALID_ARGUMENT) on a model loaded with code_bits 0: its caches hold no
 * key codes. */
EKV_API ekv_status ekv_model_set_method(ekv_model *model, ekv_select_method method, double budget);
/* Empties the sequence (position 0) and zeroes the statistics. */
EKV_API ekv_status ekv_model_reset(ekv_model *model);
/* Tokens in the sequence (the position of the next token). */
EKV_API int64_t ekv_model_position(const ekv_model *model);
/*
 * Runs n tokens at the next positions: a prefill block or (n = 1) one decode step. Each token
 * attends over itself and every earlier token with the model's method; prefilling in blocks
 * gives the same result as one token at a time. logits, if not NULL, receives [n][vocab]
 * (the prediction after each token). Tokens must be in [0, vocab); EKV_ERR_CACHE_FULL when
 * the sequence would pass params.max_tokens. Logits that are not finite (finite weights so
 * large that the forward pass overflows fp32) are EKV_ERR_NAN_INPUT with a message naming the
 * position, on either backend: the tokens were run, nothing is returned as a prediction. On
 * error the model should be reset.
 */
EKV_API ekv_status ekv_model_step(ekv_model *model, const int32_t *tokens, int64_t n,
                                  float *logits);
/*
 * Several sequences (ekv_model_params.max_seqs > 1, backend cuda): ekv_model_step,
 * ekv_model_position and ekv_model_reset act on sequence 0 (reset: on every sequence);
 * ekv_model_seq_step runs n tokens of sequence seq, as ekv_model_step does for sequence 0;
 * ekv_model_batch_step runs one decode step of n_seqs distinct sequences together (token
 * tokens[b] appended to sequence seqs[b]; logits [n_seqs][vocab]): one batch of the decode
 * stages over their ragged page lists (docs/architecture.md, "The model on the GPU").
 * n_seqs is at most max_seqs (the decode plan's batch is sized for all of them). A refused
 * call changes nothing; logits that are not finite fail as in ekv_model_step, after the step.
 */
EKV_API ekv_status ekv_model_seq_step(ekv_model *model, int32_t seq, const int32_t *tokens,
                                      int64_t n, float *logits);
EKV_API ekv_status ekv_model_batch_step(ekv_model *model, const int32_t *seqs, int32_t n_seqs,
                                        const int32_t *tokens, float *logits);
/* Tokens in sequence seq (-1 if seq is out of range); empties one sequence. */
EKV_API int64_t ekv_model_seq_position(const ekv_model *model, int32_t seq);
EKV_API ekv_status ekv_model_seq_reset(ekv_model *model, int32_t seq);
/* Keeps the first n_tokens tokens of sequence seq (0 <= n_tokens <= its position; sequence 0
 * is the one of ekv_model_step): the next step runs at position n_tokens as if the later
 * tokens had never been run (the caches' later pages are dropped, a page kept in part is
 * summarised again from its kept keys; ekv_cache_truncate). One prompt, several
 * continuations (`entmaxkv run --methods`). Out of range: EKV_ERR_INVALID_SIZE, nothing
 * changed; on a failure past that (out of memory for a key row, a CUDA error) reset the model. */
EKV_API ekv_status ekv_model_seq_truncate(ekv_model *model, int32_t seq, int64_t n_tokens);
/* Statistics of one layer, or of all layers summed (layer = -1). */
EKV_API ekv_status ekv_model_get_stats(const ekv_model *model, int32_t layer, ekv_model_stats *out);
EKV_API void ekv_model_reset_stats(ekv_model *model);
/* Byte-level tokenizer: tokens[i] = (unsigned char)text[i]; returns len. */
EKV_API int64_t ekv_model_tokenize(const char *text, int64_t len, int32_t *tokens);
/* The cache of a layer (one sequence, *seq) and the queries [n_heads][head_dim] (before the
 * 1/sqrt(head_dim) scale) of the last token run at that layer: for traces and evaluation. */
EKV_API ekv_status ekv_model_layer_cache(const ekv_model *model, int32_t layer,
                                         const ekv_cache **cache, int32_t *seq);
/* On the CUDA backend the layer caches live on the device: ekv_model_layer_cache copies the
 * layer's K/V pages and rebuilds a host cache from them (ekv_cache_seq_adopt; valid until the
 * next step, reset or ekv_model_layer_cache of that layer), and ekv_model_last_query copies the
 * queries back. */
EKV_API ekv_status ekv_model_last_query(const ekv_model *model, int32_t layer, float *q);
/* NAPE slopes [n_heads] (docs/math.md §1.6), as the model's attention uses them. */
EKV_API ekv_status ekv_model_alibi_slopes(const ekv_model *model, float *slopes);

#ifdef __cplusplus
}
#endif
#endif /* ENTMAXKV_MODEL_H */
