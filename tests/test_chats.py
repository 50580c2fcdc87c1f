"""Chat data for fine-tuning (train/chats.py): conversations rendered with the model's chat template, the loss mask
on the replies only, checked token by token; bad lines named; a fine-tuning run on it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from chat_data import chats, write_jsonl

from openflash.chat import chat_format
from openflash.chat.conversation import ChatOptions
from openflash.errors import OpenflashError
from openflash.tokenizer import load_tokenizer
from openflash.train.chats import parse_conversation, prepare_chats
from openflash.train.dataset import BatchLoader, TokenDataset, eval_batches

@pytest.mark.parametrize("tokenizer", ["deepseek", "trained"])
def test_the_mask_covers_exactly_each_reply_after_the_prompt_the_server_sends(tmp_path, tokenizer):
    """Every example is the template's prompt for the turns before an assistant turn, then that turn as the model
    writes it (reasoning, calls, EOS); the mask is 0 on the first and 1 on the second, token by token."""
    if tokenizer == "trained":
        from openflash.train.tokenizer import train_bpe_tokenizer
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("\n".join(json.dumps(r) for r in chats(40)) * 3)
        train_bpe_tokenizer([corpus], 400, tmp_path / "tok.json")
        tokenizer = str(tmp_path / "tok.json")
    records = chats(6)
    data = tmp_path / "data"
    manifest = prepare_chats([write_jsonl(tmp_path / "chats.jsonl", records)], tokenizer, data, val_fraction=0.0)
    tok = load_tokenizer(data / "tokenizer.json")
    fmt = chat_format(tok, 0, 1, "auto")
    assert manifest.loss_mask and manifest.chat_template == fmt.name == ("simple" if "tok.json" in tokenizer
                                                                        else "deepseek-v4.1")
    ds = TokenDataset(data, "train")
    offsets = ds.doc_offsets
    examples = []
    for n, raw in enumerate(records):
        turns, options = parse_conversation(raw, f"chats.jsonl:{n + 1}")
        for i, turn in enumerate(turns):
            if turn.role == "assistant":
                turn_options = ChatOptions(thinking=turn.reasoning is not None and fmt.name != "simple",
                                           tools=options.tools)
                examples.append((fmt.render(turns[:i], turn_options), fmt.reply_text(turn, turn_options)))
    assert len(examples) == ds.num_docs == 14
    for d, (prompt, reply) in enumerate(examples):
        start, stop = int(offsets[d]), int(offsets[d + 1])
        ids, mask = ds.read(start, stop - start), ds.read(start, stop - start, masks=True)
        cut = int(np.argmax(mask))
        assert mask[:cut].sum() == 0 and mask[cut:].all()
        assert ids[:cut].tolist() == tok.encode(prompt, add_special_tokens=False).ids
        assert ids[cut:].tolist() == tok.encode(reply, add_special_tokens=False).ids
    if fmt.name == "deepseek-v4.1":  # the reasoning and the calls block are part of what is trained on
        prompt, reply = examples[-2]
        assert reply.startswith("I should call the tool.</think>") and "lookup" in reply
    y = torch.cat([t for _, t in eval_batches(ds, 4, 32, 100)])  # every window of the stream
    stream = torch.from_numpy(ds.read(1, y.numel()))
    kept = torch.from_numpy(ds.read(1, y.numel(), masks=True)) == 1
    assert torch.equal(y.flatten()[kept], stream[kept]) and (y.flatten()[~kept] == -100).all() and kept.any()
    assert BatchLoader(ds, 2, 32, seed=0).batch_at(0)[1].shape == (2, 32)


def test_bad_lines_are_refused_naming_file_line_and_field(tmp_path):
    good = chats(1)[0]
    cases = [("{not json", "chats.jsonl:2: not JSON"),
             (json.dumps({"messages": []}), "chats.jsonl:2: .*messages"),
             (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}), "chats.jsonl:2: messages.0.role"),
             (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no assistant turn"),
             (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y",
                                                                        "tool_calls": [{"function": {}}]}]}),
              "messages.1.tool_calls.0"),
             (json.dumps({"tools": [{"type": "function"}], "messages": good["messages"]}), "tools.0")]
    for k, (line, match) in enumerate(cases):
        path = tmp_path / "chats.jsonl"
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(OpenflashError, match=match):
            prepare_chats([path], "deepseek", tmp_path / f"out{k}")
        assert not (tmp_path / f"out{k}").exists()  # nothing half-written
    (tmp_path / "taken").mkdir()
    with pytest.raises(OpenflashError, match="taken already exists; chat data is written to a new folder"):
        prepare_chats([write_jsonl(tmp_path / "ok.jsonl", [good])], "deepseek", tmp_path / "taken")


def test_fine_tuning_on_chats_lowers_the_reply_loss(tmp_path):
    """`data prepare --chats`, then `train --init`: a tiny model learns the replies' format; the loss counts reply
    tokens only."""
    from openflash.checkpoint import build_model, save_checkpoint
    from openflash.cli import main as cli_main
    from openflash.train.tokenizer import train_bpe_tokenizer
    from openflash.train.trainer import TrainConfig, Trainer, training_model_config

    src = write_jsonl(tmp_path / "chats.jsonl", chats(60))
    tok_path = train_bpe_tokenizer([src], 400, tmp_path / "tok.json") and tmp_path / "tok.json"
    torch.manual_seed(0)  # a checkpoint of the tiny architecture on this tokenizer, to fine-tune
    save_checkpoint(build_model(training_model_config("tiny", tok_path)), tmp_path / "base", tokenizer_json=tok_path)
    assert cli_main(["data", "prepare", str(src), "--chats", "--tokenizer", str(tok_path), "--out",
                     str(tmp_path / "data"), "--val-fraction", "0.1"]) == 0
    with pytest.raises(OpenflashError, match="prepared with another tokenizer"):
        Trainer(TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "no"), init="tiny", progress=False))
    cfg = TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "run"), init=str(tmp_path / "base"), steps=12,
                      batch_size=4,
                      seq_len=64, lr=3e-3, warmup=2, eval_every=0, eval_batches=2, progress=False)
    trainer = Trainer(cfg)
    trainer.fit()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_loss"] for r in lines if "val_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] and all(np.isfinite(evals))
    assert torch.isfinite(torch.tensor([r["loss"] for r in lines if "loss" in r])).all()
