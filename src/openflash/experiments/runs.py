"""The studies' data and training runs, cached by what determines them, and a sweep that runs several at once.

    out/data/                  stdlib source -> BPE tokenizer -> token shards (the same for every run of a scale)
    out/runs/ARM-sSEED-KEY/    one training run: config.json, train/ (the Trainer's run folder, checkpoints every
                               `save_every` steps), result.json once finished

KEY hashes the model config, the training arguments and the data manifest, so a changed scale or arm never
reuses a stale run. A killed sweep continues where it stopped: finished runs are read from result.json, a run
cut short resumes from its latest checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Callable

from openflash.config import FlashConfig
from openflash.errors import OpenflashError
from openflash.experiments.scale import Scale

RESULT_FILE = "result.json"
SAVE_EVERY = 100


@dataclass(frozen=True)
class StudyData:
    data_dir: Path
    tokenizer_path: Path
    vocab_size: int  # the tokenizer's, with its added tokens
    fingerprint: str  # of the token shards' manifest


def prepare_data(out: Path, scale: Scale, say: Callable[[str], None] = print) -> StudyData:
    """Tokenizer and token shards of the scale's corpus (Python stdlib source), built once under out/data."""
    from openflash.tools.demo import select_corpus
    from openflash.tokenizer import load_tokenizer
    from openflash.train.prepare import prepare_dataset
    from openflash.train.tokenizer import stdlib_source_dir, train_bpe_tokenizer

    root = out / "data"
    root.mkdir(parents=True, exist_ok=True)
    files = select_corpus(stdlib_source_dir(), scale.corpus_bytes, ("*.py",))
    tok_path = root / "tokenizer.json"
    if not tok_path.is_file():
        train_bpe_tokenizer(files, scale.vocab_size, tok_path, max_bytes=scale.tokenizer_bytes)
    data_dir = root / "tokens"
    manifest = prepare_dataset(files, tok_path, data_dir, val_fraction=0.05 if len(files) >= 40 else 0.25,
                               patterns=("*.py",), progress=False)
    say(f"data: {len(files)} stdlib files, {manifest.splits['train'].num_tokens:,} train / "
        f"{manifest.splits['val'].num_tokens:,} validation tokens ({data_dir})")
    fingerprint = hashlib.sha256((data_dir / "manifest.json").read_bytes()).hexdigest()[:16]
    vocab = load_tokenizer(tok_path).get_vocab_size(with_added_tokens=True)
    return StudyData(data_dir, tok_path, vocab, fingerprint)


@dataclass(frozen=True, eq=False)  # compared by identity: a study keys its results by its own specs
class RunSpec:
    arm: str
    seed: int
    config: FlashConfig
    scale: Scale
    data: StudyData

    def train_args(self) -> dict:
        s = self.scale
        return {"steps": s.steps, "batch_size": s.batch_size, "seq_len": s.seq_len, "lr": s.lr, "warmup": s.warmup,
                "eval_batches": s.eval_batches, "seed": self.seed}

    @property
    def key(self) -> str:
        text = json.dumps({"config": self.config.to_hf_dict(), "train": self.train_args(),
                           "data": self.data.fingerprint}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def folder(self, out: Path) -> Path:
        return out / "runs" / f"{self.arm}-s{self.seed}-{self.key}"


def read_result(spec: RunSpec, out: Path) -> dict | None:
    path = spec.folder(out) / RESULT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def train_run(spec: RunSpec, out: Path, threads: int) -> dict:
    """Train one run (or finish it from its latest checkpoint) and write its result.json."""
    import torch

    from openflash.files.run_dir import latest_checkpoint
    from openflash.train.distributed import DistContext
    from openflash.train.trainer import TrainConfig, Trainer

    done = read_result(spec, out)
    if done is not None:
        return done
    torch.set_num_threads(threads)
    folder = spec.folder(out)
    ctx = DistContext.current()  # under torchrun every rank trains the run (data parallel); rank 0 writes
    if ctx.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        spec.config.save(folder / "config.json")
    ctx.barrier()
    train_dir = folder / "train"
    a = spec.train_args()
    cfg = TrainConfig(data=str(spec.data.data_dir), out=str(train_dir), config=str(folder / "config.json"),
                      steps=a["steps"], batch_size=a["batch_size"], seq_len=a["seq_len"], lr=a["lr"],
                      warmup=a["warmup"], eval_every=max(1, a["steps"] // 6), eval_batches=a["eval_batches"],
                      save_every=SAVE_EVERY, seed=a["seed"], resume=latest_checkpoint(train_dir) is not None,
                      progress=False)
    trainer = Trainer(cfg, ctx)
    fit = trainer.fit()
    if fit.stopped_by == "interrupt":
        raise OpenflashError(f"{folder}: interrupted at step {fit.step}; run the study again to continue")
    result = {"arm": spec.arm, "seed": spec.seed, "key": spec.key, "val_loss": fit.val_loss,
              "params": sum(p.numel() for p in trainer.model.parameters()), "steps": fit.step,
              "tokens": fit.step * a["batch_size"] * a["seq_len"], "seconds": round(fit.trained_seconds, 1),
              "threads": threads, "world_size": ctx.world_size, "checkpoint": str(fit.checkpoint.relative_to(out))}
    if ctx.is_main:
        # A run killed between an evaluation and its next checkpoint logs that evaluation again when it resumes.
        evals = {r["step"]: r["val_loss"] for line in (train_dir / "metrics.jsonl").read_text().splitlines()
                 if "val_loss" in (r := json.loads(line))}
        result["val_curve"] = sorted(evals.items())
        tmp = folder / (RESULT_FILE + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(folder / RESULT_FILE)
    ctx.barrier()
    return result


def run_all(specs: list[RunSpec], out: Path, jobs: int, say: Callable[[str], None] = print) -> dict[RunSpec, dict]:
    """Every run's result: cached ones read, the others trained, `jobs` at a time (each with its share of the
    cores; one process per run, so runs never share a thread pool)."""
    results = {s: r for s in specs if (r := read_result(s, out)) is not None}
    todo = [s for s in dict.fromkeys(specs) if s not in results]
    if results:
        say(f"runs: {len(results)} cached, {len(todo)} to train")
    if not todo:
        return results
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    if jobs <= 1:
        for i, spec in enumerate(todo, 1):
            results[spec] = train_run(spec, out, threads)
            _report(say, i, len(todo), results[spec])
        return results
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(train_run, spec, out, threads): spec for spec in todo}
        for i, future in enumerate(as_completed(futures), 1):
            results[futures[future]] = future.result()
            _report(say, i, len(todo), results[futures[future]])
    return results


def _report(say: Callable[[str], None], i: int, n: int, result: dict) -> None:
    say(f"  [{i}/{n}] {result['arm']} seed {result['seed']}: val loss {result['val_loss']:.4f} "
        f"({result['steps']} steps, {result['seconds']:.0f} s)")
