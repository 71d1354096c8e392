"""Causal prefill attention side by side on one GPU (issue 30): ours (entmaxkv.flash_entmax on
CUDA: exact entmax, ekv_cuda_flash_entmax_*), AdaSplash-2 (adasplash.adasplash_v2: entmax-1.5,
causal, Triton; not exact) and torch SDPA softmax on the flash backend, per attention shape:
lengths N, head dims D, query/KV heads H/KV, fp16/bf16, forward and forward+backward.
Per row: median milliseconds (CUDA events), TFLOP/s of useful causal FLOPs (4 B H D N^2 / 2 for
the forward, x3.5 with the backward: 2.5 for it), and the forward's max |out - exact| on the last
64 query rows against the float64 CPU reference (entmaxkv's, docs/math.md §13: entmax alpha for
ours and AdaSplash, softmax for SDPA), on the same 16-bit inputs. A peer that is missing or
fails is a row that says why. Markdown table on stdout; --json PATH for the rows.
Not in CI: needs torch with CUDA, entmaxkv built with the CUDA backend (pip install . with nvcc,
or $ENTMAXKV_LIBRARY), adasplash 0.2.2 (its wheel) for that peer. On a machine whose Triton cache
is empty, AdaSplash-2's first rows compile its kernels first (an 8K, D 64 call of the three
peers passed 100 s on a fresh H100, and took 44 s right after): leave a time limit around this
script room for that, or run --peers adasplash-2 once before.
Usage: prefill_side_by_side.py [--lens 8192,32768] [--dims 64,128] [--heads 6/2,32/8]
[--dtypes f16,bf16] [--passes fwd,fwdbwd] [--alpha 1.5] [--iters 5] [--scheme cand,hist]
[--peers ours,adasplash-2,sdpa-flash] [--quick] [--json PATH]"""
import argparse
import json

_ap = argparse.ArgumentParser(description=__doc__.split("\nUsage:")[0])
_ap.add_argument("--lens", default="8192,32768", help="sequence lengths N, comma-separated")
_ap.add_argument("--dims", default="64,128", help="head dims D (64,128)")
_ap.add_argument("--heads", default="6/2,32/8", help="query/KV heads, comma-separated (6/2,32/8)")
_ap.add_argument("--dtypes", default="f16,bf16", help="f16 and/or bf16 (both)")
_ap.add_argument("--passes", default="fwd,fwdbwd", help="fwd and/or fwdbwd (both)")
_ap.add_argument("--alpha", type=float, default=1.5, help="entmax alpha of ours (AdaSplash-2: 1.5)")
_ap.add_argument("--iters", type=int, default=5, help="timed calls per row (median)")
_ap.add_argument("--rows", type=int, default=64, help="last query rows checked against float64")
_ap.add_argument("--scheme", default="hist",
                 help="tau schemes of ours, comma-separated: cand (candidate lists), hist "
                      "(histogram pass, exact-size lists; docs/math.md §12.1; the op's default); "
                      "one row each, named ours-SCHEME")
PEERS = ("ours", "adasplash-2", "sdpa-flash")  # the names peers() gives its rows (ours: each scheme)
_ap.add_argument("--peers", default=",".join(PEERS),
                 help="which peers run, comma-separated (ours = every --scheme row), so that each "
                      "can run in a call (and a time limit) of its own")
_ap.add_argument("--quick", action="store_true", help="smoke run: 8192, D 64, 6/2, bf16")
_ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
ARGS = _ap.parse_args()  # before the torch import: --help works without torch
_bad = set(ARGS.peers.split(",")) - set(PEERS)
if _bad:
    _ap.error(f"--peers: unknown {', '.join(sorted(_bad))} (known: {', '.join(PEERS)})")
if ARGS.quick:
    ARGS.lens, ARGS.dims, ARGS.heads, ARGS.dtypes = "8192", "64", "6/2", "bf16"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from sdpa_common import DTYPES, time_ms  # noqa: E402  (bench/: the timing loop the peers share)


# A peer's factory returns (fn, heads_first): fn(q, k, v) -> out, on [1, N, H, D] tensors (ours)
# or, heads_first, on [1, H, N, D] ones (AdaSplash, SDPA).
def ours(alpha, scheme):
    from entmaxkv import flash_cuda
    from entmaxkv.flash import flash_entmax

    def run(q, k, v):
        flash_cuda.tau_scheme = flash_cuda.TAU_SCHEMES[scheme]  # read by each forward call
        return flash_entmax(q, k, v, alpha, True)

    return run, False


