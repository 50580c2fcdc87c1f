"""What a hostile client tried against `serve`, each refused with a 4xx naming the problem: JSON nested past any
walk's recursion, prompts too long to tokenize, numbers sent as strings or booleans, a stalled upload, and the
API key's reach (the schema pages, an empty key)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from live_server import MAX_CONTEXT, NAME, LiveServer, error_of, idle, make_app, stack  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def live(stack):  # noqa: F811
    rt = stack
    engine, app = make_app(rt, server_kw=dict(body_timeout=1.0))
    with LiveServer(app) as server:
        yield server, engine


def _assistant_call(arguments: str) -> str:
    """A chat body whose assistant turn carries a tool call with these (raw JSON) arguments."""
    head = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "@"}}]}]})
    return head.replace('"@"', arguments)


def test_deeply_nested_tool_arguments_are_400s_naming_the_field(live):
    server, engine = live
    where = "messages.1.tool_calls.0.function.arguments"
    as_text = json.dumps("[" * 10_000 + "]" * 10_000)  # a JSON string holding 10,000 levels
    as_object = '{"a":' * 950 + "1" + "}" * 950  # an object the body's parser still reads
    for arguments in (as_text, as_object):
        r = httpx.post(server.url + "/v1/chat/completions", content=_assistant_call(arguments),
                       headers={"content-type": "application/json"}, timeout=30)
        err = error_of(r)
        assert r.status_code == 400 and err["param"].startswith(where), r.text
        assert "nested more than 64 levels" in err["message"]
    tools = {"type": "function", "function": {"name": "f", "parameters": json.loads('{"a":' * 80 + "1" + "}" * 80)}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": [tools]})
    assert r.status_code == 400 and error_of(r)["param"].startswith("tools.0.function.parameters.a.a")
    beyond_the_parser = '{"model": "%s", "prompt": %s1%s}' % (NAME, "[" * 5000, "]" * 5000)
    r = httpx.post(server.url + "/v1/completions", content=beyond_the_parser,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json" and "nested" in error_of(r)["message"]
    assert idle(engine)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(stack):  # noqa: F811
    rt = stack
    tok = rt.tokenizer
    calls = []

    class CountingTokenizer:  # the real tokenizer, counting the characters it is asked to encode
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode_batch(self, texts, **kwargs):
            calls.append(sum(len(t) for t in texts))
            return tok.encode_batch(texts, **kwargs)

    from openflash.chat import chat_format
    from openflash.engine.engine import EngineConfig, LLMEngine
    from openflash.serve.app import ServerConfig, build_app

    engine = LLMEngine(rt, EngineConfig(max_batch=4, max_context=MAX_CONTEXT))
    app = build_app(engine, CountingTokenizer(), ServerConfig(NAME, chat_format(tok, 0, 1), drain_timeout=1.0))
    huge = "def f(x):\n    return x\n" * (400 << 10)  # 9.8 MB
    with LiveServer(app) as server:
        start = time.monotonic()
        for path, body in (("/v1/completions", {"model": NAME, "prompt": huge}),
                           ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": huge}]}),
                           ("/tokenize", {"prompt": huge})):
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
            assert f"the context holds {MAX_CONTEXT}" in error_of(r)["message"]
        assert time.monotonic() - start < 30 and not calls  # the tokenizer never saw them
        short = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x = 1", "max_tokens": 1})
        assert short.status_code == 200 and calls


def test_numbers_are_strict_and_fields_named_as_sent(live):
    server, engine = live
    url = server.url
    for field, value in (("max_tokens", True), ("max_tokens", "2"), ("n", "1"), ("temperature", "0.5"),
                         ("seed", False), ("stop_token_ids", ["5"])):
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", field: value})
        assert r.status_code == 400 and error_of(r)["param"].startswith(field), (field, value, r.text)
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                        "max_completion_tokens": 10 ** 6})
    assert r.status_code == 400 and error_of(r)["param"] == "max_completion_tokens"
    assert error_of(r)["message"].startswith("max_completion_tokens")
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": 10 ** 6})
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
    assert httpx.get(url + f"/v1/models/{NAME}").json()["id"] == NAME
    r = httpx.get(url + "/v1/models/gpt-4")
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found" and "gpt-4" in error_of(r)["message"]
    assert httpx.get(url + "/openapi.json").status_code == 200  # no key: the schema is served
    assert idle(engine)


def test_a_stalled_upload_times_out(live):
    server, _ = live
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        start, reply = time.monotonic(), b""
        while chunk := s.recv(4096):  # the server closes the connection after its answer
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply
        assert time.monotonic() - start < 8
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_api_key_covers_the_schema_and_cannot_be_empty(stack, capsys, monkeypatch):  # noqa: F811
    rt = stack
    _, app = make_app(rt, server_kw=dict(api_key="s3cret"))
    with LiveServer(app) as server:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(server.url + path).status_code == 404, path
        assert httpx.get(server.url + f"/v1/models/{NAME}", headers={"Authorization": "Bearer s3cret"}).status_code \
            == 200
        assert httpx.get(server.url + f"/v1/models/{NAME}").status_code == 401
    from openflash.cli import main as cli_main

    assert cli_main(["serve", "--model", "tiny", "--api-key", ""]) == 2
    assert "--api-key is empty: that would turn authentication off" in capsys.readouterr().err
    monkeypatch.setenv("OPENFLASH_API_KEY", " ")
    assert cli_main(["serve", "--model", "tiny"]) == 2
    assert "OPENFLASH_API_KEY is empty" in capsys.readouterr().err
