#!/usr/bin/env bash
# CLI checks of the model subcommands (docs/cli.md) on the tiny test model:
#   - run, ppl, trace: --help exits 0 with usage; bad options exit 2 with one line on stderr;
#   - run greedy is deterministic, prints the prompt and ends with the stats lines;
#   - ppl writes the JSON fields of the contract; certified gives the dense perplexity and
#     top-k with budget 1 too, and screened (4- and 8-bit key codes) to 1e-6 relative; a
#     missing or broken model file exits 1 with a message;
#   - run with screened (as --method or in --compare) decodes the dense text;
#   - run --compare --rewind: every method continues the prompt (exact methods: dense's text);
#   - trace writes a file that eval reads (per-layer prefix), with the model's shapes;
#   - ppl --compare: one prefix per window, each method scoring the same tail (exact ones:
#     dense's ppl; topk: the ppl of topk after a dense --prefill-method); its usage errors;
#   - ppl stopped by SIGINT reports the partial result (exit 130, "interrupted" in the JSON),
#     with --compare for every phase that ran.
# Usage: test_model_cli.sh PATH/TO/entmaxkv DATA_DIR
set -u
BIN=${1:-}
DATA=${2:-}
if [ -z "$BIN" ] || [ ! -x "$BIN" ] || [ ! -d "$DATA" ]; then
    echo "usage: $0 PATH/TO/entmaxkv DATA_DIR" >&2
    exit 1
fi
MODEL="$DATA/tiny_model.safetensors"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/ekv_mcli.XXXXXX") || exit 1
trap 'rm -rf "$TMP"' EXIT
FAILS=0
CHECKS=0
check() { CHECKS=$((CHECKS + 1)); if [ "$2" -ne 0 ]; then echo "FAIL: $1" >&2; FAILS=$((FAILS + 1)); fi; }
OUT="$TMP/out"
ERR="$TMP/err"
run() { "$BIN" "$@" >"$OUT" 2>"$ERR"; RC=$?; }
nlines() { awk 'END { print NR }' "$1"; }

for sub in run ppl trace; do
    run "$sub" --help
    [ "$RC" -eq 0 ] && grep -qi usage "$OUT" && [ ! -s "$ERR" ]
    check "$sub --help should exit 0 with usage on stdout (rc=$RC)" $?
done

# a text to read: the golden script (ASCII, a few KB), twice
cat "$DATA/../golden/make_tiny_model.py" "$DATA/../golden/make_tiny_model.py" >"$TMP/text.txt"

