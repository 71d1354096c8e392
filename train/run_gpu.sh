#!/bin/bash
# One training call on the GPU machine (see train/README.md). Expects the entmax wheel
# installed on PYTHONPATH, data/train.txt.gz and data/val.txt.gz carried, and $OUT set.
#   SECS: training seconds of the main run (default 360)
#   SELFTEST=1: first a few seconds of tiny training + resume + export + reference logits
# Usage: OUT=DIR [SECS=N] [SELFTEST=0|1] train/run_gpu.sh
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
set -u -o pipefail
export PYTHONUNBUFFERED=1
SECS=${SECS:-360}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" ckpt
T0=$(date +%s)
nvidia-smi -L
python3 -c "import torch, entmax; print('torch', torch.__version__, 'entmax', entmax.__file__)" || exit 1
if [ "${SELFTEST:-1}" = 1 ]; then
    S=/tmp/selftest
    rm -rf $S
    ( python3 train/train.py --out $S --log $S/log.txt --seconds 4 --batch 8 --warmup 5 --eval-every 2 \
          --eval-seqs 8 --final-passkey 1024:4,8192:1 &&
      python3 train/train.py --out $S --log $S/log.txt --seconds 7 --batch 8 --warmup 5 --eval-every 100 \
          --eval-seqs 8 --final-passkey 1024:2 &&
      python3 train/export.py $S/model_fp32.safetensors $S/m.safetensors &&
      python3 train/make_ref_logits.py --model $S/m.safetensors --out $S/ref.bin ) 2>&1 | tee "$OUT/selftest.txt"
    rc=$?
    echo "selftest rc=$rc after $(( $(date +%s) - T0 )) s"
    [ $rc = 0 ] || exit $rc
fi
python3 train/train.py --out ckpt --log ckpt/log.txt --seconds "$SECS" --wall-limit "${WALL:-470}" 2>&1 | tee "$OUT/train_stdout.txt"
rc=$?
echo "train rc=$rc after $(( $(date +%s) - T0 )) s"
cp ckpt/log.txt ckpt/result.json "$OUT/" 2>/dev/null
[ $rc = 0 ] || exit $rc
python3 train/export.py ckpt/model_fp32.safetensors models/entmaxkv-lm.safetensors &&
python3 train/make_ref_logits.py 2>&1 | tee -a "$OUT/post.txt" &&
cp tests/data/model_ref_logits.bin "$OUT/" &&
split -b 13000000 -d models/entmaxkv-lm.safetensors "$OUT/model.part." &&
sha256sum models/entmaxkv-lm.safetensors | tee -a "$OUT/post.txt"
rc=$?
echo "all done rc=$rc after $(( $(date +%s) - T0 )) s"
exit $rc
