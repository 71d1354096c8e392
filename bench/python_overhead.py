"""Per-step overhead of the Python layer (entmaxkv.DecodeWrapper.run) over the bare C call.

Times run() on a tiny cache (one 16-token sequence, one head, D 64: the C work is negligible)
against the same ekv_decode call made straight through ctypes with the same arguments, and
prints both and their difference in microseconds. Needs the package (pip install .) or
$ENTMAXKV_LIBRARY with python/ on the path.

usage: python3 bench/python_overhead.py [--steps N]
"""
import argparse
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5000, help="timed steps (5000)")
    args = ap.parse_args()
    import numpy as np

    import entmaxkv
    from entmaxkv import _lib

    cache = entmaxkv.PagedKVCache(num_pages=8, page_size=16, num_kv_heads=1, head_dim=64)
    seq = cache.new_sequence()
    cache.append(seq, np.ones((16, 1, 64), np.float32), np.ones((16, 1, 64), np.float32))
    w = entmaxkv.DecodeWrapper("dense")
    w.plan(cache, [seq], 1)
    q = np.ones((1, 1, 64), np.float32)
    out = np.empty_like(q)
    for _ in range(200):
        w.run(q, out=out)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        w.run(q, out=out)
    run_us = (time.perf_counter() - t0) / args.steps * 1e6
    call = (_lib.context(), *w._plan["args"], q.ctypes.data, out.ctypes.data, None)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        _lib.lib.ekv_decode(*call)
    c_us = (time.perf_counter() - t0) / args.steps * 1e6
    print(f"DecodeWrapper.run: {run_us:.1f} us per step; the bare ekv_decode through ctypes: "
          f"{c_us:.1f} us; the Python layer: {run_us - c_us:.1f} us")


if __name__ == "__main__":
    main()
