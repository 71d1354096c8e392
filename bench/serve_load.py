"""Load benchmark of `entmaxkv serve` (docs/cli.md, "serve"; issue 31's target: on the GPU, 16
concurrent requests of 8K-64K prompts decode at 8x or more one request's tokens/s).

For each method of --methods, --clients requests, their prompts --min-bytes to --max-bytes
bytes (evenly spaced) of the repository's docs, each streamed with --tokens greedy tokens and
the method as its "entmaxkv" field (the prompt prefilled with the server's --prefill-method,
dense by default), are sent all at once (the server batches them: continuous batching on
--backend cuda), then the same requests one after another. Per run, from the server's /metrics
read before and after it (counters, so the run's own share):

  step tok/s        the decode steps' tokens / the seconds inside decode steps: the rate the
                    batching buys, whatever the prefills between the steps take. Each request's
                    first token comes from its prefill, so a request of T tokens counts T - 1
  mean batch        the decode steps' tokens / the decode steps (sequences per step)
  graph %           the share of those tokens whose step was replayed from a CUDA graph
  prefill tok/s     prompt tokens / the seconds inside prefill chunks

and from the clients (honest end-to-end numbers, which include the prefills):

  client decode tok/s  tokens after each request's first / the time some request was decoding
                    (the union of the intervals from a request's first token to its last); at
                    once the other requests' prefills run between the steps and count here
  end-to-end tok/s  tokens / wall time from the first request sent to the last answered
  TTFT p50, p99     time from a request sent to its first token (nearest rank)

then a markdown table and per method the ratio of the step rates, at once over one after another
(one request's rate): the issue's target (>= 8x) is read on this ratio. Also the clients' ratio,
and how many answers were the same text both ways (an exact method batched may round
differently from one alone). At the end the server's /metrics must show no KV page in use.

--tokens: the step rate counts only the steps, so it is not diluted by the prefills at any
--tokens; but a step's batch is the requests decoding at that moment. By default the worker
runs one prefill chunk (4096 tokens) per decode step, so with 128 tokens a request prefilled
early ends before the last long prompt is in (16 prompts of 8K-64K are about 150 chunks): the
mean batch column says how full the steps were. `--server-arg=--prefill-tokens
--server-arg=65536` prefills more per step and fills the batch sooner. The default 128 is
fine for the target's ratio (read it
beside the mean batch); a larger --tokens keeps the batch full longer and brings the client
columns closer to the step rate.

The server: started here (--bin, default build-gpu/entmaxkv, else build/entmaxkv; `serve
--port 0 --backend B --max-seqs CLIENTS --ctx` fitting the longest prompt, plus each
--server-arg) and stopped with SIGTERM at the end, or a running one (--url; it must take
--clients requests at once and the longest prompt, and serve no one else meanwhile, since the
server's counters are read). Standard library only (urllib, threads),
so it runs on the GPU machine without extra wheels.

usage: python3 bench/serve_load.py [--url URL | --bin PATH [--backend cuda|cpu] [--model FILE]
           [--server-arg ARG ...]] [--clients N] [--min-bytes B] [--max-bytes B] [--tokens T]
           [--methods LIST] [--no-sequential]
e.g. python3 bench/serve_load.py --bin build-gpu/entmaxkv --clients 16 --methods dense,certified
"""
import argparse
import json
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\nusage: ")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage=__doc__[__doc__.index("usage: ") + 7:].split("\ne.g.")[0])
    ap.add_argument("--url", help="a running server (http://HOST:PORT); else one is started")
    ap.add_argument("--bin", help="the entmaxkv to start (build-gpu/entmaxkv, else build/)")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", help="--model of the server started (the shipped one)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more argument of the server started (repeatable)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent requests (16)")
    ap.add_argument("--min-bytes", type=int, default=8192, help="the shortest prompt (8192)")
    ap.add_argument("--max-bytes", type=int, default=65536, help="the longest prompt (65536)")
    ap.add_argument("--tokens", type=int, default=128,
                    help="tokens per request (128; fine for the target's ratio, read beside "
                         "the mean batch: see --tokens above)")
    ap.add_argument("--methods", default="dense,certified",
                    help="comma-separated methods as run's --compare names them, "
                         "METHOD[:BUDGET] (dense,certified,topk:1/16)")
    ap.add_argument("--no-sequential", action="store_true",
                    help="only the concurrent run of each method")
    a = ap.parse_args()
    if a.clients < 1 or a.tokens < 2 or not 1 <= a.min_bytes <= a.max_bytes:
        ap.error("need --clients >= 1, --tokens >= 2 and 1 <= --min-bytes <= --max-bytes")
    return a


