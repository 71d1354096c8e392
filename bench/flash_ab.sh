#!/usr/bin/env bash
# The flash op (entmaxkv.flash_entmax, issue 30) of several source trees, timed in one call on the
# GPU machine: each tree is built as a shared library with the CUDA backend (in parallel), then
# bench/prefill_side_by_side.py --peers ours runs against each tree in turn, ROUNDS times, so that
# the trees alternate on one warm GPU and their rows compare within the call. Each run uses its
# tree's own Python package (DIR/python) and this tree's bench script.
# A tree is a source directory: the GPU machine's copy has no .git, so make one here, e.g.
# `mkdir -p .peers/base && git archive REV | tar -x -C .peers/base`, and carry .peers.
# Usage: bench/flash_ab.sh [--rounds R] [--args "SIDE_BY_SIDE_ARGS"] NAME=DIR [NAME=DIR ...]
#   --rounds: passes over the trees (default 2)
#   --args: prefill_side_by_side.py's arguments besides --peers (default: --lens 8192 --dims 64,128
#           --heads 6/2 --dtypes bf16 --passes fwd,fwdbwd --iters 5)
# Output: the rows of each run, each prefixed with "NAME rROUND |"; builds in build-ab-NAME/
# (their logs in build-ab-NAME/ab.log). Exit 1 when a build fails (nothing is timed then) or a
# run prints no rows.
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
set -uo pipefail
rounds=2
args="--lens 8192 --dims 64,128 --heads 6/2 --dtypes bf16 --passes fwd,fwdbwd --iters 5"
trees=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --rounds) rounds=${2:?--rounds needs a count}; shift 2 ;;
    --args) args=${2:?--args needs a string}; shift 2 ;;
    *=*) trees+=("$1"); shift ;;
    *) echo "flash_ab.sh: '$1' is not NAME=DIR (see --help)" >&2; exit 2 ;;
  esac
done
case "$rounds" in ''|*[!0-9]*|0) echo "flash_ab.sh: --rounds must be a positive count" >&2; exit 2 ;; esac
[ ${#trees[@]} -gt 0 ] || { echo "flash_ab.sh: no NAME=DIR given (see --help)" >&2; exit 2; }
for t in "${trees[@]}"; do
  [ -f "${t#*=}/CMakeLists.txt" ] || { echo "flash_ab.sh: ${t#*=} is not a source tree" >&2; exit 2; }
done
here=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(( $(nproc) / ${#trees[@]} )); [ "$jobs" -ge 1 ] || jobs=1

build() { # NAME DIR: the shared library in build-ab-NAME
  local b="$here/build-ab-$1"
  mkdir -p "$b" && cmake -S "$2" -B "$b" -DCMAKE_BUILD_TYPE=Release -DEKV_CUDA=ON \
    -DBUILD_SHARED_LIBS=ON -DEKV_BUILD_TESTS=OFF -DEKV_BUILD_EXAMPLES=OFF \
    -DEKV_BUILD_BENCH=OFF >"$b/ab.log" 2>&1 &&
    cmake --build "$b" -j"$jobs" --target entmaxkv >>"$b/ab.log" 2>&1
}
echo "== $(date +%T) building ${#trees[@]} trees, $jobs jobs each"
pids=()
for t in "${trees[@]}"; do build "${t%%=*}" "$(cd "${t#*=}" && pwd)" & pids+=($!); done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "build of ${trees[$i]} failed: build-ab-${trees[$i]%%=*}/ab.log" >&2; failed=1; }
done
[ "$failed" = 0 ] || exit 1
for r in $(seq 1 "$rounds"); do
  for t in "${trees[@]}"; do
    name=${t%%=*} dir=$(cd "${t#*=}" && pwd)
    echo "== $(date +%T) $name round $r"
    # shellcheck disable=SC2086 # args is a list of words
    ENTMAXKV_LIBRARY="$here/build-ab-$name/libentmaxkv.so" PYTHONPATH="$dir/python${PYTHONPATH:+:$PYTHONPATH}" \
      python3 "$here/bench/prefill_side_by_side.py" $args --peers ours | grep '^| [0-9]' |
      sed "s/^/$name r$r /" || {
      echo "$name r$r: no rows (the script failed or printed none)" >&2
      failed=1
    }
  done
done
exit $failed
