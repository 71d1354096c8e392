"""Bound tightness on a model trace, per query head (issue 4): the share of pages whose
upper bound exceeds the exact alpha = 1.5 tau* of the last query, for the box, the ball, a
"cylinder" (mean + the top principal direction of the page + the residual radius), their min,
and the exact page max (the floor of any page-level method). Exact arithmetic in float64; the
rounding slack of the C bounds is left out. Usage: bound_study.py TRACE.safetensors [LAYERS]"""
import argparse
import os
import sys

_ap = argparse.ArgumentParser(description=__doc__.split(" Usage:")[0])
_ap.add_argument("trace", metavar="TRACE.safetensors", help="a trace written by `entmaxkv trace`")
_ap.add_argument("layers", nargs="?", default="0,3,7", help="comma list of layers (default 0,3,7)")
ARGS = _ap.parse_args()  # before the numpy import: --help works without numpy

import numpy as np  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'train'))
import st_io  # noqa: E402
_r = st_io.read(ARGS.trace); t = _r[0] if isinstance(_r, tuple) else _r
ps = 16; a = 0.5
def entmax15_tau(z):
    # exact tau for alpha=1.5 in z-space: p = [z - tau]_+^2
    zs = np.sort(z)[::-1]
    n = len(zs); cs = np.cumsum(zs); cs2 = np.cumsum(zs*zs)
    k = np.arange(1, n+1)
    mean = cs/k; ss = cs2/k - mean**2
    delta = (1 - k*ss)/k
    tau = mean - np.sqrt(np.maximum(delta, 0))
    ok = zs >= tau
    kk = np.max(np.where(ok)[0]) + 1
    return tau[kk-1]
for L in [int(x) for x in ARGS.layers.split(',')]:
    K = t[f'l{L}.k'].astype(np.float64); Q = t[f'l{L}.q'].astype(np.float64); sl = t[f'l{L}.alibi_slopes']
    N, Hk, D = K.shape; S, H, _ = Q.shape; G = H // Hk
    P = (N + ps - 1) // ps
    res = {'box': [], 'ball': [], 'cyl': [], 'min3': [], 'exact': []}
    for h in range(H):
        g = h // G
        q = Q[-1, h] * a / np.sqrt(D)
        pos = np.arange(N)
        z = K[:, g] @ q + a * sl[h] * (pos - (N - 1))
        tau = entmax15_tau(z)
        cnt = {k: 0 for k in res}
        for p in range(P - 1):
            k = K[p*ps:(p+1)*ps, g]
            bonus = a * sl[h] * ((p+1)*ps - 1 - (N - 1))
            box = np.sum(np.maximum(q*k.min(0), q*k.max(0))) + bonus
            c = k.mean(0); r = np.max(np.linalg.norm(k - c, axis=1))
            ball = q @ c + np.linalg.norm(q)*r + bonus
            X = k - c
            u = np.linalg.svd(X, full_matrices=False)[2][0]
            aj = X @ u; rp = np.max(np.linalg.norm(X - np.outer(aj, u), axis=1))
            qu = q @ u; qp = np.sqrt(max(q@q - qu*qu, 0))
            cyl = q @ c + max(qu*aj.min(), qu*aj.max()) + qp*rp + bonus
            ex = np.max(k @ q + a*sl[h]*(np.arange(p*ps, (p+1)*ps) - (N-1)))
            for name, U in (('box', box), ('ball', ball), ('cyl', cyl), ('min3', min(box, ball, cyl)), ('exact', ex)):
                cnt[name] += U > tau
        for kname in res: res[kname].append(cnt[kname] / (P - 1))
    print(L, {k: np.round(v, 2).tolist() for k, v in res.items()})
