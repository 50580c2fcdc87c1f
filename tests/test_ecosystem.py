"""What users bring from the rest of the ecosystem: token maps other V4.1 implementations ship, models in the
Hugging Face cache, sizes written with units, and a /metrics endpoint that vLLM dashboards read."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from openflash.chat import chat_format
from openflash.checkpoint import build_model, save_checkpoint
from openflash.cli import build_parser
from openflash.cli import main as cli_main
from openflash.config import load_config
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.errors import CheckpointError, ConfigError, OpenflashError
from openflash.runtime.open import open_model
from openflash.serve.app import ServerConfig, build_app
from openflash.sizes import parse_size
from openflash.tokenizer import preset_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eco")
    cfg = load_config("tiny")
    preset_tokenizer(cfg).save(str(tmp / "tok.json"))
    torch.manual_seed(0)
    save_checkpoint(build_model(cfg), tmp / "ckpt", tokenizer_json=tmp / "tok.json", dtype="fp8")
    return tmp / "ckpt"


def _swapped_map(folder) -> list[int]:
    """The map the tokenizer gives, with two compressed ids swapped: a map only its file can explain."""
    ids = open_model(str(folder)).frontend.token_map.ids.copy()
    a, b = 10, int(np.flatnonzero(ids != ids[10])[0])
    ids[a], ids[b] = ids[b], ids[a]
    return ids.tolist()


def test_token_maps_other_tools_ship_are_read_and_named_in_the_load_report(checkpoint, tmp_path):
    colibri = tmp_path / "colibri"
    shutil.copytree(checkpoint, colibri)
    want = _swapped_map(checkpoint)
    (colibri / "dsv41_engram.json").write_text(json.dumps({"token_map": want, "compressed_vocab": max(want) + 1}))
    rt = open_model(str(colibri))
    assert rt.frontend.token_map.ids.tolist() == want
    assert "Engram token map from dsv41_engram.json" in rt.note
    assert "Engram token map derived from the tokenizer" in open_model(str(checkpoint)).note

    named = tmp_path / "named"
    shutil.copytree(checkpoint, named)
    (named / "my_map.json").write_text(json.dumps(want))
    config = json.loads((named / "config.json").read_text())
    (named / "config.json").write_text(json.dumps({**config, "engram_token_map_file": "my_map.json"}))
    rt = open_model(str(named))
    assert rt.frontend.token_map.ids.tolist() == want and "from my_map.json" in rt.note
    (named / "config.json").write_text(json.dumps({**config, "engram_token_map_file": "../elsewhere.json"}))
    with pytest.raises(ConfigError, match=r"engram_token_map_file = '../elsewhere.json' names no token map file"):
        open_model(str(named))


def test_a_model_id_is_found_in_the_hugging_face_cache_offline(checkpoint, tmp_path, monkeypatch, capsys):
    """`--model org/name` is the snapshot the hub tools downloaded (HF_HOME), resolved without the network; a model
    not there is refused with the command that downloads it."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    repo = tmp_path / "hf" / "hub" / "models--deepseek-ai--Tiny-V4.1"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(checkpoint, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    rt = open_model("deepseek-ai/Tiny-V4.1")
    assert rt.folder == repo / "snapshots" / commit
    with pytest.raises(CheckpointError, match=r"neither a local folder nor a model in the Hugging Face cache "
                                              r".*hf download deepseek-ai/Missing"):
        open_model("deepseek-ai/Missing")
    assert cli_main(["generate", "--model", "deepseek-ai/Missing", "--prompt", "x"]) == 2
    assert "hf download deepseek-ai/Missing" in capsys.readouterr().err


def test_every_size_flag_takes_units():
    assert parse_size("24GiB", "--memory") == 24 << 30 and parse_size("80GB", "x") == 80 * 10 ** 9
    assert parse_size("1.5KiB", "x") == 1536 and parse_size("1e6", "x") == 10 ** 6 and parse_size(4096, "x") == 4096
    with pytest.raises(OpenflashError, match=r"--memory: '1e400' is not a size .*at most 1 EiB"):
        parse_size("1e400", "--memory")  # not an OverflowError
    with pytest.raises(OpenflashError, match=r"--memory: 'lots' is not a size"):
        parse_size("lots", "--memory")
    parser = build_parser()
    serve = parser.parse_args(["serve", "--model", "tiny", "--expert-cache-bytes", "2GiB", "--engram-cache-bytes",
                               "64MiB", "--max-request-bytes", "1MB", "--max-image-bytes", "512KiB"])
    assert (serve.expert_cache_bytes, serve.engram_cache_bytes, serve.max_request_bytes, serve.max_image_bytes) == \
        (2 << 30, 64 << 20, 10 ** 6, 512 << 10)
    synth = parser.parse_args(["checkpoint", "synth", "tiny", "out", "--shard-bytes", "1GiB", "--dense-table-bytes",
                               "4096"])
    assert (synth.shard_bytes, synth.dense_table_bytes) == (1 << 30, 4096)
    assert parser.parse_args(["plan", "--memory", "24GiB"]).memory == 24 << 30
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "tiny", "--max-image-bytes", "-5"])


def test_metrics_carry_vllm_names_and_the_process_collectors(checkpoint):
    rt = open_model("tiny")
    fmt = chat_format(rt.tokenizer, rt.cfg.bos_token_id, rt.cfg.eos_token_id, "auto")
    app = build_app(LLMEngine(rt, EngineConfig(max_batch=4, max_context=128)), rt.tokenizer,
                    ServerConfig("tiny-served", fmt, drain_timeout=2.0))
    with TestClient(app) as client:
        for _ in range(2):
            # ignore_eos: sampled at temperature 1, random weights may end a request early (a flaky count).
            assert client.post("/v1/completions", json={"model": "tiny-served", "prompt": "def f(x):",
                                                        "max_tokens": 3, "ignore_eos": True}).status_code == 200
        reply = client.get("/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    one = {name: s[0] for name, s in samples.items()}
    assert one["vllm:num_requests_running"].labels == {"model_name": "tiny-served"}
    assert one["vllm:time_to_first_token_seconds_count"].value == 2
    assert one["vllm:time_per_output_token_seconds_count"].value == 4  # 3 tokens each: 2 gaps
    assert one["vllm:generation_tokens_total"].value == 6
    assert one["vllm:prompt_tokens_total"].value == one["vllm:prefix_cache_queries_total"].value > 0
    assert "vllm:prefix_cache_hits_total" in one and "vllm:request_success_total" in one
    assert one["openflash_generation_tokens_total"].value == 6  # the earlier names stay
    assert "openflash_time_to_first_token_seconds_bucket" in samples
    assert "process_cpu_seconds_total" in one and "python_gc_objects_collected_total" in one
