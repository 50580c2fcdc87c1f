"""Config loading, round trips, the derived topology and validation errors."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from openflash.config import FlashConfig, load_config
from openflash.errors import ConfigError
from openflash.topology import LayerMode

GOLDENS = Path(__file__).parent / "goldens"

# spec architecture.md §5.4, released config: layer -> (mode, ratio, kv owner, top-k owner)
W, F, RI, RU = LayerMode.WINDOW, LayerMode.FULL, LayerMode.REINDEX, LayerMode.REUSE
RELEASED_MODES = {0: W, 1: W, 2: F, 8: F, 14: F, 20: F, 24: RI, 28: RI, 32: RI, 36: RI}


def released_expectation(layer: int) -> tuple[LayerMode, int, int | None, int | None]:
    if layer < 2:
        return W, 0, None, None
    ratio = 2 if layer < 20 else 1
    kv_owner = max(s for s in (2, 8, 14, 20) if s <= layer)
    topk_owner = max(s for s in (2, 8, 14, 20, 24, 28, 32, 36) if s <= layer)
    return RELEASED_MODES.get(layer, RU), ratio, kv_owner, topk_owner


def test_flash_topology_matches_spec_table():
    cfg = load_config("flash")
    assert len(cfg.topology.layers) == 40
    for t in cfg.topology.layers:
        mode, ratio, kv_owner, topk_owner = released_expectation(t.index)
        assert (t.mode, t.compress_ratio, t.kv_owner, t.topk_owner) == (mode, ratio, kv_owner, topk_owner), t
        assert t.half == ("encoder" if t.index < 20 else "decoder")
        assert t.engram_before == (t.index in (1, 14))
        assert t.is_candidate_source == (t.index == 20)
        assert t.uses_candidates == (t.index in (24, 28, 32, 36))
        # ratio-0 layers: theta 10000, no YaRN; ratio > 0: compress theta with YaRN (architecture.md §1 trap)
        assert (t.rope_theta, t.rope_yarn) == ((10000.0, False) if ratio == 0 else (160000.0, True))
    assert cfg.topology.decoder_start == 20


def test_tiny_preset_has_every_mode():
    cfg = load_config("tiny")
    modes = {t.mode for t in cfg.topology.layers}
    assert modes == {W, F, RI, RU}
    assert cfg.engram_layer_ids and cfg.candidate_source_layer_id >= 0


def test_hf_round_trip_keeps_unknown_keys(tmp_path):
    raw = json.loads((GOLDENS / "A" / "config.json").read_text())
    raw["text_config"]["some_future_key"] = {"x": 1}
    raw["another_root_key"] = [1, 2]
    cfg = FlashConfig.from_hf_dict(raw)
    back = cfg.to_hf_dict()
    assert back["text_config"]["some_future_key"] == {"x": 1}
    assert back["another_root_key"] == [1, 2]
    assert back["vision_config"] == raw["vision_config"]
    assert back["quantization_config"] == raw["quantization_config"]
    assert FlashConfig.from_hf_dict(back) == cfg
    path = tmp_path / "config.json"
    cfg.save(path)
    assert load_config(path) == cfg


def test_reference_flat_config_equals_hf_config():
    hf = load_config(GOLDENS / "A" / "config.json")
    ref = load_config(GOLDENS / "A" / "reference_model_args.json")
    for name in ("hidden_size", "num_hidden_layers", "compress_ratios", "kv_source_layer_ids", "index_topk",
                 "rope_factor", "original_max_position_embeddings", "engram_pad_token_id", "sliding_window",
                 "routed_scaling_factor", "weight_dtype", "expert_dtype", "image_token_id"):
        assert getattr(ref, name) == getattr(hf, name), name
    assert ref.topology == hf.topology


def _broken(**changes):
    raw = json.loads((GOLDENS / "A2" / "config.json").read_text())
    text = copy.deepcopy(raw)
    for key, value in changes.items():
        if value is _DELETE:
            del text["text_config"][key]
        else:
            text["text_config"][key] = value
    return text


_DELETE = object()

BROKEN = [
    (dict(compress_ratios=[0, 2, 2, 2, 1, 1, 1]), "compress_ratios has 7 entries"),
    (dict(kv_source_layer_ids=[1, 3, 9]), "names layer 9, which does not exist"),
    (dict(kv_source_layer_ids=[3, 4], index_source_layer_ids=[3, 4, 6]), "layer 1 has compress_ratio 2 but no KV source"),
    (dict(kv_source_layer_ids=[0, 3, 4]), "names layer 0, whose compress_ratio is 0"),
    (dict(index_source_layer_ids=[1, 4, 6]), "kv_source_layer_ids [3] are not in index_source_layer_ids"),
    (dict(kv_source_layer_ids=[1, 4], index_source_layer_ids=[1, 4, 6], compress_ratios=[0, 2, 2, 1, 1, 1, 1, 1]),
     "layer 3 has compress_ratio 1 but its KV owner, layer 1, has ratio 2"),
    (dict(candidate_topk_blocks=1, candidate_block_size=4), "candidate pool candidate_topk_blocks*candidate_block_size"),
    (dict(candidate_source_layer_id=5), "candidate_source_layer_id 5 is not an index source"),
    (dict(num_attention_heads=3), "num_attention_heads (3) is not divisible by o_groups (2)"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok (9) exceeds n_routed_experts (8)"),
    (dict(engram_num_embeddings=[304]), "engram_num_embeddings has 1 entries for 2 engram_layer_ids"),
    (dict(head_dim=48), "head_dim must be a multiple of 32"),
    (dict(hidden_size="128"), "hidden_size must be an integer, got '128'"),
    (dict(sliding_window=_DELETE), "missing text_config key(s): sliding_window"),
    (dict(scoring_func="softmax"), "scoring_func 'softmax' is not supported"),
    (dict(kv_source_layer_ids=[3, 1, 4]), "kv_source_layer_ids must be strictly increasing"),
]


@pytest.mark.parametrize("changes,message", BROKEN)
def test_broken_configs_name_key_and_value(changes, message):
    with pytest.raises(ConfigError) as err:
        FlashConfig.from_hf_dict(_broken(**changes), source="broken.json")
    assert message in str(err.value)
    assert str(err.value).startswith("broken.json")


def test_bad_paths_and_json(tmp_path):
    with pytest.raises(ConfigError, match="no such preset or config file"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read config JSON"):
        load_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config(tmp_path)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openflash.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_config_show_json_and_errors(tmp_path):
    out = _cli("config", "show", "flash", "--json")
    assert out.returncode == 0, out.stderr
    layers = json.loads(out.stdout)["layers"]
    assert [layer["mode"] for layer in layers[:3]] == ["WINDOW", "WINDOW", "FULL"]
    assert layers[24]["mode"] == "REINDEX" and layers[0]["compress_ratio"] == 0
    text = _cli("config", "show", "tiny")
    assert "REINDEX" in text.stdout and "decoder" in text.stdout
    broken = tmp_path / "config.json"
    broken.write_text(json.dumps(_broken(num_attention_heads=3)))
    err = _cli("config", "show", str(broken))
    assert err.returncode == 2
    assert err.stderr.strip().count("\n") == 0 and "num_attention_heads (3)" in err.stderr
    assert "Traceback" not in err.stderr


def test_dspark_config_and_its_errors():
    from openflash.errors import ConfigError

    cfg = load_config("tiny").with_dspark()
    d = cfg.dspark
    assert (d.stages, d.block_size, d.target_layer_ids, d.noise_token_id) == (3, 5, (5, 6, 7), cfg.pad_token_id)
    assert len(cfg.compress_ratios) == cfg.num_hidden_layers + 3 and load_config("tiny").dspark is None
    assert load_config("flash").dspark.n_routed_experts == 128
    for bad, match in ((dict(noise_token_id=5000), "dspark_noise_token_id 5000 is outside the vocabulary"),
                       (dict(target_layer_ids=[2, 99]), "dspark_target_layer_ids must be backbone layers"),
                       (dict(block_size=1), "dspark_block_size must be >= 2"),
                       (dict(num_experts_per_tok=9), "dspark_num_experts_per_tok")):
        with pytest.raises(ConfigError, match=match):
            load_config("tiny").with_dspark(**bad)
