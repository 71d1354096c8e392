#!/usr/bin/env python3
"""Reference logits for the C engine's forward-pass test (train/MODEL.md).

Loads the shipped fp16 safetensors, upcasts every tensor to fp32, runs the PyTorch forward
of train/model.py in fp32 (no autocast, no TF32) on the bytes of the prompt file and writes
the logits at every position:

    tests/data/model_ref_logits.bin: T x 256 little-endian float32, row-major, row i = the
    logits after reading prompt bytes 0..i (T = byte length of the prompt file).

Runs on the CPU by default (--device cuda also works). Uses the `entmax` package's entmax15
when it is importable, else an exact sort-based 1.5-entmax written here (same algorithm).

Usage: python3 train/make_ref_logits.py [--model models/entmaxkv-lm.safetensors]
           [--prompt tests/data/model_ref_prompt.txt] [--out tests/data/model_ref_logits.bin]
"""
import argparse
import os
import sys

def parse_args():
    ap = argparse.ArgumentParser(description="reference logits for the C forward test")
    ap.add_argument("--model", default="models/entmaxkv-lm.safetensors")
    ap.add_argument("--prompt", default="tests/data/model_ref_prompt.txt")
    ap.add_argument("--out", default="tests/data/model_ref_logits.bin")
    ap.add_argument("--device", default="cpu")
    return ap.parse_args()


# --help answers here, before the imports that need numpy or torch
ARGS = parse_args() if __name__ == "__main__" else None

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import Config, LM  # noqa: E402
import st_io  # noqa: E402


def entmax15_exact(z):
    """1.5-entmax over the last dim (the convention of docs/math.md §0), exact by sorting; -inf entries get 0."""
    x = (z - z.max(dim=-1, keepdim=True).values) / 2
    xs, _ = torch.sort(x, dim=-1, descending=True)
    finite = torch.isfinite(xs)
    xs0 = torch.where(finite, xs, torch.zeros_like(xs))
    rho = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    mean = xs0.cumsum(-1) / rho
    mean_sq = (xs0 * xs0).cumsum(-1) / rho
    delta = (1 - rho * (mean_sq - mean * mean)) / rho
    tau = mean - torch.sqrt(torch.clamp(delta, min=0))
    support = ((tau <= xs0) & finite).sum(-1, keepdim=True)
    tau_star = tau.gather(-1, support - 1)
    return torch.clamp(x - tau_star, min=0) ** 2


def load_model(path, device):
    w, md = st_io.read(path)
    c = Config.from_metadata(md)
    try:
        from entmax import entmax15
        fn, which = (lambda z: entmax15(z, dim=-1)), "entmax.entmax15"
    except ImportError:
        fn, which = entmax15_exact, "entmax15_exact (local)"
    model = LM(c, entmax_fn=fn)
    sd = {k: torch.from_numpy(v.astype(np.float32)) for k, v in w.items()}
    model.load_state_dict(sd, strict=True)
    return model.to(device).eval(), c, which


def main():
    a = ARGS
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    device = torch.device(a.device)
    model, c, which = load_model(a.model, device)
    with open(a.prompt, "rb") as f:
        prompt = f.read()
    x = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
    with torch.no_grad():
        logits = model(x)[0].float().cpu().numpy()
    assert logits.shape == (len(prompt), c.vocab) and np.all(np.isfinite(logits))
    logits.astype("<f4").tofile(a.out)
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    nll = -lp[np.arange(len(prompt) - 1), np.frombuffer(prompt[1:], dtype=np.uint8)].mean()
    print("wrote %s: %d x %d float32 (entmax: %s, device %s); prompt NLL %.4f nats/byte; "
          "argmax of the last row %d (%r)" % (a.out, logits.shape[0], logits.shape[1], which, a.device,
                                              nll, int(logits[-1].argmax()), chr(int(logits[-1].argmax()))))


if __name__ == "__main__":
    main()
