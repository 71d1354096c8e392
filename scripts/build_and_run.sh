#!/usr/bin/env bash
# Quick start, step 1: build everything (Release) and run the main job: the dense decode
# benchmark on the default workload (131072 tokens, 32 query heads, 8 KV heads, D = 128,
# fp16, alpha = 1.5), with the in-process read-bandwidth probe.
# Extra arguments are passed to `entmaxkv bench` (see build/entmaxkv bench --help).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
ekv_need_tools
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
echo "== build/entmaxkv bench $*" >&2
build/entmaxkv bench "$@"
