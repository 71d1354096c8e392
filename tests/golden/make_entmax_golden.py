#!/usr/bin/env python3
"""Generate golden test vectors for exact alpha-entmax (entmaxkv C tests).

What it is
    Reference outputs of the PyPI package `entmax` (deep-spin, Peters et al.
    2019) for a fixed grid of alphas and a fixed, seeded set of input rows.
    The C test parses the output with strtod and compares against its own
    alpha-entmax implementation.

Convention (same as the package)
    p_i = [(alpha - 1) * x_i - tau]_+ ^ (1 / (alpha - 1)),  sum(p) = 1;
    alpha = 1 means softmax.

Which function produces p
    alpha = 1    : torch.softmax                      (float64)
    alpha = 1.5  : entmax.entmax15 (exact, sort-based), and the same rows again
                   through entmax.entmax_bisect(alpha=1.5) as cases named *_bisect
    alpha = 2    : entmax.sparsemax (exact, sort-based)
    other alphas : entmax.entmax_bisect(x, alpha, n_iter=N_ITER)  (float64)

How to run (needs torch and `entmax`; no GPU needed, everything runs on CPU)
    python3 -m pip install entmax      # pure python; depends on torch
    python3 tests/golden/make_entmax_golden.py [tests/data/entmax_golden.txt]

Output format (one block per case; numbers in Python repr, i.e. shortest
round-trip form, alpha with %.17g, masked entries written as -inf):
    # comment lines start with '#'
    case <name> <alpha> <n>
    x <n numbers>
    p <n numbers>

The versions of torch, numpy and entmax that produced the file are written
into its header as '#' comment lines. Input rows come from
numpy.random.default_rng(SEED) (PCG64), so they are reproducible; the rows
themselves are stored in the file, so the C test never needs the RNG.

Cases whose package output is not finite, has a negative entry, or does not
sum to 1 within SUM_TOL are skipped and listed in the header. Rows holding
-inf (masked) entries are kept as-is if the package handles them (finite
output, exact 0 at the -inf positions); otherwise p is computed on the finite
entries only with 0 placed at the -inf positions, and the header says so.
"""

import argparse
import math
import sys


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="tests/data/entmax_golden.txt",
                    help="the file to write (default tests/data/entmax_golden.txt)")
    return ap.parse_args()


# --help answers here, before the imports that need numpy or torch
ARGS = parse_args() if __name__ == "__main__" else None

import numpy as np  # noqa: E402
import torch  # noqa: E402

import entmax  # noqa: E402

SEED = 20240607
N_ITER = 200          # bisection iterations (float64 converges after ~60)
SUM_TOL = 1e-9
ALPHAS = [1.0, 1.1, 1.25, 1.3333333333333333, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0]

DT = torch.float64


def fmt(v):
    v = float(v)
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def make_rows(rng):
    """List of (tag, np.ndarray float64). Draw order is fixed."""
    rows = []
    for n in (1, 2, 5, 17, 100, 1000):
        rows.append(("randn_n%d" % n, rng.standard_normal(n)))
    rows.append(("scale10_n50", 10.0 * rng.standard_normal(50)))
    rows.append(("scale0p1_n50", 0.1 * rng.standard_normal(50)))
    rows.append(("equal_n8", np.full(8, 3.25)))
    ties = np.array([2.0, 2.0, 2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0])
    rows.append(("tiestop_n10", ties[rng.permutation(ties.size)]))
    oh = np.full(10, -1000.0)
    oh[3] = -999.0
    rows.append(("onehot_m1000_n10", oh))
    rows.append(("scale1000_n20", 1000.0 * rng.standard_normal(20)))
    m = rng.standard_normal(12)
    m[[1, 4, 5, 10]] = -np.inf
    rows.append(("masked_n12", m))
    ms = np.full(6, -np.inf)
    ms[2] = 0.7
    rows.append(("masked_single_n6", ms))
    return rows


def apply_fn(kind, alpha, x):
    """x: 1-D float64 torch tensor -> 1-D float64 torch tensor."""
    X = x.unsqueeze(0)
    with torch.no_grad():
        if kind == "softmax":
            P = torch.softmax(X, dim=-1)
        elif kind == "entmax15":
            P = entmax.entmax15(X, dim=-1)
        elif kind == "sparsemax":
            P = entmax.sparsemax(X, dim=-1)
        elif kind == "bisect":
            P = entmax.entmax_bisect(X, alpha=alpha, dim=-1, n_iter=N_ITER,
                                     ensure_sum_one=True)
        else:
            raise ValueError(kind)
    return P[0].to(DT)


def check(p, x):
    """Return None if p is acceptable, else a reason string."""
    if not bool(torch.isfinite(p).all()):
        return "non-finite output"
    if bool((p < 0).any()):
        return "negative entry"
    s = math.fsum(p.tolist())
    if abs(s - 1.0) > SUM_TOL:
        return "sum(p)-1 = %.3g" % (s - 1.0)
    masked = torch.isneginf(x)
    if bool(masked.any()) and bool((p[masked] != 0).any()):
        return "nonzero p at -inf entry"
    return None


