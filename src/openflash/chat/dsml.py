"""DSML, the tool-call markup of DeepSeek-V4.1: writing calls into prompts, reading them out of completions.

    \\n\\n<｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

`｜DSML｜` is one token of the released tokenizer; V4.1's tag names carry a leading space (" calls", " invoke",
" parameter"; V4 wrote "tool_calls", "invoke", "parameter"). A parameter with string="true" holds raw text; with
string="false" its value is JSON (numbers, booleans, null, arrays, objects). The block follows the answer text
after a blank line and ends the turn.

Sources: the V4.1 encoder as SGLang ships it (python/sglang/srt/entrypoints/openai/encoding_dsv41.py, "adapted from
the DeepSeek-V4.1 release reference implementation") and vLLM's deepseek_v41 parser (whose markers agree). The
reference parser asserts the exact layout; this one reads the same layout but allows any whitespace between tags,
as vLLM's does, and checks every string="false" value is JSON (the reference pastes it into the arguments as is).
"""

from __future__ import annotations

import json
import re
from typing import Any

from openflash.chat.conversation import ToolCall, ToolSpec

DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML} calls>"
CALLS_CLOSE = f"</{DSML} calls>"
INVOKE_OPEN = f"<{DSML} invoke"
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAM_CLOSE = f"</{DSML} parameter>"
BLOCK_SEPARATOR = "\n\n"  # between the answer text and the calls block

_INVOKE_HEAD = re.compile(rf'<{DSML} invoke name="([^"\n]*)">')
_PARAM_HEAD = re.compile(rf'<{DSML} parameter name="([^"\n]*)" string="(true|false)">')


class DsmlError(ValueError):
    """A calls block that does not follow the syntax (the server returns such a completion as text)."""


def render_invoke(call: ToolCall) -> str:
    params = []
    for key, value in call.argument_values().items():
        is_text = isinstance(value, str)
        text = value if is_text else json.dumps(value, ensure_ascii=False)
        params.append(f'<{DSML} parameter name="{key}" string="{"true" if is_text else "false"}">{text}{PARAM_CLOSE}')
    return f'{INVOKE_OPEN} name="{call.name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}"


def render_calls(calls: tuple[ToolCall, ...]) -> str:
    """The block an assistant turn with tool calls ends with (separator included)."""
    return BLOCK_SEPARATOR + CALLS_OPEN + "\n" + "\n".join(render_invoke(c) for c in calls) + "\n" + CALLS_CLOSE


def forced_opener(tool: str | None) -> str:
    """Completion text that commits the model to a call: of any tool (tool_choice "required") or of `tool`."""
    head = BLOCK_SEPARATOR + CALLS_OPEN + "\n" + INVOKE_OPEN + ' name="'
    return head if tool is None else head + f'{tool}">\n'


def call_grammar(tools: tuple[ToolSpec, ...], forced_tool: str | None, dsml_token: int) -> str:
    """The grammar (llguidance's Lark syntax) of what follows `forced_opener(forced_tool)`: the rest of that call,
    its arguments following the tool's parameters schema, then any further calls and the block's end.

    Each declared parameter in its declared order, the required ones always; a "string" one as raw text
    (string="true", without "<": the text ends at the closing tag; its enum or length bounds kept), any other as
    JSON that follows its schema (string="false"). `｜DSML｜` is matched as its own token (`dsml_token`), never
    spelled out in pieces."""
    d = f"<[{dsml_token}]>"

    def lit(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)

    def close(tag: str) -> str:
        return f'"</" {d} {lit(" " + tag + ">")}'

    first = f"first_{_rule(forced_tool)}" if forced_tool else "any_first"
    rules = [f'start: {first} ("\\n" any_call)* "\\n" {close("calls")}', "TEXT: /[^<]*/"]
    for tool in tools:
        name = _rule(tool.name)
        props = tool.parameters.get("properties") or {}
        required = set(tool.parameters.get("required") or ())
        params = []
        for i, (key, schema) in enumerate(props.items()):
            schema = schema if isinstance(schema, dict) else {}
            text = schema.get("type") == "string"
            head = lit(f' parameter name="{key}" string="{"true" if text else "false"}">')
            value = f"%json {json.dumps(schema)}"
            if text:
                value = _text_value(schema)
            rules.append(f'{name}_p{i}: "<" {d} {head} {value} {close("parameter")} "\\n"')
            params.append(f"{name}_p{i}" + ("" if key in required else "?"))
        rules.append(f"{name}_rest: " + " ".join([*params, close("invoke")]))
        rules.append(f"first_{name}: {name}_rest")
        rules.append(f"tail_{name}: {lit(tool.name + chr(34) + '>' + chr(10))} {name}_rest")
        rules.append(f"call_{name}: \"<\" {d} {lit(' invoke name=' + chr(34))} tail_{name}")
    rules.append("any_first: " + " | ".join(f"tail_{_rule(t.name)}" for t in tools))
    rules.append("any_call: " + " | ".join(f"call_{_rule(t.name)}" for t in tools))
    return "\n".join(rules) + "\n"


def _text_value(schema: dict[str, Any]) -> str:
    """A string parameter's raw text: one of its enum, or text without "<" within its length bounds."""
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) and "<" not in v for v in schema["enum"]):
        return "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"]) + ")"
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        return f"/[^<]{{{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}}}/"
    return "TEXT"


def _rule(name: str) -> str:
    """A grammar rule name for a tool's (any text: hex keeps it a valid, unique identifier)."""
    return "t" + name.encode("utf-8").hex()


def parse_invoke(text: str, tools: set[str], call_id: str) -> ToolCall:
    """One complete `<｜DSML｜ invoke ...>...</｜DSML｜ invoke>` as a ToolCall; DsmlError if it is malformed or
    names a function the request did not define."""
    head = _INVOKE_HEAD.match(text)
    if head is None or not text.endswith(INVOKE_CLOSE):
        raise DsmlError(f"not an invoke tag: {text[:80]!r}")
    name = head.group(1)
    if name not in tools:
        raise DsmlError(f"call of {name!r}, which is not among the request's tools")
    body, args = text[head.end():len(text) - len(INVOKE_CLOSE)], {}
    pos = 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos == len(body):
            break
        param = _PARAM_HEAD.match(body, pos)
        if param is None:
            raise DsmlError(f"{name}: expected a parameter tag at {body[pos:pos + 60]!r}")
        end = body.find(PARAM_CLOSE, param.end())
        if end < 0:
            raise DsmlError(f"{name}: parameter {param.group(1)!r} is not closed")
        key, raw = param.group(1), body[param.end():end]
        if key in args:
            raise DsmlError(f"{name}: parameter {key!r} given twice")
        args[key] = raw if param.group(2) == "true" else _json_value(name, key, raw)
        pos = end + len(PARAM_CLOSE)
    return ToolCall(call_id, name, json.dumps(args, ensure_ascii=False))


def _json_value(tool: str, key: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise DsmlError(f"{tool}: parameter {key!r} has string=\"false\" but is not JSON: {raw[:60]!r}") from None
