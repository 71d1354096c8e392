"""torch SDPA softmax decode on a ragged batch (the peer side of `bench --ragged`): B
sequences with lengths spread evenly from LO to HI (as `entmaxkv bench --batch B --len HI
--ragged LO`), H query heads on KV heads (grouped-query SDPA, enable_gqa, when KV < H), D dims,
one query token each. Timed two ways, the better one is the peer's number: a loop of
per-sequence SDPA calls, and one padded batch with a mask. Writes JSON to OUT. Shapes from the
environment: B, H, KV, D, LO, HI, DTYPE (defaults 16, 32, H, 128, 8192, 65536, f16).
Usage: sdpa_ragged.py OUT.json (needs torch with CUDA)."""
import argparse
import json
import os

_ap = argparse.ArgumentParser(description=__doc__.split(" Usage:")[0])
_ap.add_argument("out", metavar="OUT.json", help="where the timings go")
ARGS = _ap.parse_args()  # before the torch import: --help works without torch

import torch  # noqa: E402
from sdpa_common import DTYPES, decode_qkv, sdpa, time_ms  # noqa: E402

B = int(os.environ.get("B", 16)); H = int(os.environ.get("H", 32)); D = int(os.environ.get("D", 128))
KV = int(os.environ.get("KV", H)); DTYPE = os.environ.get("DTYPE", "f16")
LO = int(os.environ.get("LO", 8192)); HI = int(os.environ.get("HI", 65536))
lens = [LO + (HI - LO) * b // (B - 1) for b in range(B)]

torch.manual_seed(0)
seqs = [decode_qkv(n, H, KV, D, DTYPE) for n in lens]
loop_ms = time_ms(lambda: [sdpa(q, k, v) for q, k, v in seqs])
kp = torch.zeros(B, KV, HI, D, device="cuda", dtype=DTYPES[DTYPE]); vp = torch.zeros_like(kp)
mask = torch.zeros(B, 1, 1, HI, device="cuda", dtype=torch.bool)
for b, (n, (q, k, v)) in enumerate(zip(lens, seqs)):
    kp[b, :, :n] = k[0]; vp[b, :, :n] = v[0]; mask[b, :, :, :n] = True
qp = torch.cat([q for q, _, _ in seqs], 0)
pad_ms = time_ms(lambda: sdpa(qp, kp, vp, mask))
r = {"B": B, "H": H, "KV": KV, "D": D, "dtype": DTYPE, "lens": lens, "sdpa_loop_ms": loop_ms,
     "sdpa_padded_ms": pad_ms, "sdpa_best_ms": min(loop_ms, pad_ms),
     "device": torch.cuda.get_device_name(0)}
print(json.dumps(r))
json.dump(r, open(ARGS.out, "w"), indent=1)
