"""The chat formats: DeepSeek-V4.1 prompts written out by hand, render-then-parse round trips, streamed parses that
equal whole ones, malformed tool blocks, and the simple template of models trained here."""

from __future__ import annotations

import json
import logging

import pytest

from openflash.chat import chat_format
from openflash.chat.completion import CompletionParser, parse_completion
from openflash.chat.conversation import ChatOptions, Content, Reasoning, ToolCall, ToolSpec, Turn
from openflash.chat.dsv41 import DeepSeekV41Format
from openflash.config import load_config
from openflash.errors import ConfigError, RequestError
from openflash.tokenizer import load_tokenizer, preset_tokenizer

BOS, EOS, SYS, USER, ASSIST = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜System｜>", "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}, "Weather by city")
LOOKUP = ToolSpec("lookup", {"type": "object", "properties": {"query": {"type": "string"}}})


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("deepseek")


@pytest.fixture(scope="module")
def v41(tok):
    fmt = chat_format(tok, 0, 1)
    assert isinstance(fmt, DeepSeekV41Format)
    return fmt


def call(name: str, call_id: str = "c1", **args) -> ToolCall:
    return ToolCall(call_id, name, json.dumps(args))


# ---- prompts, written out -------------------------------------------------------------------------------------


def test_chat_mode_and_thinking_mode_prompts(v41):
    turns = [Turn("system", ("Be brief.",)), Turn("user", ("Hi",))]
    assert v41.render(turns, ChatOptions()) == f"{BOS}{SYS}Be brief.{USER}Hi{ASSIST}</think>"
    effort = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    assert v41.render(turns, ChatOptions(thinking=True)) == \
        f"{BOS}{SYS}{effort.format(50)}Be brief.{USER}Hi{ASSIST}<think>"
    for level, budget in (("low", 25), ("xhigh", 75), ("max", 100), (7, 7)):
        assert v41.render(turns, ChatOptions(thinking=True, reasoning_effort=level)) == \
            f"{BOS}{SYS}{effort.format(budget)}Be brief.{USER}Hi{ASSIST}<think>"
    # Without a system message the effort line still sits behind <｜System｜>; chat mode has no effort line.
    assert v41.render(turns[1:], ChatOptions(thinking=True, reasoning_effort="max")) == \
        f"{BOS}{SYS}{effort.format(100)}{USER}Hi{ASSIST}<think>"
    assert v41.render(turns[1:], ChatOptions(reasoning_effort="max")) == f"{BOS}{USER}Hi{ASSIST}</think>"


def test_thinking_drops_the_reasoning_of_earlier_turns_without_tools(v41):
    turns = [Turn("user", ("1+1?",)), Turn("assistant", ("2",), reasoning="add"), Turn("user", ("2+2?",))]
    effort = "Reasoning Effort: 50 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    assert v41.render(turns, ChatOptions(thinking=True)) == \
        f"{BOS}{SYS}{effort}{USER}1+1?{ASSIST}</think>2{EOS}{USER}2+2?{ASSIST}<think>"
    assert v41.render(turns, ChatOptions()) == f"{BOS}{USER}1+1?{ASSIST}</think>2{EOS}{USER}2+2?{ASSIST}</think>"


def test_tools_calls_and_results_prompt(v41):
    turns = [Turn("user", ("Weather in Paris and Rome?",)),
             Turn("assistant", ("Checking.",), reasoning="two cities",
                  tool_calls=(call("get_weather", "a", city="Paris"), call("get_weather", "b", city="Rome", days=2))),
             Turn("tool", ("rain",), tool_call_id="b"), Turn("tool", ("sun",), tool_call_id="a")]
    prompt = v41.render(turns, ChatOptions(tools=(WEATHER,)))
    head, rest = prompt.split(f"{USER}Weather", 1)
    assert head.startswith(f"{BOS}{SYS}\n\n## Tools\n\nYou have access to a set of tools")
    assert f'{json.dumps(WEATHER.schema())}\n\nYou MUST strictly follow' in head
    calls = (f'\n\n<{D} calls>\n<{D} invoke name="get_weather">\n'
             f'<{D} parameter name="city" string="true">Paris</{D} parameter>\n</{D} invoke>\n'
             f'<{D} invoke name="get_weather">\n<{D} parameter name="city" string="true">Rome</{D} parameter>\n'
             f'<{D} parameter name="days" string="false">2</{D} parameter>\n</{D} invoke>\n</{D} calls>')
    # Results merge into one user turn, in the order of the calls they answer.
    assert rest == (f" in Paris and Rome?{ASSIST}</think>Checking.{calls}{EOS}"
                    f"{USER}<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>{ASSIST}</think>")
    # Thinking with tools keeps every turn's reasoning.
    thinking = v41.render(turns, ChatOptions(thinking=True, tools=(WEATHER,)))
    assert f"{ASSIST}<think>two cities</think>Checking.{calls}{EOS}" in thinking and thinking.endswith("<think>")
    # tool_choice "none": no tools section.
    assert "## Tools" not in v41.render(turns, ChatOptions(tools=(WEATHER,), tool_choice="none"))


