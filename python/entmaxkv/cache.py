"""PagedKVCache: the library's paged KV cache (page pool, sequences, append, page summaries)."""
import ctypes

import numpy as np

from . import _lib
from ._lib import DTYPES, LAYOUTS, check, host_array, lib

_NP_SRC = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}  # ekv_dtype of append's input


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
        p.num_pages, p.page_size, p.num_kv_heads = int(num_pages), int(page_size), int(num_kv_heads)
        p.head_dim, p.dtype, p.max_seqs = int(head_dim), DTYPES[dtype], int(max_seqs)
        p.superpage_pages, p.code_bits = int(superpage_pages), int(code_bits)
        p.range_dtype = lib.ekv_cache_compact_ranges(p.dtype) if compact_ranges else 0
        p.layout = LAYOUTS[layout]
        self._pools = _pools  # the caller's arrays: kept alive as long as the cache
        if _pools is not None:
            p.k_pool, p.v_pool = _pools[0].ctypes.data, _pools[1].ctypes.data
        self._ptr = ctypes.c_void_p()
        self._holder = _lib.context_holder()  # the cache's context lives as long as the cache
        self._ctx = self._holder.ctx
        check(lib.ekv_cache_create(self._ctx, ctypes.byref(p), ctypes.byref(self._ptr)),
              self._ctx)
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
        if layout not in LAYOUTS:
            raise ValueError(f"PagedKVCache.wrap: layout={layout!r}: expected 'HND' or 'NHD'")
        pages, a, b, dim = k.shape
        ps, hk = (a, b) if layout == "NHD" else (b, a)
        dtype = "float16" if k.dtype == np.float16 else "float32"
        return cls(pages, page_size=ps, num_kv_heads=hk, head_dim=dim, dtype=dtype,
                   layout=layout, _pools=(k, v), **kw)

    def close(self):
        """Frees the pool (the views of it die with it)."""
        if getattr(self, "_ptr", None):
            lib.ekv_cache_free(self._ptr)
            self._ptr = None

    def __del__(self):
        self.close()

    def _live(self):
        if not self._ptr:
            raise RuntimeError("PagedKVCache: the cache was closed")
        return self._ptr

    def new_sequence(self):
        """A new, empty sequence; returns its id."""
        seq = ctypes.c_int32()
        check(lib.ekv_cache_seq_new(self._live(), ctypes.byref(seq)), self._ctx)
        return seq.value

    def free_sequence(self, seq):
        """Frees a sequence and returns its pages to the pool."""
        check(lib.ekv_cache_seq_free(self._live(), int(seq)), self._ctx)

    def length(self, seq):
        """Tokens in the sequence."""
        n = ctypes.c_int64()
        check(lib.ekv_cache_seq_length(self._live(), int(seq), ctypes.byref(n)), self._ctx)
        return n.value

    @property
    def free_pages(self):
        return lib.ekv_cache_free_pages(self._live())

    def append(self, seq, k, v):
        """Appends tokens to a sequence: k and v are [tokens, num_kv_heads, head_dim] (float32
        or float16, numpy or CPU torch), converted to the storage dtype; the page summaries are
        updated. Nothing changes when it fails (too few free pages, NaN or inf in the input)."""
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
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        check(lib.ekv_cache_append(self._live(), int(seq), k.shape[0], k.ctypes.data,
                                   v.ctypes.data, _NP_SRC[k.dtype]), self._ctx)

    def adopt(self, pages, last_page_len):
        """A new sequence over pages the caller's engine has already filled (a cache made by
        `wrap`): the pages (physical ids, in order) leave the free list, each full but the
        last, which holds last_page_len tokens; their summaries and key codes are built from
        the stored keys, as appends would have. Returns the sequence id; later tokens come by
        append. Fails, changing nothing, for a page that is not free, listed twice, or holds
        NaN or inf."""
        pages = np.ascontiguousarray(np.asarray(pages, dtype=np.int32).reshape(-1))
        if len(pages) == 0:
            raise ValueError("PagedKVCache.adopt: no pages")
        seq = self.new_sequence()
        try:
            check(lib.ekv_cache_seq_adopt(self._live(), seq, pages.ctypes.data, len(pages),
                                          int(last_page_len)), self._ctx)
        except BaseException:
            self.free_sequence(seq)
            raise
        return seq

    def page_table(self, seqs):
        """The CSR page table of the sequences, FlashInfer's names: (indptr int64 [n + 1],
        indices int32 physical pages, last_page_len int32 [n])."""
        seqs = np.ascontiguousarray(np.asarray(seqs, dtype=np.int32).reshape(-1))
        n = len(seqs)
        indptr = np.empty(n + 1, np.int64)
        last = np.empty(n, np.int32)
        need = ctypes.c_int64()
        check(lib.ekv_cache_page_table(self._live(), seqs.ctypes.data, n, indptr.ctypes.data,
                                       None, 0, last.ctypes.data, ctypes.byref(need)), self._ctx)
        indices = np.empty(max(need.value, 1), np.int32)
        check(lib.ekv_cache_page_table(self._live(), seqs.ctypes.data, n, indptr.ctypes.data,
                                       indices.ctypes.data, len(indices), last.ctypes.data, None), self._ctx)
        return indptr, indices[: need.value], last

    def _view(self):
        kv, st = _lib.PagedKV(), _lib.PageStats()
        check(lib.ekv_cache_kv_view(self._live(), ctypes.byref(kv), ctypes.byref(st)), self._ctx)
        return kv, st

    def _pool(self, which):
        kv, _ = self._view()
        shape = ((kv.num_pages, kv.num_kv_heads, kv.page_size, kv.head_dim)
                 if self.layout == "HND" else
                 (kv.num_pages, kv.page_size, kv.num_kv_heads, kv.head_dim))
        n = int(np.prod(shape))
        if self.dtype == "float32":
            raw, dt = ctypes.c_float * n, np.float32
        else:  # bfloat16 has no numpy dtype: its bit patterns, as uint16
            raw, dt = ctypes.c_uint16 * n, (np.float16 if self.dtype == "float16" else np.uint16)
        a = np.frombuffer(raw.from_address(getattr(kv, which)), dtype=dt).reshape(shape)
        a.flags.writeable = False  # writing K would leave the page summaries stale
        return a

    @property
    def k(self):
        """Read-only view of the K pool in the cache's layout (HND [num_pages, num_kv_heads,
        page_size, head_dim] or NHD [num_pages, page_size, num_kv_heads, head_dim]; bfloat16:
        the bit patterns as uint16). Valid while the cache is open."""
        return self._pool("k")

    @property
    def v(self):
        """Read-only view of the V pool, as `k`."""
        return self._pool("v")

