"""The custom ops (entmaxkv.ops) under torch.compile on CPU tensors: fullgraph compiles of a
function calling DecodeWrapper.run equal eager; opcheck on both ops; the error paths.
Skipped without torch."""
import gc

import numpy as np
import pytest

import entmaxkv

torch = pytest.importorskip("torch")
ops = pytest.importorskip("entmaxkv.ops")

HK, D, H = 2, 32, 4


@pytest.fixture
def wrapper():
    torch.manual_seed(0)
    cache = entmaxkv.PagedKVCache(num_pages=32, page_size=16, num_kv_heads=HK, head_dim=D,
                                  code_bits=4)
    seqs = [cache.new_sequence() for _ in range(2)]
    for s, n in zip(seqs, (150, 61)):
        cache.append(s, torch.randn(n, HK, D), torch.randn(n, HK, D))
    w = entmaxkv.DecodeWrapper("certified", budget=0.25)
    w.plan(cache, seqs, H)
    w.cache = cache  # keeps the cache with the wrapper in these tests
    return w


def step(w):
    def f(q):
        return w.run(q * 2.0) + 1.0  # ops around the decode stay in the graph
    return f


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(wrapper, backend):
    q = torch.randn(2, H, D)
    eager = step(wrapper)(q)
    torch._dynamo.reset()
    compiled = torch.compile(step(wrapper), fullgraph=True, backend=backend)
    got = compiled(q)
    assert isinstance(got, torch.Tensor) and got.shape == (2, H, D)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
    q2 = torch.randn(2, H, D)  # a second call with new data reuses the graph
    torch.testing.assert_close(compiled(q2), step(wrapper)(q2), rtol=0, atol=0)


def test_compiled_out_variant(wrapper):
    def f(q, out):
        wrapper.run(q, out)
        return out.sum(-1)

    q, out = torch.randn(2, H, D), torch.empty(2, H, D)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, out)
    ref = wrapper.run(q.numpy())
    np.testing.assert_array_equal(out.numpy(), ref)
    torch.testing.assert_close(got, torch.from_numpy(ref).sum(-1), rtol=0, atol=0)


def test_opcheck(wrapper):
    q = torch.randn(2, H, D)
    torch.library.opcheck(torch.ops.entmaxkv.decode.default, (q, wrapper.handle))
    torch.library.opcheck(torch.ops.entmaxkv.decode_into.default,
                          (q, torch.empty(2, H, D), wrapper.handle))


def test_op_errors(wrapper):
    with pytest.raises(ValueError, match=r"float32 \[2, 4, 32\]"):
        torch.ops.entmaxkv.decode(torch.randn(1, H, D), wrapper.handle)
    torch._dynamo.reset()
    bad = torch.compile(step(wrapper), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"float32 \[2, 4, 32\]"):  # raised while tracing
        bad(torch.randn(2, H, D + 1))
    lost = entmaxkv.DecodeWrapper("dense")
    h = lost.handle
    del lost
    gc.collect()
    with pytest.raises(RuntimeError, match=f"handle {h}"):
        torch.ops.entmaxkv.decode(torch.randn(2, H, D), h)
    unplanned = entmaxkv.DecodeWrapper("dense")
    with pytest.raises(RuntimeError, match="plan"):
        torch.ops.entmaxkv.decode(torch.randn(2, H, D), unplanned.handle)


def test_run_returns_a_tensor_for_a_tensor(wrapper):
    q = torch.randn(2, H, D)
    out = wrapper.run(q)
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), wrapper.run(q.numpy()))
