"""entmaxkv.flash_entmax: exact alpha-entmax attention as a torch op with autograd (issue 30,
docs/math.md §13):

    out = entmaxkv.flash.flash_entmax(q, k, v, alpha=1.5, causal=True, alibi_slopes=None)
    out = entmaxkv.flash.flash_entmax_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alpha=1.5,
                                             causal=True, alibi_slopes=None)

q [B, T, H, D] (or [T, H, D]), k and v [B, N, Hk, D] (or [N, Hk, D]), flash attention's layout
and conventions: row t of T sits at position N - T + t and, when causal, sees the keys up to it;
ALiBi adds -m_h |j - i|; scale None = 1/sqrt(D); H a multiple of Hk (GQA). The forward saves
each row's tau (as flash attention saves the log-sum-exp) and o-hat, the w-weighted mean of the
support's V rows (float32, q's shape; as flash attention's backward takes out for
D = dout . out, this backward's delta = dout . o-hat), and the backward is the entmax Jacobian
on the support (§13.2-13.3), so gradients are exact too.

The varlen form packs sequences of different lengths as flash attention's varlen functions do:
q [total_q, H, D], k and v [total_k, Hk, D], and cu_seqlens_q, cu_seqlens_k the B + 1 offsets
of the sequences (integer tensors, 0 first, nondecreasing, the totals last); sequence i's
queries q[cu_q[i]:cu_q[i+1]] attend its keys k[cu_k[i]:cu_k[i+1]] with the same conventions.
It runs the op above once per non-empty sequence (one launch each on CUDA; the offsets are read
on the host, a synchronisation where they live on the device) and writes each sequence's rows of
one output; a sequence with no queries is skipped, one with queries but no keys is an error.

Registered with torch.library as

    entmaxkv::flash_entmax_fwd(q, k, v, alpha, causal, alibi_slopes, scale, with_ohat)
        -> (out, tau, ohat)
    entmaxkv::flash_entmax_bwd(q, k, v, tau, ohat, dout, alpha, causal, alibi_slopes, scale)
        -> (dq, dk, dv)

    entmaxkv::flash_entmax_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, alpha, causal,
                                      alibi_slopes, scale, with_ohat) -> (out, tau, ohat)
    entmaxkv::flash_entmax_varlen_bwd(q, k, v, tau, ohat, dout, cu_seqlens_q, cu_seqlens_k,
                                      alpha, causal, alibi_slopes, scale) -> (dq, dk, dv)

with fake implementations, so autograd and torch.compile see one opaque node each. with_ohat
False (flash_entmax's choice when no input requires grad: inference) returns an empty o-hat,
and the CUDA forward skips forming it. CPU tensors run the library's CPU reference
(ekv_entmax_attention_forward/ohat/backward: double precision, one thread, O(T N) per head);
CUDA tensors run ekv_cuda_flash_entmax_forward/backward (flash_cuda.py: the fused prefill
kernel on tensor cores for the forward, the backward's rows and keys passes on tensor cores;
q float32/float16/bfloat16, k and v float16 or bfloat16, D 64 or 128; on the
caller's current stream, workspace from torch's allocator). Tensors on two devices are an error,
never copied behind the caller's back. Imported only with torch.
"""
from typing import Optional, Tuple

from . import flash_cuda, functional
from ._lib import need_torch

torch = need_torch("entmaxkv.flash")


def _batched(q, k, v):
    """(q, k, v) as [B, ...] and whether the caller's were unbatched; shapes checked here, the
    rest by the library (functional._attention_args)."""
    if q.dim() == 3 and k.dim() == 3 and v.dim() == 3:
        return q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), True
    if q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0]:
        return q, k, v, False
    raise ValueError("entmaxkv.flash_entmax: q must be [B, T, H, D] and k, v [B, N, Hk, D] (or "
                     f"all three unbatched); got {list(q.shape)}, {list(k.shape)}, "
                     f"{list(v.shape)}")


def _on_cuda(*ts):
    """Whether the call runs on CUDA (q on a CUDA device); every tensor must be where q is."""
    dev = ts[0].device
    for t in ts:
        if t is not None and t.device != dev:
            raise ValueError(f"entmaxkv.flash_entmax: a tensor is on {t.device}, q on {dev}: "
                             "move them to one device")
    return dev.type == "cuda"


def _slopes(alibi_slopes):
    return None if alibi_slopes is None else alibi_slopes.detach().to(torch.float32)


