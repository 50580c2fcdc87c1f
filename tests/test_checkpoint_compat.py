"""Checkpoints written by other tools: the official layout, followed loosely. These load (with a log note where it
matters) instead of failing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from openflash.checkpoint import load_checkpoint
from openflash.cli import main as cli_main
from openflash.config import load_config
from openflash.engine.generate import generate
from openflash.engine.sampling import SamplingParams
from openflash.errors import CheckpointError, ConfigError
from openflash.memory.tokenmap import TOKEN_MAP_FILES
from openflash.model.numerics import NUMERICS
from openflash.model.transformer import Transformer
from openflash.runtime.open import open_model
from openflash.runtime.runtime import Runtime
from openflash.tokenizer import preset_tokenizer

GOLDEN_A = Path(__file__).parent / "goldens" / "A"
GOLDEN_B2 = Path(__file__).parent / "goldens" / "B2"
TOKEN_MAP_FILE = TOKEN_MAP_FILES[0]


def _golden_copy(tmp_path: Path, edit_config=None, edit_tensors=None, golden: Path = GOLDEN_A) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    config = json.loads((golden / "config.json").read_text())
    if edit_config is not None:
        edit_config(config)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(golden / "model.safetensors"))
    if edit_tensors is not None:
        edit_tensors(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(-1).view(torch.uint8),
                                                           sb[k].view(-1).view(torch.uint8)), k


def test_ue8m0_scales_stored_as_u8(tmp_path):
    def to_u8(tensors):
        for name, t in tensors.items():
            if t.dtype == torch.float8_e8m0fnu:
                tensors[name] = t.view(torch.uint8)

    folder = _golden_copy(tmp_path, edit_tensors=to_u8)
    assert "F8_E8M0" not in json.dumps(load_file(str(folder / "model.safetensors")).keys().__repr__())
    model, _ = load_checkpoint(folder)
    _same_state(model, load_checkpoint(GOLDEN_A)[0])
    assert model.layers[0].attn.wq_a.scale.dtype == torch.float8_e8m0fnu


def test_writer_that_leaves_out_bias_vl(tmp_path, caplog):
    def drop_bias_vl(tensors):
        for name in [n for n in tensors if n.endswith("gate.bias_vl")]:
            del tensors[name]

    folder = _golden_copy(tmp_path, edit_tensors=drop_bias_vl, golden=GOLDEN_B2)
    with caplog.at_level(logging.INFO, logger="openflash.checkpoint"):
        model, _ = load_checkpoint(folder)
    assert model.cfg.has_vision
    assert torch.equal(model.layers[1].ffn.gate.bias_vl, torch.zeros_like(model.layers[1].ffn.gate.bias_vl))
    assert any("set to zeros" in r.message and "bias_vl" in r.message for r in caplog.records)


def test_vision_config_without_vision_tensors_is_named(tmp_path):
    def drop_vision(tensors):
        for name in [n for n in tensors if n.startswith(("vision.", "aligner.", "image_"))]:
            del tensors[name]

    folder = _golden_copy(tmp_path, edit_tensors=drop_vision, golden=GOLDEN_B2)
    with pytest.raises(CheckpointError, match=r"vision tower \(vision_config.num_hidden_layers = 2\).*none of its"):
        load_checkpoint(folder)


SHORT_NAMES = {"rms_norm_eps": "norm_eps", "qk_rope_head_dim": "rope_head_dim", "scoring_func": "score_func",
               "routed_scaling_factor": "route_scale"}


def _reference_names(config: dict) -> None:
    text = config["text_config"]
    for hf, short in SHORT_NAMES.items():
        text[short] = text.pop(hf)
    text["original_seq_len"] = text["rope_scaling"].pop("original_max_position_embeddings")


def test_text_config_with_reference_short_names(tmp_path, caplog):
    folder = _golden_copy(tmp_path, edit_config=_reference_names)
    with caplog.at_level(logging.INFO, logger="openflash.config"):
        cfg = load_config(folder)
    want = load_config(GOLDEN_A)
    for name in (*SHORT_NAMES, "original_max_position_embeddings"):
        assert getattr(cfg, name) == getattr(want, name), name
    assert cfg.to_hf_dict()["text_config"] == want.to_hf_dict()["text_config"]
    assert any("reference key names" in r.message for r in caplog.records)
    load_checkpoint(folder)  # and the weights load under it


def test_short_and_hf_names_must_agree(tmp_path):
    def both(config):
        config["text_config"]["norm_eps"] = 0.5
    folder = _golden_copy(tmp_path, edit_config=both)
    with pytest.raises(ConfigError, match="norm_eps=0.5 .* rms_norm_eps=.*must agree"):
        load_config(folder)


def test_engram_in_the_decoder_half_prefills_exact(caplog):
    cfg = load_config("tiny").replace(engram_layer_ids=[1, 5])  # decoder half starts at layer 4
    assert not cfg.topology.bounded_replay_ok
    tok = preset_tokenizer(cfg)
    torch.manual_seed(0)
    rt = Runtime.of(Transformer(cfg).set_numerics(NUMERICS["plain"]).eval(), tok)
    params = SamplingParams(max_tokens=4, temperature=0)
    prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"
    with caplog.at_level(logging.INFO, logger="openflash.model"):
        bounded = generate(rt, prompt, params, mode="bounded", prefill_chunk=8)
        generate(rt, prompt, params, mode="bounded", prefill_chunk=8)
    exact = generate(rt, prompt, params, mode="exact", prefill_chunk=8)
    assert bounded.token_ids == exact.token_ids
    notes = [r for r in caplog.records if "bounded prefill runs exact" in r.message]
    assert len(notes) == 1  # said once


def test_engram_in_the_decoder_half_through_the_engine():
    from openflash.engine.engine import EngineConfig, LLMEngine

    cfg = load_config("tiny").replace(engram_layer_ids=[1, 5])
    tok = preset_tokenizer(cfg)
    torch.manual_seed(0)
    rt = Runtime.of(Transformer(cfg).set_numerics(NUMERICS["plain"]).eval(), tok)
    prompt = tok.encode("import os\nimport sys\n" * 8).ids
    engine = LLMEngine(rt, EngineConfig(max_batch=2, max_context=256, prefill_mode="bounded",
                                                prefill_chunk=16))
    out = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
    want = generate(rt, prompt, SamplingParams(max_tokens=3, temperature=0), mode="exact")
    assert out.output_ids == want.token_ids


def test_checkpoint_carries_its_own_token_map(tmp_path, caplog):
    _, full = load_checkpoint(GOLDEN_A)
    ids = full.engram_frontend.token_map.ids.copy()
    ids[[10, 11]] = ids[[11, 10]]  # a map no tokenizer here would derive
    folder = _golden_copy(tmp_path)
    np.save(folder / TOKEN_MAP_FILE, ids)
    with caplog.at_level(logging.INFO, logger="openflash.checkpoint"):
        _, report = load_checkpoint(folder)
    assert np.array_equal(report.engram_frontend.token_map.ids, ids)
    assert any(TOKEN_MAP_FILE in r.message for r in caplog.records)
    np.save(folder / TOKEN_MAP_FILE, np.zeros(5, dtype=np.int64))
    with pytest.raises(ConfigError, match=f"{TOKEN_MAP_FILE}: compressed ids span 0..0"):
        load_checkpoint(folder)
    (folder / TOKEN_MAP_FILE).write_bytes(b"not npy")
    with pytest.raises(ConfigError, match="not a readable .npy token map"):
        load_checkpoint(folder)


def test_token_map_from_a_json_sidecar(tmp_path, caplog):
    _, full = load_checkpoint(GOLDEN_A)
    ids = full.engram_frontend.token_map.ids.copy()
    ids[[10, 11]] = ids[[11, 10]]
    folder = _golden_copy(tmp_path)
    for body in (ids.tolist(), {"token_map": ids.tolist()}, {"compressed_ids": ids.tolist()}):
        (folder / "engram_token_map.json").write_text(json.dumps(body))
        with caplog.at_level(logging.INFO, logger="openflash.checkpoint"):
            _, report = load_checkpoint(folder)
        assert np.array_equal(report.engram_frontend.token_map.ids, ids)
        assert any("engram_token_map.json" in r.message for r in caplog.records)
    (folder / "engram_token_map.json").write_text(json.dumps({"map": [1, 2]}))
    with pytest.raises(ConfigError, match="engram_token_map.json: a JSON token map .* one of the keys"):
        load_checkpoint(folder)
    (folder / "engram_token_map.json").write_text("[1, 2, 3.5]")
    with pytest.raises(ConfigError, match="engram_token_map.json: a JSON token map is a list of integers"):
        load_checkpoint(folder)


def test_a_token_map_mismatch_says_how_to_ship_a_map(tmp_path):
    def shrink(config):
        config["text_config"]["engram_compressed_vocab_size"] -= 1

    folder = _golden_copy(tmp_path, edit_config=shrink)
    with pytest.raises(ConfigError, match="engram_token_map.npy or engram_token_map.json"):
        load_checkpoint(folder)


def test_vision_config_without_preprocessing_keys_gets_the_released_values(tmp_path, caplog):
    def drop(config):
        del config["vision_config"]["min_pixels"], config["vision_config"]["max_wh_ratio"]

    folder = _golden_copy(tmp_path, edit_config=drop, golden=GOLDEN_B2)
    with caplog.at_level(logging.INFO, logger="openflash.config"):
        model, _ = load_checkpoint(folder)
    assert (model.cfg.vision.min_pixels, model.cfg.vision.max_wh_ratio) == (295_936, None)
    assert any("min_pixels, max_wh_ratio not set" in r.message for r in caplog.records)


def test_generate_names_the_tokenizer_it_tried(capsys):
    """Golden A has no tokenizer.json: DeepSeek's full tokenizer is tried, and its ids run past the 1,024-id vocab."""
    assert cli_main(["generate", "--model", str(GOLDEN_A), "--prompt", "zebra quantum", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "outside the model's vocabulary (0..1023)" in err and "DeepSeek tokenizer" in err
    assert f"{GOLDEN_A} has no tokenizer.json" in err and "--tokenizer" in err


def test_generate_from_token_ids_with_numerics_and_prefill_mode(capsys):
    ids = [0, 5, 17, 300, 41, 9]
    assert cli_main(["generate", "--model", str(GOLDEN_A), "--prompt-ids", "0, 5,17 300,41,9", "--numerics",
                     "reference", "--prefill", "exact", "--max-tokens", "3"]) == 0
    printed = capsys.readouterr().out
    want = generate(open_model(str(GOLDEN_A), numerics="reference"), ids, SamplingParams(max_tokens=3), mode="exact")
    assert f"# generated ids: {want.token_ids}" in printed
    with pytest.raises(SystemExit, match="2"):
        cli_main(["generate", "--model", str(GOLDEN_A), "--prompt-ids", "5,x"])
    assert "token ids are integers separated by commas or spaces, got '5,x'" in capsys.readouterr().err
    assert cli_main(["generate", "--model", str(GOLDEN_A), "--prompt-ids", "5", "--numerics", "fp16"]) == 2
    assert "numerics must be one of" in capsys.readouterr().err
