"""`openflash rl`: GRPO with verifiable rewards on a LoRA adapter (rl/).

The handler takes the parsed arguments and returns an exit code (cli.py declares the arguments)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields

from openflash.rl.config import RLConfig
from openflash.rl.trainer import RLTrainer


def rl(args: argparse.Namespace) -> int:
    """`openflash rl --init MODEL --lora R --tasks TASKS.jsonl --reward exact|tests|MODULE:FUNCTION --out RUN`."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    names = {f.name for f in fields(RLConfig)}
    cfg = RLConfig(**{k: v for k, v in vars(args).items() if k in names})
    trainer = RLTrainer(cfg)
    result = trainer.fit()
    before, after = result["eval_before"], result["eval_after"]
    if after is not None:
        was = f"{before['eval_solved']:.3f} -> " if before is not None else ""
        print(f"held-out tasks solved: {was}{after['eval_solved']:.3f} ({after['eval_tasks']} tasks)")
    print(f"step {result['step']}: adapter {result['checkpoint']} (PEFT layout); serve it with: openflash serve "
          f"--model {cfg.init} --lora NAME={cfg.out}")
    if result["step"] < cfg.steps:
        print(f"resume with: openflash rl --resume (the same arguments) --out {cfg.out}")
    return 0
