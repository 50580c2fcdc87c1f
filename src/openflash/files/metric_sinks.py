"""Where a run's metric lines go besides metrics.jsonl (files/run_dir.py): TensorBoard event files in
RUN/tensorboard/, which `tensorboard --logdir RUN` charts live, several runs side by side, and which Weights &
Biases imports as they are (`wandb sync --sync-tensorboard RUN/tensorboard`).

Every numeric field of a line with a step becomes a scalar: a training run's under "train/", an RL run's under
"rl/", validation and held-out evaluation fields ("val_*", "eval_*") under "eval/". Lines without a step (the start
and resume events) stay in metrics.jsonl only.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"
LOG_TARGETS = ("tensorboard", "none")


def parse_log_to(text: str) -> tuple[str, ...]:
    """`--log-to tensorboard` (the default) or `none` (metrics.jsonl alone), for argparse."""
    items = sorted({t.strip() for t in text.split(",") if t.strip()})
    if "wandb" in items:
        raise argparse.ArgumentTypeError("wandb is not written directly: W&B imports the TensorBoard files as they "
                                         "are (wandb sync --sync-tensorboard RUN/tensorboard)")
    bad = [t for t in items if t not in LOG_TARGETS]
    if bad or not items or ("none" in items and len(items) > 1):
        raise argparse.ArgumentTypeError(f"expected tensorboard or none, got {text!r}")
    return () if items == ["none"] else tuple(items)


class TensorBoardSink:
    """One run's event files; each line is flushed as it is written, so a crash loses nothing charted."""

    def __init__(self, run: Path, group: str, resume_step: int | None) -> None:
        """resume_step: a resumed run's step (the events of later steps, from before the resume, are dropped as
        its metrics.jsonl lines are); None: a new run (earlier event files in the folder are removed)."""
        from torch.utils.tensorboard import SummaryWriter

        folder = run / TENSORBOARD_DIR
        if resume_step is None and folder.exists():
            shutil.rmtree(folder)
        self.group = group
        self.writer = SummaryWriter(str(folder), purge_step=None if resume_step is None else resume_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            group = "eval" if key.startswith(("val_", "eval_")) else self.group
            self.writer.add_scalar(f"{group}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


__all__ = ["TensorBoardSink", "parse_log_to", "LOG_TARGETS", "TENSORBOARD_DIR"]
