#!/usr/bin/env bash
# One invocation on the GPU machine: our CUDA bench and the peers (torch SDPA softmax and the
# paper's reference, through peer_gpu.py, a peer script kept outside this repository) over
# the same shapes, then one side-by-side table (bench/side_by_side.py). Needs a build with -DEKV_CUDA=ON in $BUILD,
# torch + triton, the reference checkout in .peers/ref and peer_gpu.py in .peers/ (both
# git-ignored: copy the peer script there before the run).
# Env: LENS (default 32768,131072,524288,1048576), OUT (where JSON goes, default bench/out).
# Usage: [BUILD=build-gpu] [LENS=...] [OUT=DIR] bench/gpu_side_by_side.sh
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
OUTDIR=${OUT:-bench/out}
LENS=${LENS:-32768,131072,524288,1048576}
mkdir -p "$OUTDIR"
E="$BUILD/entmaxkv bench --backend cuda --dtype f16 --page 16 --alpha 1.5 --iters 50"
run() { local name=$1; shift; echo "== $name: $*" >&2; $E "$@" --json "$OUTDIR/ours_$name.json"; }
# H = 32, D = 128 (32 KV heads as in the peer script, then GQA 4)
run h32_dense     --heads 32 --kv-heads 32 --dim 128 --len "$LENS" --method dense
run h32_softmax   --heads 32 --kv-heads 32 --dim 128 --len "$LENS" --method dense --alpha 1
run h32_topk16    --heads 32 --kv-heads 32 --dim 128 --len "$LENS" --method topk --budget 1/16
run h32_topk64    --heads 32 --kv-heads 32 --dim 128 --len "$LENS" --method topk --budget 1/64
run h32_gauss     --heads 32 --kv-heads 32 --dim 128 --len "$LENS" --method gaussian
run h32_cert      --heads 32 --kv-heads 32 --dim 128 --len "$LENS" --method certified --budget 1/16
run h32_cert_pl   --heads 32 --kv-heads 32 --dim 128 --len "$LENS" --method certified --budget 1/16 --workload planted
run h32g4_dense   --heads 32 --kv-heads 8 --dim 128 --len "$LENS" --method dense
run h32g4_topk16  --heads 32 --kv-heads 8 --dim 128 --len "$LENS" --method topk --budget 1/16
run h32g4bf_dense  --heads 32 --kv-heads 8 --dim 128 --len "$LENS" --method dense --dtype bf16
run h32g4bf_topk16 --heads 32 --kv-heads 8 --dim 128 --len "$LENS" --method topk --budget 1/16 --dtype bf16
run h32g8_dense   --heads 32 --kv-heads 4 --dim 128 --len "$LENS" --method dense
run h32g8_topk16  --heads 32 --kv-heads 4 --dim 128 --len "$LENS" --method topk --budget 1/16
# ragged batch of 16, lengths 8K..64K
run ragged_dense   --heads 32 --kv-heads 32 --dim 128 --batch 16 --len 65536 --ragged 8192 --method dense
run ragged_softmax --heads 32 --kv-heads 32 --dim 128 --batch 16 --len 65536 --ragged 8192 --method dense --alpha 1
run ragged_topk16  --heads 32 --kv-heads 32 --dim 128 --batch 16 --len 65536 --ragged 8192 --method topk --budget 1/16
# the same ragged batch with GQA 4 (8 KV heads), fp16 and bf16
run ragged_g4_dense    --heads 32 --kv-heads 8 --dim 128 --batch 16 --len 65536 --ragged 8192 --method dense
run ragged_g4_softmax  --heads 32 --kv-heads 8 --dim 128 --batch 16 --len 65536 --ragged 8192 --method dense --alpha 1
run ragged_g4_topk16   --heads 32 --kv-heads 8 --dim 128 --batch 16 --len 65536 --ragged 8192 --method topk --budget 1/16
run ragged_g4bf_dense  --heads 32 --kv-heads 8 --dim 128 --batch 16 --len 65536 --ragged 8192 --method dense --dtype bf16
run ragged_g4bf_softmax --heads 32 --kv-heads 8 --dim 128 --batch 16 --len 65536 --ragged 8192 --method dense --alpha 1 --dtype bf16
run ragged_g4bf_topk16 --heads 32 --kv-heads 8 --dim 128 --batch 16 --len 65536 --ragged 8192 --method topk --budget 1/16 --dtype bf16
# H = 8, D = 64: where the reference runs at every length
run h8_dense      --heads 8 --kv-heads 8 --dim 64 --len "$LENS" --method dense
run h8_topk16     --heads 8 --kv-heads 8 --dim 64 --len "$LENS" --method topk --budget 1/16
run h8_topk64     --heads 8 --kv-heads 8 --dim 64 --len "$LENS" --method topk --budget 1/64
run h8_gauss      --heads 8 --kv-heads 8 --dim 64 --len "$LENS" --method gaussian
run h8_cert       --heads 8 --kv-heads 8 --dim 64 --len "$LENS" --method certified --budget 1/16
if [ "${PEERS:-1}" = 1 ]; then
  for cfg in "32 128" "8 64"; do
    set -- $cfg
    echo "== peers H=$1 D=$2" >&2
    H=$1 D=$2 LENS=$LENS PEER_OUT="$OUTDIR" EKV_PEER_REF=.peers/ref python3 .peers/peer_gpu.py > "$OUTDIR/peer_h$1.log" 2>&1 || true
    mv "$OUTDIR/peer_gpu.json" "$OUTDIR/peer_h$1.json" 2>/dev/null || true
    tail -n 6 "$OUTDIR/peer_h$1.log"
  done
  echo "== peers: ragged SDPA, then grouped-query SDPA (enable_gqa) at batch 1 and ragged" >&2
  python3 bench/sdpa_ragged.py "$OUTDIR/ragged_sdpa.json" || true
  python3 bench/sdpa_gqa.py "$OUTDIR/sdpa_gqa.json" --lens "$LENS" || true
  KV=8 python3 bench/sdpa_ragged.py "$OUTDIR/ragged_g4_sdpa.json" || true
  KV=8 DTYPE=bf16 python3 bench/sdpa_ragged.py "$OUTDIR/ragged_g4bf_sdpa.json" || true
  python3 bench/side_by_side.py "$OUTDIR" "$OUTDIR/ragged_sdpa.json"
fi
