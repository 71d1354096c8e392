"""Greedy text from the shipped entmax model through transformers, decoding through entmaxkv.

    pip install . torch transformers safetensors
    python examples/python/hf_generate.py [--method certified] [--device cuda]

The model (entmaxkv.hf_lm, models/entmaxkv-lm.safetensors) runs with
attn_implementation="entmaxkv": generate() fills an EntmaxKVCache, and every decode step's
attention is a DecodeWrapper step over it. The text equals the dense forward's (printed
beside it); the support and the share of K/V bytes each step read come from the reports.
"""
import argparse
import pathlib

import torch

from entmaxkv.hf import EntmaxKVCache
from entmaxkv.hf_lm import EntmaxKVLM

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--method", default="certified", help="dense, certified, screened, topk, gaussian")
ap.add_argument("--device", default="cpu")
args = ap.parse_args()
path = pathlib.Path(__file__).resolve().parents[2] / "models" / "entmaxkv-lm.safetensors"
prompt = b"\nThe pass key is 40712. Remember it. 40712 is the pass key.\n" + b"In the beginning " * 40
prompt += b"\nWhat is the pass key? The pass key is "
ids = torch.tensor([list(prompt)], device=args.device)

with torch.no_grad():
    dense = EntmaxKVLM.from_safetensors(path).to(args.device)  # attention: dense entmax
    want = dense.generate(ids, max_new_tokens=24, do_sample=False)
    model = EntmaxKVLM.from_safetensors(path, attn_implementation="entmaxkv").to(args.device)
    cache = EntmaxKVCache(model.config.n_layers, num_pages=128, method=args.method)
    got = model.generate(ids, cache=cache, max_new_tokens=24, do_sample=False)

print("dense   :", bytes(want[0, len(prompt):].tolist()))
print(f"{args.method:8s}:", bytes(got[0, len(prompt):].tolist()))
last = cache.reports[-1]  # the last layer's last step
frac = last.get("kv_fraction")  # the CPU report has it (docs/python.md)
print("last layer, last step: support per head", last["support"][0].tolist(), "of",
      cache.get_seq_length(), "tokens" + ("" if frac is None else f"; read {frac:.0%} of K/V"))
