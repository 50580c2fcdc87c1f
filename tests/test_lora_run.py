"""LoRA end to end (train --lora, files/peft.py, serving, lora merge): a tiny checkpoint in the official FP8/FP4
layout learns a reply format from chats with only its adapters training; the adapter round-trips through the PEFT
layout, is served beside another in one batch (each row its own adapter) and answers in the taught format where the
base does not; merged into the base it computes what base + adapter computes, up to the added rounding."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from starlette.testclient import TestClient
from chat_data import chats, write_jsonl

from openflash.chat import chat_format
from openflash.chat.conversation import ChatOptions
from openflash.chat.messages import ChatMessage, conversation
from openflash.checkpoint import build_model, save_checkpoint
from openflash.cli import main as cli_main
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.generate import generate
from openflash.engine.sampling import SamplingParams
from openflash.errors import OpenflashError, RequestError
from openflash.files.peft import read_adapter, write_adapter
from openflash.model.layers import Linear
from openflash.model.lora import adapter_weights
from openflash.runtime.open import open_model
from openflash.serve.app import ServerConfig, build_app
from openflash.train.tokenizer import train_bpe_tokenizer
from openflash.train.trainer import TrainConfig, Trainer, training_model_config

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTION = [{"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "What is 1234 plus 1234?"}]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """(folder, trainer): a tiny FP8/FP4 checkpoint and a 30-step rank-8 LoRA run on 200 chats."""
    tmp = tmp_path_factory.mktemp("lora")
    src = write_jsonl(tmp / "chats.jsonl", chats(200))
    tok = tmp / "tok.json"
    train_bpe_tokenizer([src], 400, tok)
    torch.manual_seed(0)
    save_checkpoint(build_model(training_model_config("tiny", tok)), tmp / "base", tokenizer_json=tok, dtype="fp8")
    assert cli_main(["data", "prepare", str(src), "--chats", "--tokenizer", str(tok), "--out", str(tmp / "data"),
                     "--val-fraction", "0.1"]) == 0
    cfg = TrainConfig(data=str(tmp / "data"), out=str(tmp / "run"), init=str(tmp / "base"), steps=30, batch_size=8,
                      seq_len=64, lr=1e-2, warmup=2, eval_every=0, eval_batches=4, progress=False, lora=8)
    trainer = Trainer(cfg)
    trainer.fit()
    return tmp, trainer


def _prompt(rt, question: list[dict]) -> str:
    fmt = chat_format(rt.tokenizer, rt.cfg.bos_token_id, rt.cfg.eos_token_id, "auto")
    return fmt.render(conversation([ChatMessage(**m) for m in question]), ChatOptions(False))


def test_only_the_adapters_train_on_the_stored_base_and_the_reply_loss_falls(tuned, tmp_path):
    tmp, trainer = tuned
    evals = [r["val_loss"] for r in map(json.loads, (tmp / "run" / "metrics.jsonl").read_text().splitlines())
             if "val_loss" in r]
    assert len(evals) == 2 and evals[1] < 0.5 * evals[0]
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".adapter.lora_" in n for n in trained)
    linears = [m for m in trainer.model.modules() if isinstance(m, Linear)]
    assert any(m.storage == "fp4" for m in linears) and any(m.storage == "fp8" for m in linears)
    assert all(m.dequantized_bytes == 0 and m.weight.dtype != torch.float32 for m in linears if m.quantized)
    checkpoint = tmp / "run" / "checkpoints" / "step_00000030"
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= {p.name for p in checkpoint.iterdir()}
    # resume continues the run (a copy: the others use step 30); another rank is refused with the argument named
    shutil.copytree(tmp / "run", tmp_path / "run")
    resumed = Trainer(TrainConfig(**{**trainer.cfg.__dict__, "steps": 32, "resume": True, "out": str(tmp_path / "run")}))
    assert resumed.step == 30 and resumed.fit().step == 32
    with pytest.raises(OpenflashError, match=r"lora \(run: 8, now: 4\)"):
        Trainer(TrainConfig(**{**trainer.cfg.__dict__, "lora": 4, "resume": True, "out": str(tmp_path / "run")}))


def test_the_adapter_round_trips_through_the_peft_layout(tuned, tmp_path, capsys):
    tmp, trainer = tuned
    saved = read_adapter(tmp / "run" / "checkpoints" / "step_00000030")
    config = json.loads((tmp / "run" / "checkpoints" / "step_00000030" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    assert "layers.0.attn.wq_a" in config["target_modules"] and saved.scaling == 2.0
    weights = {n: (a.clone(), b.clone()) for n, (a, b) in adapter_weights(trainer.model).items()}
    again = read_adapter(write_adapter(tmp_path / "copy", weights, 8, 16.0, "base"))
    for name, (a, b) in weights.items():
        assert torch.equal(again.weights[name][0], a) and torch.equal(again.weights[name][1], b)
    from safetensors.torch import load_file
    keys = load_file(str(tmp_path / "copy" / "adapter_model.safetensors"))
    assert "base_model.model.layers.0.attn.wq_a.lora_A.weight" in keys
    config["use_dora"] = True
    (tmp_path / "copy" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(OpenflashError, match="use_dora"):
        read_adapter(tmp_path / "copy")
    assert cli_main(["generate", "--model", str(tmp / "base"), "--lora", str(tmp_path), "--prompt", "x"]) != 0
    assert "neither a LoRA adapter folder" in capsys.readouterr().err


def test_served_adapters_share_a_batch_and_answer_in_the_taught_format(tuned, tmp_path):
    tmp, trainer = tuned
    rt = open_model(str(tmp / "base"))
    weights = adapter_weights(trainer.model)
    torch.manual_seed(1)
    noise = {n: (torch.randn_like(a), torch.randn_like(b) * 0.05) for n, (a, b) in weights.items() if ".attn." in n}
    rt.load_adapters({"fmt": tmp / "run", "noise": write_adapter(tmp_path / "noise", noise, 8, 16.0, None)})
    short = _prompt(rt, QUESTION)
    longer = _prompt(rt, [QUESTION[0], {"role": "user", "content": "What is 7 plus 7? Say it the usual way."}])
    prompts = [short, short, longer, short, longer]
    named = [None, "fmt", "fmt", "noise", None]
    params = SamplingParams(max_tokens=10)
    alone = [generate(rt, p, params, adapter=a).text for p, a in zip(prompts, named)]
    engine = LLMEngine(rt, EngineConfig(max_batch=8, max_context=256))
    together = [s.text for s in engine.generate(prompts, params, adapters=named)]
    assert together == alone  # one batch, each row with its own adapter
    assert alone[1].startswith("ANSWER:") and alone[2].startswith("ANSWER:")
    assert not alone[0].startswith("ANSWER") and not alone[4].startswith("ANSWER")
    assert alone[3] != alone[0]  # the second adapter changes its rows
    with pytest.raises(RequestError, match=r"no LoRA adapter 'nope' is loaded \(adapters: \['fmt', 'noise'\]\)"):
        engine.add_request(short, params, adapter="nope")
    # a prefix cached for one adapter is never restored for another
    assert engine.generate([short], params, adapters=["noise"])[0].num_cached == 0

    fmt = chat_format(rt.tokenizer, rt.cfg.bos_token_id, rt.cfg.eos_token_id, "auto")
    app = build_app(LLMEngine(rt, EngineConfig(max_batch=4, max_context=256)), rt.tokenizer,
                    ServerConfig("tiny-base", fmt, drain_timeout=2.0))
    with TestClient(app) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("tiny-base", None), ("fmt", "tiny-base"),
                                                           ("noise", "tiny-base")]
        body = {"model": "fmt", "messages": QUESTION, "max_tokens": 10, "temperature": 0}
        reply = client.post("/v1/chat/completions", json=body).json()
        assert reply["model"] == "fmt" and reply["choices"][0]["message"]["content"].startswith("ANSWER:")
        missing = client.post("/v1/chat/completions", json={**body, "model": "nope"})
        assert missing.status_code == 404 and "'nope' does not exist" in missing.json()["error"]["message"]


def test_a_merged_checkpoint_computes_base_plus_adapter(tuned, tmp_path, capsys):
    tmp, _ = tuned
    assert cli_main(["lora", "merge", str(tmp / "base"), str(tmp / "run"), str(tmp_path / "merged")]) == 0
    assert "quantizing back to the stored formats adds at most" in capsys.readouterr().out
    adapted = open_model(str(tmp / "base"))
    adapted.load_adapters({"fmt": tmp / "run"})
    merged = open_model(str(tmp_path / "merged"))
    ids = torch.tensor([adapted.tokenizer.encode(_prompt(adapted, QUESTION)).ids])
    with_adapter = adapted.step(ids, adapted.new_cache(), adapters=[0])
    base = adapted.step(ids, adapted.new_cache())
    folded = merged.step(ids, merged.new_cache())
    assert float((folded - with_adapter).norm()) < 0.1 * float((base - with_adapter).norm())
    assert generate(merged, _prompt(merged, QUESTION), SamplingParams(max_tokens=4)).text.startswith("ANSWER")
    assert cli_main(["lora", "merge", str(tmp / "base"), str(tmp / "run"), str(tmp_path / "merged")]) != 0
    assert "merged already exists and is not empty" in capsys.readouterr().err


def test_train_engram_updates_only_the_rows_batches_touch(tuned, tmp_path, capsys):
    """`--train-engram`: fp32 values and Adam state for the touched rows only, the stored table untouched; saved
    beside the adapter and resumed; refused per request by the server (merge first); merged as FP8 rows."""
    from safetensors.torch import load_file

    from openflash import formats
    from openflash.model.engram_table import DeviceTable, decode_rows

    tmp, trainer = tuned
    cfg = {**trainer.cfg.__dict__, "out": str(tmp_path / "run"), "steps": 3, "batch_size": 1, "seq_len": 16,
           "train_engram": True}  # few lookups: the tiny model's tables have 304 rows
    rows_run = Trainer(TrainConfig(**cfg))
    stored = {n: m.weight.clone() for n, m in rows_run.model.named_modules() if isinstance(m, DeviceTable)}
    rows_run.fit()
    assert rows_run.trained_rows and stored
    for name, rows in rows_run.trained_rows.items():
        table = rows_run.model.get_submodule(name)
        assert 0 < len(rows) < table.num_rows  # touched rows only
        assert rows.exp_avg.shape == rows.values.shape == (len(rows), table.dim)
        assert torch.equal(table.weight, stored[name])  # the stored table itself never changes
        start = decode_rows(formats.as_uint8(table.weight)[rows.rows], formats.as_uint8(table.scale)[rows.rows])
        assert float((rows.values.detach() - start).abs().max()) > 0  # the rows moved
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000003"
    saved = load_file(str(checkpoint / "engram_rows.safetensors"))
    name = next(iter(rows_run.trained_rows))
    assert torch.equal(saved[f"{name}.rows"], rows_run.trained_rows[name].rows)
    resumed = Trainer(TrainConfig(**{**cfg, "steps": 4, "resume": True}))
    assert torch.equal(resumed.trained_rows[name].values.detach(), rows_run.trained_rows[name].values.detach())
    with pytest.raises(OpenflashError, match="also trained Engram rows"):
        open_model(str(tmp / "base")).load_adapters({"rows": checkpoint})
    with pytest.raises(OpenflashError, match="--train-engram need --lora RANK"):
        TrainConfig(data="d", out="o", train_engram=True)

    assert cli_main(["lora", "merge", str(tmp / "base"), str(checkpoint), str(tmp_path / "merged")]) == 0
    assert "trained Engram rows written into the tables" in capsys.readouterr().out
    merged = open_model(str(tmp_path / "merged")).model.get_submodule(name)
    rows = rows_run.trained_rows[name]
    q, scale = formats.encode_window_fp8(rows.values.detach())
    assert torch.equal(formats.as_uint8(merged.weight)[rows.rows], formats.as_uint8(q))
    untouched = torch.ones(merged.num_rows, dtype=torch.bool)
    untouched[rows.rows] = False
    assert torch.equal(formats.as_uint8(merged.weight)[untouched], formats.as_uint8(stored[name])[untouched])


def test_bad_lora_arguments_are_named():
    from openflash.commands.run import lora_modules

    assert lora_modules(["a=x", "b=y"], "base") == {"a": "x", "b": "y"}
    with pytest.raises(OpenflashError, match=r"--lora 'bad': expected NAME=PATH"):
        lora_modules(["bad"], "base")
    with pytest.raises(OpenflashError, match=r"--lora 'base=x': the name 'base' is taken"):
        lora_modules(["base=x"], "base")
    with pytest.raises(OpenflashError, match=r"--lora \(the adapter rank\) must be >= 1, got 0"):
        TrainConfig(data="d", out="o", init="i", lora=0)
    with pytest.raises(OpenflashError, match="--lora trains adapters on a model: give it with --init MODEL"):
        TrainConfig(data="d", out="o", lora=4)
    with pytest.raises(OpenflashError, match="--checkpoint-activations reruns the eager blocks"):
        TrainConfig(data="d", out="o", compile=True, checkpoint_activations=True)
