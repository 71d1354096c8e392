"""Hugging Face transformers integration: an alpha-entmax model decodes through entmaxkv.

* `EntmaxKVCache`, a `transformers.cache_utils.Cache` whose layers (`EntmaxKVLayer`) keep
  K and V in an entmaxkv paged cache (PagedKVCache for CPU tensors, CudaPagedKVCache for
  CUDA tensors) instead of concatenated tensors.
* `entmaxkv_attention`, registered with `transformers.AttentionInterface` as "entmaxkv": a
  one-token query whose keys came from an EntmaxKVLayer is a decode step of the layer's
  DecodeWrapper (any method of the library); anything else (a prefill, no cache) is dense
  alpha-entmax attention in torch, so a model with attn_implementation="entmaxkv" gives the
  same outputs as its dense forward.

The attention module may carry `alibi_slopes` ([num_heads] floats, the bias m_h * (j - i),
docs/math.md §1.6) and its config `entmax_alpha` (default 1.5). The query position is the
last cached token, so a batch must hold sequences of one length without padding.
Imported only with torch and transformers installed; `import entmaxkv.hf` registers.
"""
import numpy as np

from ._lib import need_module, need_torch

torch = need_torch("entmaxkv.hf")
need_module("transformers", "entmaxkv.hf", "pip install 'entmaxkv[hf]'")
from transformers import AttentionInterface  # after the checks above
from transformers.cache_utils import Cache, CacheLayerMixin

from .cache import PagedKVCache
from .cuda_cache import CudaPagedKVCache
from .decode import DecodeWrapper


