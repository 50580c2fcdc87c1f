"""Chat data for supervised fine-tuning: OpenAI-style conversations to token shards with a loss mask.

    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "...", "reasoning_content": "...",
                   "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{...}"}}],
                   "tool_call_id": "c1"}, ...],
     "tools": [{"type": "function", "function": {...}}]}          one conversation per line (tools optional)

Each assistant turn becomes one example: the prompt the server would send for the turns before it (the model's own
chat template, chat/: V4.1 for the released vocabulary, simple otherwise; thinking on when the turn has
`reasoning_content`), tokenized on its own as the server does, then what the model writes for the turn
(`reply_text`: reasoning, answer, tool calls, EOS). Only the reply's tokens are trained on: the loss mask, one byte
per token beside the token shards (`{split}_mask_NNNNN.bin`), is 1 there and 0 on the prompt. The folder is the
layout of train/dataset.py with `loss_mask` set in its manifest. Bad lines (not JSON, too long, nested too deep, lone
surrogates, a bad field) are all named with file, line and field, and then nothing is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from pydantic import ValidationError
from tokenizers import Tokenizer

from openflash.chat import chat_format
from openflash.chat.conversation import ChatOptions, ImagePart, Turn, check_tool
from openflash.chat.messages import ChatMessage, conversation, json_problem
from openflash.errors import OpenflashError, RequestError
from openflash.files.atomic import write_json_atomic
from openflash.files.jsonl import BadLine, jsonl_lines
from openflash.tokenizer import tokenizer_sha256
from openflash.train.dataset import FORMAT_VERSION, MANIFEST_FILE, SPLITS, TOKENIZER_FILE, Manifest, SplitInfo
from openflash.train.fresh_folder import FreshFolder, refuse_bad
from openflash.train.prepare import SplitWriter, is_validation
from openflash.train.tokenizer import EOS_ID

# One conversation: 4 MiB of text is about a million tokens, the released context; each assistant turn renders and
# tokenizes the turns before it, so a longer line would cost memory and time far past what it could train.
MAX_CHAT_LINE_BYTES = 4 << 20


def parse_conversation(raw: Any, where: str) -> tuple[list[Turn], ChatOptions]:
    """A JSONL record as turns and options (tools), read as the server reads a request's messages
    (serve/protocol.py ChatMessage, serve/chat.py conversation); OpenflashError naming `where` and the field."""
    problem = json_problem(raw)  # nesting that recursion cannot walk, lone surrogates no tokenizer can encode
    if problem is not None:
        _, template, context = problem
        raise OpenflashError(f"{where}: {template.format(**context)}")
    try:
        if not isinstance(raw, dict) or not isinstance(raw.get("messages"), list) or not raw["messages"]:
            raise RequestError("expected an object with a non-empty 'messages' list", param="messages")
        tools = tuple(check_tool(t, f"tools.{i}") for i, t in enumerate(raw.get("tools") or ()))
        messages = []
        for i, m in enumerate(raw["messages"]):
            try:
                messages.append(ChatMessage.model_validate(m))
            except ValidationError as exc:
                first = exc.errors()[0]
                field = ".".join(str(k) for k in (f"messages.{i}", *first["loc"]))
                raise RequestError(f"{field}: {first['msg']}", param=field) from None
        turns = conversation(messages)
    except RequestError as exc:
        raise OpenflashError(f"{where}: {exc}") from None
    if any(isinstance(p, ImagePart) for t in turns for p in t.parts):
        raise OpenflashError(f"{where}: chat data takes text only (an image part was given)")
    if not any(t.role == "assistant" for t in turns):
        raise OpenflashError(f"{where}: messages: no assistant turn to train on")
    return turns, ChatOptions(tools=tools)


def chat_examples(turns: list[Turn], options: ChatOptions, fmt: Any, tokenizer: Tokenizer,
                  where: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids) of each assistant turn: the prompt rendered from the turns before it."""
    out = []
    for i, turn in enumerate(turns):
        if turn.role != "assistant":
            continue
        turn_options = ChatOptions(thinking=turn.reasoning is not None and fmt.name != "simple", tools=options.tools)
        try:
            prompt = fmt.render(turns[:i], turn_options)
        except RequestError as exc:
            raise OpenflashError(f"{where}: messages.{i}: {exc}") from None
        reply = fmt.reply_text(turn, turn_options)
        out.append((tokenizer.encode(prompt, add_special_tokens=False).ids,
                    tokenizer.encode(reply, add_special_tokens=False).ids))
    return out


