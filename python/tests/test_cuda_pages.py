"""CudaPagedKVCache's host bookkeeping (which pages an append takes, the items the append
kernel gets, the page table, sequence ids) without a GPU: the object is made without its
device tensors, and only the host methods are called. The device side is in
test_torch_cuda.py."""
import ctypes
import threading
import types

import numpy as np
import pytest

import entmaxkv
from entmaxkv import _lib
from entmaxkv.cuda_cache import CudaPagedKVCache


def host_only(num_pages=10, page_size=16, max_seqs=4):
    c = object.__new__(CudaPagedKVCache)
    c.num_pages, c.page_size, c.max_seqs = num_pages, page_size, max_seqs
    c._free, c._seqs, c._plans = list(range(num_pages - 1, -1, -1)), {}, {}
    c._versions_of, c._clock = {}, 0
    c._lock = threading.RLock()
    return c


def take(c, seq, n):
    """append's host steps around the kernel launch: the items, then the bookkeeping."""
    items, new = c._plan_items(*c._seq(seq), n)
    c._commit(seq, new, n)
    return items


def test_appends_fill_the_last_page_then_take_free_pages_in_order():
    c = host_only()
    s = c.new_sequence()
    assert take(c, s, 40) == [(0, 0, 16, 0), (1, 0, 16, 16), (2, 0, 8, 32)]
    assert take(c, s, 30) == [(2, 8, 8, 0), (3, 0, 16, 8), (4, 0, 6, 24)]
    assert take(c, s, 10) == [(4, 6, 10, 0)]  # fills page 4 exactly
    assert take(c, s, 1) == [(5, 0, 1, 0)]
    assert c.length(s) == 81 and c.free_pages == 4
    indptr, indices, last = c.page_table([s])
    assert indptr.tolist() == [0, 6] and indices.tolist() == [0, 1, 2, 3, 4, 5]
    assert last.tolist() == [1] and indices.dtype == np.int32 and indptr.dtype == np.int64


def test_freed_pages_come_back_first_and_ids_are_reused():
    c = host_only()
    a, b = c.new_sequence(), c.new_sequence()
    take(c, a, 20)  # pages 0, 1
    take(c, b, 5)  # page 2
    c.free_sequence(a)
    assert c.free_pages == 9
    a2 = c.new_sequence()
    assert a2 == a
    assert take(c, a2, 17) == [(0, 0, 16, 0), (1, 0, 1, 16)]
    indptr, indices, last = c.page_table([b, a2])
    assert indptr.tolist() == [0, 1, 3] and indices.tolist() == [2, 0, 1] and last.tolist() == [5, 1]


def test_versions_move_with_every_change():
    """As the C cache's ekv_cache_seq_version (issue 32): a reused id refilled to the old
    length holds other pages, and its version says so."""
    c = host_only()
    a, b = c.new_sequence(), c.new_sequence()
    take(c, a, 20)
    seen = {c.version(a), c.version(b)}
    v = c.version(a)
    c.free_sequence(a)
    with pytest.raises(entmaxkv.EntmaxKVError, match="not alive"):
        c.version(a)
    a2 = c.new_sequence()
    take(c, b, 20)  # takes a's old pages
    take(c, a2, 20)
    assert a2 == a and c.length(a2) == 20 and c.version(a2) != v
    seen |= {c.version(a2), c.version(b)}
    assert len(seen) == 4


def test_refusals_change_nothing():
    c = host_only(num_pages=3)
    s = c.new_sequence()
    take(c, s, 10)
    with pytest.raises(entmaxkv.EntmaxKVError, match="need 3 free pages; 2 are free") as e:
        c._plan_items(*c._seq(s), 50)
    assert e.value.status_name and c.free_pages == 2 and c.length(s) == 10
    with pytest.raises(entmaxkv.EntmaxKVError, match="sequence 7 is not alive"):
        c.length(7)
    with pytest.raises(TypeError, match="seq must be an integer"):
        c.free_sequence("x")
    for _ in range(3):
        c.new_sequence()
    with pytest.raises(entmaxkv.EntmaxKVError, match="max_seqs=4"):
        c.new_sequence()


@pytest.mark.parametrize("kw,match", [(dict(head_dim=12), "multiple of 8"),
                                      (dict(page_size=0), "page_size"),
                                      (dict(code_bits=2), "code_bits"),
                                      (dict(layout="HDN"), "layout"),
                                      (dict(dtype="int8"), "dtype"),
                                      (dict(num_pages=0), "num_pages")])
def test_shapes_are_checked_before_any_device_call(kw, match):
    args = dict(num_pages=4, page_size=16, num_kv_heads=2, head_dim=64, dtype="float16",
                code_bits=0, layout="HND", max_seqs=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        CudaPagedKVCache._check_shape(**args)


def stats_bytes(c, compact_ranges=True):
    """The statistics block the library's device cache asks the Python cache for
    (ekv_cuda_cache_sizes: host arithmetic, in a build without CUDA too)."""
    p, pool, stats, ctx = c._cache_params(compact_ranges), ctypes.c_int64(), ctypes.c_int64(), \
        _lib.context()
    ctx.call(_lib.lib.ekv_cuda_cache_sizes, ctx.ptr, ctypes.byref(p), ctypes.byref(pool),
             ctypes.byref(stats))
    return pool.value, stats.value


def test_the_layout_is_the_librarys():
    """The cache's geometry reaches the library through the ekv_cuda_cache_params mirror, and
    the library lays the statistics out (256-byte aligned arrays): the pool is the tensors',
    and the block holds kmin, kmax, kmean, km2, radius, count, the compact ranges and ball
    (f16 K) and the 4-bit codes, and none of them without compact ranges or codes."""
    c = host_only(num_pages=10)
    c.device, c.num_kv_heads, c.head_dim = types.SimpleNamespace(index=0), 2, 64
    c.dtype, c.layout, c.code_bits = "float16", "NHD", 4
    assert stats_bytes(c) == (10 * 16 * 2 * 64 * 2, 28928 + 10 * 2 * 16 * 32)
    c.code_bits = 0
    assert stats_bytes(c, compact_ranges=False) == (10 * 16 * 2 * 64 * 2, 20736 + 40)
    c.head_dim = 12  # the library's own check and message
    with pytest.raises(entmaxkv.EntmaxKVError, match="multiple of 8"):
        stats_bytes(c)


def test_without_torch_the_message_says_what_to_install(monkeypatch):
    """A CUDA cache needs torch; without it the error says so (it was a bare "No module
    named 'torch'" from inside the package)."""
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails as if absent
    with pytest.raises(ModuleNotFoundError, match="CudaPagedKVCache needs torch.*pip install"):
        CudaPagedKVCache(num_pages=4)
    monkeypatch.delitem(sys.modules, "entmaxkv.ops", raising=False)
    with pytest.raises(ModuleNotFoundError, match="entmaxkv.ops needs torch"):
        import entmaxkv.ops
