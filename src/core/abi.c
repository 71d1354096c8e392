/* The sizes of the public structs, for bindings that mirror them (ekv_abi_sizeof). */
#include "internal.h"
#include <string.h>

int64_t ekv_abi_sizeof(const char *type_name) {
    static const struct {
        const char *name;
        int64_t size;
    } types[] = {
            {"ekv_paged_kv", sizeof(ekv_paged_kv)},
            {"ekv_page_stats", sizeof(ekv_page_stats)},
            {"ekv_page_table", sizeof(ekv_page_table)},
            {"ekv_cache_params", sizeof(ekv_cache_params)},
            {"ekv_decode_params", sizeof(ekv_decode_params)},
            {"ekv_decode_info", sizeof(ekv_decode_info)},
            {"ekv_select_params", sizeof(ekv_select_params)},
            {"ekv_context_params", sizeof(ekv_context_params)},
            {"ekv_attention_params", sizeof(ekv_attention_params)},
            {"ekv_cuda_plan_params", sizeof(ekv_cuda_plan_params)},
            {"ekv_cuda_report", sizeof(ekv_cuda_report)},
            {"ekv_cuda_append_item", sizeof(ekv_cuda_append_item)},
            {"ekv_cuda_sharded_params", sizeof(ekv_cuda_sharded_params)},
            {"ekv_cuda_sharded_report", sizeof(ekv_cuda_sharded_report)},
            {"ekv_cuda_cache_params", sizeof(ekv_cuda_cache_params)},
            {"ekv_flash_entmax_args", sizeof(ekv_flash_entmax_args)},
    };
    if (!type_name) return -1;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (!strcmp(types[i].name, type_name)) return types[i].size;
    return -1;
}