def test_mid_conversation_system_and_developer(v41):
    turns = [Turn("user", ("Hi",)), Turn("assistant", ("Hello",)), Turn("system", ("Now answer briefly.",))]
    assert v41.render(turns, ChatOptions()) == \
        f"{BOS}{USER}Hi{ASSIST}</think>Hello{EOS}{SYS}Now answer briefly.{ASSIST}</think>"


def test_refusals(v41):
    with pytest.raises(RequestError) as err:
        v41.check(ChatOptions(thinking=True, reasoning_effort="medium"))
    assert err.value.param == "reasoning_effort" and "xhigh" in str(err.value)
    for bad in (0, 101, True):
        with pytest.raises(RequestError):
            v41.check(ChatOptions(reasoning_effort=bad))
    with pytest.raises(RequestError) as err:
        v41.render([Turn("user", ("q",)), Turn("assistant", ("a",))], ChatOptions())
    assert err.value.param == "messages.1"


# ---- render then parse ------------------------------------------------------------------------------------------

REPLIES = [
    (Turn("assistant", ("Plain answer.",)), False),
    (Turn("assistant", ("It is 4.",), reasoning="2+2 is 4"), True),
    (Turn("assistant", ("",), reasoning="need data", tool_calls=(call("lookup", q="x"),)), True),
    (Turn("assistant", ("Let me look.",), tool_calls=(
        call("lookup", "a", query='{"a": 1} </tag> \n spaced', limit=2, flags=[1, True, None], nested={"k": "v"}),
        call("get_weather", "b", city="Zürich"))), False),
    (Turn("assistant", (), tool_calls=(call("lookup"),)), False),  # no arguments at all
]


def _merged(pieces):
    """Adjacent text pieces joined (a stream splits them anywhere)."""
    out = []
    for p in pieces:
        if out and type(p) is type(out[-1]) and isinstance(p, (Reasoning, Content)):
            out[-1] = type(p)(out[-1].text + p.text)
        else:
            out.append(p)
    return out


def _as_turn(pieces) -> Turn:
    text = "".join(p.text for p in pieces if isinstance(p, Content))
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning)) or None
    calls = tuple(p for p in pieces if isinstance(p, ToolCall))
    return Turn("assistant", (text,) if text else (), reasoning, calls)


@pytest.mark.parametrize("turn,thinking", REPLIES)
def test_render_then_parse_round_trip(v41, tok, turn, thinking):
    completion = v41.completion_text(turn, with_reasoning=thinking)
    ids = tok.encode(completion, add_special_tokens=False).ids
    assert tok.decode(ids) == completion  # what the engine detokenizes is what was rendered
    pieces = parse_completion(completion, thinking, {"lookup", "get_weather"})
    back = _as_turn(pieces)
    assert back.text == "\n\n".join(turn.parts) and back.reasoning == (turn.reasoning if thinking else None)
    assert [(c.name, c.argument_values()) for c in back.tool_calls] == \
        [(c.name, c.argument_values()) for c in turn.tool_calls]
    # The same turn inside a conversation with tools renders the same text, then EOS.
    convo = [Turn("user", ("q",)), turn, Turn("user", ("next",))]
    assert completion + EOS in v41.render(convo, ChatOptions(thinking=thinking, tools=(WEATHER, LOOKUP)))
    # Streamed at every chunk size (and one token at a time) the parse is the same.
    for size in (1, 2, 3, 5, 7, 11, 23, 1000):
        parser = CompletionParser(thinking, {"lookup", "get_weather"})
        streamed = []
        for i in range(0, len(completion), size):
            streamed += parser.feed(completion[i:i + size])
        streamed += parser.finish()
        assert _strip_ids(_merged(streamed)) == _strip_ids(_merged(pieces)), size
    parser, streamed = CompletionParser(thinking, {"lookup", "get_weather"}), []
    for token in ids:
        streamed += parser.feed(tok.decode([token]))
    assert _strip_ids(_merged(streamed + parser.finish())) == _strip_ids(_merged(pieces))


def _strip_ids(pieces):
    return [(p.name, p.arguments) if isinstance(p, ToolCall) else p for p in pieces]


def test_text_that_only_looks_like_a_marker_stays_text():
    text = "a </thin b <｜DSML｜ call c\n\n\nd"
    for thinking in (False, True):
        got = _merged(parse_completion(text if not thinking else "r</think>" + text, thinking, {"lookup"}))
        assert got[-1] == Content(text)
    # No tools: a calls block is text.
    block = f'\n\n<{D} calls>\n<{D} invoke name="lookup">\n</{D} invoke>\n</{D} calls>'
    assert parse_completion("x" + block, False) == [Content("x" + block)]


