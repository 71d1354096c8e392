#!/usr/bin/env python3
"""Plot `entmaxkv eval --json` rows: dropped mass (delta) and support recall against the KV
fraction read, one line per method. Usage: plot_eval.py EVAL.json OUT.png (needs matplotlib)."""
import argparse
import json


def main():
    ap = argparse.ArgumentParser(description=__doc__.split(" Usage:")[0])
    ap.add_argument("eval_json", metavar="EVAL.json", help="rows of `entmaxkv eval --json`")
    ap.add_argument("out", metavar="OUT.png", help="the plot to write")
    args = ap.parse_args()
    import matplotlib  # here, so that --help works without matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.load(open(args.eval_json))
    methods = sorted({r["method"] for r in rows})
    fig, (ax_d, ax_r) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in methods:
        pts = sorted((r["kv_fraction"], r["delta_mean"], r["recall_mean"]) for r in rows if r["method"] == m)
        xs = [p[0] for p in pts]
        style = dict(marker="o", linestyle="-" if len(pts) > 1 else "none", label=m)
        ax_d.plot(xs, [max(p[1], 1e-9) for p in pts], **style)
        ax_r.plot(xs, [p[2] for p in pts], **style)
    r0 = rows[0]
    title = f"{r0.get('workload', '?')}, N={r0.get('len', '?')}, alpha={r0.get('alpha', '?')}"
    ax_d.set(xscale="log", yscale="log", xlabel="KV fraction read", ylabel="dropped mass delta (mean)", title=title)
    ax_r.set(xscale="log", xlabel="KV fraction read", ylabel="support recall (mean)", ylim=(0, 1.02), title=title)
    for ax in (ax_d, ax_r):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
