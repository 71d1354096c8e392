#!/usr/bin/env bash
# CLI contract checks (docs/cli.md).  Usage: test_cli.sh PATH/TO/entmaxkv
# Exit 0 = every check passed, 1 = a check failed (each failure is printed).
#   - --help of the tool and of each subcommand: exit 0, usage on stdout;
#   - bad usage (unknown subcommand/option, bad values): exit 2 and a one-line reason
#     on stderr, nothing on stdout;
#   - entmax: %.9g probabilities from stdin lines, -inf masking, --json objects with
#     p, tau, support; a bad number exits 1 naming the line;
#   - bench: a tiny workload writes a JSON array whose rows carry the contract fields.
# Uses python3 for JSON checks when it is available, grep otherwise. Takes a few seconds.
set -u

BIN=${1:-}
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
    echo "usage: $0 PATH/TO/entmaxkv  (got '${BIN}', not an executable)" >&2
    exit 1
fi
BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")" # absolute: some checks run elsewhere

TMP=$(mktemp -d "${TMPDIR:-/tmp}/ekv_cli.XXXXXX") || exit 1
trap 'rm -rf "$TMP"' EXIT

FAILS=0
CHECKS=0
fail() { echo "FAIL: $*" >&2; FAILS=$((FAILS + 1)); }
check() { # check DESCRIPTION CONDITION-STATUS (capture $? first when DESCRIPTION runs a $(...):
          # a command substitution in the arguments would reset $? to its own status)
    CHECKS=$((CHECKS + 1))
    if [ "$2" -ne 0 ]; then fail "$1"; fi
}

PY=""
if command -v python3 >/dev/null 2>&1 && python3 -c 'import json, math' >/dev/null 2>&1; then PY=python3; fi
TIMEOUT=""
if command -v timeout >/dev/null 2>&1; then TIMEOUT="timeout 120"; fi

# run INPUT ARGS... : runs the tool with INPUT on stdin; sets RC, OUT, ERR (file paths).
OUT="$TMP/out"
ERR="$TMP/err"
run() {
    local input=$1
    shift
    printf '%s' "$input" | $TIMEOUT "$BIN" "$@" >"$OUT" 2>"$ERR"
    RC=$?
}
nlines() { awk 'END { print NR }' "$1"; }
show() { echo "    stdout: $(head -c 300 "$OUT" | tr '\n' '|')" >&2; echo "    stderr: $(head -c 300 "$ERR" | tr '\n' '|')" >&2; }

# ---------------------------------------------------------------------------------- help
expect_help() { # ARGS...
    run "" "$@"
    local ok=0
    [ "$RC" -eq 0 ] || ok=1
    grep -qi 'usage' "$OUT" || ok=1
    [ ! -s "$ERR" ] || ok=1
    check "'$*' should exit 0 and print usage on stdout (rc=$RC)" $ok
    [ $ok -eq 0 ] || show
}
expect_help --help
expect_help -h
expect_help help
expect_help entmax --help
expect_help entmax -h
expect_help bench --help
expect_help bench -h

# the main help names the subcommands
run "" --help
grep -q 'entmax' "$OUT" && grep -q 'bench' "$OUT"
check "main --help should list the entmax and bench subcommands" $?

# no subcommand at all is bad usage
run ""
[ "$RC" -eq 2 ] && [ -s "$ERR" ]
check "no arguments should exit 2 with usage on stderr (rc=$RC)" $?

# ---------------------------------------------------------------------------- bad usage
expect_usage_error() { # ARGS...
    run "1 2 3"$'\n' "$@"
    local ok=0 n
    n=$(nlines "$ERR")
    [ "$RC" -eq 2 ] || ok=1
    [ "$n" -eq 1 ] || ok=1
    grep -q '[^[:space:]]' "$ERR" || ok=1
    [ ! -s "$OUT" ] || ok=1
    check "'$*' should exit 2 with a one-line reason on stderr (rc=$RC, $n stderr lines)" $ok
    [ $ok -eq 0 ] || show
}
expect_usage_error frob
expect_usage_error --frob
expect_usage_error entmax --frob
expect_usage_error entmax --alpha x
expect_usage_error entmax --alpha 9
expect_usage_error entmax --alpha 0.5
expect_usage_error entmax --alpha 0
expect_usage_error entmax --alpha -1
expect_usage_error entmax --alpha nan
expect_usage_error entmax --alpha 1.5x
expect_usage_error entmax --alpha
expect_usage_error bench --frob
expect_usage_error bench --alpha x
expect_usage_error bench --alpha 9
expect_usage_error bench --alpha 0.99
expect_usage_error bench --heads 6 --kv-heads 4
expect_usage_error bench --kv-heads 4 --heads 6
expect_usage_error bench --heads 0
expect_usage_error bench --heads x
expect_usage_error bench --kv-heads 0
expect_usage_error bench --dim 0
expect_usage_error bench --dim 64x
expect_usage_error bench --dtype f8
expect_usage_error bench --dtype ''
expect_usage_error bench --method foo
expect_usage_error bench --page 0
expect_usage_error bench --page 257
expect_usage_error bench --page -1
expect_usage_error bench --len 0
expect_usage_error bench --len abc
expect_usage_error bench --len 256,x
expect_usage_error bench --len
expect_usage_error bench --batch 0
expect_usage_error bench --threads -1
expect_usage_error bench --iters 0
expect_usage_error bench --backend foo
expect_usage_error bench --workload foo
expect_usage_error bench --isa foo
expect_usage_error bench --method topk --budget 0
expect_usage_error bench --method topk --budget 1.5
expect_usage_error bench --method topk --budget 1/0
expect_usage_error bench --method topk --budget-tokens 0
expect_usage_error bench --method screened --code-bits 2
expect_usage_error bench --method screened --code-bits x
expect_usage_error bench --method screened --code-bits
# the sharded options are for --backend cuda; --shard-pools needs --shards or --gpus and a
# synthetic workload (usage errors before any device is touched, in every build)
expect_usage_error bench --shards 2
expect_usage_error bench --gpus 2
expect_usage_error bench --shard-pools
expect_usage_error bench --shard-pools --shards 2
expect_usage_error bench --backend cuda --shard-pools
expect_usage_error bench --backend cuda --shards 2 --gpus 2
expect_usage_error bench --backend cuda --gpus 2 --shard-pools --workload trace:none.safetensors
# the reference backend does not screen (the library's support check: exit 2); a build without
# CUDA refuses --backend cuda (exit 2); a CUDA build on a machine without a GPU says so in one
# line and exits 1 (a runtime condition, not bad usage); with a GPU the run succeeds
expect_usage_error bench --backend ref --method screened --len 64
run "" bench --backend cuda --method screened --len 64 --iters 1 --warmup 0
if [ "$RC" -eq 2 ]; then
    expect_usage_error bench --backend cuda --method screened --len 64
