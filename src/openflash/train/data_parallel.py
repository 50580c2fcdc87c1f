"""Data-parallel training without torchrun: `fit_data_parallel` spawns local gloo processes, as torchrun would
(tests and quick comparisons; `openflash train` under torchrun is the production path)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from openflash.train.distributed import DistContext
from openflash.train.trainer import TrainConfig, Trainer


def reduced_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The gradients the last optimizer step used (averaged over the ranks, clipped), by parameter name; whole
    when the run is sharded (a collective then: every rank calls it)."""
    return {n: (p.grad.full_tensor() if trainer.sharded else p.grad).detach().clone()
            for n, p in trainer.model.named_parameters() if p.grad is not None}


def _spawned_fit(ctx: DistContext, cfg_dict: dict[str, Any], records_path: str, grads_path: str | None) -> None:
    records: list[dict[str, Any]] = []

    def on_step(trainer: Trainer, record: dict[str, Any]) -> None:
        records.append(record)
        if grads_path is not None and record["step"] == 1:
            grads = reduced_gradients(trainer)
            if ctx.is_main:
                torch.save(grads, grads_path)

    result = Trainer(TrainConfig(**cfg_dict), ctx, on_step=on_step).fit()
    if ctx.is_main:
        Path(records_path).write_text(json.dumps({"records": records, "step": result.step,
                                                  "stopped_by": result.stopped_by,
                                                  "val_loss": result.val_loss}))


def fit_data_parallel(cfg: TrainConfig, world_size: int, threads_per_rank: int = 1,
                      first_step_grads: str | Path | None = None) -> dict[str, Any]:
    """Train `cfg` with `world_size` local processes (gloo on 127.0.0.1), as torchrun would; returns rank 0's
    per-step records and final step. `first_step_grads`: a file to save the first step's reduced gradients to
    (`reduced_gradients`), for comparing data parallel with one process."""
    from openflash.train.distributed import spawn

    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    records_path = Path(cfg.out) / f".spawn_records_{os.getpid()}.json"
    grads_path = None if first_step_grads is None else str(first_step_grads)
    try:
        spawn(_spawned_fit, world_size, asdict(cfg), str(records_path), grads_path,
              threads_per_rank=threads_per_rank)
        return json.loads(records_path.read_text())
    finally:
        records_path.unlink(missing_ok=True)


__all__ = ["fit_data_parallel", "reduced_gradients"]
