/* CLI support: argument parsing, timing, random numbers, the read-bandwidth probe. */
#define _GNU_SOURCE /* madvise */
#include "cli.h"
#include <sys/mman.h>
#include <sys/stat.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
    if (end == s || *end) return -1;
    /* ERANGE is both overflow (refused: the value is not a double) and underflow, where strtod
     * gives the nearest double (a subnormal or 0), as it rounds any decimal: 1e-320 is a
     * number, in [0, 100] for --temp */
    if (errno == ERANGE && isinf(v)) return -1;
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
    /* a positive denominator: "-1/-16" is not 1/16 (the sign goes on the numerator) */
    if (cli_parse_double(num, &a) || cli_parse_double(slash + 1, &b) || !(b > 0)) return -1;
    *out = a / b;
    return 0;
}

int cli_split_list(const char *sub, const char *opt, const char *s, char *buf, size_t cap,
                   char **items, int max) {
    if (strlen(s) >= cap)
        cli_usage_error(sub, "%s is too long (%zu characters at most)", opt, cap - 1);
    strcpy(buf, s);
    int n = 0;
    for (char *t = buf;; n++) {
        char *comma = strchr(t, ',');
        if (comma) *comma = 0;
        if (!*t)
            cli_usage_error(sub, "%s '%s': entry %d is empty (expected a comma list such as a,b)",
                            opt, s, n + 1);
        if (n == max) cli_usage_error(sub, "%s '%s': at most %d entries", opt, s, max);
        items[n] = t;
        if (!comma) return n + 1;
        t = comma + 1;
    }
}

