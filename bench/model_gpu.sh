#!/usr/bin/env bash
# The model on the GPU (docs/architecture.md, "The model on the GPU"): prefill tokens/s and
# FLOP rate with the dense tensor-core prefill at 8K, 32K and 128K tokens (and 1M with
# MODEL_GPU_1M=1: about 2-4 minutes of prefill), then decode tokens/s per method (dense, topk,
# certified, screened) after a dense prefill at 32K and 128K (one run each: --compare), with
# CUDA graphs and, for dense at 32K, eager launches. The prompts are the repository's own text
# (docs and sources, repeated): speed does not depend on the bytes.
#
# Usage: bench/model_gpu.sh LOGDIR      (BIN=build-gpu/entmaxkv by default; the shipped model)
# Writes LOGDIR/model_gpu.log (every command and its output) and LOGDIR/model_gpu.tsv
# (phase, context, method, tokens, seconds, tokens/s, useful TFLOP/s, tensor-core TFLOP/s).
# FLOP counts (docs/math.md §12): attention 2*H*D*N^2 per layer for N prefill tokens (the
# causal half, S and P.V), linear layers 2*params per token; "tensor-core" counts what the
# GEMMs compute with the split's 2 parts (f16 cache; the discarded causal half of each block's
# square is not counted).
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help | "") usage; [ -n "${1:-}" ]; exit $? ;; esac
set -u
cd "$(dirname "$0")/.."
OUT=$1
BIN=${BIN:-build-gpu/entmaxkv}
mkdir -p "$OUT" || exit 1
LOG="$OUT/model_gpu.log"
TSV="$OUT/model_gpu.tsv"
: >"$LOG"
printf 'phase\tctx\tmethod\ttokens\tseconds\ttokens_per_s\tuseful_tflops\ttc_tflops\n' >"$TSV"
[ -x "$BIN" ] || { echo "model_gpu.sh: $BIN is not built" >&2; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; git log -1 --format='commit %H'; } >>"$LOG" 2>&1

# the stats lines of run ([prefill ...], [decode @N ...], [decode batch B ...]) as TSV rows
cat >"$OUT/stats.awk" <<'AWK'
        /^\[(prefill|decode)/ {
            line = $0; sub(/^\[/, "", line); split(line, a, "]"); head = a[1]
            nf = split(head, w, " "); phase = w[1]; first = 2
            if (w[2] == "batch") { phase = phase "_batch" w[3]; first = 4 }
            else if (phase == "decode") first = 3
            method = w[first]; for (k = first + 1; k <= nf; k++) method = method " " w[k]
            match(a[2], /[0-9]+ tokens in [0-9.]+ s/); split(substr(a[2], RSTART, RLENGTH), b, " ")
            tok = b[1]; sec = b[4]
            match(a[2], /[0-9.]+ tokens\/s/); rate = substr(a[2], RSTART, RLENGTH) + 0
            H = 6; D = 64; L = 8; P = 12.7e6
            if (phase == "prefill" && sec > 0) { # one sequence: the N^2 of attention
                useful = (2 * H * D * tok * tok * L + 2 * P * tok) / sec / 1e12
                tc = (2 * 2 * H * D * tok * tok * L + 2 * P * tok) / sec / 1e12
            } else { useful = 0; tc = 0 }
            if (tok > 0) printf "%s\t%s\t%s\t%s\t%s\t%.1f\t%.2f\t%.2f\n", phase, ctx, method, tok, sec, rate, useful, tc
        }
AWK

. bench/repo_prompt.sh # prompt N: N bytes of the repository's text

# run_one CTX ARGS...: one run, its stats lines into the TSV
run_one() {
    local ctx=$1
    shift
    echo "== $BIN run --backend cuda --prompt-file $(prompt "$ctx") --quiet $*" >>"$LOG"
    "$BIN" run --backend cuda --prompt-file "$(prompt "$ctx")" --quiet "$@" >"$OUT/run.out" 2>>"$LOG"
    local rc=$?
    cat "$OUT/run.out" >>"$LOG"
    [ $rc -eq 0 ] || { echo "   (exit $rc)" >>"$LOG"; return 1; }
    # [prefill dense] N tokens in S s: R tokens/s; ...   /   [decode @N topk 0.0625] ...
    awk -v ctx="$ctx" -f "$OUT/stats.awk" "$OUT/run.out" >>"$TSV"
}

for n in 8192 32768 131072; do
    run_one "$n" --method dense -n 0
done
[ "${MODEL_GPU_1M:-0}" = 1 ] && run_one 1048576 --method dense -n 0
for n in 32768 131072; do
    run_one "$n" --method dense -n 128 --compare topk,certified,screened
done
run_one 32768 --method dense -n 128 --no-graphs

# batched decode: BATCH prompts of 8K..32K bytes (different lengths: a ragged page table)
B=${MODEL_GPU_BATCH:-16}
: >"$OUT/prompts.txt"
for k in $(seq 0 $((B - 1))); do
    head -c $((8192 + 24576 * k / (B > 1 ? B - 1 : 1))) "$(prompt 32768)" | tr '\n' ' ' >>"$OUT/prompts.txt"
    echo >>"$OUT/prompts.txt"
done
echo "== $BIN run --backend cuda --prompts-file $OUT/prompts.txt --quiet -n 64 --method dense --compare topk,certified,screened" >>"$LOG"
"$BIN" run --backend cuda --prompts-file "$OUT/prompts.txt" --quiet -n 64 --method dense \
    --compare topk,certified,screened >"$OUT/run.out" 2>>"$LOG" || echo "   (exit $?)" >>"$LOG"
cat "$OUT/run.out" >>"$LOG"
awk -v ctx=ragged -f "$OUT/stats.awk" "$OUT/run.out" >>"$TSV"
column -t -s $'\t' "$TSV" 2>/dev/null || cat "$TSV"
