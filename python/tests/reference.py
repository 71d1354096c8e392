"""float64 references the tests compare against: entmax by bisection on tau, dense attention."""
import numpy as np


def entmax_ref(x, alpha, axis=-1):
    x = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        out[idx] = _row(x[idx], alpha)
    return np.moveaxis(out, -1, axis)


def _row(x, alpha):
    if alpha == 1.0:
        e = np.exp(x - x.max())
        return e / e.sum()
    z = (alpha - 1.0) * (x - x.max())  # max z = 0: tau in [-1, 0]
    beta = 1.0 / (alpha - 1.0)
    lo, hi = -1.0, 0.0
    for _ in range(200):
        t = 0.5 * (lo + hi)
        s = np.sum(np.maximum(z - t, 0.0) ** beta)
        lo, hi = (t, hi) if s > 1.0 else (lo, t)
    p = np.maximum(z - 0.5 * (lo + hi), 0.0) ** beta
    return p / p.sum()


def attention_ref(q, k, v, alpha, scale=None, slopes=None):
    """q [H, D], k/v [N, Hk, D] (float64): out [H, D] with GQA (head h uses KV head h // G);
    slopes [H]: the ALiBi bias m_h * (j - (N - 1)) of a query at the last position."""
    H, D = q.shape
    N, G = k.shape[0], H // k.shape[1]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    out = np.empty((H, D))
    for h in range(H):
        s = k[:, h // G, :] @ q[h] * scale
        if slopes is not None:
            s = s + slopes[h] * (np.arange(N) - (N - 1.0))
        out[h] = _row(s, alpha) @ v[:, h // G, :]
    return out


def attention_rows_ref(q, k, v, alpha, causal=True, slopes=None):
    """q [T, H, D], k/v [N, Hk, D] (float64): out [T, H, D] of rows at positions N - T + t,
    causal rows over the keys j <= their position, ALiBi bias -m_h |j - i| (docs/math.md §13)."""
    T, H, D = q.shape
    N, G = k.shape[0], H // k.shape[1]
    out = np.empty((T, H, D))
    for t in range(T):
        i = N - T + t
        n = i + 1 if causal else N
        for h in range(H):
            s = k[:n, h // G, :] @ q[t, h] / np.sqrt(D)
            if slopes is not None:
                s = s - slopes[h] * np.abs(np.arange(n) - i)
            out[t, h] = _row(s, alpha) @ v[:n, h // G, :]
    return out
