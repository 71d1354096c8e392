#!/usr/bin/env python3
"""Passkey retrieval prompts for evaluation (format: train/MODEL.md, "Passkey retrieval").

Writes, for each length L (tokens = bytes) and i = 0..count-1, the prompt file
OUT/passkey_L{L}_{i:03d}.txt (exactly L bytes, no trailing newline added) and one line of
OUT/manifest.tsv:

    file  length  depth  answer  needle_offset

depth = (i + 0.5) / count (the needle goes from the start to the end of the filler),
answer = the 5 digits the model must produce next (greedy, 5 tokens), needle_offset = byte
offset of the needle's leading "\\n". The filler is the validation text (data/val.txt), so the
model has not seen it. Deterministic for a given --seed and val.txt.

Usage: python3 train/make_passkey.py [--lengths 8192,32768,65536] [--count 20]
           [--val data/val.txt] [--out data/passkey] [--seed 0]
"""
import argparse
import os
import sys

def parse_args():
    ap = argparse.ArgumentParser(description="passkey evaluation prompts")
    ap.add_argument("--lengths", default="8192,32768,65536")
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--val", default="data/val.txt")
    ap.add_argument("--out", default="data/passkey")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


# --help answers here, before the imports that need numpy or torch
ARGS = parse_args() if __name__ == "__main__" else None

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import passkey  # noqa: E402


def main():
    a = ARGS
    with open(a.val, "rb") as f:
        src = np.frombuffer(f.read(), dtype=np.uint8)
    os.makedirs(a.out, exist_ok=True)
    lines = ["file\tlength\tdepth\tanswer\tneedle_offset"]
    for L in (int(v) for v in a.lengths.split(",") if v):
        rng = np.random.default_rng([a.seed, L])
        free = L - passkey.NEEDLE_LEN - len(passkey.QUESTION)
        for i in range(a.count):
            depth = (i + 0.5) / a.count
            key = passkey.random_key(rng)
            start = int(rng.integers(0, len(src)))
            p = passkey.make_prompt(src, L, depth, key, start)
            name = "passkey_L%d_%03d.txt" % (L, i)
            with open(os.path.join(a.out, name), "wb") as f:
                f.write(p)
            off = int(round(depth * free))
            assert p[off:off + passkey.NEEDLE_LEN] == passkey.needle(key)
            lines.append("%s\t%d\t%.4f\t%s\t%d" % (name, L, depth, key, off))
    with open(os.path.join(a.out, "manifest.tsv"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote %d prompts and %s" % (len(lines) - 1, os.path.join(a.out, "manifest.tsv")))


if __name__ == "__main__":
    main()
