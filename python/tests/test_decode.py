import numpy as np
import pytest

import entmaxkv
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