usage() {
    run "$@"
    [ "$RC" -eq 2 ] && [ "$(nlines "$ERR")" -eq 1 ] && [ ! -s "$OUT" ]
    st=$?; check "'$*' should exit 2 with one line on stderr (rc=$RC: $(head -c 200 "$ERR"))" $st
}
usage run --bogus
usage run --model "$MODEL" --method fast
usage run --model "$MODEL" --budget 0
usage run --model "$MODEL" --budget 2
usage run --model "$MODEL" -n -3
usage run --model "$MODEL" --temp x
usage run --model "$MODEL" --prompt a --prompt-file b
usage run --model "$MODEL" --compare dense,nope
usage run --model "$MODEL" --rewind
usage run --model "$MODEL" --compare topk:2
usage run --model "$MODEL" --compare topk:x
usage run --model "$MODEL" --kv-dtype f8
usage run --model "$MODEL" --page 0
usage run --model "$MODEL" --method screened --code-bits 3
usage ppl --model "$MODEL" --text "$TMP/text.txt" --code-bits
usage ppl --model "$MODEL"
usage ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 1
usage ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 64 --score-last 64
usage ppl --text "$TMP/text.txt" --method
usage trace --model "$MODEL" --text "$TMP/text.txt"
usage trace --model "$MODEL" --text "$TMP/text.txt" --out "$TMP/x" --queries 0
usage trace --model "$MODEL" --text "$TMP/text.txt" --out "$TMP/x" --layers 7
usage trace --model "$MODEL" --text "$TMP/text.txt" --out "$TMP/x" --layers x
usage run --model "$MODEL" --backend ref
usage run --model "$MODEL" --backend gpu
usage run --model "$MODEL" --prefill-chunk 0
usage run --model "$MODEL" --prefill-kernel flash
# issue 32: empty list entries, a negative ratio's signs, a budget a method does not read and
# the evaluation-only oracle are refused, not run
usage run --model "$MODEL" --compare ,
usage run --model "$MODEL" --compare dense,,topk
usage ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --score-last 50 --compare topk,
usage trace --model "$MODEL" --text "$TMP/text.txt" --out "$TMP/x" --layers 1,,0
usage trace --model "$MODEL" --text "$TMP/text.txt" --out "$TMP/x" --layers ,
usage run --model "$MODEL" --compare topk:-1/-16
usage run --model "$MODEL" --budget -1/-16
usage run --model "$MODEL" --compare dense:0.5
usage run --model "$MODEL" --compare screened:1/4
usage run --model "$MODEL" --method oracle
usage run --model "$MODEL" --prefill-method oracle
usage run --model "$MODEL" --compare dense,oracle
usage ppl --model "$MODEL" --text "$TMP/text.txt" --method oracle
usage trace --model "$MODEL" --text "$TMP/text.txt" --out "$TMP/x" --method oracle
# the options of the cuda backend are refused on the cpu (they were silently ignored)
usage run --model "$MODEL" --no-graphs
usage run --model "$MODEL" --prefill-kernel gemm
usage run --model "$MODEL" --prefill-kernel hist
usage ppl --model "$MODEL" --text "$TMP/text.txt" --prefill-chunk 64
usage trace --model "$MODEL" --text "$TMP/text.txt" --out "$TMP/x" --prefill-kernel auto
usage run --model "$MODEL" --prefill-candidates 4
usage ppl --model "$MODEL" --text "$TMP/text.txt" --prefill-compact 16
usage trace --model "$MODEL" --text "$TMP/text.txt" --out "$TMP/x" --decode-candidates 4
# the cuda list sizes (ekv_model_params; they were environment variables): 1 .. their most
usage run --model "$MODEL" --backend cuda --prefill-candidates 0
usage run --model "$MODEL" --backend cuda --prefill-candidates 65537
usage run --model "$MODEL" --backend cuda --prefill-compact 65537
usage run --model "$MODEL" --backend cuda --decode-candidates 16385
usage run --model "$MODEL" --backend cuda --decode-candidates x
usage run --model "$MODEL" --fused-attend 1
usage run --model "$MODEL" --backend cuda --fused-attend 2
usage run --model "$MODEL" --overlap-launches 1
usage run --model "$MODEL" --backend cuda --overlap-launches 2
usage run --model "$MODEL" --backend cuda --overlap-launches -2
usage run --model "$MODEL" --tau-cluster 2
usage run --model "$MODEL" --backend cuda --tau-cluster 16
run run --model "$MODEL" --prefill-kernel fused --no-graphs --help
[ "$RC" -eq 0 ] && grep -qi usage "$OUT"
check "run --help with cuda options should still print the help (rc=$RC)" $?
# a temperature below the smallest double is a number in [0, 100] (it rounds), not bad usage
run run --model "$MODEL" --prompt "Hello" -n 2 --quiet --temp 1e-320
[ "$RC" -eq 0 ] && grep -q '^\[decode @5 dense\] 2 tokens' "$OUT"
st=$?; check "run --temp 1e-320 should run (rc=$RC: $(head -c 200 "$ERR"))" $st

# runtime failures: exit 1 with a message
run run --model "$TMP/none.safetensors" -n 1
[ "$RC" -eq 1 ] && grep -q "none.safetensors" "$ERR"
check "a missing model should exit 1 naming the file (rc=$RC)" $?
head -c 3000 "$MODEL" >"$TMP/cut.safetensors"
run run --model "$TMP/cut.safetensors" -n 1
[ "$RC" -eq 1 ] && [ -s "$ERR" ]
check "a truncated model should exit 1 with a message (rc=$RC)" $?
run ppl --model "$MODEL" --text "$TMP/none.txt"
[ "$RC" -eq 1 ] && [ -s "$ERR" ]
check "a missing text should exit 1 (rc=$RC)" $?

