"""Adapters and fine-tuning under hostile input: a poisoned adapter fails only its own requests (and is refused at
start where its files show it), the prefix cache keys everything that changes an adapter's product, adapters are
tied to the base they were trained on, and bad adapter files, chat lines and merge targets are refused by name
without losing anything."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from starlette.testclient import TestClient
from chat_data import chats, write_jsonl

from openflash.chat import chat_format
from openflash.checkpoint import build_model, save_checkpoint
from openflash.cli import main as cli_main
from openflash.config import load_config
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.generate import generate
from openflash.engine.sampling import SamplingParams
from openflash.errors import OpenflashError
from openflash.files.jsonl import jsonl_records
from openflash.files.peft import BASE_FILE, read_adapter, write_adapter
from openflash.runtime.open import open_model
from openflash.serve.app import ServerConfig, build_app
from openflash.tokenizer import preset_tokenizer
from openflash.train.prepare import encode_texts, text_pieces
from openflash.train.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

MODULE = "layers.0.attn.wq_a"
PROMPT = "def fib(n):\n    return"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny FP8 checkpoint with its preset's tokenizer, and a few adapters beside it."""
    tmp = tmp_path_factory.mktemp("hostile")
    cfg = load_config("tiny")
    preset_tokenizer(cfg).save(str(tmp / "tok.json"))
    torch.manual_seed(0)
    save_checkpoint(build_model(cfg), tmp / "base", tokenizer_json=tmp / "tok.json", dtype="fp8")
    return tmp


def _adapter(folder: Path, alpha: float = 8.0, scale: float = 0.3, seed: int = 1, a_value: float | None = None,
             b_value: float | None = None, base: dict | None = None) -> Path:
    torch.manual_seed(seed)
    a, b = torch.randn(4, 128) * scale, torch.randn(64, 4) * scale
    if a_value is not None:
        a, b = torch.full_like(a, a_value), torch.full_like(b, b_value)
    return write_adapter(folder, {MODULE: (a, b)}, 4, alpha, None, base)


def test_a_poisoned_adapter_fails_its_own_requests_and_no_one_elses(base):
    """An adapter whose update overflows (finite weights, so it passes the load checks) makes NaN logits: each of
    its requests fails on its own, the others in the same batch finish with the tokens they get alone."""
    rt = open_model(str(base / "base"))
    rt.load_adapters({"good": _adapter(base / "good"), "poison": _adapter(base / "poison", 4.0, a_value=1e18,
                                                                          b_value=1e19)})
    greedy, sampled = SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=0.8, seed=3)
    named = [None, "good", "poison", None, "poison", "good"]
    params = [greedy, sampled, sampled, sampled, greedy, greedy]
    alone = [generate(rt, PROMPT, p, adapter=a).text if a != "poison" else None for p, a in zip(params, named)]
    engine = LLMEngine(rt, EngineConfig(max_batch=8, max_context=128))
    together = engine.generate([PROMPT] * len(named), params, adapters=named)
    for seq, want, adapter in zip(together, alone, named):
        if adapter == "poison":
            assert seq.finish_reason == "error" and "NaN or inf" in seq.error
        else:
            assert seq.finish_reason != "error" and seq.text == want
    with pytest.raises(OpenflashError, match="NaN or inf"):
        generate(rt, PROMPT, sampled, adapter="poison")

    fmt = chat_format(rt.tokenizer, rt.cfg.bos_token_id, rt.cfg.eos_token_id, "auto")
    app = build_app(LLMEngine(rt, EngineConfig(max_batch=16, max_context=128)), rt.tokenizer,
                    ServerConfig("base", fmt, drain_timeout=2.0))
    bodies = [{"model": m or "base", "prompt": PROMPT, "max_tokens": 6, "temperature": t, "seed": 3}
              for m, t in [(None, 0), ("good", 0.8), ("poison", 0.8), (None, 0.8), ("poison", 0), ("good", 0)] * 3]
    with TestClient(app) as client, ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda body: client.post("/v1/completions", json=body), bodies))
    for body, reply in zip(bodies, replies):
        if body["model"] == "poison":
            assert reply.status_code == 500 and "NaN or inf" in reply.json()["error"]["message"]
        else:
            assert reply.status_code == 200, reply.text


def _cached_and_text(client: TestClient, model: str) -> tuple[int, str]:
    body = {"model": model, "prompt": PROMPT * 12, "max_tokens": 4, "temperature": 0}
    reply = client.post("/v1/completions", json=body).json()
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"], reply["choices"][0]["text"]


