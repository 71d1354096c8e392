"""CudaStep: DecodeWrapper's device half over a CudaPagedKVCache. The C plan
(ekv_cuda_plan_create) allocates every scratch buffer, and the page table lives in device
buffers sized once, so run() only checks on the host and launches (ekv_cuda_decode /
ekv_cuda_decode_certified): no allocation, no synchronisation, capturable in a CUDA graph
(include/entmaxkv/cuda.h). Re-planning after an append rewrites the same buffers, so a graph
captured earlier replays over the new lengths."""
import ctypes

import numpy as np

from . import _lib
from ._device import check_cuda_tensor, check_current_device, current_stream, device_guard, overlap
from ._lib import lib


class CudaStep:
    """One C plan for (cache, batch, heads, stream) with room for max_pages pages per
    sequence; `fits` says whether a new batch can reuse it."""

    def __init__(self, cache, batch, num_heads, max_pages, prm, sel, slopes):
        import torch

        self.cache, self.batch, self.num_heads, self.max_pages = cache, batch, num_heads, max_pages
        self.device, self.stream = cache.device, current_stream(cache.device)
        p = lib.ekv_cuda_plan_default_params()
        p.device, p.stream, p.max_batch = cache.device.index, self.stream, batch
        p.num_heads, p.num_kv_heads = num_heads, cache.num_kv_heads
        p.head_dim, p.page_size, p.max_pages_per_seq = cache.head_dim, cache.page_size, max_pages
        self._ctx = cache._ctx  # the plan reports into the cache's context (_lib.Context)
        self.plan = ctypes.c_void_p()
        with device_guard(self.device):
            self._ctx.call(lib.ekv_cuda_plan_create, self._ctx.ptr, ctypes.byref(p),
                           ctypes.byref(self.plan))
        i32 = dict(dtype=torch.int32, device=self.device)
        self.indptr = torch.zeros(batch + 1, dtype=torch.int64, device=self.device)
        self.indices = torch.zeros(batch * max_pages, **i32)
        self.last = torch.zeros(batch, **i32)
        self.slopes = None if slopes is None else torch.from_numpy(slopes).to(self.device)
        if self.slopes is not None:  # the plan's copy: the C call reads it on the device
            prm.alibi_slopes = self.slopes.data_ptr()
        self.table = _lib.PageTable(batch, self.indptr.data_ptr(), self.indices.data_ptr(),
                                    self.last.data_ptr())
        kv, st = cache._view()
        self.structs = (prm, sel, kv, st, self.table)
        self.args = (ctypes.byref(prm), ctypes.byref(sel), ctypes.byref(kv), ctypes.byref(st),
                     ctypes.byref(self.table))
        self.ran = False  # a step has been launched (eagerly or into a graph)
        self.decode = (lib.ekv_cuda_decode_certified if sel.method == _lib.METHODS["certified"]
                       else lib.ekv_cuda_decode)

    def fits(self, cache, batch, num_heads, pages):
        return (cache is self.cache and batch == self.batch and num_heads == self.num_heads
                and pages <= self.max_pages and current_stream(cache.device) == self.stream)

    def set_table(self, indptr, indices, last):
        """The batch's page table into the plan's device buffers (on the current stream, so
        ahead of any later launch or graph replay there)."""
        import torch

        self.indptr.copy_(torch.from_numpy(indptr))
        self.indices[: len(indices)].copy_(torch.from_numpy(indices))
        self.last.copy_(torch.from_numpy(last))

    def run(self, q, out):
        """Checks q and out (float32 CUDA [batch, heads, head_dim], contiguous, on the cache's
        device), then launches one step on the plan's stream."""
        import torch

        if current_stream(self.device) != self.stream:
            raise RuntimeError("DecodeWrapper.run: the current CUDA stream is not the one plan() "
                               "ran on: call plan() on this stream (to capture a graph, plan "
                               "on the stream given to torch.cuda.graph(..., stream=s))")
        check_current_device(self.device, "DecodeWrapper.run")
        shape = (self.batch, self.num_heads, self.cache.head_dim)
        check_cuda_tensor(q, "q", torch.float32, shape, self.device)
        if out is None:
            out = torch.empty(shape, dtype=torch.float32, device=self.device)
        else:
            check_cuda_tensor(out, "out", torch.float32, shape, self.device)
            if overlap(q, out):
                raise ValueError("entmaxkv: out overlaps q: the result would overwrite its own "
                                 "input")
        self._ctx.call(self.decode, self.plan, *self.args, q.data_ptr(), out.data_ptr())
        self.ran = True
        return out

    def read_report(self):
        """The last step's report (ekv_cuda_read_report: synchronises the plan's stream)."""
        B, H, Hk = self.batch, self.num_heads, self.cache.num_kv_heads
        tau, sup = np.empty((B, H), np.float64), np.empty((B, H), np.int64)
        r1, r2 = np.empty((B, Hk), np.int32), np.empty((B, Hk), np.int32)
        vrows = np.empty((B, Hk), np.int64)
        rep = _lib.CudaReport(tau=tau.ctypes.data, support=sup.ctypes.data,
                              pages_round1=r1.ctypes.data, pages_round2=r2.ctypes.data,
                              v_rows=vrows.ctypes.data)
        self._ctx.call(lib.ekv_cuda_read_report, self.plan, B, ctypes.byref(rep))
        return dict(tau=tau, support=sup, pages_round1=r1, pages_round2=r2, v_rows=vrows,
                    lists_round2=rep.lists_round2, slow_rows=rep.slow_rows,
                    compacted_rows=rep.compacted_rows, launches=rep.launches, survivors=rep.survivors,
                    softmax_one_pass=bool(rep.softmax_one_pass))

    def free(self):
        if self.plan:
            lib.ekv_cuda_plan_free(self.plan)
            self.plan = ctypes.c_void_p()
