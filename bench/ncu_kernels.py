#!/usr/bin/env python3
"""Kernel times from an ncu CSV (`ncu --metrics gpu__time_duration.sum --csv`), as the TSV rows
of bench/real_attention.sh.

Usage: ncu_kernels.py CSV PART CTX LAYER METHOD [--last-step KERNEL]
  every kernel name's mean ms over the run and its launches (a trace bench's steps), or with
  --last-step the kernels from the last launch of KERNEL on (a model decode step begins with
  its block tables' kernel): each name's total ms in that step and its launches, then the step's
  sum ("METHOD/all kernels"). ncu serialises the kernels and flushes the caches before each, so
  a step's sum is an upper bound of its kernels' share, without the gaps between them.
"""
import collections
import csv
import sys

TO_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}


def kernel_times(path):
    """[(kernel name, ms)] in launch order."""
    rows = [r for r in csv.reader(l for l in open(path) if l.startswith('"'))]
    if not rows:
        return []
    h = rows[0]
    ik, im, iv, iu = (h.index(k) for k in ("Kernel Name", "Metric Name", "Metric Value", "Metric Unit"))
    out = []
    for r in rows[1:]:
        if r[im] == "gpu__time_duration.sum":
            name = r[ik].split("(")[0].replace("void ", "").replace("<unnamed>::", "")
            out.append((name, float(r[iv].replace(",", "")) * TO_MS[r[iu]]))
    return out


def main(argv):
    if len(argv) == 2 and argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    if len(argv) not in (6, 8) or (len(argv) == 8 and argv[6] != "--last-step"):
        sys.exit(__doc__)
    path, part, ctx, layer, method = argv[1:6]
    times = kernel_times(path)
    if len(argv) == 8:
        starts = [i for i, (n, _) in enumerate(times) if n.startswith(argv[7])]
        if not starts:
            sys.exit("ncu_kernels.py: no launch of %s in %s" % (argv[7], path))
        times = times[starts[-1]:]
    ms = collections.OrderedDict()
    for name, t in times:
        ms.setdefault(name, []).append(t)
    for name, v in ms.items():
        value = sum(v) if len(argv) == 8 else sum(v) / len(v)
        print("%s\tnew\t%s\t%s\t%s/%s\t%.4f\t-\t%d" % (part, ctx, layer, method, name, value, len(v)))
    if len(argv) == 8:
        print("%s\tnew\t%s\t%s\t%s/all kernels\t%.4f\t-\t%d" % (part, ctx, layer, method,
              sum(t for _, t in times), len(times)))


if __name__ == "__main__":
    main(sys.argv)
