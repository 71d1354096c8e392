#!/usr/bin/env bash
# Dense decode on the CPU, the configuration of issue 2: 131072 tokens (and 32768),
# 8 KV heads x 128 dims, 32 query heads, fp16, page 16, entmax alpha = 1.5 and softmax,
# on 1 and 2 threads. Each run reports bw_ratio against the read-bandwidth probe run in the
# same process. Writes bench/out/cpu_dense_*.json and prints a markdown table.
# Usage: bench/cpu_dense.sh [extra bench options]   (run from the repository root, after
# ./scripts/build_and_run.sh or cmake --build build)
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
bin=build/entmaxkv
[ -x "$bin" ] || { echo "build first: cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build" >&2; exit 2; }
mkdir -p bench/out
for threads in 1 2; do
  for alpha in 1.5 1; do
    out=bench/out/cpu_dense_t${threads}_a${alpha}.json
    "$bin" bench --len 32768,131072 --heads 32 --kv-heads 8 --dim 128 --dtype f16 --page 16 \
      --alpha "$alpha" --threads "$threads" --iters 30 --warmup 3 --json "$out" "$@" >&2
  done
done
python3 - <<'PY'
import glob, json
rows = []
for f in sorted(glob.glob("bench/out/cpu_dense_*.json")):
    rows += json.load(open(f))
print("| threads | alpha | len | ms median | ms min | bytes read | GB/s | probe GB/s | bw_ratio | kv_fraction |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in sorted(rows, key=lambda r: (r["threads"], -r["alpha"], r["len"])):
    print(f"| {r['threads']} | {r['alpha']:g} | {r['len']} | {r['ms_median']:.2f} | {r['ms_min']:.2f} | "
          f"{r['bytes_read']/1e6:.1f} MB | {r['gbps']:.2f} | {r['bw_probe_gbps']:.2f} | {r['bw_ratio']:.3f} | "
          f"{r['kv_fraction']:.4f} |")
PY