@pytest.mark.parametrize("bad", [
    f'<{D} invoke name="delete_all">\n</{D} invoke>',  # not a tool of the request
    f'<{D} invoke name="lookup">\n<{D} parameter name="n" string="false">not json</{D} parameter>\n</{D} invoke>',
    f'<{D} invoke name="lookup">\n<{D} parameter name="q" string="true">a</{D} parameter>\n'
    f'<{D} parameter name="q" string="true">b</{D} parameter>\n</{D} invoke>',  # a parameter twice
    f'<{D} invoke name="lookup">\nstray text\n</{D} invoke>',
    f'garbage <{D} invoke name="lookup">\n</{D} invoke>',
    f'<{D} invoke name="lookup">\n<{D} parameter name="q" string="true">cut off',  # the completion ended here
])
def test_malformed_blocks_come_back_as_text(bad, caplog):
    good = f'<{D} invoke name="lookup">\n<{D} parameter name="q" string="true">ok</{D} parameter>\n</{D} invoke>'
    tail = f"\n</{D} calls>" if "cut off" not in bad else ""
    completion = f"Answer.\n\n<{D} calls>\n{good}\n{bad}{tail}"
    with caplog.at_level(logging.WARNING, logger="openflash.chat"):
        pieces = _merged(parse_completion(completion, False, {"lookup"}))
    assert "malformed tool-call block" in caplog.text
    assert pieces[0] == Content("Answer.") and isinstance(pieces[1], ToolCall)  # the call before it stands
    assert pieces[2] == Content(f"\n{bad}{tail}")
    # Malformed as the first call: the whole block, blank line included, is text.
    alone = f"Answer.\n\n<{D} calls>\n{bad}{tail}"
    assert _merged(parse_completion(alone, False, {"lookup"})) == [Content(alone)]


def test_forcing_opens_the_block(v41):
    options = ChatOptions(tools=(WEATHER, LOOKUP), tool_choice="named", forced_tool="lookup")
    forcing = v41.forcing(options)
    assert forcing.after_token is None and forcing.text == f'\n\n<{D} calls>\n<{D} invoke name="lookup">\n'
    thinking = v41.forcing(ChatOptions(thinking=True, tools=(WEATHER,), tool_choice="required"))
    assert thinking.after_token == v41.think_end_id and thinking.text.endswith('invoke name="')
    assert v41.forcing(ChatOptions(tools=(WEATHER,))) is None
    assert v41.forcing(ChatOptions(tools=(WEATHER,), tool_choice="none")) is None


# ---- which template, and the simple one -------------------------------------------------------------------------


def test_template_choice():
    tiny = preset_tokenizer(load_config("tiny"))  # DeepSeek's cut to 1,024 ids: no V4.1 tokens
    assert chat_format(tiny, 0, 1).name == "simple"
    with pytest.raises(ConfigError, match="lacks the tokens"):
        chat_format(tiny, 0, 1, "deepseek-v4.1")
    with pytest.raises(ConfigError, match="chat template must be one of"):
        chat_format(tiny, 0, 1, "chatml")
    full = load_tokenizer("deepseek")
    assert chat_format(full, 0, 1, "simple").name == "simple"
    with pytest.raises(ConfigError, match="eos_token_id"):
        chat_format(full, 0, 5)


def test_simple_template_renders_tools_as_text():
    tiny = preset_tokenizer(load_config("tiny"))
    fmt = chat_format(tiny, 0, 1)
    turns = [Turn("system", ("S",)), Turn("user", ("q",)),
             Turn("assistant", ("a",), reasoning="dropped", tool_calls=(call("lookup", "c1", query="x"),)),
             Turn("tool", ("42",), tool_call_id="c1")]
    prompt = fmt.render(turns, ChatOptions(tools=(LOOKUP,)))
    assert prompt == (f"{BOS}S\n\n## Tools\n{json.dumps(LOOKUP.schema())}{USER}q{ASSIST}a\n[tool call c1] lookup "
                      f'{{"query": "x"}}{EOS}{USER}[tool result c1]\n42{ASSIST}')
    assert parse_completion("x</think>y", False) == [Content("x</think>y")]
    for options, param in ((ChatOptions(thinking=True), "chat_template_kwargs.thinking"),
                           (ChatOptions(reasoning_effort="high"), "reasoning_effort"),
                           (ChatOptions(tools=(LOOKUP,), tool_choice="required"), "tool_choice")):
        with pytest.raises(RequestError) as err:
            fmt.check(options)
        assert err.value.param == param
