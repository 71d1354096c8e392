#!/usr/bin/env bash
# entmaxkv serve (docs/cli.md, "serve") driven by curl: the server is started on 127.0.0.1 on a
# free port, with the tiny test model (where the text does not matter) and the shipped one
# (long enough requests to catch in flight):
#   - --help and bad options; GET /health, /v1/models, /metrics;
#   - completions and chat, whole and streamed (server-sent events ending with [DONE]);
#   - exact methods (certified, screened) through the server give `entmaxkv run`'s text with the
#     same prompt, seed, temperature and --prefill-method (the server's default: dense);
#   - the prefill method (--prefill-method, the request's "prefill_method"): a sparse method's
#     text with a dense prefill, with its own prefill, and a server prefilling with topk, each
#     equal to run's with the same --prefill-method (run's texts of the two prefills differ);
#   - /metrics counts the decode steps' tokens (a request's first token comes from its prefill)
#     and the seconds inside decode steps and prefill chunks;
#   - each bad input gets its 4xx and an OpenAI error object, and the server keeps serving:
#     malformed JSON, wrong types, invalid UTF-8, a huge body, negative and huge max_tokens, an
#     unknown model, method or endpoint, a prompt past the context;
#   - --max-seqs: several sequences need --backend cuda (tests/gpu/test_serve_cuda.sh batches
#     them on the GPU); the cpu serves requests in turn;
#   - a full queue gets 503; a client that disconnects mid-stream cancels its request, whose
#     pages return to the pool (/metrics: KV pages in use 0); one that disconnects during a long
#     prefill stops it at the next chunk;
#   - SIGTERM lets a streamed request in flight finish, then the server exits 0.
# Usage: test_serve.sh PATH/TO/entmaxkv DATA_DIR MODELS_DIR
set -u
BIN=${1:-}
DATA=${2:-}
MODELS=${3:-}
if [ -z "$BIN" ] || [ ! -x "$BIN" ] || [ ! -d "$DATA" ] || [ ! -d "$MODELS" ]; then
    echo "usage: $0 PATH/TO/entmaxkv DATA_DIR MODELS_DIR" >&2
    exit 1
fi
if "$BIN" serve --help 2>&1 | grep -q "built without libmicrohttpd"; then
    echo "SKIP: this entmaxkv has no serve (no libmicrohttpd at configure time)"
    exit 77
fi
for tool in curl python3; do
    command -v $tool >/dev/null 2>&1 || { echo "FAIL: $tool is needed (scripts/deps.sh installs it)" >&2; exit 1; }
done
TINY="$DATA/tiny_model.safetensors"
BIG="$MODELS/entmaxkv-lm.safetensors"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/ekv_serve.XXXXXX") || exit 1
. "$(dirname "$0")/serve_lib.sh"

"$BIN" serve --help >"$TMP/out" 2>"$TMP/err"
[ $? -eq 0 ] && grep -q "usage: entmaxkv serve" "$TMP/out" && [ ! -s "$TMP/err" ]
check "serve --help exits 0 with usage on stdout" $?
"$BIN" serve --port 70000 >"$TMP/out" 2>"$TMP/err"
[ $? -eq 2 ] && grep -q "entmaxkv serve: --port" "$TMP/err"
check "serve --port 70000 is bad usage (exit 2)" $?
"$BIN" serve --method oracle >"$TMP/out" 2>"$TMP/err"
[ $? -eq 2 ]
check "serve --method oracle is bad usage (exit 2)" $?
for m in oracle fast; do
    "$BIN" serve --prefill-method $m >"$TMP/out" 2>"$TMP/err"
    [ $? -eq 2 ] && grep -q "entmaxkv serve: --prefill-method" "$TMP/err"
    st=$?; check "serve --prefill-method $m is bad usage naming the option (exit 2: $(cat "$TMP/err"))" $st
