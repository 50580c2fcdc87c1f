"""The OpenAI-compatible server, driven live on 127.0.0.1 with the official `openai` client.

The tiny preset (random weights, "plain" numerics for exact equality) with a BPE tokenizer trained here: the `stack`
fixture of tests/live_server.py, which the other server tests share.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import wait_for_health
from live_server import (MAX_CONTEXT, NAME, LiveServer, error_of, free_port, idle, make_app, reference,  # noqa: F401
                         stack)
from starlette.testclient import TestClient

from openflash.chat import chat_format
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.sampling import SamplingParams
from openflash.serve.app import ServerConfig, build_app


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def live(stack):
    """The app on a live server for the module's tests (they leave it idle)."""
    rt = stack
    engine, app = make_app(rt)
    with LiveServer(app) as server:
        yield server, engine
    assert not engine.accepting and not engine.has_work()  # shut down with the server


# ---- completions and chat ----------------------------------------------------------------------------------------


def test_completions_stream_equals_nonstream_equals_sequential(live, stack):
    server, engine = live
    rt = stack
    tok = rt.tokenizer
    client = server.client()
    prompt = "def split(self, text):\n    "
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    want = reference(rt, prompt, 8)
    assert full.choices[0].text == want
    n_prompt = len(tok.encode(prompt).ids)
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.total_tokens == n_prompt + full.usage.completion_tokens
    assert full.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices
    # Token-id prompts, n choices, echo.
    ids = tok.encode("import re").ids
    multi = client.completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0, n=2, echo=True)
    assert [c.index for c in multi.choices] == [0, 1]
    assert multi.choices[0].text == multi.choices[1].text == "import re" + reference(rt, ids, 3)
    assert multi.usage.prompt_tokens == len(ids)


def test_chat_stream_and_nonstream(live, stack):
    server, engine = live
    rt = stack
    tok = rt.tokenizer
    client = server.client()
    messages = [{"role": "system", "content": "You wrap text."}, {"role": "user", "content": "Wrap this line."}]
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    fmt = chat_format(tok, 0, 1)
    assert fmt.name == "simple" and fmt.bos == "<|bos|>" and fmt.eos == "<|eos|>"
    rendered = "<|bos|>You wrap text.<｜User｜>Wrap this line.<｜Assistant｜>"
    ids = tok.encode(rendered, add_special_tokens=False).ids
    assert full.usage.prompt_tokens == len(ids)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == reference(rt, ids, 6)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    # Seeded sampling is reproducible.
    a, b = (client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0.9,
                                           seed=7).choices[0].message.content for _ in range(2))
    assert a == b