else
    { [ "$RC" -eq 0 ] || { [ "$RC" -eq 1 ] && [ "$(nlines "$ERR")" -eq 1 ] && grep -qi "cuda" "$ERR"; }; }
    check "'bench --backend cuda' in a CUDA build: runs, or exits 1 naming the missing device (rc=$RC)" $?
fi
expect_usage_error eval --methods foo
expect_usage_error eval --budgets 0
expect_usage_error eval --budgets 2
expect_usage_error eval --alpha 1
expect_usage_error eval --workload nope
expect_usage_error eval --heads 6 --kv-heads 4
expect_usage_error eval --bogus
# every list option is one comma list without empty entries (issue 32: ',' gave an empty table)
expect_usage_error eval --methods ,
expect_usage_error eval --methods entmax-topk,,oracle
expect_usage_error eval --budgets 1/4,
expect_usage_error bench --len 64,,128
expect_usage_error bench --len ,64
# a ratio's denominator is positive: -1/-16 is not 1/16
expect_usage_error bench --method topk --budget -1/-16
expect_usage_error eval --budgets -1/-4
# a number below the smallest double is a (rounded) number, and said to be out of range as such
run "" entmax --alpha 1e-320
[ "$RC" -eq 2 ] && grep -q -- "--alpha 1e-320 is outside \[1, 4\]" "$ERR"
st=$?; check "entmax --alpha 1e-320 should be out of [1, 4], not 'not a number' (rc=$RC: $(head -c 200 "$ERR"))" $st

# Subcommands of later issues: until they exist they must refuse cleanly (exit 2, one
# line); once they exist, their --help must work.
for sub in eval run ppl trace; do
    run "" "$sub" --help
    if [ "$RC" -eq 0 ]; then
        grep -qi 'usage' "$OUT"
        check "'$sub --help' exited 0 but printed no usage" $?
    else
        [ "$RC" -eq 2 ] && [ "$(nlines "$ERR")" -eq 1 ]
        check "'$sub --help' should exit 0 (implemented) or 2 with one line (not yet; rc=$RC)" $?
    fi
done

# --------------------------------------------------------------------------------- entmax
# expect_line INPUT EXPECTED ARGS... : exact text of a single output line
expect_line() {
    local input=$1 want=$2
    shift 2
    run "$input" "$@"
    [ "$RC" -eq 0 ] && [ "$(cat "$OUT")" = "$want" ] && [ "$(nlines "$OUT")" -eq 1 ]
    st=$?; check "'$*' on '${input%$'\n'}' should print '$want' (rc=$RC, got '$(head -c 200 "$OUT")')" $st
}
# expect_close INPUT "P1 P2 ..." TOL ARGS... : numeric comparison field by field
expect_close() {
    local input=$1 want=$2 tol=$3
    shift 3
    run "$input" "$@"
    local got
    got=$(cat "$OUT")
    [ "$RC" -eq 0 ] && awk -v got="$got" -v want="$want" -v tol="$tol" 'BEGIN {
        n = split(got, g, " "); m = split(want, w, " ");
        if (n != m) exit 1;
        for (i = 1; i <= n; i++) { d = g[i] - w[i]; if (d < 0) d = -d; if (d > tol) exit 1; }
        exit 0 }'
    check "'$*' on '${input%$'\n'}' should be within $tol of '$want' (rc=$RC, got '$got')" $?
}