@pytest.mark.parametrize("persisted", [False, True])
def test_adapters_differing_only_in_alpha_never_share_cached_prefixes(base, tmp_path, persisted):
    """Same weights file, other lora_alpha: other products, so other prefix-cache keys (live, and across a restart
    with a persisted cache)."""
    low, high = _adapter(tmp_path / "low", alpha=4.0), _adapter(tmp_path / "high", alpha=64.0)
    assert (low / "adapter_model.safetensors").read_bytes() == (high / "adapter_model.safetensors").read_bytes()

    def server(adapters: dict) -> TestClient:
        rt = open_model(str(base / "base"))
        rt.load_adapters(adapters)
        fmt = chat_format(rt.tokenizer, rt.cfg.bos_token_id, rt.cfg.eos_token_id, "auto")
        config = EngineConfig(max_batch=4, max_context=256, prefix_cache_dir=str(tmp_path / "pc") if persisted else None)
        return TestClient(build_app(LLMEngine(rt, config), rt.tokenizer, ServerConfig("base", fmt, drain_timeout=2.0)))

    with server({"x": high}) as client:  # what "x" computes with alpha 64, cold
        _, want_high = _cached_and_text(client, "x")
    if persisted:
        shutil.rmtree(tmp_path / "pc")
    with server({"x": low} if persisted else {"x": low, "y": high}) as client:
        cold, low_text = _cached_and_text(client, "x")
        warm, again = _cached_and_text(client, "x")
        assert cold == 0 and warm > 0 and again == low_text  # the cache does serve the same adapter
        if not persisted:
            cached, text = _cached_and_text(client, "y")
            assert cached == 0 and text == want_high
    if persisted:  # restarted with the other alpha under the same name, reading the saved cache
        with server({"x": high}) as client:
            cached, text = _cached_and_text(client, "x")
            assert cached == 0 and text == want_high
    assert want_high != low_text


@pytest.mark.parametrize("case, message", [
    ("nan", r"lora_B.weight holds 1 non-finite values"),
    ("inf", r"lora_A.weight holds 1 non-finite values"),
    ("alpha_nan", r"lora_alpha must be a finite number, got nan"),
    ("alpha_huge", r"lora_alpha = 1e\+308 .* can overflow fp32"),
    ("alpha_bool", r"lora_alpha must be a finite number, got True"),
    ("rank_bool", r"r must be a positive integer, got True"),
    ("int8", r"has dtype torch.int8; LoRA weights are floating point"),
    ("array", r"adapter_config.json: expected a JSON object, got list"),
    ("null", r"adapter_config.json: expected a JSON object, got NoneType"),
    ("string", r"adapter_config.json: expected a JSON object, got str"),
    ("latin1", r"adapter_config.json: not UTF-8 text"),
])
def test_bad_adapter_files_are_refused_at_start_naming_file_and_value(base, tmp_path, case, message):
    folder = _adapter(tmp_path / "a")
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    config = json.loads(config_path.read_text())
    tensors = load_file(str(weights_path))
    key_a, key_b = (f"base_model.model.{MODULE}.lora_{p}.weight" for p in "AB")
    if case in ("nan", "inf"):
        tensors[key_b if case == "nan" else key_a].view(-1)[3] = float("nan" if case == "nan" else "inf")
    elif case == "int8":
        tensors[key_a] = tensors[key_a].to(torch.int8)
    elif case.startswith("alpha") or case == "rank_bool":
        config[{"alpha_nan": "lora_alpha", "alpha_huge": "lora_alpha", "alpha_bool": "lora_alpha",
                "rank_bool": "r"}[case]] = {"alpha_nan": float("nan"), "alpha_huge": 1e308}.get(case, True)
    save_file(tensors, str(weights_path))
    text = json.dumps(config)
    raw = {"array": b"[1, 2]", "null": b"null", "string": b'"lora"', "latin1": text[:-1].encode() + b', "x": "\xe9"}'}
    config_path.write_bytes(raw.get(case, text.encode()))
    with pytest.raises(OpenflashError, match=message):
        read_adapter(folder)
    rt = open_model(str(base / "base"))
    with pytest.raises(OpenflashError, match=r"--lora bad: .*" + message):
        rt.load_adapters({"bad": folder})
    assert rt.adapters is None  # nothing half-attached


