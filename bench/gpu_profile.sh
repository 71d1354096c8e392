#!/usr/bin/env bash
# Per-kernel profile of one CUDA decode step on the GPU machine, with Nsight Compute:
# duration, DRAM throughput (% of peak), registers, achieved occupancy and grid size of
# every kernel of a few steps. Prints one CSV block per configuration.
# Usage: BUILD=build-gpu bench/gpu_profile.sh "LABEL|bench args" ...
# e.g.   bench/gpu_profile.sh "dense128k|--len 131072 --method dense"
# Each configuration runs H = 32, 32 KV heads, D = 128, fp16, page 16, alpha 1.5 unless its
# arguments say otherwise (later arguments win). ncu replays each kernel, so the numbers are
# per kernel, not the step's wall time (which `entmaxkv bench` measures).
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
KERNELS=${KERNELS:-12}
METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,dram__bytes_read.sum
for cfg in "$@"; do
  label=${cfg%%|*}
  args=${cfg#*|}
  echo "== $label: $args"
  # skip the warmup steps' kernels (the first step's launches), then profile KERNELS kernels
  ncu --clock-control none --metrics "$METRICS" --csv -s 10 -c "$KERNELS" \
    "$BUILD/entmaxkv" bench --backend cuda --heads 32 --kv-heads 32 --dim 128 --dtype f16 --page 16 --alpha 1.5 \
    --iters 50 --warmup 3 $args 2>/dev/null | python3 -c '
import csv, sys
rows = [r for r in csv.reader(l for l in sys.stdin if l.startswith("\""))]
if not rows: sys.exit("no ncu rows")
h = rows[0]; ik, im, iv, iu = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value"), h.index("Metric Unit")
iid = h.index("ID")
by = {}
for r in rows[1:]:
    by.setdefault((r[iid], r[ik].replace("(anonymous namespace)::", "").replace("<unnamed>::", "").replace("void ", "").split("<")[0].split("(")[0]), {})[r[im]] = r[iv] + (" " + r[iu] if r[iu] and r[iu] != "%" else "")
print("id,kernel,time,dram_pct,dram_read,regs,occ_pct,grid")
for (i, k), m in by.items():
    print(",".join([i, k, m["gpu__time_duration.sum"],
                    m["dram__throughput.avg.pct_of_peak_sustained_elapsed"], m["dram__bytes_read.sum"],
                    m["launch__registers_per_thread"], m["sm__warps_active.avg.pct_of_peak_sustained_active"],
                    m["launch__grid_size"]]))
'
done
