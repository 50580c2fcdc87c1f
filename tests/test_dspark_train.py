"""Training a DSpark drafter on a model trained here: `openflash train --dspark --init RUN` adds a drafter to a
checkpoint, trains only it (the backbone stays bit-for-bit), its loss falls, and the result serves speculatively."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from openflash.checkpoint import load_checkpoint, save_checkpoint
from openflash.config import load_config
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.sampling import SamplingParams
from openflash.model.transformer import Transformer
from openflash.runtime.runtime import Runtime
from openflash.tokenizer import preset_tokenizer
from openflash.train.prepare import prepare_dataset
from openflash.train.tokenizer import stdlib_source_dir

pytestmark = pytest.mark.usefixtures("one_thread")


def test_train_drafter_from_the_cli(tmp_path):
    cfg = load_config("tiny")
    tok_path = tmp_path / "tokenizer.json"
    tok_path.write_text(preset_tokenizer(cfg).to_str())
    sources = [stdlib_source_dir() / f for f in ("textwrap.py", "string.py", "glob.py", "fnmatch.py")]
    prepare_dataset([str(s) for s in sources], str(tok_path), str(tmp_path / "data"))
    torch.manual_seed(0)
    save_checkpoint(Transformer(cfg), tmp_path / "base", tokenizer_json=tok_path)
    out = subprocess.run([sys.executable, "-m", "openflash.cli", "train", "--dspark", "--init", str(tmp_path / "base"),
                          "--data", str(tmp_path / "data"), "--out", str(tmp_path / "drafted"), "--steps", "30",
                          "--batch-size", "4", "--seq-len", "64", "--anchors", "8", "--device", "cpu"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "drafter trained 30 steps" in out.stdout
    history = json.loads((tmp_path / "drafted" / "drafter_train.json").read_text())["history"]
    first, last = (sum(r["loss"] for r in part) / len(part) for part in (history[:5], history[-5:]))
    assert last < 0.95 * first, (first, last)
    model, _ = load_checkpoint(tmp_path / "drafted")
    base, _ = load_checkpoint(tmp_path / "base")
    assert model.cfg.dspark is not None and len(model.mtp) == 3
    drafted_state, base_state = model.state_dict(), base.state_dict()
    assert all(torch.equal(drafted_state[k], v) for k, v in base_state.items())  # the backbone did not move
    tok = preset_tokenizer(cfg)
    prompts = [tok.encode("def wrap(text, width):").ids, tok.encode("import glob\n").ids]
    params = SamplingParams(max_tokens=20)
    rt = Runtime.of(model, tok)
    plain = LLMEngine(rt, EngineConfig(max_batch=2)).generate(prompts, params, ignore_eos=True)
    engine = LLMEngine(rt, EngineConfig(max_batch=2, speculative="dspark"))
    spec = engine.generate(prompts, params, ignore_eos=True)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert engine.metrics.spec_rounds > 0
    bad = subprocess.run([sys.executable, "-m", "openflash.cli", "train", "--dspark", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--dspark needs --init" in bad.stderr
    gen = [sys.executable, "-m", "openflash.cli", "generate", "--model", str(tmp_path / "drafted"), "--prompt",
           "def wrap(text):", "--max-tokens", "12", "--speculative", "dspark"]
    out = subprocess.run(gen, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "12 generated" in out.stdout and "tokens per verification" in out.stdout, out.stderr
    out = subprocess.run(gen + ["--num-speculative-tokens", "9"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "num_speculative_tokens must be in 1..5" in out.stderr
    assert "Traceback" not in out.stderr
