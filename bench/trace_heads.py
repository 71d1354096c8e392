"""How flat each head of a model trace is, for the tau kernels' lists (docs/math.md §0, §9.1):
per layer and query head of a query row, the candidates (z > M - 1), the support (z > tau), and
how many tokens lie above the histogram lower bound of §9.1 "A bound from counts" (the list the
CUDA tau kernel rebuilds for a head whose candidates overflow). Each at the trace's length and
at its last CTX tokens, so the growth with the context shows. Exact tau in float64; it checks
that the count bound never exceeds tau. Usage: trace_heads.py TRACE.safetensors [--ctx 8192]"""
import argparse
import os
import sys

_ap = argparse.ArgumentParser(description=__doc__.split(" Usage:")[0])
_ap.add_argument("trace", metavar="TRACE.safetensors", help="a trace written by `entmaxkv trace`")
_ap.add_argument("--ctx", type=int, default=8192, help="the shorter context (default 8192)")
_ap.add_argument("--query", type=int, default=-1, help="query row of the trace (default -1: last)")
_ap.add_argument("--bins", type=int, default=2048, help="histogram bins over [-1, 0] (default 2048)")
_ap.add_argument("--alpha", type=float, default=1.5, help="entmax alpha (default 1.5, the model's)")
ARGS = _ap.parse_args()  # before the numpy import: --help works without numpy

import numpy as np  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'train'))
import st_io  # noqa: E402

BETA = 1.0 / (ARGS.alpha - 1.0)


def tau_of(z):
    """The exact threshold over z (docs/math.md §0): bisection on F(t) = sum [z - t]_+^beta = 1
    over the candidates, in [M - 1, M]."""
    m = z.max()
    y = z[z > m - 1] - m
    lo, hi = -1.0, 0.0
    for _ in range(200):
        t = 0.5 * (lo + hi)
        if (np.clip(y - t, 0, None) ** BETA).sum() > 1:
            lo = t
        else:
            hi = t
    return m + lo


def count_bound(z):
    """docs/math.md §9.1 "A bound from counts": the largest bin edge e_k of y = z - M where
    sum_{j > k} c_j (e_j - e_k)^beta >= 1, found by bisection (-1 when none)."""
    m = z.max()
    y = z[z >= m - 1] - m
    nb = ARGS.bins
    c = np.bincount(np.minimum(((y + 1) * nb).astype(np.int64), nb - 1), minlength=nb)
    lo, hi = -1, nb
    while hi - lo > 1:
        mid = (lo + hi) // 2
        j = np.arange(mid + 1, nb)
        if (c[mid + 1:] * ((j - mid) / nb) ** BETA).sum() >= 1 + 1e-9:
            lo = mid
        else:
            hi = mid
    return m - 1 + max(lo, 0) / nb


def head_row(z):
    """candidates / support / above the count bound, over the scores z of one query"""
    tau = tau_of(z)
    bound = count_bound(z)
    if bound > tau + 1e-12:
        sys.exit(f"trace_heads: the count bound {bound!r} exceeds tau {tau!r}")
    return f"{(z > z.max() - 1).sum()}/{(z > tau).sum()}/{(z > bound).sum()}"


def main():
    r = st_io.read(ARGS.trace)
    t = r[0] if isinstance(r, tuple) else r
    layers = sorted({int(k.split('.')[0][1:]) for k in t if k.startswith('l') and k.endswith('.k')})
    n_all = t[f'l{layers[0]}.k'].shape[0]
    short = min(ARGS.ctx, n_all)
    print(f"{ARGS.trace}: {n_all} tokens; per head candidates/support/above the count bound "
          f"after {short} and {n_all} tokens (query row {ARGS.query})")
    for layer in layers:
        K = t[f'l{layer}.k'].astype(np.float64)
        Q = t[f'l{layer}.q'].astype(np.float64)
        slopes = t[f'l{layer}.alibi_slopes'].astype(np.float64)
        n, hk, d = K.shape
        s, h_all, _ = Q.shape
        qrow = ARGS.query % s
        pos = n - s + qrow  # the query's position: the trace keeps the last s queries
        cells = []
        for h in range(h_all):
            g = h // (h_all // hk)
            keys = np.arange(pos + 1)
            z = (ARGS.alpha - 1) * (K[:pos + 1, g] @ Q[qrow, h] / np.sqrt(d)
                                    + slopes[h] * (keys - pos))
            cells.append(f"h{h} m={slopes[h]:.4f} {head_row(z[-short:])} {head_row(z)}")
        print(f"layer {layer}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
