"""The layout of a training run folder, read by training (resume) and by inference (a run means its latest
checkpoint):

    RUN/config.json, train_args.json, metrics.jsonl, tensorboard/ (event files: files/metric_sinks.py)
    RUN/checkpoints/step_00000200/   config.json, model.safetensors, tokenizer.json, trainer_state.pt,
                                     checksums.sha256 (a complete checkpoint: it appears by one rename)
    RUN/checkpoints/.tmp_step_*      a save that did not finish (removed at the next start)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from openflash.errors import OpenflashError
from openflash.files.atomic import write_json_atomic, write_text_atomic
from openflash.files.metric_sinks import TensorBoardSink
from openflash.files.shards import INDEX_FILE, SINGLE_FILE

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


@dataclass
class RunFolder:
    """The files of one training run: where it resumes from, its arguments, its metrics log (and the sinks of
    `log_to`: files/metric_sinks.py, charted under `group`) and its checkpoints (written by rank 0 only:
    `is_main`)."""

    path: Path
    is_main: bool = True
    log_to: tuple[str, ...] = ()
    group: str = "train"
    sinks: list[TensorBoardSink] = field(default_factory=list, repr=False)

    def resume_point(self, resume: bool) -> Path | None:
        """The checkpoint to continue from (None: a new run), after clearing saves that did not finish."""
        if self.is_main:
            remove_partial_checkpoints(self.path)
        latest = latest_checkpoint(self.path)
        if resume and latest is None:
            raise OpenflashError(f"--resume: no checkpoint in {self.path / CHECKPOINTS_DIR} (start without "
                                 f"--resume to begin a new run)")
        if not resume and latest is not None:
            raise OpenflashError(f"{self.path} already holds checkpoints (latest {latest.name}); pass --resume to "
                                 f"continue it, or choose a new --out folder")
        return latest if resume else None

    def check_resume_args(self, args: dict[str, Any], fixed: tuple[str, ...]) -> None:
        """A resumed run must share the `fixed` arguments with the run it continues."""
        path = self.path / ARGS_FILE
        if not path.is_file():
            return
        try:
            recorded = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise OpenflashError(f"{path}: unreadable ({exc})") from exc
        diffs = [f"{k} (run: {recorded.get(k)!r}, now: {args.get(k)!r})" for k in fixed if recorded.get(k) != args.get(k)]
        if diffs:
            raise OpenflashError(f"--resume with different arguments than the run in {self.path}: {'; '.join(diffs)}")

    def start(self, config_json: str | None, step: int, args: dict[str, Any], event: dict[str, Any]) -> None:
        """Begin (config_json: the model config to record) or resume (None: drop metric lines past `step`)."""
        self.path.mkdir(parents=True, exist_ok=True)
        metrics = self.path / METRICS_FILE
        if config_json is not None:
            write_text_atomic(self.path / "config.json", config_json)
            metrics.write_text("")
        else:
            truncate_metrics(metrics, step)
        write_json_atomic(self.path / ARGS_FILE, args)
        self.close()
        if "tensorboard" in self.log_to:
            self.sinks.append(TensorBoardSink(self.path, self.group, None if config_json is not None else step))
        self.append_metrics(event)

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.path / METRICS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        """Close the sinks (a run that ends; start() opens them again)."""
        for sink in self.sinks:
            sink.close()
        self.sinks.clear()

    def save(self, step: int, write: Callable[[Path], None], keep: int) -> Path:
        """Checkpoint `step`: `write(folder)` fills a temporary folder, which then appears by one rename; only the
        newest `keep` checkpoints stay."""
        root = self.path / CHECKPOINTS_DIR
        final = root / f"step_{step:08d}"
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp_step_{step:08d}_{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        write(tmp)
        if final.exists():  # a stale copy of this step (e.g. from a run that was resumed earlier)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in checkpoint_dirs(self.path)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final
