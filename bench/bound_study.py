"""Page and token bounds on a model trace (issues 4 and 28), for the last query of each layer,
in float64 with the rounding slack of the C bounds left out (alpha 1.5, page size 16).
  bounds (the default): per query head, the share of pages whose upper bound exceeds the exact
    tau*, for the box, the ball, a "cylinder" (mean + the top principal direction of the page +
    the residual radius), their min, and the exact page max (the floor of any page-level
    method).
  lists: per KV head, the share of its pages (the last left out) that certified's round 1 lists
    on the GPU (docs/math.md §9.3): a bound above the lower bound L of some head of the group,
    with the page's own min(box, ball) or its superpage's box (16 pages), L round 0's tau of the
    last 4 or 16 pages' tokens, or tau* itself; the share of pages whose true max exceeds
    tau*; and per head how flat the scores are (M - tau*, median - tau*, tokens within 0.5).
  codes: per KV head, the share of tokens whose bound from b-bit key codes (each dimension of a
    page in 2^b - 1 steps over the page's range, as the caches' codes, docs/math.md §10) exceeds
    L for some head, with L tau*, the tau of the last 64 tokens or of the last 4096.
Usage: bound_study.py TRACE.safetensors [LAYERS] [--study bounds|lists|codes]"""
import argparse
import os
import sys

_ap = argparse.ArgumentParser(description=__doc__.split(" Usage:")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
_ap.add_argument("trace", metavar="TRACE.safetensors", help="a trace written by `entmaxkv trace`")
_ap.add_argument("layers", nargs="?", default="0,3,7", help="comma list of layers (default 0,3,7)")
_ap.add_argument("--study", default="bounds", choices=["bounds", "lists", "codes"],
                 help="what to measure (default bounds)")
ARGS = _ap.parse_args()  # before the numpy import: --help works without numpy

import numpy as np  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'train'))
import st_io  # noqa: E402
_r = st_io.read(ARGS.trace); t = _r[0] if isinstance(_r, tuple) else _r
ps = 16; a = 0.5; SUPER = 16


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