# --prefill-method: the prompt with one method, the generated tokens with another (certified:
# the same text as dense); the stats lines name each; a bad method exits 2
run run --model "$MODEL" --prompt "The LORD said" -n 16 --prefill-method dense --method certified
cp "$OUT" "$TMP/pm.txt"
run run --model "$MODEL" --prompt "The LORD said" -n 16
{ grep -q '^\[prefill dense\]' "$TMP/pm.txt" && grep -q '^\[decode @13 certified' "$TMP/pm.txt" &&
    [ "$(head -c 29 "$TMP/pm.txt")" = "$(head -c 29 "$OUT")" ]; }
check "run --prefill-method dense --method certified: dense prefill, certified decode, the dense text" $?
# screened decodes from key codes: the caches, made for the dense prefill, must hold them too
run run --model "$MODEL" --prompt "The LORD said" -n 16 --prefill-method dense --method screened
{ [ "$RC" -eq 0 ] && grep -q '^\[decode @13 screened' "$OUT" &&
    [ "$(head -c 29 "$OUT")" = "$(head -c 29 "$TMP/pm.txt")" ]; }
check "run --prefill-method dense --method screened: the dense text (rc=$RC)" $?
run run --model "$MODEL" --prompt "Hello" -n 1 --prefill-method nope
[ "$RC" -eq 2 ] && [ "$(wc -l <"$ERR")" -eq 1 ]
check "run --prefill-method nope should exit 2 with one line (rc=$RC)" $?

# --backend cuda: runs where the build has CUDA and a device is present, else exits 1 saying
# which is missing (gaussian too: its ALiBi mixture runs on the GPU)
run run --model "$MODEL" --prompt "Hello" -n 4 --backend cuda
{ [ "$RC" -eq 0 ] && grep -q "KV read not measured on cuda" "$OUT"; } ||
    { [ "$RC" -eq 1 ] && grep -qi "cuda" "$ERR"; }
st=$?; check "run --backend cuda should run or exit 1 naming what is missing (rc=$RC: $(head -c 200 "$ERR"))" $st
run run --model "$MODEL" --prompt "Hello" -n 4 --backend cuda --method gaussian
[ "$RC" -eq 0 ] || { [ "$RC" -eq 1 ] && grep -qi "cuda" "$ERR"; }
st=$?; check "run --backend cuda --method gaussian should run or exit 1 naming what is missing (rc=$RC: $(head -c 200 "$ERR"))" $st
# the cuda list sizes are options of every model subcommand, taken with --backend cuda
run run --model "$MODEL" --prompt "Hello" -n 4 --backend cuda --prefill-candidates 4 \
    --prefill-compact 2 --decode-candidates 4
[ "$RC" -eq 0 ] || { [ "$RC" -eq 1 ] && grep -qi "cuda" "$ERR"; }
st=$?; check "run --backend cuda with the list sizes should run or exit 1 naming what is missing (rc=$RC: $(head -c 200 "$ERR"))" $st
for sub in run ppl trace serve; do
    run "$sub" --help
    grep -q -- "--prefill-candidates N" "$OUT" && grep -q -- "--prefill-compact N" "$OUT" &&
        grep -q -- "--decode-candidates N" "$OUT" && grep -q -- "--fused-attend 0|1" "$OUT" &&
        grep -q -- "--overlap-launches -1|0|1" "$OUT" && grep -q -- "--tau-cluster K" "$OUT"
    check "$sub --help should list the cuda list sizes, --fused-attend, --overlap-launches and --tau-cluster" $?
done

# run --prompts-file: one prompt runs on the CPU too and generates what --prompt does; several
# need --backend cuda (exit 1 saying so where there is none)
printf 'Hello\n' >"$TMP/p1.txt"
run run --model "$MODEL" --prompt "Hello" -n 20 --threads 1
want=$(head -c 25 "$OUT" | tail -c 20)
run run --model "$MODEL" --prompts-file "$TMP/p1.txt" -n 20 --threads 1
[ "$RC" -eq 0 ] && [ "$(sed -n 2p "$OUT")" = "$want" ] && grep -q "^\[decode batch 1 dense\] 20 tokens" "$OUT"
check "run --prompts-file with one prompt should generate what --prompt does (rc=$RC)" $?
printf 'Hello\n\nworld\n' >"$TMP/p2.txt"
run run --model "$MODEL" --prompts-file "$TMP/p2.txt" -n 4
[ "$RC" -eq 1 ] && grep -qi "cuda" "$ERR"
check "run --prompts-file with two prompts on the CPU should exit 1 naming cuda (rc=$RC)" $?
usage run --model "$MODEL" --prompts-file "$TMP/p2.txt" --prompt x

