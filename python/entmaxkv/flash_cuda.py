"""The CUDA half of entmaxkv.flash_entmax: the torch tensors of one call as the library's
ekv_flash_entmax_args (include/entmaxkv/cuda.h), and its forward and backward launched on the
caller's current stream, with the workspace from torch's caching allocator (torch.empty on the
device: no cudaMalloc, no synchronisation). flash.py routes CUDA tensors here. Imported only
with torch."""
import ctypes

from . import _lib
from ._device import current_stream, device_guard
from ._lib import lib

# The forward's tau scheme (ekv_flash_entmax_args.tau_scheme; docs/math.md §12, §12.1): 0
# candidate lists, 1 histogram pass and exact-size lists. The same result either way; a
# benchmark's switch (bench/prefill_side_by_side.py --scheme), not part of the op's schema.
# 1 by default: 1.2-1.5x faster than the candidates on the op's benchmark shapes (8K and 32K, D 64
# and 128, bf16; bench/RESULTS.md, 2026-12-05). The model's prefill keeps the candidates (its
# flat heads' long lists take the histogram scheme's Newton passes).
TAU_SCHEMES = {"cand": 0, "hist": 1}
tau_scheme = 1

_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16",
                 "torch.bfloat16": "bfloat16"}


def _dtype(t, name):
    key = _TORCH_DTYPES.get(str(t.dtype))
    if key is None:
        raise TypeError(f"entmaxkv.flash_entmax: {name} is {t.dtype}; on CUDA q is float32, "
                        "float16 or bfloat16 and k, v float16 or bfloat16")
    return _lib.DTYPES[key]


def _args(q, k, v, alpha, causal, slopes, scale):
    """(args, keep): the struct for [B, T, H, D] q and [B, N, Hk, D] k, v (one device; made
    contiguous), out of q's dtype; keep holds q, k, v and the slopes the pointers refer to.
    The caller sets out and tau."""
    import torch

    dev = q.device
    for name, t in (("k", k), ("v", v), ("alibi_slopes", slopes)):
        if t is not None and t.device != dev:
            raise ValueError(f"entmaxkv.flash_entmax: {name} is on {t.device}, q on {dev}")
    if k.dtype != v.dtype:
        raise TypeError(f"entmaxkv.flash_entmax: k is {k.dtype} and v {v.dtype}; they must match")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if slopes is not None:
        slopes = slopes.detach().to(torch.float32).contiguous()
    B, T, H, D = q.shape
    p = lib.ekv_attention_default_params()
    p.num_queries, p.num_keys, p.num_heads, p.num_kv_heads = T, k.shape[1], H, k.shape[2]
    p.head_dim, p.causal, p.alpha, p.scale = D, int(causal), float(alpha), float(scale)
    p.alibi_slopes = None if slopes is None else slopes.data_ptr()
    a = _lib.FlashEntmaxArgs(shape=p, batch=B, q_dtype=_dtype(q, "q"), kv_dtype=_dtype(k, "k"),
                             out_dtype=_dtype(q, "q"), block_tokens=0, q=q.data_ptr(),
                             k=k.data_ptr(), v=v.data_ptr(), tau_scheme=tau_scheme)
    return a, (q, k, v, slopes)


def _workspace(a, dev, backward):
    import torch

    fwd, bwd = ctypes.c_int64(), ctypes.c_int64()
    ctx = _lib.context()
    ctx.call(lib.ekv_cuda_flash_entmax_workspace, ctx.ptr, ctypes.byref(a), ctypes.byref(fwd),
             ctypes.byref(bwd))
    n = bwd.value if backward else fwd.value
    return torch.empty(max(n, 1), dtype=torch.uint8, device=dev)  # 512-byte aligned blocks


def forward(q, k, v, alpha, causal, slopes, scale, with_ohat):
    """out (q's dtype), tau (float64 [B, T, H]) and o-hat (float32, q's shape; empty without
    with_ohat: the kernel then skips it) of batched [B, ...] CUDA tensors."""
    import torch

    with device_guard(q.device):
        a, _keep = _args(q, k, v, alpha, causal, slopes, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tau = torch.empty(q.shape[:-1], dtype=torch.float64, device=q.device)
        ohat = torch.empty(q.shape if with_ohat else (0,), dtype=torch.float32, device=q.device)
        a.out, a.tau = out.data_ptr(), tau.data_ptr()
        a.ohat = ohat.data_ptr() if with_ohat else None
        ws = _workspace(a, q.device, False)
        ctx = _lib.context()
        ctx.call(lib.ekv_cuda_flash_entmax_forward, ctx.ptr, ctypes.byref(a), ws.data_ptr(),
                 ws.numel(), current_stream(q.device))
    return out, tau, ohat


def backward(q, k, v, tau, ohat, dout, alpha, causal, slopes, scale):
    """dq, dk, dv (the dtypes of q, k, v) from the forward's tau and o-hat and dL/dout."""
    import torch

    if tau.shape != q.shape[:-1] or ohat.shape != q.shape:
        raise ValueError(f"entmaxkv.flash_entmax: tau must be {list(q.shape[:-1])} and ohat "
                         f"{list(q.shape)} (the forward's, with_ohat=True); got "
                         f"{list(tau.shape)} and {list(ohat.shape)}")
    with device_guard(q.device):
        a, keep = _args(q, k, v, alpha, causal, slopes, scale)
        tau = tau.to(torch.float64).contiguous()
        ohat = ohat.to(torch.float32).contiguous()
        dout = dout.to(q.dtype).contiguous()
        a.tau, a.ohat, a.out = tau.data_ptr(), ohat.data_ptr(), None  # out is not read
        dq, dk, dv = (torch.empty_like(t) for t in keep[:3])
        ws = _workspace(a, q.device, True)
        ctx = _lib.context()
        ctx.call(lib.ekv_cuda_flash_entmax_backward, ctx.ptr, ctypes.byref(a), dout.data_ptr(),
                 dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), ws.data_ptr(), ws.numel(),
                 current_stream(q.device))
    return dq, dk, dv
