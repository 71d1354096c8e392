#!/usr/bin/env python3
"""Export trained weights to the shipped fp16 safetensors file of train/MODEL.md.

Input: the fp32 weights that train/train.py writes (--out/model_fp32.safetensors), or any
safetensors file with the tensor names of MODEL.md. Output: every tensor as F16, the
`__metadata__` strings of MODEL.md. Needs only numpy (no torch).

Usage: python3 train/export.py ckpt/model_fp32.safetensors models/entmaxkv-lm.safetensors
"""
import argparse
import os
import sys


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\nUsage:")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="fp32 weights (safetensors, the tensor names of MODEL.md)")
    ap.add_argument("dst", help="the fp16 safetensors file to write")
    return ap.parse_args()


# --help answers here, before the imports that need numpy or torch
ARGS = parse_args() if __name__ == "__main__" else None

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_io  # noqa: E402

MAX_BYTES = 30 * 1000 * 1000


def expected_shapes(md):
    d, L = int(md["d_model"]), int(md["n_layers"])
    H, Hk, D, Fd, V = int(md["n_heads"]), int(md["n_kv_heads"]), int(md["head_dim"]), int(md["ffn_dim"]), int(md["vocab"])
    s = {"tok_embeddings.weight": (V, d), "norm.weight": (d,)}
    for l in range(L):
        p = "layers.%d." % l
        s[p + "attn_norm.weight"] = (d,)
        s[p + "attn.wq.weight"] = (H * D, d)
        s[p + "attn.wk.weight"] = (Hk * D, d)
        s[p + "attn.wv.weight"] = (Hk * D, d)
        s[p + "attn.wo.weight"] = (d, H * D)
        s[p + "ffn_norm.weight"] = (d,)
        s[p + "ffn.w1.weight"] = (Fd, d)
        s[p + "ffn.w3.weight"] = (Fd, d)
        s[p + "ffn.w2.weight"] = (d, Fd)
    return s


def main():
    src, dst = ARGS.src, ARGS.dst
    w, md = st_io.read(src)
    want = expected_shapes(md)
    if set(w) != set(want):
        raise SystemExit("tensor names differ from MODEL.md: missing %s, extra %s"
                         % (sorted(set(want) - set(w)), sorted(set(w) - set(want))))
    out = {}
    for k, v in w.items():
        if tuple(v.shape) != want[k]:
            raise SystemExit("%s has shape %s, expected %s" % (k, v.shape, want[k]))
        h = v.astype(np.float32).astype(np.float16)
        if not np.all(np.isfinite(h)):
            raise SystemExit("%s does not fit in fp16" % k)
        out[k] = h
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    st_io.write(dst, out, md)
    size = os.path.getsize(dst)
    n = sum(v.size for v in out.values())
    print("wrote %s: %d tensors, %d parameters, %d bytes" % (dst, len(out), n, size))
    if size > MAX_BYTES:
        raise SystemExit("the file is over 30 MB")


if __name__ == "__main__":
    main()
