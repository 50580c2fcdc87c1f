"""`openflash data prepare`, `tokenizer train`, `train`, `plot` and `demo`: the training side.

Each handler takes the parsed arguments and returns an exit code (cli.py declares the arguments)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path

import torch

from openflash.errors import OpenflashError
from openflash.runtime.placement import resolve_device
from openflash.tools.demo import DemoConfig, run_demo
from openflash.train.distributed import init_from_env
from openflash.train.plot import plot_run
from openflash.train.prepare import prepare_dataset
from openflash.train.tokenizer import iter_text_files, parse_patterns, train_bpe_tokenizer
from openflash.train.trainer import TrainConfig, Trainer


def train_dspark(args: argparse.Namespace) -> int:
    """`openflash train --dspark --init RUN --out DIR [--steps N] [--data D] ...`."""
    import logging

    from openflash.train.dspark import DraftTrainConfig, train_drafter

    if args.init is None:
        raise OpenflashError("--dspark needs --init RUN (the trained model to draft for)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = DraftTrainConfig(init=args.init, out=args.out, data=args.data, steps=args.steps, batch_size=args.batch_size,
                           seq_len=args.seq_len, anchors=args.anchors, lr=args.lr, seed=args.seed,
                           max_minutes=args.max_minutes, device=args.device)
    summary = train_drafter(cfg)
    first, last = summary["first"], summary["last"]
    print(f"drafter trained {summary['steps']} steps: loss {first['loss']:.3f} -> {last['loss']:.3f}, greedy "
          f"agreement {first['greedy_agreement']:.2f} -> {last['greedy_agreement']:.2f}; model with drafter: "
          f"{args.out}")
    return 0


def train_vision_pairs(args: argparse.Namespace) -> int:
    """`openflash train --vision-data PAIRS.jsonl --init M --out DIR [--steps N] [--batch-size B] ...`."""
    import logging

    from openflash.train.vision import VLTrainConfig, train_vision

    if args.init is None:
        raise OpenflashError("--vision-data needs --init (a preset such as tiny-vl, a checkpoint or a run folder)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    summary = train_vision(VLTrainConfig(data=args.vision_data, init=args.init, out=args.out, steps=args.steps,
                                         batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                                         freeze_vision=args.freeze_vision, seed=args.seed,
                                         max_minutes=args.max_minutes, device=args.device))
    print(f"vision fine-tune: {summary['examples']} examples, {summary['steps']} steps, loss "
          f"{summary['first']['loss']:.3f} -> {summary['last']['loss']:.3f}; model: {args.out}")
    return 0


def data_prepare(args: argparse.Namespace) -> int:
    """`openflash data prepare SOURCES... --tokenizer T --out DIR [--val-fraction F] [--glob G] [--seed S]`, or
    with `--chats`, JSONL conversations rendered with the chat template, trained on the replies only; with
    `--dataset`, the sources are Hugging Face datasets (their --text-field, or with --chats their
    --messages-field)."""
    defaults = {"split": "train", "text_field": "text", "messages_field": "messages"}
    changed = [k for k, v in defaults.items() if getattr(args, k) != v]
    if changed and not args.dataset:
        raise OpenflashError(f"--{changed[0].replace('_', '-')} reads Hugging Face datasets: add --dataset")
    if args.chats:
        from openflash.train.chats import prepare_chats

        prepare_chats(args.sources, args.tokenizer, args.out, val_fraction=args.val_fraction, seed=args.seed,
                      template=args.chat_template, dataset_split=args.split if args.dataset else None,
                      messages_field=args.messages_field)
        return 0
    if args.dataset:
        from openflash.train.prepare_rows import prepare_rows

        prepare_rows(args.sources, args.tokenizer, args.out, split=args.split, text_field=args.text_field,
                     val_fraction=args.val_fraction, seed=args.seed)
        return 0
    prepare_dataset(args.sources, args.tokenizer, args.out, val_fraction=args.val_fraction,
                    patterns=parse_patterns(args.glob), seed=args.seed)
    return 0


def tokenizer_train(args: argparse.Namespace) -> int:
    """`openflash tokenizer train SOURCES... --vocab-size N --out tokenizer.json [--glob ...]`."""
    files = list(iter_text_files(args.sources, parse_patterns(args.glob)))
    if not files:
        raise OpenflashError(f"no files matching {args.glob} under {', '.join(map(str, args.sources))}")
    start = time.perf_counter()
    tokenizer = train_bpe_tokenizer(files, args.vocab_size, Path(args.out))
    seconds = time.perf_counter() - start
    print(f"trained byte-level BPE on {len(files)} files: vocab size {tokenizer.get_vocab_size(with_added_tokens=True)}"
          f" in {seconds:.1f} s -> {args.out}")
    return 0


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    return TrainConfig(**values)


def train(args: argparse.Namespace) -> int:
    """`openflash train --data DIR --out RUN [--init MODEL] [...]` (also under torchrun: data parallel over the
    ranks; --init fine-tunes a checkpoint), or `openflash train --dspark --init RUN --out DIR`: a drafter for a
    trained model."""
    if args.dspark and args.vision_data:
        raise OpenflashError("--dspark and --vision-data are separate runs; give one")
    if args.compile and (args.dspark or args.vision_data):
        raise OpenflashError("--compile compiles the main model's training (openflash train --data ...); "
                             "--dspark and --vision-data run eagerly")
    if args.lora is not None and (args.dspark or args.vision_data):
        raise OpenflashError("--lora trains adapters on text or chats (openflash train --data ... --init MODEL)")
    if args.dspark or args.vision_data:
        resolve_device(args.device)  # a device that is not there: one line, before the model loads
    if args.dspark:
        return train_dspark(args)
    if args.vision_data:
        return train_vision_pairs(args)
    if args.data is None:
        raise OpenflashError("--data is required (a folder written by `openflash data prepare`)")
    cfg = config_from_args(args)
    ctx = init_from_env(resolve_device(args.device))
    try:
        result = Trainer(cfg, ctx).fit()
    finally:
        if ctx.enabled:
            torch.distributed.destroy_process_group()
    if ctx.is_main and result.stopped_by == "interrupt":
        print(f"resume with: openflash train --data {cfg.data} --out {cfg.out} --resume")
    elif ctx.is_main and cfg.lora is not None and result.checkpoint is not None:
        print(f"adapter: {result.checkpoint} (PEFT layout); serve it with: openflash serve --model {cfg.init} "
              f"--lora NAME={cfg.out}")
    return 0


def plot(args: argparse.Namespace) -> int:
    """`openflash plot RUN_DIR [--out PNG]`."""
    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def demo(args: argparse.Namespace) -> int:
    """`openflash demo [--preset small|tiny] [--minutes 10] [--run-dir runs/demo] [--corpus DIR]`."""
    if not args.minutes > 0:
        raise OpenflashError(f"--minutes must be positive, got {args.minutes}")
    cfg = DemoConfig(preset=args.preset, minutes=args.minutes, run_dir=Path(args.run_dir),
                     corpus=Path(args.corpus) if args.corpus else None)
    start = time.perf_counter()
    summary = run_demo(cfg)
    (Path(cfg.run_dir) / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min; summary in {cfg.run_dir}/demo_summary.json, "
          f"loss curve: openflash plot {cfg.run_dir}/train")
    return 0