def prompts(n, lo, hi):
    """n prompts of lo..hi bytes: slices of the docs, ASCII so a byte is a character."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench/RESULTS.md"]
    text = "".join(f.read_text(encoding="utf-8") for f in files if f.exists())
    text = "".join(c for c in text if 32 <= ord(c) < 127 or c == "\n") or "In the beginning "
    while len(text) < 2 * hi:
        text += text
    sizes = [lo + (hi - lo) * k // max(n - 1, 1) for k in range(n)]
    return [text[(k * 7919) % (len(text) - s):][:s] for k, s in enumerate(sizes)]


def start_server(a):
    exe = a.bin or next((str(ROOT / d / "entmaxkv") for d in ("build-gpu", "build")
                         if (ROOT / d / "entmaxkv").exists()), None)
    if not exe:
        sys.exit("serve_load: no --url and no entmaxkv found (give --bin PATH)")
    cmd = [exe, "serve", "--port", "0", "--backend", a.backend,
           "--ctx", str(a.max_bytes + a.tokens + 16), "--queue", str(max(64, 2 * a.clients))]
    if a.backend == "cuda":
        cmd += ["--max-seqs", str(a.clients)]
    if a.model:
        cmd += ["--model", a.model]
    cmd += a.server_arg
    print("serve_load: " + " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # the model loads first; the line comes once it listens
    m = re.match(r"entmaxkv serve: listening on (http://\S+)", line)
    if not m:
        proc.kill()
        sys.exit("serve_load: the server did not start (%r)" % line)
    return proc, m.group(1)


def method_field(method):
    """run's METHOD[:BUDGET] (e.g. topk:1/16) as the request's "entmaxkv" object."""
    name, _, budget = method.partition(":")
    return {"method": name, "budget": budget} if budget else {"method": name}


def request(url, prompt, tokens, method):
    """One streamed completion: (seconds to the first token, seconds to the end, tokens, text)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "entmaxkv": method_field(method)}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0, first, text, used = time.perf_counter(), None, [], 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(d["error"]["message"])
            if d.get("usage"):
                used = d["usage"]["completion_tokens"]
            if d["choices"] and d["choices"][0]["text"]:
                first = first or time.perf_counter()
                text.append(d["choices"][0]["text"])
    end = time.perf_counter()
    return first - t0 if first else end - t0, end - t0, used, "".join(text), t0


