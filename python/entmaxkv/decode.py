"""DecodeWrapper: one decode step of a batch over a PagedKVCache, every method of the library
(plan once per batch shape, run per step, FlashInfer's split)."""
import ctypes
import numbers
import threading

import numpy as np

from . import _lib, _registry
from ._lib import METHODS, as_int, c_array, host_array, int_array, is_torch, lib, out_array
from .cuda_cache import CudaPagedKVCache
from .cuda_decode import CudaStep


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
        if isinstance(budget, numbers.Integral) and not isinstance(budget, bool):
            budget = as_int(budget, "budget", 64)  # a token count: int64 in C
            if budget < 1:
                raise ValueError(f"DecodeWrapper: budget={budget}: a token budget must be >= 1")
        elif isinstance(budget, numbers.Real) and not isinstance(budget, bool):
            budget = float(budget)
            if not 0.0 < budget <= 1.0:
                raise ValueError(f"DecodeWrapper: budget={budget}: a fraction must be in (0, 1]")
        else:
            raise TypeError("DecodeWrapper: budget is a fraction (float) or tokens (int)")
        if not 1.0 <= float(alpha) <= 4.0:
            raise ValueError(f"DecodeWrapper: alpha={alpha} is outside [1, 4]")
        self.method, self.budget, self.alpha = method, budget, float(alpha)
        self.scale = 0.0 if scale is None else float(scale)
        self._slopes = (None if alibi_slopes is None  # a copy: the plan reads it at each run
                        else c_array(np.array(host_array(alibi_slopes, "alibi_slopes"),
                                              np.float32).reshape(-1)))
        self._lock = threading.RLock()  # plan and run, one thread at a time
        self._plan = self._cuda = self._report = None
        self._retired = []  # CUDA plans a re-plan outgrew, kept for graphs captured on them
        self.handle = _registry.register(self)  # the custom ops' name for it (entmaxkv.ops)

    def plan(self, cache, seqs, num_heads, max_pages_per_seq=None):
        """Fixes the batch: the cache, its sequences (ids, in batch order) and the query heads.
        Call again after any append to these sequences (run() checks).

        Over a CudaPagedKVCache the step runs on the device, on the current stream (run()
        must be called on the same one). max_pages_per_seq (CUDA): the longest sequence, in
        pages, that later plans of this batch shape may hold without a new C plan (default:
        the longest sequence now); re-planning within it only rewrites the device page table,
        so a captured CUDA graph stays valid. A plan that outgrows it makes a new C plan
        (graphs captured before must then be captured again; the old plan is kept until
        close() so that a stale graph does not launch on freed memory)."""
        seqs = int_array(seqs, "seqs").reshape(-1).tolist()  # Python ints: run() checks each
        num_heads = as_int(num_heads, "num_heads")
        if max_pages_per_seq is not None:
            max_pages_per_seq = as_int(max_pages_per_seq, "max_pages_per_seq", 64)
        if len(seqs) == 0:
            raise ValueError("DecodeWrapper.plan: no sequences")
        if num_heads < 1 or num_heads % cache.num_kv_heads:
            raise ValueError(f"DecodeWrapper.plan: num_heads={num_heads} must be a positive "
                             f"multiple of the cache's {cache.num_kv_heads} KV heads")
        if self._slopes is not None and len(self._slopes) != num_heads:
            raise ValueError(f"DecodeWrapper.plan: {len(self._slopes)} ALiBi slopes for "
                             f"{num_heads} heads")
        with self._lock, cache._lock:  # the versions and the page table of one cache state
            lens = cache._lengths(seqs)
            if min(lens) == 0:
                raise ValueError("DecodeWrapper.plan: a sequence of the batch is empty")
            if isinstance(cache, CudaPagedKVCache):
                self._plan_cuda(cache, seqs, lens, num_heads, max_pages_per_seq)
            else:
                self._plan_host(cache, seqs, lens, num_heads)

    def _plan_host(self, cache, seqs, lens, H):
        indptr, indices, last = cache.page_table(seqs)
        B = len(seqs)
        prm, sel = self._params(H)
        kv, st = cache._view()
        table = _lib.PageTable(B, indptr.ctypes.data, indices.ctypes.data, last.ctypes.data)
        tau, sup = np.empty((B, H), np.float64), np.empty((B, H), np.int64)
        info = _lib.DecodeInfo(tau=tau.ctypes.data, support=sup.ctypes.data)
        kv_bytes = 2 * sum(lens) * cache.num_kv_heads * cache.head_dim * lib.ekv_dtype_size(kv.dtype)
        # everything a step passes to the library, built once (run() only adds q and out)
        self._retire_cuda()
        self._plan = dict(cache=cache, seqs=seqs, lens=lens, versions=cache._versions(seqs),
                          shape=(B, H, cache.head_dim),
                          keep=(indptr, indices, last), tau=tau, sup=sup, kv_bytes=kv_bytes,
                          info=info, args=(ctypes.byref(prm), ctypes.byref(sel),
                                           ctypes.byref(kv), ctypes.byref(st),
                                           ctypes.byref(table)), structs=(prm, sel, kv, st, table))

    def _plan_cuda(self, cache, seqs, lens, H, max_pages_per_seq):
        indptr, indices, last = cache.page_table(seqs)
        pages = int(np.diff(indptr).max())
        room = pages if max_pages_per_seq is None else max_pages_per_seq
        if room < pages:
            raise ValueError(f"DecodeWrapper.plan: max_pages_per_seq={room} but a sequence of "
                             f"the batch holds {pages} pages")
        step = self._cuda
        if step is None or not step.fits(cache, len(seqs), H, pages):
            prm, sel = self._params(H)
            step = CudaStep(cache, len(seqs), H, room, prm, sel, self._slopes)
            self._retire_cuda()
        step.set_table(indptr, indices, last)
        self._cuda, self._report = step, None
        self._plan = dict(cache=cache, seqs=seqs, lens=lens, versions=cache._versions(seqs),
                          shape=(len(seqs), H, cache.head_dim))

    def _retire_cuda(self):
        """The current CUDA plan is kept, not freed: a graph captured on it may replay."""
        if self._cuda is not None:
            self._retired.append(self._cuda)
        self._cuda = None

    def close(self):
        """Frees the wrapper's CUDA plans (also when it is collected); nothing on the CPU."""
        with getattr(self, "_lock", threading.RLock()):  # not while another thread runs
            for step in getattr(self, "_retired", []) + [getattr(self, "_cuda", None)]:
                if step is not None:
                    step.free()
            self._retired, self._cuda, self._plan = [], None, None

    def __del__(self):
        self.close()

    @property
    def report(self):
        """What the last run() did (None before the first): on the CPU, tau and support
        [batch, num_heads], bytes_k, bytes_v, bytes_summary, survivors and kv_fraction; on
        CUDA, tau, support, pages_round1/pages_round2 and v_rows [batch, num_kv_heads],
        lists_round2, slow_rows, compacted_rows, launches, survivors, softmax_one_pass, read from the device
        at each access (ekv_cuda_read_report: it synchronises the
        stream, so not inside a graph capture)."""
        with self._lock:
            if self._cuda is not None:  # read each time: a graph replay runs no Python
                return self._cuda.read_report() if self._cuda.ran else None
            return self._report

    def run(self, q, out=None):
        """One step: q [batch, num_heads, head_dim] float32 attends over each sequence;
        returns out (the same shape, float32; written in place when given). Over a host cache
        q and out are numpy arrays or CPU tensors; over a CudaPagedKVCache, contiguous CUDA
        tensors on its device (never copied), and the step is launched on the current stream
        without synchronising (capturable in a CUDA graph). self.report describes the step.
        Under torch.compile the step is the custom op entmaxkv::decode (entmaxkv.ops)."""
        if is_torch(q) and _traced():
            from . import ops

            return ops.run(self, q, out)
        return self._run(q, out)

    def out_shape(self):
        """[batch, num_heads, head_dim] of the planned step (q's and out's shape)."""
        if self._plan is None:
            raise RuntimeError("DecodeWrapper: call plan() first")
        return self._plan["shape"]

    def _run(self, q, out):
        with self._lock:
            pl = self._plan
            if pl is None:
                raise RuntimeError("DecodeWrapper.run: call plan() first")
            with pl["cache"]._lock:  # no append to the cache while the step reads it
                return self._run_locked(pl, q, out)

    def _run_locked(self, pl, q, out):
        cache = pl["cache"]
        if cache._versions(pl["seqs"]) != pl["versions"]:  # not the lengths: a reused id
            raise RuntimeError("DecodeWrapper.run: the cache changed since plan(): call plan() "
                               "again")
        if self._cuda is not None:
            return self._cuda.run(q, out)
        shape, q_in = pl["shape"], q
        q = host_array(q, "q")
        if q.shape != shape or q.dtype != np.float32:
            raise ValueError(f"DecodeWrapper.run: q must be float32 {list(shape)}; got "
                             f"{q.dtype} {q.shape}")
        q = c_array(q)
        torch_out = out is not None and is_torch(out)
        res = (out_array(out, "out", shape, np.float32, [(q, "q")]) if out is not None
               else np.empty(shape, np.float32))
        info, ctx = pl["info"], _lib.context()  # the step runs on the calling thread's context
        ctx.call(lib.ekv_decode, ctx.ptr, *pl["args"], q.ctypes.data, res.ctypes.data,
                 ctypes.byref(info))
        read = info.bytes_k + info.bytes_v + info.bytes_summary
        self._report = dict(tau=pl["tau"], support=pl["sup"], bytes_k=info.bytes_k,
                           bytes_v=info.bytes_v, bytes_summary=info.bytes_summary,
                           survivors=info.survivors, kv_fraction=read / pl["kv_bytes"])
        if torch_out:
            return out
        return _torch().from_numpy(res) if is_torch(q_in) else res

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


def _torch():
    import torch

    return torch


def _traced():
    """torch.compile is tracing the call (torch is imported: q is a tensor)."""
    return _torch().compiler.is_compiling()
