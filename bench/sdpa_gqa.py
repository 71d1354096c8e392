"""torch SDPA softmax decode at batch 1 over several lengths, for the shapes of our GQA rows:
H query heads on KV heads (grouped-query SDPA, enable_gqa, when KV < H), D dims, f16 and/or
bf16, one query token. One JSON array of {N, H, KV, D, dtype, sdpa_ms} to OUT.
Usage: sdpa_gqa.py OUT.json [--lens N,...] [--heads H] [--kv-heads KV,...] [--dim D]
[--dtypes f16,bf16] (needs torch with CUDA)."""
import argparse
import json

_ap = argparse.ArgumentParser(description=__doc__.split("\nUsage:")[0])
_ap.add_argument("out", metavar="OUT.json", help="where the timings go")
_ap.add_argument("--lens", default="32768,131072,524288,1048576", help="tokens, comma-separated")
_ap.add_argument("--heads", type=int, default=32, help="query heads (32)")
_ap.add_argument("--kv-heads", default="8,4", help="KV heads, comma-separated (8,4)")
_ap.add_argument("--dim", type=int, default=128, help="head dim (128)")
_ap.add_argument("--dtypes", default="f16,bf16", help="f16 and/or bf16 (both)")
ARGS = _ap.parse_args()  # before the torch import: --help works without torch

import torch  # noqa: E402
from sdpa_common import decode_qkv, sdpa, time_ms  # noqa: E402

torch.manual_seed(0)
rows = []
for dt in ARGS.dtypes.split(","):
    for kv in (int(x) for x in ARGS.kv_heads.split(",")):
        for n in (int(x) for x in ARGS.lens.split(",")):
            q, k, v = decode_qkv(n, ARGS.heads, kv, ARGS.dim, dt)
            r = {"N": n, "H": ARGS.heads, "KV": kv, "D": ARGS.dim, "dtype": dt,
                 "sdpa_ms": time_ms(lambda: sdpa(q, k, v))}
            rows.append(r)
            print(json.dumps(r), flush=True)
            del q, k, v
json.dump(rows, open(ARGS.out, "w"), indent=1)