def run_all(url, ps, tokens, method, concurrent):
    out, errors = [None] * len(ps), []

    def one(k):
        try:
            out[k] = request(url, ps[k], tokens, method)
        except Exception as e:  # noqa: BLE001 - reported with the request's number
            errors.append("request %d: %r" % (k, e))

    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=one, args=(k,)) for k in range(len(ps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for k in range(len(ps)):
            one(k)
    if errors:
        sys.exit("serve_load: %s: %s" % (method, "; ".join(errors[:3])))
    return time.perf_counter() - t0, out


def union(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def rank(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, -(-len(xs) * q // 100) - 1))]


COUNTERS = ("entmaxkv_decode_tokens_total", "entmaxkv_decode_steps_total",
            "entmaxkv_decode_seconds_total", "entmaxkv_prompt_tokens_total",
            "entmaxkv_prefill_seconds_total", "entmaxkv_kv_pages_in_use",
            "entmaxkv_decode_graph_tokens_total")


def metrics(url):
    """The server's unlabelled /metrics values; exits naming a counter the server lacks."""
    text = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
    got = dict(re.findall(r"^(entmaxkv_\w+) (\S+)$", text, re.M))
    lack = [k for k in COUNTERS if k not in got]
    if lack:
        sys.exit("serve_load: the server's /metrics lacks %s (an older entmaxkv serve?)"
                 % ", ".join(lack))
    return {k: float(v) for k, v in got.items()}


def div(a, b):
    return a / b if b > 0 else float("nan")


def row(method, mode, wall, res, m0, m1):
    """A table row: method, mode, requests, tokens, wall, the server's step rate, mean batch and
    prefill rate over the run (m1 - m0), the clients' decode and end-to-end tok/s, TTFT. Returns
    (step rate, client decode rate, row)."""
    d = {k: m1[k] - m0[k] for k in COUNTERS}
    step = div(d["entmaxkv_decode_tokens_total"], d["entmaxkv_decode_seconds_total"])
    batch = div(d["entmaxkv_decode_tokens_total"], d["entmaxkv_decode_steps_total"])
    graph = 100 * div(d["entmaxkv_decode_graph_tokens_total"], d["entmaxkv_decode_tokens_total"])
    prefill = div(d["entmaxkv_prompt_tokens_total"], d["entmaxkv_prefill_seconds_total"])
    toks = sum(r[2] for r in res)
    window = union([(r[4] + r[0], r[4] + r[1]) for r in res])
    decode = div(sum(r[2] - 1 for r in res), window)
    ttft = [r[0] for r in res]
    return step, decode, ("| %s | %s | %d | %d | %.2f | %.1f | %.2f | %.0f | %.0f | %.1f | %.1f "
                          "| %.3f | %.3f |" % (method, mode, len(res), toks, wall, step, batch,
                                               graph, prefill, decode, toks / wall, rank(ttft, 50),
                                               rank(ttft, 99)))


def main():
    a = parse_args()
    proc, url = (None, a.url.rstrip("/")) if a.url else start_server(a)
    try:
        ps = prompts(a.clients, a.min_bytes, a.max_bytes)
        rows, notes = [], []
        for method in a.methods.split(","):
            request(url, ps[0][:512], 4, method)  # warm-up: graphs, cuBLAS, first launches
            m0 = metrics(url)
            wall, res = run_all(url, ps, a.tokens, method, True)
            m1 = metrics(url)
            step, dec, line = row(method, "%d at once" % a.clients, wall, res, m0, m1)
            rows.append(line)
            if a.no_sequential:
                continue
            wall1, res1 = run_all(url, ps, a.tokens, method, False)
            step1, dec1, line1 = row(method, "one after another", wall1, res1, m1, metrics(url))
            rows.append(line1)
            same = sum(x[3] == y[3] for x, y in zip(res, res1))
            notes.append("%s: decode-step rate at once %.2fx one after another's (the target: "
                         ">= 8x); clients' decode rate %.2fx; %d of %d answers the same text both "
                         "ways" % (method, step / step1, dec / dec1, same, len(res)))
        left = metrics(url)["entmaxkv_kv_pages_in_use"]
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=600)
    print("%d requests of %d-%d prompt bytes, %d tokens each (greedy, streamed); %s\n"
          % (a.clients, a.min_bytes, a.max_bytes, a.tokens, url if a.url else "server started"))
    print("| method | run | requests | tokens | wall s | step tok/s | mean batch | graph % "
          "| prefill tok/s | client decode tok/s | end-to-end tok/s | TTFT p50 s | TTFT p99 s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows) + "\n")
    for n in notes:
        print(n)
    print("KV pages in use after the runs: %g" % left)
    if left != 0:
        sys.exit("serve_load: pages are still in use after every request ended")


if __name__ == "__main__":
    main()
