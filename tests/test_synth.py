"""`openflash checkpoint synth`: random-weights checkpoints in the official layout, cut to fit (synth.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from openflash.checkpoint import count_by_dtype, load_checkpoint
from openflash.config import load_config
from openflash.residency import resident_bytes
from openflash.runtime.runtime import Runtime
from openflash.tools.synth import cut_config, synthesize
from openflash.topology import LayerMode


def _step(model, report, ids):
    rt = Runtime.of(model, report.tokenizer, frontend=report.engram_frontend)
    cache = rt.new_cache(ids.shape[0])
    logits = rt.step(ids, cache)
    return logits, rt.decode(logits.argmax(-1), cache)


def test_a_synthetic_tiny_checkpoint_is_official_and_loads_both_ways(tmp_path):
    report = synthesize("tiny", tmp_path / "ckpt", shard_bytes=1 << 20)
    assert report.shards > 1 and (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    dtypes = count_by_dtype(tmp_path / "ckpt")
    assert {"F8_E4M3", "F8_E8M0", "I8", "BF16", "F32"} <= set(dtypes)
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (1, 24))
    stored = _step(*load_checkpoint(tmp_path / "ckpt", weights="stored"), ids)
    dequantized = _step(*load_checkpoint(tmp_path / "ckpt", weights="dequantized"), ids)
    for a, b in zip(stored, dequantized):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    out = subprocess.run([sys.executable, "-m", "openflash.cli", "generate", "--model", str(tmp_path / "ckpt"),
                          "--prompt", "def f(x):", "--max-tokens", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr  # its tokenizer (the preset's cut of DeepSeek's) came with it


def test_cutting_the_released_config_keeps_a_valid_topology():
    flash = load_config("flash")
    cut = cut_config(flash, layers=4, experts=8)
    assert cut.hidden_size == 5120 and cut.moe_intermediate_size == 2304 and cut.num_attention_heads == 64
    assert cut.num_hidden_layers == 4 and cut.n_routed_experts == 8 and cut.num_experts_per_tok == 6
    assert cut.engram_layer_ids == [1] and cut.engram_num_embeddings == [flash.engram_num_embeddings[0]]
    assert cut.dspark is None and cut.kv_source_layer_ids == [2]
    assert [t.mode for t in cut.topology.layers] == [LayerMode.WINDOW, LayerMode.WINDOW, LayerMode.FULL,
                                                     LayerMode.REUSE]


def test_large_engram_tables_are_sparse_zero_rows(tmp_path):
    report = synthesize("tiny", tmp_path / "ckpt", dense_table_bytes=1)
    assert len(report.sparse_tables) == 2
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    table_file = tmp_path / "ckpt" / index["weight_map"][report.sparse_tables[0]]
    assert table_file.stat().st_blocks * 512 < 64 << 10  # a hole, not data
    model, _ = load_checkpoint(tmp_path / "ckpt")
    assert not model.layers[1].engram.embed.weight.view(torch.uint8).any()


def test_released_width_layer_prefills_and_decodes_with_stored_weights(tmp_path):
    """One layer of the released model (hidden 5120, 64 heads, experts of 2304; 4 of its 384 experts), the
    released vocabulary: 2.7 GB as stored, held as stored."""
    report = synthesize("flash", tmp_path / "ckpt", layers=1, experts=4, vision=False)
    model, load = load_checkpoint(tmp_path / "ckpt", weights="stored")
    assert resident_bytes(model) <= 1.03 * report.logical_bytes
    prefill, decode = _step(model, load, torch.randint(3, 120000, (1, 8)))
    assert prefill.shape == decode.shape == (1, 129280)
    assert torch.isfinite(prefill).all() and torch.isfinite(decode).all()


def test_bad_synth_requests_are_named(tmp_path):
    import pytest

    from openflash.errors import OpenflashError

    with pytest.raises(OpenflashError, match="--layers must be in 1..40, got 0"):
        cut_config(load_config("flash"), layers=0)
    with pytest.raises(OpenflashError, match="--experts must be in 1..384, got 999"):
        cut_config(load_config("flash"), experts=999)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(OpenflashError, match="not empty; checkpoint synth writes a new folder"):
        synthesize("tiny", tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"  # nothing lost
