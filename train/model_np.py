#!/usr/bin/env python3
"""An independent numpy (float64) forward pass of train/MODEL.md, used to check the exported
file and the reference logits without torch:

    python3 train/model_np.py models/entmaxkv-lm.safetensors tests/data/model_ref_prompt.txt \
        tests/data/model_ref_logits.bin

prints the largest relative difference max|a - b| / max|b| per position against the file.
"""
import argparse
import os
import sys


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the exported model (safetensors)")
    ap.add_argument("prompt", help="the prompt file of the reference logits")
    ap.add_argument("logits", help="the reference logits (T x 256 float32)")
    return ap.parse_args()


# --help answers here, before the imports that need numpy or torch
ARGS = parse_args() if __name__ == "__main__" else None

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_io  # noqa: E402


def entmax15_rows(z):
    """Exact 1.5-entmax of each row of z (float64), -inf entries get 0 (sort-based)."""
    out = np.zeros_like(z)
    for r in range(z.shape[0]):
        row = z[r]
        fin = np.isfinite(row)
        x = (row[fin] - row[fin].max()) / 2
        xs = np.sort(x)[::-1]
        rho = np.arange(1, len(xs) + 1)
        mean = np.cumsum(xs) / rho
        mean_sq = np.cumsum(xs * xs) / rho
        delta = (1 - rho * (mean_sq - mean * mean)) / rho
        tau = mean - np.sqrt(np.maximum(delta, 0))
        k = int(np.sum(tau <= xs))
        p = np.maximum(x - tau[k - 1], 0) ** 2
        out[r, fin] = p
    return out


def forward(w, md, tokens):
    d, L = int(md["d_model"]), int(md["n_layers"])
    H, Hk, D = int(md["n_heads"]), int(md["n_kv_heads"]), int(md["head_dim"])
    eps = float(md["norm_eps"])
    g = {k: v.astype(np.float64) for k, v in w.items()}
    T = len(tokens)
    h0 = H // 2
    slopes = [2.0 ** (-8.0 * (h + 1) / h0) if h < h0 else 0.0 for h in range(H)]
    rel = np.arange(T)[None, :] - np.arange(T)[:, None]  # j - i

    def rms(x, wt):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * wt

    x = g["tok_embeddings.weight"][tokens]
    for l in range(L):
        p = "layers.%d." % l
        a = rms(x, g[p + "attn_norm.weight"])
        q = (a @ g[p + "attn.wq.weight"].T).reshape(T, H, D)
        k = (a @ g[p + "attn.wk.weight"].T).reshape(T, Hk, D)
        v = (a @ g[p + "attn.wv.weight"].T).reshape(T, Hk, D)
        outs = []
        for h in range(H):
            kv = h // (H // Hk)
            z = q[:, h] @ k[:, kv].T / np.sqrt(D) + slopes[h] * rel
            z[rel > 0] = -np.inf
            outs.append(entmax15_rows(z) @ v[:, kv])
        x = x + np.concatenate(outs, -1) @ g[p + "attn.wo.weight"].T
        f = rms(x, g[p + "ffn_norm.weight"])
        u = f @ g[p + "ffn.w1.weight"].T
        x = x + ((u / (1 + np.exp(-u))) * (f @ g[p + "ffn.w3.weight"].T)) @ g[p + "ffn.w2.weight"].T
    x = rms(x, g["norm.weight"])
    return x @ g["tok_embeddings.weight"].T


def main():
    w, md = st_io.read(ARGS.model)
    prompt = open(ARGS.prompt, "rb").read()
    ref = np.fromfile(ARGS.logits, dtype="<f4").reshape(len(prompt), -1).astype(np.float64)
    got = forward(w, md, np.frombuffer(prompt, dtype=np.uint8).astype(np.int64))
    rel = np.abs(got - ref).max(-1) / np.abs(ref).max(-1)
    print("positions %d, max relative difference %.3e (at %d), mean %.3e"
          % (len(prompt), rel.max(), int(rel.argmax()), rel.mean()))
    return 0 if rel.max() <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
