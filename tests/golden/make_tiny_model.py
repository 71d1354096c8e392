#!/usr/bin/env python3
"""A tiny random entmaxkv-lm-v1 model and its reference logits, for tests/test_model.c.

Writes tests/data/tiny_model.safetensors (F16 weights, the train/MODEL.md layout and
metadata) and tests/data/tiny_model_ref.safetensors (the prompt as I32 `tokens` [n] and the
logits F32 [n, 256] after every token). The forward pass here is written from MODEL.md alone,
in float64 numpy from the fp16-rounded weights, with 1.5-entmax by bisection on tau: it shares
no code with the C engine. Small shapes that still exercise GQA (4 query heads on 2 KV heads),
NAPE (2 ALiBi heads, 2 without position), causal entmax and two prefill blocks (72 tokens).

    python3 tests/golden/make_tiny_model.py      # needs numpy only
"""
import argparse
import json
import os
import struct

# --help answers here, before the imports that need numpy or torch
if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

import numpy as np  # noqa: E402

CFG = dict(vocab=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
           alpha=1.5, norm_eps=1e-5, train_ctx=64, tied_embeddings=1)
PROMPT = b"In the beginning was the Word: entmax gives exact zeros, so decode reads less."


def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, numpy array); dtypes float16, float32, int32."""
    names = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32"}
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    for name, a in tensors:
        a = np.ascontiguousarray(a)
        b = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def entmax15(z):
    """1.5-entmax of scores z (the entmax package's convention: p = [z/2 - tau]_+^2), bisection."""
    x = z / 2.0
    lo, hi = x.max() - 1.0, x.max()  # sum [x - tau]_+^2 is >= 1 at lo and 0 at hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if (np.clip(x - mid, 0, None) ** 2).sum() >= 1.0:
            lo = mid
        else:
            hi = mid
    p = np.clip(x - lo, 0, None) ** 2
    return p / p.sum()


def rmsnorm(x, g, eps):
    return x / np.sqrt((x * x).mean() + eps) * g


def forward(W, tokens, c):
    H, Hk, D = c["n_heads"], c["n_kv_heads"], c["head_dim"]
    h0 = H // 2
    slopes = [2.0 ** (-8.0 * (h + 1) / h0) if h < h0 else 0.0 for h in range(H)]
    Ks = [[] for _ in range(c["n_layers"])]
    Vs = [[] for _ in range(c["n_layers"])]
    out = []
    for i, tok in enumerate(tokens):
        x = W["tok_embeddings.weight"][tok].copy()
        for l in range(c["n_layers"]):
            p = "layers.%d." % l
            xn = rmsnorm(x, W[p + "attn_norm.weight"], c["norm_eps"])
            q = (W[p + "attn.wq.weight"] @ xn).reshape(H, D)
            Ks[l].append((W[p + "attn.wk.weight"] @ xn).reshape(Hk, D))
            Vs[l].append((W[p + "attn.wv.weight"] @ xn).reshape(Hk, D))
            K, V = np.array(Ks[l]), np.array(Vs[l])  # [i+1, Hk, D]
            att = np.zeros((H, D))
            for h in range(H):
                g = h // (H // Hk)
                z = K[:, g, :] @ q[h] / np.sqrt(D) + slopes[h] * (np.arange(i + 1) - i)
                att[h] = entmax15(z) @ V[:, g, :]
            x = x + W[p + "attn.wo.weight"] @ att.reshape(-1)
            hn = rmsnorm(x, W[p + "ffn_norm.weight"], c["norm_eps"])
            a = W[p + "ffn.w1.weight"] @ hn
            x = x + W[p + "ffn.w2.weight"] @ (a / (1.0 + np.exp(-a)) * (W[p + "ffn.w3.weight"] @ hn))
        out.append(W["tok_embeddings.weight"] @ rmsnorm(x, W["norm.weight"], c["norm_eps"]))
    return np.array(out)


def main():
    c = CFG
    rng = np.random.default_rng(20261130)
    d, H, Hk, D, F = c["d_model"], c["n_heads"], c["n_kv_heads"], c["head_dim"], c["ffn_dim"]
    shapes = [("tok_embeddings.weight", (c["vocab"], d), 1.0)]
    for l in range(c["n_layers"]):
        p = "layers.%d." % l
        shapes += [(p + "attn_norm.weight", (d,), None), (p + "attn.wq.weight", (H * D, d), 0.5),
                   (p + "attn.wk.weight", (Hk * D, d), 0.5), (p + "attn.wv.weight", (Hk * D, d), 0.3),
                   (p + "attn.wo.weight", (d, H * D), 0.2), (p + "ffn_norm.weight", (d,), None),
                   (p + "ffn.w1.weight", (F, d), 0.3), (p + "ffn.w3.weight", (F, d), 0.3),
                   (p + "ffn.w2.weight", (d, F), 0.2)]
    shapes.append(("norm.weight", (d,), None))
    W16 = []
    for name, shape, scale in shapes:
        a = 1.0 + 0.1 * rng.standard_normal(shape) if scale is None else scale * rng.standard_normal(shape)
        W16.append((name, a.astype(np.float16)))
    W = {n: a.astype(np.float64) for n, a in W16}  # the reference uses the fp16-rounded weights
    tokens = list(PROMPT)
    logits = forward(W, tokens, c)
    here = os.path.dirname(os.path.abspath(__file__))
    data = os.path.join(here, "..", "data")
    meta = dict(arch="entmaxkv-lm-v1", positions="nape", **c)
    write_safetensors(os.path.join(data, "tiny_model.safetensors"), W16, meta)
    write_safetensors(os.path.join(data, "tiny_model_ref.safetensors"),
                      [("tokens", np.array(tokens, dtype=np.int32)), ("logits", logits.astype(np.float32))],
                      {"note": "made by tests/golden/make_tiny_model.py"})
    print("%d tokens, logits range [%.3f, %.3f]" % (len(tokens), logits.min(), logits.max()))


if __name__ == "__main__":
    main()
