"""Where a model runs, as one value: the device, the weights' residency, the routed experts' tier and the Engram
tables' tier. The command line (or a plan.json from `openflash plan --memory`) builds it once (`from_args`) and
`open_model` (runtime/open.py) places the runtime by it.

On an accelerator the Engram tables stay in host memory by default (spec: engram.md §5; the tables are most of the
parameters, their rows are addressed by token ids alone, so a step's rows are gathered on the host and copied ahead
while the layers before them run): `engram="auto"` means the host tier next to a CUDA device for a model whose tables
are stored as FP8 rows (the released format), and the model's own memory otherwise (the CPU, or fp32 tables trained
here, which the host tier would round to FP8).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openflash.errors import OpenflashError

if TYPE_CHECKING:  # torch is imported where a device is resolved: the command line parses without it
    import torch

DEVICE_HELP = ("where the model runs: auto (the first CUDA device if there is one, under torchrun the rank's own "
               "LOCAL_RANK; else the CPU), cpu, cuda or cuda:N")
ENGRAM_TIERS = ("auto", "device", "host", "disk")
EXPERT_TIERS = ("device", "host", "disk")


def local_rank() -> int:
    """This process's rank on its machine under torchrun (0 outside it)."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise OpenflashError(f"LOCAL_RANK={os.environ['LOCAL_RANK']!r} is not an integer") from None


def resolve_device(spec: str | torch.device) -> torch.device:
    """A --device value as a concrete torch.device; a one-line error for one that is not there."""
    import torch

    if isinstance(spec, torch.device):
        spec = str(spec)
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank() % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise OpenflashError(f"--device {spec!r}: not a device ({DEVICE_HELP})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise OpenflashError(f"--device {spec!r}: openflash runs on the CPU or on CUDA devices")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise OpenflashError(f"--device {spec}: no CUDA device is visible here (torch {torch.__version__}, {build}); "
                             f"use --device cpu, or install the PyTorch build for this machine's CUDA")
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else local_rank() % count
    if index >= count:
        raise OpenflashError(f"--device {spec}: this machine has {count} CUDA device(s) (0..{count - 1})")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class Placement:
    """Where each part of a model goes (see the module doc). Sizes are bytes; 0 means no limit."""

    device: str = "auto"
    weights: str = "auto"  # auto | dequantized | stored (checkpoint.load_checkpoint)
    experts: str = "device"  # device (in the model) | host | disk (memory/experts.py)
    expert_cache_bytes: int = 0
    expert_prefetch: bool = False
    expert_direct_io: bool = False
    engram: str = "auto"  # auto | device | host | disk (memory/tables.py)
    engram_table_dir: str | None = None  # disk: table files from `openflash engram export`
    engram_cache_bytes: int = 0  # disk: row cache per table (0: the runtime's default)
    engram_io_threads: int = 4
    compile: bool = False  # the compiled backend (decode steps as one graph; on CUDA a replayed CUDA graph)

    def __post_init__(self) -> None:
        if self.engram not in ENGRAM_TIERS:
            raise OpenflashError(f"Engram placement must be one of {list(ENGRAM_TIERS)}, got {self.engram!r}")
        if self.experts not in EXPERT_TIERS:
            raise OpenflashError(f"expert placement must be one of {list(EXPERT_TIERS)}, got {self.experts!r}")
        for name in ("expert_cache_bytes", "engram_cache_bytes"):
            if getattr(self, name) < 0:
                raise OpenflashError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.engram_io_threads < 1:
            raise OpenflashError(f"--engram-io-threads must be >= 1, got {self.engram_io_threads}")

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def engram_tier(self, fp8_tables: bool) -> str:
        """The Engram tier `auto` stands for here (module doc); fp8_tables: the model stores FP8 rows."""
        if self.engram != "auto":
            return self.engram
        return "host" if self.torch_device.type == "cuda" and fp8_tables else "device"

    def with_(self, **changes: Any) -> "Placement":
        return replace(self, **changes)

    @classmethod
    def from_args(cls, args: Any) -> "Placement":
        """The placement flags a command declares (cli.py `_placement_flags`; a command lacking one gets the
        default), or the settings of --placement plan.json, which may not be given together with them."""
        given = {f.name: getattr(args, _FLAGS.get(f.name, f.name)) for f in fields(cls)
                 if hasattr(args, _FLAGS.get(f.name, f.name))}
        plan = getattr(args, "placement", None)
        if plan is not None:
            clash = [k for k in _FROM_PLAN if k in given and given[k] != getattr(cls, k)]
            if clash:
                flags = ", ".join("--" + _FLAGS.get(k, k).replace("_", "-") for k in clash)
                raise OpenflashError(f"--placement {plan} sets {flags}; give one or the other")
            settings = read_placement(plan)
            given.update({k: settings[_FLAGS.get(k, k)] for k in _FROM_PLAN})
        return cls(**given)


# Placement field -> the command-line flag's dest where they differ; and what a plan.json sets.
_FLAGS = {"experts": "expert_placement", "engram": "engram_placement"}
_FROM_PLAN = ("weights", "experts", "expert_cache_bytes", "engram", "engram_cache_bytes")
PLACEMENT_KEYS = tuple(_FLAGS.get(k, k) for k in _FROM_PLAN)  # a plan.json's "run" keys (tools/placement_plan.py)


def read_placement(path: str | Path) -> dict[str, Any]:
    """The run settings of a plan.json (`--placement`, written by `openflash plan --out`); OpenflashError naming
    the file and the missing keys."""
    path = Path(path)
    try:
        run = json.loads(path.read_text())["run"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OpenflashError(f"{path}: not a placement written by `openflash plan --out` ({exc})") from None
    missing = [k for k in PLACEMENT_KEYS if k not in run]
    if missing:
        raise OpenflashError(f"{path}: placement lacks {missing}")
    return {k: run[k] for k in PLACEMENT_KEYS}


__all__ = ["Placement", "read_placement", "PLACEMENT_KEYS", "resolve_device", "local_rank", "DEVICE_HELP", "ENGRAM_TIERS", "EXPERT_TIERS"]
