"""The V4.1 chat protocol through the real server and the official `openai` client: thinking and reasoning effort,
tool definitions, tool turns, DSML tool calls parsed and streamed, tool_choice, and the 400s of bad requests.

No model here was trained to think or call tools, so the engine's token choice replays scripted completions
(`ScriptedEngine.next_tokens`, the only test double): the model, caches, scheduler, detokenization, stop
conditions and the whole server are the real ones. The model is the tiny preset with the released vocabulary.
"""

from __future__ import annotations

import json
import logging
import os

import httpx
import pytest
import torch
from live_server import LiveServer

from openflash.chat import chat_format
from openflash.chat.conversation import ChatOptions, ToolCall, ToolSpec, Turn
from openflash.config import load_config
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.memory.tokenmap import build_compressed_token_map
from openflash.model.numerics import NUMERICS
from openflash.model.transformer import Transformer
from openflash.runtime.runtime import Runtime
from openflash.serve.app import ServerConfig, build_app
from openflash.tokenizer import load_tokenizer

NAME = "tiny-v41"
D = "｜DSML｜"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"},
                                                                          "days": {"type": "integer"}}}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}

pytestmark = pytest.mark.usefixtures("one_thread")


def invoke(name: str, **params) -> str:
    body = "\n".join(f'<{D} parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                     f'{v if isinstance(v, str) else json.dumps(v)}</{D} parameter>' for k, v in params.items())
    return f'<{D} invoke name="{name}">\n{body}\n</{D} invoke>'


def calls_block(*invokes: str) -> str:
    return f"\n\n<{D} calls>\n" + "\n".join(invokes) + f"\n</{D} calls>"


class ScriptedEngine(LLMEngine):
    """The real engine; each sequence's next token comes from the script whose key its prompt contains (the
    longest such key), then EOS. `prompts` records the prompt text of every request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scripts: dict[str, list[int]] = {}
        self.prompts: list[str] = []

    def script(self, key: str, completion: str) -> None:
        self.scripts[key] = self.tokenizer.encode(completion, add_special_tokens=False).ids + [self.cfg.eos_token_id]

    def next_tokens(self, logits: torch.Tensor, seqs) -> list[int]:
        out = []
        for seq in seqs:
            prompt = self.tokenizer.decode(seq.prompt_ids, skip_special_tokens=False)
            if not seq.output_ids:
                self.prompts.append(prompt)
            keys = [k for k in self.scripts if k in prompt]
            assert keys, f"no script for prompt ...{prompt[-200:]!r}"
            script = self.scripts[max(keys, key=len)]
            out.append(script[min(len(seq.output_ids), len(script) - 1)])
        return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server_chat")
    old_cache = os.environ.get("OPENFLASH_CACHE")
    os.environ["OPENFLASH_CACHE"] = str(tmp / "cache")
    try:
        tok = load_tokenizer("deepseek")
        token_map = build_compressed_token_map(tok, tok.get_vocab_size(with_added_tokens=True))
        cfg = load_config("tiny").replace(vocab_size=tok.get_vocab_size(with_added_tokens=True),
                                          engram_compressed_vocab_size=int(token_map.max()) + 1, image_token_id=None)
        torch.manual_seed(0)
        model = Transformer(cfg).set_numerics(NUMERICS["plain"]).eval()
        engine = ScriptedEngine(Runtime.of(model, tok), EngineConfig(max_batch=8, max_context=2048, prefill_chunk=256,
                                                         max_step_tokens=2048))
        fmt = chat_format(tok, cfg.bos_token_id, cfg.eos_token_id)
        assert fmt.name == "deepseek-v4.1"
        app = build_app(engine, tok, ServerConfig(NAME, fmt, drain_timeout=2.0))
        with LiveServer(app) as server:
            yield server, engine, fmt
    finally:
        if old_cache is None:
            os.environ.pop("OPENFLASH_CACHE", None)
        else:
            os.environ["OPENFLASH_CACHE"] = old_cache


def reassemble(chunks) -> tuple[dict, str | None]:
    """A streamed choice 0 as the message the non-streamed response holds."""
    content, reasoning, calls, finish = None, None, {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content is not None:
            content = (content or "") + delta.content
        extra = getattr(delta, "reasoning_content", None)
        if extra is not None:
            reasoning = (reasoning or "") + extra
        for tc in delta.tool_calls or ():
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "reasoning": reasoning,
            "calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]}, finish


def whole(response) -> tuple[dict, str]:
    message = response.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls or ())
    return {"content": message.content, "reasoning": getattr(message, "reasoning_content", None),
            "calls": calls}, response.choices[0].finish_reason


def ask_both(client, **kwargs) -> tuple[dict, str]:
    """The non-streamed and the streamed response must agree; returns the message and finish reason."""
    full = whole(client.chat.completions.create(model=NAME, temperature=0, **kwargs))
    streamed = reassemble(client.chat.completions.create(model=NAME, temperature=0, stream=True, **kwargs))
    assert streamed == full
    return full


def test_tool_call_parsed_and_streamed(served):
    server, engine, fmt = served
    engine.script("SCRIPT:weather", "Let me check." + calls_block(invoke("get_weather", city="Paris", days=3),
                                                                    invoke("get_weather", city="Zürich")))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "SCRIPT:weather Paris?"}]
    engine.prompts.clear()
    message, finish = ask_both(server.client(), messages=messages, tools=[WEATHER], max_tokens=200)
    assert message == {"content": "Let me check.", "reasoning": None,
                       "calls": [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Zürich"})]}
    assert finish == "tool_calls"
    tool = ToolSpec("get_weather", WEATHER["function"]["parameters"], "Weather by city")
    expected = fmt.render([Turn("system", ("Be brief.",)), Turn("user", ("SCRIPT:weather Paris?",))],
                          ChatOptions(tools=(tool,)))
    assert engine.prompts[0] == expected and "## Tools" in expected


def test_thinking_and_reasoning_effort(served):
    server, engine, _ = served
    client = server.client()
    engine.script("SCRIPT:sum", "Two and two make four.</think>It is 4.")
    messages = [{"role": "user", "content": "SCRIPT:sum 2+2?"}]
    engine.prompts.clear()
    message, finish = ask_both(client, messages=messages, reasoning_effort="max", max_tokens=50)
    assert message == {"content": "It is 4.", "reasoning": "Two and two make four.", "calls": []} and finish == "stop"
    assert "Reasoning Effort: 100" in engine.prompts[0] and engine.prompts[0].endswith("<think>")
    # The other ways to ask for thinking, and to refuse it.
    for extra in ({"thinking": {"type": "enabled"}}, {"chat_template_kwargs": {"thinking": True}},
                  {"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": 30}}):
        got, _ = ask_both(client, messages=messages, max_tokens=50, extra_body=extra)
        assert got["reasoning"] == "Two and two make four."
    engine.script("SCRIPT:plain", "Four.")
    engine.prompts.clear()
    got, _ = ask_both(client, messages=[{"role": "user", "content": "SCRIPT:plain"}], max_tokens=20,
                      extra_body={"chat_template_kwargs": {"thinking": False}})
    assert got == {"content": "Four.", "reasoning": None, "calls": []}
    assert engine.prompts[0].endswith("<｜Assistant｜></think>") and "Reasoning Effort" not in engine.prompts[0]


def test_agent_loop_turns_reach_the_prompt(served):
    server, engine, fmt = served
    engine.script("SCRIPT:loop", "The tool answered.</think>It rains in Rome.")
    messages = [
        {"role": "user", "content": "SCRIPT:loop weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "ask the tool",
         "tool_calls": [{"id": "call_a", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome"})}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "rain"},
    ]
    engine.prompts.clear()
    message, finish = ask_both(server.client(), messages=messages, tools=[WEATHER], max_tokens=50,
                               reasoning_effort="high")
    assert message == {"content": "It rains in Rome.", "reasoning": "The tool answered.", "calls": []}
    assert finish == "stop"
    tool = ToolSpec("get_weather", WEATHER["function"]["parameters"], "Weather by city")
    turns = [Turn("user", ("SCRIPT:loop weather?",)),
             Turn("assistant", (), "ask the tool", (ToolCall("call_a", "get_weather", '{"city": "Rome"}'),)),
             Turn("tool", ("rain",), tool_call_id="call_a")]
    prompt = engine.prompts[0]
    assert prompt == fmt.render(turns, ChatOptions(thinking=True, reasoning_effort="high", tools=(tool,)))
    assert f'<think>ask the tool</think>\n\n<{D} calls>\n<{D} invoke name="get_weather">' in prompt
    assert prompt.endswith("<｜User｜><tool_result>rain</tool_result><｜Assistant｜><think>")


def test_tool_choice_required_and_named(served):
    server, engine, _ = served
    client = server.client()
    # Chat mode, required: the prompt ends with the forced opener; the model writes the rest of the call.
    engine.script("SCRIPT:forced", 'get_weather">\n' + f'<{D} parameter name="city" string="true">Oslo</{D} parameter>'
                  f"\n</{D} invoke>\n</{D} calls>")
    engine.prompts.clear()
    message, finish = ask_both(client, messages=[{"role": "user", "content": "SCRIPT:forced"}],
                               tools=[WEATHER, LOOKUP], tool_choice="required", max_tokens=60)
    assert message == {"content": None, "reasoning": None, "calls": [("get_weather", {"city": "Oslo"})]}
    assert finish == "tool_calls" and engine.prompts[0].endswith(f'</think>\n\n<{D} calls>\n<{D} invoke name="')
    # Thinking, named: the model reasons, closes </think>, then the server writes the opener with the name.
    plan = "Plan: call lookup with the query v41."
    engine.script("SCRIPT:named", plan + "</think>I will not call anything.")
    engine.script(plan, f'<{D} parameter name="query" string="true">v41</{D} parameter>\n</{D} invoke>\n</{D} calls>')
    engine.prompts.clear()
    kwargs = dict(messages=[{"role": "user", "content": "SCRIPT:named"}], tools=[WEATHER, LOOKUP], max_tokens=80,
                  tool_choice={"type": "function", "function": {"name": "lookup"}}, reasoning_effort="low")
    message, finish = ask_both(client, **kwargs)
    assert message == {"content": None, "reasoning": plan, "calls": [("lookup", {"query": "v41"})]}
    assert finish == "tool_calls"
    assert engine.prompts[1].endswith(f'{plan}</think>\n\n<{D} calls>\n<{D} invoke name="lookup">\n')
    usage = client.chat.completions.create(model=NAME, temperature=0, **kwargs).usage
    tok = engine.tokenizer
    phase1 = len(tok.encode(plan + "</think>", add_special_tokens=False).ids)
    # the second request's tokens: the call's grammar (serve/grammar.py) ends it at the block's close, so the
    # script's EOS is never generated
    rest = len(engine.scripts[plan]) - 1
    forced = len(tok.encode(engine.prompts[1][len(engine.prompts[0]) + len(plan) + len("</think>"):],
                            add_special_tokens=False).ids)
    assert usage.completion_tokens == phase1 + forced + rest


def test_malformed_tool_block_is_text(served, caplog):
    server, engine, _ = served
    completion = "Sure." + calls_block(invoke("rm_rf", path="/"))  # not one of the request's tools
    engine.script("SCRIPT:bad", completion)
    with caplog.at_level(logging.WARNING, logger="openflash.chat"):
        message, finish = ask_both(server.client(), messages=[{"role": "user", "content": "SCRIPT:bad"}],
                                   tools=[WEATHER], max_tokens=80)
    assert message == {"content": completion, "reasoning": None, "calls": []} and finish == "stop"
    assert "malformed tool-call block" in caplog.text


@pytest.mark.parametrize("change,param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": ["get_weather"]}, "tools.0"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters.type"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]}, "messages.1.tool_call_id"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]},
        {"role": "user", "content": "and?"}]}, "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "messages.1"),
    ({"reasoning_effort": "medium"}, "reasoning_effort"),
    ({"reasoning_effort": 101}, "reasoning_effort"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
    ({"chat_template_kwargs": {"effort": 3}}, "chat_template_kwargs.effort"),
])
def test_bad_chat_requests_are_400s_naming_the_field(served, change, param):
    server, _, _ = served
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **change}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_a_forced_call_s_arguments_follow_the_tool_s_schema(served):
    """A real (random) model, not a script: under tool_choice named or required the arguments are masked by the
    call's grammar (chat/dsml.py call_grammar), so every sampled call parses and validates, thinking mode too."""
    _, scripted, fmt = served
    strict = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1,
                                                                           "maximum": 9},
                       "unit": {"type": "string", "enum": ["C", "F"]}}}}}
    engine = LLMEngine(scripted.runtime, EngineConfig(max_batch=8, max_context=2048, prefill_chunk=256,
                                                      max_step_tokens=2048))
    app = build_app(engine, scripted.tokenizer, ServerConfig(NAME, fmt, drain_timeout=2.0))
    with LiveServer(app) as server:
        client = server.client()
        # thinking: a random model does not close its reasoning by itself, so </think> is favoured (logit_bias);
        # the call's grammar then masks it, as everything else that is not the call
        close = {str(scripted.tokenizer.token_to_id("</think>")): 100}
        asks = [dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                dict(tool_choice="required"), dict(tool_choice="required", reasoning_effort="low", logit_bias=close)]
        for seed, ask in enumerate(asks * 2):
            out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Weather?"}],
                                                 tools=[strict, LOOKUP], max_tokens=400, temperature=1.0, seed=seed,
                                                 **ask)
            choice = out.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, (ask, choice)
            for call in choice.message.tool_calls:
                args = json.loads(call.function.arguments)
                if call.function.name == "get_weather":
                    assert len(args["city"]) <= 8 and "<" not in args["city"] and type(args["days"]) is int
                    assert 1 <= args["days"] <= 9 and args.get("unit", "C") in ("C", "F")
                else:
                    assert call.function.name == "lookup" and set(args) <= {"query"}
