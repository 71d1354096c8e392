"""What the SDPA peer scripts share (bench/sdpa_ragged.py, bench/sdpa_gqa.py): the timing loop
and the decode inputs (bench/prefill_side_by_side.py takes the timing loop too). A module they
import, not a script to run.
Usage: from sdpa_common import time_ms, decode_qkv, sdpa (needs torch with CUDA)."""
import argparse

if __name__ == "__main__":  # --help works without torch; anything else says what this is
    argparse.ArgumentParser(description=__doc__.split("\nUsage:")[0]).parse_args()
    raise SystemExit("sdpa_common.py is imported by bench/sdpa_ragged.py and bench/sdpa_gqa.py")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def time_ms(fn, warm=5, iters=50):
    """Median milliseconds of fn over iters CUDA-event-timed calls, after warm untimed ones."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def decode_qkv(n, heads, kv_heads, dim, dtype):
    """One decode step's q [1, H, 1, D] and K, V [1, KV, n, D] on the GPU."""
    dev, dt = torch.device("cuda"), DTYPES[dtype]
    q = torch.randn(1, heads, 1, dim, device=dev, dtype=dt)
    k = torch.randn(1, kv_heads, n, dim, device=dev, dtype=dt)
    v = torch.randn(1, kv_heads, n, dim, device=dev, dtype=dt)
    return q, k, v


def sdpa(q, k, v, mask=None):
    """Softmax attention; grouped-query (enable_gqa) when K has fewer heads than q."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
