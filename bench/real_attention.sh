#!/usr/bin/env bash
# Real attention on the GPU, beside torch SDPA in the same call (docs/architecture.md, "Tests
# and measurement"): the shipped model's own attention, not synthetic keys.
#   1. model decode: for each context of CTXS, one dense prefill of the repository's text, then
#      `run --compare METHODS --rewind` (every method decodes the same DECODE tokens after the
#      same prefill); the [decode ...] stats lines give tokens/s per method, and an exact method
#      (certified, screened) whose line says it left dense's tokens is flagged on stdout and in the log;
#   2. SDPA attention-only: torch's softmax SDPA (enable_gqa) on the model's attention shape
#      (H 6, KV 2, D 64, f16, one query) at the same contexts, ms per layer and the tokens/s of
#      its 8 layers' attention alone (the most a softmax engine of this shape could decode);
#      (a short context such as 4096 in CTXS shows the engine's fixed cost per token);
#   3. the model's trace at TRACE_CTX tokens (`entmaxkv trace --backend cuda`), the layers of
#      TRACE_LAYERS and every method through `bench --backend cuda --workload trace:FILE@lL.` (median ms per step,
#      graph replay), with SDPA on the same layer's shape.
# Usage: bench/real_attention.sh OUTDIR   (prompts: bench/repo_prompt.sh; PROMPT_CORPUS=FILE
#   there gives two trees the same bytes)
#   BIN (build-gpu/entmaxkv), OLD_BIN (none: other trees' builds run beside BIN on the same
#   prompts and trace: a path, its rows tagged old, or several NAME=PATH, tagged NAME; a tree
#   from `git archive`: bench/build_tree.sh), CTXS ("131072 524288"; set and empty: no model
#   decode), TRACE_CTX (262144, 0 =
#   skip), TRACE_LAYERS ("0 1 2 3 4 5 6 7"), DECODE (32), METHODS (topk:1/16,certified,screened,
#   gaussian; dense runs first), TRACE_METHODS (dense topk certified screened; M+V: M with the
#   variant V's options, BIN's tree only: fused (bench --fused-attend 1), overlap
#   (--overlap-launches 1, the default on sm_90), plain (--overlap-launches 0), flat
#   (--superpage 0: no superpages, so certified runs no round 0), cluster (--tau-cluster 8: a
#   long list's tau by a cluster of 8 blocks, the default on sm_90), oneblock (--tau-cluster 0:
#   one block a head), bits4 (--code-bits 4: screened's 4-bit key codes; 8 is the default),
#   joined by +, e.g. dense+fused+overlap), PROFILE_LAYERS
#   (none: the trace layers whose steps ncu times kernel by kernel, every trace method, rows
#   "kernel" of the TSV: method/kernel, its mean ms, its launches in the run), PROFILE_STEP
#   (none: a context, e.g. 4096, whose model decode step ncu times kernel by kernel for dense
#   and topk, rows "step": method/kernel, its ms in the step, its launches; the model's fixed
#   cost per token), MODEL_VARIANTS (none: variants as above, e.g. "fused overlap": the model
#   decode of part 1 again with BIN and each variant's options, rows tagged by the variant).
# Writes OUTDIR/real_attention.log (commands and outputs) and OUTDIR/real_attention.tsv.
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help | "") usage; [ -n "${1:-}" ]; exit $? ;; esac
set -u
cd "$(dirname "$0")/.."
OUT=$1
BIN=${BIN:-build-gpu/entmaxkv}
CTXS=${CTXS-131072 524288} # set and empty: no model decode
TRACE_CTX=${TRACE_CTX:-262144}
TRACE_LAYERS=${TRACE_LAYERS:-0 1 2 3 4 5 6 7}
OLD_BIN=${OLD_BIN:-}
DECODE=${DECODE:-32}
METHODS=${METHODS:-topk:1/16,certified,screened,gaussian}
TRACE_METHODS=${TRACE_METHODS:-dense topk certified screened}
PROFILE_LAYERS=${PROFILE_LAYERS:-}
PROFILE_STEP=${PROFILE_STEP:-}
MODEL_VARIANTS=${MODEL_VARIANTS:-}
mkdir -p "$OUT" || exit 1
LOG="$OUT/real_attention.log"
TSV="$OUT/real_attention.tsv"
: >"$LOG"
printf 'part\ttree\tctx\tlayer\tmethod\tms\tms_graph\ttokens_per_s\n' >"$TSV"
for b in "$BIN" $(for o in $OLD_BIN; do echo "${o#*=}"; done); do
    [ -x "$b" ] || { echo "real_attention.sh: $b is not built" >&2; exit 1; }
