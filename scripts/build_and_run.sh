#!/usr/bin/env bash
# Quick start, step 1: build everything (Release) and run the main job: the shipped entmax
# language model (models/entmaxkv-lm.safetensors, issue 6) generating text from its built-in
# prompt, ending with tokens/s and the fraction of the KV cache each step read.
# Extra arguments are passed to `entmaxkv run` (see build/entmaxkv run --help), e.g.
#   ./scripts/build_and_run.sh --method certified --prompt "The LORD said"
# Usage: ./scripts/build_and_run.sh [entmaxkv run options]
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
ekv_need_tools
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--temp 0.7 --seed 1) # greedy output of this small model loops
echo "== build/entmaxkv run ${args[*]}" >&2
build/entmaxkv run "${args[@]}"
