/*
 * entmaxkv — long-context decoding with alpha-entmax attention.
 *
 * The umbrella header: the API lives in three headers by concern,
 *   entmaxkv/core.h   status, dtypes, context, entmax, KV views, the cache, CPU decode
 *   entmaxkv/cuda.h   the CUDA backend (plans, decode, append)
 *   entmaxkv/model.h  the safetensors reader and the model engine
 * and this header includes all three.
 */
#ifndef ENTMAXKV_H
#define ENTMAXKV_H

#include "entmaxkv/core.h"
#include "entmaxkv/cuda.h"
#include "entmaxkv/model.h"

#endif /* ENTMAXKV_H */