done
"$BIN" serve --help | grep -q -- "--prefill-method M .*default dense"
check "serve --help documents --prefill-method and its default" $?
"$BIN" serve --prefill-tokens 0 >"$TMP/out" 2>"$TMP/err"
[ $? -eq 2 ] && grep -q "entmaxkv serve: --prefill-tokens" "$TMP/err"
st=$?; check "serve --prefill-tokens 0 is bad usage naming the option (exit 2: $(cat "$TMP/err"))" $st
"$BIN" serve --help | grep -q -- "--prefill-tokens N .*prompt tokens prefilled between two decode steps"
check "serve --help documents --prefill-tokens" $?
"$BIN" serve --max-seqs 4 >"$TMP/out" 2>"$TMP/err"
[ $? -eq 2 ] && grep -q "the cpu model holds one sequence.*needs --backend cuda" "$TMP/err"
st=$?; check "serve --max-seqs 4 on the cpu is bad usage naming cuda (exit 2: $(cat "$TMP/err"))" $st
"$BIN" serve --max-seqs 0 --backend cuda >"$TMP/out" 2>"$TMP/err"
[ $? -eq 2 ] && grep -q "\-\-max-seqs 0: expected an integer in \[1, 4096\]" "$TMP/err"
st=$?; check "serve --max-seqs 0 is bad usage (exit 2: $(cat "$TMP/err"))" $st
"$BIN" serve --help | grep -q -- "--max-seqs N .*cuda: requests decoded together"
check "serve --help documents --max-seqs" $?


start --threads 1 --model "$TINY" --ctx 512 --max-body 65536 --method dense
grep -q "method dense, prefill method dense, cpu backend, context 512 tokens, requests in turn$" "$LOG.err"
st=$?; check "the cpu server names its methods and says it serves requests in turn ($(cat "$LOG.err"))" $st
CODE=$(curl -s -o "$TMP/body" -w '%{http_code}' "$URL/health")
[ "$CODE" = 200 ] && [ "$(jget "$TMP/body" 'd["status"]')" = ok ]
check "GET /health is 200 ok" $?
curl -s "$URL/v1/models" >"$TMP/body"
[ "$(jget "$TMP/body" 'd["data"][0]["id"]')" = entmaxkv-lm ]
check "GET /v1/models lists entmaxkv-lm" $?

