/*
 * Context-parallel decode's shared math (docs/math.md §11), written once for the CPU simulation
 * (src/cpu/sharded/sharded.c) and the CUDA sharded plan (src/cuda/sharded/sharded_tau.cu): the
 * contiguous page ranges of the shards, the moments a shard contributes to a round of the
 * agreement on tau, and the bracket update every shard applies to the reduced moments (the same
 * inputs on every shard, so the same state: no shard ever decides alone). C and CUDA (host and
 * device).
 */
#ifndef EKV_SHARD_AGREE_H
#define EKV_SHARD_AGREE_H
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "hd.h"

/* d^(1/(alpha-1)) for d > 0 (the entmax weight before the threshold test), alpha > 1. */
EKV_HD double ekv_entmax_pow(double d, double alpha) {
    if (alpha == 2.0) return d;
    if (alpha == 1.5) return d * d;
    return pow(d, 1.0 / (alpha - 1.0));
}

/* Shard j of S holds pages [first, first + count) of a sequence of P pages: [j P / S,
 * (j + 1) P / S), contiguous so that the newest page (where appends go) has one owner and the
 * last shard always holds the last page. floor(j P / S) = j floor(P / S) + floor(j (P mod S) / S),
 * which never forms j P (that overflows int64 for P near its top). */
EKV_HD int64_t ekv_shard_bound(int64_t P, int32_t S, int32_t j) {
    return (P / S) * j + (P % S) * j / S;
}
EKV_HD void ekv_shard_range(int64_t P, int32_t S, int32_t j, int64_t *first, int64_t *count) {
    *first = ekv_shard_bound(P, S, j);
    *count = ekv_shard_bound(P, S, j + 1) - *first;
}

/* The numbers a shard sends per head and round: over its z > x, with y = z - x, the count,
 * sum y, sum y^2, F = sum y^beta, F1 = sum y^(beta - 1) (f(x) = F - 1, f'(x) = -beta F1), and
 * the count of z in (clo, chi] (0 while chi is NAN). */
enum { EKV_AGREE_MOMENTS = 6 };

/* One score z added to the moments m at x (ekv_agree_state's x, clo, chi). */
EKV_HD void ekv_agree_add(double *m, double z, double x, double clo, double chi, double alpha) {
    m[5] += z > clo && z <= chi; /* false for chi = NAN */
    const double y = z - x;
    if (!(y > 0)) return;
    const double w = ekv_entmax_pow(y, alpha);
    m[0] += 1;
    m[1] += y;
    m[2] += y * y;
    m[3] += w;
    m[4] += alpha == 2.0 ? 1.0 : w / y;
}

/* The agreement on one head's tau: the bracket [lo, hi], the point x of the next round's
 * moments, and the closed-form candidate chi (NAN: none) whose check, the scores in (clo, chi],
 * rides on that round. done: 0 running, 1 converged at tau = x, 2 the closed form held
 * (tau = chi, the merge may have been sent speculatively at chi). */
typedef struct ekv_agree_state {
    double lo, hi, x, clo, chi, tau;
    int32_t done, rounds;
} ekv_agree_state;

/* From the allreduce-max of the shards' own thresholds (lo: a subset's threshold is a lower
 * bound, docs/math.md §9.1) and their maxima (hi: f(max) = -1 < 0). */
EKV_HD void ekv_agree_start(ekv_agree_state *s, double lo, double hi) {
    s->lo = lo;
    s->hi = hi;
    s->x = lo;
    s->clo = lo;
    s->chi = NAN;
    s->tau = lo;
    s->done = 0;
    s->rounds = 0;
}

/* The root d of sum over S(x) of (y - d)^beta = 1 in closed form (alpha 2 and 1.5), from the
 * moments at x; NAN when alpha has none or the quadratic has no root. */
EKV_HD double ekv_agree_closed_form(const double *m, double alpha) {
    if (alpha == 2.0) return (m[1] - 1.0) / m[0];
    if (alpha != 1.5) return NAN;
    const double disc = m[1] * m[1] - m[0] * (m[2] - 1.0);
    return disc >= 0 ? (m[1] - sqrt(disc)) / m[0] : NAN;
}

/* One round: red holds the shards' moments at s->x summed. The closed-form check first (no
 * score in (clo, chi]: chi is tau), then the sign of f(x) narrows the bracket, and the next x
 * is the Newton step inside it (else the midpoint). Returns s->done. */
EKV_HD int32_t ekv_agree_step(ekv_agree_state *s, const double *red, double alpha) {
    const double beta = 1.0 / (alpha - 1.0);
    s->rounds++;
    if (!isnan(s->chi)) {
        if (red[5] == 0) { /* S(chi) = S(clo): the closed form holds at chi */
            s->tau = s->chi;
            return s->done = 2;
        }
        if (alpha == 2.0) /* the scores in (clo, chi] make f(chi) >= 0: a lower bound */
            s->lo = fmax(s->lo, s->chi);
        else /* 1.5: they make f(chi) <= 0, an upper bound */
            s->hi = fmin(s->hi, s->chi);
    }
    const double f = red[3] - 1.0, x = s->x;
    if (f == 0) {
        s->tau = x;
        return s->done = 1;
    }
    if (f > 0)
        s->lo = fmax(s->lo, x);
    else
        s->hi = fmin(s->hi, x);
    const double res = 4 * DBL_EPSILON * fmax(1.0, fabs(s->lo)); /* tau's resolution */
    const double nx = x + f / (beta * red[4]);                   /* Newton: f'(x) = -beta F1 */
    if (s->hi - s->lo <= res || (red[4] > 0 && fabs(nx - x) <= res)) {
        s->tau = x;
        return s->done = 1;
    }
    const double d = f > 0 ? ekv_agree_closed_form(red, alpha) : NAN;
    s->chi = isfinite(d) && x + d > s->lo && x + d < s->hi ? x + d : NAN;
    s->clo = x;
    s->x = red[4] > 0 && nx > s->lo && nx < s->hi ? nx : 0.5 * (s->lo + s->hi);
    s->tau = s->lo; /* what an unfinished agreement would take */
    return 0;
}

#endif /* EKV_SHARD_AGREE_H */
