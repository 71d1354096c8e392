#!/usr/bin/env bash
# The Python package's CUDA path on a GPU machine (it needs torch with CUDA, nvcc, CMake and
# pytest there; no network): builds the library with the CUDA backend, runs python/tests (the
# CUDA tests in python/tests/test_torch_cuda.py fail, not skip, when the build lacks CUDA) and
# the per-step overhead benchmark on the CPU and on CUDA with graphs off and on. Logs go to
# LOGDIR: build.log, pytest.log, overhead.log.
# The package is installed with `EKV_CUDA=ON pip install --no-build-isolation .` into a
# virtualenv made with --system-site-packages (it sees the machine's torch) when
# scikit-build-core is importable; otherwise (or with EKV_PY_BUILD=cmake) the library is built
# with CMake in $BUILD (default build-gpu-py/, shared) and the tests load it through
# $ENTMAXKV_LIBRARY.
# Usage: scripts/gpu_python_tests.sh LOGDIR
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; "") usage >&2; exit 2 ;; esac
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1"
logs=$(cd "$1" && pwd)
py=${PYTHON:-python3}
"$py" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'" ||
  { echo "gpu_python_tests: needs torch with a CUDA device" >&2; exit 1; }
"$py" -c "import pytest" || { echo "gpu_python_tests: needs pytest" >&2; exit 1; }

mode=${EKV_PY_BUILD:-auto}
venv=$(mktemp -d /tmp/ekv-gpu-venv.XXXXXX)
trap 'rm -rf "$venv"' EXIT
if [ "$mode" != cmake ]; then # the virtualenv must see torch, pytest and scikit-build-core
  "$py" -m venv --system-site-packages "$venv"
  if "$venv/bin/python" -c "import scikit_build_core, torch, pytest" 2>/dev/null; then
    mode=pip
  elif [ "$mode" = pip ]; then
    echo "gpu_python_tests: a virtualenv over $py does not see scikit-build-core, torch and pytest" >&2
    exit 1
  else
    mode=cmake
  fi
fi
echo "-- building the library with CUDA ($mode); log: $logs/build.log"
if [ "$mode" = pip ]; then
  EKV_CUDA=ON "$venv/bin/pip" install -v --no-build-isolation --no-deps "$repo" >"$logs/build.log" 2>&1 ||
    { tail -30 "$logs/build.log" >&2; exit 1; }
  py="$venv/bin/python"
  cd "$venv" # away from the source tree: the installed package is what is imported
else
  build=${BUILD:-$repo/build-gpu-py} # shared, apart from tests/gpu/run.sh's static build
  { cmake -S "$repo" -B "$build" -DEKV_CUDA=ON -DBUILD_SHARED_LIBS=ON \
      -DEKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release &&
    cmake --build "$build" -j"$(nproc)"; } >"$logs/build.log" 2>&1 ||
    { tail -30 "$logs/build.log" >&2; exit 1; }
  export ENTMAXKV_LIBRARY="$build/libentmaxkv.so"
  export PYTHONPATH="$repo/python${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "-- python/tests; log: $logs/pytest.log"
rc=0
"$py" -m pytest -v -rs "$repo/python/tests" 2>&1 | tee "$logs/pytest.log" || rc=$?
echo "-- bench/python_overhead.py (CPU, then CUDA graphs off and on); log: $logs/overhead.log"
{ "$py" "$repo/bench/python_overhead.py" && "$py" "$repo/bench/python_overhead.py" --cuda; } 2>&1 |
  tee "$logs/overhead.log" || rc=1
exit "$rc"
