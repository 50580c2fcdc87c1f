"""Curves of a run: `run_dir/metrics.jsonl` -> PNG.

metrics.jsonl holds one JSON object per line. A training run's lines carry `step` and `loss` (plus lr,
tokens_per_s), its evaluation lines `step` and `val_loss`: drawn as loss.png. An RL run's (`openflash rl`) carry
`reward_mean` and, for the held-out tasks, `eval_solved`: drawn as reward.png. Other lines are ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from openflash.errors import OpenflashError

METRICS_FILE = "metrics.jsonl"


@dataclass
class LossCurves:
    train_steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    reward_steps: list[int] = field(default_factory=list)  # an RL run: the rollouts' mean reward per step
    reward: list[float] = field(default_factory=list)
    solved_steps: list[int] = field(default_factory=list)  # and the held-out tasks' solved share
    solved: list[float] = field(default_factory=list)

    @property
    def rl(self) -> bool:
        return bool(self.reward or self.solved) and not (self.train_loss or self.val_loss)


def read_metrics(path: Path) -> LossCurves:
    """Parse metrics.jsonl; errors name the file and line number."""
    if not path.is_file():
        raise OpenflashError(f"metrics file not found: {path}")
    curves = LossCurves()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise OpenflashError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise OpenflashError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            for key, steps, values in (("loss", curves.train_steps, curves.train_loss),
                                       ("val_loss", curves.val_steps, curves.val_loss),
                                       ("reward_mean", curves.reward_steps, curves.reward),
                                       ("eval_solved", curves.solved_steps, curves.solved)):
                if key not in record:
                    continue
                step, value = record.get("step"), record[key]
                if not isinstance(step, int) or isinstance(step, bool):
                    raise OpenflashError(f"{path}:{number}: '{key}' line needs an integer 'step', got {step!r}")
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise OpenflashError(f"{path}:{number}: '{key}' must be a number, got {value!r}")
                steps.append(step)
                values.append(float(value))
    if not (curves.train_loss or curves.val_loss or curves.reward or curves.solved):
        raise OpenflashError(f"{path} has no loss lines (no 'loss' or 'val_loss' values) and no reward lines (no "
                             f"'reward_mean' or 'eval_solved')")
    return curves


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw train and validation loss against step (an RL run: reward and held-out solved share); returns the PNG
    path (default RUN_DIR/loss.png, or reward.png)."""
    # The object-oriented Figure API with the Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    curves = read_metrics(run_dir / METRICS_FILE)
    out = Path(out) if out is not None else run_dir / ("reward.png" if curves.rl else "loss.png")
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if curves.rl:
        return _draw_reward(fig, ax, curves, run_dir, out)
    if curves.train_loss:
        ax.plot(curves.train_steps, curves.train_loss, color="tab:blue", linewidth=1.0, alpha=0.8, label="train")
    if curves.val_loss:
        ax.plot(curves.val_steps, curves.val_loss, color="tab:orange", linewidth=1.5, marker="o", markersize=3,
                label="validation")
    finite = [v for v in curves.train_loss + curves.val_loss if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        ax.set_yscale("log")  # early losses (~ln vocab) dwarf late ones
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{run_dir.resolve().name}: loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _draw_reward(fig, ax, curves: LossCurves, run_dir: Path, out: Path) -> Path:
    if curves.reward:
        ax.plot(curves.reward_steps, curves.reward, color="tab:blue", linewidth=1.0, alpha=0.8,
                label="rollouts' mean reward")
    if curves.solved:
        ax.plot(curves.solved_steps, curves.solved, color="tab:green", linewidth=1.5, marker="o", markersize=3,
                label="held-out tasks solved")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / solved share")
    ax.set_title(f"{run_dir.resolve().name}: reward")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