# run: deterministic greedy output, the prompt echoed, stats at the end
run run --model "$MODEL" --prompt "Hello" -n 20 --threads 1
[ "$RC" -eq 0 ] && head -c 5 "$OUT" | grep -q Hello && grep -q "^\[decode @5 dense\] 20 tokens" "$OUT" && grep -q "KV read" "$OUT"
check "run should echo the prompt and end with the stats lines (rc=$RC)" $?
cp "$OUT" "$TMP/run1"
run run --model "$MODEL" --prompt "Hello" -n 20 --threads 2
[ "$RC" -eq 0 ] && [ "$(head -c 25 "$OUT")" = "$(head -c 25 "$TMP/run1")" ]
check "greedy run should not depend on the thread count" $?
run run --model "$MODEL" --prompt "Hello" -n 8 --method topk --compare certified,gaussian,dense --quiet
[ "$RC" -eq 0 ] && [ "$(grep -c '^\[decode' "$OUT")" -eq 4 ] && grep -q "round 2" "$OUT"
check "run --compare should print one decode line per method (rc=$RC)" $?
# screened is exact: the same greedy text as dense; in --compare the caches get codes at load
run run --model "$MODEL" --prompt "Hello" -n 20 --threads 1 --method screened
[ "$RC" -eq 0 ] && [ "$(head -c 25 "$OUT")" = "$(head -c 25 "$TMP/run1")" ] && grep -q "^\[decode @5 screened\] 20 tokens" "$OUT"
st=$?; check "run --method screened should decode the dense text (rc=$RC: $(head -c 200 "$ERR"))" $st
run run --model "$MODEL" --prompt "Hello" -n 8 --compare screened,dense --code-bits 8 --quiet
[ "$RC" -eq 0 ] && [ "$(grep -c '^\[decode' "$OUT")" -eq 3 ] && grep -q "^\[decode @13 screened\]" "$OUT"
st=$?; check "run --compare screened should decode with the screen (rc=$RC: $(head -c 200 "$ERR"))" $st
# --rewind: each method from the prompt's end again: certified and screened write dense's text
run run --model "$MODEL" --prompt "Hello" -n 20 --threads 1 --method dense --compare certified,screened,topk --budget 1/4 --rewind
txt=$(head -c 25 "$TMP/run1" | tail -c 20)
[ "$RC" -eq 0 ] && [ "$(grep -c '^\[decode @5 ' "$OUT")" -eq 4 ] &&
  [ "$(grep -c -F -- "$txt" "$OUT")" -ge 3 ] && grep -q -- "--- from the prompt with screened ---" "$OUT"
st=$?; check "run --compare --rewind: every method from the prompt, exact ones with dense's text (rc=$RC: $(head -c 200 "$ERR"))" $st
# ... and each stats line after the first says whether it wrote the first method's tokens
[ "$RC" -eq 0 ] && grep -q '^\[decode @5 certified 0.25\] .*; the same 20 tokens as dense$' "$OUT" &&
  grep -q '^\[decode @5 screened\] .*; the same 20 tokens as dense$' "$OUT" &&
  ! grep -q '^\[decode @5 dense\] .*tokens as' "$OUT"
