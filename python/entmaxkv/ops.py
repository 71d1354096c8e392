"""DecodeWrapper.run as torch.library custom ops, so torch.compile (fullgraph) keeps a decode
step as one opaque node instead of breaking the graph at the ctypes call:

    entmaxkv::decode(Tensor q, int wrapper) -> Tensor
    entmaxkv::decode_into(Tensor q, Tensor(a!) out, int wrapper) -> ()

`wrapper` is a planned DecodeWrapper's `handle`; the fake implementations give
the output's shape from the wrapper's plan, so tracing needs no real call. DecodeWrapper.run
goes through them by itself while torch.compile traces it. Imported only with torch.
"""
from ._lib import need_torch
from ._registry import lookup

torch = need_torch("entmaxkv.ops")


def _wrapper(h):
    w = lookup(h)
    if w is None:
        raise RuntimeError(f"entmaxkv::decode: no DecodeWrapper has handle {h} (collected?)")
    return w


def _out_shape(h, q):
    shape = _wrapper(h).out_shape()
    if tuple(q.shape) != shape or q.dtype != torch.float32:
        raise ValueError(f"entmaxkv::decode: q must be float32 {list(shape)}; got {q.dtype} "
                         f"{list(q.shape)}")
    return shape


@torch.library.custom_op("entmaxkv::decode", mutates_args=())
def decode(q: torch.Tensor, wrapper: int) -> torch.Tensor:
    """One step of the wrapper's plan: out [batch, heads, head_dim] float32, a new tensor."""
    out = q.new_empty(_out_shape(wrapper, q))
    _wrapper(wrapper)._run(q, out)
    return out


@decode.register_fake
def _(q, wrapper):
    return q.new_empty(_out_shape(wrapper, q))


@torch.library.custom_op("entmaxkv::decode_into", mutates_args=("out",))
def decode_into(q: torch.Tensor, out: torch.Tensor, wrapper: int) -> None:
    """One step of the wrapper's plan, written into out."""
    _out_shape(wrapper, q)
    _wrapper(wrapper)._run(q, out)


@decode_into.register_fake
def _(q, out, wrapper):
    _out_shape(wrapper, q)


def run(wrapper, q, out=None):
    """wrapper.run(q, out) through the custom ops."""
    h = wrapper.handle
    if out is None:
        return torch.ops.entmaxkv.decode(q, h)
    torch.ops.entmaxkv.decode_into(q, out, h)
    return out


def compiling():
    """torch.compile is tracing the caller."""
    return torch.compiler.is_compiling()
