"""Python threads (docs/python.md, "Threads"): each thread calls the library on its own
context; a cache made in one thread can be used from another, waiting, not failing, while
its maker is inside a call; one cache is appended to and decoded over from two threads, each
call seeing the cache between appends. Each case runs in a fresh interpreter, so a crash
(a call on freed or half-written memory) fails its test, not the run."""
import threading

import numpy as np
import pytest

import entmaxkv
from helpers import assert_runs
from reference import attention_ref

HK, D, H = 4, 64, 8


def in_threads(*fns):
    """Runs each fn in its own thread; re-raises the first exception any of them raised."""
    errors = []

    def guard(fn):
        try:
            fn()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def rows(rng, n):
    return rng.standard_normal((n, HK, D)).astype(np.float32)


def _case_append_in_one_thread_while_the_cache_maker_decodes():
    """The issue's case: caches made in the main thread; one thread appends to one of them
    while another decodes over the other and computes entmax. Both caches share their
    maker's context, which failed with "context used from two threads at once"."""
    rng = np.random.default_rng(1)
    appended = entmaxkv.PagedKVCache(num_pages=1024, page_size=16, num_kv_heads=HK, head_dim=D)
    read = entmaxkv.PagedKVCache(num_pages=256, page_size=16, num_kv_heads=HK, head_dim=D)
    sa, sr = appended.new_sequence(), read.new_sequence()
    read.append(sr, rows(rng, 3000), rows(rng, 3000))
    w = entmaxkv.DecodeWrapper("certified", budget=0.1)
    w.plan(read, [sr], H)
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    want = w.run(q)
    k, v = rows(rng, 32), rows(rng, 32)
    done = threading.Event()

    def appender():
        try:
            for _ in range(300):
                appended.append(sa, k, v)
        finally:
            done.set()

    def decoder():
        x = rng.standard_normal((64, 512))
        while not done.is_set():
            np.testing.assert_array_equal(w.run(q), want)
            entmaxkv.entmax(x)

    other = threading.Thread(target=appender)
    other.start()
    try:
        decoder()  # on the main thread: its context is the one both caches were made with
    finally:
        other.join()
    assert appended.length(sa) == 300 * 32


def _case_one_cache_appended_and_decoded_from_two_threads():
    """One thread appends token by token while another plans and decodes over the same
    sequence: every step equals the reference over the tokens it was planned on (a plan the
    append overtook is refused by run, and planned again), never a mix."""
    rng = np.random.default_rng(2)
    n0, extra = 40, 120
    k, v = rows(rng, n0 + extra), rows(rng, n0 + extra)
    cache = entmaxkv.PagedKVCache(num_pages=64, page_size=16, num_kv_heads=HK, head_dim=D,
                                  dtype="float32")
    seq = cache.new_sequence()
    cache.append(seq, k[:n0], v[:n0])
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    stop = threading.Event()

    def appender():
        try:
            for t in range(n0, n0 + extra):
                cache.append(seq, k[t:t + 1], v[t:t + 1])
                cache.page_table([seq])
        finally:
            stop.set()

    checked = []

    def decoder():
        w = entmaxkv.DecodeWrapper("certified", budget=0.25, alpha=1.5)
        while not stop.is_set() or not checked or checked[-1] < n0 + extra:
            w.plan(cache, [seq], H)
            n = w._plan["lens"][0]
            try:
                out = w.run(q)
            except RuntimeError as e:
                assert "changed since plan" in str(e)
                continue
            ref = attention_ref(q[0].astype(np.float64), k[:n].astype(np.float64),
                                v[:n].astype(np.float64), 1.5)
            np.testing.assert_allclose(out[0], ref, atol=2e-5 * np.abs(ref).max())
            checked.append(n)

    in_threads(appender, decoder)
    assert cache.length(seq) == n0 + extra and checked[-1] == n0 + extra


def _case_threads_decode_their_own_caches_at_once():
    """Four threads, each with its own cache made in it, decode and append at once: the
    results equal one thread's (docs/architecture.md: contexts are independent)."""
    rng = np.random.default_rng(3)
    data = [(rows(rng, 500), rows(rng, 500), rng.standard_normal((1, H, D)).astype(np.float32))
            for _ in range(4)]

    def work(i, results):
        k, v, q = data[i]
        c = entmaxkv.PagedKVCache(num_pages=64, page_size=16, num_kv_heads=HK, head_dim=D)
        s = c.new_sequence()
        outs = []
        for part in range(5):
            c.append(s, k[part * 100:(part + 1) * 100], v[part * 100:(part + 1) * 100])
            w = entmaxkv.DecodeWrapper("certified" if i % 2 else "dense")
            w.plan(c, [s], H)
            outs.append(w.run(q))
        results[i] = outs

    alone, together = {}, {}
    for i in range(4):
        work(i, alone)
    in_threads(*[lambda i=i: work(i, together) for i in range(4)])
    for i in range(4):
        for a, b in zip(alone[i], together[i]):
            np.testing.assert_array_equal(a, b)


def _case_close_waits_for_a_call_in_another_thread():
    """close() from one thread while another appends: the append finishes first, later calls
    raise, and nothing crashes."""
    rng = np.random.default_rng(4)
    cache = entmaxkv.PagedKVCache(num_pages=4096, page_size=16, num_kv_heads=HK, head_dim=D)
    seq = cache.new_sequence()
    k = rows(rng, 16)
    started = threading.Event()

    def appender():
        with pytest.raises(RuntimeError, match="closed"):
            while True:  # the pool holds 4096 appends: the close comes long before
                cache.append(seq, k, k)
                started.set()

    def closer():
        started.wait()
        cache.close()

    in_threads(appender, closer)


@pytest.mark.parametrize("case", ["append_in_one_thread_while_the_cache_maker_decodes",
                                  "one_cache_appended_and_decoded_from_two_threads",
                                  "threads_decode_their_own_caches_at_once",
                                  "close_waits_for_a_call_in_another_thread"])
def test_threads(case):
    assert_runs(f"import test_threads; test_threads._case_{case}()")
