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

With --needles N (2..8) each prompt holds N named keys ("The pass key of NAME is K. ...")
at spread depths and asks for one ("What is the pass key of NAME? The pass key of NAME is "):
depth and needle_offset are the asked needle's, the others sit at random depths. Needles that
occur in the filler are refused (they must be new to it).

Usage: python3 train/make_passkey.py [--lengths 8192,32768,65536] [--count 20]
           [--val data/val.txt] [--out data/passkey] [--seed 0] [--needles 1]
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
    ap.add_argument("--needles", type=int, default=1,
                    help="keys per prompt: 1 = the trained format, 2..8 = named keys")
    a = ap.parse_args()
    if not 1 <= a.needles <= 8:
        ap.error("--needles %d: expected 1..8" % a.needles)
    return a


# --help answers here, before the imports that need numpy or torch
ARGS = parse_args() if __name__ == "__main__" else None

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import passkey  # noqa: E402


def one_prompt(src, L, depth, rng, needles):
    """(prompt, answer, needle offset) with the asked needle at depth."""
    if needles == 1:  # key, then start: the draws of the prompts earlier sessions measured
        key = passkey.random_key(rng)
        start = int(rng.integers(0, len(src)))
        p = passkey.make_prompt(src, L, depth, key, start)
        off = int(round(depth * (L - passkey.NEEDLE_LEN - len(passkey.QUESTION))))
        assert p[off:off + passkey.NEEDLE_LEN] == passkey.needle(key)
        return p, key, off
    start = int(rng.integers(0, len(src)))
    names = passkey.NAMES[:needles]
    keys = [passkey.random_key(rng) for _ in names]
    asked = int(rng.integers(0, needles))
    depths = [float(rng.random()) for _ in names]
    depths[asked] = depth
    p, offs = passkey.make_multi_prompt(src, L, depths, names, keys, asked, start)
    return p, keys[asked], offs[asked]


def main():
    a = ARGS
    with open(a.val, "rb") as f:
        data = f.read()
    for probe in (b"The pass key", b"pass key of"):  # needles must be new to the filler
        if probe in data:
            raise SystemExit("make_passkey: %r occurs in %s: needles must not" % (probe, a.val))
    src = np.frombuffer(data, dtype=np.uint8)
    os.makedirs(a.out, exist_ok=True)
    lines = ["file\tlength\tdepth\tanswer\tneedle_offset"]
    tag = "passkey" if a.needles == 1 else "passkey%d" % a.needles
    for L in (int(v) for v in a.lengths.split(",") if v):
        rng = np.random.default_rng([a.seed, L, a.needles])
        if a.needles == 1:
            rng = np.random.default_rng([a.seed, L])  # the prompts earlier sessions measured
        for i in range(a.count):
            depth = (i + 0.5) / a.count
            p, key, off = one_prompt(src, L, depth, rng, a.needles)
            name = "%s_L%d_%03d.txt" % (tag, L, i)
            with open(os.path.join(a.out, name), "wb") as f:
                f.write(p)
            lines.append("%s\t%d\t%.4f\t%s\t%d" % (name, L, depth, key, off))
    with open(os.path.join(a.out, "manifest.tsv"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote %d prompts and %s" % (len(lines) - 1, os.path.join(a.out, "manifest.tsv")))


if __name__ == "__main__":
    main()
