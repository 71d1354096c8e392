#!/usr/bin/env bash
# GPU tests, run on the GPU machine: builds with -DEKV_CUDA=ON (sm_90a + PTX), runs test_cuda
# (every CUDA stage against the CPU and long-double reference backends, graph replay, invalid
# inputs), test_cuda_sharded (the sharded plan against the one-GPU plan) and test_model_cuda
# (the model on the GPU against the CPU engine, every GPU method), test_flash_entmax_cuda
# (ekv_cuda_flash_entmax_* against the CPU reference), test_overlap (overlapped launches overlap
# and wait: src/cuda/common/overlap.cuh), test_wgmma (Hopper's warpgroup MMA against mma.sync:
# src/cuda/common/wgmma.cuh),
# then compute-sanitizer memcheck over the first MEMCHECK_CASES cases of test_cuda's table.
# Usage: tests/gpu/run.sh [LOGDIR]   (logs are also copied to LOGDIR when given)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
LOG=${1:-}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DEKV_CUDA=ON -DEKV_BUILD_TESTS=ON >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target test_cuda test_cuda_sharded test_model_cuda \
  test_flash_entmax_cuda test_overlap test_wgmma entmaxkv_cli >/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
status=0
echo "== test_overlap"
"$BUILD/tests/test_overlap" 2>&1 | tee ${LOG:+"$LOG/test_overlap.log"} || status=1
echo "== test_wgmma"
"$BUILD/tests/test_wgmma" 2>&1 | tee ${LOG:+"$LOG/test_wgmma.log"} || [ "${PIPESTATUS[0]}" -eq 77 ] || status=1
echo "== test_cuda"
"$BUILD/tests/test_cuda" 2>&1 | tee ${LOG:+"$LOG/test_cuda.log"} || status=1
echo "== test_cuda_sharded"
"$BUILD/tests/test_cuda_sharded" 2>&1 | tee ${LOG:+"$LOG/test_cuda_sharded.log"} || status=1
echo "== test_flash_entmax_cuda"
"$BUILD/tests/test_flash_entmax_cuda" 2>&1 | tee ${LOG:+"$LOG/test_flash_entmax_cuda.log"} || status=1
echo "== test_model_cuda"
"$BUILD/tests/test_model_cuda" 2>&1 | tee ${LOG:+"$LOG/test_model_cuda.log"} || status=1
if command -v compute-sanitizer >/dev/null 2>&1; then
  echo "== compute-sanitizer memcheck (first ${MEMCHECK_CASES:-8} cases)"
  EKV_CUDA_TEST_CASES=${MEMCHECK_CASES:-8} compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$BUILD/tests/test_cuda" 2>&1 | tail -n 25 | tee ${LOG:+"$LOG/memcheck.log"} || status=1
else
  echo "== compute-sanitizer not found: memcheck skipped"
fi
exit $status
