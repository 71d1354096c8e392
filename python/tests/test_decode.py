import numpy as np
import pytest

import entmaxkv
from helpers import assert_runs, spy, unaligned
from reference import attention_ref

HK, D, H = 2, 64, 8


def make_cache(lens, code_bits=4, dtype="float16", seed=0):
    rng = np.random.default_rng(seed)
    cache = entmaxkv.PagedKVCache(num_pages=128, page_size=16, num_kv_heads=HK, head_dim=D,
                                  dtype=dtype, code_bits=code_bits)
    seqs, kvs = [], []
    for n in lens:
        s = cache.new_sequence()
        k = rng.standard_normal((n, HK, D)).astype(np.float32)
        k[rng.random(n) < 0.03] += 2.5 * rng.standard_normal(D).astype(np.float32)  # a few hits
        v = rng.standard_normal((n, HK, D)).astype(np.float32)
        cache.append(s, k, v)
        seqs.append(s)
        kvs.append((k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)))
    return cache, seqs, kvs


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
def test_dense_against_reference(alpha):
    cache, seqs, kvs = make_cache([300, 77])
    q = np.random.default_rng(9).standard_normal((2, H, D)).astype(np.float32)
    w = entmaxkv.DecodeWrapper("dense", alpha=alpha)
    w.plan(cache, seqs, H)
    out = w.run(q)
    for b, (k, v) in enumerate(kvs):
        ref = attention_ref(q[b].astype(np.float64), k, v, alpha)
        np.testing.assert_allclose(out[b], ref, atol=2e-5 * np.abs(ref).max())
    assert w.report["support"].shape == (2, H) and w.report["kv_fraction"] > 0


@pytest.mark.parametrize("method", ["certified", "screened"])
def test_exact_methods_equal_dense(method):
    cache, seqs, _ = make_cache([500, 129])
    q = np.random.default_rng(5).standard_normal((2, H, D)).astype(np.float32)
    dense = entmaxkv.DecodeWrapper("dense")
    dense.plan(cache, seqs, H)
    exact = entmaxkv.DecodeWrapper(method, budget=0.125)
    exact.plan(cache, seqs, H)
    np.testing.assert_allclose(exact.run(q), dense.run(q), atol=1e-5)
    np.testing.assert_array_equal(exact.report["support"], dense.report["support"])


def test_topk_with_every_token_is_dense_and_out_is_filled():
    cache, seqs, _ = make_cache([200])
    q = np.random.default_rng(6).standard_normal((1, H, D)).astype(np.float32)
    dense = entmaxkv.DecodeWrapper("dense")
    dense.plan(cache, seqs, H)
    topk = entmaxkv.DecodeWrapper("topk", budget=1.0)
    topk.plan(cache, seqs, H)
    out = np.zeros((1, H, D), np.float32)
    assert topk.run(q, out=out) is out
    np.testing.assert_allclose(out, dense.run(q), atol=1e-6)


def test_plan_is_checked():
    cache, seqs, _ = make_cache([40])
    w = entmaxkv.DecodeWrapper("dense")
    with pytest.raises(RuntimeError, match="plan"):
        w.run(np.zeros((1, H, D), np.float32))
    w.plan(cache, seqs, H)
    with pytest.raises(ValueError, match=r"\[1, 8, 64\]"):
        w.run(np.zeros((1, H, D + 1), np.float32))
    with pytest.raises(ValueError, match="float32"):
        w.run(np.zeros((1, H, D), np.float64))
    cache.append(seqs[0], np.zeros((1, HK, D), np.float32), np.zeros((1, HK, D), np.float32))
    with pytest.raises(RuntimeError, match="changed since plan"):
        w.run(np.zeros((1, H, D), np.float32))
    with pytest.raises(ValueError, match="multiple"):
        w.plan(cache, seqs, 3)
    # issue 32: a sequence freed, its id reused and refilled to the plan's length holds other
    # pages (another sequence took the old ones): the length agrees, the plan is still stale
    cache, seqs, _ = make_cache([40, 20])
    w.plan(cache, seqs[:1], H)
    cache.free_sequence(seqs[0])
    s = cache.new_sequence()
    assert s == seqs[0]
    rows = np.ones((40, HK, D), np.float32)
    cache.append(seqs[1], rows, rows)  # takes the freed pages
    cache.append(s, rows, rows)
    assert cache.length(s) == 40
    with pytest.raises(RuntimeError, match="changed since plan"):
        w.run(np.zeros((1, H, D), np.float32))
    with pytest.raises(ValueError, match="method"):
        entmaxkv.DecodeWrapper("nope")
    with pytest.raises(ValueError, match="budget"):
        entmaxkv.DecodeWrapper("topk", budget=1.5)