done
# "tree binary" pairs: this tree's build (new), then OLD_BIN's (old, or each NAME=PATH's NAME)
trees() {
    local o
    echo "new $BIN"
    for o in $OLD_BIN; do case "$o" in *=*) echo "${o%%=*} ${o#*=}" ;; *) echo "old $o" ;; esac; done
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log -1 --format='commit %H' 2>/dev/null; } >>"$LOG" 2>&1

. bench/repo_prompt.sh # prompt N: N bytes of the repository's text

# SDPA softmax decode on the model's attention shape: "ctx ms_per_layer" per context
sdpa_rows() {
    PYTHONPATH=bench python3 - "$@" <<'PY'
import sys
from sdpa_common import time_ms, decode_qkv, sdpa
for n in map(int, sys.argv[1:]):
    q, k, v = decode_qkv(n, 6, 2, 64, "f16")
    print(n, "%.4f" % time_ms(lambda: sdpa(q, k, v), warm=10, iters=100))
PY
}

# variant_options V: the options of a variant (fused, overlap, plain, flat, cluster, oneblock,
# bits4, or some joined by +)
variant_options() {
    local part opts=""
    for part in $(echo "$1" | tr + ' '); do
        case "$part" in
        fused) opts="$opts --fused-attend 1" ;;
        overlap) opts="$opts --overlap-launches 1" ;;
        plain) opts="$opts --overlap-launches 0" ;;
        flat) opts="$opts --superpage 0" ;;
        cluster) opts="$opts --tau-cluster 8" ;;
        oneblock) opts="$opts --tau-cluster 0" ;;
        bits4) opts="$opts --code-bits 4" ;;
        *) echo "real_attention.sh: unknown variant '$part'" >&2 ;;
        esac
    done
    echo $opts
}

# bench_method M: bench's method options of a trace method (M+V: with the variant's options)
bench_method() {
    case "$1" in *+*) echo "--method ${1%%+*} $(variant_options "${1#*+}")" ;; *) echo "--method $1" ;; esac
}

# profile_step TRACE LAYER METHOD: ncu's duration of every kernel the trace bench launches
# (eager and graph-replayed nodes), averaged per kernel name, as TSV rows
profile_step() {
    local steps=8
    echo "== ncu: $BIN bench --backend cuda --workload trace:$1@l$2. $(bench_method "$3") --iters $steps" >>"$LOG"
    ncu --clock-control none --graph-profiling node --metrics gpu__time_duration.sum --csv \
        "$BIN" bench --backend cuda --workload "trace:$1@l$2." $(bench_method "$3") --iters "$steps" \
        --warmup 1 >"$OUT/ncu.csv" 2>>"$LOG" || { echo "   (ncu exit $?)" >>"$LOG"; return; }
    python3 bench/ncu_kernels.py "$OUT/ncu.csv" kernel "$TRACE_CTX" "$2" "$3" | tee -a "$LOG" >>"$TSV"
}

# profile_model_step CTX METHOD: ncu's duration of every kernel of the model's last decode
# step (`run` of a CTX-byte prompt, 3 tokens; the step begins with its block tables), as TSV
# rows "step": kernel, its ms in the step, its launches; then the step's sum
profile_model_step() {
    local f
    f=$(prompt "$1")
    echo "== ncu: $BIN run --backend cuda --prompt-file $f -n 3 --method $2 --quiet" >>"$LOG"
    ncu --clock-control none --graph-profiling node --metrics gpu__time_duration.sum --csv \
        "$BIN" run --backend cuda --prompt-file "$f" -n 3 --method "$2" --quiet \
        >"$OUT/ncu.csv" 2>>"$LOG" || { echo "   (ncu exit $?)" >>"$LOG"; return; }
    python3 bench/ncu_kernels.py "$OUT/ncu.csv" step "$1" - "$2" --last-step block_tables_kernel |
        tee -a "$LOG" >>"$TSV"
}

