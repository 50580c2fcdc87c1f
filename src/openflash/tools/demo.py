"""`openflash demo`: train a small V4.1-Flash model on Python source code, then let it write some.

Stages, each cached in the run folder (a second run skips what is done):

    1. corpus      a subset of the Python standard library source (or --corpus), picked deterministically
    2. tokenizer   run/tokenizer.json: byte-level BPE, 4096 ids
    3. dataset     run/data/: token shards (`openflash data prepare`)
    4. training    run/train/: time-bounded; the step count is what fits in --minutes (measured on the first
                   steps). A later run with a larger --minutes continues the run from its checkpoint.
    5. generation  completions of a few code prompts from the latest checkpoint, with decode speed

Validation loss is reported before and after training (from run/train/metrics.jsonl).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from openflash.errors import OpenflashError
from openflash.runtime.placement import Placement
from openflash.train.tokenizer import DEFAULT_PATTERNS, stdlib_source_dir, walk_sources

DONE_FILE = "demo_done.json"  # in the training run folder: the budget (minutes) of the last finished run
PROMPTS = ("def fibonacci(n):", "import os\n\n", "class Stack:", "    def __init__(self, ")
# Folders of the stdlib that hold its test suite: a different style of code, and most of the bytes.
SKIP_PARTS = frozenset({"test", "tests", "idle_test", "lib2to3"})


@dataclass
class DemoConfig:
    preset: str = "small"
    minutes: float = 10.0
    run_dir: Path = Path("runs/demo")
    corpus: Path | None = None  # None: the Python standard library
    corpus_bytes: int = 8_000_000  # enough text for a 10-minute run without repeating; tokenizes in seconds
    tokenizer_bytes: int = 3_000_000
    vocab_size: int = 4096
    batch_size: int = 8
    seq_len: int | None = None  # None: 256 for small, 128 for tiny
    lr: float = 3e-3
    prompts: tuple[str, ...] = PROMPTS
    max_new_tokens: int = 48
    # Low-temperature sampling with a fixed seed: reproducible, and a small model's greedy output tends to loop.
    temperature: float = 0.6
    top_k: int = 40
    progress: bool = True

    @property
    def sequence_length(self) -> int:
        return self.seq_len if self.seq_len is not None else (128 if self.preset == "tiny" else 256)


def select_corpus(root: Path, max_bytes: int, patterns: tuple[str, ...]) -> list[Path]:
    """Files under `root` (test suites skipped), in an order spread over the whole tree (sha256 of the relative
    path), until `max_bytes`. Deterministic for a given tree."""
    files = [f for f in walk_sources([root], patterns) if not SKIP_PARTS.intersection(Path(f.rel).parts)]
    if not files:
        raise OpenflashError(f"no files matching {','.join(patterns)} under {root}")
    files.sort(key=lambda f: hashlib.sha256(f.rel.encode("utf-8")).hexdigest())
    chosen, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        chosen.append(f.path)
        total += f.path.stat().st_size
    return sorted(chosen)


def _say(cfg: DemoConfig, text: str) -> None:
    if cfg.progress:
        print(text, flush=True)


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def run_demo(cfg: DemoConfig) -> dict:
    """Run (or resume) every stage; returns a summary (val losses, samples, timings)."""
    from openflash.train.prepare import prepare_dataset
    from openflash.train.tokenizer import train_bpe_tokenizer

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"run_dir": str(run_dir), "preset": cfg.preset}
    timings: dict[str, float] = {}

    # 1. corpus -------------------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    if cfg.corpus is None:
        root, patterns = stdlib_source_dir(), ("*.py",)
    else:
        root, patterns = Path(cfg.corpus), tuple(DEFAULT_PATTERNS)
        if not root.is_dir():
            raise OpenflashError(f"--corpus {root}: not a folder")
    files = select_corpus(root, cfg.corpus_bytes, patterns)
    size = sum(p.stat().st_size for p in files)
    amount = f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"
    _say(cfg, f"[1/5] corpus: {len(files)} files, {amount} of {', '.join(patterns)} from {root}")

    # 2. tokenizer ----------------------------------------------------------------------------------------------
    tok_path = run_dir / "tokenizer.json"
    if tok_path.is_file():
        _say(cfg, f"[2/5] tokenizer: cached ({tok_path})")
    else:
        t1 = time.perf_counter()
        tok = train_bpe_tokenizer(files, cfg.vocab_size, tok_path, max_bytes=cfg.tokenizer_bytes)
        _say(cfg, f"[2/5] tokenizer: byte-level BPE, {tok.get_vocab_size(with_added_tokens=True)} ids, trained in "
                  f"{time.perf_counter() - t1:.1f} s -> {tok_path}")

    # 3. dataset -----------------------------------------------------------------------------------------------
    data_dir = run_dir / "data"
    val_fraction = 0.02 if len(files) >= 200 else 0.2  # a few files still need some held out
    manifest_done = (data_dir / "manifest.json").is_file()
    t1 = time.perf_counter()
    manifest = prepare_dataset(files, tok_path, data_dir, val_fraction=val_fraction, patterns=patterns,
                               progress=False)
    train_split, val_split = manifest.splits["train"], manifest.splits["val"]
    how = "cached" if manifest_done else f"tokenized in {time.perf_counter() - t1:.1f} s"
    _say(cfg, f"[3/5] dataset: {train_split.num_tokens:,} train / {val_split.num_tokens:,} validation tokens "
              f"({how}) -> {data_dir}")
    timings["prepare"] = time.perf_counter() - t0
    summary["train_tokens"], summary["val_tokens"] = train_split.num_tokens, val_split.num_tokens

    # 4. training ----------------------------------------------------------------------------------------------
    train_dir = run_dir / "train"
    t1 = time.perf_counter()
    summary.update(_train_stage(cfg, data_dir, train_dir))
    timings["train"] = time.perf_counter() - t1

    # 5. generation ----------------------------------------------------------------------------------------------
    t1 = time.perf_counter()
    summary["samples"] = _generate_stage(cfg, train_dir)
    timings["generate"] = time.perf_counter() - t1
    summary["timings"] = timings
    return summary


def _train_stage(cfg: DemoConfig, data_dir: Path, train_dir: Path) -> dict:
    from openflash.files.run_dir import latest_checkpoint, read_trainer_state
    from openflash.train.trainer import TrainConfig, Trainer

    budget = cfg.minutes * 60.0
    checkpoint = latest_checkpoint(train_dir)
    trained = float(read_trainer_state(checkpoint)["trained_seconds"]) if checkpoint is not None else 0.0
    remaining = budget - trained
    # Done when a run for at least this budget finished (the trainer plans its steps to fit the budget and keeps
    # time for evaluations and saves, so the seconds it trained say less than whether it finished).
    marker = train_dir / DONE_FILE
    finished = json.loads(marker.read_text()).get("minutes", 0.0) if marker.is_file() else 0.0
    if checkpoint is not None and (finished >= cfg.minutes or remaining < max(1.0, 0.02 * budget)):
        _say(cfg, f"[4/5] training: cached ({trained / 60:.1f} of {cfg.minutes:g} min done, {checkpoint.name})")
    else:
        what = f"continuing from {checkpoint.name}" if checkpoint is not None else f"'{cfg.preset}' preset"
        _say(cfg, f"[4/5] training: {what}, {remaining / 60:.1f} min (batch {cfg.batch_size} x "
                  f"{cfg.sequence_length} tokens)")
        train_cfg = TrainConfig(
            data=str(data_dir), out=str(train_dir), config=cfg.preset,
            steps=1_000_000,  # a placeholder bound: the run fixes its step count from the time budget
            batch_size=cfg.batch_size, seq_len=cfg.sequence_length, lr=cfg.lr, warmup=20,
            eval_every=100, save_every=100, max_minutes=remaining / 60.0, steps_from_budget=True,
            adaptive_threads=True, resume=checkpoint is not None, progress=cfg.progress)
        if Trainer(train_cfg).fit().stopped_by != "interrupt":
            marker.write_text(json.dumps({"minutes": cfg.minutes}) + "\n")
    records = _metrics(train_dir)
    evals = [r for r in records if "val_loss" in r]
    result: dict = {"steps": max((r["step"] for r in records if "loss" in r), default=0)}
    checkpoint = latest_checkpoint(train_dir)
    if checkpoint is not None:
        result["minutes"] = float(read_trainer_state(checkpoint)["trained_seconds"]) / 60.0
        _say(cfg, f"      trained {result['steps']} steps in {result['minutes']:.1f} of {cfg.minutes:g} min")
    if evals:
        before, after = evals[0], evals[-1]
        result["val_loss_before"], result["val_loss_after"] = before["val_loss"], after["val_loss"]
        _say(cfg, f"      validation loss: {before['val_loss']:.3f} (step {before['step']}) -> "
                  f"{after['val_loss']:.3f} (step {after['step']}), perplexity {math.exp(before['val_loss']):.0f} "
                  f"-> {math.exp(after['val_loss']):.1f}")
    return result


def _generate_stage(cfg: DemoConfig, train_dir: Path) -> list[dict]:
    from openflash.engine.generate import generate
    from openflash.engine.sampling import SamplingParams
    from openflash.files.run_dir import latest_checkpoint
    from openflash.runtime.open import open_model

    checkpoint = latest_checkpoint(train_dir)
    if checkpoint is None:
        raise OpenflashError(f"no checkpoint in {train_dir} to generate from")
    runtime = open_model(str(checkpoint), placement=Placement(weights="dequantized"))
    params = SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, max_tokens=cfg.max_new_tokens, seed=0)
    how = "greedy" if params.greedy else f"temperature {cfg.temperature}, top-k {cfg.top_k}, seed 0"
    _say(cfg, f"[5/5] generation from {checkpoint} ({how}, up to {cfg.max_new_tokens} tokens each)")
    samples = []
    for prompt in cfg.prompts:
        result = generate(runtime, prompt, params)
        speed = result.decode_tokens_per_second
        samples.append({"prompt": prompt, "completion": result.text, "tokens": len(result.token_ids),
                        "decode_tokens_per_s": speed})
        if cfg.progress:
            print(f"----- {prompt!r}  ({len(result.token_ids)} tokens, {speed:.0f} tokens/s decode)")
            print(prompt + result.text)
    if cfg.progress:
        print("-----")
    return samples


__all__ = ["DemoConfig", "run_demo", "select_corpus", "PROMPTS"]