int cli_parse_i64_list(const char *sub, const char *opt, const char *s, int64_t *out, int max) {
    const size_t cap = strlen(s) + 1;
    char *buf = malloc(cap), **items = malloc(sizeof(char *) * (size_t)(max > 0 ? max : 1));
    if (!buf || !items) {
        fprintf(stderr, "entmaxkv %s: out of memory\n", sub);
        exit(1);
    }
    const int n = cli_split_list(sub, opt, s, buf, cap, items, max);
    for (int k = 0; k < n; k++)
        if (cli_parse_i64(items[k], &out[k]))
            cli_usage_error(sub, "%s '%s': '%s' is not a non-negative integer", opt, s, items[k]);
    free(items);
    free(buf);
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

/* ---- output files, written whole or not at all (docs/cli.md, "Common rules") ---- */

static char *dup_str(const char *s) {
    char *d = malloc(strlen(s) + 1);
    if (d) strcpy(d, s);
    return d;
}

/* Where a file for path goes: *direct = 1 when path is to be written in place (a device or
 * a process's file under /dev/ or /proc/, e.g. /dev/stdout, which leads to whatever stdout is,
 * a regular file included; anything else that exists and is not a regular file, e.g. a pipe;
 * a dangling link, whose target fopen creates), else the regular file a temporary one will be
 * renamed over (path itself, or the file a link leads to, so that the link stays). NULL, with
 * errno, when path cannot be one. */
static char *file_target(const char *path, int *direct, struct stat *sb, int *exists) {
    *exists = stat(path, sb) == 0;
    if (*exists && S_ISDIR(sb->st_mode)) {
        errno = EISDIR;
        return NULL;
    }
    struct stat lsb;
    *direct = !strncmp(path, "/dev/", 5) || !strncmp(path, "/proc/", 6) ||
              (*exists && !S_ISREG(sb->st_mode)) || (!*exists && lstat(path, &lsb) == 0);
    /* a path that does not exist: the temporary file's creation says what is wrong with it
     * (a missing directory, a file in the way) */
    if (*direct || !*exists) return dup_str(path);
    char *real = realpath(path, NULL); /* through any links: the file itself is replaced */
    return real ? real : dup_str(path);
}

/* A new temporary file next to target, with the mode the target has (or a new file would
 * get), opened for writing; NULL with errno on failure. */
static FILE *open_temp(const char *target, const struct stat *sb, int exists, char **tmp) {
    const size_t n = strlen(target) + sizeof ".tmp-XXXXXX";
    *tmp = malloc(n);
    if (!*tmp) return NULL;
    snprintf(*tmp, n, "%s.tmp-XXXXXX", target);
    const int fd = mkstemp(*tmp);
    if (fd < 0) {
        free(*tmp);
        *tmp = NULL;
        return NULL;
    }
    mode_t mode = exists ? sb->st_mode & 07777 : 0;
    if (!exists) { /* what fopen would have made: 0666 less the umask */
        const mode_t um = umask(0);
        umask(um);
        mode = 0666 & ~um;
    }
    FILE *f = fchmod(fd, mode) == 0 ? fdopen(fd, "wb") : NULL;
    if (!f) {
        const int e = errno;
        close(fd);
        unlink(*tmp);
        free(*tmp);
        *tmp = NULL;
        errno = e;
    }
    return f;
}

int cli_file_open(cli_file *o, const char *sub, const char *path) {
    memset(o, 0, sizeof *o);
    o->name = path;
    struct stat sb;
    int direct = 0, exists = 0;
    o->path = file_target(path, &direct, &sb, &exists);
    if (o->path) o->f = direct ? fopen(o->path, "wb") : open_temp(o->path, &sb, exists, &o->tmp);
    if (o->f) return 0;
    fprintf(stderr, "entmaxkv %s: cannot write %s: %s\n", sub, path, strerror(errno));
    free(o->path);
    o->path = NULL;
    return 1;
}

void cli_file_discard(cli_file *o) {
    if (o->f) fclose(o->f);
    if (o->tmp) unlink(o->tmp);
    free(o->tmp);
    free(o->path);
    memset(o, 0, sizeof *o);
}

int cli_file_commit(cli_file *o, const char *sub) {
    if (!o->f) return 0;
    /* every byte on the disk before the rename, so that a crash cannot leave a short file
     * in place of the old one; a write error shows at the latest here */
    int bad = ferror(o->f) || fflush(o->f) || (o->tmp && fsync(fileno(o->f)));
    int err = bad ? errno : 0;
    bad = fclose(o->f) || bad;
    err = err ? err : errno;
    o->f = NULL;
    if (!bad && o->tmp && rename(o->tmp, o->path)) {
        bad = 1;
        err = errno;
    }
    if (bad)
        fprintf(stderr, "entmaxkv %s: writing %s failed: %s%s\n", sub, o->name,
                err ? strerror(err) : "write error",
                o->tmp ? " (the file is as it was before)" : "");
    cli_file_discard(o); /* after a rename the temporary name no longer exists */
    return bad;
}

int cli_out_open(cli_out *o, const char *sub, const char *path) {
    memset(o, 0, sizeof *o);
    o->text = stdout;
    if (!path) return 0;
    if (!strcmp(path, "-")) { /* stdout carries the JSON alone */
        o->json = stdout;
        o->text = stderr;
        return 0;
    }
    if (cli_file_open(&o->file, sub, path)) return 1;
    o->json = o->file.f;
    return 0;
}

int cli_out_close(cli_out *o, const char *sub) {
    if (!o->json) return 0;
    int bad = 0;
    if (o->json == stdout) {
        bad = ferror(stdout) || fflush(stdout);
        if (bad) fprintf(stderr, "entmaxkv %s: writing the JSON to stdout failed\n", sub);
    } else
        bad = cli_file_commit(&o->file, sub);
    o->json = NULL;
    return bad;
}

void cli_out_discard(cli_out *o) {
    if (o->json && o->json != stdout) cli_file_discard(&o->file);
    o->json = NULL;
}

const char *cli_json_num(char *buf, size_t n, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    va_list cp;
    va_copy(cp, ap);
    const double v = va_arg(cp, double);
    va_end(cp);
    if (isfinite(v))
        vsnprintf(buf, n, fmt, ap);
    else
        snprintf(buf, n, "null");
    va_end(ap);
    return buf;
}
