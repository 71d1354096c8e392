"""The shipped entmaxkv language model (models/entmaxkv-lm.safetensors, train/MODEL.md) as a
transformers PreTrainedModel whose attention goes through transformers' AttentionInterface,
so attn_implementation="entmaxkv" with an EntmaxKVCache decodes through the library.

8 pre-norm Llama-style layers, GQA 6/2, head dim 64, SwiGLU, 1.5-entmax, NAPE positions (half
the heads ALiBi, half none; no RoPE), byte tokens, tied embeddings. Parameter names are the
file's tensor names, so `from_safetensors` loads the file as it is.

    model = EntmaxKVLM.from_safetensors("models/entmaxkv-lm.safetensors", attn_implementation="entmaxkv")
    cache = EntmaxKVCache(model.config.n_layers, num_pages=64, method="certified")
    out = model.generate(ids, cache=cache, max_new_tokens=32, do_sample=False)
"""
import math

from . import hf  # registers the "entmaxkv" attention function (and checks torch, transformers)

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .hf import dense_entmax_attention

# the output's cache field: "cache" from transformers 5.24 on, "past_key_values" before
_CACHE_FIELD = ("cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__
                else "past_key_values")


class EntmaxKVLMConfig(PretrainedConfig):
    """The hyper-parameters of train/MODEL.md (its __metadata__ keys)."""

    model_type = "entmaxkv-lm"

    def __init__(self, vocab=256, d_model=384, n_layers=8, n_heads=6, n_kv_heads=2, head_dim=64,
                 ffn_dim=1024, entmax_alpha=1.5, norm_eps=1e-5, **kw):
        self.vocab, self.d_model, self.n_layers = vocab, d_model, n_layers
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.ffn_dim, self.entmax_alpha, self.norm_eps = ffn_dim, entmax_alpha, norm_eps
        kw.setdefault("tie_word_embeddings", False)  # the output projection reads the embedding
        super().__init__(vocab_size=vocab, num_hidden_layers=n_layers, **kw)

    @classmethod
    def from_metadata(cls, md, **kw):
        """The config of a file's __metadata__; refuses another architecture or variant."""
        if md.get("arch") != "entmaxkv-lm-v1":
            raise ValueError(f"not an entmaxkv-lm-v1 file: arch={md.get('arch')!r}")
        if md.get("positions") != "nape" or md.get("tied_embeddings") != "1":
            raise ValueError("unsupported variant: positions must be nape, embeddings tied")
        ints = ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim")
        return cls(**{k: int(md[k]) for k in ints}, entmax_alpha=float(md["alpha"]),
                   norm_eps=float(md["norm_eps"]), **kw)


def nape_slopes(n_heads):
    """MODEL.md's NAPE slopes: 2^(-8 (h + 1) / h0) for h < h0 = n_heads / 2, 0 after."""
    h0 = n_heads // 2
    return [2.0 ** (-8.0 * (h + 1) / h0) if h < h0 else 0.0 for h in range(n_heads)]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        c = self.config = config
        self.layer_idx = layer_idx
        self.wq = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)
        self.alibi_slopes = nape_slopes(c.n_heads)  # read by the attention functions

    def forward(self, x, cache=None):
        c = self.config
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        scale = 1.0 / math.sqrt(c.head_dim)
        if c._attn_implementation in (None, "eager"):  # the dense forward
            out = dense_entmax_attention(q, k, v, None, scale, c.entmax_alpha, self.alibi_slopes)
            out = out.transpose(1, 2)
        else:
            fn = hf.AttentionInterface()[c._attn_implementation]
            out, _ = fn(self, q, k, v, None, scaling=scale)
        return self.wo(out.reshape(B, T, c.n_heads * c.head_dim))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.attn = Attention(c, layer_idx)
        self.ffn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.ffn = nn.Module()
        self.ffn.w1 = nn.Linear(c.d_model, c.ffn_dim, bias=False)  # gate (silu)
        self.ffn.w3 = nn.Linear(c.d_model, c.ffn_dim, bias=False)  # up
        self.ffn.w2 = nn.Linear(c.ffn_dim, c.d_model, bias=False)  # down

    def forward(self, x, cache=None):
        h = x + self.attn(self.attn_norm(x), cache)
        f = self.ffn_norm(h)
        return h + self.ffn.w2(F.silu(self.ffn.w1(f)) * self.ffn.w3(f))


class EntmaxKVLM(PreTrainedModel, GenerationMixin):
    """The model: forward(input_ids [batch, tokens], past_key_values=cache) -> logits."""

    config_class = EntmaxKVLMConfig
    base_model_prefix = "entmaxkv_lm"
    _supports_attention_backend = True

    def __init__(self, config):
        super().__init__(config)
        self.tok_embeddings = nn.Embedding(config.vocab, config.d_model)
        self.layers = nn.ModuleList([Block(config, i) for i in range(config.n_layers)])
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.post_init()

    @classmethod
    def from_safetensors(cls, path, **config_kw):
        """The model of a MODEL.md file (float16 weights, computed in float32)."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            config = EntmaxKVLMConfig.from_metadata(f.metadata(), **config_kw)
            weights = {k: f.get_tensor(k).float() for k in f.keys()}
        model = cls(config)
        model.load_state_dict(weights, strict=True)
        return model.eval()

    def get_input_embeddings(self):
        return self.tok_embeddings

    def forward(self, input_ids=None, cache=None, attention_mask=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        """logits [batch, tokens (or logits_to_keep), vocab]; `cache` (transformers >= 5.24's
        name; past_key_values before) an EntmaxKVCache, or None for the dense forward."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise NotImplementedError("EntmaxKVLM: padding (an attention_mask with zeros) is not "
                                      "supported; decode sequences of one length")
        cache = cache if cache is not None else kwargs.get("past_key_values")
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, cache)
        x = self.norm(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = F.linear(x, self.tok_embeddings.weight)
        return CausalLMOutputWithPast(logits=logits, **{_CACHE_FIELD: cache})