def head_scores(K, Q, sl, h, G):
    """q' (a scale q) of head h's last query and its z-space scores over every token."""
    N, _, D = K.shape
    q = Q[-1, h] * a / np.sqrt(D)
    return q, K[:, h // G] @ q + a * sl[h] * (np.arange(N) - (N - 1))


def page_bonus(sl, h, pages, N):
    """The ALiBi term of a page's bound: its last token's."""
    return a * sl[h] * ((pages + 1) * ps - 1 - (N - 1))


def recent_tau(z, pages_before_last):
    """tau of the last page's tokens and pages_before_last full pages' before them (round 0)."""
    N = len(z); last = N - ((N + ps - 1) // ps - 1) * ps
    return entmax15_tau(z[max(0, N - (last + pages_before_last * ps)):])


def study_bounds(L, K, Q, sl):
    N, Hk, D = K.shape; S, H, _ = Q.shape; G = H // Hk
    P = (N + ps - 1) // ps
    res = {'box': [], 'ball': [], 'cyl': [], 'min3': [], 'exact': []}
    for h in range(H):
        g = h // G
        q, z = head_scores(K, Q, sl, h, G)
        tau = entmax15_tau(z)
        cnt = {k: 0 for k in res}
        for p in range(P - 1):
            k = K[p*ps:(p+1)*ps, g]
            bonus = page_bonus(sl, h, p, N)
            box = np.sum(np.maximum(q*k.min(0), q*k.max(0))) + bonus
            c = k.mean(0); r = np.max(np.linalg.norm(k - c, axis=1))
            ball = q @ c + np.linalg.norm(q)*r + bonus
            X = k - c
            u = np.linalg.svd(X, full_matrices=False)[2][0]
            aj = X @ u; rp = np.max(np.linalg.norm(X - np.outer(aj, u), axis=1))
            qu = q @ u; qp = np.sqrt(max(q@q - qu*qu, 0))
            cyl = q @ c + max(qu*aj.min(), qu*aj.max()) + qp*rp + bonus
            ex = np.max(z[p*ps:(p+1)*ps])
            for name, U in (('box', box), ('ball', ball), ('cyl', cyl), ('min3', min(box, ball, cyl)), ('exact', ex)):
                cnt[name] += U > tau
        for kname in res: res[kname].append(cnt[kname] / (P - 1))
    print(L, {k: np.round(v, 2).tolist() for k, v in res.items()})


def study_lists(L, K, Q, sl):
    N, Hk, D = K.shape; S, H, _ = Q.shape; G = H // Hk
    P = (N + ps - 1) // ps; pages = np.arange(P - 1)
    Kp = K[:(P - 1) * ps].reshape(P - 1, ps, Hk, D)
    kmin, kmax, kmean = Kp.min(1), Kp.max(1), Kp.mean(1)
    rad = np.max(np.linalg.norm(Kp - kmean[:, None], axis=-1), axis=1)
    sp = pages // SUPER
    smin = np.stack([kmin[sp == s].min(0) for s in range(sp[-1] + 1)])
    smax = np.stack([kmax[sp == s].max(0) for s in range(sp[-1] + 1)])
    cols = ['page/R3', 'page/R15', 'super/R3', 'super/R15', 'page/tau*', 'true max/tau*']
    for g in range(Hk):
        take = {c: np.zeros(P - 1, bool) for c in cols}
        sup, spread = [], []
        for h in range(g * G, (g + 1) * G):
            q, z = head_scores(K, Q, sl, h, G)
            tau = entmax15_tau(z); sup.append(int(np.sum(z > tau)))
            spread.append(f"{z.max() - tau:.2f}/{np.median(z) - tau:.2f}/{int(np.sum(z > tau - 0.5))}")
            L0 = {R: recent_tau(z, R) for R in (3, 15)}
            bonus = page_bonus(sl, h, pages, N)
            own = np.minimum(np.sum(np.maximum(q * kmin[:, g], q * kmax[:, g]), axis=1),
                             kmean[:, g] @ q + np.linalg.norm(q) * rad[:, g]) + bonus
            sup_box = np.sum(np.maximum(q * smin[:, g], q * smax[:, g]), axis=1)[sp] + bonus
            for R in (3, 15):
                take[f'page/R{R}'] |= own > L0[R]
                take[f'super/R{R}'] |= sup_box > L0[R]
            take['page/tau*'] |= own > tau
            take['true max/tau*'] |= z[:(P - 1) * ps].reshape(P - 1, ps).max(1) > tau
        print(f"layer {L} KV head {g} (slopes {np.round(sl[g*G:(g+1)*G], 4).tolist()}), "
              f"{P - 1} pages, support {sup} tokens, M - tau*/median - tau*/tokens within 0.5 "
              f"of tau* {spread}: " + ", ".join(f"{c} {take[c].mean():.3f}" for c in cols))


def study_codes(L, K, Q, sl):
    N, Hk, D = K.shape; S, H, _ = Q.shape; G = H // Hk
    n = N // ps * ps
    for g in range(Hk):
        Kp = K[:n, g].reshape(n // ps, ps, D)
        mn, mx = Kp.min(1, keepdims=True), Kp.max(1, keepdims=True)
        out = []
        for bits in (4, 8):
            lv = 2 ** bits - 1
            step = (mx - mn) / lv
            c = np.where(step > 0, np.clip(np.floor((Kp - mn) / np.where(step > 0, step, 1)), 0, lv - 1), 0)
            lo = (mn + c * step).reshape(n, D); hi = (mn + (c + 1) * step).reshape(n, D)
            surv = {w: np.zeros(n, bool) for w in ('tau*', 'last 64', 'last 4096')}
            supp = np.zeros(n, bool)
            for h in range(g * G, (g + 1) * G):
                q, z = head_scores(K, Q, sl, h, G)
                u = np.sum(np.maximum(q * lo, q * hi), axis=1) + a * sl[h] * (np.arange(n) - (N - 1))
                tau = entmax15_tau(z)
                supp |= z[:n] > tau
                for w, lb in (('tau*', tau), ('last 64', entmax15_tau(z[-64:])),
                              ('last 4096', entmax15_tau(z[-4096:]))):
                    surv[w] |= u > lb
            out.append(f"{bits}-bit: " + ", ".join(f"{w} {surv[w].mean():.3f}" for w in surv))
        print(f"layer {L} KV head {g}: support {supp.mean():.4f} of the tokens; survivors " +
              "; ".join(out))


for L in [int(x) for x in ARGS.layers.split(',')]:
    K = t[f'l{L}.k'].astype(np.float64); Q = t[f'l{L}.q'].astype(np.float64); sl = t[f'l{L}.alibi_slopes']
    {'bounds': study_bounds, 'lists': study_lists, 'codes': study_codes}[ARGS.study](L, K, Q, sl)