def test_commands_refuse_bad_adapters_in_one_line(base, tmp_path, capsys):
    poisoned = _adapter(tmp_path / "nan")
    tensors = load_file(str(poisoned / "adapter_model.safetensors"))
    next(iter(tensors.values())).view(-1)[0] = float("nan")
    save_file(tensors, str(poisoned / "adapter_model.safetensors"))
    for argv in (["generate", "--model", str(base / "base"), "--lora", str(poisoned), "--prompt", "x",
                  "--temperature", "0.8"],
                 ["lora", "merge", str(base / "base"), str(poisoned), str(tmp_path / "merged")],
                 ["generate", "--model", str(base / "base"), "--lora", "", "--prompt", "x"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert "non-finite" in err or "path is empty" in err
    assert not (tmp_path / "merged").exists()


def test_verify_covers_the_adapters_too(base, tmp_path, capsys):
    folder = _adapter(tmp_path / "a")
    weights = folder / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # a flipped bit in a float: still loads, silently different
    weights.write_bytes(bytes(data))
    rt = open_model(str(base / "base"))
    with pytest.raises(OpenflashError, match=r"--lora a: .*adapter_model.safetensors"):
        rt.load_adapters({"a": folder}, verify=True)
    argv = ["generate", "--model", str(base / "base"), "--lora", str(folder), "--prompt", "x", "--max-tokens", "1"]
    assert cli_main(argv + ["--verify"]) == 2 and "adapter_model.safetensors" in capsys.readouterr().err
    assert cli_main(argv) == 0  # without --verify it is not hashed


def test_an_adapter_is_tied_to_its_base(base, tmp_path, capsys):
    """An adapter recorded as trained on another checkpoint is refused by serve, generate and merge, naming both;
    one recorded on this base loads."""
    other = tmp_path / "other"
    torch.manual_seed(5)
    save_checkpoint(build_model(load_config("tiny")), other, tokenizer_json=base / "tok.json", dtype="fp8")
    from openflash.files.manifest import folder_fingerprint

    mine = _adapter(tmp_path / "mine", base={"path": str(base / "base"),
                                             "fingerprint": folder_fingerprint(base / "base")})
    foreign = _adapter(tmp_path / "foreign", base={"path": str(other), "fingerprint": folder_fingerprint(other)})
    open_model(str(base / "base")).load_adapters({"mine": mine})
    with pytest.raises(OpenflashError, match=r"was trained on .*other .*not on .*base.*delete .*base_model.json"):
        open_model(str(base / "base")).load_adapters({"foreign": foreign})
    assert cli_main(["lora", "merge", str(base / "base"), str(foreign), str(tmp_path / "m")]) == 2
    assert "was trained on" in capsys.readouterr().err and not (tmp_path / "m").exists()


def test_lora_merge_writes_a_checkpoint_not_a_run_step(base, tmp_path, capsys):
    run_step = tmp_path / "run" / "checkpoints" / "step_00000005"
    shutil.copytree(base / "base", run_step)
    (run_step / "trainer_state.pt").write_bytes(b"state")
    adapter = _adapter(tmp_path / "a")
    assert cli_main(["lora", "merge", str(run_step), str(adapter), str(tmp_path / "merged")]) == 0
    assert not (tmp_path / "merged" / "trainer_state.pt").exists()
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    capsys.readouterr()
    into_run = tmp_path / "run" / "checkpoints" / "step_00000009"
    assert cli_main(["lora", "merge", str(run_step), str(adapter), str(into_run)]) == 2
    assert "training run's checkpoints/" in capsys.readouterr().err and not into_run.exists()
    (tmp_path / "file").write_text("keep me")
    assert cli_main(["lora", "merge", str(run_step), str(adapter), str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err and (tmp_path / "file").read_text() == "keep me"
    assert cli_main(["lora", "merge", str(run_step), str(adapter), str(tmp_path / "file" / "under" / "it")]) == 2
    assert "is a file, so no folder can be made under it" in capsys.readouterr().err


def _data(base: Path, tmp: Path) -> Path:
    src = write_jsonl(tmp / "chats.jsonl", chats(30))
    assert cli_main(["data", "prepare", str(src), "--chats", "--tokenizer", str(base / "tok.json"), "--out",
                     str(tmp / "data"), "--val-fraction", "0.1"]) == 0
    return tmp / "data"


def _lora_cfg(data: Path, out: Path, init: Path, **kw) -> TrainConfig:
    return TrainConfig(data=str(data), out=str(out), init=str(init), steps=2, batch_size=2, seq_len=32, warmup=0,
                       eval_every=0, eval_batches=1, progress=False, lora=4, **kw)


def test_train_verifies_its_init_on_request_and_a_resumed_lora_run_keeps_its_base(base, tmp_path):
    data = _data(base, tmp_path)
    # a base that is a run folder: --init resolves to its latest checkpoint
    base_run = tmp_path / "base_run"
    shutil.copytree(base / "base", base_run / "checkpoints" / "step_00000001")
    first = base_run / "checkpoints" / "step_00000001"
    trainer = Trainer(_lora_cfg(data, tmp_path / "lora", base_run))
    trainer.fit()
    assert trainer.base["path"] == str(first.resolve())
    saved = tmp_path / "lora" / "checkpoints" / "step_00000002"
    assert json.loads((saved / BASE_FILE).read_text())["path"] == str(first.resolve())
    start = json.loads((tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["config"] == str(first.resolve())  # the base, not the unused preset default
    # the base run moves on; the LoRA run resumes on the checkpoint it started from
    torch.manual_seed(9)
    save_checkpoint(build_model(load_config("tiny")), base_run / "checkpoints" / "step_00000002",
                    tokenizer_json=base / "tok.json", dtype="fp8")
    resumed = Trainer(_lora_cfg(data, tmp_path / "lora", base_run, resume=True))
    assert resumed.base["path"] == str(first.resolve()) and resumed.step == 2
    # its files changed since: refused
    (first / "config.json").write_text((first / "config.json").read_text() + " ")
    with pytest.raises(OpenflashError, match="has changed since"):
        Trainer(_lora_cfg(data, tmp_path / "lora", base_run, resume=True))

    damaged = tmp_path / "damaged"
    shutil.copytree(base / "base", damaged)
    weights = damaged / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0x10
    weights.write_bytes(bytes(raw))
    for lora in (4, None):
        cfg = _lora_cfg(data, tmp_path / f"v{lora}", damaged, verify_init=True)
        cfg = TrainConfig(**{**cfg.__dict__, "lora": lora})
        with pytest.raises(OpenflashError, match=r"--verify: .*model.safetensors"):
            Trainer(cfg)
    with pytest.raises(OpenflashError, match="--config small with --init"):
        TrainConfig(data="d", out="o", init="tiny", config="small")


def test_chat_preparation_names_every_bad_line_and_reads_unicode_line_separators(base, tmp_path, monkeypatch):
    good = json.dumps(chats(1)[0])
    separators = json.dumps({"messages": [{"role": "user", "content": "a\u2028b\u2029c\u0085d"},
                                          {"role": "assistant", "content": "ok"}]}, ensure_ascii=False)
    deep = '{"messages": [{"role": "user", "content": ' + "[" * 100_000 + "]" * 100_000 + "}]}"
    surrogate = '{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "x"}]}'
    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join([good, separators, "{not json", deep, good, surrogate, "x" * 300_000, good]) + "\n",
                   encoding="utf-8")
    import openflash.train.chats as chat_module

    monkeypatch.setattr(chat_module, "MAX_CHAT_LINE_BYTES", 250_000)
    with pytest.raises(OpenflashError) as refused:
        chat_module.prepare_chats([src], base / "tok.json", tmp_path / "out")
    message = str(refused.value)
    assert message.startswith("4 bad line(s); nothing was written")
    assert f"{src}:3: not JSON" in message and f"{src}:4: JSON nested" in message and "over the limit of 250,000" in message
    assert f"{src}:6: messages.0.content: character 0 is a lone UTF-16 surrogate" in message
    assert f"{src}:7: " in message and f"{src}:2:" not in message
    assert not (tmp_path / "out").exists()
    ok = tmp_path / "ok.jsonl"
    ok.write_text("\n".join([good, separators, good]) + "\n", encoding="utf-8")
    assert [w.rsplit(":", 1)[1] for w, _ in jsonl_records(ok)] == ["1", "2", "3"]
    assert list(jsonl_records(ok))[1][1]["messages"][0]["content"] == "a\u2028b\u2029c\u0085d"
    chat_module.prepare_chats([ok], base / "tok.json", tmp_path / "out")


def test_a_large_document_is_encoded_in_bounded_pieces_to_the_same_tokens(base):
    """Text is tokenized a bounded piece at a time (memory ~ the piece, not the document), cut where no
    pre-tokenizer joins across: the tokens equal the whole document's."""
    tok = preset_tokenizer(load_config("small"))
    text = Path(json.__file__).read_text() * 3 + "  \n\n\tx = 1;\n)\n" * 50
    pieces = text_pieces(text, 2000)
    assert len(pieces) > 10 and "".join(pieces) == text
    whole = tok.encode(text, add_special_tokens=False).ids
    pieced = encode_texts(tok, [text, "short"], np.dtype("int32"), chars=2000)
    assert pieced[0].tolist() == whole
    assert pieced[1].tolist() == tok.encode("short", add_special_tokens=False).ids