def adasplash2():
    from adasplash import adasplash_v2

    def run(q, k, v):  # [B, H, N, D]: the copies into that layout are made outside the timing
        return adasplash_v2(q, k, v, niter=1)

    return run, True


def sdpa_flash():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            if k.shape[1] == q.shape[1]:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            except RuntimeError:  # a torch whose flash backend has no GQA: K, V repeated
                G = q.shape[1] // k.shape[1]  # (the copies are timed too: small beside N^2)
                return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1),
                                                      v.repeat_interleave(G, 1), is_causal=True)

    return run, True


def peers(alpha):
    """(name, reference alpha, factory) of each peer; a factory returns (fn, heads_first)."""
    chosen = ARGS.peers.split(",")
    ours_rows = [(f"ours-{s}", alpha, lambda s=s: ours(alpha, s))
                 for s in ARGS.scheme.split(",") if "ours" in chosen]
    return ours_rows + [row for row in (("adasplash-2", 1.5, adasplash2),
                                        ("sdpa-flash", 1.0, sdpa_flash)) if row[0] in chosen]


def exact_last_rows(q, k, v, alpha, rows):
    """The float64 CPU reference of the last `rows` query rows ([1, rows, H, D])."""
    from entmaxkv.flash import flash_entmax

    qd, kd, vd = (t.detach().cpu().double() for t in (q[:, -rows:], k, v))
    return flash_entmax(qd, kd, vd, alpha, True)


def measure(factory, q, k, v, npass, ref):
    """One row's timing and error; raises when the peer cannot run."""
    fn, heads_first = factory()
    args = [t.transpose(1, 2).contiguous() if heads_first else t for t in (q, k, v)]
    if npass == "fwd":
        with torch.no_grad():
            out = fn(*args)
            ms = time_ms(lambda: fn(*args), warm=1, iters=ARGS.iters)
        if heads_first:
            out = out.transpose(1, 2)
        err = (out[:, -ref.shape[1]:].double().cpu() - ref).abs().max().item()
        return ms, err
    grads = [t.detach().requires_grad_(True) for t in args]
    g = torch.randn_like(args[0])

    def step():
        torch.autograd.grad(fn(*grads), grads, g)

    return time_ms(step, warm=1, iters=ARGS.iters), None


def shape_rows(n, h, kv, d, dt):
    """Every peer and pass of one shape."""
    gen = torch.Generator(device="cuda").manual_seed(n + 7 * h + d)
    q, k, v = (torch.randn(1, n, x, d, device="cuda", dtype=DTYPES[dt], generator=gen)
               for x in (h, kv, kv))
    refs, rows = {}, []
    flops = 4.0 * h * d * n * n / 2
    for name, ref_alpha, factory in peers(ARGS.alpha):
        for npass in ARGS.passes.split(","):
            row = {"N": n, "H": h, "KV": kv, "D": d, "dtype": dt, "pass": npass, "peer": name,
                   "ms": None, "tflops": None, "max_err": None, "ref_alpha": ref_alpha, "note": ""}
            try:
                if npass == "fwd" and ref_alpha not in refs:
                    refs[ref_alpha] = exact_last_rows(q, k, v, ref_alpha, ARGS.rows)
                ms, err = measure(factory, q, k, v, npass, refs.get(ref_alpha))
                work = flops * (1.0 if npass == "fwd" else 3.5)
                row.update(ms=round(ms, 3), tflops=round(work / ms / 1e9, 1), max_err=err)
            except Exception as e:  # a missing or failing peer is a row that says so
                row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return rows


def table(rows):
    out = ["| N | H/KV | D | dtype | pass | peer | ms | TFLOP/s | max err (vs exact, alpha) | note |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = "" if r["max_err"] is None else f"{r['max_err']:.1e} ({r['ref_alpha']:g})"
        out.append(f"| {r['N']} | {r['H']}/{r['KV']} | {r['D']} | {r['dtype']} | {r['pass']} | "
                   f"{r['peer']} | {'' if r['ms'] is None else r['ms']} | "
                   f"{'' if r['tflops'] is None else r['tflops']} | {err} | {r['note']} |")
    return "\n".join(out)


def main():
    rows = []
    for dt in ARGS.dtypes.split(","):
        for hk in ARGS.heads.split(","):
            h, kv = (int(x) for x in hk.split("/"))
            for d in (int(x) for x in ARGS.dims.split(",")):
                for n in (int(x) for x in ARGS.lens.split(",")):
                    rows += shape_rows(n, h, kv, d, dt)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, alpha {ARGS.alpha}\n")
    print(table(rows))
    if ARGS.json:
        json.dump(rows, open(ARGS.json, "w"), indent=1)


if __name__ == "__main__":
    main()