def kkt_residual(alpha, x, p):
    """Max |p - p_ref| where p_ref is rebuilt from the tau implied by the
    largest entry of p (alpha > 1), or the softmax formula (alpha = 1)."""
    xs = x.tolist()
    ps = p.tolist()
    fin = [i for i, v in enumerate(xs) if math.isfinite(v)]
    if alpha == 1.0:
        mx = max(xs[i] for i in fin)
        e = [math.exp(xs[i] - mx) if i in fin else 0.0 for i in range(len(xs))]
        s = math.fsum(e)
        return max(abs(ps[i] - e[i] / s) for i in range(len(xs)))
    am1 = alpha - 1.0
    k = max(range(len(ps)), key=lambda i: ps[i])
    tau = am1 * xs[k] - ps[k] ** am1
    ref = []
    for i in range(len(xs)):
        if i in fin:
            z = am1 * xs[i] - tau
            ref.append(z ** (1.0 / am1) if z > 0 else 0.0)
        else:
            ref.append(0.0)
    return max(abs(a - b) for a, b in zip(ps, ref))


def main():
    out_path = ARGS.out
    torch.manual_seed(SEED)  # not used for data; set for good measure
    rng = np.random.default_rng(SEED)

    blocks = []     # (name, alpha, x_list, p_list)
    skipped = []    # (name, reason)
    notes = []      # masked-fallback notes
    diag = []       # diagnostic lines

    for alpha in ALPHAS:
        rows = make_rows(rng)
        if alpha == 1.0:
            variants = [("", "softmax")]
        elif alpha == 1.5:
            variants = [("", "entmax15"), ("_bisect", "bisect")]
        elif alpha == 2.0:
            variants = [("", "sparsemax")]
        else:
            variants = [("", "bisect")]
        for suffix, kind in variants:
            worst = 0.0
            for tag, xa in rows:
                name = "a%r_%s%s" % (alpha, tag, suffix)
                x = torch.tensor(xa, dtype=DT)
                p = apply_fn(kind, alpha, x)
                why = check(p, x)
                masked = torch.isneginf(x)
                if why is not None and bool(masked.any()):
                    # Fallback: run on the finite entries only, 0 at -inf.
                    fin = ~masked
                    pf = apply_fn(kind, alpha, x[fin])
                    p = torch.zeros_like(x)
                    p[fin] = pf
                    why2 = check(p, x)
                    if why2 is None:
                        notes.append("%s: package gave %s with -inf input; p "
                                     "computed on finite entries only, 0 at "
                                     "-inf positions" % (name, why))
                        why = None
                    else:
                        why = "%s (fallback: %s)" % (why, why2)
                if why is not None:
                    skipped.append((name, why))
                    continue
                worst = max(worst, kkt_residual(alpha, x, p))
                blocks.append((name, alpha, x.tolist(), p.tolist()))
            diag.append("alpha=%r %s: max |p - p_ref(tau from argmax p)| = %.3g"
                        % (alpha, kind, worst))

    # Cross-checks between the exact sort-based routines and bisection.
    rng2 = np.random.default_rng(SEED)
    for alpha, exact in ((1.5, "entmax15"), (2.0, "sparsemax")):
        worst = 0.0
        for tag, xa in make_rows(rng2):
            x = torch.tensor(xa, dtype=DT)
            a = apply_fn(exact, alpha, x)
            b = apply_fn("bisect", alpha, x)
            if bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all()):
                worst = max(worst, float((a - b).abs().max()))
        diag.append("cross-check alpha=%r: max |%s - entmax_bisect| over "
                    "first-alpha-set rows = %.3g" % (alpha, exact, worst))

    with open(out_path, "w") as f:
        f.write("# entmaxkv golden vectors for exact alpha-entmax\n")
        f.write("# generated by tests/golden/make_entmax_golden.py\n")
        f.write("# run: python3 tests/golden/make_entmax_golden.py %s\n"
                % "tests/data/entmax_golden.txt")
        f.write("# torch %s\n" % torch.__version__)
        f.write("# entmax %s\n" % getattr(entmax, "__version__", "unknown"))
        f.write("# numpy %s\n" % np.__version__)
        f.write("# python %s\n" % sys.version.split()[0])
        f.write("# seed %d (numpy.random.default_rng), dtype float64, "
                "entmax_bisect n_iter=%d ensure_sum_one=True\n" % (SEED, N_ITER))
        f.write("# convention: p = [(alpha-1)*x - tau]_+^(1/(alpha-1)), "
                "alpha=1 is softmax\n")
        f.write("# alpha=1: torch.softmax; alpha=1.5: entmax.entmax15 "
                "(+ *_bisect: entmax.entmax_bisect); alpha=2: entmax.sparsemax; "
                "others: entmax.entmax_bisect\n")
        f.write("# format: 'case <name> <alpha %.17g> <n>' then 'x <n>' "
                "then 'p <n>'\n")
        f.write("# cases: %d\n" % len(blocks))
        for d in diag:
            f.write("# diag: %s\n" % d)
        if notes:
            for s in notes:
                f.write("# masked fallback: %s\n" % s)
        else:
            f.write("# masked rows (-inf entries): package output was finite "
                    "with p=0 at -inf for every alpha; written as produced\n")
        if skipped:
            for name, why in skipped:
                f.write("# skipped: %s: %s\n" % (name, why))
        else:
            f.write("# skipped: none\n")
        for name, alpha, xs, ps in blocks:
            f.write("case %s %.17g %d\n" % (name, alpha, len(xs)))
            f.write("x " + " ".join(fmt(v) for v in xs) + "\n")
            f.write("p " + " ".join(fmt(v) for v in ps) + "\n")

    print("wrote %s: %d cases, %d skipped, %d masked fallbacks"
          % (out_path, len(blocks), len(skipped), len(notes)))
    for d in diag:
        print(d)
    for name, why in skipped:
        print("skipped", name, why)


if __name__ == "__main__":
    main()