@torch.library.custom_op("entmaxkv::flash_entmax_fwd", mutates_args=())
def flash_entmax_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: float,
                     causal: bool, alibi_slopes: Optional[torch.Tensor], scale: float,
                     with_ohat: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (q's shape and dtype), tau (q's shape less D, float64) and o-hat (q's shape,
    float32; empty without with_ohat)."""
    cuda = _on_cuda(q, k, v, alibi_slopes)
    qb, kb, vb, single = _batched(q, k, v)
    if cuda:
        out, tau, ohat = flash_cuda.forward(qb, kb, vb, alpha, causal, alibi_slopes, scale,
                                            with_ohat)
    else:
        res = [[], [], []]
        for b in range(qb.shape[0]):
            args = (qb[b].contiguous(), kb[b].contiguous(), vb[b].contiguous())
            o, t = functional.entmax_attention(*args, alpha, causal, _slopes(alibi_slopes),
                                               scale or None)
            res[0].append(torch.from_numpy(o))
            res[1].append(torch.from_numpy(t))
            if with_ohat:
                res[2].append(torch.from_numpy(functional.entmax_attention_ohat(
                        *args, t, alpha, causal, _slopes(alibi_slopes), scale or None)))
        out, tau = torch.stack(res[0]), torch.stack(res[1])
        ohat = torch.stack(res[2]).to(torch.float32) if with_ohat else _no_ohat(q)
    if single:
        out, tau, ohat = out[0], tau[0], ohat[0] if with_ohat else ohat
    return out, tau, ohat


def _no_ohat(q):
    """The o-hat of a forward without with_ohat: empty."""
    return q.new_empty((0,), dtype=torch.float32)


def _fwd_fake(q, with_ohat):
    """Both forwards' outputs as their fake implementations give them: out, tau, o-hat."""
    return (q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float64),
            q.new_empty(q.shape, dtype=torch.float32) if with_ohat else _no_ohat(q))


@flash_entmax_fwd.register_fake
def _(q, k, v, alpha, causal, alibi_slopes, scale, with_ohat):
    return _fwd_fake(q, with_ohat)


