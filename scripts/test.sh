#!/usr/bin/env bash
# Quick start, step 2: build with tests and run the whole suite (CTest).
# Set EKV_SANITIZE=1 to build and run it with AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
ekv_need_tools
dir=build-test
extra=()
if [ "${EKV_SANITIZE:-0}" = 1 ]; then
  dir=build-asan
  extra=(-DEKV_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo)
else
  extra=(-DCMAKE_BUILD_TYPE=Release)
fi
cmake -S . -B "$dir" -DEKV_BUILD_TESTS=ON "${extra[@]}" >/dev/null
cmake --build "$dir" -j"$(nproc)"
cd "$dir"
ctest --output-on-failure -j"$(nproc)"
