"""entmaxkv.flash.flash_entmax, the torch op (issue 30): its forward against the library's
reference (entmax_attention) and, where the entmax package is installed, against
entmax.entmax_bisect on the scores; its gradients by torch.autograd.gradcheck in float64; the
fake implementations by torch.library.opcheck; torch.compile keeping it whole; the varlen form
against the unbatched op on each packed sequence (bit for bit), gradcheck, opcheck and its
offsets' checks; on CUDA
(ekv_cuda_flash_entmax_*) the forward and gradients against the CPU op in float64 on the same
16-bit inputs, torch.compile and opcheck. Skipped where torch is not installed (CI), the CUDA
tests where there is no CUDA device; run on the GPU machine."""
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
    _out, tau, _ohat = flash.flash_entmax_fwd(q, k, k, alpha, causal, slopes, 0.0, False)
    a = 1.0 if alpha == 1 else alpha - 1
    z = a * _scores(q, k, causal, slopes)
    gap = (z - tau.unsqueeze(-1)).abs()
    return bool((gap[torch.isfinite(z)] > margin).all())


def _rows_far_from_tau(q, k, tau, alpha, causal, slopes, margin):
    """[B, T, H] bool: the rows whose visible scores all keep margin from their tau (alpha 2
    only; every row otherwise)."""
    if alpha != 2.0:
        return torch.ones(tau.shape, dtype=torch.bool)
    z = _scores(q, k, causal, slopes)  # alpha 2: z = s
    gap = (z - tau.unsqueeze(-1)).abs().masked_fill(~torch.isfinite(z), float("inf"))
    return gap.amin(dim=-1) > margin


def _gradcheck(f, q, k, v):
    """torch.autograd.gradcheck of f(q, k, v) in float64 (q, k, v then require grad)."""
    for t in (q, k, v):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


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
    _gradcheck(lambda a, b, c: flash.flash_entmax(a, b, c, alpha, causal, slopes), q, k, v)


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
    for with_ohat in (True, False):
        torch.library.opcheck(torch.ops.entmaxkv.flash_entmax_fwd,
                              (q, k, v, 1.5, True, None, 0.0, with_ohat))
    _out, tau, ohat = flash.flash_entmax_fwd(q, k, v, 1.5, True, None, 0.0, True)
    torch.library.opcheck(torch.ops.entmaxkv.flash_entmax_bwd,
                          (q, k, v, tau, ohat, torch.randn_like(q), 1.5, True, None, 0.0))


def test_ohat_only_when_grad_is_needed():
    """with_ohat False returns an empty o-hat and the same out and tau; flash_entmax asks for it
    only when an input requires grad, and a backward through a forward without it is refused."""
    q, k, v = _data(17)
    out, tau, ohat = flash.flash_entmax_fwd(q, k, v, 1.5, True, None, 0.0, False)
    ref, rtau, rohat = flash.flash_entmax_fwd(q, k, v, 1.5, True, None, 0.0, True)
    assert ohat.numel() == 0 and rohat.shape == q.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(tau, rtau, rtol=0, atol=0)
    q.requires_grad_(True)
    with torch.no_grad():
        torch.testing.assert_close(flash.flash_entmax(q, k, v), ref, rtol=0, atol=0)
    bare, _, _ = flash.flash_entmax_fwd(q, k, v, 1.5, True, None, 0.0, False)
    with pytest.raises(RuntimeError, match="with_ohat=False"):
        bare.sum().backward()


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
        with pytest.raises(ValueError, match="one device"):
            flash.flash_entmax(q.cuda(), k, v)


# ---- the varlen form: packed sequences, each as the batched op computes it ----

