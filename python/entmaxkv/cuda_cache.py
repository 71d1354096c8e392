"""CudaPagedKVCache: a paged KV cache in CUDA memory (torch tensors), filled by the library's
append kernel (ekv_cuda_cache_append), which also keeps the page summaries the sparse methods
read. The tensors are the library's device cache (ekv_cuda_cache_adopt): it says how many bytes
the statistics take and where each array lies, so the layout is the C one. The page bookkeeping
(free pages, each sequence's pages and length) lives on the host, so a decode step never has
to read it back from the device."""
import ctypes
import threading

from . import _lib
from ._device import check_cuda_tensor, current_stream, device_guard, overlap
from ._lib import DTYPES, LAYOUTS, as_int, fail, int_array, lib


def _torch_dtypes():
    torch = _lib.need_torch("CudaPagedKVCache")

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class CudaPagedKVCache:
    """The PagedKVCache interface (new_sequence, append, page_table, ...) over torch CUDA
    tensors: K and V pages [num_pages, num_kv_heads, page_size, head_dim] ("HND") or
    [num_pages, page_size, num_kv_heads, head_dim] ("NHD"), and the page statistics, on
    `device` (default: the current CUDA device). Appends take float32 CUDA tensors and run
    on the caller's current stream. head_dim: a multiple of 8 up to 512 (the CUDA backend's
    range, include/entmaxkv/cuda.h). The cache keeps no superpage summaries (the device has
    none), so its decode reads every page's statistics."""

    def __init__(self, num_pages, page_size=16, num_kv_heads=8, head_dim=128, dtype="float16",
                 max_seqs=64, code_bits=0, compact_ranges=True, layout="HND", device=None,
                 _pools=None):
        torch = _lib.need_torch("CudaPagedKVCache")
        num_pages, page_size, num_kv_heads, head_dim, code_bits, max_seqs = (
            as_int(num_pages, "num_pages", 64), as_int(page_size, "page_size"),
            as_int(num_kv_heads, "num_kv_heads"), as_int(head_dim, "head_dim"),
            as_int(code_bits, "code_bits"), as_int(max_seqs, "max_seqs"))
        self._check_shape(num_pages, page_size, num_kv_heads, head_dim, dtype, code_bits,
                          layout, max_seqs)
        dev = torch.device("cuda" if device is None else device)
        if dev.type != "cuda":
            raise ValueError(f"CudaPagedKVCache: device={device!r} is not a CUDA device")
        self.device = torch.device("cuda", torch.cuda.current_device() if dev.index is None
                                   else dev.index)
        self.num_pages, self.page_size, self.num_kv_heads = num_pages, page_size, num_kv_heads
        self.head_dim, self.dtype, self.code_bits, self.layout = head_dim, dtype, code_bits, layout
        self.max_seqs = max_seqs
        P, ps, Hk, D = self.num_pages, self.page_size, self.num_kv_heads, self.head_dim
        shape = (P, Hk, ps, D) if layout == "HND" else (P, ps, Hk, D)
        if _pools is None:
            tdt = _torch_dtypes()[dtype]
            _pools = (torch.zeros(shape, dtype=tdt, device=self.device),
                      torch.zeros(shape, dtype=tdt, device=self.device))
        self.k, self.v = _pools
        # The plans report into this context (_lib.Context); the host bookkeeping and every
        # call on the cache (and decodes over it) hold self._lock, one thread at a time.
        self._lock, self._ctx = threading.RLock(), _lib.context()
        self._plans = {}  # cudaStream_t -> the small plan ekv_cuda_cache_append launches with
        self._open_cache(compact_ranges)
        self._free = list(range(P - 1, -1, -1))  # pop() hands out page 0 first
        self._seqs = {}  # id -> [pages (list of physical ids), length]
        self._versions_of, self._clock = {}, 0  # id -> version (_touch)

    @staticmethod
    def _check_shape(num_pages, page_size, num_kv_heads, head_dim, dtype, code_bits, layout,
                     max_seqs):
        if dtype not in DTYPES:
            raise ValueError(f"CudaPagedKVCache: dtype={dtype!r}: expected one of {sorted(DTYPES)}")
        if layout not in LAYOUTS:
            raise ValueError(f"CudaPagedKVCache: layout={layout!r}: expected 'HND' or 'NHD'")
        if not 1 <= page_size <= 256:
            raise ValueError(f"CudaPagedKVCache: page_size={page_size} must be in [1, 256]")
        if head_dim < 8 or head_dim % 8 or head_dim > 512:
            raise ValueError(f"CudaPagedKVCache: head_dim={head_dim} must be a multiple of 8 "
                             "in [8, 512] (the CUDA backend's range)")
        if code_bits not in (0, 4, 8):
            raise ValueError(f"CudaPagedKVCache: code_bits={code_bits} must be 0, 4 or 8")
        if num_pages < 1 or num_kv_heads < 1 or max_seqs < 1:
            raise ValueError("CudaPagedKVCache: num_pages, num_kv_heads and max_seqs must be >= 1")

    @classmethod
    def wrap(cls, k_pages, v_pages, layout="NHD", **kw):
        """A cache over the caller's K and V page tensors (torch CUDA, contiguous, float16,
        bfloat16 or float32, 16-byte aligned; the layout as PagedKVCache.wrap). Appends write
        into them; the caller may read them, not write them (the statistics would go stale)."""
        if not _lib.is_torch(k_pages) or not _lib.is_torch(v_pages):
            raise TypeError("CudaPagedKVCache.wrap: k_pages and v_pages must be torch CUDA tensors")
        if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
            raise ValueError(f"CudaPagedKVCache.wrap: k_pages and v_pages must share a 4-d shape; "
                             f"got {list(k_pages.shape)} and {list(v_pages.shape)}")
        names = {t: n for n, t in _torch_dtypes().items()}
        if k_pages.dtype not in names:
            raise TypeError(f"CudaPagedKVCache.wrap: float16, bfloat16 or float32 pages; got "
                            f"{k_pages.dtype}")
        if layout not in LAYOUTS:
            raise ValueError(f"CudaPagedKVCache.wrap: layout={layout!r}: expected 'HND' or 'NHD'")
        for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
            check_cuda_tensor(t, name, k_pages.dtype, k_pages.shape, k_pages.device, aligned=True)
        if overlap(k_pages, v_pages):
            raise ValueError("CudaPagedKVCache.wrap: k_pages and v_pages overlap: appends to V "
                             "would overwrite K (pass two separate tensors)")
        pages, a, b, dim = k_pages.shape
        ps, hk = (a, b) if layout == "NHD" else (b, a)
        return cls(pages, page_size=ps, num_kv_heads=hk, head_dim=dim,
                   dtype=names[k_pages.dtype], layout=layout, device=k_pages.device,
                   _pools=(k_pages, v_pages), **kw)

    def _cache_params(self, compact_ranges):
        """The geometry as the library's device cache takes it (ekv_cuda_cache_params)."""
        p = lib.ekv_cuda_cache_default_params()
        p.device, p.num_pages, p.page_size = self.device.index, self.num_pages, self.page_size
        p.num_kv_heads, p.head_dim, p.code_bits = self.num_kv_heads, self.head_dim, self.code_bits
        p.dtype, p.layout = DTYPES[self.dtype], LAYOUTS[self.layout]
        p.range_dtype = lib.ekv_cache_compact_ranges(p.dtype) if compact_ranges else 0
        p.compact_ball, p.superpage_pages = 1, 0  # as the C cache's compact ranges; no boxes
        return p

    def _open_cache(self, compact_ranges):
        """The library's device cache over self.k, self.v and a zeroed statistics block of the
        size it asks for (ekv_cuda_cache_sizes), and its views (ekv_cuda_cache_view)."""
        import torch

        p = self._cache_params(compact_ranges)
        self.range_dtype = p.range_dtype
        stats = ctypes.c_int64()
        self._ctx.call(lib.ekv_cuda_cache_sizes, self._ctx.ptr, ctypes.byref(p), None,
                       ctypes.byref(stats))
        self._stats_t = torch.zeros(stats.value, dtype=torch.uint8, device=self.device)
        cache = ctypes.c_void_p()
        with device_guard(self.device):
            self._ctx.call(lib.ekv_cuda_cache_adopt, self._ctx.ptr, ctypes.byref(p),
                           self.k.data_ptr(), self.v.data_ptr(), self._stats_t.data_ptr(),
                           ctypes.byref(cache))
        self._cache = cache
        self._kv, self._st = _lib.PagedKV(), _lib.PageStats()
        self._ctx.call(lib.ekv_cuda_cache_view, cache, ctypes.byref(self._kv),
                       ctypes.byref(self._st))

    def close(self):
        """Frees the append plans (a later append makes them again); the tensors go with the
        last reference to them."""
        with getattr(self, "_lock", threading.RLock()):
            for plan in getattr(self, "_plans", {}).values():
                lib.ekv_cuda_plan_free(plan)
            self._plans = {}

    def __del__(self):
        self.close()
        if getattr(self, "_cache", None):  # the library's object over the tensors, not them
            lib.ekv_cuda_cache_free(self._cache)
            self._cache = None

    def _append_plan(self):
        """The plan ekv_cuda_cache_append launches on: one per stream the caller appended on."""
        stream = current_stream(self.device)
        plan = self._plans.get(stream)
        if plan is None:
            p = lib.ekv_cuda_plan_default_params()
            p.device, p.stream, p.max_batch = self.device.index, stream, 1
            p.num_heads = p.num_kv_heads = self.num_kv_heads
            p.head_dim, p.page_size, p.max_pages_per_seq = self.head_dim, self.page_size, 1
            plan = ctypes.c_void_p()
            with device_guard(self.device):
                self._ctx.call(lib.ekv_cuda_plan_create, self._ctx.ptr, ctypes.byref(p),
                               ctypes.byref(plan))
            self._plans[stream] = plan
        return plan

    def new_sequence(self):
        """A new, empty sequence; returns its id."""
        with self._lock:
            if len(self._seqs) >= self.max_seqs:
                fail("INVALID_ARGUMENT", f"max_seqs={self.max_seqs} sequences are already alive")
            seq = next(i for i in range(self.max_seqs + 1) if i not in self._seqs)
            self._seqs[seq] = [[], 0]
            self._touch(seq)
            return seq

    def _touch(self, seq):
        """A new version for a changed sequence (as the C cache's ekv_cache_seq_version)."""
        self._clock += 1
        self._versions_of[seq] = self._clock

    def _seq(self, seq):
        s = self._seqs.get(as_int(seq, "seq"))
        if s is None:
            fail("INVALID_SEQUENCE", f"sequence {seq} is not alive in this cache")
        return s

    def free_sequence(self, seq):
        """Frees a sequence and returns its pages to the pool."""
        with self._lock:
            pages, _ = self._seq(seq)
            self._free.extend(reversed(pages))
            del self._seqs[as_int(seq, "seq")]

    def length(self, seq):
        """Tokens in the sequence."""
        with self._lock:
            return self._seq(seq)[1]

    def _lengths(self, seqs):
        """length() of each sequence, as PagedKVCache._lengths."""
        with self._lock:
            return [self._seq(s)[1] for s in seqs]

    def version(self, seq):
        """A number every change to the sequence replaces with one it never had (as
        PagedKVCache.version): a page table taken earlier is stale once it moved."""
        return self._versions([seq])[0]

    def _versions(self, seqs):
        """version() of each sequence, as PagedKVCache._versions."""
        out = []
        with self._lock:
            for s in seqs:
                self._seq(s)  # alive, else INVALID_SEQUENCE
                out.append(self._versions_of[as_int(s, "seq")])
        return out

    @property
    def free_pages(self):
        with self._lock:
            return len(self._free)

    def append(self, seq, k, v):
        """Appends tokens: k and v float32 CUDA tensors [tokens, num_kv_heads, head_dim],
        contiguous, on the cache's device; written in the storage dtype with the summaries
        (and key codes) of every touched page, on the current stream. Refused, changing
        nothing, for too few free pages or NaN/inf in k or v (that check synchronises)."""
        with self._lock:
            self._append(seq, k, v)

    def _append(self, seq, k, v):
        import torch

        pages, n0 = self._seq(seq)
        check_cuda_tensor(k, "k", torch.float32, None, self.device)
        check_cuda_tensor(v, "v", torch.float32, None, self.device)
        want = (self.num_kv_heads, self.head_dim)
        if k.dim() != 3 or tuple(k.shape[1:]) != want or k.shape != v.shape:
            raise ValueError(f"CudaPagedKVCache.append: k and v must both be [tokens, {want[0]}, "
                             f"{want[1]}]; got {list(k.shape)} and {list(v.shape)}")
        n = k.shape[0]
        if n == 0:
            return
        items, new_pages = self._plan_items(pages, n0, n)
        if not bool(torch.isfinite(k).all() & torch.isfinite(v).all()):
            fail("NAN_INPUT", "CudaPagedKVCache.append: k or v holds NaN or infinite values")
        self._launch_append(items, k, v)
        self._commit(seq, new_pages, n)

    def _commit(self, seq, new_pages, n):
        """The host side of an append the kernel has been launched for: the pages leave the
        free list (its end, where _plan_items took them) and join the sequence."""
        del self._free[len(self._free) - len(new_pages):]
        entry = self._seq(seq)
        entry[0].extend(new_pages)
        entry[1] += n
        self._touch(as_int(seq, "seq"))

    def _plan_items(self, pages, n0, n):
        """The append items (page, first slot, tokens, source row) for n tokens after n0, and
        the free pages they take (left on the free list until the launch succeeds)."""
        ps = self.page_size
        first = n0 % ps
        fill = min(ps - first, n) if first else 0  # the last page's free slots first
        need = -(-(n - fill) // ps)
        if need > len(self._free):
            fail("CACHE_FULL", f"CudaPagedKVCache.append: {n} tokens need {need} free pages; "
                               f"{len(self._free)} are free")
        new_pages = self._free[len(self._free) - need:][::-1]
        items = [(pages[-1], first, fill, 0)] if fill else []
        src = fill
        for p in new_pages:
            take = min(ps, n - src)
            items.append((p, 0, take, src))
            src += take
        return items, new_pages

    def _launch_append(self, items, k, v):
        import torch

        arr = (_lib.CudaAppendItem * len(items))(*[
            _lib.CudaAppendItem(page=p, first_slot=f, n_new=c, reserved=0, src_token=s)
            for p, f, c, s in items])
        host = torch.frombuffer(bytearray(bytes(arr)), dtype=torch.uint8)
        dev_items = host.to(self.device)  # on the current stream, ahead of the kernel
        plan = self._append_plan()
        with device_guard(self.device):  # the kernel launches on the current device
            self._ctx.call(lib.ekv_cuda_cache_append, plan, self._cache, dev_items.data_ptr(),
                           len(items), k.data_ptr(), v.data_ptr())

    def adopt(self, pages, last_page_len):
        """A new sequence over pages the caller's engine has already written (a cache made by
        `wrap`): each page full but the last, which holds last_page_len tokens. Their
        statistics (and key codes) are built from the stored keys by the append kernel, which
        rewrites each stored row with itself (exact: the storage dtype widened to float32 and
        back). Refused, changing nothing, for a page that is not free or listed twice."""
        pages = int_array(pages, "pages").reshape(-1).tolist()
        last_page_len = as_int(last_page_len, "last_page_len")
        if not pages:
            raise ValueError("CudaPagedKVCache.adopt: no pages")
        if not 1 <= last_page_len <= self.page_size:
            raise ValueError(f"CudaPagedKVCache.adopt: last_page_len={last_page_len} must be in "
                             f"[1, {self.page_size}]")
        with self._lock:
            return self._adopt(pages, last_page_len)

    def _adopt(self, pages, last_page_len):
        free = set(self._free)
        if len(set(pages)) != len(pages) or not set(pages) <= free:
            fail("INVALID_ARGUMENT", "CudaPagedKVCache.adopt: a page is listed twice, out of "
                                     "range or held by another sequence")
        k, v = self._gather(pages, last_page_len)
        seq = self.new_sequence()
        n = k.shape[0]
        items = [(p, 0, self.page_size if i + 1 < len(pages) else last_page_len,
                  i * self.page_size) for i, p in enumerate(pages)]
        try:
            import torch

            if not bool(torch.isfinite(k).all() & torch.isfinite(v).all()):
                fail("NAN_INPUT", "CudaPagedKVCache.adopt: the pages hold NaN or infinite keys "
                                  "or values")
            self._launch_append(items, k, v)
        except BaseException:
            del self._seqs[seq]
            raise
        taken = set(pages)
        self._free = [p for p in self._free if p not in taken]
        self._seqs[seq] = [pages, n]
        self._touch(seq)
        return seq

    def _gather(self, pages, last):
        """The stored rows of these pages as float32 [tokens, num_kv_heads, head_dim]."""
        import torch

        idx = torch.tensor(pages, device=self.device)
        k, v = self.k.index_select(0, idx), self.v.index_select(0, idx)
        if self.layout == "HND":  # [pages, Hk, ps, D] -> [pages, ps, Hk, D]
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        n = (len(pages) - 1) * self.page_size + last
        rows = lambda x: x.reshape(-1, self.num_kv_heads, self.head_dim)[:n].float().contiguous()
        return rows(k), rows(v)

    def page_table(self, seqs):
        """The CSR page table of the sequences, as PagedKVCache.page_table (numpy, host)."""
        import numpy as np

        seqs = int_array(seqs, "seqs").reshape(-1).tolist()
        with self._lock:
            lists = [(list(p), n) for p, n in (self._seq(s) for s in seqs)]
        indptr = np.zeros(len(seqs) + 1, np.int64)
        indptr[1:] = np.cumsum([len(p) for p, _ in lists])
        indices = np.array([pg for p, _ in lists for pg in p], np.int32)
        last = np.array([n - (len(p) - 1) * self.page_size if p else 0 for p, n in lists], np.int32)
        return indptr, indices, last

    def _view(self):
        return self._kv, self._st