def test_cache_errors_leave_it_unchanged():
    cache, seqs, _ = make_cache([10])
    bad = np.zeros((3, HK, D), np.float32)
    bad[1, 0, 0] = np.nan
    with pytest.raises(entmaxkv.EntmaxKVError):
        cache.append(seqs[0], bad, bad)
    assert cache.length(seqs[0]) == 10
    with pytest.raises(ValueError, match="tokens"):
        cache.append(seqs[0], np.zeros((3, HK + 1, D), np.float32), np.zeros((3, HK + 1, D), np.float32))
    with pytest.raises(entmaxkv.EntmaxKVError, match="sequence|seq"):
        cache.length(12345)
    with pytest.raises(ValueError, match="dtype"):
        entmaxkv.PagedKVCache(num_pages=4, dtype="int8")


def test_pool_views_hold_the_stored_keys():
    cache, seqs, kvs = make_cache([20], code_bits=0)
    indptr, indices, last = cache.page_table(seqs)
    assert list(indptr) == [0, 2] and list(last) == [4]
    k = cache.k
    assert k.shape == (128, HK, 16, D) and not k.flags.writeable
    np.testing.assert_array_equal(k[indices[1], 1, :4].astype(np.float64), kvs[0][0][16:20, 1])


def test_wrapped_nhd_pages_equal_the_library_pool():
    """The caller's NHD pages (FlashInfer's layout): appends land at [page, slot, head, dim],
    and every method decodes as over the library's own HND pool."""
    rng = np.random.default_rng(11)
    kp = np.zeros((64, 16, HK, D), np.float16)
    vp = np.zeros((64, 16, HK, D), np.float16)
    wrapped = entmaxkv.PagedKVCache.wrap(kp, vp, layout="NHD", code_bits=4)
    own = entmaxkv.PagedKVCache(num_pages=64, page_size=16, num_kv_heads=HK, head_dim=D,
                                code_bits=4)
    k = rng.standard_normal((333, HK, D)).astype(np.float32)
    v = rng.standard_normal((333, HK, D)).astype(np.float32)
    sw, so = wrapped.new_sequence(), own.new_sequence()
    wrapped.append(sw, k, v)
    own.append(so, k, v)
    indptr, indices, last = wrapped.page_table([sw])
    page, slot = indices[20 // 16], 20 % 16  # token 20
    np.testing.assert_array_equal(kp[page, slot], k[20].astype(np.float16))
    assert wrapped.k.shape == (64, 16, HK, D) and wrapped.k.base is not None
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    for method in ("dense", "certified", "screened", "topk"):
        a, b = entmaxkv.DecodeWrapper(method, budget=0.25), entmaxkv.DecodeWrapper(method, budget=0.25)
        a.plan(wrapped, [sw], H)
        b.plan(own, [so], H)
        np.testing.assert_array_equal(a.run(q), b.run(q))


def test_wrap_refuses_bad_pages():
    with pytest.raises(ValueError, match="4-d"):
        entmaxkv.PagedKVCache.wrap(np.zeros((4, 16, 2), np.float16), np.zeros((4, 16, 2), np.float16))
    with pytest.raises(TypeError, match="float16 or float32"):
        entmaxkv.PagedKVCache.wrap(np.zeros((4, 16, 2, 8), np.int8), np.zeros((4, 16, 2, 8), np.int8))
    k = np.zeros((4, 2, 16, 8), np.float16)
    with pytest.raises(ValueError, match="contiguous"):
        entmaxkv.PagedKVCache.wrap(k.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3))


