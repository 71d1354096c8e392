"""The entmaxkv language model in PyTorch: exactly train/MODEL.md (entmaxkv-lm-v1).

Module and parameter names are the tensor names of MODEL.md, so `model.state_dict()` is the
exported file (less `output.weight`, which is tied).
"""
if __name__ == "__main__":  # a module, not a command: --help says what it is
    import argparse
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="A module imported by the scripts of train/; running it does nothing.").parse_args()
    raise SystemExit(0)

import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab: int = 256
    d_model: int = 384
    n_layers: int = 8
    n_heads: int = 6
    n_kv_heads: int = 2
    head_dim: int = 64
    ffn_dim: int = 1024
    alpha: float = 1.5
    norm_eps: float = 1e-5
    train_ctx: int = 1024

    def metadata(self):
        """The safetensors __metadata__ strings of MODEL.md."""
        return {
            "arch": "entmaxkv-lm-v1",
            "vocab": str(self.vocab),
            "d_model": str(self.d_model),
            "n_layers": str(self.n_layers),
            "n_heads": str(self.n_heads),
            "n_kv_heads": str(self.n_kv_heads),
            "head_dim": str(self.head_dim),
            "ffn_dim": str(self.ffn_dim),
            "alpha": "1.5",
            "norm_eps": "1e-5",
            "positions": "nape",
            "train_ctx": str(self.train_ctx),
            "tied_embeddings": "1",
        }

    @staticmethod
    def from_metadata(md):
        if md.get("arch") != "entmaxkv-lm-v1":
            raise ValueError("not an entmaxkv-lm-v1 file: arch=%r" % md.get("arch"))
        if md.get("positions") != "nape" or md.get("tied_embeddings") != "1" or float(md["alpha"]) != 1.5:
            raise ValueError("unsupported variant in metadata")
        return Config(vocab=int(md["vocab"]), d_model=int(md["d_model"]), n_layers=int(md["n_layers"]),
                      n_heads=int(md["n_heads"]), n_kv_heads=int(md["n_kv_heads"]),
                      head_dim=int(md["head_dim"]), ffn_dim=int(md["ffn_dim"]),
                      norm_eps=float(md["norm_eps"]), train_ctx=int(md["train_ctx"]))


def nape_slopes(n_heads):
    """NAPE slopes (docs/math.md §1.6): m_h = 2^(-8 (h+1) / h0) for h < h0 = n_heads / 2, else 0."""
    h0 = n_heads // 2
    return [2.0 ** (-8.0 * (h + 1) / h0) if h < h0 else 0.0 for h in range(n_heads)]


def attention_bias(n_heads, t_q, t_k, device, q_offset=0):
    """[H, t_q, t_k] fp32: m_h * (j - i) for j <= i, -inf for j > i (query i = q_offset + row)."""
    i = torch.arange(t_q, device=device, dtype=torch.float32)[:, None] + q_offset
    j = torch.arange(t_k, device=device, dtype=torch.float32)[None, :]
    rel = j - i
    m = torch.tensor(nape_slopes(n_heads), device=device, dtype=torch.float32)
    bias = m[:, None, None] * rel[None]
    return bias.masked_fill((rel > 0)[None], float("-inf"))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wq = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)

    def forward(self, x, bias, entmax_fn):
        c = self.c
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        group = c.n_heads // c.n_kv_heads
        # query head h uses KV head h // group
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        # the attention core runs in fp32 (scores, entmax, weighted sum), also under autocast
        with torch.autocast(device_type=x.device.type, enabled=False):
            qf, kf, vf = q.float(), k.float(), v.float()
            z = torch.matmul(qf, kf.transpose(-1, -2)) * (1.0 / math.sqrt(c.head_dim)) + bias
            p = entmax_fn(z)
            out = torch.matmul(p, vf)
        out = out.to(x.dtype).transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.w1 = nn.Linear(c.d_model, c.ffn_dim, bias=False)
        self.w3 = nn.Linear(c.d_model, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.attn = Attention(c)
        self.ffn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.ffn = FeedForward(c)

    def forward(self, x, bias, entmax_fn):
        h = x + self.attn(self.attn_norm(x), bias, entmax_fn)
        return h + self.ffn(self.ffn_norm(h))


def default_entmax():
    from entmax import entmax15
    return lambda z: entmax15(z, dim=-1)


class LM(nn.Module):
    def __init__(self, c, entmax_fn=None):
        super().__init__()
        self.c = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.d_model)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.entmax_fn = entmax_fn or default_entmax()
        self._bias = None

    def init_weights(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        std = 0.02
        out_std = std / math.sqrt(2 * self.c.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                with torch.no_grad():
                    p.fill_(1.0)
                continue
            s = out_std if (name.endswith("wo.weight") or name.endswith("w2.weight")) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * s)

    def bias(self, T, device):
        if self._bias is None or self._bias.shape[-1] != T or self._bias.device != device:
            self._bias = attention_bias(self.c.n_heads, T, T, device)
        return self._bias

    def forward(self, tokens):
        """tokens [B, T] int64 -> logits [B, T, vocab] (fp32)."""
        B, T = tokens.shape
        x = self.tok_embeddings(tokens)
        bias = self.bias(T, tokens.device)
        for layer in self.layers:
            x = layer(x, bias, self.entmax_fn)
        x = self.norm(x)
        return F.linear(x, self.tok_embeddings.weight.to(x.dtype)).float()

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


def config_dict(c):
    return asdict(c)
