"""DecodeWrapper: one decode step of a batch over a PagedKVCache, every method of the library
(plan once per batch shape, run per step, FlashInfer's split)."""
import ctypes

import numpy as np

from . import _lib
from ._lib import METHODS, check, host_array, is_torch, lib


class DecodeWrapper:
    """Decode attention with one of the library's methods (docs/architecture.md):
    "dense" (exact), "topk" (the pages with the highest key-box bounds within the budget),
    "gaussian" (the Gaussian-aware page selector), "certified" (exact: reads only the pages
    whose bounds can reach the threshold), "screened" (exact: per-token key codes rule tokens
    out; the cache needs code_bits 4 or 8).

    budget: for topk and certified, a fraction of each sequence's tokens (a float in (0, 1])
    or a token count (an int >= 1). alpha: 1 = softmax, (1, 4] = entmax (default 1.5).
    scale: the score scale (None = 1/sqrt(head_dim)). alibi_slopes: [num_heads] or None."""

    def __init__(self, method="dense", budget=1 / 16, alpha=1.5, scale=None, alibi_slopes=None):
        if method not in METHODS:
            raise ValueError(f"DecodeWrapper: method={method!r}: expected one of "
                             f"{sorted(METHODS)}")
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise TypeError("DecodeWrapper: budget is a fraction (float) or tokens (int)")
        if isinstance(budget, float) and not 0.0 < budget <= 1.0:
            raise ValueError(f"DecodeWrapper: budget={budget}: a fraction must be in (0, 1]")
        if isinstance(budget, int) and budget < 1:
            raise ValueError(f"DecodeWrapper: budget={budget}: a token budget must be >= 1")
        if not 1.0 <= float(alpha) <= 4.0:
            raise ValueError(f"DecodeWrapper: alpha={alpha} is outside [1, 4]")
        self.method, self.budget, self.alpha = method, budget, float(alpha)
        self.scale = 0.0 if scale is None else float(scale)
        self._slopes = (None if alibi_slopes is None
                        else np.ascontiguousarray(alibi_slopes, dtype=np.float32).reshape(-1))
        self._plan = None
        self.report = None

    def plan(self, cache, seqs, num_heads):
        """Fixes the batch: the cache, its sequences (ids, in batch order) and the query heads.
        Call again after any append to these sequences (run() checks)."""
        seqs = np.asarray(seqs, dtype=np.int32).reshape(-1)
        if len(seqs) == 0:
            raise ValueError("DecodeWrapper.plan: no sequences")
        if num_heads < 1 or num_heads % cache.num_kv_heads:
            raise ValueError(f"DecodeWrapper.plan: num_heads={num_heads} must be a positive "
                             f"multiple of the cache's {cache.num_kv_heads} KV heads")
        if self._slopes is not None and len(self._slopes) != num_heads:
            raise ValueError(f"DecodeWrapper.plan: {len(self._slopes)} ALiBi slopes for "
                             f"{num_heads} heads")
        lens = [cache.length(s) for s in seqs]
        if min(lens) == 0:
            raise ValueError("DecodeWrapper.plan: a sequence of the batch is empty")
        indptr, indices, last = cache.page_table(seqs)
        B, H = len(seqs), int(num_heads)
        prm, sel = self._params(H)
        kv, st = cache._view()
        table = _lib.PageTable(B, indptr.ctypes.data, indices.ctypes.data, last.ctypes.data)
        tau, sup = np.empty((B, H), np.float64), np.empty((B, H), np.int64)
        info = _lib.DecodeInfo(tau=tau.ctypes.data, support=sup.ctypes.data)
        kv_bytes = 2 * sum(lens) * cache.num_kv_heads * cache.head_dim * lib.ekv_dtype_size(kv.dtype)
        # everything a step passes to the library, built once (run() only adds q and out)
        self._plan = dict(cache=cache, seqs=seqs, lens=lens, shape=(B, H, cache.head_dim),
                          keep=(indptr, indices, last), tau=tau, sup=sup, kv_bytes=kv_bytes,
                          info=info, args=(ctypes.byref(prm), ctypes.byref(sel),
                                           ctypes.byref(kv), ctypes.byref(st),
                                           ctypes.byref(table)), structs=(prm, sel, kv, st, table))

    def run(self, q, out=None):
        """One step: q [batch, num_heads, head_dim] float32 (numpy or CPU torch) attends over
        each sequence; returns out (the same shape, float32; written in place when given).
        self.report then holds tau and support [batch, num_heads] (overwritten by the next
        step), the bytes read and kv_fraction (bytes read / K+V bytes of the batch)."""
        pl = self._plan
        if pl is None:
            raise RuntimeError("DecodeWrapper.run: call plan() first")
        cache, shape = pl["cache"], pl["shape"]
        if [cache.length(s) for s in pl["seqs"]] != pl["lens"]:
            raise RuntimeError("DecodeWrapper.run: the cache changed since plan(): call plan() "
                               "again")
        q = host_array(q, "q")
        if q.shape != shape or q.dtype != np.float32:
            raise ValueError(f"DecodeWrapper.run: q must be float32 {list(shape)}; got "
                             f"{q.dtype} {q.shape}")
        q = np.ascontiguousarray(q)
        torch_out = out is not None and is_torch(out)
        res = host_array(out, "out") if out is not None else np.empty(shape, np.float32)
        if res.shape != shape or res.dtype != np.float32 or not res.flags.c_contiguous:
            raise ValueError(f"DecodeWrapper.run: out must be C-contiguous float32 "
                             f"{list(shape)}")
        info = pl["info"]
        ctx = _lib.context()
        check(lib.ekv_decode(ctx, *pl["args"], q.ctypes.data, res.ctypes.data,
                             ctypes.byref(info)), ctx)
        read = info.bytes_k + info.bytes_v + info.bytes_summary
        self.report = dict(tau=pl["tau"], support=pl["sup"], bytes_k=info.bytes_k,
                           bytes_v=info.bytes_v, bytes_summary=info.bytes_summary,
                           survivors=info.survivors, kv_fraction=read / pl["kv_bytes"])
        return out if torch_out else res

    def _params(self, H):
        prm = lib.ekv_decode_default_params()
        prm.num_heads, prm.alpha, prm.scale = H, self.alpha, self.scale
        prm.alibi_slopes = self._slopes.ctypes.data if self._slopes is not None else None
        sel = lib.ekv_select_default_params()
        sel.method = METHODS[self.method]
        if isinstance(self.budget, float):
            sel.budget_fraction = self.budget
        else:
            sel.budget_tokens = self.budget
        return prm, sel
