"""entmaxkv serve driven by the `openai` client from PyPI (docs/cli.md, "serve").

The server (the CLI named by $ENTMAXKV_CLI; scripts/check_python.sh builds and names it) runs
on 127.0.0.1 on a free port with the tiny test model. Checked: completions and chat, whole and
streamed, through the unmodified client; 32 concurrent clients whose every answer equals the
same request's answer alone; the KV pages in use back to zero afterwards.
"""
import os
import pathlib
import re
import signal
import subprocess
import threading
import urllib.request

import pytest

openai = pytest.importorskip("openai")
CLI = os.environ.get("ENTMAXKV_CLI")
TINY = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny_model.safetensors"
pytestmark = pytest.mark.skipif(not CLI, reason="ENTMAXKV_CLI names no entmaxkv binary")


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([CLI, "serve", "--port", "0", "--threads", "1", "--ctx", "512",
                             "--model", str(TINY)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.match(r"entmaxkv serve: listening on (http://\S+)", line)
    assert m, line
    yield m.group(1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def metric(server, name):
    text = urllib.request.urlopen(server + "/metrics").read().decode()
    return float(re.search(r"^%s (\S+)$" % re.escape(name), text, re.M).group(1))


def test_models(client):
    assert [m.id for m in client.models.list()] == ["entmaxkv-lm"]


def test_completion_whole_and_streamed(client):
    args = dict(model="entmaxkv-lm", prompt="In the beginning", max_tokens=12, temperature=0.8,
                seed=3)
    whole = client.completions.create(**args)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == 16
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_whole_and_streamed(client):
    args = dict(model="entmaxkv-lm", max_tokens=6, seed=5,
                messages=[{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": "Who made the light?"}],
                extra_body={"entmaxkv": {"method": "certified", "budget": "1/16"}})
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("length", "stop")
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **args)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_bad_request_is_an_openai_error(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="entmaxkv-lm", prompt="a", max_tokens=-1)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="a")


def test_concurrent_clients(server, client):
    """32 clients, 4 requests each (streamed and not), answered in turn by the one worker:
    every answer equals the same request made alone, none is lost, no page is left in use."""
    prompts = ["In the beginning", "The LORD said", "def main():", "Python is"]
    expect = {}
    for i, p in enumerate(prompts):
        r = client.completions.create(model="entmaxkv-lm", prompt=p, max_tokens=8, seed=i,
                                      temperature=1.0)
        expect[p] = r.choices[0].text
    errors, done = [], []

    def one(k):
        try:
            for j in range(4):
                i = (k + j) % len(prompts)
                args = dict(model="entmaxkv-lm", prompt=prompts[i], max_tokens=8, seed=i,
                            temperature=1.0)
                if (k + j) % 2:
                    text = "".join(c.choices[0].text
                                   for c in client.completions.create(stream=True, **args))
                else:
                    text = client.completions.create(**args).choices[0].text
                assert text == expect[prompts[i]], (k, j, text)
                done.append(1)
        except Exception as e:  # noqa: BLE001 - reported below with the client's number
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(done) == 128
    assert metric(server, "entmaxkv_kv_pages_in_use") == 0
    assert metric(server, "entmaxkv_queue_depth") == 0


def test_readme_example(server):
    """The README's Serve listing, run as written but for the server's address."""
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("\n## Serve\n", 1)[1].split("\n## ", 1)[0]
    listing = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:8080" in listing
    out = subprocess.run([os.environ.get("PYTHON", __import__("sys").executable), "-c",
                          listing.replace("http://127.0.0.1:8080", server)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), out
