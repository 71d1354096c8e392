"""PagedKVCache: the library's paged KV cache (page pool, sequences, append, page summaries)."""
import ctypes
import threading

import numpy as np

from . import _lib
from ._lib import DTYPES, LAYOUTS, as_int, c_array, host_array, int_array, lib

_NP_SRC = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}  # ekv_dtype of append's input


class _Pool:
    """Owns the C cache (and the caller's page arrays of a wrapped one): ekv_cache_free runs
    when the last reference goes, the PagedKVCache's until close() or each numpy view of the
    pool (Memory), so no view ever reads freed memory."""

    def __init__(self, ptr, ctx, arrays):
        self.ptr, self.ctx, self.arrays = ptr, ctx, arrays  # ctx: the cache reports into it

    def __del__(self):
        if lib is not None and self.ptr:
            lib.ekv_cache_free(self.ptr)


class PagedKVCache:
    """A paged KV cache with the per-page key summaries the sparse methods read (docs/math.md
    §1). Pages hold K and V in one of two layouts: "HND" [num_pages, num_kv_heads, page_size,
    head_dim] (the library's default) or "NHD" [num_pages, page_size, num_kv_heads, head_dim]
    (FlashInfer's and vLLM's). The pool is the library's, or the caller's (`wrap`).

    num_pages: pages in the pool; page_size: tokens per page (1..256); dtype: storage of K and
    V, "float16", "bfloat16" or "float32"; max_seqs: sequences alive at once; superpage_pages:
    pages per superpage summary (0 = none); code_bits: 4 or 8 to keep the key codes the
    "screened" method reads (0 = none); compact_ranges: keep the page ranges in K's 16-bit
    type (exact, half the bytes)."""

    def __init__(self, num_pages, page_size=16, num_kv_heads=8, head_dim=128, dtype="float16",
                 max_seqs=64, superpage_pages=16, code_bits=0, compact_ranges=True,
                 layout="HND", _pools=None):
        if dtype not in DTYPES:
            raise ValueError(f"PagedKVCache: dtype={dtype!r}: expected one of {sorted(DTYPES)}")
        if layout not in LAYOUTS:
            raise ValueError(f"PagedKVCache: layout={layout!r}: expected 'HND' or 'NHD'")
        p = lib.ekv_cache_default_params()
        p.num_pages, p.dtype = as_int(num_pages, "num_pages", 64), DTYPES[dtype]
        p.page_size, p.head_dim = as_int(page_size, "page_size"), as_int(head_dim, "head_dim")
        p.num_kv_heads = as_int(num_kv_heads, "num_kv_heads")
        p.max_seqs = as_int(max_seqs, "max_seqs")
        p.superpage_pages = as_int(superpage_pages, "superpage_pages")
        p.code_bits = as_int(code_bits, "code_bits")
        p.range_dtype = lib.ekv_cache_compact_ranges(p.dtype) if compact_ranges else 0
        p.layout = LAYOUTS[layout]
        if _pools is not None:  # the caller's arrays: kept alive as long as the pool
            p.k_pool, p.v_pool = _pools[0].ctypes.data, _pools[1].ctypes.data
        # The cache's calls (and decodes over it, DecodeWrapper) hold self._lock: one at a
        # time, so an append never runs while another thread reads the cache; the C calls run
        # on the context of the creating thread, under its lock (_lib.Context).
        self._lock, self._ctx = threading.RLock(), _lib.context()
        ptr = ctypes.c_void_p()
        self._ctx.call(lib.ekv_cache_create, self._ctx.ptr, ctypes.byref(p), ctypes.byref(ptr))
        self._owner = _Pool(ptr, self._ctx, _pools)
        self.page_size, self.num_kv_heads, self.head_dim = p.page_size, p.num_kv_heads, p.head_dim
        self.num_pages, self.dtype, self.code_bits = p.num_pages, dtype, p.code_bits
        self.layout = layout

    @classmethod
    def wrap(cls, k_pages, v_pages, layout="NHD", **kw):
        """A cache over the caller's K and V page arrays (numpy, C-contiguous, float16 or
        float32, 16-byte aligned; NHD: [num_pages, page_size, num_kv_heads, head_dim], HND:
        [num_pages, num_kv_heads, page_size, head_dim]). Appends write into them and keep the
        summaries; the caller may read them (e.g. run another kernel on the same pages) but
        must not write them. Other keyword arguments as the constructor. Torch CUDA pages give
        a CudaPagedKVCache over them (CudaPagedKVCache.wrap)."""
        if _lib.is_torch(k_pages) and k_pages.device.type == "cuda":
            from .cuda_cache import CudaPagedKVCache

            return CudaPagedKVCache.wrap(k_pages, v_pages, layout=layout, **kw)
        k, v = np.asarray(k_pages), np.asarray(v_pages)
        if k.shape != v.shape or k.ndim != 4:
            raise ValueError(f"PagedKVCache.wrap: k_pages and v_pages must share a 4-d shape; "
                             f"got {k.shape} and {v.shape}")
        if k.dtype != v.dtype or k.dtype not in (np.float16, np.float32):
            raise TypeError(f"PagedKVCache.wrap: float16 or float32 pages; got {k.dtype}, "
                            f"{v.dtype}")
        for name, a in (("k_pages", k), ("v_pages", v)):
            if not a.flags.c_contiguous or not a.flags.writeable or a.ctypes.data % 16:
                raise ValueError(f"PagedKVCache.wrap: {name} must be C-contiguous, writable "
                                 "and 16-byte aligned")
        if np.may_share_memory(k, v):  # contiguous: their extents overlap, so their pages do
            raise ValueError("PagedKVCache.wrap: k_pages and v_pages overlap: appends to V would "
                             "overwrite K (pass two separate arrays)")
        if layout not in LAYOUTS:
            raise ValueError(f"PagedKVCache.wrap: layout={layout!r}: expected 'HND' or 'NHD'")
        pages, a, b, dim = k.shape
        ps, hk = (a, b) if layout == "NHD" else (b, a)
        dtype = "float16" if k.dtype == np.float16 else "float32"
        return cls(pages, page_size=ps, num_kv_heads=hk, head_dim=dim, dtype=dtype,
                   layout=layout, _pools=(k, v), **kw)

    def close(self):
        """Ends the cache: later calls raise RuntimeError. Its memory is freed now, or, while
        numpy views of it (`k`, `v`, or arrays sliced from them) are alive, when the last of
        them goes; until then they stay valid read-only arrays."""
        with self._lock:
            self._owner = None

    def _live(self):
        owner = getattr(self, "_owner", None)
        if owner is None:
            raise RuntimeError("PagedKVCache: the cache was closed")
        return owner.ptr

    def _call(self, fn, *args):
        """fn(cache, *args) under the cache's lock and its context's (see __init__)."""
        with self._lock:
            self._ctx.call(fn, self._live(), *args)

    def new_sequence(self):
        """A new, empty sequence; returns its id."""
        seq = ctypes.c_int32()
        self._call(lib.ekv_cache_seq_new, ctypes.byref(seq))
        return seq.value

    def free_sequence(self, seq):
        """Frees a sequence and returns its pages to the pool."""
        self._call(lib.ekv_cache_seq_free, as_int(seq, "seq"))

    def length(self, seq):
        """Tokens in the sequence."""
        n = ctypes.c_int64()
        self._call(lib.ekv_cache_seq_length, as_int(seq, "seq"), ctypes.byref(n))
        return n.value

    def version(self, seq):
        """A number every change to the sequence (append, adopt, free and a new sequence with
        its id) replaces with one it never had: a page table taken earlier is stale once it
        moved, even when the length agrees (ekv_cache_seq_version)."""
        return self._versions([seq])[0]

    def _versions(self, seqs):
        """version() of each sequence, under one acquisition of the locks: DecodeWrapper
        checks them at each step."""
        v, out = ctypes.c_uint64(), []
        with self._lock, self._ctx.lock:
            ptr = self._live()
            for seq in seqs:
                _lib.check(lib.ekv_cache_seq_version(ptr, as_int(seq, "seq"), ctypes.byref(v)),
                           self._ctx.ptr)
                out.append(v.value)
        return out

    def _lengths(self, seqs):
        """length() of each sequence (ints), under one acquisition of the locks: DecodeWrapper
        checks them at each step."""
        n, out = ctypes.c_int64(), []
        with self._lock, self._ctx.lock:
            ptr = self._live()
            for seq in seqs:
                _lib.check(lib.ekv_cache_seq_length(ptr, as_int(seq, "seq"), ctypes.byref(n)),
                           self._ctx.ptr)
                out.append(n.value)
        return out

    @property
    def free_pages(self):
        with self._lock, self._ctx.lock:
            return lib.ekv_cache_free_pages(self._live())

    def append(self, seq, k, v):
        """Appends tokens to a sequence: k and v are [tokens, num_kv_heads, head_dim] (float32
        or float16, numpy or CPU torch), converted to the storage dtype; the page summaries are
        updated. Nothing changes when it fails (too few free pages, NaN or inf in the input)."""
        seq = as_int(seq, "seq")
        k, v = host_array(k, "k"), host_array(v, "v")
        want = (self.num_kv_heads, self.head_dim)
        if k.ndim != 3 or k.shape[1:] != want or k.shape != v.shape:
            raise ValueError(f"PagedKVCache.append: k and v must both be [tokens, {want[0]}, "
                             f"{want[1]}]; got {k.shape} and {v.shape}")
        if k.dtype != v.dtype or k.dtype not in _NP_SRC:
            raise TypeError(f"PagedKVCache.append: k and v must share a dtype, float32 or "
                            f"float16; got {k.dtype} and {v.dtype}")
        if k.shape[0] == 0:
            return
        k, v = c_array(k), c_array(v)
        self._call(lib.ekv_cache_append, seq, k.shape[0], k.ctypes.data, v.ctypes.data,
                   _NP_SRC[k.dtype])

    def adopt(self, pages, last_page_len):
        """A new sequence over pages the caller's engine has already filled (a cache made by
        `wrap`): the pages (physical ids, in order) leave the free list, each full but the
        last, which holds last_page_len tokens; their summaries and key codes are built from
        the stored keys, as appends would have. Returns the sequence id; later tokens come by
        append. Fails, changing nothing, for a page that is not free, listed twice, or holds
        NaN or inf."""
        pages = int_array(pages, "pages").reshape(-1)
        last_page_len = as_int(last_page_len, "last_page_len")
        if len(pages) == 0:
            raise ValueError("PagedKVCache.adopt: no pages")
        with self._lock:  # the new sequence and its pages in one step
            seq = self.new_sequence()
            try:
                self._call(lib.ekv_cache_seq_adopt, seq, pages.ctypes.data, len(pages),
                           last_page_len)
            except BaseException:
                self.free_sequence(seq)
                raise
        return seq

    def page_table(self, seqs):
        """The CSR page table of the sequences, FlashInfer's names: (indptr int64 [n + 1],
        indices int32 physical pages, last_page_len int32 [n])."""
        seqs = int_array(seqs, "seqs").reshape(-1)
        n = as_int(len(seqs), "the number of sequences")
        indptr = np.empty(n + 1, np.int64)
        last = np.empty(n, np.int32)
        need = ctypes.c_int64()
        with self._lock:  # both calls see the same cache
            self._call(lib.ekv_cache_page_table, seqs.ctypes.data, n, indptr.ctypes.data, None,
                       0, last.ctypes.data, ctypes.byref(need))
            indices = np.empty(max(need.value, 1), np.int32)
            self._call(lib.ekv_cache_page_table, seqs.ctypes.data, n, indptr.ctypes.data,
                       indices.ctypes.data, len(indices), last.ctypes.data, None)
        return indptr, indices[: need.value], last

    def _view(self):
        kv, st = _lib.PagedKV(), _lib.PageStats()
        self._call(lib.ekv_cache_kv_view, ctypes.byref(kv), ctypes.byref(st))
        return kv, st

    def _pool(self, which):
        with self._lock:
            kv, _ = self._view()
            owner = self._owner
        shape = ((kv.num_pages, kv.num_kv_heads, kv.page_size, kv.head_dim)
                 if self.layout == "HND" else
                 (kv.num_pages, kv.page_size, kv.num_kv_heads, kv.head_dim))
        # bfloat16 has no numpy dtype: its bit patterns, as uint16
        dt = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[self.dtype]
        # read-only (writing K would leave the page summaries stale); the array holds the
        # pool, so it stays valid after the cache object is gone or closed
        return _lib.Memory(owner, getattr(kv, which), shape, dt).array()

    @property
    def k(self):
        """Read-only view of the K pool in the cache's layout (HND [num_pages, num_kv_heads,
        page_size, head_dim] or NHD [num_pages, page_size, num_kv_heads, head_dim]; bfloat16:
        the bit patterns as uint16). It keeps the pool alive (see close())."""
        return self._pool("k")

    @property
    def v(self):
        """Read-only view of the V pool, as `k`."""
        return self._pool("v")
