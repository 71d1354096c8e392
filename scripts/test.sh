#!/usr/bin/env bash
# Quick start, step 2: build with tests and run the whole suite (CTest).
# Set EKV_SANITIZE=1 to build and run it with AddressSanitizer + UndefinedBehaviorSanitizer,
# EKV_WERROR=1 to make compiler warnings errors (CI does).
# Usage: [EKV_SANITIZE=1] [EKV_WERROR=1] ./scripts/test.sh
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
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
# always passed, so a build directory configured once with EKV_WERROR=1 does not keep it
extra+=(-DEKV_WERROR="$([ "${EKV_WERROR:-0}" = 1 ] && echo ON || echo OFF)")
cmake -S . -B "$dir" -DEKV_BUILD_TESTS=ON "${extra[@]}" >/dev/null
cmake --build "$dir" -j"$(nproc)"
cd "$dir"
ctest --output-on-failure -j"$(nproc)"
