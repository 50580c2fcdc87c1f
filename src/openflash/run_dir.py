"""The layout of a training run folder, read by training (resume) and by inference (a run means its latest
checkpoint):

    RUN/config.json, train_args.json, metrics.jsonl
    RUN/checkpoints/step_00000200/   config.json, model.safetensors, tokenizer.json, trainer_state.pt,
                                     checksums.sha256 (a complete checkpoint: it appears by one rename)
    RUN/checkpoints/.tmp_step_*      a save that did not finish (removed at the next start)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from openflash.errors import OpenflashError
from openflash.shards import INDEX_FILE, SINGLE_FILE

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "trainer_state.pt"
ARGS_FILE = "train_args.json"

log = logging.getLogger("openflash.train")


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def remove_partial_checkpoints(run_dir: str | Path) -> list[Path]:
    """Delete the `.tmp_step_*` folders a save killed mid-write left behind (never read: a checkpoint becomes
    visible only by its final rename); returns what was removed."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    removed = sorted(root.glob(".tmp_step_*")) if root.is_dir() else []
    for partial in removed:
        log.info("removing %s, left by a checkpoint save that did not finish", partial)
        shutil.rmtree(partial, ignore_errors=True)
    return removed


def read_checkpoint_weights(checkpoint: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights of a training checkpoint, checked against the model its config.json builds; every problem is
    an OpenflashError naming the file."""
    if (checkpoint / INDEX_FILE).exists():
        raise OpenflashError(f"{checkpoint}: sharded training checkpoints are not supported")
    path = checkpoint / SINGLE_FILE
    if not path.is_file():
        raise OpenflashError(f"{path} is missing: the checkpoint is incomplete")
    try:
        weights = load_file(str(path))
    except Exception as exc:  # safetensors raises its own types for a damaged header or short file
        raise OpenflashError(f"{path}: unreadable safetensors file ({exc})") from None
    problems = [f"missing {n}" for n in expected if n not in weights]
    problems += [f"unexpected {n}" for n in weights if n not in expected]
    problems += [f"{n} has shape {list(t.shape)}, config.json gives {list(expected[n].shape)}"
                 for n, t in weights.items() if n in expected and t.shape != expected[n].shape]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise OpenflashError(f"{path}: weights do not match {checkpoint / 'config.json'}: "
                             f"{'; '.join(problems[:3])}{more}")
    return weights


def read_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    path = Path(checkpoint) / STATE_FILE
    if not path.is_file():
        raise OpenflashError(f"{path} is missing: not a training checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged pickle / zip
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OpenflashError(f"{path}: unreadable trainer state ({first})") from None


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines past `step` (written after the checkpoint a resumed run continues from)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
            continue
        kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
    os.replace(tmp, path)
