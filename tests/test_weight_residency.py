"""Weights that stay in their stored formats ("stored" residency): memory is the checkpoint's size, outputs are
those of the dequantized path, and parity holds (model/layers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from openflash import kernels
from openflash.checkpoint import load_checkpoint
from openflash.errors import CheckpointError
from openflash.model import layers
from openflash.residency import choose_residency, resident_bytes
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.tools.parity import run_golden

GOLDENS = Path(__file__).parent / "goldens"


def _run(folder: Path, weights: str) -> tuple[list[torch.Tensor], int]:
    """Plain numerics: the activations' FP8 QDQ jumps a rounding step wherever a last-bit difference crosses a
    boundary, and the stored weights' products (the native kernels, also for a prefill's rows) sum in another
    order than the dequantized ones (the BLAS); without it the two differ by that order alone."""
    rt = open_model(str(folder), numerics="plain", placement=Placement(weights=weights))
    torch.manual_seed(1)
    ids = torch.randint(3, rt.cfg.vocab_size - 8, (2, 40))
    cache = rt.new_cache(2)
    out = [rt.step(ids, cache)]
    for _ in range(3):
        out.append(rt.decode(out[-1].argmax(-1), cache))
    return out, resident_bytes(rt.model)


@pytest.mark.parametrize("golden", ["A2", "B2"])
def test_stored_weights_take_the_checkpoint_size_and_give_the_same_logits(golden):
    folder = GOLDENS / golden
    size = (folder / "model.safetensors").stat().st_size
    stored, stored_bytes = _run(folder, "stored")
    dequantized, dequantized_bytes = _run(folder, "dequantized")
    assert stored_bytes <= 1.03 * size, (stored_bytes, size)
    assert dequantized_bytes > 2 * size  # fp32 copies of FP8 / FP4 / bf16
    for a, b in zip(stored, dequantized):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_many_small_tiles_change_nothing(monkeypatch):
    monkeypatch.setattr(layers, "TILE_BYTES", 1)  # 32 output rows per tile
    monkeypatch.setattr(kernels, "serves", lambda *a: False)  # the tiled PyTorch path, not the native kernels
    tiled, _ = _run(GOLDENS / "A2", "stored")
    monkeypatch.undo()
    whole, _ = _run(GOLDENS / "A2", "dequantized")
    for a, b in zip(tiled, whole):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_parity_holds_with_stored_weights():
    results = run_golden(GOLDENS / "B2", "reference", teacher_forced=True, weights="stored")
    assert all(c.passed for c in results), [c.key for c in results if not c.passed]


def test_auto_picks_stored_when_the_copies_would_not_fit():
    model, _ = load_checkpoint(GOLDENS / "A2", weights="stored")
    assert choose_residency(model, available=1 << 20) == "stored"
    assert choose_residency(model, available=1 << 40) == "dequantized"
    assert load_checkpoint(GOLDENS / "A2", weights="auto")[1].residency == "dequantized"  # tiny: it fits
    with pytest.raises(CheckpointError, match="weights must be one of"):
        load_checkpoint(GOLDENS / "A2", weights="fp4")


def test_auto_picks_stored_where_the_kernels_decode_faster(tmp_path, monkeypatch):
    """A quantized checkpoint of hidden size KERNELS_WIDTH or more (the `small` preset's, FP8/FP4 by synth) keeps
    its weights as stored when the native kernels run here; golden A2 (hidden 128) and any model without the
    kernels keep fp32 copies where they fit."""
    from openflash.kernels import native
    from openflash.residency import KERNELS_WIDTH
    from openflash.tools.synth import synthesize

    synthesize("small", tmp_path / "small", vision=False)
    model, _ = load_checkpoint(tmp_path / "small", weights="stored")
    assert model.cfg.hidden_size >= KERNELS_WIDTH
    assert choose_residency(model, available=1 << 40) == ("stored" if native.available() else "dequantized")
    assert choose_residency(model, available=1 << 40, device="meta") == "dequantized"  # not the CPU: no kernels
    monkeypatch.setenv("OPENFLASH_KERNELS", "0")
    native.status.cache_clear()
    try:
        assert choose_residency(model, available=1 << 40) == "dequantized"
    finally:
        monkeypatch.undo()
        native.status.cache_clear()
