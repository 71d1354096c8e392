#!/usr/bin/env bash
# Long-context tasks over the model engine (issue 14 item 3; not in CI): for every method,
#   passkey   single-key retrieval (train/make_passkey.py) at each length, several depths;
#   multikey  NEEDLES named keys in one haystack, the question names one (--needles);
#   ppl       the same 512 scored tokens after contexts of each PPL_CTX length (one window
#             that ends at the same byte for every length: offset = max context - context).
# The haystack and the perplexity text are TEXT (default the training split, data/train.txt,
# from train/get_data.sh; the needles never occur in it: make_passkey.py refuses a text that
# holds them). Exact methods (certified, screened) must give dense's answers and perplexities;
# the summary line says whether they did.
#
# Usage: bench/long_context.sh OUTDIR
# Environment (defaults in brackets):
#   BIN [build/entmaxkv]   BACKEND [cpu] (cuda: the GPU engine)   TEXT [data/train.txt]
#   LENS [32768,131072,524288,1048576]  COUNT [5] prompts per length and task  NEEDLES [4]
#   METHODS ["dense topk:1/16 topk:1/64 gaussian certified screened"] (method[:budget])
#   PREFILL [method]: the prompt's method; "dense" prefills densely (the GPU's tensor-core
#            prefill) and applies the method to the generated tokens (run --prefill-method)
#   REWIND [0]: 1 = one run per prompt: a dense prefill, then every method of METHODS answers
#            from the prompt's end (run --compare LIST --rewind): one prefill per prompt, not
#            one per method (the way to run 1M-token prompts); and one ppl run per context: a dense
#            prefix, then every method of PPL_METHODS scores the same 512 predictions (ppl
#            --prefill-method dense --compare LIST)
#   PPL_CTX [8192,32768,131072,524288,1048576]   PPL_METHODS [METHODS] (ppl applies the method
#            to every token: on cuda a non-dense method is O(N^2) reads, keep it to short contexts)
#   PYTHON [python3] (needs numpy)
# Writes OUTDIR/long_context.tsv (task, length, method, correct or ppl, total or kv_fraction),
# with REWIND=1 OUTDIR/decode_rates.tsv (each method's decode tokens/s at each length, the mean
# over the prompts' 5 answer tokens) and every command's output under OUTDIR/logs/.
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; "") usage >&2; exit 2 ;; esac
set -u
cd "$(dirname "$0")/.."
OUT=$1
BIN=${BIN:-build/entmaxkv} BACKEND=${BACKEND:-cpu} TEXT=${TEXT:-data/train.txt}
LENS=${LENS:-32768,131072,524288,1048576} COUNT=${COUNT:-5} NEEDLES=${NEEDLES:-4}
METHODS=${METHODS:-"dense topk:1/16 topk:1/64 gaussian certified screened"}
PREFILL=${PREFILL:-method} PPL_CTX=${PPL_CTX:-8192,32768,131072,524288,1048576}
PPL_METHODS=${PPL_METHODS:-$METHODS} REWIND=${REWIND:-0}
PYTHON=${PYTHON:-python3}
[ -x "$BIN" ] || { echo "long_context.sh: $BIN is not built" >&2; exit 1; }
[ -s "$TEXT" ] || { echo "long_context.sh: no text $TEXT (train/get_data.sh makes it)" >&2; exit 1; }
mkdir -p "$OUT/logs" || exit 1
TSV="$OUT/long_context.tsv" RATES="$OUT/decode_rates.tsv"
printf 'task\tlength\tmethod\tvalue\tof\n' >"$TSV"
printf 'task\tlength\tmethod\tdecode_tokens_per_s\tprompts\n' >"$RATES"

