"""Every request field honoured or refused by name, and structured output: `response_format` JSON through a grammar
(serve/grammar.py), in batches that mix constrained and free requests, read back with the `openai` SDK's own
`parse`."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from live_server import NAME, LiveServer, error_of, idle, make_app, reference, stack  # noqa: F401
from pydantic import BaseModel, Field

from openflash.serve.grammar import GrammarCompiler
from openflash.serve.protocol import ResponseFormat

pytestmark = pytest.mark.usefixtures("one_thread")

USER = [{"role": "user", "content": "def main():"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "admin"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120},
                         "admin": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def live(stack):
    engine, app = make_app(stack)
    with LiveServer(app) as server:
        yield server, engine


def _valid_person(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "admin"} and isinstance(value["name"], str)
            and len(value["name"]) <= 6 and type(value["age"]) is int and 0 <= value["age"] <= 120
            and isinstance(value["admin"], bool))


def test_unknown_and_unserved_fields_are_refused_by_name(live):
    server, engine = live
    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, json={"model": NAME, "messages": USER, "temprature": 0.5})
    assert r.status_code == 400 and error_of(r)["param"] == "temprature" and error_of(r)["code"] == "unknown_parameter"
    for field, value in (("audio", {"voice": "x"}), ("modalities", ["text", "audio"]), ("prediction", {"x": 1}),
                         ("functions", [{"name": "f"}])):
        r = httpx.post(url, json={"model": NAME, "messages": USER, field: value})
        assert r.status_code == 400 and error_of(r)["param"] == field, r.text
        assert error_of(r)["code"] == "unsupported_parameter"
    r = httpx.post(url, json={"model": NAME, "messages": USER, "continue_final_message": True})
    assert r.status_code == 400 and error_of(r)["param"] == "continue_final_message"
    r = httpx.post(url, json={"model": NAME, "messages": USER, "top_logprobs": 2})
    assert r.status_code == 400 and error_of(r)["param"] == "top_logprobs"
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x", "logit_bias": {"x": 1}})
    assert r.status_code == 400 and error_of(r)["param"].startswith("logit_bias")
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x", "logit_bias": {"99999": 1}})
    assert r.status_code == 400 and error_of(r)["param"] == "logit_bias" and "99999" in error_of(r)["message"]
    r = httpx.post(url, json={"model": NAME, "messages": USER, "stream": True,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert r.status_code == 400 and error_of(r)["param"] == "stream_options.continuous_usage_stats"
    completions = server.url + "/v1/completions"
    r = httpx.post(completions, json={"model": NAME, "prompt": "x", "max_tokens": 2, "max_completion_tokens": 3})
    assert r.status_code == 400 and error_of(r)["param"] == "max_completion_tokens"
    newer = httpx.post(completions, json={"model": NAME, "prompt": "x", "max_completion_tokens": 2, "ignore_eos": True})
    assert newer.status_code == 200 and newer.json()["usage"]["completion_tokens"] == 2
    ok = httpx.post(url, json={"model": NAME, "messages": USER, "max_tokens": 1, "user": "u1", "store": False,
                               "metadata": {"run": "a"}, "modalities": ["text"]})
    assert ok.status_code == 200, ok.text
    assert idle(engine)


def test_every_response_carries_a_request_id(live):
    server, _ = live
    given = httpx.get(server.url + "/health", headers={"x-request-id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"
    made = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1})
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    refused = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x", "n": 0},
                         headers={"x-request-id": "bad\x01id"})
    assert refused.status_code == 400 and re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])


def test_sampling_options_change_what_is_generated(live, stack):
    server, engine = live
    client, tok = server.client(), stack.tokenizer
    token = tok.encode("os", add_special_tokens=False).ids[0]
    biased = client.completions.create(model=NAME, prompt="import", max_tokens=3, temperature=0,
                                       logit_bias={str(token): 100})
    assert biased.choices[0].text == tok.decode([token] * 3)
    plain = reference(stack, "def f(x):", 8)
    stop = plain[3:5]
    kept = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == plain[:plain.find(stop) + len(stop)]
    eos = stack.cfg.eos_token_id
    held = client.completions.create(model=NAME, prompt="x", max_tokens=6, temperature=0,
                                     logit_bias={str(eos): 100}, extra_body={"min_tokens": 2})
    assert held.usage.completion_tokens == 3 and held.choices[0].finish_reason == "stop"
    penalised = client.completions.create(model=NAME, prompt="import", max_tokens=3, temperature=0,
                                          logit_bias={str(token): 3.0}, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].text != tok.decode([token] * 3)
    assert idle(engine)


def test_json_schema_output_validates_for_every_seed_beside_free_requests(live, stack):
    server, engine = live
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def constrained(seed: int) -> str:
        out = client.chat.completions.create(model=NAME, messages=USER, max_tokens=64, temperature=1.0, seed=seed,
                                             response_format=fmt)
        return out.choices[0].message.content

    def free(_: int) -> str:
        return client.completions.create(model=NAME, prompt="def f(x):", max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:  # one engine batch holds masked and free rows
        replies = list(pool.map(constrained, range(8)))
        frees = list(pool.map(free, range(4)))
    assert all(_valid_person(json.loads(r)) for r in replies), replies
    assert len(set(replies)) > 1  # the seeds really sample
    assert frees == [reference(stack, "def f(x):", 8)] * 4
    # Any object: nothing bounds its keys, so a random model may still be inside one at max_tokens ("length").
    for seed in range(6):
        out = client.chat.completions.create(model=NAME, messages=USER, max_tokens=64, temperature=1.0, seed=seed,
                                             response_format={"type": "json_object"})
        text, reason = out.choices[0].message.content, out.choices[0].finish_reason
        assert text.startswith("{") and reason in ("stop", "length")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
    assert idle(engine)


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    admin: bool


def test_the_sdk_s_parse_gets_its_pydantic_model(live):
    server, engine = live
    for seed in range(3):
        out = server.client().chat.completions.parse(model=NAME, messages=USER, max_tokens=64, temperature=1.0,
                                                     seed=seed, response_format=Person)
        person = out.choices[0].message.parsed
        assert isinstance(person, Person) and 0 <= person.age <= 120
    assert idle(engine)


def test_a_schema_that_cannot_compile_is_a_400_naming_it(live):
    server, engine = live
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=NAME, messages=USER, response_format=fmt)
    assert e.value.body["param"] == "response_format.json_schema.schema"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": USER,
                                                               "response_format": {"type": "json_schema"}})
    assert r.status_code == 400 and error_of(r)["param"] == "response_format"
    assert idle(engine)


def test_in_thinking_mode_the_grammar_starts_after_the_reasoning(stack):
    compiler = GrammarCompiler(stack.tokenizer, stack.cfg.vocab_size, stack.cfg.eos_token_id)
    grammar = compiler.grammar(ResponseFormat(type="json_object"))
    think_end, free_token = 7, 12
    state = compiler.start(grammar, after_token=think_end)
    assert bool(state.allowed(stack.cfg.vocab_size).all())  # the reasoning is free
    assert state.advance(free_token) and state.advance(think_end)
    mask = state.allowed(stack.cfg.vocab_size)
    brace = stack.tokenizer.encode("{", add_special_tokens=False).ids[0]
    assert mask[brace] and int(mask.sum()) < stack.cfg.vocab_size // 10  # then the answer follows the grammar
    assert not state.finished