expect_line $'1 2 3\n' "0 0 1" entmax --alpha 2
expect_line $'0 0\n' "0.5 0.5" entmax --alpha 1
expect_line $'0 0\n' "0.5 0.5" entmax --alpha 1.5
expect_line $'5\n' "1" entmax --alpha 3
expect_line $'1 -inf 3\n' "0 0 1" entmax --alpha 2
expect_line $'0 -inf 0\n' "0.5 0 0.5" entmax --alpha 1
expect_line $'  1\t2   3  \n' "0 0 1" entmax --alpha 2
expect_close $'1 2 3\n' "0 0.1692811 0.8307189" 1e-6 entmax --alpha 1.5
expect_close $'1 2 3\n' "0 0.1692811 0.8307189" 1e-6 entmax
expect_close $'1 2 3\n' "0.09003057 0.24472847 0.66524096" 1e-6 entmax --alpha 1
expect_close $'1 -inf 2 3\n' "0 0 0.1692811 0.8307189" 1e-6 entmax --alpha 1.5
expect_close $'-inf 1 2 3\n' "0 0 0.1692811 0.8307189" 1e-6 entmax
expect_close $'1 2 -inf\n' "0.26894142 0.73105858 0" 1e-6 entmax --alpha 1

# %.9g: at most 9 significant digits per number
run $'0.1 0.2 0.3 0.7 1.1\n' entmax --alpha 1
[ "$RC" -eq 0 ] && awk '{ for (i = 1; i <= NF; i++) { s = $i; sub(/^-/, "", s); sub(/[eE].*/, "", s);
    gsub(/\./, "", s); sub(/^0+/, "", s); if (length(s) > 9) exit 1 } } END { exit NR == 1 ? 0 : 1 }' "$OUT"
st=$?; check "entmax output should use %.9g (got '$(head -c 200 "$OUT")')" $st

# several lines in, one line out per vector; blank lines are skipped
run $'1 2 3\n0 0\n\n4\n' entmax --alpha 2
[ "$RC" -eq 0 ] && [ "$(nlines "$OUT")" -eq 3 ] && [ "$(sed -n 2p "$OUT")" = "0.5 0.5" ] && [ "$(sed -n 3p "$OUT")" = "1" ]
st=$?; check "entmax should print one line per input vector (rc=$RC, got '$(tr '\n' '|' <"$OUT")')" $st

# --json
JSON_IN=$'1 2 3\n0 0\n1 -inf 3\n0.5 -1 2 0.25 7\n'
for a in 1 1.5 2 3; do
    run "$JSON_IN" entmax --alpha "$a" --json
    if [ "$RC" -ne 0 ]; then
        check "entmax --json --alpha $a exited $RC" 1
        show
        continue
    fi
    if [ -n "$PY" ]; then
        $PY - "$OUT" "$a" <<'EOF'
import json, math, sys
path, alpha = sys.argv[1], float(sys.argv[2])
inputs = [[1, 2, 3], [0, 0], [1, -math.inf, 3], [0.5, -1, 2, 0.25, 7]]
lines = [l for l in open(path).read().splitlines()]
assert len(lines) == len(inputs), "%d json lines for %d inputs" % (len(lines), len(inputs))
for line, x in zip(lines, inputs):
    o = json.loads(line)
    assert isinstance(o, dict), line
    for k in ("p", "tau", "support"):
        assert k in o, "key %s missing in %s" % (k, line)
    p, tau, sup = o["p"], o["tau"], o["support"]
    assert len(p) == len(x), line
    assert all(isinstance(v, (int, float)) and v >= 0 for v in p), line
    assert abs(sum(p) - 1) < 1e-6, "sum p = %r in %s" % (sum(p), line)
    assert isinstance(sup, int) and sup == sum(1 for v in p if v > 0), "support %r vs p in %s" % (sup, line)
    for xi, pi in zip(x, p):
        if xi == -math.inf:
            assert pi == 0, line
    # tau in z-space: p_j = [(a-1) x_j - tau]_+^(1/(a-1)); softmax: p_j = exp(x_j - tau)
    for xi, pi in zip(x, p):
        if xi == -math.inf:
            continue
        if alpha == 1:
            want = math.exp(xi - tau)
        else:
            d = (alpha - 1) * xi - tau
            want = d ** (1 / (alpha - 1)) if d > 0 else 0.0
        assert abs(want - pi) < 1e-5, "p=%r but tau gives %r in %s" % (pi, want, line)
EOF
        check "entmax --json --alpha $a: JSON lines with p, tau, support consistent with docs/math.md §0" $?
    else
        [ "$(nlines "$OUT")" -eq 4 ] && [ "$(grep -c '^{"p":\[.*\],"tau":[-0-9.eE+]*,"support":[0-9]*}$' "$OUT")" -eq 4 ]
        check "entmax --json --alpha $a: 4 lines of {\"p\":[...],\"tau\":t,\"support\":k}" $?
    fi
done
run $'0 0\n' entmax --alpha 1 --json
if [ -n "$PY" ]; then
    $PY -c 'import json, math, sys; o = json.loads(open(sys.argv[1]).read()); assert abs(o["tau"] - math.log(2)) < 1e-9 and o["support"] == 2 and o["p"] == [0.5, 0.5], o' "$OUT"
else
    grep -q '"tau":0.6931471805' "$OUT" && grep -q '"support":2' "$OUT"
