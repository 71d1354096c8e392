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
