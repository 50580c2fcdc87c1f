"""Training loop: `openflash train` and the demo both run `Trainer(cfg).fit()`.

One step (data parallel over ranks when torch.distributed is initialised; see distributed.py):

    inputs, targets = loader.batch_at(step)           # depends only on (seed, step): resumes exactly
    hash ids = Engram hash of the inputs               # computed from tokens, before the model runs
    stage 1 (step < indexer_warmup): dense attention, objective = indexer KL, only `*.attn.indexer.*` learns
    stage 2: sparse attention, objective = lm loss + indexer_loss_weight * indexer KL
             (the indexer's inputs are detached inside the model, so the KL gradient reaches only the indexer)
    backward, average grads across ranks, clip, AdamW/Adam(/Muon) step
    router bias += rate * sign(mean load - load) from the step's expert loads (summed across ranks)

A run folder holds:

    config.json          the model config (adjusted to the dataset's tokenizer)
    train_args.json      the TrainConfig of the run
    metrics.jsonl        train lines {step, loss, lr, tokens_per_s, grad_norm, load_max_mean, ...},
                         eval lines {step, val_loss, val_ppl} (step 0 = before training)
    checkpoints/step_NNNNNNNN/   config.json, model.safetensors (official names, fp32), tokenizer.json,
                                 trainer_state.pt (optimizer, schedule, data loader, RNG, counters)

A checkpoint is written to a temporary folder and renamed into place, so a listed checkpoint is always complete;
only the newest `keep_checkpoints` are kept. Ctrl-C finishes the current step, saves and exits cleanly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from tqdm import tqdm

from openflash.config import FlashConfig
from openflash.errors import OpenflashError
from openflash.files.manifest import verify_manifest, write_manifest
from openflash.files.run_dir import CHECKPOINTS_DIR, STATE_FILE, RunFolder, read_trainer_state
from openflash.memory.frontend import EngramFrontend
from openflash.memory.tokenmap import TokenMap
from openflash.model.compiled import check_toolchain
from openflash.model.engram_rows import TrainedRows
from openflash.model.engram_table import DeviceTable
from openflash.model.numerics import TRAIN
from openflash.model.transformer import Transformer
from openflash.runtime.placement import resolve_device
from openflash.runtime.runtime import Runtime
from openflash.threads import ThreadTuner
from openflash.tokenizer import load_tokenizer
from openflash.train.config import RESUME_FIXED, TrainConfig, training_model_config
from openflash.train.dataset import BatchLoader, TokenDataset, eval_batches
from openflash.train.distributed import DistContext, all_reduce_grads, collective_device
from openflash.train.finetune import fine_tune_base
from openflash.train.interrupt import StopRequest
from openflash.train.optim import (OptimConfig, Schedule, TrainOptimizer, expert_loads, is_indexer_param, load_stats,
                                   reset_expert_loads, update_router_bias)
from openflash.train.sharded import full_optimizer_state, load_full_optimizer_state
from openflash.train.tuning import Built, RunModel, tuning_for

# A time-budgeted run plans its step count from its PLAN_FROM-th step of the invocation on, after every step, at the
# recent pace: the median of the last PACE_WINDOW steps (the first step excluded: it warms caches up).
PLAN_FROM, PACE_WINDOW = 4, 20

log = logging.getLogger("openflash.train")


@dataclass
class FitResult:
    step: int  # optimizer steps done in total (all invocations)
    stopped_by: str  # "steps", "time", "interrupt"
    checkpoint: Path | None
    last_loss: float | None
    val_loss: float | None
    trained_seconds: float


# ---------------------------------------------------------------------------------------------------------------
# The trainer


class Tuning(Protocol):
    """What is trained and how it is saved (train/tuning.py: FullTuning, LoRATuning); the trainer holds one and asks
    it, never which one it is."""

    updates_router_bias: bool  # the router's load-balancing bias trains (a frozen base keeps its own)

    def resumed_config(self, checkpoint: Path) -> FlashConfig | None:
        """The model config a resumed run rebuilds from, or None when the model comes from --init again."""

    def build(self, run: RunModel) -> Built:
        """The run's model (and what came with it)."""

    def distribute(self, model: Transformer, ctx: DistContext, resume_from: Path | None,
                   trained_rows: dict[str, TrainedRows]) -> bool:
        """The ranks' models made equal; True when the model is now sharded over them."""

    def gather(self, model: Transformer, sharded: bool) -> dict[str, torch.Tensor]:
        """What a checkpoint saves beside the model's own state, gathered whole (on every rank)."""

    def write(self, folder: Path, model: Transformer, gathered: dict[str, torch.Tensor],
              trained_rows: dict[str, TrainedRows], tokenizer_path: Path) -> None:
        """A checkpoint's weights into `folder` (rank 0)."""

    def load(self, checkpoint: Path, model: Transformer, trained_rows: dict[str, TrainedRows], sharded: bool) -> None:
        """A checkpoint's weights back into the run's model."""




