#!/usr/bin/env bash
# Another tree's GPU build beside this one, so that two or more trees are measured in one call
# on one machine (bench/real_attention.sh's OLD_BIN=NAME=PATH ...; timings from different calls
# or cards do not compare: docs/architecture.md, "Tests and measurement").
# Usage: bench/build_tree.sh TARBALL DIR [CMAKE_ARG ...]
#   TARBALL  a tree from `git archive --format=tar.gz -o T.tgz REF -- . ':!models'`, made where
#            the history is (the GPU machine's copy of the checkout has none) and carried there
#   DIR      gets the tree, this tree's models/ linked in, and DIR/build-gpu (Release,
#            EKV_CUDA=ON, tests on; the CLI, test_cuda and test_model_cuda built with JOBS
#            parallel jobs, default the CPUs); prints DIR/build-gpu/entmaxkv, the build's log in
#            DIR/build.log. Several at once: run each in the background, then `wait`.
case "${1:-}" in -h|--help | "") awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; [ -n "${1:-}" ]; exit $? ;; esac
set -u
cd "$(dirname "$0")/.." || exit 1
tarball=$1 dir=$2
shift 2
[ -f "$tarball" ] || { echo "build_tree.sh: no tarball '$tarball'" >&2; exit 1; }
rm -rf "$dir" && mkdir -p "$dir" && tar -xzf "$tarball" -C "$dir" || exit 1
[ -e "$dir/models" ] || ln -s "$PWD/models" "$dir/models"
{ cmake -S "$dir" -B "$dir/build-gpu" -DCMAKE_BUILD_TYPE=Release -DEKV_CUDA=ON -DEKV_BUILD_TESTS=ON \
    -DEKV_BUILD_EXAMPLES=OFF "$@" &&
    cmake --build "$dir/build-gpu" -j"${JOBS:-$(nproc)}" --target entmaxkv_cli test_cuda test_model_cuda; } \
    >"$dir/build.log" 2>&1 || { echo "build_tree.sh: $tarball failed to build (log: $dir/build.log)" >&2; tail -n 20 "$dir/build.log" >&2; exit 1; }
echo "$dir/build-gpu/entmaxkv"