def dataset_chats(source: str, split: str, messages_field: str) -> Iterator[tuple[str, Any]]:
    """(where, conversation) of a Hugging Face dataset's rows (train/hf_datasets.py): its `messages_field`, and its
    "tools" where the row has them; a row without the field as a BadLine naming it."""
    from openflash.train.hf_datasets import dataset_rows

    for where, row in dataset_rows(source, split):
        if messages_field not in row:
            yield where, BadLine(where, f"no field {messages_field!r} (fields: {sorted(row)[:20]})")
            continue
        record = {"messages": row[messages_field]}
        if row.get("tools") is not None:
            record["tools"] = row["tools"]
        yield where, record


def prepare_chats(sources: Sequence[str | Path], tokenizer_spec: str | Path, out_dir: str | Path,
                  val_fraction: float = 0.01, seed: int = 0, template: str = "auto",
                  shard_tokens: int = 1 << 24, dataset_split: str | None = None,
                  messages_field: str = "messages") -> Manifest:
    """Render and tokenize the conversations of `sources` into `out_dir` (written aside, then renamed: an
    interrupted run leaves nothing): JSONL files, or with `dataset_split` the rows of Hugging Face datasets (their
    `messages_field`)."""
    folder = FreshFolder.start(out_dir, tokenizer_spec, val_fraction, "chat data")
    out_dir, tok_path, tokenizer, work = folder.out_dir, folder.tokenizer_path, folder.tokenizer, folder.work
    fmt = chat_format(tokenizer, EOS_ID - 1, EOS_ID, template)  # the DeepSeek convention: bos 0, eos 1
    vocab, dtype = folder.vocab_size, folder.dtype
    try:
        fresh = {"shard_index": 0, "shard_fill": 0, "num_docs": 0}
        tokens = {s: SplitWriter(work, s, dtype, shard_tokens, dict(fresh)) for s in SPLITS}
        masks = {s: SplitWriter(work, f"{s}_mask", np.dtype("u1"), shard_tokens, dict(fresh)) for s in SPLITS}
        conversations, bad = 0, []
        for source in sources:
            records = jsonl_lines(source, MAX_CHAT_LINE_BYTES) if dataset_split is None else \
                dataset_chats(str(source), dataset_split, messages_field)
            for where, raw in records:
                try:
                    if isinstance(raw, BadLine):
                        raise OpenflashError(str(raw))
                    turns, options = parse_conversation(raw, where)
                    examples = chat_examples(turns, options, fmt, tokenizer, where)
                except OpenflashError as exc:  # every bad line is named, then nothing is written
                    bad.append(str(exc))
                    continue
                if bad:
                    continue
                split = "val" if is_validation(f"{Path(where).name}", seed, val_fraction) else "train"
                for prompt, reply in examples:
                    tokens[split].add(np.array(prompt + reply, dtype=dtype))
                    masks[split].add(np.array([0] * len(prompt) + [1] * len(reply), dtype="u1"))
                conversations += 1
        refuse_bad(bad, "line")
        infos: dict[str, SplitInfo] = {}
        for split in SPLITS:
            infos[split] = tokens[split].finish()
            masks[split].finish()
            (work / f"{split}_mask_docs.bin").unlink()  # the token shards' offsets are the ones kept
        if infos["train"].num_tokens == 0:
            raise OpenflashError(f"no training example in {', '.join(map(str, sources))} (all held out, or empty)")
        shutil.copy(tok_path, work / TOKENIZER_FILE)
        manifest = Manifest(FORMAT_VERSION, tokenizer_sha256(tokenizer), TOKENIZER_FILE, vocab, EOS_ID, dtype.name,
                            shard_tokens,
                            [str(Path(s).resolve()) for s in sources], ["chat jsonl"], float(val_fraction), int(seed),
                            "", conversations, {"utf-8": conversations}, {"count": 0, "by_reason": {}, "files": []},
                            infos, loss_mask=True, chat_template=fmt.name)
        write_json_atomic(work / MANIFEST_FILE, manifest.to_dict())
        work.rename(out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # gone already once renamed
    print(f"{out_dir}: {conversations} conversations, {infos['train'].num_docs} training examples "
          f"({infos['train'].num_tokens:,} tokens), {infos['val'].num_docs} held out; chat template {fmt.name}; "
          f"loss on the replies only")
    return Manifest.load(out_dir)


__all__ = ["parse_conversation", "chat_examples", "prepare_chats"]
