/*
 * The safetensors reader on valid files, on every truncation of a valid file, on a table of
 * malformed headers, and on random mutations (a deterministic in-process fuzz run; the
 * libFuzzer target is tests/fuzz/fuzz_safetensors.c). Bad input must give
 * EKV_ERR_INVALID_ARGUMENT with a message, never a crash (ASan/UBSan in CI).
 */
#include "entmaxkv.h"
#include "test_util.h"
#include <string.h>

/* Builds header-length + header + data into buf; returns the total length. */
static int64_t make_file(unsigned char *buf, const char *header, const unsigned char *data,
                         int64_t dlen) {
    uint64_t hl = strlen(header);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(hl >> (8 * i));
    memcpy(buf + 8, header, hl);
    memcpy(buf + 8 + hl, data, (size_t)dlen);
    return 8 + (int64_t)hl + dlen;
}

static ekv_status parse(ekv_context *ctx, const unsigned char *b, int64_t n) {
    ekv_safetensors *st = NULL;
    ekv_status s = ekv_safetensors_parse(ctx, b, n, &st);
    if (s == EKV_OK) {
        /* touch everything the reader promises */
        for (int64_t i = 0; i < ekv_safetensors_count(st); i++) {
            ekv_tensor_info t;
            ekv_safetensors_at(st, i, &t);
            volatile unsigned char acc = 0;
            for (int64_t k = 0; k < t.nbytes; k++) acc ^= ((const unsigned char *)t.data)[k];
            (void)acc;
            (void)strlen(t.name);
        }
        for (int64_t i = 0; i < ekv_safetensors_metadata_count(st); i++) {
            const char *k, *v;
            ekv_safetensors_metadata_at(st, i, &k, &v);
            if (ekv_safetensors_metadata(st, k) != v)
                g_failures++; /* keys are unique: the lookup finds this pair */
            (void)strlen(v);
        }
        ekv_safetensors_free(st);
    }
    return s;
}