@torch.library.custom_op("entmaxkv::flash_entmax_bwd", mutates_args=())
def flash_entmax_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: torch.Tensor,
                     ohat: torch.Tensor, dout: torch.Tensor, alpha: float, causal: bool,
                     alibi_slopes: Optional[torch.Tensor],
                     scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (the shapes and dtypes of q, k, v) given the forward's tau and o-hat and
    dL/dout (the CPU reference recomputes o-hat's part itself and does not read it)."""
    cuda = _on_cuda(q, k, v, tau, ohat, dout, alibi_slopes)
    qb, kb, vb, single = _batched(q, k, v)
    tb, ob, db = (x.unsqueeze(0) for x in (tau, ohat, dout)) if single else (tau, ohat, dout)
    if cuda:
        dq, dk, dv = flash_cuda.backward(qb, kb, vb, tb, ob, db, alpha, causal, alibi_slopes,
                                         scale)
        return (dq[0], dk[0], dv[0]) if single else (dq, dk, dv)
    grads = [[], [], []]
    for b in range(qb.shape[0]):
        g = functional.entmax_attention_backward(
                qb[b].contiguous(), kb[b].contiguous(), vb[b].contiguous(), tb[b].contiguous(),
                db[b].to(q.dtype).contiguous(), alpha, causal, _slopes(alibi_slopes),
                scale or None)
        for i in range(3):
            grads[i].append(torch.from_numpy(g[i]))
    dq, dk, dv = (torch.stack(x) for x in grads)
    return (dq[0], dk[0], dv[0]) if single else (dq, dk, dv)


@flash_entmax_bwd.register_fake
def _(q, k, v, tau, ohat, dout, alpha, causal, alibi_slopes, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, alpha, causal, alibi_slopes, scale, _with_ohat = inputs
    ctx.save_for_backward(q, k, v, output[1], output[2])
    ctx.args = (alpha, causal, alibi_slopes, scale)


def _saved_ohat(ohat, q):
    """The saved o-hat, or RuntimeError where the forward ran without it."""
    if ohat.numel() == 0 and q.numel() != 0:
        raise RuntimeError("entmaxkv.flash_entmax: the forward ran with with_ohat=False (no "
                           "input required grad), so it kept no o-hat for a backward")
    return ohat


def _backward(ctx, dout, dtau, dohat):
    q, k, v, tau, ohat = ctx.saved_tensors
    alpha, causal, alibi_slopes, scale = ctx.args
    dq, dk, dv = flash_entmax_bwd(q, k, v, tau, _saved_ohat(ohat, q), dout, alpha, causal,
                                  alibi_slopes, scale)
    # tau, o-hat: not differentiated (unused); alpha ... with_ohat: not tensors
    return dq, dk, dv, None, None, None, None, None


flash_entmax_fwd.register_autograd(_backward, setup_context=_setup_context)


def _wants_grad(*ts):
    """Whether autograd will need the backward of an op on these tensors (o-hat is kept then)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def flash_entmax(q, k, v, alpha=1.5, causal=True, alibi_slopes=None, scale=None):
    """Exact alpha-entmax attention (the module docstring); returns out, q's shape and dtype."""
    out, _tau, _ohat = flash_entmax_fwd(q, k, v, float(alpha), bool(causal), alibi_slopes,
                                        0.0 if scale is None else float(scale),
                                        _wants_grad(q, k, v))
    return out


# ---- the varlen form ----

def _offsets(cu, name, total):
    """cu_seqlens as host ints, checked: a 1-D integer tensor, 0 first, nondecreasing, total
    last."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or \
            cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise ValueError(f"entmaxkv.flash_entmax_varlen: {name} must be a 1-D integer tensor of "
                         "B + 1 offsets (B >= 1)")
    off = cu.tolist()
    if off[0] != 0 or off[-1] != total or any(b < a for a, b in zip(off, off[1:])):
        raise ValueError(f"entmaxkv.flash_entmax_varlen: {name} must rise from 0 to {total} "
                         f"(the packed length) without decreasing; got {off}")
    return off


def _varlen_spans(q, k, v, cu_seqlens_q, cu_seqlens_k):
    """The (query span, key span) of each sequence, shapes and offsets checked."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[0] != v.shape[0]:
        raise ValueError("entmaxkv.flash_entmax_varlen: q must be [total_q, H, D] and k, v "
                         f"[total_k, Hk, D]; got {list(q.shape)}, {list(k.shape)}, "
                         f"{list(v.shape)}")
    oq = _offsets(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    ok = _offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if len(oq) != len(ok):
        raise ValueError("entmaxkv.flash_entmax_varlen: cu_seqlens_q and cu_seqlens_k must list "
                         f"the same sequences; got {len(oq) - 1} and {len(ok) - 1}")
    return [((oq[i], oq[i + 1]), (ok[i], ok[i + 1])) for i in range(len(oq) - 1)]


@torch.library.custom_op("entmaxkv::flash_entmax_varlen_fwd", mutates_args=())
def flash_entmax_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, alpha: float,
                            causal: bool, alibi_slopes: Optional[torch.Tensor], scale: float,
                            with_ohat: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (q's shape and dtype), tau ([total_q, H], float64) and o-hat (q's shape, float32;
    empty without with_ohat), sequence by sequence."""
    _on_cuda(q, k, v, alibi_slopes)
    out = q.new_zeros(q.shape)
    tau = q.new_zeros(q.shape[:-1], dtype=torch.float64)
    ohat = q.new_zeros(q.shape, dtype=torch.float32) if with_ohat else _no_ohat(q)
    for (a, b), (c, d) in _varlen_spans(q, k, v, cu_seqlens_q, cu_seqlens_k):
        if b > a:
            o, t, oh = flash_entmax_fwd(q[a:b], k[c:d], v[c:d], alpha, causal, alibi_slopes,
                                        scale, with_ohat)
            out[a:b], tau[a:b] = o, t
            if with_ohat:
                ohat[a:b] = oh
    return out, tau, ohat


@flash_entmax_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, alpha, causal, alibi_slopes, scale, with_ohat):
    return _fwd_fake(q, with_ohat)


@torch.library.custom_op("entmaxkv::flash_entmax_varlen_bwd", mutates_args=())
def flash_entmax_varlen_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: torch.Tensor,
                            ohat: torch.Tensor, dout: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            cu_seqlens_k: torch.Tensor, alpha: float, causal: bool,
                            alibi_slopes: Optional[torch.Tensor],
                            scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, sequence by sequence (keys of a sequence with no queries get 0)."""
    _on_cuda(q, k, v, tau, ohat, dout, alibi_slopes)
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    for (a, b), (c, d) in _varlen_spans(q, k, v, cu_seqlens_q, cu_seqlens_k):
        if b > a:
            dq[a:b], dk[c:d], dv[c:d] = flash_entmax_bwd(q[a:b], k[c:d], v[c:d], tau[a:b],
                                                         ohat[a:b], dout[a:b], alpha, causal,
                                                         alibi_slopes, scale)
    return dq, dk, dv


@flash_entmax_varlen_bwd.register_fake
def _(q, k, v, tau, ohat, dout, cu_seqlens_q, cu_seqlens_k, alpha, causal, alibi_slopes, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_varlen_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, alpha, causal, alibi_slopes, scale, _with_ohat = inputs
    ctx.save_for_backward(q, k, v, output[1], output[2], cu_q, cu_k)
    ctx.args = (alpha, causal, alibi_slopes, scale)


def _varlen_backward(ctx, dout, dtau, dohat):
    q, k, v, tau, ohat, cu_q, cu_k = ctx.saved_tensors
    alpha, causal, alibi_slopes, scale = ctx.args
    dq, dk, dv = flash_entmax_varlen_bwd(q, k, v, tau, _saved_ohat(ohat, q), dout, cu_q, cu_k,
                                         alpha, causal, alibi_slopes, scale)
    return dq, dk, dv, None, None, None, None, None, None, None


flash_entmax_varlen_fwd.register_autograd(_varlen_backward, setup_context=_setup_varlen_context)


def flash_entmax_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alpha=1.5, causal=True,
                        alibi_slopes=None, scale=None):
    """flash_entmax over packed sequences (the module docstring); returns out, q's shape and
    dtype."""
    out, _tau, _ohat = flash_entmax_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                               float(alpha), bool(causal), alibi_slopes,
                                               0.0 if scale is None else float(scale),
                                               _wants_grad(q, k, v))
    return out