# options of a METHODS entry (method[:budget]); with a second argument, run's prefill rule too
opts_of() {
    local m=${1%%:*} b=""
    [ "$m" != "$1" ] && b=${1#*:}
    printf -- '--backend %s --method %s' "$BACKEND" "$m"
    [ -n "$b" ] && printf -- ' --budget %s' "$b"
    [ -n "${2:-}" ] && [ "$PREFILL" = dense ] && [ "$m" != dense ] && printf -- ' --prefill-method dense'
    return 0
}

prompts() { # DIR NEEDLES
    "$PYTHON" train/make_passkey.py --lengths "$LENS" --count "$COUNT" --val "$TEXT" \
        --out "$1" --needles "$2" >"$OUT/logs/make_$(basename "$1").log" 2>&1 ||
        { cat "$OUT/logs/make_$(basename "$1").log" >&2; exit 1; }
}
prompts "$OUT/passkey" 1
prompts "$OUT/multikey" "$NEEDLES"

# REWIND=1: one run per prompt, dense first, then the other specs in order (run's phases)
rewind_task() { # TASK L
    local others="" spec phase
    local -a specs=(dense)
    for spec in $METHODS; do
        [ "$spec" = dense ] && continue
        others=${others:+$others,}$spec
        specs+=("$spec")
    done
    local log="$OUT/logs/${1}_L${2}_rewind.log"
    echo "== $1 L=$2 rewind: dense,$others" >&2
    bench/model_passkey.sh "$BIN" "$OUT/$1" "$2" "$COUNT" --backend "$BACKEND" --method dense \
        ${others:+--compare "$others" --rewind} >"$log" 2>&1 ||
        { echo "long_context.sh: $log failed" >&2; tail -3 "$log" >&2; return; }
    while read -r phase score; do
        printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "${specs[phase]}" "${score%/*}" "${score#*/}" >>"$TSV"
    done < <(awk '/^passkey L=/ { p = 0; if ($3 ~ /^phase=/) { p = $3; sub(/phase=/, "", p) }; print p, $NF }' "$log")
    # each method's decode rate at this length, the mean over the prompts (5 tokens each)
    while read -r phase rate n; do
        printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "${specs[phase]}" "$rate" "$n" >>"$RATES"
    done < <(awk 'match($0, / phase=[0-9]+ /) { p = substr($0, RSTART + 7, RLENGTH - 8)
                  if (match($0, / tokens_per_s=[0-9.]+ /)) { s[p] += substr($0, RSTART + 14, RLENGTH - 15); c[p]++ } }
             END { for (p in s) printf "%d %.2f %d\n", p, s[p] / c[p], c[p] }' "$log" | sort -n)
}

for task in passkey multikey; do
    for L in ${LENS//,/ }; do
        if [ "$REWIND" = 1 ]; then
            rewind_task "$task" "$L"
            continue
        fi
        for spec in $METHODS; do
            log="$OUT/logs/${task}_L${L}_${spec//[:\/]/_}.log"
            echo "== $task L=$L $spec" >&2
            # shellcheck disable=SC2046
            bench/model_passkey.sh "$BIN" "$OUT/$task" "$L" "$COUNT" $(opts_of "$spec" run) >"$log" 2>&1
            score=$(awk '/^passkey L=/ { print $NF }' "$log")
            [ -n "$score" ] || { echo "long_context.sh: no result in $log" >&2; tail -3 "$log" >&2; continue; }
            printf '%s\t%s\t%s\t%s\t%s\n' "$task" "$L" "$spec" "${score%/*}" "${score#*/}" >>"$TSV"
        done
    done
done

maxctx=0
for c in ${PPL_CTX//,/ }; do [ "$c" -gt "$maxctx" ] && maxctx=$c; done

# the rows of one ppl JSON into the TSV: its own method (spec) and, with --compare, each phase's
ppl_rows() { # JSON CTX SPEC [COMPARE_SPECS...]
    "$PYTHON" - "$@" >>"$TSV" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); ctx = sys.argv[2]; specs = sys.argv[3:]
rows = [j] + j.get("compare", [])
for spec, r in zip(specs, rows):
    kv = r.get("kv_fraction")
    print("ppl\t%s\t%s\t%.6f\t%s" % (ctx, spec, r["ppl"], "n/a" if kv is None else "%.4f" % kv))
PY
}

# REWIND=1: one ppl run per context, a dense prefix, then the 512 scored predictions with
# dense and each other method of PPL_METHODS (ppl --prefill-method dense --compare LIST)
if [ "$REWIND" = 1 ]; then
    others="" specs=(dense)
    for spec in $PPL_METHODS; do
        [ "$spec" = dense ] && continue
        others=${others:+$others,}$spec
        specs+=("$spec")
    done
    for c in ${PPL_CTX//,/ }; do
        json="$OUT/logs/ppl_${c}_rewind.json"
        echo "== ppl ctx=$c rewind: dense${others:+,$others}" >&2
        "$BIN" ppl --text "$TEXT" --ctx "$c" --windows 1 --offset $((maxctx - c)) --score-last 512 \
            --backend "$BACKEND" --prefill-method dense --method dense ${others:+--compare "$others"} \
            --json "$json" >"$OUT/logs/ppl_${c}_rewind.log" 2>&1 ||
            { echo "long_context.sh: ppl ctx=$c failed" >&2; continue; }
        ppl_rows "$json" "$c" "${specs[@]}"
    done
    PPL_METHODS="" # done: the per-method loop below has nothing left to run
fi
for c in ${PPL_CTX//,/ }; do
    for spec in $PPL_METHODS; do
        json="$OUT/logs/ppl_${c}_${spec//[:\/]/_}.json"
        echo "== ppl ctx=$c $spec" >&2
        # shellcheck disable=SC2046
        "$BIN" ppl --text "$TEXT" --ctx "$c" --windows 1 --offset $((maxctx - c)) --score-last 512 \
            $(opts_of "$spec") --json "$json" >"$OUT/logs/ppl_${c}_${spec//[:\/]/_}.log" 2>&1 ||
            { echo "long_context.sh: ppl ctx=$c $spec failed" >&2; continue; }
        ppl_rows "$json" "$c" "$spec"
    done
done

# exact methods against dense: the same answers counts and perplexities (to 1e-4 relative)
awk -F'\t' 'NR > 1 { m = $3; sub(/:.*/, "", m); key = $1 "\t" $2
        if ($3 == "dense") d[key] = $4; else if (m == "certified" || m == "screened") x[key "\t" $3] = $4 }
     END { bad = 0; n = 0
        for (k in x) { split(k, a, "\t"); dk = a[1] "\t" a[2]; if (!(dk in d)) continue; n++
            v = x[k] + 0; w = d[dk] + 0
            if ((a[1] == "ppl" && (v - w > 1e-4 * w || w - v > 1e-4 * w)) || (a[1] != "ppl" && v != w)) {
                bad++; print "exact method differs from dense: " k " " x[k] " vs " d[dk] } }
        printf "exact methods equal dense in %d of %d comparisons\n", n - bad, n }' "$TSV"
column -t -s $'\t' "$TSV" 2>/dev/null || cat "$TSV"
[ "$REWIND" = 1 ] && { column -t -s $'\t' "$RATES" 2>/dev/null || cat "$RATES"; }
exit 0