st=$?; check "run --rewind: the exact methods' stats lines say they wrote dense's 20 tokens (rc=$RC)" $st
# a top-k budget of 1/256 over 4-token pages of a 3000-byte prompt reads too little to follow dense
head -c 3000 "$TMP/text.txt" >"$TMP/p3k.txt"
run run --model "$MODEL" --prompt-file "$TMP/p3k.txt" -n 16 --threads 1 --page 4 --method dense --compare topk:1/256 --rewind --quiet
[ "$RC" -eq 0 ] && grep -q '^\[decode @3000 topk 0.00390625\] .*; differs from dense at token [0-9]*$' "$OUT"
st=$?; check "run --rewind: a method that leaves dense's text is named with the first token that differs (rc=$RC: $(head -c 200 "$ERR"))" $st
# --superpage 0: caches without superpages (certified without its round 0), the same text
run run --model "$MODEL" --prompt "Hello" -n 20 --threads 1 --method dense --compare certified --budget 1/4 --rewind --superpage 0
[ "$RC" -eq 0 ] && [ "$(grep -c '^\[decode @5 ' "$OUT")" -eq 2 ] && [ "$(grep -c -F -- "$txt" "$OUT")" -ge 2 ]
st=$?; check "run --superpage 0: certified writes dense's text (rc=$RC: $(head -c 200 "$ERR"))" $st
usage run --model "$MODEL" --superpage -1
usage run --model "$MODEL" --superpage 4097
run run --model "$MODEL" --prompt "Hello" -n 4 --method topk --budget 1/2 --compare topk:1/64,dense,topk --rewind --quiet
[ "$RC" -eq 0 ] && grep -q '^\[decode @5 topk 0.5\]' "$OUT" && grep -q '^\[decode @5 topk 0.015625\]' "$OUT" &&
  [ "$(grep -c '^\[decode @5 topk 0.5\]' "$OUT")" -eq 2 ]
st=$?; check "run --compare method:budget: its own budget, the others --budget's (rc=$RC: $(head -c 200 "$ERR"))" $st

# ppl: the JSON contract; certified and top-k with every token equal dense
ppl_field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
run ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --windows 3 --json "$TMP/dense.json"
[ "$RC" -eq 0 ] && grep -q "^ppl " "$OUT"
st=$?; check "ppl dense should succeed (rc=$RC: $(head -c 200 "$ERR"))" $st
if command -v python3 >/dev/null 2>&1; then
    python3 - "$TMP/dense.json" <<'EOF'
import json, math, sys
j = json.load(open(sys.argv[1]))
for k in ("ppl", "tokens", "method", "kv_fraction", "bits_per_byte"):
    assert k in j, k
assert j["method"] == "dense" and j["tokens"] == 3 * 299 and j["ppl"] > 1
assert abs(j["bits_per_byte"] - math.log2(j["ppl"])) < 1e-6
assert 0 < j["kv_fraction"] <= 1
EOF
    check "ppl JSON should carry ppl, tokens, method, kv_fraction, bits_per_byte" $?
    for m in "certified --budget 1/16" "topk --budget 1"; do
        run ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --windows 3 --method $m --json "$TMP/m.json"
        python3 -c "
import json,sys
a=json.load(open('$TMP/dense.json')); b=json.load(open('$TMP/m.json'))
sys.exit(0 if abs(a['ppl']-b['ppl']) <= 1e-5*a['ppl'] else 1)"
        st=$?; check "ppl --method $m should equal dense ($(cat "$TMP/m.json" | head -c 100))" $st
    done
    for bits in 4 8; do
        run ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --windows 3 --method screened \
            --code-bits $bits --json "$TMP/m.json"
        python3 -c "
import json,sys
a=json.load(open('$TMP/dense.json')); b=json.load(open('$TMP/m.json'))
assert a['code_bits'] == 0 and a['survivors_mean'] is None, a
assert b['method'] == 'screened' and b['code_bits'] == $bits and b['survivors_mean'] > 0, b
sys.exit(0 if abs(a['ppl']-b['ppl']) <= 1e-6*a['ppl'] else 1)"
        st=$?; check "ppl --method screened --code-bits $bits should equal dense ($(head -c 200 "$TMP/m.json"))" $st
    done
    run ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --windows 2 --score-last 50 --json "$TMP/s.json"
    [ "$RC" -eq 0 ] && [ "$(ppl_field "$TMP/s.json" tokens)" = 100 ]
    check "ppl --score-last 50 over 2 windows should score 100 tokens" $?

    # --compare: one prefix per window, then each method's tail scored (docs/cli.md, "Prefix
    # and tail"): phase 0 is the plain run, the exact methods give its ppl, and a compare
    # phase is the same tail as a run of that method after a dense --prefill-method
    run ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --windows 2 --score-last 50 \
        --method dense --compare certified,topk:1/16,screened --json "$TMP/c.json"
    [ "$RC" -eq 0 ] && [ "$(grep -c '^ppl ' "$OUT")" -eq 4 ] && grep -q '^ppl .* method topk 0.0625 ' "$OUT"
    st=$?; check "ppl --compare should print one ppl line per phase (rc=$RC: $(head -c 200 "$ERR"))" $st
    run ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --windows 2 --score-last 50 \
        --method topk --budget 1/16 --prefill-method dense --json "$TMP/t.json"
    [ "$RC" -eq 0 ] && python3 - "$TMP/c.json" "$TMP/s.json" "$TMP/t.json" <<'EOF'
