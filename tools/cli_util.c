/* CLI support: argument parsing, timing, random numbers, the read-bandwidth probe. */
#define _GNU_SOURCE /* madvise */
#include "cli.h"
#include <sys/mman.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void cli_usage_error(const char *sub, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "entmaxkv %s: ", sub);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (see 'entmaxkv %s --help')\n", sub);
    exit(CLI_USAGE);
}

const char *cli_need(const char *sub, int argc, char **argv, int *i) {
    if (*i + 1 >= argc) cli_usage_error(sub, "%s needs a value", argv[*i]);
    return argv[++*i];
}

ekv_dtype cli_need_dtype(const char *sub, int argc, char **argv, int *i) {
    const char *v = cli_need(sub, argc, argv, i);
    ekv_dtype dt = EKV_DTYPE_F32;
    if (ekv_dtype_from_name(v, &dt))
        cli_usage_error(sub, "%s %s: expected f32, f16 or bf16", argv[*i - 1], v);
    return dt;
}

ekv_select_method cli_method(const char *sub, const char *what, const char *name) {
    ekv_select_method m = EKV_SELECT_DENSE;
    if (!ekv_method_from_name(name, &m)) return m;
    char names[256] = "";
    for (int k = 0; k < EKV_SELECT_METHOD_COUNT; k++) /* the library's names, in its order */
        snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", k ? ", " : "",
                 ekv_method_name((ekv_select_method)k));
    cli_usage_error(sub, "%s '%s': unknown method (expected one of %s)", what, name, names);
}

ekv_select_method cli_need_method(const char *sub, int argc, char **argv, int *i) {
    const char *v = cli_need(sub, argc, argv, i);
    return cli_method(sub, argv[*i - 1], v);
}

int cli_method_codes(ekv_select_method m) { return m == EKV_SELECT_SCREENED; }

int32_t cli_need_code_bits(const char *sub, int argc, char **argv, int *i) {
    const char *v = cli_need(sub, argc, argv, i);
    if (strcmp(v, "4") && strcmp(v, "8"))
        cli_usage_error(sub, "%s %s: expected 4 or 8 (bits per key channel)", argv[*i - 1], v);
    return v[0] == '4' ? 4 : 8;
}

int cli_take(const char *sub, const cli_opt *table, size_t n, int argc, char **argv, int *i,
             void *opts) {
    for (size_t k = 0; k < n; k++) {
        const cli_opt *t = &table[k];
        if (strcmp(argv[*i], t->name)) continue;
        char *field = (char *)opts + t->offset;
        if (t->kind == CLI_OPT_STR)
            *(const char **)field = cli_need(sub, argc, argv, i);
        else if (t->kind == CLI_OPT_INT)
            *(int64_t *)field = cli_need_int(sub, argc, argv, i, t->lo, t->hi);
        else
            *(int *)field = 1;
        return 1;
    }
    return 0;
}

void cli_parse(const char *sub, int argc, char **argv, void (*help)(FILE *), cli_take_fn take,
               void *opts) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            help(stdout);
            exit(0);
        }
        if (!take(sub, argc, argv, &i, opts)) cli_usage_error(sub, "unknown option '%s'", argv[i]);
    }
}

int64_t cli_need_int(const char *sub, int argc, char **argv, int *i, int64_t lo, int64_t hi) {
    const char *opt = argv[*i], *v = cli_need(sub, argc, argv, i);
    int64_t x;
    if (cli_parse_i64(v, &x) || x < lo || x > hi)
        cli_usage_error(sub, "%s %s: expected an integer in [%lld, %lld]", opt, v, (long long)lo,
                        (long long)hi);
    return x;
}

int cli_parse_i64(const char *s, int64_t *out) {
    if (!s || !*s) return -1;
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || v < 0) return -1;
    int64_t mul = 1;
    if (*end == 'k' || *end == 'K') {
        mul = 1024;
        end++;
    } else if (*end == 'm' || *end == 'M') {
        mul = 1048576;
        end++;
    }
    if (*end) return -1;
    if (v > INT64_MAX / mul) return -1;
    *out = (int64_t)v * mul;
    return 0;
}

int cli_parse_double(const char *s, double *out) {
    if (!s || !*s) return -1;
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    if (errno || end == s || *end) return -1;
    *out = v;
    return 0;
}

int cli_parse_fraction(const char *s, double *out) {
    const char *slash = strchr(s, '/');
    if (!slash) return cli_parse_double(s, out);
    char num[64];
    size_t n = (size_t)(slash - s);
    if (n == 0 || n >= sizeof num) return -1;
    memcpy(num, s, n);
    num[n] = 0;
    double a, b;
    if (cli_parse_double(num, &a) || cli_parse_double(slash + 1, &b) || b == 0) return -1;
    *out = a / b;
    return 0;
}

int cli_parse_i64_list(const char *s, int64_t *out, int max) {
    int n = 0;
    char buf[1024];
    if (strlen(s) >= sizeof buf) return -1;
    strcpy(buf, s);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        if (n >= max || cli_parse_i64(tok, &out[n])) return -1;
        n++;
    }
    return n;
}

