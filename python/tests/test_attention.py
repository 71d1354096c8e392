"""entmax_attention and entmax_attention_backward (docs/math.md §13) against float64 numpy:
the forward against the bisection reference, the backward against central differences of that
reference (independent of the library's forward), on data whose scores all lie at least 1e-4
from their row's tau (so a difference step never crosses the edge of the support)."""
import numpy as np
import pytest

import entmaxkv
from reference import attention_rows_ref


def _data(seed, T=3, N=6, H=2, Hk=1, D=4):
    r = np.random.default_rng(seed)
    return (3 * r.standard_normal((T, H, D)), r.standard_normal((N, Hk, D)),
            r.standard_normal((N, Hk, D)), r.standard_normal((T, H, D)))


def _gap(q, k, tau, alpha, causal, slopes):
    """The smallest |z - tau| over every row and the keys it sees, and how many keys are out."""
    T, H, D = q.shape
    N, G = k.shape[0], H // k.shape[1]
    a = 1.0 if alpha == 1 else alpha - 1
    gap, out = np.inf, 0
    for t in range(T):
        i = N - T + t
        n = i + 1 if causal else N
        for h in range(H):
            s = k[:n, h // G] @ q[t, h] / np.sqrt(D)
            if slopes is not None:
                s = s - slopes[h] * np.abs(np.arange(n) - i)
            gap = min(gap, np.min(np.abs(a * s - tau[t, h])))
            out += int(np.sum(a * s <= tau[t, h]))
    return gap, out


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("alibi", [False, True])
def test_forward_and_gradients(alpha, causal, alibi):
    slopes = np.array([0.25, 0.0]) if alibi else None
    for seed in range(100):
        q, k, v, dout = _data(seed)
        out, tau = entmaxkv.entmax_attention(q, k, v, alpha, causal, slopes)
        gap, outside = _gap(q, k, tau, alpha, causal, slopes)
        if gap > 1e-4 and (alpha == 1 or outside > 0):
            break
    assert gap > 1e-4 and (alpha == 1 or outside > 0)
    np.testing.assert_allclose(out, attention_rows_ref(q, k, v, alpha, causal, slopes),
                               atol=1e-10)
    dq, dk, dv = entmaxkv.entmax_attention_backward(q, k, v, tau, dout, alpha, causal, slopes)
    h = 1e-6
    for x, grad in ((q, dq), (k, dk), (v, dv)):
        num = np.empty_like(x)
        for idx in np.ndindex(x.shape):
            x0 = x[idx]
            x[idx] = x0 + h
            lp = np.sum(dout * attention_rows_ref(q, k, v, alpha, causal, slopes))
            x[idx] = x0 - h
            lm = np.sum(dout * attention_rows_ref(q, k, v, alpha, causal, slopes))
            x[idx] = x0
            num[idx] = (lp - lm) / (2 * h)
        assert np.max(np.abs(num - grad)) < 1e-6 * max(1.0, np.max(np.abs(grad)))
    # float32 inputs: the same computation on the rounded inputs
    f = [a.astype(np.float32) for a in (q, k, v, dout)]
    out32, tau32 = entmaxkv.entmax_attention(*f[:3], alpha, causal, slopes)
    assert out32.dtype == np.float32 and tau32.dtype == np.float64
    np.testing.assert_allclose(out32, out, atol=1e-5)
    dq32, dk32, dv32 = entmaxkv.entmax_attention_backward(*f[:3], tau32, f[3], alpha, causal,
                                                          slopes)
    for g32, g in ((dq32, dq), (dk32, dk), (dv32, dv)):
        np.testing.assert_allclose(g32, g, atol=1e-4 * max(1.0, np.max(np.abs(g))))


def test_errors():
    q, k, v, dout = _data(0)
    with pytest.raises(TypeError, match="all be float32 or all float64"):
        entmaxkv.entmax_attention(q.astype(np.float32), k, v)
    with pytest.raises(ValueError, match=r"q must be \[T, H, D\]"):
        entmaxkv.entmax_attention(q[0], k, v)
    with pytest.raises(ValueError, match="alibi_slopes must hold H=2 slopes"):
        entmaxkv.entmax_attention(q, k, v, alibi_slopes=[0.5])
    with pytest.raises(entmaxkv.EntmaxKVError, match=r"alpha=0.5 is outside \[1, 4\]"):
        entmaxkv.entmax_attention(q, k, v, alpha=0.5)
    with pytest.raises(entmaxkv.EntmaxKVError, match="causal attention needs num_queries=3"):
        entmaxkv.entmax_attention(q, k[:2], v[:2])
    _, tau = entmaxkv.entmax_attention(q, k, v)
    tau[1, 0] -= 5
    with pytest.raises(entmaxkv.EntmaxKVError, match=r"tau\[2\]=.* is not the threshold"):
        entmaxkv.entmax_attention_backward(q, k, v, tau, dout)
    with pytest.raises(ValueError, match=r"tau must be \[3, 2\]"):
        entmaxkv.entmax_attention_backward(q, k, v, tau[:1], dout)
