import numpy as np
import pytest

import entmaxkv
from helpers import spy, unaligned
from reference import entmax_ref

ALPHAS = [1.0, 1.25, 1.5, 2.0, 3.0]


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-9), (np.float32, 2e-6)])
def test_against_reference(alpha, dtype, tol):
    x = np.random.default_rng(1).standard_normal((3, 4, 50)).astype(dtype) * 3
    p = entmaxkv.entmax(x, alpha=alpha)
    assert p.dtype == dtype and p.shape == x.shape
    np.testing.assert_allclose(p, entmax_ref(x, alpha), atol=tol, rtol=0)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=10 * tol)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_any_axis(dim):
    x = np.random.default_rng(2).standard_normal((5, 6, 7))
    p = entmaxkv.entmax15(x, dim=dim)
    np.testing.assert_allclose(p, entmax_ref(x, 1.5, axis=dim), atol=1e-9)
    np.testing.assert_allclose(p.sum(axis=dim), 1.0, atol=1e-12)


def test_sparsity_and_masking():
    x = np.array([[3.0, 2.9, -5.0, -np.inf, 0.0]])
    p = entmaxkv.sparsemax(x)
    assert p[0, 3] == 0 and p[0, 2] == 0 and p[0, 0] > p[0, 1] > 0
    assert entmaxkv.entmax(x, alpha=1.0)[0, 3] == 0  # softmax masks -inf too


def test_errors():
    with pytest.raises(entmaxkv.EntmaxKVError, match="row 1"):
        entmaxkv.entmax(np.array([[0.0, 1.0], [np.nan, 1.0]]))
    with pytest.raises(entmaxkv.EntmaxKVError, match="row 0") as e:
        entmaxkv.entmax(np.array([[-np.inf, -np.inf]]))
    assert e.value.status < 0 and e.value.status_name
    with pytest.raises(TypeError, match="float32 or float64"):
        entmaxkv.entmax(np.zeros((2, 3), np.int64))
    with pytest.raises(ValueError, match="alpha"):
        entmaxkv.entmax(np.zeros(3), alpha=5)
    with pytest.raises(ValueError, match="out of range"):
        entmaxkv.entmax(np.zeros((2, 3)), dim=2)
    with pytest.raises(ValueError, match="scalar"):
        entmaxkv.entmax(np.float64(1.0))


def test_input_is_not_modified_and_views_work():
    x = np.random.default_rng(3).standard_normal((4, 9))
    keep = x.copy()
    p = entmaxkv.entmax(x.T, dim=0)  # a non-contiguous view
    np.testing.assert_array_equal(x, keep)
    np.testing.assert_allclose(p, entmax_ref(x.T, 1.5, axis=0), atol=1e-9)


@pytest.mark.parametrize("fn,dtype", [("ekv_entmax_rows", np.float32),
                                      ("ekv_entmax_rows_f64", np.float64)])
def test_unaligned_input_reaches_the_library_aligned(monkeypatch, fn, dtype):
    """A row that starts off its dtype's alignment is copied first (the C code loads whole
    elements: UBSan reported the misaligned loads); the result does not change."""
    x = np.random.default_rng(4).standard_normal((3, 33)).astype(dtype)
    seen = spy(monkeypatch, fn, [1, 5])
    p = entmaxkv.entmax(unaligned(x))
    assert len(seen) == 2 and all(a % np.dtype(dtype).itemsize == 0 for a in seen)
    np.testing.assert_array_equal(p, entmaxkv.entmax(x))
