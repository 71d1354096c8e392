#!/usr/bin/env bash
# Issue 16 on the GPU machine: `bench --shard-pools` (docs/cli.md, bench) against the
# whole-pool sharded path, then the context that fits no single GPU. Needs a build with
# -DEKV_CUDA=ON in $BUILD (and -DEKV_NCCL=ON for --gpus).
#   check [S]       one GPU, local transport: for dense, certified and screened (planted, and a
#                   ragged batch for dense) runs --shards S with and without --shard-pools at
#                   128K tokens; fails unless both paths agree with the one-GPU step
#                   (rel_err_vs_1gpu <= 1e-5); different output hashes (out_fnv) are noted, not
#                   failed: each shard's plan is sized for its own pool, so its split-KV
#                   partition, hence the fp32 summation order, differs (docs/cli.md, bench)
#   check-gpus [N]  the same over N GPUs (--gpus N, NCCL)
#   big [N]         10M tokens, H 32, KV 32, D 128, f16, B 1, dense and screened over N GPUs
#                   (default 2) with --shard-pools: the one-GPU reference is skipped (it needs
#                   ~230 GB), each GPU holds ~82 GB of K/V
# Env: LEN (check's length, default 131072), BIGLEN (default 10000000).
# Usage: [BUILD=build-gpu] bench/shard_pools.sh check|check-gpus|big [N]
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h | --help | "") usage; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
BUILD=${BUILD:-build-gpu}
E="$BUILD/entmaxkv bench --backend cuda --heads 32 --kv-heads 32 --dim 128 --dtype f16 --page 16"
fails=0

# field NAME LINE: the value of NAME=... in a "# sharded" line
field() { printf '%s\n' "$2" | tr ' ' '\n' | awk -F= -v k="$1" '$1 == k { print $2 }'; }

# compare WHAT ARGS...: whole pool and shard pools (the split of $split), the same options
compare() {
    local what=$1
    shift
    echo "== $what: ${split[*]} $*"
    local whole pools
    whole=$($E "$@" "${split[@]}" | grep '^# sharded') || { echo "FAIL $what: whole-pool run"; fails=$((fails + 1)); return; }
    pools=$($E "$@" "${split[@]}" --shard-pools | tee /dev/stderr | grep '^# sharded') ||
        { echo "FAIL $what: shard-pools run"; fails=$((fails + 1)); return; }
    echo "   whole: $whole"
    echo "   pools: $pools"
    local ew ep fw fp
    ew=$(field rel_err_vs_1gpu "$whole") ep=$(field rel_err_vs_1gpu "$pools")
    fw=$(field out_fnv "$whole") fp=$(field out_fnv "$pools")
    if ! awk -v a="$ew" -v b="$ep" 'BEGIN { exit !(a != "none" && b != "none" && a + 0 <= 1e-5 && b + 0 <= 1e-5) }'; then
        echo "FAIL $what: rel_err_vs_1gpu whole $ew, shard pools $ep (want both <= 1e-5)"
        fails=$((fails + 1))
    fi
    [ "$fw" != "$fp" ] &&
        echo "note $what: out_fnv differ ($fw, $fp): the shard plans' splits follow their pools"
}

mode=$1 n=${2:-2}
case "$mode" in
check | check-gpus)
    split=(--shards "$n")
    [ "$mode" = check-gpus ] && split=(--gpus "$n")
    L=${LEN:-131072}
    compare dense --len "$L" --method dense
    compare dense-ragged --len "$L" --batch 4 --ragged 8192 --method dense
    compare dense-planted --len "$L" --method dense --workload planted
    compare certified --len "$L" --method certified --budget 1/16 --workload planted
    compare screened --len "$L" --method screened --workload planted
    echo "shard_pools.sh $mode: $fails failure(s)"
    [ "$fails" -eq 0 ]
    ;;
big)
    L=${BIGLEN:-10000000}
    for m in dense screened; do
        echo "== $m: $L tokens over $n GPUs"
        $E --len "$L" --batch 1 --method $m --workload planted --gpus "$n" --shard-pools || fails=$((fails + 1))
    done
    [ "$fails" -eq 0 ]
    ;;
*) usage; exit 2 ;;
esac