import json, sys
c, s, t = (json.load(open(f)) for f in sys.argv[1:4])
near = lambda a, b, tol: abs(a - b) <= tol * abs(b)
cmp = {x["method"]: x for x in c["compare"]}
assert [x["method"] for x in c["compare"]] == ["certified", "topk", "screened"], c
assert c["method"] == "dense" and c["tokens"] == 100 and c["prefill_method"] == "dense", c
assert all(x["tokens"] == 100 and x["tokens_per_s"] > 0 for x in c["compare"]), c
assert near(c["ppl"], s["ppl"], 1e-6), (c["ppl"], s["ppl"])
for m in ("certified", "screened"):
    assert near(cmp[m]["ppl"], c["ppl"], 1e-5), (m, cmp[m]["ppl"], c["ppl"])
assert cmp["topk"]["budget"] == 0.0625 and t["prefill_method"] == "dense", (cmp, t)
assert near(cmp["topk"]["ppl"], t["ppl"], 1e-6), (cmp["topk"]["ppl"], t["ppl"])
assert not near(cmp["topk"]["ppl"], c["ppl"], 1e-3), "topk 1/16 should not be dense here"
assert "compare" not in s and "prefill_method" not in s, s
EOF
    check "ppl --compare: phase 0 = the plain run, certified and screened = dense, topk = topk after a dense prefix" $?
fi
usage ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --compare certified
usage ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --prefill-method dense
usage ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --score-last 50 --compare nope
usage ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --score-last 50 --compare topk:2
usage ppl --model "$MODEL" --text "$TMP/text.txt" --ctx 300 --score-last 50 --prefill-method x

# --json and --out are checked before the run: a bad path fails at once (a run of minutes
# here), not after it (issue 32: ppl opened its JSON file only at the end)
for i in $(seq 1 150); do cat "$TMP/text.txt"; done >"$TMP/long.txt"
for sub in ppl trace; do
    if [ "$sub" = ppl ]; then args=(--ctx 8192 --windows 200 --json); else args=(--ctx 100000 --out); fi
    timeout 20 "$BIN" $sub --model "$MODEL" --text "$TMP/long.txt" --threads 1 "${args[@]}" "$TMP/no/such/dir/x" \
        >"$OUT" 2>"$ERR"
    RC=$?
    [ "$RC" -eq 1 ] && grep -q "cannot write $TMP/no/such/dir/x" "$ERR" && [ ! -s "$OUT" ]
    st=$?; check "$sub into a missing directory should fail before the run (rc=$RC: $(head -c 200 "$ERR"))" $st
done

# ppl on SIGINT: the predictions scored so far, exit 130. The text is long enough that the run
# cannot finish before the signal (5000 windows of 300 tokens).
"$BIN" ppl --model "$MODEL" --text "$TMP/long.txt" --ctx 300 --windows 5000 --json "$TMP/int.json" \
    >"$OUT" 2>"$ERR" &
