#!/usr/bin/env bash
# entmaxkv serve --backend cuda: continuous batching (docs/cli.md, "serve"), on the GPU machine
# (not in CI). The shipped model with --max-seqs 4 serves 9 requests of 1K to 64K-byte prompts
# (text of the repository's docs) that arrive while others decode, more than the slots, so some
# wait in the queue and join the batch as others leave:
#   - every answer equals `entmaxkv run --backend cuda` with the same prompt, method, prefill
#     method, seed and temperature (dense at every length, certified on short prompts, so two
#     methods share the steps; the server's default prefill, dense, and a request's own
#     "prefill_method" certified; greedy and sampled; streamed and whole);
#   - /metrics: the decode steps made each request's tokens but its first, in steps of more
#     than one sequence on average;
#   - /metrics saw 3 or more requests running at once; after the load none runs or waits and
#     the KV pages in use are back to 0;
#   - a client gone mid-stream is counted cancelled and leaves the batch;
#   - SIGTERM with a request in flight: it finishes, then the server exits 0.
# Usage: tests/gpu/test_serve_cuda.sh [PATH/TO/entmaxkv]
#   (default $BIN, else build-gpu/entmaxkv: tests/gpu/run.sh's build; exit 77 without a GPU or
#   without serve). KEEP=DIR keeps the prompts, references and answers in DIR.
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
set -u
cd "$(dirname "$0")/../.." || exit 1
BIN=${1:-${BIN:-build-gpu/entmaxkv}}
MODEL=models/entmaxkv-lm.safetensors
if [ ! -x "$BIN" ]; then
    echo "usage: $0 PATH/TO/entmaxkv (no '$BIN'; tests/gpu/run.sh builds build-gpu/)" >&2
    exit 1
fi
if "$BIN" serve --help 2>&1 | grep -q "built without libmicrohttpd"; then
    echo "SKIP: this entmaxkv has no serve (apt-get install libmicrohttpd-dev, then rebuild)"
    exit 77
fi
if ! "$BIN" run --backend cuda --model "$MODEL" --prompt x -n 1 --quiet >/dev/null 2>&1; then
    echo "SKIP: '$BIN run --backend cuda' does not run here (no CUDA build or no device)"
    exit 77
fi
for tool in curl python3; do
    command -v $tool >/dev/null 2>&1 || { echo "FAIL: $tool is needed" >&2; exit 1; }
done
TMP=$(mktemp -d "${TMPDIR:-/tmp}/ekv_serve_cuda.XXXXXX") || exit 1
. tests/serve_lib.sh
WORK=${KEEP:-$TMP/work}
mkdir -p "$WORK"

