"""Per-step overhead of the Python layer (entmaxkv.DecodeWrapper.run) over the bare C call.

CPU (default): times run() on a tiny cache (one 16-token sequence, one head, D 64: the C work
is negligible) against the same ekv_decode call made straight through ctypes with the same
arguments, and prints both and their difference in microseconds.

--cuda: the same over a CudaPagedKVCache with torch CUDA tensors, three ways: run() eagerly
(graphs off), the bare ekv_cuda_decode through ctypes, and one step captured in a CUDA graph
and replayed (graphs on: no Python per step). Each is timed over --steps launches followed
by one synchronisation, so the numbers are host time per step (launch-bound at this size).

--cuda --context N: one sequence of N random tokens at the issue's shape (H 32, KV 8, D 128,
f16, page 16) and --method's step (default dense), run() against the bare call: the median
of per-step CUDA-event times and the wall time per step of --steps back-to-back steps, to set
beside `entmaxkv bench --backend cuda --len N` (the C bench) run on the same machine.

Needs the package (pip install .) or $ENTMAXKV_LIBRARY with python/ on the path.

usage: python3 bench/python_overhead.py [--steps N] [--cuda [--context N] [--method M]]
"""
import argparse
import time


def timed(fn, steps, sync=lambda: None):
    for _ in range(200):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / steps * 1e6


def cpu(steps):
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
    run_us = timed(lambda: w.run(q, out=out), steps)
    call = (_lib.context().ptr, *w._plan["args"], q.ctypes.data, out.ctypes.data, None)
    c_us = timed(lambda: _lib.lib.ekv_decode(*call), steps)
    print(f"DecodeWrapper.run: {run_us:.1f} us per step; the bare ekv_decode through ctypes: "
          f"{c_us:.1f} us; the Python layer: {run_us - c_us:.1f} us")


def cuda(steps):
    import torch

    import entmaxkv
    from entmaxkv import _lib

    dev = torch.device("cuda", torch.cuda.current_device())
    cache = entmaxkv.CudaPagedKVCache(num_pages=8, page_size=16, num_kv_heads=1, head_dim=64)
    seq = cache.new_sequence()
    cache.append(seq, torch.ones(16, 1, 64, device=dev), torch.ones(16, 1, 64, device=dev))
    stream = torch.cuda.Stream()
    q = torch.ones(1, 1, 64, device=dev)
    out = torch.empty_like(q)
    w = entmaxkv.DecodeWrapper("dense")
    stream.wait_stream(torch.cuda.current_stream())  # the append ran on the default stream
    with torch.cuda.stream(stream):
        w.plan(cache, [seq], 1)
        run_us = timed(lambda: w.run(q, out), steps, stream.synchronize)
        st = w._cuda
        call = (st.plan, *st.args, q.data_ptr(), out.data_ptr())
        st._ctx.call(st.decode, *call)  # the bare call works before it is timed
        c_us = timed(lambda: st.decode(*call), steps, stream.synchronize)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        w.run(q, out)
    with torch.cuda.stream(stream):
        g_us = timed(graph.replay, steps, stream.synchronize)
    print(f"CUDA, graphs off: DecodeWrapper.run {run_us:.1f} us per step; the bare "
          f"ekv_cuda_decode through ctypes {c_us:.1f} us; the Python layer {run_us - c_us:.1f} us")
    print(f"CUDA, graphs on: one captured step replayed {g_us:.1f} us per step")


def cuda_context(steps, n, method):
    import torch

    import entmaxkv

    dev = torch.device("cuda", torch.cuda.current_device())
    H, Hk, D, ps = 32, 8, 128, 16
    pages = (n + ps - 1) // ps
    cache = entmaxkv.CudaPagedKVCache(num_pages=pages, page_size=ps, num_kv_heads=Hk, head_dim=D,
                                      code_bits=4 if method == "screened" else 0)
    seq = cache.new_sequence()
    g = torch.Generator(device=dev).manual_seed(1)
    chunk = 1 << 16
    for t0 in range(0, n, chunk):  # the append's staging stays small
        m = min(chunk, n - t0)
        cache.append(seq, torch.randn(m, Hk, D, device=dev, generator=g),
                     torch.randn(m, Hk, D, device=dev, generator=g))
    q = torch.randn(1, H, D, device=dev, generator=g)
    out = torch.empty_like(q)
    w = entmaxkv.DecodeWrapper(method)
    w.plan(cache, [seq], H)
    st = w._cuda
    call = (st.plan, *st.args, q.data_ptr(), out.data_ptr())

    def event_median(fn, reps=200):
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return sorted(times)[len(times) // 2]

    sync = torch.cuda.current_stream().synchronize
    run = lambda: w.run(q, out)
    bare = lambda: st.decode(*call)
    ev_run, ev_bare = event_median(run), event_median(bare)
    wall_run, wall_bare = timed(run, steps, sync), timed(bare, steps, sync)
    print(f"CUDA B=1 at {n} tokens (H {H}, KV {Hk}, D {D}, f16, {method}): DecodeWrapper.run "
          f"median {ev_run:.1f} us per step (events), {wall_run:.1f} us wall per step back to "
          f"back; the bare ekv_cuda_decode {ev_bare:.1f} us (events), {wall_bare:.1f} us wall: "
          f"run() is {100 * (wall_run / wall_bare - 1):+.1f} % (wall), "
          f"{100 * (ev_run / ev_bare - 1):+.1f} % (events)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5000, help="timed steps (5000)")
    ap.add_argument("--cuda", action="store_true", help="the CUDA path, graphs off and on")
    ap.add_argument("--context", type=int, default=0,
                    help="with --cuda: one sequence of N tokens at H 32 / KV 8 / D 128 instead")
    ap.add_argument("--method", default="dense", help="with --context: the method (dense)")
    args = ap.parse_args()
    if args.context < 0 or (args.context and not args.cuda):
        ap.error("--context N needs --cuda and N >= 1")
    if args.context:
        cuda_context(args.steps, args.context, args.method)
    else:
        (cuda if args.cuda else cpu)(args.steps)


if __name__ == "__main__":
    main()
