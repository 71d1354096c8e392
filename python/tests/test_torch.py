"""The torch paths (CPU tensors in and out). Skipped where torch is not installed (CI); run on
the GPU machine, where it is."""
import numpy as np
import pytest

import entmaxkv
from reference import entmax_ref

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entmax_on_cpu_tensors(dtype):
    x = torch.randn(3, 5, 40, dtype=dtype)
    p = entmaxkv.entmax(x, alpha=1.5, dim=1)
    assert isinstance(p, torch.Tensor) and p.dtype == dtype and p.shape == x.shape
    np.testing.assert_allclose(p.numpy(), entmax_ref(x.numpy(), 1.5, axis=1),
                               atol=2e-6 if dtype == torch.float32 else 1e-9)


def test_entmax_refuses_cuda_and_half_tensors():
    with pytest.raises(TypeError, match="float32 or float64"):
        entmaxkv.entmax(torch.zeros(4, dtype=torch.float16))
    if torch.cuda.is_available():
        with pytest.raises(TypeError, match="host memory"):
            entmaxkv.entmax(torch.zeros(4, device="cuda"))


def test_decode_with_tensors():
    cache = entmaxkv.PagedKVCache(num_pages=32, page_size=16, num_kv_heads=2, head_dim=32)
    s = cache.new_sequence()
    cache.append(s, torch.randn(100, 2, 32), torch.randn(100, 2, 32))
    w = entmaxkv.DecodeWrapper("dense")
    w.plan(cache, [s], 4)
    q = torch.randn(1, 4, 32)
    out = torch.empty(1, 4, 32)
    assert w.run(q, out=out) is out
    np.testing.assert_allclose(out.numpy(), w.run(q.numpy()), atol=0)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entmax_equals_the_entmax_package(alpha, dtype):
    """The same mapping as the `entmax` package (its convention, docs/math.md §0): entmax15
    and sparsemax in closed form, entmax_bisect for other alphas; -inf entries are zeros."""
    em = pytest.importorskip("entmax")
    x = torch.randn(6, 9, 70, dtype=torch.float64) * 2
    x[0, 0, :5] = float("-inf")
    x = x.to(dtype)
    ref = {1.5: lambda t: em.entmax15(t, dim=-1), 2.0: lambda t: em.sparsemax(t, dim=-1)}.get(
        alpha, lambda t: em.entmax_bisect(t, alpha=alpha, dim=-1, n_iter=200))
    want = ref(x.double())
    got = entmaxkv.entmax(x, alpha=alpha)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=0,
                               atol=1e-6 if dtype == torch.float32 else 1e-12)
    assert (got[0, 0, :5] == 0).all() and (got == 0).any()
