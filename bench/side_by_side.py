"""Prints one side-by-side table from the JSON written by bench/gpu_side_by_side.sh: our
CUDA bench rows (ours_*.json), the peers (peer_h32.json, peer_h8.json from the peer script,
peer_gpu.py, which is not part of this repository: see bench/gpu_side_by_side.sh), the
ragged SDPA runs (sdpa_ragged.py) and grouped-query SDPA at batch 1 (sdpa_gqa.py).
Usage: side_by_side.py OUTDIR [RAGGED_JSON]"""
import argparse
import json
import os

_ap = argparse.ArgumentParser(description=__doc__.split("\nUsage:")[0])
_ap.add_argument("outdir", metavar="OUTDIR", help="the directory bench/gpu_side_by_side.sh wrote")
_ap.add_argument("ragged", metavar="RAGGED_JSON", nargs="?", help="the JSON of bench/sdpa_ragged.py")
ARGS = _ap.parse_args()
d = ARGS.outdir
def load(name):
    p = os.path.join(d, name)
    if not os.path.exists(p): return None
    with open(p) as f: return json.load(f)
def ours(name):
    rows = load(f"ours_{name}.json") or []
    return {r["len"]: r for r in rows}
def best(r):  # eager or graph replay, whichever is faster
    if not r: return None
    g = r.get("ms_graph_median") or 0
    return min(r["ms_median"], g) if g > 0 else r["ms_median"]
def f(x, w=7, p=3): return f"{x:{w}.{p}f}" if x is not None else " " * (w - 4) + "  --"
def ratio(a, b): return a / b if a is not None and b else None

for H, D, tag in ((32, 128, "h32"), (8, 64, "h8")):
    peer = load(f"peer_h{H}.json")
    prow = {r["N"]: r for r in (peer or {}).get("rows", [])}
    dense, topk16, cert = ours(f"{tag}_dense"), ours(f"{tag}_topk16"), ours(f"{tag}_cert")
    topk64, soft, gauss = ours(f"{tag}_topk64"), ours(f"{tag}_softmax"), ours(f"{tag}_gauss")
    if not dense: continue
    print(f"\nH={H} KV heads={H} D={D} fp16 page 16 alpha 1.5, B=1, ms (best of eager / graph replay); "
          f"copy bw {dense[min(dense)]['copy_bw_gbps']:.0f} GB/s")
    print(f"{'N':>8} {'sdpa':>7} {'softmx':>7} {'dense':>7} {'d/sdpa':>7} {'top16':>7} {'sdpa/t':>7} {'top64':>7} "
          f"{'gauss':>7} {'cert':>7} {'ref_full':>8} {'ref_t16':>7} {'ref_t64':>7} {'ref_gs':>7} {'roof_d':>6} {'roof_t':>6}")
    for N in sorted(dense):
        p = prow.get(N, {})
        sd = p.get("sdpa_softmax_ms")
        dm, tm = best(dense.get(N)), best(topk16.get(N))
        print(f"{N:>8} {f(sd)} {f(best(soft.get(N)))} {f(dm)} {f(ratio(dm, sd), 7, 2)} {f(tm)} {f(ratio(sd, tm), 7, 2)} "
              f"{f(best(topk64.get(N)))} {f(best(gauss.get(N)))} {f(best(cert.get(N)))} {f(p.get('ref_entmax_full_ms'), 8)} "
              f"{f(p.get('ref_entmax_topk16_ms'))} {f(p.get('ref_entmax_topk64_ms'))} {f(p.get('ref_entmax_gaussian_ms'))} "
              f"{f(dense[N]['roofline_ratio'], 6, 2)} {f(topk16[N]['roofline_ratio'] if N in topk16 else None, 6, 2)}")
sgqa = {(r["KV"], r["dtype"], r["N"]): r["sdpa_ms"] for r in load("sdpa_gqa.json") or []}
for kv, dt, tag in ((8, "f16", "h32g4"), (8, "bf16", "h32g4bf"), (4, "f16", "h32g8")):
    gd, gt = ours(f"{tag}_dense"), ours(f"{tag}_topk16")
    if not gd: continue
    print(f"\nH=32 KV heads={kv} (GQA {32 // kv}) D=128 {dt}, B=1: ms (roofline ratio); SDPA with enable_gqa")
    print(f"{'N':>8} {'sdpa':>7} {'dense':>7} {'roof':>6} {'d/sdpa':>7} {'top16':>7} {'roof':>6} {'sdpa/t':>7}")
    for N in sorted(gd):
        sd, dm, tm = sgqa.get((kv, dt, N)), best(gd[N]), best(gt.get(N))
        print(f"{N:>8} {f(sd)} {f(dm)} {f(gd[N]['roofline_ratio'], 6, 2)} {f(ratio(dm, sd), 7, 2)} {f(tm)} "
              f"{f(gt[N]['roofline_ratio'] if N in gt else None, 6, 2)} {f(ratio(sd, tm), 7, 2)}")
def ragged_line(label, rag, rd, rs, rt):
    """One ragged batch: SDPA (the better of its loop and padded runs) beside our rows."""
    if not rd: return
    r = next(iter(rd.values()))
    sd = rag["sdpa_best_ms"] if rag else None
    print(f"\nragged {label} B={r['batch']} lengths {r['ragged_min']}..{r['len']} ({r['total_tokens']} tokens), "
          f"H=32 KV={r['kv_heads']} D=128 {r['dtype']}:")
    print(f"  sdpa {f(sd)} (loop {f(rag and rag['sdpa_loop_ms'])}, padded {f(rag and rag['sdpa_padded_ms'])})  "
          f"ours dense entmax {f(best(r))} -> {f(ratio(sd, best(r)), 5, 2)}x SDPA throughput; "
          f"softmax {f(best(next(iter(rs.values()), None)))}; topk16 {f(best(next(iter(rt.values()), None)))}")
rag = load(ARGS.ragged) if ARGS.ragged and os.path.exists(ARGS.ragged) else None
ragged_line("MHA", rag, ours("ragged_dense"), ours("ragged_softmax"), ours("ragged_topk16"))
ragged_line("GQA 4", load("ragged_g4_sdpa.json"), ours("ragged_g4_dense"), ours("ragged_g4_softmax"),
            ours("ragged_g4_topk16"))
ragged_line("GQA 4", load("ragged_g4bf_sdpa.json"), ours("ragged_g4bf_dense"),
            ours("ragged_g4bf_softmax"), ours("ragged_g4bf_topk16"))
