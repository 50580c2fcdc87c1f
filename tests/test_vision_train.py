"""Fine-tuning a VL model on image+text pairs (train/vision.py): the JSONL format, loss masking, falling loss, and
the CLI with clear errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from openflash.checkpoint import load_checkpoint
from openflash.runtime.open import open_model
from openflash.train.vision import VLTrainConfig, train_vision

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def pairs(tmp_path):
    rng = np.random.default_rng(0)
    captions = ["red square", "blue noise", "green stripes", "a dark corner"]
    lines = []
    for k, caption in enumerate(captions):
        Image.fromarray(rng.integers(0, 256, (40 + 10 * k, 60, 3), dtype=np.uint8)).save(tmp_path / f"img{k}.png")
        record = {"image": f"img{k}.png", "text": caption} if k % 2 else \
            {"images": [f"img{k}.png"], "prompt": "Describe <image> briefly:", "text": " " + caption}
        lines.append(json.dumps(record))
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "pairs.jsonl"


def test_a_tiny_vl_model_fine_tunes_with_falling_loss(pairs, tmp_path):
    summary = train_vision(VLTrainConfig(data=str(pairs), init="tiny-vl", out=str(tmp_path / "out"), steps=24,
                                         batch_size=4, lr=3e-3))
    losses = [h["loss"] for h in json.loads((tmp_path / "out" / "vision_train.json").read_text())["history"]]
    assert summary["examples"] == 4 and len(losses) == 24
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4]), losses
    model, _ = load_checkpoint(tmp_path / "out")  # the fine-tuned model, vision tower included, loads back
    assert model.cfg.vision is not None
    start = open_model("tiny-vl").model  # the same random init (seed 0)
    assert not torch.equal(model.vision.blocks[0].attn.wqkv.weight, start.vision.blocks[0].attn.wqkv.weight)


def test_frozen_vision_keeps_the_tower(pairs, tmp_path):
    train_vision(VLTrainConfig(data=str(pairs), init="tiny-vl", out=str(tmp_path / "out"), steps=2, batch_size=2,
                               freeze_vision=True))
    start, model = open_model("tiny-vl").model, load_checkpoint(tmp_path / "out")[0]
    assert torch.equal(model.vision.blocks[0].attn.wqkv.weight,
                       start.vision.blocks[0].attn.wqkv.weight.to(torch.float32))


@pytest.mark.parametrize("line,match", [
    ("not json", "pairs.jsonl:1: not JSON"),
    ('{"text": "no image"}', r"'image' \(a path\) or 'images'"),
    ('{"image": "missing.png", "text": "x"}', "pairs.jsonl:1: image 0: cannot read .*missing.png"),
    ('{"image": "img.png", "text": "x <image>"}', "images go in 'prompt'"),
])
def test_bad_pairs_name_the_file_and_line(tmp_path, line, match):
    Image.new("RGB", (20, 20)).save(tmp_path / "img.png")
    (tmp_path / "pairs.jsonl").write_text(line + "\n")
    out = subprocess.run([sys.executable, "-m", "openflash.cli", "train", "--vision-data", str(tmp_path / "pairs.jsonl"),
                          "--init", "tiny-vl", "--out", str(tmp_path / "out"), "--steps", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert re.search(match, out.stderr), out.stderr


def test_a_text_model_is_refused(pairs, tmp_path):
    from openflash.errors import OpenflashError
    with pytest.raises(OpenflashError, match="no vision tower"):
        train_vision(VLTrainConfig(data=str(pairs), init="tiny", out=str(tmp_path / "out"), steps=1))
