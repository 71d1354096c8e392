"""entmaxkv.flash_entmax: exact alpha-entmax attention as a torch op with autograd (issue 30,
docs/math.md §13):

    out = entmaxkv.flash.flash_entmax(q, k, v, alpha=1.5, causal=True, alibi_slopes=None)

q [B, T, H, D] (or [T, H, D]), k and v [B, N, Hk, D] (or [N, Hk, D]), flash attention's layout
and conventions: row t of T sits at position N - T + t and, when causal, sees the keys up to it;
ALiBi adds -m_h |j - i|; scale None = 1/sqrt(D); H a multiple of Hk (GQA). The forward saves
each row's tau (as flash attention saves the log-sum-exp) and the backward is the entmax
Jacobian on the support (§13.2-13.3), so gradients are exact too.

Registered with torch.library as

    entmaxkv::flash_entmax_fwd(q, k, v, alpha, causal, alibi_slopes, scale) -> (out, tau)
    entmaxkv::flash_entmax_bwd(q, k, v, tau, dout, alpha, causal, alibi_slopes, scale)
        -> (dq, dk, dv)

with fake implementations, so autograd and torch.compile see one opaque node each. CPU tensors
run the library's CPU reference (ekv_entmax_attention_forward/backward: double precision, one
thread, O(T N) per head); CUDA tensors run ekv_cuda_flash_entmax_forward/backward
(flash_cuda.py: the fused prefill kernel on tensor cores for the forward, a first CUDA-core
backward; q float32/float16/bfloat16, k and v float16 or bfloat16, D 64 or 128; on the
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
                     causal: bool, alibi_slopes: Optional[torch.Tensor],
                     scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """out (q's shape and dtype) and tau (q's shape less D, float64)."""
    cuda = _on_cuda(q, k, v, alibi_slopes)
    qb, kb, vb, single = _batched(q, k, v)
    if cuda:
        out, tau = flash_cuda.forward(qb, kb, vb, alpha, causal, alibi_slopes, scale)
        return (out[0], tau[0]) if single else (out, tau)
    outs, taus = [], []
    for b in range(qb.shape[0]):
        o, t = functional.entmax_attention(qb[b].contiguous(), kb[b].contiguous(),
                                           vb[b].contiguous(), alpha, causal,
                                           _slopes(alibi_slopes), scale or None)
        outs.append(torch.from_numpy(o))
        taus.append(torch.from_numpy(t))
    out, tau = torch.stack(outs), torch.stack(taus)
    return (out[0], tau[0]) if single else (out, tau)


@flash_entmax_fwd.register_fake
def _(q, k, v, alpha, causal, alibi_slopes, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float64)


@torch.library.custom_op("entmaxkv::flash_entmax_bwd", mutates_args=())
def flash_entmax_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: torch.Tensor,
                     dout: torch.Tensor, alpha: float, causal: bool,
                     alibi_slopes: Optional[torch.Tensor],
                     scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (the shapes and dtypes of q, k, v) given the forward's tau and dL/dout."""
    cuda = _on_cuda(q, k, v, tau, dout, alibi_slopes)
    qb, kb, vb, single = _batched(q, k, v)
    tb, db = (tau.unsqueeze(0), dout.unsqueeze(0)) if single else (tau, dout)
    if cuda:
        dq, dk, dv = flash_cuda.backward(qb, kb, vb, tb, db, alpha, causal, alibi_slopes, scale)
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
def _(q, k, v, tau, dout, alpha, causal, alibi_slopes, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, alpha, causal, alibi_slopes, scale = inputs
    ctx.save_for_backward(q, k, v, output[1])
    ctx.args = (alpha, causal, alibi_slopes, scale)


def _backward(ctx, dout, dtau):
    q, k, v, tau = ctx.saved_tensors
    alpha, causal, alibi_slopes, scale = ctx.args
    dq, dk, dv = flash_entmax_bwd(q, k, v, tau, dout, alpha, causal, alibi_slopes, scale)
    return dq, dk, dv, None, None, None, None  # tau is not differentiated (dtau unused)


flash_entmax_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_entmax(q, k, v, alpha=1.5, causal=True, alibi_slopes=None, scale=None):
    """Exact alpha-entmax attention (the module docstring); returns out, q's shape and dtype."""
    out, _tau = flash_entmax_fwd(q, k, v, float(alpha), bool(causal), alibi_slopes,
                                 0.0 if scale is None else float(scale))
    return out