def test_models_health_tokenize_detokenize_metrics(live, stack):
    server, engine = live
    tok = stack.tokenizer
    client = server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.post(server.url + "/tokenize", json={"prompt": "import os"}).json()
    assert r["tokens"] == tok.encode("import os").ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_CONTEXT
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tok.encode("<|bos|><｜User｜>hi<｜Assistant｜>", add_special_tokens=False).ids
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "import os"}
    client.completions.create(model=NAME, prompt="x = 1", max_tokens=2, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("openflash_time_to_first_token_seconds_bucket", "openflash_inter_token_latency_seconds_count",
                 "openflash_num_requests_waiting", "openflash_num_requests_running", "openflash_kv_blocks_in_use",
                 "openflash_prefix_cache_hit_rate", "openflash_generation_tokens_per_second",
                 "openflash_generation_tokens_total", 'openflash_requests_finished_total{reason="length"}'):
        assert name in text, name


# ---- errors ------------------------------------------------------------------------------------------------------


def test_error_responses(live):
    server, engine = live
    url = server.url
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny-test", "prompt": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
    r = httpx.post(url + "/v1/completions", content=b"not json")
    assert r.status_code == 400 and "malformed JSON" in error_of(r)["message"]
    r = httpx.post(url + "/v1/nothing", json={})
    assert r.status_code == 404
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["param"] == "model" and "tiny-test" in e.value.body["message"]
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=NAME, prompt=[5] * 300, max_tokens=1)
    assert e.value.status_code == 400 and e.value.body["code"] == "context_length_exceeded"
    cases = [
        (dict(prompt="x", max_tokens=MAX_CONTEXT), "max_tokens"),  # more than the context left
        (dict(prompt="x", max_tokens=0), "max_tokens"),
        (dict(prompt="x", temperature=3), "temperature"),
        (dict(prompt="x", top_p=0), "top_p"),
        (dict(prompt="x", n=0), "n"),
        (dict(prompt="x", presence_penalty=2.5), "presence_penalty"),
        (dict(prompt="x", stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(prompt="x", extra_body={"top_k": -5}), "top_k"),
        (dict(prompt="x", seed=-1), "seed"),
    ]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=NAME, **kwargs)
        assert e.value.body["param"] == field and field in e.value.body["message"], (kwargs, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["param"].startswith("messages")
    r = httpx.post(url + "/detokenize", json={"tokens": [5, 99999]})
    assert r.status_code == 400 and error_of(r)["param"] == "tokens"
    assert idle(engine)


def _raw_requests(port: int, bodies: list[tuple[str, bytes]]) -> list[tuple[int, bytes]]:
    """POST each (path, JSON bytes) in turn over ONE kept-alive connection; (status, body) of each. Fails if the
    server closes the connection early."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        reader = sock.makefile("rb")
        for path, body in bodies:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            status_line = reader.readline()
            assert status_line, "the server closed the connection"
            headers = {}
            while (line := reader.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                headers[key.strip().lower()] = value.strip()
            out.append((int(status_line.split()[1]), reader.read(int(headers["content-length"]))))
            assert headers.get("connection") != "close"
    return out


def test_lone_surrogates_are_400s_naming_the_field_and_keep_the_connection(live):
    server, engine = live
    cases = [
        ("/v1/completions", b'{"model": "tiny-test", "prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
        ("/v1/completions", b'{"model": "tiny-test", "prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt.1"),
        ("/v1/chat/completions", b'{"model": "tiny-test", "messages": [{"role": "user", "content": "x\\ud800"}]}',
         "messages.0.content"),
        ("/v1/chat/completions", b'{"model": "tiny-test", "messages": [{"role": "user", "content": '
                                 b'[{"type": "text", "text": "\\ud83d"}]}]}', "messages.0.content.0.text"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b'{"model": "tiny-test", "prompt": "x", "stop": ["\\ud800"], "max_tokens": 1}', "stop.0"),
        ("/v1/completions", b'{"model": "tiny-\\ud800", "prompt": "x", "max_tokens": 1}', "model"),
    ]
    good = ("/tokenize", b'{"prompt": "import os"}')
    replies = _raw_requests(server.port, [item for path, body, _ in cases for item in ((path, body), good)])
    for (path, body, field), (status, reply), (good_status, _) in zip(cases, replies[::2], replies[1::2]):
        err = json.loads(reply)["error"]
        assert status == 400 and err["param"] == field and err["code"] == "invalid_text", (body, err)
        assert "surrogate" in err["message"] and field in err["message"]
        assert good_status == 200  # the same connection serves the next request
    assert idle(engine)


def test_invalid_values_that_used_to_pass(live):
    server, engine = live
    url = server.url
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", "stop_token_ids": [2**70]})
    assert r.status_code == 400 and error_of(r)["param"] == "stop_token_ids"
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", "stop_token_ids": [5, 1024]})
    assert r.status_code == 400 and "1024" in error_of(r)["message"]
    for field in ("stream", "echo", "ignore_eos"):
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", field: "yes"})
        assert r.status_code == 400 and error_of(r)["param"] == field, r.text
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "stream": 1,
                                                        "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and error_of(r)["param"] == "stream"
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", "stream": True,
                                                   "stream_options": {"include_usage": "yes"}})
    assert r.status_code == 400 and error_of(r)["param"] == "stream_options.include_usage"
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny-test", "prompt": "x"}',
                   headers={"content-type": "text/plain"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_content_type"
    # Echoed values are cut: a 1 MiB model name does not come back as a 1 MB error.
    r = httpx.post(url + "/v1/completions", json={"model": "m" * (1 << 20), "prompt": "x"})
    assert r.status_code == 404 and len(r.content) < 4096 and "1048576 characters" in error_of(r)["message"]
    assert idle(engine)


def test_request_body_limit_and_tokenization_off_the_event_loop(stack):
    rt = stack
    engine, app = make_app(rt, server_kw=dict(max_request_bytes=64 << 10))
    with LiveServer(app) as server:
        big = {"model": NAME, "prompt": "x = 1\n" * (200 << 10), "max_tokens": 1}
        r = httpx.post(server.url + "/v1/completions", json=big, timeout=30)
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large" and "65536" in error_of(r)["message"]

        def chunked():  # no Content-Length: the limit applies to the streamed bytes
            yield b'{"model": "tiny-test", "prompt": "'
            for _ in range(100):
                yield b"y" * 4096
            yield b'"}'

        r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
        assert httpx.get(server.url + "/health").status_code == 200
    # The default limit (32 MiB) refuses a 40 MiB prompt before reading it.
    engine, app = make_app(rt)
    with LiveServer(app) as server:
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"model": NAME, "prompt": "z" * (40 << 20), "max_tokens": 1})
        assert r.status_code == 413 and str(32 << 20) in error_of(r)["message"]


def test_tokenization_runs_off_the_event_loop(stack):
    """While one request is being tokenized, /health answers: the tokenizer runs in a worker thread."""
    rt = stack
    model, tok = rt.model, rt.tokenizer
    tokenizing, release = threading.Event(), threading.Event()

    class BlockingTokenizer:  # the real tokenizer, held at encode_batch until the test lets go
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode_batch(self, *args, **kwargs):
            tokenizing.set()
            assert release.wait(30)
            return tok.encode_batch(*args, **kwargs)

    engine = LLMEngine(rt, EngineConfig(max_batch=4, max_context=MAX_CONTEXT))
    fmt = chat_format(tok, model.cfg.bos_token_id, model.cfg.eos_token_id)
    app = build_app(engine, BlockingTokenizer(), ServerConfig(NAME, fmt, drain_timeout=2.0))
    with LiveServer(app) as server, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, server.url + "/tokenize", json={"prompt": "import os"}, timeout=60)
        assert tokenizing.wait(30)
        try:
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        finally:
            release.set()
        assert pending.result().json()["tokens"] == tok.encode("import os").ids


def test_api_key(stack):
    rt = stack
    engine, app = make_app(rt, server_kw=dict(api_key="s3cret"))
    with LiveServer(app) as server:
        url = server.url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x"}, headers=headers)
            assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key", (headers, r.text)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200  # stays open (load balancers)
        with pytest.raises(openai.AuthenticationError):
            server.client().models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=NAME, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_queue_full_is_429(stack):
    rt = stack
    engine, app = make_app(rt, max_waiting=1)
    client = TestClient(app)  # no lifespan: the engine thread never starts, so the queue stays full
    engine.add_request([5, 6], SamplingParams(max_tokens=1))
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 429
    err = error_of(r)
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"


# ---- cancellation, concurrency, shutdown -------------------------------------------------------------------------


def test_client_disconnect_cancels_the_sequence(live):
    server, engine = live
    aborted = engine.metrics.requests_finished["abort"]
    client = server.client()
    stream = client.completions.create(model=NAME, prompt="while True:", max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for n, _ in enumerate(stream):
        if n == 2:
            break
    stream.close()
    assert idle(engine), engine.stats()
    assert engine.metrics.requests_finished["abort"] == aborted + 1
    # A non-streaming request whose client gives up is cancelled too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=1.0,
                   json={"model": NAME, "prompt": "for x in y:", "max_tokens": 200, "ignore_eos": True})
    assert idle(engine), engine.stats()
    assert engine.metrics.requests_finished["abort"] == aborted + 2


def test_32_concurrent_requests_equal_sequential(live, stack):
    server, engine = live
    rt = stack
    words = ["def", "class", "import", "return", "while", "lambda", "yield", "with"]
    prompts = [f"{words[i % 8]} {words[(i * 3) % 8]}_{i}(" for i in range(32)]
    client = server.client()

    def ask(prompt: str) -> str:
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0).choices[0].text

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, prompts))
    assert got == [reference(rt, p, 4) for p in prompts]
    assert idle(engine)


def test_shutdown_aborts_what_does_not_drain(stack):
    rt = stack
    engine, app = make_app(rt)
    with LiveServer(app, graceful=0.5) as server:
        stream = server.client().completions.create(model=NAME, prompt="x", max_tokens=200, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        server.server.should_exit = True
        with pytest.raises(Exception):  # the connection is closed before the 200 tokens
            for chunk in stream:
                assert chunk.choices[0].finish_reason is None
        server.thread.join(timeout=30)
    assert not engine.accepting and not engine.has_work()
    assert engine.metrics.requests_finished["abort"] == 1 and engine.factory.pool.blocks_in_use == 0


def test_serve_refuses_bad_limits(capsys):
    from openflash.cli import main as cli_main

    assert cli_main(["serve", "--model", "tiny", "--max-request-bytes", "0"]) == 2
    assert "--max-request-bytes must be >= 1 (got 0)" in capsys.readouterr().err
    assert cli_main(["serve", "--model", "tiny", "--thinking"]) == 2  # the preset's tokenizer: the simple template
    assert "--thinking needs the deepseek-v4.1 chat template; this model's is 'simple'" in capsys.readouterr().err
    assert cli_main(["serve", "--model", "tiny", "--speculative", "dspark"]) == 2
    assert "needs a model with a DSpark draft head" in capsys.readouterr().err
    # the engine's settings, checked from the flags before the model loads, each refusal naming its flag
    for flags, says in ((["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
                        (["--max-context", "1"], "--max-context must be >= 2, got 1"),
                        (["--prefill-padding", "1"], "--prefill-padding must be in [0, 1), got 1.0"),
                        (["--num-speculative-tokens", "2"], "--num-speculative-tokens needs --speculative")):
        assert cli_main(["serve", "--model", "/nonexistent/model", *flags]) == 2
        err = capsys.readouterr().err
        assert says in err and "nonexistent" not in err


def test_openflash_serve_command(tmp_path):
    """`openflash serve --model tiny`: a preset with random weights (logged as such), served until SIGINT."""
    port = free_port()
    env = {**os.environ, "OPENFLASH_CACHE": str(tmp_path)}
    cmd = [sys.executable, "-m", "openflash.cli", "serve", "--model", "tiny", "--port", str(port),
           "--max-batch", "4", "--max-context", "128"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, proc, 90)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2
        # Any text works on a preset: it comes with a tokenizer that fits its vocabulary.
        out = client.completions.create(model="tiny", prompt="def fibonacci(n): 😀", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2
        # Greedy: sampled at temperature 1, random weights may pick the end of the turn first (a flaky 1 token).
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "héllo, 世界"}],
                                              max_tokens=2, temperature=0)
        assert chat.usage.completion_tokens == 2
    finally:
        proc.send_signal(signal.SIGINT)
        log, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, log
    assert "RANDOM weights" in log


def test_simple_template_takes_tools_as_text_and_refuses_what_it_cannot_do(live, stack):
    server, _ = live
    tok = stack.tokenizer
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "Find x."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "x = 1"}]
    client = server.client()
    out = client.chat.completions.create(model=NAME, messages=messages, tools=[tool], max_tokens=3, temperature=0)
    rendered = ("<|bos|>## Tools\n" + json.dumps(tool["function"]) + "<｜User｜>Find x.<｜Assistant｜>\n[tool call c1] "
                "lookup {}<|eos|><｜User｜>[tool result c1]\nx = 1<｜Assistant｜>")
    assert out.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False).ids)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"
    for extra, param in (({"tool_choice": "required"}, "tool_choice"),
                         ({"reasoning_effort": "high"}, "reasoning_effort"),
                         ({"chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs.thinking")):
        body = {"model": NAME, "messages": messages, "tools": [tool], "max_tokens": 3, **extra}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_serving_benchmark_refuses_a_step_budget_below_one():
    """benchmarks/serve.py checks its side-by-side lists before it loads a model."""
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "serve.py")
    done = subprocess.run([sys.executable, script, "--step-tokens", "512", "0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--step-tokens values must be >= 1, got [512, 0]" in done.stderr, done.stderr