def _packed(seed, tq, tk, H=4, Hk=2, D=8, dtype=torch.float64):
    """q [sum tq, H, D], k and v [sum tk, Hk, D] and the offsets of the sequences."""
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(sum(tq), H, D, generator=g, dtype=dtype)
    k = torch.randn(sum(tk), Hk, D, generator=g, dtype=dtype)
    v = torch.randn(sum(tk), Hk, D, generator=g, dtype=dtype)
    cu = [torch.tensor([0] + list(np.cumsum(t)), dtype=torch.int32) for t in (tq, tk)]
    return q, k, v, cu[0], cu[1]


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.0])
@pytest.mark.parametrize("causal,alibi", [(True, False), (True, True), (False, False)])
def test_varlen_equals_each_sequence(alpha, causal, alibi):
    """Sequences of 3, 0 (no queries: its keys unused), 1 and 5 queries over 6, 2, 7 and 5 keys:
    each sequence's rows of out and tau are the unbatched op's on its own slices, bit for bit."""
    tq, tk = [3, 0, 1, 5], [6, 2, 7, 5]
    q, k, v, cq, ck = _packed(12, tq, tk)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64) if alibi else None
    out, tau, ohat = flash.flash_entmax_varlen_fwd(q, k, v, cq, ck, alpha, causal, slopes, 0.0,
                                                   True)
    assert out.shape == q.shape and tau.shape == q.shape[:-1] and tau.dtype == torch.float64
    assert ohat.shape == q.shape and ohat.dtype == torch.float32
    for i in range(len(tq)):
        a, b, c, d = cq[i].item(), cq[i + 1].item(), ck[i].item(), ck[i + 1].item()
        if b == a:
            continue
        o, t, oh = flash.flash_entmax_fwd(q[a:b], k[c:d], v[c:d], alpha, causal, slopes, 0.0,
                                          True)
        torch.testing.assert_close(out[a:b], o, rtol=0, atol=0)
        torch.testing.assert_close(tau[a:b], t, rtol=0, atol=0)
        torch.testing.assert_close(ohat[a:b], oh, rtol=0, atol=0)
    whole = flash.flash_entmax_varlen(q, k, v, cq.long(), ck.long(), alpha, causal, slopes)
    torch.testing.assert_close(whole, out, rtol=0, atol=0)


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_varlen_gradcheck(alpha):
    """Gradients through the packed form in float64, the keys of the query-less sequence
    included (their gradient is 0)."""
    for seed in range(30, 70):
        q, k, v, cq, ck = _packed(seed, [2, 0, 3], [4, 2, 3], D=4)
        spans = [(0, 2, 0, 4), (2, 5, 6, 9)]
        if all(_far_from_tau(q[a:b].unsqueeze(0), k[c:d].unsqueeze(0), alpha, True, None)
               for a, b, c, d in spans):
            break
    else:
        pytest.fail("no seed keeps every score 1e-4 from tau")
    _gradcheck(lambda a, b, c: flash.flash_entmax_varlen(a, b, c, cq, ck, alpha), q, k, v)
    flash.flash_entmax_varlen(q, k, v, cq, ck, alpha).pow(2).sum().backward()
    assert k.grad[4:6].abs().max() == 0 and v.grad[4:6].abs().max() == 0


def test_varlen_opcheck_and_compile():
    q, k, v, cq, ck = _packed(13, [2, 3], [5, 3], dtype=torch.float32)
    torch.library.opcheck(torch.ops.entmaxkv.flash_entmax_varlen_fwd,
                          (q, k, v, cq, ck, 1.5, True, None, 0.0, True))
    _out, tau, ohat = flash.flash_entmax_varlen_fwd(q, k, v, cq, ck, 1.5, True, None, 0.0, True)
    torch.library.opcheck(torch.ops.entmaxkv.flash_entmax_varlen_bwd,
                          (q, k, v, tau, ohat, torch.randn_like(q), cq, ck, 1.5, True, None,
                           0.0))
    f = torch.compile(lambda a, b, c: flash.flash_entmax_varlen(a, b, c, cq, ck), fullgraph=True,
                      backend="eager")
    torch.testing.assert_close(f(q, k, v), flash.flash_entmax_varlen(q, k, v, cq, ck), rtol=0,
                               atol=0)


def test_varlen_bad_offsets():
    q, k, v, cq, ck = _packed(14, [2, 3], [5, 3])
    bad = [(cq.float(), ck, "integer"), (cq[:-1], ck, "rise from 0 to 5"),
           (torch.tensor([1, 2, 5]), ck, "rise from 0"), (torch.tensor([0, 3, 2, 5]),
                                                           torch.tensor([0, 3, 4, 8]),
                                                           "without decreasing"),
           (cq, torch.tensor([0, 8]), "the same sequences"), (cq.view(1, 3), ck, "1-D")]
    for a, b, msg in bad:
        with pytest.raises(ValueError, match=msg):
            flash.flash_entmax_varlen(q, k, v, a, b)
    with pytest.raises(ValueError, match=r"\[total_q, H, D\]"):
        flash.flash_entmax_varlen(q.unsqueeze(0), k, v, cq, ck)