static volatile sig_atomic_t g_interrupted;
static void on_interrupt(int sig) {
    g_interrupted = 1;
    signal(sig, SIG_DFL); /* a second Ctrl-C ends the process */
}
void cli_catch_interrupt(void) { signal(SIGINT, on_interrupt); }
int cli_interrupted(void) { return g_interrupted != 0; }

double cli_now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

void cli_rng_seed(cli_rng *r, uint64_t seed) {
    uint64_t z = seed;
    for (int i = 0; i < 4; i++) { /* splitmix64 */
        z += 0x9e3779b97f4a7c15ull;
        uint64_t x = z;
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
        r->s[i] = x ^ (x >> 31);
    }
    r->has_spare = 0;
}

static uint64_t rng_next(cli_rng *r) {
    uint64_t *s = r->s, res = s[0] + s[3], t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return res;
}

double cli_rng_uniform(cli_rng *r) {
    return ((rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

double cli_rng_normal(cli_rng *r) {
    if (r->has_spare) {
        r->has_spare = 0;
        return r->spare;
    }
    double u = cli_rng_uniform(r), v = cli_rng_uniform(r);
    double rad = sqrt(-2.0 * log(u)), th = 6.283185307179586 * v;
    r->spare = rad * sin(th);
    r->has_spare = 1;
    return rad * cos(th);
}

void cli_fill_normal(cli_rng *r, float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)cli_rng_normal(r);
}

/* ---- read-bandwidth probe: each thread sums its slice with 8 independent integer
 * accumulators (which the compiler vectorises), the same access pattern as a K pass. */
typedef struct {
    const uint64_t *p;
    int64_t n;
    uint64_t sum;
} probe_arg;

static void *probe_thread(void *vp) {
    probe_arg *a = vp;
    uint64_t acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= a->n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a->p[i + j];
    for (; i < a->n; i++) acc[0] += a->p[i];
    uint64_t s = 0;
    for (int j = 0; j < 8; j++) s += acc[j];
    a->sum = s;
    return NULL;
}

double cli_read_bandwidth_probe(int threads, int64_t bytes) {
    if (threads < 1) threads = 1;
    int64_t n = bytes / 8;
    /* same allocation policy as the cache pool (2 MiB aligned, transparent huge pages) */
    const size_t huge = (size_t)2 << 20, sz = ((size_t)n * 8 + huge - 1) / huge * huge;
    uint64_t *buf = NULL;
    if (posix_memalign((void **)&buf, huge, sz) != 0) return 0;
#ifdef MADV_HUGEPAGE
    madvise(buf, sz, MADV_HUGEPAGE);
#endif
    for (int64_t i = 0; i < n; i++) buf[i] = (uint64_t)i * 0x9e3779b97f4a7c15ull; /* not zeros */
    double rates[7];
    volatile uint64_t sink = 0;
    for (int rep = 0; rep < 7; rep++) {
        pthread_t th[256];
        probe_arg args[256];
        int nt = threads > 256 ? 256 : threads;
        double t0 = cli_now_seconds();
        for (int t = 0; t < nt; t++) {
            int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
            args[t].p = buf + lo;
            args[t].n = hi - lo;
            if (t > 0) pthread_create(&th[t], NULL, probe_thread, &args[t]);
        }
        probe_thread(&args[0]);
        for (int t = 1; t < nt; t++) pthread_join(th[t], NULL);
        double dt = cli_now_seconds() - t0;
        for (int t = 0; t < nt; t++) sink += args[t].sum;
        rates[rep] = (double)n * 8 / dt / 1e9;
    }
    (void)sink;
    free(buf);
    /* median of 7, the same statistic the bench reports for the decode step */
    for (int i = 1; i < 7; i++)
        for (int k = i; k > 0 && rates[k] < rates[k - 1]; k--) {
            double t = rates[k];
            rates[k] = rates[k - 1];
            rates[k - 1] = t;
        }
    return rates[3];
}

int cli_out_open(cli_out *o, const char *sub, const char *path) {
    o->json = NULL;
    o->text = stdout;
    if (!path) return 0;
    if (!strcmp(path, "-")) { /* stdout carries the JSON alone */
        o->json = stdout;
        o->text = stderr;
        return 0;
    }
    o->json = fopen(path, "w");
    if (!o->json) {
        fprintf(stderr, "entmaxkv %s: cannot write %s: %s\n", sub, path, strerror(errno));
        return 1;
    }
    return 0;
}

int cli_out_close(cli_out *o, const char *sub) {
    if (!o->json) return 0;
    int bad = ferror(o->json) != 0;
    if (o->json == stdout)
        bad = fflush(stdout) != 0 || bad;
    else
        bad = fclose(o->json) != 0 || bad;
    o->json = NULL;
    if (bad) fprintf(stderr, "entmaxkv %s: writing the JSON failed\n", sub);
    return bad;
}
