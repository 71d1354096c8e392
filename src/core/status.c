/* Status strings, dtype names, version. */
#include "internal.h"
#include <strings.h>

const char *ekv_status_string(ekv_status s) {
    switch (s) {
    case EKV_OK: return "ok";
    case EKV_ERR_NULL_POINTER: return "null pointer argument";
    case EKV_ERR_INVALID_SIZE: return "invalid size";
    case EKV_ERR_HEAD_MISMATCH: return "head count mismatch";
    case EKV_ERR_INVALID_ALPHA: return "invalid alpha";
    case EKV_ERR_INVALID_PAGE_SIZE: return "invalid page size";
    case EKV_ERR_INVALID_DTYPE: return "invalid dtype";
    case EKV_ERR_SIZE_OVERFLOW: return "size overflow";
    case EKV_ERR_OUT_OF_MEMORY: return "out of memory";
    case EKV_ERR_NAN_INPUT: return "non-finite input";
    case EKV_ERR_EMPTY_INPUT: return "empty input";
    case EKV_ERR_INVALID_SEQUENCE: return "invalid sequence";
    case EKV_ERR_CACHE_FULL: return "cache full";
    case EKV_ERR_INVALID_ARGUMENT: return "invalid argument";
    case EKV_ERR_UNSUPPORTED: return "unsupported";
    case EKV_ERR_INTERNAL: return "internal error";
    case EKV_ERR_DEVICE: return "CUDA device error";
    }
    return "unknown status";
}

const char *ekv_dtype_name(ekv_dtype dt) {
    switch (dt) {
    case EKV_DTYPE_F32: return "f32";
    case EKV_DTYPE_F16: return "f16";
    case EKV_DTYPE_BF16: return "bf16";
    }
    return NULL;
}

int64_t ekv_dtype_size(ekv_dtype dt) {
    switch (dt) {
    case EKV_DTYPE_F32: return 4;
    case EKV_DTYPE_F16: return 2;
    case EKV_DTYPE_BF16: return 2;
    }
    return 0;
}

ekv_status ekv_dtype_from_name(const char *name, ekv_dtype *out) {
    if (!name || !out) return EKV_ERR_NULL_POINTER;
    static const struct {
        const char *n;
        ekv_dtype d;
    } names[] = {
            {"f32", EKV_DTYPE_F32},   {"fp32", EKV_DTYPE_F32},      {"float32", EKV_DTYPE_F32},
            {"f16", EKV_DTYPE_F16},   {"fp16", EKV_DTYPE_F16},      {"float16", EKV_DTYPE_F16},
            {"bf16", EKV_DTYPE_BF16}, {"bfloat16", EKV_DTYPE_BF16},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcasecmp(name, names[i].n) == 0) {
            *out = names[i].d;
            return EKV_OK;
        }
    return EKV_ERR_INVALID_DTYPE;
}
