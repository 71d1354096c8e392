"""entmaxkv.flash.flash_entmax, the torch op (issue 30): its forward against the library's
reference (entmax_attention) and, where the entmax package is installed, against
entmax.entmax_bisect on the scores; its gradients by torch.autograd.gradcheck in float64; the
fake implementations by torch.library.opcheck; torch.compile keeping it whole. Skipped where
torch is not installed (CI); run on the GPU machine."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
flash = pytest.importorskip("entmaxkv.flash")


def _data(seed, B=2, T=3, N=6, H=4, Hk=2, D=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(B, T, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, N, Hk, D, generator=g, dtype=dtype)
    v = torch.randn(B, N, Hk, D, generator=g, dtype=dtype)
    return q, k, v


def _scores(q, k, causal, slopes):
    """z-space scores [B, T, H, N] with -inf where a causal row does not see the key."""
    B, T, H, D = q.shape
    N, G = k.shape[1], H // k.shape[2]
    kk = k.repeat_interleave(G, dim=2)  # [B, N, H, D]
    s = torch.einsum("bthd,bnhd->bthn", q, kk) / D ** 0.5
    i = torch.arange(N - T, N).view(T, 1)
    j = torch.arange(N).view(1, N)
    if slopes is not None:
        s = s - slopes.view(1, 1, H, 1) * (j - i).abs().view(1, T, 1, N)
    if causal:
        s = s.masked_fill((j > i).view(1, T, 1, N), float("-inf"))
    return s


def _far_from_tau(q, k, alpha, causal, slopes, margin=1e-4):
    """Every visible score at least margin from its row's tau (finite differences never cross
    the edge of the support)."""
    _out, tau = flash.flash_entmax_fwd(q, k, k, alpha, causal, slopes, 0.0)
    a = 1.0 if alpha == 1 else alpha - 1
    z = a * _scores(q, k, causal, slopes)
    gap = (z - tau.unsqueeze(-1)).abs()
    return bool((gap[torch.isfinite(z)] > margin).all())


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("causal", [True, False])
def test_forward_matches_the_reference(alpha, causal):
    import entmaxkv
    q, k, v = _data(1)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    out = flash.flash_entmax(q, k, v, alpha, causal, slopes)
    assert out.shape == q.shape and out.dtype == q.dtype
    for b in range(q.shape[0]):
        ref, _tau = entmaxkv.entmax_attention(q[b], k[b], v[b], alpha, causal, slopes)
        np.testing.assert_allclose(out[b].numpy(), ref, rtol=0, atol=1e-12)


def test_forward_matches_entmax_bisect():
    entmax = pytest.importorskip("entmax")
    q, k, v = _data(2)
    z = _scores(q, k, True, None)  # [B, T, H, N]
    p = entmax.entmax_bisect(z, alpha=1.5, dim=-1, n_iter=200)
    G = q.shape[2] // k.shape[2]
    want = torch.einsum("bthn,bnhd->bthd", p, v.repeat_interleave(G, dim=2))
    out = flash.flash_entmax(q, k, v, 1.5, True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.0])
@pytest.mark.parametrize("causal,alibi", [(True, False), (True, True), (False, False)])
def test_gradcheck(alpha, causal, alibi):
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64) if alibi else None
    for seed in range(10, 40):
        q, k, v = _data(seed, B=1, T=3, N=5, H=4, Hk=2, D=4)
        if _far_from_tau(q, k, alpha, causal, slopes):
            break
    else:
        pytest.fail("no seed keeps every score 1e-4 from tau")
    for t in (q, k, v):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda a, b, c: flash.flash_entmax(a, b, c, alpha, causal, slopes), (q, k, v),
        eps=1e-6, atol=1e-7, rtol=1e-5)


def test_float32_gradients_follow_the_float64_ones():
    q, k, v = _data(3)
    for t in (q, k, v):
        t.requires_grad_(True)
    flash.flash_entmax(q, k, v).pow(2).sum().backward()
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    flash.flash_entmax(q32, k32, v32).pow(2).sum().backward()
    for a, b in ((q, q32), (k, k32), (v, v32)):
        assert b.grad.dtype == torch.float32
        torch.testing.assert_close(b.grad.double(), a.grad, rtol=1e-4, atol=1e-5)


def test_opcheck():
    q, k, v = _data(4, dtype=torch.float32)
    torch.library.opcheck(torch.ops.entmaxkv.flash_entmax_fwd, (q, k, v, 1.5, True, None, 0.0))
    _out, tau = flash.flash_entmax_fwd(q, k, v, 1.5, True, None, 0.0)
    torch.library.opcheck(torch.ops.entmaxkv.flash_entmax_bwd,
                          (q, k, v, tau, torch.randn_like(q), 1.5, True, None, 0.0))


def test_compile_keeps_one_node():
    q, k, v = _data(5, dtype=torch.float32)
    f = torch.compile(lambda a, b, c: flash.flash_entmax(a, b, c), fullgraph=True,
                      backend="eager")
    torch.testing.assert_close(f(q, k, v), flash.flash_entmax(q, k, v), rtol=0, atol=0)


def test_bad_shapes_and_devices():
    q, k, v = _data(6)
    with pytest.raises(ValueError, match=r"\[B, T, H, D\]"):
        flash.flash_entmax(q, k[0], v)
    if torch.cuda.is_available():
        with pytest.raises(NotImplementedError, match="CPU reference only"):
            flash.flash_entmax(q.cuda(), k.cuda(), v.cuda())