# ---- CUDA (ekv_cuda_flash_entmax_*): skipped without a CUDA device ----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}  # the dtypes' unit roundoff
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625])


def _cuda_data(seed, dtype, B=2, T=40, N=96, H=6, Hk=2, D=64):
    """CUDA tensors of dtype and their values in float64 on the CPU (what the reference takes:
    the same rounded numbers)."""
    q, k, v = _data(seed, B, T, N, H, Hk, D, dtype=torch.float32)
    dev = [t.to(dtype).cuda() for t in (q, k, v)]
    return dev, [t.detach().cpu().double() for t in dev]


@cuda
@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
@pytest.mark.parametrize("causal,alibi", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_forward_matches_the_cpu_op(alpha, causal, alibi, dtype):
    """out within its own rounding (UNIT) plus 1e-4 of max|v| of the float64 reference on the
    same 16-bit inputs (the device's scores are fp32, docs/math.md §12); tau within 1e-5."""
    (q, k, v), (q64, k64, v64) = _cuda_data(7, dtype)
    slopes = SLOPES if alibi else None
    out, tau, ohat = flash.flash_entmax_fwd(q, k, v, alpha, causal,
                                            None if slopes is None else slopes.cuda(), 0.0, True)
    ref, rtau, rohat = flash.flash_entmax_fwd(q64, k64, v64, alpha, causal, slopes, 0.0, True)
    assert out.dtype == dtype and out.shape == q.shape and tau.dtype == torch.float64
    assert ohat.dtype == torch.float32 and ohat.shape == q.shape
    torch.testing.assert_close(out.cpu().double(), ref, rtol=UNIT[dtype],
                               atol=1e-4 * v64.abs().max().item())
    torch.testing.assert_close(tau.cpu(), rtau, rtol=1e-5, atol=1e-5)
    # o-hat is fp32 on the device (no 16-bit rounding), a w-weighted mean as out is p-weighted;
    # sparsemax's w = 1 jumps at the support's edge, so there only the rows whose scores all
    # keep 2e-5 from tau (docs/math.md §13.4)
    rows = _rows_far_from_tau(q64, k64, rtau, alpha, causal, slopes, 2e-5)
    assert rows.any()
    torch.testing.assert_close(ohat.cpu().double()[rows], rohat.double()[rows], rtol=1e-5,
                               atol=1e-4 * v64.abs().max().item())


@cuda
@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_cuda_tau_schemes_agree(alpha):
    """The forward's histogram tau scheme (flash_cuda.tau_scheme 1, docs/math.md §12.1) gives the
    candidate scheme's tau (1e-5) and output (the same support, fp32 sums: 1e-5 of max|v|)."""
    from entmaxkv import flash_cuda

    (q, k, v), _ = _cuda_data(11, torch.bfloat16)
    res, keep = [], flash_cuda.tau_scheme
    try:
        for scheme in (0, 1):
            flash_cuda.tau_scheme = scheme
            res.append(flash.flash_entmax_fwd(q, k, v, alpha, True, SLOPES.cuda(), 0.0, False))
    finally:
        flash_cuda.tau_scheme = keep
    (o0, t0, _h0), (o1, t1, _h1) = res
    torch.testing.assert_close(t1, t0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o1.float(), o0.float(), rtol=2.0 ** -8,
                               atol=1e-5 * v.abs().max().item())


@cuda
@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_gradients_match_the_cpu_op(alpha, dtype):
    """dq, dk, dv of the CUDA op within their rounding plus 2e-4 of each tensor's largest
    against the CPU op's float64 backward on the same inputs; sparsemax data keeps every score
    2e-5 from tau (no derivative at a tie, docs/math.md §13.4)."""
    for seed in range(20, 60):
        (q, k, v), (q64, k64, v64) = _cuda_data(seed, dtype, B=1)
        if alpha != 2.0 or _far_from_tau(q64, k64, alpha, True, None, margin=2e-5):
            break
    else:
        pytest.fail("no seed keeps every score 2e-5 from tau")
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    for t in (q, k, v, q64, k64, v64):
        t.requires_grad_(True)
    flash.flash_entmax(q, k, v, alpha).backward(g.cuda())
    flash.flash_entmax(q64, k64, v64, alpha).backward(g.double())
    for a, b in ((q, q64), (k, k64), (v, v64)):
        assert a.grad.dtype == dtype
        torch.testing.assert_close(a.grad.cpu().double(), b.grad, rtol=UNIT[dtype],
                                   atol=2e-4 * b.grad.abs().max().item())


@cuda
def test_cuda_compile_fullgraph():
    """torch.compile sees one opaque node each way (the fake implementations): forward and
    gradients equal the eager op's."""
    (q, k, v), _ = _cuda_data(8, torch.bfloat16)
    f = torch.compile(lambda a, b, c: flash.flash_entmax(a, b, c, 1.5, True), fullgraph=True,
                      backend="aot_eager")
    grads = []
    for fn in (f, lambda a, b, c: flash.flash_entmax(a, b, c, 1.5, True)):
        ts = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*ts)
        out.float().pow(2).sum().backward()
        grads.append([out.detach()] + [t.grad for t in ts])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@cuda