class Trainer:
    """Builds (or resumes) a run and trains it: `Trainer(cfg).fit()`.

    `on_step(trainer, record)` is called after every optimizer step on every rank (tests use it to interrupt a
    run through `request_stop()`, the same path Ctrl-C takes).
    """

    def __init__(self, cfg: TrainConfig, ctx: DistContext | None = None,
                 on_step: Callable[["Trainer", dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx if ctx is not None else DistContext.current()
        self.on_step = on_step
        self.run_dir = Path(cfg.out)
        self.run = RunFolder(self.run_dir, self.ctx.is_main, cfg.log_to, "train")
        self.train_data = TokenDataset(cfg.data, "train")
        self.val_data = TokenDataset(cfg.data, "val")
        self.tokenizer_path = self.train_data.tokenizer_path

        self.resume_from = self.run.resume_point(cfg.resume)
        if self.resume_from is not None:
            # (a fine-tuning run's model config is its --init's, which is fixed itself; runs written before --config
            # was refused with --init recorded the unused default there)
            fixed = RESUME_FIXED if cfg.init is None else tuple(k for k in RESUME_FIXED if k != "config")
            self.run.check_resume_args(asdict(cfg), fixed)
            if cfg.verify:  # this run wrote the manifest itself: a damaged checkpoint must not train on, blessed anew
                try:
                    verify_manifest(self.resume_from)
                except OpenflashError as exc:
                    raise OpenflashError(f"--resume: {exc} (--no-verify resumes anyway)") from None
        self.base = fine_tune_base(cfg, self.resume_from) if cfg.init is not None else None  # None: a preset
        self.tuning: Tuning = tuning_for(cfg, self.base)
        model_cfg = self.tuning.resumed_config(self.resume_from) if self.resume_from is not None else \
            training_model_config(cfg.config, self.tokenizer_path) if cfg.init is None else None

        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)
        if cfg.autocast != "off" and self.device.type != "cuda":
            raise OpenflashError(f"--autocast {cfg.autocast} runs on a CUDA device (this run's is {self.device}); the "
                                 f"CPU computes in fp32")
        if cfg.compile:
            check_toolchain(self.device)
        numerics = TRAIN.with_compile(cfg.compile)
        init = self.base["path"] if self.base is not None else cfg.init
        built = self.tuning.build(RunModel(init, model_cfg, self.train_data, numerics, self.device, self.resume_from))
        self.model, self.model_cfg = built.model, built.model.cfg
        # A fine-tuning run keeps its checkpoint's Engram addressing: the token map it carries (copied into every
        # checkpoint of the run, so a resume reads it back), else its tokenizer's.
        self.token_map_file, frontend = built.token_map_file, built.frontend
        if frontend is None and self.token_map_file is not None:
            frontend = EngramFrontend.from_token_map(self.model_cfg, TokenMap.from_file(self.token_map_file,
                                                                                         self.model_cfg))
        self.model.train()
        self.model.checkpoint_blocks = cfg.checkpoint_activations
        self.trained_rows = {n: m.trained for n, m in self.model.named_modules()
                             if isinstance(m, DeviceTable) and m.trained is not None}
        self.sharded = self.tuning.distribute(self.model, self.ctx, self.resume_from, self.trained_rows)
        # The model's own tables, addressed through the data's tokenizer (or the map above); gathered in autograd.
        self.runtime = built.runtime or Runtime.of(self.model, load_tokenizer(self.tokenizer_path), frontend=frontend)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.indexer_params = [p for n, p in self.model.named_parameters() if p.requires_grad and is_indexer_param(n)]
        if cfg.indexer_warmup and not self.indexer_params:
            raise OpenflashError(f"--indexer-warmup {cfg.indexer_warmup}: the model {cfg.config} has no indexer")
        self.optimizer = TrainOptimizer(self.model, OptimConfig(lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                                engram_lr_mult=cfg.engram_lr_mult,
                                                                optimizer=cfg.optimizer))
        self.schedule = Schedule(cfg.warmup, cfg.steps, cfg.indexer_warmup, cfg.min_lr_ratio)
        self.loader = BatchLoader(self.train_data, cfg.batch_size, cfg.seq_len, cfg.seed, self.ctx.rank,
                                  self.ctx.world_size)
        self.eval_set = eval_batches(self.val_data, cfg.batch_size, cfg.seq_len, cfg.eval_batches) \
            if self.val_data.num_tokens > cfg.seq_len else []
        self.step = 0
        self.tokens_seen = 0
        self._seconds_before = 0.0  # trained_seconds of earlier invocations (resume)
        self._fit_start: float | None = None
        self._last_eval_step = -1
        self.last_val_loss: float | None = None
        self.stop = StopRequest(announce=self.ctx.is_main)
        self._last_saved_step = -1
        self._eval_seconds = 0.0
        self._save_seconds = 0.0
        if self.resume_from is not None:
            self._load(self.resume_from)

    # ---- public ---------------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint and return from fit() (what Ctrl-C does)."""
        self.stop.request()

    @property
    def total_steps(self) -> int:
        return self.schedule.total

    def fit(self) -> FitResult:
        cfg, ctx = self.cfg, self.ctx
        self._fit_start = time.monotonic()
        deadline = self._fit_start + cfg.max_minutes * 60 if cfg.max_minutes is not None else math.inf
        if ctx.is_main:
            resumed = self.resume_from is not None
            self.run.start(None if resumed else json.dumps(self.model_cfg.to_hf_dict(), indent=2) + "\n", self.step,
                           asdict(cfg), {"event": "resume" if resumed else "start", "at_step": self.step,
                                         "world_size": ctx.world_size,
                                         "config": cfg.config if self.base is None else self.base["path"],
                                         "params": sum(p.numel() for p in self.model.parameters())})
        if self.step == 0 and self.resume_from is None and self.eval_set:
            self._evaluate_and_log()
        # A time-budgeted run shows a plain step counter until it knows how many steps fit.
        bar = tqdm(total=None if cfg.steps_from_budget else self.total_steps, initial=self.step, unit="step",
                   dynamic_ncols=True, disable=not (cfg.progress and ctx.is_main), desc="training")
        stopped_by, last_loss, step_times = "steps", None, []
        tuner = None
        if cfg.adaptive_threads and not ctx.enabled and torch.get_num_threads() > 1:
            tuner = ThreadTuner((torch.get_num_threads(), 1))
        threads_before = torch.get_num_threads()
        with self.stop:  # Ctrl-C asks for a stop after this step
            try:
                while self.step < self.total_steps:
                    if tuner is not None:
                        torch.set_num_threads(tuner.threads_for(len(step_times)))
                    record = self.train_step()
                    if tuner is not None:
                        record["threads"] = torch.get_num_threads()
                        tuner.record(record["threads"], record["step_seconds"])
                    step_times.append(record["step_seconds"])
                    last_loss = record["loss"]
                    if ctx.is_main:
                        self._log(record)
                    bar.update(1)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                                    refresh=False)
                    if cfg.steps_from_budget and self._plan_budget(step_times, deadline):
                        bar.total = self.total_steps
                        bar.refresh()
                    if self.on_step is not None:
                        self.on_step(self, record)
                    if self.step < self.total_steps:
                        if cfg.eval_every and self.step % cfg.eval_every == 0 and self.eval_set:
                            self._evaluate_and_log(bar)
                        if cfg.save_every and self.step % cfg.save_every == 0:
                            self._save()
                    interrupted, out_of_time = ctx.any_each([self.stop.requested, time.monotonic() >= deadline])
                    if interrupted or out_of_time:
                        stopped_by = "interrupt" if interrupted else "time"
                        break
            finally:
                bar.close()
                torch.set_num_threads(threads_before)
        if self.eval_set and stopped_by != "interrupt" and self._last_eval_step != self.step:
            self._evaluate_and_log()
        checkpoint = self._save()
        self.run.close()
        self._seconds_before, self._fit_start = self.trained_seconds, None
        if ctx.is_main and cfg.progress:
            how = {"steps": "finished", "time": "stopped at the time limit", "interrupt": "interrupted"}[stopped_by]
            print(f"{how} at step {self.step}/{self.total_steps}; checkpoint {checkpoint}")
        return FitResult(self.step, stopped_by, checkpoint, last_loss, self.last_val_loss, self.trained_seconds)

    @property
    def trained_seconds(self) -> float:
        """Wall time spent in fit() over all invocations of this run (steps, evaluations and saves)."""
        running = time.monotonic() - self._fit_start if self._fit_start is not None else 0.0
        return self._seconds_before + running

    # ---- one step -------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        cfg, ctx, model = self.cfg, self.ctx, self.model
        t0 = time.monotonic()
        step = self.step
        indexer_stage = step < self.schedule.indexer_warmup
        inputs, targets = self._on_device(*self.loader.batch_at(step))
        multiplier = self.schedule.multiplier(step)
        self.optimizer.set_lr_multiplier(multiplier)
        self.optimizer.zero_grad()
        with self._autocast():
            out = self.runtime.forward(inputs, targets, dense_indexer=indexer_stage)
        if indexer_stage:
            objective = out.indexer_loss
        elif out.indexer_loss is not None and cfg.indexer_loss_weight:
            objective = out.loss + cfg.indexer_loss_weight * out.indexer_loss
        else:
            objective = out.loss
        objective.backward()

        # Every trainable parameter of the stage gets a gradient (zeros for experts that received no tokens), so
        # one process and several see the same set of updated parameters.
        params = self.indexer_params if indexer_stage else self.params
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not self.sharded:  # (FSDP2 reduced them in the backward)
            all_reduce_grads(params, ctx)
        clipped = params + [r.values for r in self.trained_rows.values() if r.values.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(clipped, cfg.grad_clip) if cfg.grad_clip > 0 else \
            torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in clipped]))
        self.optimizer.step()
        for rows in self.trained_rows.values():  # the tables' rate, as in pre-training (optim.py)
            rows.adam_step(cfg.lr * cfg.engram_lr_mult * multiplier)

        loads = ctx.all_reduce_sum_(expert_loads(model))
        if not indexer_stage and self.tuning.updates_router_bias:
            update_router_bias(model, loads, cfg.bias_update_rate)
        reset_expert_loads(model)

        losses = torch.stack([out.loss.detach().float(), out.indexer_loss.detach().float()
                              if out.indexer_loss is not None else torch.zeros((), device=out.loss.device)])
        ctx.all_reduce_mean_(losses)
        loss, indexer_loss = float(losses[0]), float(losses[1])
        if not math.isfinite(loss):
            raise OpenflashError(f"the training loss became {loss} at step {step + 1}; lower --lr (now {cfg.lr})")
        self.step += 1
        self.loader.step = self.step
        tokens = cfg.batch_size * cfg.seq_len
        self.tokens_seen += tokens
        seconds = time.monotonic() - t0
        record = {"step": self.step, "loss": round(loss, 6), "lr": self.optimizer.lr(),
                  "tokens_per_s": round(tokens / seconds, 1), "grad_norm": round(float(grad_norm), 6),
                  "step_seconds": round(seconds, 4)}
        if out.indexer_loss is not None:
            record["indexer_loss"] = round(indexer_loss, 6)
        if indexer_stage:
            record["stage"] = "indexer_warmup"
        record.update(load_stats(loads))
        record["loss_exact"] = loss  # full precision, for resume/equivalence checks
        return record

    def _on_device(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch on the model's device: through pinned memory with an asynchronous copy on CUDA, so the copy
        does not hold the step (the host reads the next batch's tokens while the GPU runs)."""
        if self.device.type != "cuda":
            return inputs, targets
        return (inputs.pin_memory().to(self.device, non_blocking=True),
                targets.pin_memory().to(self.device, non_blocking=True))

    def _autocast(self) -> Any:
        """bf16 autocast when asked (CUDA only, checked at start), else nothing."""
        if self.cfg.autocast == "bf16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---- evaluation ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss over the fixed validation windows (all ranks share the work)."""
        ctx, model = self.ctx, self.model
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=collective_device())
        try:
            for inputs, targets in self.eval_set:
                rows = inputs.shape[0]
                lo, hi = rows * ctx.rank // ctx.world_size, rows * (ctx.rank + 1) // ctx.world_size
                if hi <= lo:
                    continue
                x, y = inputs[lo:hi], targets[lo:hi]
                with self._autocast():
                    out = self.runtime.forward(x, y)
                trained = int((y != -100).sum())  # chat data: the reply tokens only
                total[0] += float(out.loss) * trained
                total[1] += trained
        finally:
            model.train(was_training)
        ctx.all_reduce_sum_(total)
        if total[1] == 0:
            raise OpenflashError(f"{self.cfg.data}: the validation split has no window of seq_len + 1 = "
                                 f"{self.cfg.seq_len + 1} tokens")
        return float(total[0] / total[1])

    def _evaluate_and_log(self, bar: tqdm | None = None) -> float:
        t0 = time.monotonic()
        val = self.evaluate()
        self._eval_seconds = time.monotonic() - t0
        self.last_val_loss = val
        self._last_eval_step = self.step
        if self.ctx.is_main:
            ppl = math.exp(min(val, 50.0))
            self.run.append_metrics({"step": self.step, "val_loss": round(val, 6), "val_ppl": round(ppl, 4)})
            if self.cfg.progress:
                (bar.write if bar is not None else print)(f"step {self.step}: val_loss {val:.4f} (ppl {ppl:.2f})")
        return val

    # ---- time budget -----------------------------------------------------------------------------------------
    def _plan_budget(self, step_times: list[float], deadline: float) -> bool:
        """Set the total step count to what fits before the deadline at the recent pace, leaving time for the
        evaluations and checkpoints still to come; returns whether the count changed. Planned again after every
        step, so the budget is a deadline rather than a count fixed early: steps slowed at the start (a busy
        machine, cold caches) shorten the plan only until they speed up, and the learning-rate schedule follows."""
        if len(step_times) < PLAN_FROM:
            return False
        now = time.monotonic()
        per_step = statistics.median(step_times[1:][-PACE_WINDOW:])  # the median ignores probes and evaluations
        steps_left = (deadline - now) / per_step
        evals = (steps_left // self.cfg.eval_every if self.cfg.eval_every else 0) + 1
        saves = (steps_left // self.cfg.save_every if self.cfg.save_every else 0) + 1
        reserve = evals * self._eval_seconds + saves * max(self._save_seconds, 1.0)
        total = self.step + max(1, int((deadline - now - reserve) / per_step))
        changed = total != self.schedule.total
        self.schedule.total = total
        return changed

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        self.run.append_metrics({k: v for k, v in record.items() if k != "loss_exact"})

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "trained_seconds": self.trained_seconds,
            "last_val_loss": self.last_val_loss,
            "world_size": self.ctx.world_size,
            "optimizer": self.optimizer.state_dict(partial(full_optimizer_state, self.model) if self.sharded
                                                   else None),
            "schedule": self.schedule.state_dict(),
            "loader": self.loader.state_dict(),
            "rng": torch.get_rng_state(),
            "train_args": asdict(self.cfg),
        }

    def _save(self) -> Path:
        """Write a checkpoint of the current step (rank 0), atomically; returns its folder."""
        final = self.run_dir / CHECKPOINTS_DIR / f"step_{self.step:08d}"
        if self._last_saved_step == self.step:
            return final
        t0 = time.monotonic()

        gathered = self.tuning.gather(self.model, self.sharded)  # every rank takes part (and in the optimizer state)
        trainer_state = self.state_dict()

        def write(folder: Path) -> None:
            self.tuning.write(folder, self.model, gathered, self.trained_rows, self.tokenizer_path)
            if self.token_map_file is not None:
                shutil.copy(self.token_map_file, folder / self.token_map_file.name)
            torch.save(trainer_state, folder / STATE_FILE)
            write_manifest(folder)  # again, now covering the trainer state too

        if self.ctx.is_main:
            final = self.run.save(self.step, write, self.cfg.keep_checkpoints)
        self.ctx.barrier()
        self._last_saved_step = self.step
        self._save_seconds = time.monotonic() - t0
        return final

    def _load(self, checkpoint: Path) -> None:
        state = read_trainer_state(checkpoint)
        self.tuning.load(checkpoint, self.model, self.trained_rows, self.sharded)
        try:
            self.optimizer.load_state_dict(state["optimizer"], partial(load_full_optimizer_state, self.model)
                                           if self.sharded else None)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise OpenflashError(f"{checkpoint / STATE_FILE}: optimizer state does not fit the model ({exc})") \
                from None
        self.schedule.load_state_dict(state["schedule"])
        # --steps may extend (or shorten) a resumed run; a time-budgeted run re-plans its steps after calibrating.
        self.schedule.total = self.cfg.steps if not self.cfg.steps_from_budget else int(state["step"]) + self.cfg.steps
        self.loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self._seconds_before = float(state["trained_seconds"])
        self.last_val_loss = state["last_val_loss"]
        self._last_saved_step = self.step

# ---------------------------------------------------------------------------------------------------------------
# CLI


__all__ = ["TrainConfig", "Trainer", "FitResult", "training_model_config"]