int main(void) {
    ekv_context *ctx;
    if (ekv_context_create(NULL, &ctx)) return 1;
    static unsigned char buf[1 << 16], data[4096];
    for (int i = 0; i < 4096; i++) data[i] = (unsigned char)(i * 37 + 11);
    const char *good = "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"a\\\"b\\u00e9\"},"
                       "\"q\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
                       "\"k\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[24,32]},"
                       "\"v\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[32,40]},"
                       "\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[40,48]},"
                       "\"e\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[48,48]}}";
    int64_t n = make_file(buf, good, data, 48);
    ekv_safetensors *st;
    CHECK(ekv_safetensors_parse(ctx, buf, n, &st) == EKV_OK, "valid file: %s", ekv_last_error(ctx));
    CHECK(ekv_safetensors_count(st) == 5, "count %lld", (long long)ekv_safetensors_count(st));
    ekv_tensor_info t;
    CHECK(ekv_safetensors_find(st, "q", &t) == EKV_OK && t.dtype == EKV_DTYPE_F32 && t.ndim == 2 &&
                  t.shape[0] == 2 && t.shape[1] == 3 && t.numel == 6 && t.nbytes == 24 &&
                  !memcmp(t.data, data, 24),
          "tensor q");
    CHECK(ekv_safetensors_find(st, "k", &t) == EKV_OK && t.dtype == EKV_DTYPE_F16 &&
                  !memcmp(t.data, data + 24, 8),
          "k");
    CHECK(ekv_safetensors_find(st, "v", &t) == EKV_OK && t.dtype == EKV_DTYPE_BF16 &&
                  !strcmp(t.dtype_name, "BF16"),
          "v");
    CHECK(ekv_safetensors_find(st, "s", &t) == EKV_OK && t.dtype == -1 && t.ndim == 0 &&
                  t.numel == 1,
          "scalar I64");
    CHECK(ekv_safetensors_find(st, "e", &t) == EKV_OK && t.numel == 0 && t.nbytes == 0,
          "empty tensor");
    CHECK(ekv_safetensors_find(st, "nope", &t) == EKV_ERR_INVALID_ARGUMENT, "missing name");
    /* metadata: string pairs, escapes decoded, absent keys NULL */
    CHECK(ekv_safetensors_metadata_count(st) == 2, "metadata count %lld",
          (long long)ekv_safetensors_metadata_count(st));
    const char *mv = ekv_safetensors_metadata(st, "format");
    CHECK(mv && !strcmp(mv, "pt"), "metadata format = %s", mv ? mv : "(null)");
    mv = ekv_safetensors_metadata(st, "note");
    CHECK(mv && !strcmp(mv, "a\"b\xc3\xa9"), "metadata note = %s", mv ? mv : "(null)");
    CHECK(ekv_safetensors_metadata(st, "absent") == NULL &&
                  ekv_safetensors_metadata(st, NULL) == NULL,
          "absent key");
    const char *mk, *mval;
    CHECK(ekv_safetensors_metadata_at(st, 1, &mk, &mval) == EKV_OK && !strcmp(mk, "note"),
          "metadata_at 1");
    CHECK(ekv_safetensors_metadata_at(st, 2, &mk, &mval) == EKV_ERR_INVALID_ARGUMENT,
          "metadata_at past the end");
    ekv_safetensors_free(st);
    { /* a long value (past any fixed buffer), an empty object, and no metadata at all */
        static char hdr[12000];
        int k = snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"long\":\"");
        for (int i = 0; i < 9000; i++) hdr[k++] = (char)('a' + i % 26);
        snprintf(hdr + k, sizeof hdr - (size_t)k,
                 "\"},\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}");
        n = make_file(buf, hdr, data, 4);
        CHECK(ekv_safetensors_parse(ctx, buf, n, &st) == EKV_OK, "long metadata: %s",
              ekv_last_error(ctx));
        mv = ekv_safetensors_metadata(st, "long");
        CHECK(mv && strlen(mv) == 9000 && mv[8999] == 'a' + 8999 % 26, "long metadata value");
        ekv_safetensors_free(st);
        n = make_file(
                buf,
                "{\"__metadata__\":{},\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
                data, 4);
        CHECK(ekv_safetensors_parse(ctx, buf, n, &st) == EKV_OK &&
                      ekv_safetensors_metadata_count(st) == 0,
              "empty metadata");
        ekv_safetensors_free(st);
    }

    /* every truncation of the valid file is an error, never a crash */
    int bad_trunc = 0;
    for (int64_t k = 0; k < n; k++) bad_trunc += parse(ctx, buf, k) == EKV_ERR_INVALID_ARGUMENT;
    CHECK(bad_trunc == n, "%d of %lld truncations rejected", bad_trunc, (long long)n);

    /* malformed headers */
    static const char *bad[] = {
            "",
            "{",
            "[]",
            "{\"a\":1}",
            "{\"a\":{}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}",
            "{\"a\":{\"dtype\":\"F99\",\"shape\":[1],\"data_offsets\":[0,4]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4000000]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[01],\"data_offsets\":[0,4]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,4]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,4]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
            "{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}} x",
            "{\"a\\q\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
            "{\"a\\u12\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
            "{\"a\\u0000b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
            "{\"__metadata__\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},}",
            "{\"a\" {\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
            "{\"a\":{\"dtype\":F32,\"shape\":[1],\"data_offsets\":[0,4]}}",
            /* __metadata__ is an object of strings, keys unique, once */
            "{\"__metadata__\":{\"n\":1}}",
            "{\"__metadata__\":{\"n\":[\"a\"]}}",
            "{\"__metadata__\":{\"n\":null}}",
            "{\"__metadata__\":{\"n\":{}}}",
            "{\"__metadata__\":\"x\"}",
            "{\"__metadata__\":[]}",
            "{\"__metadata__\":{\"n\":\"1\",\"n\":\"2\"}}",
            "{\"__metadata__\":{},\"__metadata__\":{}}",
            "{\"__metadata__\":{\"n\":\"a\\u0000b\"}}",
            "{\"__metadata__\":{\"n\":\"1\",}}",
            "{\"__metadata__\":{\"n\" \"1\"}}",
            "{\"__metadata__\":{\"n\":\"1\"",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int64_t m = make_file(buf, bad[i], data, 64);
        ekv_status s = parse(ctx, buf, m);
        CHECK(s == EKV_ERR_INVALID_ARGUMENT, "bad header %zu accepted (%d): %s", i, s, bad[i]);
        CHECK(strlen(ekv_last_error(ctx)) > 0, "bad header %zu: no message", i);
        if (getenv("EKV_TEST_VERBOSE")) printf("  %zu: %s\n", i, ekv_last_error(ctx));
    }
    /* a header length larger than the file, and one past the 100 MiB limit */
    n = make_file(buf, good, data, 48);
    buf[0] = 0xff;
    buf[1] = 0xff;
    buf[2] = 0xff;
    buf[3] = 0x7f;
    CHECK(parse(ctx, buf, n) == EKV_ERR_INVALID_ARGUMENT, "huge header length");
    /* random mutations of the valid file: no crash, only OK or INVALID_ARGUMENT */
    test_rng r = {12345};
    int ok = 0, rejected = 0, other = 0;
    for (int it = 0; it < 20000; it++) {
        n = make_file(buf, good, data, 48);
        int flips = 1 + (int)(test_next(&r) % 4);
        for (int f = 0; f < flips; f++) {
            int64_t pos = (int64_t)(test_next(&r) % (uint64_t)n);
            int kind = (int)(test_next(&r) % 3);
            if (kind == 0)
                buf[pos] = (unsigned char)test_next(&r);
            else if (kind == 1)
                buf[pos] ^= (unsigned char)(1u << (test_next(&r) % 8));
            else
                buf[pos] = "{}[]\":,0123456789-e.\\u"[test_next(&r) % 23];
        }
        int64_t len = test_next(&r) % 5 == 0 ? (int64_t)(test_next(&r) % (uint64_t)n) : n;
        ekv_status s = parse(ctx, buf, len);
        ok += s == EKV_OK;
        rejected += s == EKV_ERR_INVALID_ARGUMENT;
        other += s != EKV_OK && s != EKV_ERR_INVALID_ARGUMENT;
    }
    printf("mutations: %d accepted, %d rejected, %d other\n", ok, rejected, other);
    CHECK(other == 0, "%d mutations gave a status other than OK / INVALID_ARGUMENT", other);
    CHECK(rejected > 1000 && ok > 10,
          "the mutation run did not exercise both outcomes (%d ok, %d rejected)", ok, rejected);
    /* NULLs and files */
    CHECK(ekv_safetensors_parse(ctx, NULL, 4, &st) == EKV_ERR_NULL_POINTER, "NULL buf");
    CHECK(ekv_safetensors_open(ctx, "/nonexistent/x.safetensors", &st) == EKV_ERR_INVALID_ARGUMENT,
          "missing file");
    ekv_context_free(ctx);
    return test_finish("test_safetensors");
}