post /v1/completions '{"model":"entmaxkv-lm","prompt":"In the beginning","max_tokens":5,"temperature":0}'
[ "$CODE" = 200 ] && [ "$(jget "$TMP/body" 'd["usage"]["completion_tokens"], d["choices"][0]["finish_reason"], d["object"]')" = "5 length text_completion" ]
st=$?; check "a completion: 200, 5 tokens, finish_reason length ($CODE $(cat "$TMP/body"))" $st
post /v1/chat/completions '{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],"max_tokens":3}'
[ "$CODE" = 200 ] && [ "$(jget "$TMP/body" 'd["choices"][0]["message"]["role"], d["object"], d["usage"]["prompt_tokens"]')" = "assistant chat.completion 38" ]
st=$?; check "a chat completion: 200, the plain template's 38 prompt bytes, 'System: Be brief.', 'User: Hi' and 'Assistant: ' ($CODE $(cat "$TMP/body"))" $st
# a stop string ends the text before it (temperature 0: the tiny model repeats itself)
post /v1/completions '{"prompt":"Hello","max_tokens":40,"temperature":0}'
cp "$TMP/body" "$TMP/full"
stop_body=$(python3 -c 'import json,sys; t=json.load(open(sys.argv[1]))["choices"][0]["text"]
print(json.dumps({"prompt":"Hello","max_tokens":40,"temperature":0,"stop":["zzz",t[3:5]]}))' "$TMP/full")
post /v1/completions "$stop_body"
python3 - "$TMP/full" "$TMP/body" <<'EOF'
import json, sys
full = json.load(open(sys.argv[1]))["choices"][0]["text"]
got = json.load(open(sys.argv[2]))["choices"][0]
stop = full[3:5]
assert len(stop) == 2 and stop.isascii() and got["finish_reason"] == "stop", (got, stop)
assert got["text"] == full[: full.index(stop)], (got["text"], full)
EOF
check "stop: the text ends before the first stop string, finish_reason stop" $?

# streams: every event a JSON chunk, the text of the deltas that of the whole answer, [DONE] last
curl -sN "$URL/v1/completions" -d '{"prompt":"abc","max_tokens":12,"temperature":0,"stream":true}' >"$TMP/sse"
post /v1/completions '{"prompt":"abc","max_tokens":12,"temperature":0}'
python3 - "$TMP/sse" "$TMP/body" <<'EOF'
import json, sys
events = [l[6:] for l in open(sys.argv[1]).read().split("\n\n") if l.startswith("data: ")]
assert events[-1] == "[DONE]", events[-1]
chunks = [json.loads(e) for e in events[:-1]]
text = "".join(c["choices"][0]["text"] for c in chunks)
assert chunks[-1]["choices"][0]["finish_reason"] == "length"
assert text == json.load(open(sys.argv[2]))["choices"][0]["text"], text
EOF
check "a streamed completion: JSON chunks, the whole answer's text, then data: [DONE]" $?
curl -sN "$URL/v1/chat/completions" -d '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}' >"$TMP/sse"
python3 - "$TMP/sse" <<'EOF'
import json, sys
events = [l[6:] for l in open(sys.argv[1]).read().split("\n\n") if l.startswith("data: ")]
assert events[-1] == "[DONE]"
chunks = [json.loads(e) for e in events[:-1]]
assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
assert chunks[-2]["choices"][0]["finish_reason"] == "length"
assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
EOF
check "a streamed chat: the role first, the finish, the usage chunk, [DONE]" $?

# /metrics: the decode steps' tokens are a request's tokens but its first (from its prefill's
# logits); on the cpu, requests in turn, each decode step is one request's
metrics_of() { curl -s "$URL/metrics" | grep -E '^entmaxkv_(generated|decode|prefill|prompt)' >"$1"; }
metrics_of "$TMP/m0"
post /v1/completions '{"prompt":"Metrics","max_tokens":5,"temperature":0}'
metrics_of "$TMP/m1"
post /v1/completions '{"prompt":"One","max_tokens":1,"temperature":0}'
metrics_of "$TMP/m2"
python3 - "$TMP/m0" "$TMP/m1" "$TMP/m2" <<'EOF'
import sys
m = [dict((l.split()[0], float(l.split()[1])) for l in open(f)) for f in sys.argv[1:]]
d = lambda i, k: m[i][k] - m[i - 1][k]
assert d(1, "entmaxkv_generated_tokens_total") == 5, m
assert d(1, "entmaxkv_decode_tokens_total") == 4 and d(1, "entmaxkv_decode_steps_total") == 4, m
assert m[2]["entmaxkv_decode_graph_tokens_total"] == 0, m  # no CUDA graphs on the cpu
assert d(1, "entmaxkv_prompt_tokens_total") == 7, m
assert d(1, "entmaxkv_decode_seconds_total") > 0 and d(1, "entmaxkv_prefill_seconds_total") > 0, m
assert d(2, "entmaxkv_generated_tokens_total") == 1, m
assert d(2, "entmaxkv_decode_tokens_total") == 0 and d(2, "entmaxkv_decode_steps_total") == 0, m
assert d(2, "entmaxkv_decode_seconds_total") == 0, m
rate = m[2]["entmaxkv_decode_tokens_total"] / m[2]["entmaxkv_decode_seconds_total"]
assert abs(m[2]["entmaxkv_decode_tokens_per_second"] / rate - 1) < 1e-4, (rate, m)
rate = m[2]["entmaxkv_prompt_tokens_total"] / m[2]["entmaxkv_prefill_seconds_total"]
assert abs(m[2]["entmaxkv_prefill_tokens_per_second"] / rate - 1) < 1e-4, (rate, m)
EOF
check "/metrics: 5 tokens are 4 decode steps' tokens, 1 token none; rates from the seconds inside steps and chunks" $?

# as_run PROMPT_FILE EXT RUN_ARGS...: `entmaxkv run RUN_ARGS` of the prompt (24 tokens, seed 7,
# temperature 0.8) and a completion of it with the "entmaxkv" object EXT; 0 when the texts are
# the same. Run's text is left in $TMP/ran.
as_run() {
    local prompt=$1 ext=$2
    shift 2
    "$BIN" run --threads 1 "$@" --prompt-file "$prompt" -n 24 --temp 0.8 --seed 7 >"$TMP/run" 2>/dev/null
    python3 - "$prompt" "$ext" >"$TMP/req" <<'EOF'
import json, sys
print(json.dumps({"prompt": open(sys.argv[1], encoding="utf-8").read(), "max_tokens": 24,
                  "temperature": 0.8, "seed": 7, "entmaxkv": json.loads(sys.argv[2])}))
EOF
    post /v1/completions "$(cat "$TMP/req")"
    python3 - "$TMP/run" "$prompt" "$TMP/body" "$TMP/ran" <<'EOF'
import json, sys
prompt = open(sys.argv[2], "rb").read()  # run echoes a prompt shorter than 4096 bytes first
ran = open(sys.argv[1], "rb").read()[len(prompt):][:24].decode("utf-8", "replace")
open(sys.argv[4], "w").write(ran)
got = json.load(open(sys.argv[3]))["choices"][0]["text"]
assert got == ran, (got, ran)
EOF
}

# exact methods through the server: run's text with the same prompt, seed, temperature and
# --prefill-method (the server's default, dense)
printf 'The LORD said' >"$TMP/lord"
for method in certified screened; do
    as_run "$TMP/lord" "{\"method\":\"$method\"}" --model "$TINY" --prefill-method dense --method "$method"
    check "$method through the server gives run's text (prefill dense, seed 7, temperature 0.8)" $?
done

# bad input: each its status and an error object naming the problem; the server keeps serving
bad() { # bad STATUS WORD PATH BODY
    post "$3" "$4"
    [ "$CODE" = "$1" ] && grep -q "\"error\":{\"message\":\"[^\"]*$2" "$TMP/body"
    st=$?; check "bad input gets $1 mentioning '$2': $4 -> $CODE $(head -c 300 "$TMP/body")" $st
}
bad 400 "not valid JSON" /v1/completions '{"prompt": "a",'
bad 400 "not valid JSON" /v1/completions '{"prompt": "a",}'
bad 400 "not valid JSON" /v1/completions '{"prompt": "a", "prompt": "b"}'
bad 400 "not valid JSON" /v1/completions "$(printf '{"prompt": "\xc3\x28"}')"
bad 400 "not valid JSON" /v1/completions '{"prompt": "\ud800"}'
bad 400 "must be a JSON object" /v1/completions '[1, 2]'
bad 400 "prompt" /v1/completions '{"prompt": 5}'
bad 400 "prompt is empty" /v1/completions '{"prompt": ""}'
bad 400 "max_tokens" /v1/completions '{"prompt": "a", "max_tokens": -1}'
bad 400 "max_tokens" /v1/completions '{"prompt": "a", "max_tokens": 100000000000000000000}'
bad 400 "max_tokens" /v1/completions '{"prompt": "a", "max_tokens": "5"}'
bad 400 "max_tokens" /v1/completions '{"prompt": "a", "max_tokens": 2.5}'
bad 400 "exceed the context" /v1/completions '{"prompt": "a", "max_tokens": 512}'
bad 400 "temperature" /v1/completions '{"prompt": "a", "temperature": -1}'
bad 400 "stream" /v1/completions '{"prompt": "a", "stream": "yes"}'
bad 400 "stop" /v1/completions '{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}'
bad 400 "not supported" /v1/completions '{"prompt": "a", "n": 2}'
bad 400 "entmaxkv.method" /v1/completions '{"prompt": "a", "entmaxkv": {"method": "fast"}}'
bad 400 "entmaxkv.method" /v1/completions '{"prompt": "a", "entmaxkv": {"method": "oracle"}}'
bad 400 "entmaxkv.budget" /v1/completions '{"prompt": "a", "entmaxkv": {"method": "topk", "budget": 0}}'
bad 400 "entmaxkv.prefill_method" /v1/completions '{"prompt": "a", "entmaxkv": {"prefill_method": "fast"}}'
bad 400 "entmaxkv.prefill_method" /v1/completions '{"prompt": "a", "entmaxkv": {"prefill_method": "oracle"}}'
bad 400 "entmaxkv.prefill_method" /v1/completions '{"prompt": "a", "entmaxkv": {"prefill_method": 1}}'
bad 400 "takes 'method', 'budget' and 'prefill_method'" /v1/completions '{"prompt": "a", "entmaxkv": {"prefill": "dense"}}'
bad 400 "role" /v1/chat/completions '{"messages": [{"role": "robot", "content": "a"}]}'
bad 400 "messages" /v1/chat/completions '{"messages": []}'
bad 404 "does not exist" /v1/completions '{"model": "gpt-4", "prompt": "a"}'
bad 404 "no such endpoint" /v1/nothing '{}'
CODE=$(curl -s -o "$TMP/body" -w '%{http_code}' "$URL/v1/completions")
[ "$CODE" = 405 ]
check "GET /v1/completions is 405 ($CODE)" $?
head -c 100000 /dev/zero | tr '\0' ' ' >"$TMP/huge"
CODE=$(curl -s -o "$TMP/body" -w '%{http_code}' "$URL/v1/completions" --data-binary @"$TMP/huge")
[ "$CODE" = 413 ]
check "a body past --max-body is 413 ($CODE)" $?
CODE=$(curl -s -o "$TMP/body" -w '%{http_code}' "$URL/v1/completions" -H 'Transfer-Encoding: chunked' --data-binary @"$TMP/huge")
[ "$CODE" = 413 ]
check "a chunked body past --max-body is 413 ($CODE)" $?
# the README's curl example (Serve section), run as written but for the address
awk '/^## Serve/ { sec = 1; next } /^## / { sec = 0 } sec && /^curl/ { c = 1 } c { print } c && !/\\$/ { exit }' \
    "$MODELS/../README.md" | sed "s|http://127.0.0.1:8080|$URL|" >"$TMP/readme.sh"
grep -q "^curl" "$TMP/readme.sh" && bash "$TMP/readme.sh" >"$TMP/body" &&
    [ "$(jget "$TMP/body" 'd["usage"]["completion_tokens"]')" = 40 ]
check "the README's curl example works" $?
post /v1/completions '{"prompt":"still here","max_tokens":2}'
[ "$CODE" = 200 ]
check "the server still serves after the bad inputs ($CODE)" $?
[ "$(metric 'entmaxkv_requests_total{status="400"}')" -ge 20 ] && [ "$(metric entmaxkv_kv_pages_in_use)" = 0 ]
check "/metrics counts the 400s; no KV page in use" $?
kill -TERM "$PID"
wait "$PID"
check "SIGTERM on an idle server exits 0" $?

# the prefill method, on the shipped model and a prompt of 1536 bytes, where topk 1/64's text
# after a topk prefill differs from its text after a dense one: a server prefilling with topk
# (--prefill-method), then the default server (dense) and a request's own prefill_method
python3 -c 'import sys; sys.stdout.write(open(sys.argv[1]).read() * 8)' "$DATA/model_ref_prompt.txt" >"$TMP/p8"
start --threads 1 --model "$BIG" --prefill-method topk --budget 1/64 --prefill-tokens 100000
grep -q "method dense, prefill method topk 0.015625, cpu backend" "$LOG.err"
st=$?; check "the server names its prefill method ($(cat "$LOG.err"))" $st
as_run "$TMP/p8" '{"method":"certified"}' --model "$BIG" --prefill-method topk --budget 1/64 --method certified
check "serve --prefill-method topk (the whole prompt's chunks in one iteration: --prefill-tokens 100000): certified gives run --prefill-method topk's text" $?
kill -TERM "$PID"
wait "$PID"
check "SIGTERM exits 0" $?

# the shipped model: a request long enough to be caught in flight
start --threads 1 --model "$BIG" --queue 1
as_run "$TMP/p8" '{"method":"topk","budget":"1/64"}' --model "$BIG" --prefill-method dense --method topk --budget 1/64
check "topk 1/64 through the default server prefills dense: run --prefill-method dense's text" $?
cp "$TMP/ran" "$TMP/ran_dense"
as_run "$TMP/p8" '{"method":"topk","budget":"1/64","prefill_method":"topk"}' --model "$BIG" --method topk --budget 1/64
check "a request's prefill_method topk: run --method topk's text (prefilled with topk)" $?
! cmp -s "$TMP/ran" "$TMP/ran_dense"
check "run's texts after a dense and after a topk prefill differ (so the checks above tell them apart)" $?
curl -sN "$URL/v1/completions" -d '{"prompt":"The LORD said","max_tokens":3000,"stream":true}' >"$TMP/long" &
CURL=$!
for _ in $(seq 100); do [ "$(metric entmaxkv_requests_running)" = 1 ] && break; sleep 0.1; done
post /v1/completions '{"prompt":"a","max_tokens":2}'
[ "$CODE" = 503 ] && grep -q '"code":"overloaded"' "$TMP/body"
check "a full queue (--queue 1) gets 503 ($CODE)" $?
for _ in $(seq 100); do [ -s "$TMP/long" ] && break; sleep 0.1; done
kill "$CURL" 2>/dev/null
wait "$CURL" 2>/dev/null
for _ in $(seq 100); do [ "$(metric entmaxkv_requests_running)" = 0 ] && break; sleep 0.1; done
[ "$(metric entmaxkv_requests_cancelled_total)" = 1 ] && [ "$(metric entmaxkv_kv_pages_in_use)" = 0 ] &&
    [ "$(metric entmaxkv_generated_tokens_total)" -lt 3000 ]
check "a client gone mid-stream: its request stops, its pages return (pages in use 0)" $?
post /v1/completions '{"prompt":"a","max_tokens":2}'
[ "$CODE" = 200 ]
check "the server serves the next request ($CODE)" $?
# a client gone during a long prefill: the prompt runs in chunks (256 tokens on the cpu), so its
# request stops at the next chunk rather than after the whole prompt
python3 -c 'import json; print(json.dumps({"prompt": "In the beginning " * 230, "max_tokens": 1}))' >"$TMP/longp"
before=$(metric entmaxkv_prompt_tokens_total)
curl -s "$URL/v1/completions" --data-binary @"$TMP/longp" >/dev/null &
CURL=$!
for _ in $(seq 200); do [ "$(metric entmaxkv_prompt_tokens_total)" != "$before" ] && break; sleep 0.05; done
kill "$CURL" 2>/dev/null
wait "$CURL" 2>/dev/null
for _ in $(seq 100); do [ "$(metric entmaxkv_requests_running)" = 0 ] && break; sleep 0.1; done
ran=$(( $(metric entmaxkv_prompt_tokens_total) - before ))
[ "$ran" -gt 0 ] && [ "$ran" -lt 3910 ] && [ "$(metric entmaxkv_requests_cancelled_total)" = 2 ] &&
    [ "$(metric entmaxkv_kv_pages_in_use)" = 0 ] && [ "$(metric entmaxkv_requests_running)" = 0 ]
check "a client gone mid-prefill: its 3910-byte prompt stops after $ran tokens, pages in use 0" $?
post /v1/completions '{"prompt":"a","max_tokens":2}'
[ "$CODE" = 200 ]
check "the server serves the request after ($CODE)" $?
# SIGTERM while a stream is in flight: it ends whole, then the server exits 0
curl -sN "$URL/v1/completions" -d '{"prompt":"The LORD said","max_tokens":400,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}' >"$TMP/drain" &
CURL=$!
for _ in $(seq 100); do grep -q '"text"' "$TMP/drain" && break; sleep 0.05; done
kill -TERM "$PID"
wait "$PID"
RC=$?
wait "$CURL"
python3 - "$TMP/drain" <<'EOF'
import json, sys
events = [l[6:] for l in open(sys.argv[1]).read().split("\n\n") if l.startswith("data: ")]
assert events[-1] == "[DONE]", events[-3:]
assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
assert json.loads(events[-2])["usage"]["completion_tokens"] == 400
EOF
[ $? -eq 0 ] && [ "$RC" = 0 ]
check "SIGTERM drains the stream in flight (400 tokens, [DONE]) and exits 0 (rc $RC)" $?

echo "test_serve: $((CHECKS - FAILS)) passed, $FAILS failed"
[ "$FAILS" -eq 0 ]