def test_cuda_opcheck():
    (q, k, v), _ = _cuda_data(9, torch.float16)
    for with_ohat in (True, False):
        torch.library.opcheck(torch.ops.entmaxkv.flash_entmax_fwd,
                              (q, k, v, 1.5, True, None, 0.0, with_ohat))
    _out, tau, ohat = flash.flash_entmax_fwd(q, k, v, 1.5, True, None, 0.0, True)
    torch.library.opcheck(torch.ops.entmaxkv.flash_entmax_bwd,
                          (q, k, v, tau, ohat, torch.randn_like(q), 1.5, True, None, 0.0))


@cuda
def test_cuda_refuses_what_the_kernel_does_not_serve():
    from entmaxkv._lib import EntmaxKVError

    (q, k, v), _ = _cuda_data(10, torch.float16, D=64)
    with pytest.raises(EntmaxKVError, match="head_dim 64 or 128"):
        flash.flash_entmax(q[..., :32], k[..., :32], v[..., :32])
    with pytest.raises(EntmaxKVError, match="f16 or bf16"):
        flash.flash_entmax(q, k.float(), v.float())
    with pytest.raises(TypeError, match="must match"):
        flash.flash_entmax(q, k, v.bfloat16())


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_varlen_matches_the_cpu_op(dtype):
    """The packed form on CUDA (one launch a sequence) against the CPU op's float64 on the same
    16-bit inputs: out and tau as the batched CUDA test takes them, and the gradients."""
    tq, tk = [40, 0, 17, 64], [96, 30, 17, 200]
    q, k, v, cq, ck = _packed(15, tq, tk, H=6, Hk=2, D=64, dtype=torch.float32)
    dev = [t.to(dtype).cuda().requires_grad_(True) for t in (q, k, v)]
    ref = [t.detach().cpu().double().requires_grad_(True) for t in dev]
    slopes = SLOPES
    out, tau, _ohat = flash.flash_entmax_varlen_fwd(*dev, cq.cuda(), ck.cuda(), 1.5, True,
                                                    slopes.cuda(), 0.0, False)
    rout, rtau, _rohat = flash.flash_entmax_varlen_fwd(*ref, cq, ck, 1.5, True, slopes, 0.0,
                                                       False)
    vmax = ref[2].abs().max().item()
    torch.testing.assert_close(out.detach().cpu().double(), rout.detach(), rtol=UNIT[dtype],
                               atol=1e-4 * vmax)
    torch.testing.assert_close(tau.cpu(), rtau, rtol=1e-5, atol=1e-5)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(16)).to(dtype)
    flash.flash_entmax_varlen(*dev, cq.cuda(), ck.cuda(), 1.5, True, slopes.cuda()).backward(
        g.cuda())
    flash.flash_entmax_varlen(*ref, cq, ck, 1.5, True, slopes).backward(g.double())
    for a, b in zip(dev, ref):
        assert a.grad.dtype == dtype
        torch.testing.assert_close(a.grad.cpu().double(), b.grad, rtol=UNIT[dtype],
                                   atol=2e-4 * b.grad.abs().max().item())
