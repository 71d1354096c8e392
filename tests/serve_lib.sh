# Shell helpers of the serve tests (tests/test_serve.sh on the cpu, tests/gpu/test_serve_cuda.sh
# on the GPU machine), sourced once BIN (the entmaxkv to test) and TMP (a scratch directory,
# removed at exit with every server started) are set: counted checks, a server started on a free
# port, a POST, a /metrics value.
PIDS=()
FAILS=0
CHECKS=0
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; rm -rf "$TMP"; }
trap cleanup EXIT
# check MESSAGE STATUS: one check, failed when STATUS is not 0. A command substitution in
# MESSAGE resets $?: take the status first then (st=$?; check "... $(cat F)" $st).
check() { CHECKS=$((CHECKS + 1)); if [ "$2" -ne 0 ]; then echo "FAIL: $1" >&2; FAILS=$((FAILS + 1)); fi; }
# a JSON field of a file: jget FILE 'python expression over d'
jget() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print($2)" "$1" 2>/dev/null; }
# start ARGS...: `entmaxkv serve --port 0 ARGS` in the background, waiting (START_WAIT tenths of
# a second, default 100) for its address; sets PID, URL and LOG ($LOG.out, $LOG.err: its output)
start() {
    LOG="$TMP/server.$#.$RANDOM"
    "$BIN" serve --port 0 "$@" >"$LOG.out" 2>"$LOG.err" &
    PID=$!
    PIDS+=("$PID")
    for _ in $(seq "${START_WAIT:-100}"); do
        URL=$(sed -n 's/^entmaxkv serve: listening on \(http:[^ ]*\)$/\1/p' "$LOG.out")
        [ -n "$URL" ] && return 0
        kill -0 "$PID" 2>/dev/null || break
        sleep 0.1
    done
    echo "FAIL: the server did not start: $(cat "$LOG.err")" >&2
    exit 1
}
# post PATH BODY: the status in $CODE, the body in $TMP/body
post() { CODE=$(curl -s -o "$TMP/body" -w '%{http_code}' "$URL$1" -H 'Content-Type: application/json' --data-binary "$2"); }
metric() { curl -s "$URL/metrics" | awk -v k="$1" '$1 == k { print $2 }'; }
