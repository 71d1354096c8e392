"""alpha-entmax over an axis of a numpy array or a CPU torch tensor (forward, exact)."""
import numpy as np

from . import _lib


def _rows_entmax(a, alpha, dim, who):
    if a.dtype not in (np.float32, np.float64):
        raise TypeError(f"entmaxkv.{who}: dtype {a.dtype} is not supported: pass float32 or "
                        "float64 (convert float16/bfloat16 first)")
    if a.ndim == 0:
        raise ValueError(f"entmaxkv.{who}: x is a scalar; it needs an axis to normalise over")
    if not -a.ndim <= dim < a.ndim:
        raise ValueError(f"entmaxkv.{who}: dim={dim} is out of range for {a.ndim} dimensions")
    if a.shape[dim] == 0:
        raise ValueError(f"entmaxkv.{who}: the axis dim={dim} is empty")
    if a.size == 0:
        return np.empty_like(a)
    # a copy only when dim is not the last contiguous axis, or x is not aligned
    rows = _lib.c_array(np.moveaxis(a, dim, -1))
    out = np.empty_like(rows)
    n = rows.shape[-1]
    fn = _lib.lib.ekv_entmax_rows if rows.dtype == np.float32 else _lib.lib.ekv_entmax_rows_f64
    ctx = _lib.context()
    ctx.call(fn, ctx.ptr, rows.ctypes.data, rows.size // n, n, float(alpha), out.ctypes.data)
    return np.moveaxis(out, -1, dim)


def entmax(x, alpha=1.5, dim=-1):
    """alpha-entmax of x along `dim`: p = [(alpha - 1) x - tau]_+^(1/(alpha-1)) with tau such
    that p sums to 1 (alpha = 1 is softmax, 1.5 entmax15, 2 sparsemax; alpha in [1, 4]).

    x: a numpy array or a CPU torch tensor, float32 or float64, any shape; entries equal to
    -inf are masked (p = 0). Returns the same kind and dtype as x. Exact: tau is solved in
    double precision (docs/math.md §0, §8); forward only (no autograd)."""
    alpha = float(alpha)
    if not 1.0 <= alpha <= 4.0:  # also NaN
        raise ValueError(f"entmaxkv.entmax: alpha={alpha} is outside [1, 4]")
    a = _lib.host_array(x, "x")  # a CPU tensor: a view of it; its dtype checked as numpy's
    p = _rows_entmax(a, alpha, dim, "entmax")
    if _lib.is_torch(x):
        import torch

        return torch.from_numpy(p)
    return p


def entmax15(x, dim=-1):
    """1.5-entmax (sparse, smooth): entmax(x, 1.5, dim)."""
    return entmax(x, 1.5, dim)


def sparsemax(x, dim=-1):
    """Sparsemax, the Euclidean projection onto the simplex: entmax(x, 2, dim)."""
    return entmax(x, 2.0, dim)


def _attention_args(who, q, k, v, alpha, causal, alibi_slopes, scale, extra=()):
    """The library's parameters and C-ready arrays of an attention call; shapes and dtypes are
    checked here, values (alpha, scale, slopes, NaN) by the library."""
    arrays = [_lib.host_array(x, name) for x, name in [(q, "q"), (k, "k"), (v, "v"), *extra]]
    dt = arrays[0].dtype
    if dt not in (np.float32, np.float64) or any(a.dtype != dt for a in arrays):
        raise TypeError(f"entmaxkv.{who}: q, k, v (and dout) must all be float32 or all "
                        f"float64; got {[str(a.dtype) for a in arrays]}")
    qa, ka, va = arrays[:3]
    if qa.ndim != 3 or ka.ndim != 3 or ka.shape != va.shape or qa.shape[2] != ka.shape[2]:
        raise ValueError(f"entmaxkv.{who}: q must be [T, H, D] and k, v [N, Hk, D] with the "
                         f"same D; got {list(qa.shape)}, {list(ka.shape)}, {list(va.shape)}")
    (T, H, D), N, Hk = qa.shape, ka.shape[0], ka.shape[1]
    prm = _lib.lib.ekv_attention_default_params()
    prm.num_queries, prm.num_keys = _lib.as_int(T, "T", 64), _lib.as_int(N, "N", 64)
    prm.num_heads, prm.num_kv_heads, prm.head_dim = _lib.as_int(H, "H"), _lib.as_int(Hk, "Hk"), \
        _lib.as_int(D, "D")
    prm.causal, prm.alpha = int(bool(causal)), float(alpha)
    prm.scale = 0.0 if scale is None else float(scale)
    slopes = None
    if alibi_slopes is not None:
        slopes = _lib.c_array(np.asarray(_lib.host_array(alibi_slopes, "alibi_slopes"),
                                         np.float32).reshape(-1), np.float32)
        if slopes.shape != (H,):
            raise ValueError(f"entmaxkv.{who}: alibi_slopes must hold H={H} slopes; got "
                             f"{slopes.size}")
        prm.alibi_slopes = slopes.ctypes.data
    return prm, [_lib.c_array(a) for a in arrays], slopes


def _call_attention(stage, qa, *args):
    """ekv_entmax_attention_<stage> (float32 arrays) or its _f64 form (float64), on the
    thread's context."""
    fn = getattr(_lib.lib, f"ekv_entmax_attention_{stage}"
                 + ("_f64" if qa.dtype == np.float64 else ""))
    ctx = _lib.context()
    ctx.call(fn, ctx.ptr, *args)


def entmax_attention(q, k, v, alpha=1.5, causal=True, alibi_slopes=None, scale=None):
    """Exact entmax attention of T query rows over N keys, in double on the CPU (the reference
    that kernels are checked against, docs/math.md §13): q [T, H, D], k and v [N, Hk, D]
    (numpy or CPU torch, all float32 or all float64; H a multiple of Hk). Row t sits at position
    N - T + t; causal rows see the keys up to it (T <= N). alibi_slopes: H slopes, the bias
    -m_h |j - i|; scale None = 1/sqrt(D). Returns (out [T, H, D] in q's dtype, tau [T, H]
    float64, each row's threshold in z-space), numpy arrays."""
    prm, (qa, ka, va), _slopes = _attention_args("entmax_attention", q, k, v, alpha, causal,
                                                 alibi_slopes, scale)
    out, tau = np.empty_like(qa), np.empty(qa.shape[:2], np.float64)
    _call_attention("forward", qa, prm, qa.ctypes.data, ka.ctypes.data, va.ctypes.data,
                    out.ctypes.data, tau.ctypes.data)
    return out, tau


def entmax_attention_ohat(q, k, v, tau, alpha=1.5, causal=True, alibi_slopes=None, scale=None):
    """o-hat [T, H, D] (q's dtype, numpy) of entmax_attention's rows given its tau [T, H]: the
    w-weighted mean of the support's V rows, w = p^(2 - alpha), which the backward's
    delta = dout . o-hat needs (docs/math.md §13.3); softmax: out. A tau that is not the
    forward's raises EntmaxKVError."""
    prm, (qa, ka, va), _slopes = _attention_args("entmax_attention_ohat", q, k, v, alpha, causal,
                                                 alibi_slopes, scale)
    ta = _tau_array("entmax_attention_ohat", tau, qa)
    ohat = np.empty_like(qa)
    _call_attention("ohat", qa, prm, qa.ctypes.data, ka.ctypes.data, va.ctypes.data,
                    ta.ctypes.data, ohat.ctypes.data)
    return ohat


def _tau_array(fname, tau, qa):
    """tau as a C float64 array of shape [T, H] (q's first two dims), or ValueError."""
    ta = _lib.c_array(np.asarray(_lib.host_array(tau, "tau"), np.float64), np.float64)
    if ta.shape != qa.shape[:2]:
        raise ValueError(f"entmaxkv.{fname}: tau must be {list(qa.shape[:2])}; got "
                         f"{list(ta.shape)}")
    return ta


def entmax_attention_backward(q, k, v, tau, dout, alpha=1.5, causal=True, alibi_slopes=None,
                              scale=None):
    """The gradients (dq, dk, dv) of entmax_attention given dout = dL/dout [T, H, D] and the
    forward's tau [T, H]: the entmax Jacobian on the support (docs/math.md §13.2-13.3), in
    double. A tau that is not the forward's raises EntmaxKVError."""
    prm, (qa, ka, va, da), _slopes = _attention_args(
            "entmax_attention_backward", q, k, v, alpha, causal, alibi_slopes, scale,
            extra=[(dout, "dout")])
    if da.shape != qa.shape:
        raise ValueError(f"entmaxkv.entmax_attention_backward: dout must be {list(qa.shape)}; "
                         f"got {list(da.shape)}")
    ta = _tau_array("entmax_attention_backward", tau, qa)
    dq, dk, dv = np.empty_like(qa), np.empty_like(ka), np.empty_like(va)
    _call_attention("backward", qa, prm, qa.ctypes.data, ka.ctypes.data, va.ctypes.data,
                    ta.ctypes.data, da.ctypes.data, dq.ctypes.data, dk.ctypes.data,
                    dv.ctypes.data)
    return dq, dk, dv
