"""`openflash experiment NAME... | all`: train the studies' runs (cached) and write their results and plots."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from openflash.experiments import STUDY_NAMES, resolve_scale, run_experiments
from openflash.train.distributed import init_from_env


def experiment(args: argparse.Namespace) -> int:
    names = list(STUDY_NAMES) if args.names == ["all"] else list(dict.fromkeys(args.names))
    scale = resolve_scale(args.scale, args.seeds)
    command = "openflash " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    ctx = init_from_env()
    start = time.perf_counter()
    try:
        run_experiments(names, scale, Path(args.out), Path(args.results), jobs=args.jobs, command=command)
    finally:
        if ctx.enabled:
            torch.distributed.destroy_process_group()
    if ctx.is_main:
        print(f"done in {(time.perf_counter() - start) / 60:.1f} min; results in {args.results}/")
    return 0