fi
st=$?; check "softmax --json of '0 0': tau = log 2, support 2 (got '$(head -c 200 "$OUT")')" $st

# runtime errors in the input: exit 1, message naming the line
expect_input_error() { # INPUT LINE-NUMBER ARGS...
    local input=$1 ln=$2
    shift 2
    run "$input" entmax "$@"
    [ "$RC" -eq 1 ] && grep -q "line $ln\b" "$ERR"
    st=$?; check "entmax $* on '$(printf '%s' "$input" | tr '\n' '|')' should exit 1 naming line $ln (rc=$RC, stderr '$(head -c 200 "$ERR")')" $st
}
expect_input_error $'1 2 3\n4 x 5\n' 2
expect_input_error $'abc\n' 1
expect_input_error $'1 2\n\n3 4,5\n' 3
expect_input_error $'1 2 3\n1 nan 3\n' 2 --alpha 1.5
expect_input_error $'1 inf 3\n' 1 --alpha 2
expect_input_error $'-inf -inf\n' 1 --alpha 1
# finite numbers beyond f32 are out of range, not masked (-1e39 read as -inf) nor "NaN or +inf"
for x in -1e39 1e39 1e999 3.40282357e38; do
    run "$x 0"$'\n' entmax
    [ "$RC" -eq 1 ] && grep -q "line 1: '$x' is outside the range of f32" "$ERR" && [ ! -s "$OUT" ]
    st=$?; check "entmax on '$x 0' should exit 1: outside the range of f32 (rc=$RC, stderr '$(head -c 200 "$ERR")')" $st
done
expect_line $'1e-320 0\n' "0.5 0.5" entmax --alpha 1.5 # below f32's smallest: rounds to 0

# huge finite inputs: exact, finite probabilities and valid JSON (printed -nan before)
for a in 1 1.25 1.5 2 4; do
    expect_line $'2e16 0\n' "1 0" entmax --alpha "$a"
    expect_line $'-inf 3e38 -3e38\n' "0 1 0" entmax --alpha "$a"
    expect_line $'1e30 1e30\n' "0.5 0.5" entmax --alpha "$a"
    run $'2e16 0\n' entmax --alpha "$a" --json
    if [ -n "$PY" ]; then
        $PY -c 'import json, math, sys; o = json.loads(open(sys.argv[1]).read()); assert o["p"] == [1, 0] and o["support"] == 1 and math.isfinite(o["tau"]), o' "$OUT" 2>/dev/null
    else
        grep -q '^{"p":\[1,0\],"tau":[0-9.eE+]*,"support":1}$' "$OUT"
    fi
    st=$?; check "entmax --alpha $a --json of '2e16 0': valid JSON, p [1, 0] (got '$(head -c 200 "$OUT")')" $st
done
# unreadable stdin, NUL bytes and raw bytes: exit 1 with a message; no raw byte echoed
$TIMEOUT "$BIN" entmax <"$TMP" >"$OUT" 2>"$ERR"
RC=$?
[ "$RC" -eq 1 ] && grep -q 'cannot read stdin' "$ERR"
st=$?; check "entmax with a directory on stdin should exit 1 (rc=$RC, stderr '$(head -c 200 "$ERR")')" $st
printf '1 2\0 3\n' | $TIMEOUT "$BIN" entmax >"$OUT" 2>"$ERR"
RC=$?
[ "$RC" -eq 1 ] && grep -q 'line 1: contains a NUL byte' "$ERR" && [ ! -s "$OUT" ]
st=$?; check "entmax on a line with a NUL byte should exit 1 (rc=$RC, stderr '$(head -c 200 "$ERR")')" $st
printf '1 \377\033[31m 3\n' | $TIMEOUT "$BIN" entmax >"$OUT" 2>"$ERR"
RC=$?
[ "$RC" -eq 1 ] && grep -qF "'\xff\x1b[31m' is not a number" "$ERR" && ! LC_ALL=C grep -q "$(printf '[\033\377]')" "$ERR"
st=$?; check "entmax should escape invalid bytes in its error (rc=$RC, stderr '$(head -c 200 "$ERR" | od -c | head -2 | tr '\n' ' ')')" $st

