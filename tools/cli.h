/* Helpers shared by the CLI's subcommands (not part of the library). */
#ifndef EKV_CLI_H
#define EKV_CLI_H
#include "entmaxkv.h"
#include <stdint.h>
#include <stdio.h>

/* Exit codes: 0 ok, 1 runtime failure, 2 bad usage. */
#define CLI_USAGE 2

/* Prints "entmaxkv SUB: message" to stderr and exits with code 2. */
void cli_usage_error(const char *sub, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));
/* Parses a non-negative integer with optional k/K (1024) or M (1048576) suffix. */
int cli_parse_i64(const char *s, int64_t *out);
int cli_parse_double(const char *s, double *out);
/* Parses a comma-separated list of integers into out[max]; returns count or -1. */
int cli_parse_i64_list(const char *s, int64_t *out, int max);
double cli_now_seconds(void);

/* xoshiro256+ stream with Gaussian samples (fast fill of synthetic workloads). */
typedef struct { uint64_t s[4]; int has_spare; double spare; } cli_rng;
void cli_rng_seed(cli_rng *r, uint64_t seed);
double cli_rng_normal(cli_rng *r);
void cli_fill_normal(cli_rng *r, float *x, int64_t n);

/* Read bandwidth of this machine with `threads` threads over a buffer of `bytes`. GB/s. */
double cli_read_bandwidth_probe(int threads, int64_t bytes);

int cmd_bench(int argc, char **argv);
#endif
