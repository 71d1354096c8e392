#!/usr/bin/env python3
"""Writes a synthetic trace in the layout `eval/bench --workload trace:FILE` reads (see
tools/workload.c): k, v [N, Hk, D], q [S, H, D] (F16 or F32) and alibi_slopes [H] (F32).
Only the standard library: usable in tests without numpy. Real traces come from the model
(`entmaxkv trace`, which names them l<layer>.q, l<layer>.k, ...).
Usage: make_trace.py OUT.safetensors [N] [S] [H] [HK] [D] [f16|f32] [seed] [--prefixes P1,P2]"""
import argparse
import json
import random
import struct


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\nUsage")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", metavar="OUT.safetensors", help="the trace file to write")
    for name, default, what in (("n", 512, "keys (tokens)"), ("s", 4, "decode queries"), ("h", 4, "query heads"),
                                ("hk", 2, "KV heads"), ("d", 32, "head dim")):
        ap.add_argument(name, nargs="?", type=int, default=default, help="%s (default %d)" % (what, default))
    ap.add_argument("dtype", nargs="?", choices=("f16", "f32"), default="f16", help="K/V/q dtype (default f16)")
    ap.add_argument("seed", nargs="?", type=int, default=1, help="random seed (default 1)")
    ap.add_argument("--prefixes", default="",
                    help="comma list of name prefixes, one copy of the tensors each, as `entmaxkv trace` "
                         "writes layers (e.g. l0.,l3.; default: no prefix)")
    return ap.parse_args()


def main():
    a = parse_args()
    out, n, s, h, hk, d, dt = a.out, a.n, a.s, a.h, a.hk, a.d, a.dtype
    rng = random.Random(a.seed)
    fmt, code, size = ("e", "F16", 2) if dt == "f16" else ("f", "F32", 4)
    direction = [rng.gauss(0, 1) for _ in range(d)]
    tensors, blobs, off = {}, [], 0

    def add(name, shape, values, f=fmt, c=code, sz=size):
        nonlocal off
        blob = struct.pack("<%d%s" % (len(values), f), *values)
        tensors[name] = {"dtype": c, "shape": shape, "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)

    keys = []
    for t in range(n):  # a few keys aligned with a shared direction, the rest noise
        strong = rng.random() < 0.01
        keys += [rng.gauss(0, 1) + (3 * direction[i % d] if strong else 0) for i in range(hk * d)]
    values = [rng.gauss(0, 1) for _ in range(n * hk * d)]
    queries = [rng.gauss(0, 1) + 2 * direction[i % d] for i in range(s * h * d)]
    slopes = [2.0 ** (-8.0 * (i + 1) / max(h // 2, 1)) if i < h // 2 else 0.0 for i in range(h)]
    for p in a.prefixes.split(",") if a.prefixes else [""]:
        add(p + "k", [n, hk, d], keys)
        add(p + "v", [n, hk, d], values)
        add(p + "q", [s, h, d], queries)
        add(p + "alibi_slopes", [h], slopes, "f", "F32", 4)
    header = json.dumps(tensors, separators=(",", ":")).encode()
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"".join(blobs))


if __name__ == "__main__":
    main()