# ---------------------------------------------------------------------------------- bench
# check_bench_json FILE ROWS EXPECTED-JSON-OBJECT : field presence, types, values
check_bench_json() {
    local file=$1 rows=$2 expect=$3
    if [ ! -s "$file" ]; then
        check "bench did not write $file" 1
        return
    fi
    if [ -n "$PY" ]; then
        $PY - "$file" "$rows" "$expect" <<'EOF'
import json, math, sys
path, nrows, expect = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
data = json.load(open(path))
assert isinstance(data, list), "not a JSON array"
assert len(data) == nrows, "%d rows, want %d" % (len(data), nrows)
required = ["backend", "method", "alpha", "len", "batch", "heads", "kv_heads", "dim", "page", "dtype",
            "ms_median", "ms_min", "bytes_read", "gbps", "kv_fraction", "bw_probe_gbps", "bw_ratio"]
strings = {"backend", "method", "dtype"}
for i, row in enumerate(data):
    assert isinstance(row, dict), "row %d is not an object" % i
    for k in required:
        assert k in row, "row %d lacks %s" % (i, k)
        v = row[k]
        if k in strings:
            assert isinstance(v, str) and v, "row %d: %s = %r" % (i, k, v)
        else:
            assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), \
                "row %d: %s = %r" % (i, k, v)
    for k, v in expect.items():
        if k == "len":
            assert row["len"] == v[i], "row %d: len %r, want %r" % (i, row["len"], v[i])
        else:
            assert row[k] == v, "row %d: %s = %r, want %r" % (i, k, row[k], v)
    assert 0 < row["ms_min"] <= row["ms_median"], row
    assert row["bytes_read"] > 0 and row["gbps"] > 0 and row["bw_probe_gbps"] > 0, row
    assert 0 < row["kv_fraction"] <= 1 + 1e-9, row
    if row["alpha"] == 1 and row["method"] == "dense":
        assert abs(row["kv_fraction"] - 1) < 1e-6, "softmax reads all of K and V: %r" % row
    if row["method"] == "topk":
        assert row["kv_fraction"] < 0.6, "top-k at a small budget reads a small fraction: %r" % row
    kv_total = 2 * row["len"] * row["batch"] * row["kv_heads"] * row["dim"] * {"f32": 4, "f16": 2, "bf16": 2}[row["dtype"]]
    assert abs(row["bytes_read"] / kv_total - row["kv_fraction"]) < 1e-4, "kv_fraction vs bytes_read: %r" % row
    assert abs(row["gbps"] / row["bw_probe_gbps"] - row["bw_ratio"]) <= 1e-3 + 1e-2 * row["bw_ratio"], \
        "bw_ratio != gbps / bw_probe_gbps: %r" % row
EOF
        check "bench JSON $file: array of $rows rows with the contract fields and values" $?
    else
        local ok=0 k
        head -c 1 "$file" | grep -q '\[' || ok=1
        tail -c 3 "$file" | grep -q '\]' || ok=1
        for k in backend method alpha len batch heads kv_heads dim page dtype ms_median ms_min bytes_read \
            gbps kv_fraction bw_probe_gbps bw_ratio; do
            [ "$(grep -o "\"$k\":" "$file" | wc -l)" -eq "$rows" ] || { ok=1; echo "  field $k: not in every row" >&2; }
        done
        check "bench JSON $file: array of $rows rows with the contract fields (grep)" $ok
    fi
}

J1="$TMP/bench1.json"
run "" bench --len 256,512 --heads 4 --kv-heads 2 --dim 64 --iters 3 --warmup 1 --threads 1 --json "$J1"
check "bench (tiny, cpu, entmax15) should exit 0 (rc=$RC, stderr '$(head -c 300 "$ERR")')" $([ "$RC" -eq 0 ]; echo $?)
check_bench_json "$J1" 2 '{"backend":"cpu","method":"dense","alpha":1.5,"len":[256,512],"batch":1,"heads":4,"kv_heads":2,"dim":64,"page":16,"dtype":"f16"}'
grep -q '^ *256 ' "$OUT" && grep -q '^ *512 ' "$OUT"
check "bench should print a table row per length" $?

# --len repeatable, reference backend, softmax, f32, batch 2, page 8
J2="$TMP/bench2.json"
run "" bench --backend ref --alpha 1 --dtype f32 --batch 2 --page 8 --len 40 --len 64 --heads 4 --kv-heads 4 \
    --dim 16 --iters 1 --warmup 0 --threads 1 --json "$J2"
check "bench (tiny, ref, softmax) should exit 0 (rc=$RC, stderr '$(head -c 300 "$ERR")')" $([ "$RC" -eq 0 ]; echo $?)
check_bench_json "$J2" 2 '{"backend":"ref","method":"dense","alpha":1,"len":[40,64],"batch":2,"heads":4,"kv_heads":4,"dim":16,"page":8,"dtype":"f32"}'

# top-k on every synthetic workload: JSON contract, a small kv_fraction
for wl in random planted heavy alibi; do
    J3="$TMP/bench_topk_$wl.json"
    run "" bench --method topk --budget 1/8 --workload $wl --len 512 --heads 4 --kv-heads 2 --dim 32 --iters 2 \
        --warmup 1 --threads 1 --json "$J3"
    check "bench --method topk --workload $wl should exit 0 (rc=$RC, stderr '$(head -c 300 "$ERR")')" $([ "$RC" -eq 0 ]; echo $?)
    check_bench_json "$J3" 1 '{"backend":"cpu","method":"topk","alpha":1.5,"len":[512],"heads":4,"kv_heads":2,"dim":32}'
done

