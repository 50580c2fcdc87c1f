"""Checkpoint loading in the official layout (clear errors), saving (fp32 exact, fp8 official, sharded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from openflash.checkpoint import count_by_dtype, load_checkpoint, save_checkpoint
from openflash.config import load_config
from openflash.errors import CheckpointError
from openflash.model.numerics import PLAIN
from openflash.model.transformer import Transformer
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.runtime.runtime import Runtime

GOLDEN_A = Path(__file__).parent / "goldens" / "A"


def _copy_golden(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(GOLDEN_A / "config.json", folder / "config.json")
    return folder, load_file(str(GOLDEN_A / "model.safetensors"))


def test_loads_golden_with_official_dtypes():
    model, report = load_checkpoint(GOLDEN_A)
    assert report.tensors == 657 - 8  # the 8 wo_a scales are folded into wo_a at load (convert.py step)
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert model.layers[0].ffn.experts[0].w1.weight.dtype == torch.int8
    assert model.layers[0].attn.wo_a.weight.dtype == torch.float32
    assert model.layers[0].engram.embed.weight.dtype == torch.float8_e4m3fn
    assert count_by_dtype(GOLDEN_A) == {"BF16": 65, "F32": 64, "F8_E4M3": 72, "F8_E8M0": 264, "I8": 192}


@pytest.mark.parametrize("damage,expected", [
    (lambda t: t.pop("layers.3.attn.compressor.wgate.weight"), "missing tensor layers.3.attn.compressor.wgate.weight"),
    (lambda t: t.__setitem__("layers.0.attn.extra.weight", torch.zeros(2)), "unexpected tensor layers.0.attn.extra.weight"),
    (lambda t: t.__setitem__("norm.weight", torch.zeros(64, dtype=torch.bfloat16)),
     "tensor norm.weight has shape [64], expected [128]"),
    (lambda t: t.__setitem__("layers.0.attn.wq_a.weight", torch.zeros(64, 128, dtype=torch.bfloat16)),
     "tensor layers.0.attn.wq_a.weight has dtype BF16, expected F8_E4M3"),
    (lambda t: t.__setitem__("layers.2.ffn.experts.1.w2.weight", torch.zeros(128, 32, dtype=torch.float32)),
     "tensor layers.2.ffn.experts.1.w2.weight has dtype F32, expected I8"),
])
def test_load_errors_name_the_tensor(tmp_path, damage, expected):
    folder, tensors = _copy_golden(tmp_path)
    damage(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder)
    assert expected in str(err.value)
    assert str(folder) in str(err.value)


def test_all_problems_reported_at_once(tmp_path):
    folder, tensors = _copy_golden(tmp_path)
    tensors.pop("norm.weight")
    tensors.pop("head.weight")
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"2 problems") as err:
        load_checkpoint(folder)
    assert "norm.weight" in str(err.value) and "head.weight" in str(err.value)


def test_missing_files_and_broken_index(tmp_path):
    folder, tensors = _copy_golden(tmp_path)
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"norm.weight": "x.safetensors"}}))
    with pytest.raises(CheckpointError, match="x.safetensors: shard listed"):
        load_checkpoint(folder)
    (folder / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="needs a 'weight_map'"):
        load_checkpoint(folder)


def test_fp32_round_trip_is_exact_and_sharded(tmp_path):
    torch.manual_seed(0)
    cfg = load_config("tiny")
    model = Transformer(cfg).eval().set_numerics(PLAIN)
    save_checkpoint(model, tmp_path / "one", dtype="fp32")
    save_checkpoint(model, tmp_path / "many", dtype="fp32", max_shard_bytes=1 << 20)
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    ids = torch.randint(3, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        want = Runtime.of(model).forward(ids).logits
    for name in ("one", "many"):
        loaded, _ = load_checkpoint(tmp_path / name, numerics="plain")
        # What the round trip guarantees: every stored tensor comes back bit for bit.
        original = model.state_dict()
        for key, tensor in loaded.state_dict().items():
            assert tensor.dtype == original[key].dtype and torch.equal(tensor.view(-1).view(torch.uint8),
                                                                       original[key].view(-1).view(torch.uint8)), key
        # Logits are not bitwise: the loaded weights sit elsewhere in memory (safetensors mappings are not 64-byte
        # aligned), and the BLAS may pick another kernel for them, moving the last bits (seen on AVX2 machines).
        # Identical weights leave only fp32 summation-order differences: ~1e-6 relative over 128-wide dots.
        with torch.no_grad():
            torch.testing.assert_close(Runtime.of(loaded).forward(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_fp8_save_uses_official_layout_and_loads(tmp_path):
    torch.manual_seed(0)
    model = Transformer(load_config("tiny")).eval()
    save_checkpoint(model, tmp_path / "q", dtype="fp8")
    counts = count_by_dtype(tmp_path / "q")
    assert set(counts) == {"BF16", "F32", "F8_E4M3", "F8_E8M0", "I8"}
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "fp8" and raw["quantization_config"]["expert_dtype"] == "fp4"
    loaded, _ = load_checkpoint(tmp_path / "q")
    assert loaded.layers[0].ffn.experts[0].w1.weight.dtype == torch.int8
    ids = torch.randint(3, 1024, (1, 12))
    with torch.no_grad():
        assert torch.isfinite(Runtime.of(loaded).forward(ids).logits).all()
    # Stored weights are the originals to within the formats' precision (FP8: 2^-4 relative, FP4: 1/4 of a block max)
    original, stored = model.layers[2].attn.wq_a.weight, loaded.layers[2].attn.wq_a.dequantized_weight()
    assert ((stored - original).abs() <= original.abs() * 2**-4 + 1e-6).all()
    original, stored = model.layers[2].ffn.experts[3].w1.weight, loaded.layers[2].ffn.experts[3].w1.dequantized_weight()
    block_max = original.abs().view(original.shape[0], -1, 32).amax(-1).repeat_interleave(32, -1)
    assert ((stored - original).abs() <= block_max / 4 + 1e-6).all()
    # Re-saving the loaded FP8 model reproduces the same bytes
    save_checkpoint(loaded, tmp_path / "again", dtype="fp8")
    first, second = load_file(str(tmp_path / "q" / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k].view(torch.uint8), second[k].view(torch.uint8)) for k in first)


def test_engram_tables_can_be_left_to_an_external_tier():
    from openflash.memory.placement import EngramMemory

    model, report = load_checkpoint(GOLDEN_A, skip_engram_tables=True)
    assert model.layers[0].engram.embed.weight.is_meta
    assert "engram tables (left for an external tier)" in report.summary()
    memory = EngramMemory.attach(model, "host", frontend=report.engram_frontend, checkpoint_dir=GOLDEN_A)
    hosted = Runtime(model, report.tokenizer, memory)
    full = open_model(str(GOLDEN_A), placement=Placement(weights="dequantized"))
    ids = torch.tensor(json.loads((GOLDEN_A / "inputs.json").read_text())["input_ids"])
    # Two model instances: same rows and weights, but separately placed tensors (see the fp32 round trip above).
    torch.testing.assert_close(hosted.step(ids, hosted.new_cache(1)), full.step(ids, full.new_cache(1)), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors", "link.safetensors"])
def test_index_may_not_name_files_outside_the_folder(tmp_path, shard):
    from openflash.memory.checkpoint_tables import CheckpointTables

    folder, tensors = _copy_golden(tmp_path)
    save_file(tensors, str(tmp_path / "outside.safetensors"))
    (folder / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    weight_map = {name: shard for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for load in (load_checkpoint, CheckpointTables):
        with pytest.raises(CheckpointError, match="outside the checkpoint folder") as err:
            load(folder)
        assert str(folder / "model.safetensors.index.json") in str(err.value)