echo "== 1. model decode per method (dense prefill, then --compare $METHODS --rewind)" | tee -a "$LOG"
for n in $CTXS; do
    f=$(prompt "$n")
    { trees | sed 's/$/ -/'; for v in $MODEL_VARIANTS; do echo "$v $BIN $v"; done; } | while read -r tree bin variant; do
        fa=$([ "$variant" = - ] || variant_options "$variant")
        echo "== $bin run --backend cuda --prompt-file $f -n $DECODE --method dense --quiet --compare $METHODS --rewind $fa" >>"$LOG"
        "$bin" run --backend cuda --prompt-file "$f" -n "$DECODE" --method dense --quiet \
            --compare "$METHODS" --rewind $fa >"$OUT/run_${n}_$tree.out" 2>>"$LOG" || echo "   (exit $?)" >>"$LOG"
        cat "$OUT/run_${n}_$tree.out" >>"$LOG"
        grep -E '^\[decode @[0-9]+ (certified|screened)[] ].*; differs from' "$OUT/run_${n}_$tree.out" |
            sed 's/^/   EXACT METHOD LEFT THE DENSE TEXT: /' | tee -a "$LOG"
        grep -h '^\[decode' "$OUT/run_${n}_$tree.out" | while read -r line; do
            method=$(echo "$line" | sed -E 's/^\[decode @?[0-9]* ?([^]]*)\].*/\1/')
            rate=$(echo "$line" | grep -oE '[0-9.]+ tokens/s' | head -n 1 | cut -d' ' -f1)
            [ -n "$rate" ] && printf 'model\t%s\t%s\t-\t%s\t-\t-\t%s\n' "$tree" "$n" "$method" "$rate" >>"$TSV"
        done
    done
done

for m in $([ -n "$PROFILE_STEP" ] && echo dense topk); do profile_model_step "$PROFILE_STEP" "$m"; done

echo "== 2. SDPA attention-only (H 6, KV 2, D 64, f16, one query; 8 layers)" | tee -a "$LOG"
sdpa_rows $CTXS $([ "$TRACE_CTX" != 0 ] && echo "$TRACE_CTX") 2>>"$LOG" | while read -r n ms; do
    echo "sdpa $n tokens: $ms ms per layer" >>"$LOG"
    printf 'sdpa\t-\t%s\tall\tsdpa\t%s\t-\t%s\n' "$n" "$ms" "$(awk -v m="$ms" 'BEGIN { printf "%.1f", 1000 / (8 * m) }')" >>"$TSV"
done

if [ "$TRACE_CTX" != 0 ]; then
    echo "== 3. the model's trace at $TRACE_CTX tokens, layers $TRACE_LAYERS, every method" | tee -a "$LOG"
    tr="$OUT/trace_$TRACE_CTX.safetensors"
    "$BIN" trace --backend cuda --text "$(prompt $((TRACE_CTX + 64)))" --ctx "$TRACE_CTX" \
        --layers "$(echo $TRACE_LAYERS | tr ' ' ,)" --out "$tr" >>"$LOG" 2>&1 || echo "   (trace exit $?)" >>"$LOG"
    for l in $TRACE_LAYERS; do
        for m in $TRACE_METHODS; do
            trees | while read -r tree bin; do
                case "$tree $m" in "new "*) ;; *+*) continue ;; esac # variants: BIN's tree only
                echo "== $bin bench --backend cuda --workload trace:$tr@l$l. $(bench_method "$m")" >>"$LOG"
                "$bin" bench --backend cuda --workload "trace:$tr@l$l." $(bench_method "$m") >"$OUT/bench.out" 2>>"$LOG" ||
                    echo "   (exit $?)" >>"$LOG"
                cat "$OUT/bench.out" >>"$LOG"
                row=$(awk '$1 ~ /^[0-9]+$/ { print $2 "\t" $4; exit }' "$OUT/bench.out")
                [ -n "$row" ] && printf 'trace\t%s\t%s\t%s\t%s\t%s\t-\n' "$tree" "$TRACE_CTX" "$l" "$m" "$row" >>"$TSV"
            done
        done
    done
    for l in $PROFILE_LAYERS; do
        for m in $TRACE_METHODS; do profile_step "$tr" "$l" "$m"; done
    done
    rm -f "$tr"
fi
cat "$TSV"
