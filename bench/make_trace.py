#!/usr/bin/env python3
"""Writes a synthetic trace in the layout `eval/bench --workload trace:FILE` reads (see
tools/workload.c): k, v [N, Hk, D], q [S, H, D] (F16 or F32) and alibi_slopes [H] (F32).
Only the standard library: usable in tests without numpy. Real traces come from the model
(`entmaxkv trace`, a later issue).
Usage: make_trace.py OUT.safetensors [N] [S] [H] [HK] [D] [f16|f32] [seed]"""
import json
import random
import struct
import sys


def main():
    out = sys.argv[1]
    n, s, h, hk, d = (int(x) for x in (sys.argv[2:7] + ["512", "4", "4", "2", "32"][len(sys.argv[2:7]):]))
    dt = sys.argv[7] if len(sys.argv) > 7 else "f16"
    rng = random.Random(int(sys.argv[8]) if len(sys.argv) > 8 else 1)
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
    add("k", [n, hk, d], keys)
    add("v", [n, hk, d], [rng.gauss(0, 1) for _ in range(n * hk * d)])
    add("q", [s, h, d], [rng.gauss(0, 1) + 2 * direction[i % d] for i in range(s * h * d)])
    add("alibi_slopes", [h], [2.0 ** (-8.0 * (i + 1) / max(h // 2, 1)) if i < h // 2 else 0.0 for i in range(h)], "f", "F32", 4)
    header = json.dumps(tensors, separators=(",", ":")).encode()
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"".join(blobs))


if __name__ == "__main__":
    main()