# screened (CPU): the contract fields plus code_bits and survivors_mean; bytes_read counts the
# screen's page ranges (f16 by default with f16 K, f32 with --ranges f32) and codes; without
# --code-bits the codes are 8 bits (CLI_CODE_BITS_DEFAULT)
for bits in 4 8 f32 default; do
    J3="$TMP/bench_screened_$bits.json"
    ranges=f16
    if [ "$bits" = f32 ]; then bits=4; ranges=f32; fi
    opt="--code-bits $bits"
    if [ "$bits" = default ]; then bits=8; opt=""; fi
    run "" bench --method screened $opt --ranges $ranges --workload planted --len 512,700 \
        --heads 4 --kv-heads 2 --dim 32 --iters 2 --warmup 1 --threads 1 --json "$J3"
    check "bench --method screened ${opt:-(default code bits)} should exit 0 (rc=$RC, stderr '$(head -c 300 "$ERR")')" $([ "$RC" -eq 0 ]; echo $?)
    check_bench_json "$J3" 2 "{\"backend\":\"cpu\",\"method\":\"screened\",\"len\":[512,700],\"code_bits\":$bits}"
    if [ -n "$PY" ] && [ -s "$J3" ]; then
        $PY - "$J3" "$ranges" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1])):
    # the screen reads every page's range (2 x dim values) and every token's codes
    assert r["ranges"] == sys.argv[2], r
    pages, rb = -(-r["len"] // r["page"]), {"f16": 2, "f32": 4}[r["ranges"]]
    screen = r["kv_heads"] * (pages * 2 * r["dim"] * rb + r["len"] * r["dim"] * r["code_bits"] // 8)
    assert r["bytes_summary"] == screen and r["bytes_read"] > screen, r
    assert 0 < r["survivors_mean"] <= r["len"] and r["support_mean"] <= r["survivors_mean"], r
EOF
        check "bench --method screened ${opt:-(default code bits)} --ranges $ranges: survivors_mean and the screen's bytes" $?
    fi
done
J3="$TMP/bench_dense_codes.json"
run "" bench --len 256 --heads 4 --kv-heads 2 --dim 32 --iters 1 --warmup 0 --threads 1 --json "$J3"
grep -q '"code_bits":0,"survivors_mean":null' "$J3"
check "bench dense: code_bits 0 and survivors_mean null" $?

# eval: the JSON rows of docs/cli.md, oracle exact, entmax-topk exact at a full budget
J4="$TMP/eval.json"
run "" eval --workload planted --len 512 --heads 4 --kv-heads 2 --dim 32 --steps 2 --threads 1 \
    --budgets 1/16,1 --json "$J4"
check "eval (tiny) should exit 0 (rc=$RC, stderr '$(head -c 300 "$ERR")')" $([ "$RC" -eq 0 ]; echo $?)
if [ -n "$PY" ] && [ -s "$J4" ]; then
    $PY - "$J4" <<'EOF'
import json, math, sys
rows = json.load(open(sys.argv[1]))
need = ["method", "budget", "kv_fraction", "delta_mean", "delta_max", "recall_mean", "recall_min",
        "rel_err_mean", "rel_err_max", "cosine_min"]
for r in rows:
    for k in need:
        assert k in r, "eval row lacks %s: %r" % (k, r)
by = {(r["method"], r["budget"]): r for r in rows}
assert {m for m, _ in by} == {"softmax-topk", "entmax-topk", "gaussian", "certified", "certified-gauss",
                              "screened-4", "screened-8", "oracle"}, by.keys()
# every row: bytes read / K+V bytes; oracle reads the fewest K+V rows of any exact method
for r in rows:
    assert 0 < r["bytes_fraction"] and r["code_bits"] in (0, 4, 8), r
    assert (r["survivors_fraction"] is None) == (r["code_bits"] == 0), r
for b in (4, 8):
    s = [r for r in rows if r["method"] == "screened-%d" % b]
    assert len(s) == 1 and s[0]["code_bits"] == b and s[0]["budget"] is None, s
    s = s[0]
    # exact: the dense output and the whole support in its pages
    assert s["delta_max"] == 0 and s["recall_min"] == 1 and s["rel_err_max"] < 1e-5, s
    assert 0 < s["survivors_fraction"] < 1 and s["bytes_vs_dense_entmax"] > 0, s
    assert s["kv_fraction"] >= by[("oracle", None)]["kv_fraction"] - 1e-12, s
for r in rows:
    if r["method"] in ("certified", "certified-gauss"):
        assert r["delta_max"] == 0 and r["rel_err_max"] < 1e-5 and r["certified_fraction"] == 1, r
        assert 0 <= r["round2_fraction"] <= 1 and 0 <= r["pages_bound_above_tau"] <= 1, r
    if r["method"] == "entmax-topk":
        assert r["delta_bound_max"] is not None and r["delta_bound_max"] + 1e-9 >= r["delta_max"], r
g = [r for r in rows if r["method"] == "gaussian"]
assert len(g) == 1 and g[0]["budget"] is None and "tau_err_mean" in g[0] and g[0]["tau_mode"] == "exact", g
# exact mode: whatever the gaussian selector lists, decode is exact on it, so no error when nothing is dropped
assert g[0]["delta_max"] > 0 or g[0]["rel_err_max"] < 1e-5, g
o = [r for r in rows if r["method"] == "oracle"]
assert len(o) == 1 and o[0]["delta_max"] == 0 and o[0]["recall_min"] == 1 and o[0]["rel_err_max"] < 1e-5, o
full = by[("entmax-topk", 1)]
assert full["delta_max"] == 0 and full["recall_min"] == 1 and full["kv_fraction"] == 1, full
for r in rows:
    assert 0 <= r["delta_mean"] <= r["delta_max"] <= 1 + 1e-6 and 0 <= r["recall_min"] <= r["recall_mean"] <= 1 + 1e-9, r
EOF
    check "eval JSON: contract fields and sane values" $?
fi
grep -q 'entmax-topk' "$OUT" && grep -q 'softmax-topk' "$OUT"
check "eval should print a table with every method" $?
# --plot writes a real PNG when matplotlib is there (skipped otherwise)
if [ -n "$PY" ] && $PY -c 'import matplotlib' 2>/dev/null; then
    run "" eval --len 256 --heads 2 --kv-heads 1 --dim 16 --steps 1 --threads 1 --json "$TMP/e2.json" --plot "$TMP/e2.png"
    [ "$RC" -eq 0 ] && [ "$(head -c 4 "$TMP/e2.png" | tail -c 3)" = "PNG" ]
    st=$?; check "eval --plot should write a PNG (rc=$RC, stderr '$(head -c 300 "$ERR")')" $st
fi

# trace:FILE workloads (the synthetic trace writer needs only python3's standard library)
if [ -n "$PY" ]; then
    TR="$TMP/trace.safetensors"
    $PY "$(dirname "$0")/../bench/make_trace.py" "$TR" 600 3 4 2 32 f16 7
    J5="$TMP/eval_trace.json"
    run "" eval --workload "trace:$TR" --steps 3 --threads 1 --budgets 1/8,1 --json "$J5"
    check "eval on a trace should exit 0 (rc=$RC, stderr '$(head -c 300 "$ERR")')" $([ "$RC" -eq 0 ]; echo $?)
    $PY - "$J5" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
assert all(r["workload"] == "trace" and r["len"] == 600 and r["heads"] == 4 and r["kv_heads"] == 2 and r["dim"] == 32 for r in rows), rows
full = [r for r in rows if r["method"] == "entmax-topk" and r["budget"] == 1][0]
assert full["delta_max"] == 0 and full["rel_err_max"] < 1e-5, full
EOF
    check "eval trace JSON: shapes from the trace, exact at a full budget" $?
    run "" bench --workload "trace:$TR" --method topk --budget 1/4 --iters 2 --warmup 1 --threads 1 --json "$TMP/bt.json"
    check "bench on a trace should exit 0 (rc=$RC)" $([ "$RC" -eq 0 ]; echo $?)
    check_bench_json "$TMP/bt.json" 1 '{"method":"topk","len":[600],"heads":4,"kv_heads":2,"dim":32}'
    head -c 100 "$TR" > "$TMP/bad.safetensors"
    run "" eval --workload "trace:$TMP/bad.safetensors" --steps 1
    [ "$RC" -eq 1 ] && grep -q safetensors "$ERR"
    st=$?; check "eval on a truncated trace should exit 1 naming the problem (rc=$RC, '$(head -c 200 "$ERR")')" $st
fi

# an unwritable JSON path is a runtime failure
run "" bench --len 64 --heads 2 --kv-heads 1 --dim 8 --iters 1 --warmup 0 --threads 1 --json "$TMP/no/such/dir/x.json"
[ "$RC" -eq 1 ] && [ -s "$ERR" ]
check "bench --json into a missing directory should exit 1 with a message (rc=$RC)" $?
# ... found before the run, not after it (issue 32: eval opened its --json only at the end): a
# run of minutes fails at once
for path in "$TMP/no/such/dir/x.json" "$TMP"; do
    printf '' | timeout 20 "$BIN" eval --len 65536 --heads 4 --kv-heads 1 --dim 32 --steps 100000 --threads 1 \
        --json "$path" >"$OUT" 2>"$ERR"
    RC=$?
    [ "$RC" -eq 1 ] && grep -q "cannot write $path" "$ERR" && [ ! -s "$OUT" ]
    st=$?; check "eval --json $path should fail before the run (rc=$RC, stderr '$(head -c 200 "$ERR")')" $st
done
# a JSON file is written whole or not at all: a write that fails (here the file size limit,
# which binds root too) leaves the previous file as it was and no temporary file, the table
# still printed (docs/cli.md, "Common rules")
printf '{"previous": true}\n' >"$TMP/keep.json"
(trap '' XFSZ; ulimit -f 1; exec "$BIN" bench --len 64,128,256 --heads 2 --kv-heads 1 --dim 8 --iters 1 \
    --warmup 0 --threads 1 --json "$TMP/keep.json" </dev/null) 2>"$ERR" | cat >"$OUT"
RC=${PIPESTATUS[0]}
[ "$RC" -eq 1 ] && grep -q "writing $TMP/keep.json failed" "$ERR" && grep -q '^ *256 ' "$OUT" &&
    [ "$(cat "$TMP/keep.json")" = '{"previous": true}' ] && [ -z "$(ls "$TMP" | grep 'keep.json.tmp')" ]
st=$?; check "bench --json: a failed write keeps the previous file and prints the table (rc=$RC, stderr '$(head -c 300 "$ERR")')" $st
# a device is written in place (not replaced): /dev/full fails the write, the table is printed
run "" bench --len 64 --heads 2 --kv-heads 1 --dim 8 --iters 1 --warmup 0 --threads 1 --json /dev/full
[ "$RC" -eq 1 ] && grep -q "writing /dev/full failed" "$ERR" && grep -q '^ *64 ' "$OUT" && [ -c /dev/full ]
st=$?; check "bench --json /dev/full should print the table and exit 1 (rc=$RC, stderr '$(head -c 300 "$ERR")')" $st

# --json -: the JSON alone on stdout (parseable), the human table on stderr; no file named '-'
JDIR="$TMP/jsondash"
mkdir -p "$JDIR"
for sub in bench eval; do
    if [ "$sub" = bench ]; then args=(bench --len 64,128 --heads 2 --kv-heads 1 --dim 8 --iters 1 --warmup 0 --threads 1)
    else args=(eval --len 256 --heads 2 --kv-heads 1 --dim 16 --steps 1 --threads 1 --budgets 1/4); fi
    (cd "$JDIR" && printf '' | $TIMEOUT "$BIN" "${args[@]}" --json - >"$OUT" 2>"$ERR")
    RC=$?
    ok=0
    [ "$RC" -eq 0 ] || ok=1
    [ ! -e "$JDIR/-" ] || ok=1
    grep -q 'kv_fraction' "$ERR" || ok=1 # the table's header went to stderr
    if [ -n "$PY" ]; then
        $PY -c 'import json, sys; rows = json.load(open(sys.argv[1])); assert isinstance(rows, list) and rows' "$OUT" || ok=1
    else
        head -c 1 "$OUT" | grep -q '\[' || ok=1
    fi
    check "$sub --json - should write only JSON to stdout and the table to stderr (rc=$RC)" $ok
    [ $ok -eq 0 ] || show
done

# ppl --json - (when the shipped model is in the source tree): one JSON object on stdout
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MODEL="$ROOT/models/entmaxkv-lm.safetensors"
if [ -f "$MODEL" ]; then
    head -c 600 "$ROOT/README.md" >"$TMP/ppl.txt"
    (cd "$JDIR" && $TIMEOUT "$BIN" ppl --model "$MODEL" --text "$TMP/ppl.txt" --ctx 128 --windows 1 \
        --threads 1 --json - >"$OUT" 2>"$ERR" </dev/null)
    RC=$?
    ok=0
    [ "$RC" -eq 0 ] && [ ! -e "$JDIR/-" ] && grep -q '^ppl ' "$ERR" || ok=1
    if [ -n "$PY" ]; then
        $PY -c 'import json, sys; o = json.load(open(sys.argv[1])); assert o["ppl"] > 0' "$OUT" || ok=1
    fi
    check "ppl --json - should write only JSON to stdout and the report to stderr (rc=$RC)" $ok
    [ $ok -eq 0 ] || show
fi

# trace:FILE@PREFIX with a prefix the file lacks: exit 1, naming the prefixes it has
if [ -n "$PY" ]; then
    TL="$TMP/layers.safetensors"
    $PY "$(dirname "$0")/../bench/make_trace.py" "$TL" 64 2 4 2 16 --prefixes l0.,l3.
    run "" eval --workload "trace:$TL@layer3." --steps 1 --threads 1
    [ "$RC" -eq 1 ] && grep -q "layer3\.q" "$ERR" && grep -q '"l0\.", "l3\."' "$ERR"
    st=$?; check "eval on a trace with a missing prefix should exit 1 listing l0. and l3. (rc=$RC, '$(head -c 300 "$ERR")')" $st
    run "" eval --workload "trace:$TL@l3." --steps 1 --threads 1 --budgets 1
    check "eval on the trace's prefix l3. should exit 0 (rc=$RC, '$(head -c 300 "$ERR")')" $([ "$RC" -eq 0 ]; echo $?)
fi

# every script of bench/, scripts/, train/ and tests/golden/ answers --help: usage on stdout,
# exit 0, and nothing written (run from an empty directory, which must stay empty)
HDIR="$TMP/help_cwd"
mkdir -p "$HDIR"
for f in "$ROOT"/bench/*.py "$ROOT"/bench/*.sh "$ROOT"/scripts/*.py "$ROOT"/scripts/*.sh "$ROOT"/train/*.py \
    "$ROOT"/train/*.sh "$ROOT"/tests/golden/*.py "$ROOT"/tests/golden/*.sh; do
    [ -f "$f" ] || continue
    case "$f" in
        *.py) [ -n "$PY" ] || continue; runner=$PY ;;
        *) runner=bash ;;
    esac
    (cd "$HDIR" && PYTHONDONTWRITEBYTECODE=1 $TIMEOUT $runner "$f" --help >"$OUT" 2>"$ERR" </dev/null)
    RC=$?
    ok=0
    [ "$RC" -eq 0 ] || ok=1
    grep -qi 'usage' "$OUT" || ok=1
    [ -z "$(ls -A "$HDIR")" ] || ok=1
    check "${f#"$ROOT"/} --help should print usage and exit 0 without writing files (rc=$RC, left: $(ls -A "$HDIR" | head -3 | tr '\n' ' '))" $ok
    [ $ok -eq 0 ] || show
    rm -rf "${HDIR:?}"/* "${HDIR:?}"/.[!.]* 2>/dev/null
done

echo "test_cli: $CHECKS checks, $FAILS failures"
[ "$FAILS" -eq 0 ]