# The requests: prompt bytes, method, prefill method (- : the server's, dense), temperature,
# seed, max_tokens, streamed, arrival (s after the first). The prompts are slices of the docs
# (ASCII, so a byte is a character).
cat >"$WORK/plan.txt" <<'EOF'
64000 dense - 0 1 300 0 0.0
1024 dense - 0.8 2 400 1 0.0
4096 certified certified 0 3 200 0 0.3
16384 dense - 0.8 4 200 1 0.6
2048 certified - 0.8 5 150 0 0.9
32768 dense - 0 6 150 0 1.2
8192 dense - 0.8 7 250 1 1.5
1500 dense - 0 8 120 0 1.8
12000 dense - 0 9 100 1 2.1
EOF
python3 - "$WORK" README.md docs/*.md bench/RESULTS.md <<'EOF'
import sys
work, files = sys.argv[1], sys.argv[2:]
text = "".join(open(f, encoding="utf-8").read() for f in files)
text = "".join(c for c in text if 32 <= ord(c) < 127 or c == "\n")
while len(text) < 200000:
    text += text
for k, line in enumerate(open(work + "/plan.txt")):
    n = int(line.split()[0])
    start = (k * 15013) % (len(text) - n)
    open("%s/prompt%d.txt" % (work, k), "w").write(text[start:start + n])
EOF

# the references: run on the GPU, one request at a time
k=0
while read -r bytes method prefill temp seed ntok stream at; do
    [ "$prefill" = - ] && prefill=dense
    "$BIN" run --backend cuda --model "$MODEL" --prompt-file "$WORK/prompt$k.txt" --method "$method" \
        --prefill-method "$prefill" --temp "$temp" --seed "$seed" -n "$ntok" >"$WORK/run$k.txt" 2>"$WORK/run$k.err"
    st=$?; check "reference $k: run --backend cuda ($bytes bytes, $method, prefill $prefill) exits 0: $(tail -c 300 "$WORK/run$k.err")" $st
    k=$((k + 1))
done <"$WORK/plan.txt"

START_WAIT=1200 start --backend cuda --model "$MODEL" --max-seqs 4 --ctx 66000
grep -q "prefill method dense, cuda backend, context 66000 tokens, continuous batching over 4 sequences" "$LOG.err"
st=$?; check "the server says it prefills dense and batches over 4 sequences: $(cat "$LOG.err")" $st

# the load: each request on its own thread at its arrival time, /metrics polled meanwhile; a
# client that drops its stream after the first text; then every answer against run's
python3 - "$URL" "$WORK" <<'EOF'
import json, sys, threading, time, urllib.request
url, work = sys.argv[1], sys.argv[2]
plan = [l.split() for l in open(work + "/plan.txt")]
answers, errors, most = {}, [], [0]

def post(body):
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)

def one(k, bytes_, method, prefill, temp, seed, ntok, stream, at):
    time.sleep(float(at))
    body = {"prompt": open("%s/prompt%d.txt" % (work, k)).read(), "max_tokens": int(ntok),
            "temperature": float(temp), "seed": int(seed), "stream": stream == "1",
            "entmaxkv": {"method": method}}
    if prefill != "-":
        body["entmaxkv"]["prefill_method"] = prefill
    try:
        with post(body) as r:
            if stream == "1":
                events = [l[6:].strip() for l in r if l.startswith(b"data: ")]
                assert events[-1] == b"[DONE]", events[-1]
                text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
            else:
                text = json.load(r)["choices"][0]["text"]
        answers[k] = text
    except Exception as e:  # noqa: BLE001 - reported with the request's number
        errors.append("request %d: %r" % (k, e))

def dropper():
    time.sleep(0.5)
    body = {"prompt": "In the beginning " * 100, "max_tokens": 3000, "stream": True}
    r = post(body)
    for line in r:
        if line.startswith(b"data: {"):
            break
    r.close()  # the client goes away mid-stream

def poll(stop):
    while not stop.is_set():
        m = urllib.request.urlopen(url + "/metrics").read().decode()
        for l in m.splitlines():
            if l.startswith("entmaxkv_requests_running "):
                most[0] = max(most[0], int(float(l.split()[1])))
        time.sleep(0.05)

stop = threading.Event()
poller = threading.Thread(target=poll, args=(stop,))
poller.start()
t0 = time.time()
threads = [threading.Thread(target=one, args=(k, *p)) for k, p in enumerate(plan)]
threads.append(threading.Thread(target=dropper))
for t in threads:
    t.start()
for t in threads:
    t.join()
wall = time.time() - t0
stop.set()
poller.join()
bad = list(errors)
for k, (bytes_, method, prefill, temp, seed, ntok, stream, at) in enumerate(plan):
    if k not in answers:
        continue
    out = open("%s/run%d.txt" % (work, k), "rb").read()
    prompt = open("%s/prompt%d.txt" % (work, k), "rb").read()
    if len(prompt) < 4096:  # run echoes a short prompt before its text
        out = out[len(prompt):]
    ran = out[:int(ntok)].decode("utf-8", "replace")
    open("%s/served%d.txt" % (work, k), "w").write(answers[k])
    if answers[k] != ran:
        i = next((j for j, (a, b) in enumerate(zip(answers[k], ran)) if a != b),
                 min(len(answers[k]), len(ran)))
        bad.append("request %d (%s bytes, %s, prefill %s, temperature %s, seed %s): the text "
                   "differs from run's at character %d: served %r, run %r"
                   % (k, bytes_, method, prefill, temp, seed, i, answers[k][i:i + 40],
                      ran[i:i + 40]))
print("test_serve_cuda: %d requests in %.1f s, at most %d running at once"
      % (len(plan), wall, most[0]))
for b in bad:
    print("FAIL: " + b, file=sys.stderr)
if most[0] < 3:
    print("FAIL: at most %d requests ran at once (expected 3 or more)" % most[0], file=sys.stderr)
sys.exit(1 if bad or most[0] < 3 else 0)
EOF
check "every served answer equals run's, with 3 or more requests batched at once" $?

for _ in $(seq 100); do [ "$(metric entmaxkv_requests_running)" = 0 ] && break; sleep 0.1; done
[ "$(metric entmaxkv_requests_running)" = 0 ] && [ "$(metric entmaxkv_queue_depth)" = 0 ] &&
    [ "$(metric entmaxkv_kv_pages_in_use)" = 0 ]
check "after the load: none running or queued, KV pages in use 0" $?
[ "$(metric entmaxkv_requests_cancelled_total)" = 1 ]
check "the client gone mid-stream is counted cancelled" $?
# the decode steps made every token but each request's first (from its prefill), the one
# cancelled included (each of its tokens was fed to a step before it left)
gen=$(metric entmaxkv_generated_tokens_total)
dec=$(metric entmaxkv_decode_tokens_total)
steps=$(metric entmaxkv_decode_steps_total)
[ "$dec" = $((gen - $(wc -l <"$WORK/plan.txt"))) ] && [ "$steps" -gt 0 ] && [ "$dec" -gt "$steps" ]
check "/metrics: the decode steps made $dec of the $gen tokens, the 9 answered requests' first ones not, in $steps steps (more than one sequence per step on average)" $?
# the batched steps replay captured graphs (a key's first step runs eagerly): most tokens
graphed=$(metric entmaxkv_decode_graph_tokens_total)
[ "$graphed" -le "$dec" ] && [ $((2 * graphed)) -gt "$dec" ]
check "/metrics: $graphed of the $dec decode-step tokens came from replayed CUDA graphs (more than half)" $?
# SIGTERM while two requests decode: both finish whole, then the server exits 0
CURLS=()
for k in 0 1; do
    curl -s "$URL/v1/completions" -d "{\"prompt\":\"The LORD said $k\",\"max_tokens\":400,\"temperature\":0}" >"$WORK/drain$k.json" &
    CURLS+=($!)
done
for _ in $(seq 100); do [ "$(metric entmaxkv_requests_running)" = 2 ] && break; sleep 0.05; done
kill -TERM "$PID"
wait "$PID"
RC=$?
wait "${CURLS[@]}"
[ "$RC" = 0 ] && [ "$(jget "$WORK/drain0.json" 'd["usage"]["completion_tokens"]')" = 400 ] &&
    [ "$(jget "$WORK/drain1.json" 'd["usage"]["completion_tokens"]')" = 400 ]
check "SIGTERM drains the two requests in flight (400 tokens each) and exits 0 (rc $RC)" $?

echo "test_serve_cuda: $((CHECKS - FAILS)) passed, $FAILS failed"
[ "$FAILS" -eq 0 ]