def test_adopt_pages_another_engine_filled():
    """Pages written straight into the caller's NHD arrays (as a serving engine would), then
    adopted: decode equals a cache that appended the same tokens, and equals the reference."""
    rng = np.random.default_rng(12)
    kp = np.zeros((32, 16, HK, D), np.float16)
    vp = np.zeros((32, 16, HK, D), np.float16)
    cache = entmaxkv.PagedKVCache.wrap(kp, vp, layout="NHD", code_bits=8)
    n, pages = 40, [7, 3, 20]  # 16 + 16 + 8 tokens
    k = rng.standard_normal((n, HK, D)).astype(np.float16)
    v = rng.standard_normal((n, HK, D)).astype(np.float16)
    for t in range(n):
        kp[pages[t // 16], t % 16], vp[pages[t // 16], t % 16] = k[t], v[t]
    seq = cache.adopt(pages, last_page_len=8)
    assert cache.length(seq) == n and cache.free_pages == 29
    own = entmaxkv.PagedKVCache(num_pages=32, page_size=16, num_kv_heads=HK, head_dim=D,
                                code_bits=8)
    so = own.new_sequence()
    own.append(so, k, v)
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    for method in ("dense", "screened", "certified"):
        a, b = entmaxkv.DecodeWrapper(method), entmaxkv.DecodeWrapper(method)
        a.plan(cache, [seq], H)
        b.plan(own, [so], H)
        np.testing.assert_array_equal(a.run(q), b.run(q))
    ref = attention_ref(q[0].astype(np.float64), k.astype(np.float64), v.astype(np.float64), 1.5)
    np.testing.assert_allclose(a.run(q)[0], ref, atol=2e-5 * np.abs(ref).max())
    with pytest.raises(entmaxkv.EntmaxKVError, match="another sequence"):
        cache.adopt([3], last_page_len=1)
    kp[0, 0, 0, 0] = np.nan
    with pytest.raises(entmaxkv.EntmaxKVError, match="NaN"):
        cache.adopt([0], last_page_len=1)
    assert cache.free_pages == 29


def test_cache_made_in_another_thread():
    """A cache keeps the context it was made with (its errors and appends live there), even
    after the thread that made it has ended."""
    import threading

    made = {}
    t = threading.Thread(target=lambda: made.update(c=entmaxkv.PagedKVCache(
        num_pages=8, page_size=16, num_kv_heads=HK, head_dim=D)))
    t.start()
    t.join()
    cache = made["c"]
    s = cache.new_sequence()
    cache.append(s, np.ones((5, HK, D), np.float32), np.ones((5, HK, D), np.float32))
    bad = np.ones((2, HK, D), np.float32)
    bad[0, 0, 0] = np.inf
    with pytest.raises(entmaxkv.EntmaxKVError, match="NaN or infinite"):
        cache.append(s, bad, bad)
    assert cache.length(s) == 5


# ---- issue 32: lifetimes, out=, integers, alignment, overlapping pools ----

def test_pool_views_outlive_the_cache_object():
    """A view of the pool keeps it alive: the issue's one-liner (the temporary cache went at
    once and the view read freed memory: a segfault), and a view kept after close()."""
    assert_runs("""
        import gc, numpy as np, entmaxkv
        entmaxkv.PagedKVCache(4096, num_kv_heads=8, head_dim=128).k[-1].sum()
        c = entmaxkv.PagedKVCache(4096, num_kv_heads=2, head_dim=64, dtype="float32")
        s = c.new_sequence()
        x = np.arange(20 * 2 * 64, dtype=np.float32).reshape(20, 2, 64)
        c.append(s, x, -x)
        page = int(c.page_table([s])[1][0])
        k, v = c.k, c.v[page]
        c.close()
        del c
        gc.collect()
        big = [np.ones(1 << 22) for _ in range(16)]  # reuse of freed memory would show
        assert np.array_equal(k[page, 1, :16], x[:16, 1])
        assert np.array_equal(v[0], -x[:16, 0])
    """)


def test_closed_cache_refuses_calls_and_its_views_stay_read_only():
    cache, seqs, _ = make_cache([20], code_bits=0)
    k = cache.k
    first = k[:2].copy()
    cache.close()
    np.testing.assert_array_equal(k[:2], first)
    with pytest.raises(ValueError):
        k.flags.writeable = True  # the pool's memory is never handed out writable
    for call in (lambda: cache.length(seqs[0]), lambda: cache.k, lambda: cache.new_sequence(),
                 lambda: cache.free_pages):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    w = entmaxkv.DecodeWrapper("dense")
    with pytest.raises(RuntimeError, match="closed"):
        w.plan(cache, seqs, H)


def test_wrapped_pool_views_are_read_only_and_keep_the_arrays():
    kp, vp = np.zeros((4, 16, HK, D), np.float32), np.zeros((4, 16, HK, D), np.float32)
    cache = entmaxkv.PagedKVCache.wrap(kp, vp)
    s = cache.new_sequence()
    cache.append(s, np.ones((3, HK, D), np.float32), np.ones((3, HK, D), np.float32))
    k = cache.k
    del cache, kp, vp
    assert k[0, :3].sum() == 3 * HK * D and not k.flags.writeable


def test_out_is_checked_before_the_library_writes_into_it():
    cache, seqs, _ = make_cache([40])
    w = entmaxkv.DecodeWrapper("dense")
    w.plan(cache, seqs, H)
    q = np.random.default_rng(3).standard_normal((1, H, D)).astype(np.float32)
    ro = np.zeros((1, H, D), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        w.run(q, out=ro)
    assert not ro.any()
    with pytest.raises(ValueError, match="contiguous"):
        w.run(q, out=np.zeros((1, H, 2 * D), np.float32)[:, :, ::2])
    with pytest.raises(ValueError, match="aligned"):
        w.run(q, out=unaligned(np.zeros((1, H, D), np.float32)))
    with pytest.raises(TypeError, match="float32"):
        w.run(q, out=np.zeros((1, H, D), np.float64))
    with pytest.raises(ValueError, match=r"\[1, 8, 64\]"):
        w.run(q, out=np.zeros((1, H, D + 1), np.float32))
    with pytest.raises(ValueError, match="overlaps q"):
        w.run(q, out=q)
    np.testing.assert_array_equal(w.run(q, out=np.empty((1, H, D), np.float32)), w.run(q))


def test_read_only_memory_as_out_is_refused_not_written():
    """out over memory the process cannot write (a read-only mapping): the write segfaulted."""
    assert_runs("""
        import mmap, numpy as np, entmaxkv
        c = entmaxkv.PagedKVCache(8, page_size=16, num_kv_heads=2, head_dim=64)
        s = c.new_sequence()
        c.append(s, np.ones((5, 2, 64), np.float32), np.ones((5, 2, 64), np.float32))
        w = entmaxkv.DecodeWrapper("dense")
        w.plan(c, [s], 8)
        o = np.frombuffer(mmap.mmap(-1, 8 * 64 * 4, prot=mmap.PROT_READ), np.float32)
        try:
            w.run(np.ones((1, 8, 64), np.float32), out=o.reshape(1, 8, 64))
        except ValueError as e:
            assert "read-only" in str(e), e
        else:
            raise SystemExit("out was accepted")
    """)


@pytest.mark.parametrize("kw,error", [
    (dict(page_size=2**32 + 4), ValueError), (dict(num_pages=2**64 + 1), ValueError),
    (dict(head_dim=2**31), ValueError), (dict(max_seqs=-(2**31) - 1), ValueError),
    (dict(code_bits=2**32 + 4), ValueError), (dict(page_size=16.5), TypeError),
    (dict(page_size=True), TypeError), (dict(num_kv_heads="2"), TypeError)])
def test_cache_integers_are_not_wrapped(kw, error):
    """ctypes keeps the low bits of an int that does not fit: page_size=2**32+4 was 4."""
    args = dict(num_pages=8, page_size=16, num_kv_heads=HK, head_dim=D)
    args.update(kw)
    with pytest.raises(error, match=next(iter(kw))):
        entmaxkv.PagedKVCache(**args)


def test_call_integers_are_not_wrapped():
    cache, seqs, _ = make_cache([20])
    s, one = seqs[0], np.ones((1, HK, D), np.float32)
    with pytest.raises(ValueError, match="seq"):
        cache.append(s + 2**32, one, one)  # was sequence s
    with pytest.raises(ValueError, match="seq"):
        cache.free_sequence(s + 2**32)
    with pytest.raises(ValueError, match="seq"):
        cache.length(s - 2**32)
    with pytest.raises(ValueError, match="seqs"):
        cache.page_table([s + 2**32])
    with pytest.raises(TypeError, match="seqs"):
        cache.page_table([s + 0.5])
    with pytest.raises(TypeError, match="pages"):
        cache.adopt([3.7, 4.2], 1)  # were pages 3 and 4
    with pytest.raises(ValueError, match="pages"):
        cache.adopt([2**32 + 3], 1)
    with pytest.raises(ValueError, match="last_page_len"):
        cache.adopt([3], 2**32 + 1)
    with pytest.raises(ValueError, match="budget"):
        entmaxkv.DecodeWrapper("topk", budget=2**64 + 1)  # was 1 token
    w = entmaxkv.DecodeWrapper("dense")
    with pytest.raises(TypeError, match="num_heads"):
        w.plan(cache, seqs, 8.5)
    with pytest.raises(ValueError, match="seqs"):
        w.plan(cache, [s + 2**32], H)
    with pytest.raises(TypeError, match="seqs"):
        w.plan(cache, [True], H)
    assert cache.length(s) == 20 and cache.free_pages == 126


def test_numpy_integers_and_integral_floats_are_integers():
    a = entmaxkv.PagedKVCache(np.int64(16), page_size=np.int32(16), num_kv_heads=np.uint8(HK),
                              head_dim=float(D))
    s = a.new_sequence()
    x = np.random.default_rng(4).standard_normal((40, HK, D)).astype(np.float32)
    a.append(np.int64(s), x, x)
    assert a.length(np.int32(s)) == 40 and a.page_table(np.array([s], np.uint16))[0][-1] == 3
    q = np.random.default_rng(5).standard_normal((1, H, D)).astype(np.float32)
    w = entmaxkv.DecodeWrapper("topk", budget=np.int64(16))
    ref = entmaxkv.DecodeWrapper("topk", budget=16)
    w.plan(a, np.array([s]), np.int64(H))
    ref.plan(a, [s], H)
    np.testing.assert_array_equal(w.run(q), ref.run(q))


def test_unaligned_inputs_reach_the_library_aligned(monkeypatch):
    """numpy arrays may start at any byte; the C code loads whole floats (UBSan: misaligned
    loads). q, k and v are copied to aligned memory; the results do not change."""
    cache, seqs, _ = make_cache([32], code_bits=0, dtype="float32")
    rng = np.random.default_rng(6)
    k32 = rng.standard_normal((3, HK, D)).astype(np.float32)
    seen = spy(monkeypatch, "ekv_cache_append", [3, 4])
    cache.append(seqs[0], unaligned(k32), unaligned(-k32))
    cache.append(seqs[0], unaligned(k32.astype(np.float16)), unaligned(k32.astype(np.float16)))
    assert len(seen) == 4 and all(p % 4 == 0 for p in seen[:2]) and all(p % 2 == 0 for p in seen)
    np.testing.assert_array_equal(cache.k[cache.page_table(seqs)[1][2], 1, :3], k32[:, 1])
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    slopes = np.linspace(0.1, 0.5, H).astype(np.float32)
    w = entmaxkv.DecodeWrapper("dense", alibi_slopes=unaligned(slopes))
    assert w._slopes.flags.aligned
    w.plan(cache, seqs, H)
    seen = spy(monkeypatch, "ekv_decode", [6, 7])
    got = w.run(unaligned(q))
    assert len(seen) == 2 and all(p % 4 == 0 for p in seen)
    monkeypatch.undo()
    ref = entmaxkv.DecodeWrapper("dense", alibi_slopes=slopes)
    ref.plan(cache, seqs, H)
    np.testing.assert_array_equal(got, ref.run(q))


def test_wrap_refuses_overlapping_pools():
    """K and V over the same (or overlapping) memory: each append would overwrite the other."""
    kp = np.zeros((8, 16, HK, D), np.float16)
    with pytest.raises(ValueError, match="overlap"):
        entmaxkv.PagedKVCache.wrap(kp, kp)
    both = np.zeros((12, 16, HK, D), np.float16)
    with pytest.raises(ValueError, match="overlap"):
        entmaxkv.PagedKVCache.wrap(both[:8], both[4:])
    entmaxkv.PagedKVCache.wrap(both[:6], both[6:])  # adjacent, not overlapping