class EntmaxKVLayer(CacheLayerMixin):
    """One model layer's K and V in an entmaxkv paged cache: one sequence per batch row,
    created on the first update from the states' shape and device. Keyword arguments:
    those of PagedKVCache / CudaPagedKVCache (num_pages, page_size, dtype, code_bits, ...),
    and method, budget: the DecodeWrapper's."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, method="dense", budget=1 / 16, **cache_kw):
        super().__init__()
        if method == "screened":
            # the screen reads per-token key codes; 8 bits as the CLI's default (docs/cli.md)
            cache_kw.setdefault("code_bits", 8)
        self.method, self.budget, self.cache_kw = method, budget, cache_kw
        self.cache, self.seqs, self.wrapper, self.length = None, [], None, 0
        DecodeWrapper(method, budget)  # bad method or budget: refused now, not at the first step

    def lazy_initialization(self, key_states, value_states):
        B, Hk, _, D = key_states.shape
        self.device = key_states.device
        make = CudaPagedKVCache if key_states.device.type == "cuda" else PagedKVCache
        kw = dict(self.cache_kw)
        if make is CudaPagedKVCache:
            kw.setdefault("device", key_states.device)
        self.cache = make(num_kv_heads=Hk, head_dim=D, **kw)
        self.seqs = [self.cache.new_sequence() for _ in range(B)]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Appends the new tokens ([batch, num_kv_heads, tokens, head_dim]) and returns the
        states for the attention function: this call's (all the tokens, for a prefill into
        an empty cache) with a link to this layer, which a one-token step decodes through."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, _, T, _ = key_states.shape
        if B != len(self.seqs):
            raise ValueError(f"EntmaxKVLayer: a batch of {B} after one of {len(self.seqs)}")
        if self.length and T > 1:
            raise NotImplementedError("EntmaxKVCache: a prefill after earlier tokens (chunked "
                                      "prefill) is not supported: prefill once, then decode one "
                                      "token per step")
        for b, seq in enumerate(self.seqs):  # [Hk, T, D] -> [T, Hk, D] float32 rows
            self.cache.append(seq, _rows(key_states[b]), _rows(value_states[b]))
        self.length += T
        key_states._entmaxkv_layer = self  # how entmaxkv_attention finds the layer
        return key_states, value_states

    def decode(self, query, alpha, scale, slopes):
        """The attention of query [batch, num_heads, 1, head_dim] over the cached tokens (the
        last one is the query's own): [batch, num_heads, head_dim] float32."""
        H = query.shape[1]
        key = (float(alpha), float(scale), None if slopes is None else tuple(slopes), H)
        if self.wrapper is None or self._wrapper_key != key:
            self.wrapper = DecodeWrapper(self.method, self.budget, alpha=alpha, scale=scale,
                                         alibi_slopes=slopes)
            self._wrapper_key = key
        pages = -(-self.length // self.cache.page_size)
        room = 1 << (pages - 1).bit_length()  # CUDA: a new C plan only when the pages double
        self.wrapper.plan(self.cache, self.seqs, H, max_pages_per_seq=room)
        return self.wrapper.run(query[:, :, 0].float().contiguous())

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return -1

    def reset(self):
        for seq in self.seqs:
            self.cache.free_sequence(seq)
        self.seqs = [self.cache.new_sequence() for _ in self.seqs] if self.cache else []
        self.length = 0

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("EntmaxKVCache: beam search (reorder_cache) is not supported")


def _rows(states):
    """[num_kv_heads, tokens, head_dim] -> contiguous float32 [tokens, num_kv_heads, head_dim]."""
    return states.detach().transpose(0, 1).float().contiguous()


class EntmaxKVCache(Cache):
    """A Cache of num_layers EntmaxKVLayer (keyword arguments: theirs). num_pages is per
    layer and must hold every sequence of the batch: batch * ceil(max tokens / page_size)."""

    def __init__(self, num_layers, num_pages, method="dense", budget=1 / 16, **cache_kw):
        super().__init__(layers=[EntmaxKVLayer(method, budget, num_pages=num_pages, **cache_kw)
                                 for _ in range(num_layers)])

    @property
    def reports(self):
        """Each layer's last decode report (DecodeWrapper.report), None before a step."""
        return [None if l.wrapper is None else l.wrapper.report for l in self.layers]


def entmaxkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    """The "entmaxkv" attention function: query [batch, heads, q_len, head_dim], key and value
    [batch, kv_heads, kv_len, head_dim]; returns ([batch, q_len, heads, head_dim], None)."""
    alpha = getattr(module.config, "entmax_alpha", 1.5)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    slopes = getattr(module, "alibi_slopes", None)
    layer = getattr(key, "_entmaxkv_layer", None)
    if layer is not None and query.shape[2] == 1:
        sl = None if slopes is None else np.asarray(torch.as_tensor(slopes).cpu(), np.float32)
        out = layer.decode(query, alpha, scale, sl)
        return torch.as_tensor(out)[:, None].to(query.dtype), None
    out = dense_entmax_attention(query, key, value, attention_mask, scale, alpha, slopes)
    return out.transpose(1, 2).to(query.dtype), None


def dense_entmax_attention(query, key, value, attention_mask, scale, alpha, slopes=None):
    """Dense alpha-entmax attention in float32, the reference the decode path must equal:
    [batch, heads, q_len, head_dim]. The queries are the last q_len of the kv_len positions;
    attention_mask None means causal, a bool mask keeps its True entries, a float one adds."""
    group = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    z = torch.matmul(query.float(), k.transpose(-1, -2)) * scale
    T, N = query.shape[2], key.shape[2]
    rel = (torch.arange(N, device=z.device)[None, :]
           - (N - T + torch.arange(T, device=z.device))[:, None]).float()  # j - i
    if slopes is not None:
        z = z + torch.as_tensor(slopes, dtype=torch.float32, device=z.device)[:, None, None] * rel
    if attention_mask is None:
        z = z.masked_fill(rel > 0, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        z = z.masked_fill(~attention_mask, float("-inf"))
    else:
        z = z + attention_mask.float()
    return torch.matmul(_entmax(z, alpha), v)


def _entmax(z, alpha):
    """entmax over the last axis: the library's (exact tau) for CPU tensors; on CUDA, the
    `entmax` package's bisection (same convention, docs/math.md §0)."""
    if z.device.type == "cpu":
        from .functional import entmax

        return entmax(z.contiguous(), alpha=alpha)
    from entmax import entmax_bisect

    return entmax_bisect(z, alpha=alpha, dim=-1)


AttentionInterface.register("entmaxkv", entmaxkv_attention)