pid=$!
sleep 2
kill -INT "$pid"
wait "$pid"
RC=$?
[ "$RC" -eq 130 ] && grep -q "interrupted" "$ERR" && python3 -c "
import json,sys
j=json.load(open('$TMP/int.json'))
assert j['interrupted'] is True and j['tokens'] > 0 and j['ppl'] > 1, j
assert j['windows_done'] < 5000 and j['tokens'] <= (j['windows_done'] + 1) * 299, j"
st=$?; check "ppl should report the partial result on SIGINT (rc=$RC: $(tail -c 300 "$ERR"))" $st
# ... and with --compare: every phase that ran in the interrupted window counts what it scored
"$BIN" ppl --model "$MODEL" --text "$TMP/long.txt" --ctx 300 --windows 5000 --score-last 50 \
    --compare certified --json "$TMP/int.json" >"$OUT" 2>"$ERR" &
pid=$!
sleep 2
kill -INT "$pid"
wait "$pid"
RC=$?
[ "$RC" -eq 130 ] && python3 -c "
import json,sys
j=json.load(open('$TMP/int.json')); c=j['compare'][0]; d=j['windows_done']
assert j['interrupted'] is True and 0 < d < 5000 and c['method'] == 'certified', j
assert d * 50 <= c['tokens'] <= j['tokens'] <= (d + 1) * 50 and c['ppl'] > 1, j"
st=$?; check "ppl --compare should report every phase's partial result on SIGINT (rc=$RC: $(tail -c 300 "$ERR"))" $st

# trace -> eval
run trace --model "$MODEL" --text "$TMP/text.txt" --ctx 400 --queries 4 --out "$TMP/t.safetensors"
[ "$RC" -eq 0 ] && [ -s "$TMP/t.safetensors" ]
st=$?; check "trace should write its file (rc=$RC: $(head -c 200 "$ERR"))" $st
run eval --workload "trace:$TMP/t.safetensors@l1." --budgets 1/4 --steps 4 --threads 1
[ "$RC" -eq 0 ] && grep -q "len=400 B=1 H=4 Hk=2 D=8" "$OUT" && grep -q "^certified" "$OUT"
st=$?; check "eval should read the trace of layer 1 with the model's shapes (rc=$RC: $(head -c 300 "$ERR"))" $st

# a trace that fails to write (here the file size limit, which binds root too) leaves the
# previous file as it was and no temporary file (docs/cli.md, "Common rules")
cp "$TMP/t.safetensors" "$TMP/keep.safetensors"
(trap '' XFSZ; ulimit -f 8; exec "$BIN" trace --model "$MODEL" --text "$TMP/text.txt" --ctx 400 --queries 4 \
    --offset 7 --out "$TMP/t.safetensors") >"$OUT" 2>"$ERR"
RC=$?
[ "$RC" -eq 1 ] && grep -q "writing $TMP/t.safetensors failed" "$ERR" && cmp -s "$TMP/t.safetensors" "$TMP/keep.safetensors" &&
    [ -z "$(ls "$TMP" | grep 't.safetensors.tmp')" ]
st=$?; check "trace: a failed write should keep the previous file (rc=$RC: $(head -c 300 "$ERR"))" $st

# run --prompts-file prints the progress of a long prefill as run --prompt-file does: wherever
# the single prompt's prefill printed two progress lines (> 4 s), the batch's prints one
head -c 20000 "$TMP/long.txt" | tr '\n' ' ' >"$TMP/longp.txt"
echo >>"$TMP/longp.txt"
run run --model "$MODEL" --prompt-file "$TMP/longp.txt" -n 1 --quiet --threads 1
single=$(grep -c 'tokens/s, ETA' "$ERR")
run run --model "$MODEL" --prompts-file "$TMP/longp.txt" -n 1 --quiet --threads 1
[ "$RC" -eq 0 ] && { [ "$single" -lt 2 ] || grep -q '^  prefill sequence 1/1: .* tokens/s, ETA' "$ERR"; }
st=$?; check "run --prompts-file should print prefill progress (single prompt: $single lines; rc=$RC: $(head -c 300 "$ERR"))" $st

