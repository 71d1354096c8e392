"""torch SDPA softmax decode on a ragged batch (the peer side of `bench --ragged`): B
sequences with lengths spread evenly from LO to HI (as `entmaxkv bench --batch B --len HI
--ragged LO`), H heads, D dims, fp16, one query token each. Timed two ways, the better one
is the peer's number: a loop of per-sequence SDPA calls, and one padded batch with a mask.
Writes JSON to OUT. Shapes from the environment: B, H, D, LO, HI (defaults 16, 32, 128, 8192,
65536). Usage: sdpa_ragged.py OUT.json (needs torch with CUDA)."""
import argparse
import json
import os

_ap = argparse.ArgumentParser(description=__doc__.split(" Usage:")[0])
_ap.add_argument("out", metavar="OUT.json", help="where the timings go")
ARGS = _ap.parse_args()  # before the torch import: --help works without torch

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

B = int(os.environ.get("B", 16)); H = int(os.environ.get("H", 32)); D = int(os.environ.get("D", 128))
LO = int(os.environ.get("LO", 8192)); HI = int(os.environ.get("HI", 65536))
dev = torch.device("cuda")
lens = [LO + (HI - LO) * b // (B - 1) for b in range(B)]

def bench(fn, warm=5, iters=50):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]

torch.manual_seed(0)
ks = [torch.randn(1, H, n, D, device=dev, dtype=torch.float16) for n in lens]
vs = [torch.randn(1, H, n, D, device=dev, dtype=torch.float16) for n in lens]
qs = [torch.randn(1, H, 1, D, device=dev, dtype=torch.float16) for _ in lens]
loop_ms = bench(lambda: [F.scaled_dot_product_attention(q, k, v) for q, k, v in zip(qs, ks, vs)])
kp = torch.zeros(B, H, HI, D, device=dev, dtype=torch.float16); vp = torch.zeros_like(kp)
mask = torch.zeros(B, 1, 1, HI, device=dev, dtype=torch.bool)
for b, n in enumerate(lens):
    kp[b, :, :n] = ks[b][0]; vp[b, :, :n] = vs[b][0]; mask[b, :, :, :n] = True
qp = torch.cat(qs, 0)
pad_ms = bench(lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask))
r = {"B": B, "H": H, "D": D, "lens": lens, "sdpa_loop_ms": loop_ms, "sdpa_padded_ms": pad_ms,
     "sdpa_best_ms": min(loop_ms, pad_ms), "device": torch.cuda.get_device_name(0)}
print(json.dumps(r))
json.dump(r, open(ARGS.out, "w"), indent=1)