if command -v python3 >/dev/null 2>&1; then
    # huge finite weights: logits that overflow fp32 are an error of the library (exit 1, the
    # JSON file untouched, no NUL bytes generated); finite but huge logits give a perplexity
    # beyond a double: exit 1, null in valid JSON (issue 32: inf, -nan, NUL bytes, exit 0)
    MINMODEL="$DATA/../fuzz/make_min_model.py"
    python3 "$MINMODEL" --norm 3e38 "$TMP/inf.safetensors" && python3 "$MINMODEL" --norm 1e30 "$TMP/big.safetensors"
    printf '{"previous": true}\n' >"$TMP/nf.json"
    run ppl --model "$TMP/inf.safetensors" --text "$TMP/text.txt" --ctx 100 --windows 2 --json "$TMP/nf.json"
    [ "$RC" -eq 1 ] && grep -q "logits .* are not finite" "$ERR" && [ "$(cat "$TMP/nf.json")" = '{"previous": true}' ]
    st=$?; check "ppl with overflowing logits should exit 1 naming them, the JSON file kept (rc=$RC: $(head -c 300 "$ERR"))" $st
    run run --model "$TMP/inf.safetensors" --prompt "Hello" -n 8
    [ "$RC" -eq 1 ] && grep -q "logits .* are not finite" "$ERR" && [ "$(tr -d '\000' <"$OUT" | wc -c)" -eq "$(wc -c <"$OUT")" ]
    st=$?; check "run with overflowing logits should exit 1 without NUL bytes (rc=$RC: $(head -c 300 "$ERR"))" $st
    run ppl --model "$TMP/big.safetensors" --text "$TMP/text.txt" --ctx 100 --windows 2 --json "$TMP/nf.json"
    [ "$RC" -eq 1 ] && grep -q "perplexity overflows a double" "$ERR" && grep -q '^ppl inf ' "$OUT" && python3 -c "
import json, math, sys
def bad(c): raise ValueError('not JSON: ' + c)
j = json.loads(open(sys.argv[1]).read(), parse_constant=bad)
assert j['ppl'] is None and math.isfinite(j['bits_per_byte']) and j['tokens'] == 198, j" "$TMP/nf.json"
    st=$?; check "ppl beyond a double should exit 1 with valid JSON (ppl null) (rc=$RC: $(head -c 300 "$ERR"))" $st

    # the loader's shape message: [16], not [160] (a stray 0 printed for a vector)
    python3 -c "
import sys
b = open(sys.argv[1], 'rb').read()
a = b'\"norm.weight\":{\"dtype\":\"F16\",\"shape\":[32]'
assert a in b
open(sys.argv[2], 'wb').write(b.replace(a, a.replace(b'F16', b'F32').replace(b'[32]', b'[16]'), 1))" \
        "$MODEL" "$TMP/shape.safetensors"
    run run --model "$TMP/shape.safetensors" -n 1
    [ "$RC" -eq 1 ] && grep -qF "tensor 'norm.weight' has shape [16] (ndim 1), expected [32]" "$ERR"
    st=$?; check "a model with a wrong vector shape should say [16] and [32] (rc=$RC: $(head -c 300 "$ERR"))" $st

    # trace handles every layer a model may have (the loader's 1024), not the first 256
    python3 "$MINMODEL" --layers 300 "$TMP/deep.safetensors"
    run trace --model "$TMP/deep.safetensors" --text "$TMP/text.txt" --ctx 64 --queries 2 --out "$TMP/deep_t.safetensors"
    [ "$RC" -eq 0 ] && grep -q ": 300 layers," "$OUT"
    st=$?; check "trace of a 300-layer model should write 300 layers (rc=$RC: $(head -c 200 "$OUT") $(head -c 200 "$ERR"))" $st
    run eval --workload "trace:$TMP/deep_t.safetensors@l299." --steps 1 --budgets 1 --threads 1
    [ "$RC" -eq 0 ] && grep -q "len=64 " "$OUT"
    st=$?; check "eval should read layer 299 of the trace (rc=$RC: $(head -c 200 "$ERR"))" $st
    run trace --model "$TMP/deep.safetensors" --text "$TMP/text.txt" --ctx 64 --queries 2 \
        --layers "$(seq -s, 299 -1 0)" --out "$TMP/deep_t.safetensors"
    [ "$RC" -eq 0 ] && grep -q ": 300 layers," "$OUT"
    st=$?; check "trace --layers of all 300 layers should write them (rc=$RC: $(head -c 200 "$ERR"))" $st
fi

echo "test_model_cli: $CHECKS checks, $FAILS failures"
[ "$FAILS" -eq 0 ]
