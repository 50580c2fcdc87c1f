"""`openflash rl`: GRPO on a LoRA adapter, the engine generating the rollouts (`RLTrainer(cfg).fit()`).

One step:

    tasks = the step's prompts_per_step tasks               (a fixed shuffle per pass: resumes exactly)
    rollouts = group_size completions of each (rollout.py: the engine, on the policy as it stands; a task with a
               tool environment runs as an episode of turns, its tool results fed back, rl/environment.py)
    rewards = the reward of each (rewards.py), + the overlong penalty; advantages within each group (grpo.py)
    groups with no signal (all rewards equal, when dropped) or fewer than 2 usable samples are skipped, counted
    log p_old = the training forward's log-probs before the update (no grad); log p_ref = the same with the
    adapter switched off (only with --kl-coef)
    updates_per_step optimizer steps over mini-batches of the rollouts: clipped surrogate (+ KL) over the tokens
    the model wrote (tool results masked), backward

The base stays frozen as stored (train/finetune.lora_model); rollouts run in the `fp32` numerics (eval), the update
in `finetune` (the same rounding points, straight-through). The run folder is the trainer's (files/run_dir.py):
train_args.json, metrics.jsonl (a line per step, eval lines with the held-out solved share), checkpoints holding the
adapter (PEFT layout, served by `serve --lora`), its base's fingerprint and trainer_state.pt. Single process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm import tqdm

from openflash.chat import chat_format
from openflash.errors import OpenflashError
from openflash.files.manifest import write_manifest
from openflash.files.peft import read_adapter, write_adapter
from openflash.files.run_dir import STATE_FILE, RunFolder, read_trainer_state
from openflash.model.layers import Linear
from openflash.model.lora import LoRA, adapter_weights, lora_alpha
from openflash.model.numerics import FINETUNE, FP32
from openflash.rl.config import RESUME_FIXED, RLConfig
from openflash.rl.grpo import (completion_positions, equal_groups, group_advantages, overlong_penalty, picked_logprobs,
                               policy_loss)
from openflash.rl.rewards import Reward, make_reward
from openflash.rl.rollout import Rollout, RolloutBatch, generate_groups
from openflash.rl.tasks import Task, read_tasks
from openflash.runtime.placement import resolve_device
from openflash.train.finetune import fine_tune_base, load_adapter_weights, lora_model
from openflash.train.interrupt import StopRequest
from openflash.train.optim import OptimConfig, Schedule, TrainOptimizer, reset_expert_loads

log = logging.getLogger("openflash.rl")


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model: every trained adapter taken off its linear for the block (the KL reference)."""
    taken = [(m, m.adapter) for m in model.modules() if isinstance(m, Linear) and isinstance(m.adapter, LoRA)]
    for linear, _ in taken:
        linear.adapter = None
    try:
        yield
    finally:
        for linear, adapter in taken:
            linear.adapter = adapter


class RLTrainer:
    def __init__(self, cfg: RLConfig, on_step: Callable[["RLTrainer", dict[str, Any]], None] | None = None) -> None:
        self.cfg, self.on_step = cfg, on_step
        self.run = RunFolder(Path(cfg.out), log_to=cfg.log_to, group="rl")
        self.resume_from = self.run.resume_point(cfg.resume)
        if self.resume_from is not None:
            self.run.check_resume_args(asdict(cfg), RESUME_FIXED)
        self.reward: Reward = make_reward(cfg.reward, cfg.answer_pattern, cfg.reward_timeout, cfg.reward_memory)
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.base = fine_tune_base(cfg, self.resume_from)  # None: a preset
        self.runtime = lora_model(self.base["path"] if self.base is not None else cfg.init, None, cfg.lora,
                                  cfg.lora_alpha, cfg.lora_targets, device=self.device)
        self.model = self.runtime.model
        self.model.checkpoint_blocks = cfg.checkpoint_activations
        model_cfg = self.runtime.cfg
        read = dict(tokenizer=self.runtime.tokenizer, bos_token_id=model_cfg.bos_token_id,
                    eos_token_id=model_cfg.eos_token_id, needs=self.reward.needs,
                    max_prompt_tokens=cfg.max_prompt_tokens, tool_timeout=cfg.reward_timeout)
        self.tasks = read_tasks(cfg.tasks, **read)
        self.eval_tasks = read_tasks(cfg.eval_tasks, **read) if cfg.eval_tasks else []
        self.chat_format = chat_format(self.runtime.tokenizer, model_cfg.bos_token_id, model_cfg.eos_token_id) \
            if any(t.environment is not None for t in self.tasks + self.eval_tasks) else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = TrainOptimizer(self.model, OptimConfig(lr=cfg.lr, weight_decay=cfg.weight_decay))
        self.schedule = Schedule(cfg.warmup, cfg.steps, 0, min_ratio=1.0)  # constant after the warm-up
        self.step = 0
        self.stop = StopRequest(announce=cfg.progress)
        self._last_saved_step = -1
        if self.resume_from is not None:
            self._load(self.resume_from)

    # ---- the loop -----------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        resumed = self.resume_from is not None
        model_config = json.dumps(self.runtime.cfg.to_hf_dict(), indent=2) + "\n"
        self.run.start(None if resumed else model_config, self.step, asdict(cfg),
                       {"event": "resume" if resumed else "start", "at_step": self.step, "tasks": len(self.tasks),
                        "eval_tasks": len(self.eval_tasks),
                        "base": cfg.init if self.base is None else self.base["path"],
                        "trained_params": sum(p.numel() for p in self.params)})
        first_eval = self.evaluate() if self.eval_tasks and not resumed else None
        bar = tqdm(total=cfg.steps, initial=self.step, unit="step", dynamic_ncols=True, disable=not cfg.progress,
                   desc="rl")
        last: dict[str, Any] = {}
        with self.stop:
            try:
                while self.step < cfg.steps and not self.stop.requested:
                    last = self.train_step()
                    self.run.append_metrics(last)
                    bar.update(1)
                    bar.set_postfix(reward=f"{last['reward_mean']:.3f}", refresh=False)
                    if self.on_step is not None:
                        self.on_step(self, last)
                    if self.step < cfg.steps:
                        if cfg.eval_every and self.step % cfg.eval_every == 0 and self.eval_tasks:
                            self.evaluate()
                        if cfg.save_every and self.step % cfg.save_every == 0:
                            self._save()
            finally:
                bar.close()
        final_eval = self.evaluate() if self.eval_tasks else None
        checkpoint = self._save()
        self.run.close()
        return {"step": self.step, "checkpoint": checkpoint, "last": last,
                "eval_before": first_eval, "eval_after": final_eval}

    def request_stop(self) -> None:
        """Finish the current step, save and return from fit() (what Ctrl-C does)."""
        self.stop.request()

    def step_tasks(self, step: int) -> list[Task]:
        """The tasks of a step: passes over the file, each in its own seeded order."""
        n, k = len(self.tasks), self.cfg.prompts_per_step
        picked = []
        for slot in range(step * k, (step + 1) * k):
            epoch, at = divmod(slot, n)
            order = list(range(n))
            random.Random(self.cfg.seed * 7919 + epoch).shuffle(order)
            picked.append(self.tasks[order[at]])
        return picked

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        batch = self._rollouts(self.step_tasks(self.step), cfg.group_size, cfg.temperature, self.step)
        scored = [[self._score(r) for r in group] for group in batch.groups]
        rewards_all = [s for group in scored for s in group if s is not None]
        usable, empty, dropped = [], 0, 0
        for group, scores in zip(batch.groups, scored):
            kept = [(r, s) for r, s in zip(group, scores) if s is not None and r.generated]
            if len(kept) < 2:
                empty += 1
                continue
            rewards = torch.tensor([[s for _, s in kept]], dtype=torch.float64)
            if cfg.drop_equal_groups and bool(equal_groups(rewards)[0]):
                dropped += 1
                continue
            advantages = group_advantages(rewards, cfg.scale_advantages)[0]
            usable.extend((r, float(a)) for (r, _), a in zip(kept, advantages))
        t0 = time.perf_counter()
        update = self._update(usable) if usable else {}
        update_seconds = time.perf_counter() - t0
        self.step += 1
        done = [r for g in batch.groups for r in g if r.error is None]
        lengths = [r.generated for r in done]
        record = {"step": self.step, "reward_mean": _round(_mean(rewards_all)),
                  "reward_std": _round(_std(rewards_all)),
                  "solved": _round(_mean([float(s >= 1.0) for s in rewards_all])),
                  "completion_len": _round(_mean(lengths)), "truncated": sum(r.truncated for g in batch.groups
                                                                             for r in g),
                  "turns": _round(_mean([r.turns for r in done])), "tool_calls": sum(r.tool_calls for r in done),
                  "tool_errors": sum(r.tool_errors for r in done), "groups_dropped": dropped, "groups_empty": empty,
                  "trained_sequences": len(usable),
                  "rollout_seconds": round(batch.seconds, 3), "rollout_tokens_per_s": round(batch.tokens_per_s, 1),
                  "update_seconds": round(update_seconds, 3), "lr": self.optimizer.lr(), **update}
        return record

    # ---- rollouts and rewards ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def _rollouts(self, tasks: list[Task], group_size: int, temperature: float, step: int) -> RolloutBatch:
        self.model.set_numerics(FP32).eval()
        try:
            return generate_groups(self.runtime, tasks, group_size, self.cfg.max_tokens, temperature,
                                   tuple(self.cfg.stop or ()), self.cfg.seed, step, self.cfg.max_turns,
                                   self.chat_format)
        finally:
            self.model.set_numerics(FINETUNE).train()

    def _score(self, rollout: Rollout) -> float | None:
        """The sample's reward (+ the overlong penalty); None for a sample the engine failed (logged)."""
        if rollout.error is not None:
            log.warning("%s: a rollout failed (%s); left out of the update", rollout.task.where, rollout.error)
            return None
        score = self.reward(rollout.task, rollout.text)
        if score.problem is not None and score.value == 0:
            log.warning("%s: reward 0: %s", rollout.task.where, score.problem)
        return score.value + overlong_penalty(rollout.generated, self.cfg.max_tokens,
                                              self.cfg.overlong_buffer)

    def evaluate(self) -> dict[str, Any]:
        """The held-out tasks, one greedy completion each: mean reward and solved share (reward >= 1)."""
        batch = self._rollouts(self.eval_tasks, 1, 0.0, 0)
        scores = [0.0 if g[0].error is not None else self.reward(g[0].task, g[0].text).value for g in batch.groups]
        record = {"step": self.step, "eval_reward": _round(_mean(scores)),
                  "eval_solved": _round(_mean([float(s >= 1.0) for s in scores])), "eval_tasks": len(scores)}
        self.run.append_metrics(record)
        if self.cfg.progress:
            print(f"step {self.step}: held-out solved {record['eval_solved']:.3f} of {len(scores)}, mean reward "
                  f"{record['eval_reward']:.3f}")
        return record

    # ---- the update -----------------------------------------------------------------------------------------------
    def _update(self, samples: list[tuple[Rollout, float]]) -> dict[str, Any]:
        cfg = self.cfg
        with torch.no_grad():
            old = self._logprobs([r for r, _ in samples], grad=False)
            ref = None
            if cfg.kl_coef:
                with adapters_off(self.model):
                    ref = self._logprobs([r for r, _ in samples], grad=False)
        sampler_gap = _mean([abs(a - b) for (r, _), lp in zip(samples, old)
                             for a, b, t in zip(r.logprobs, lp.tolist(), r.trained) if t])
        order = list(range(len(samples)))
        random.Random(cfg.seed * 104_729 + self.step).shuffle(order)
        minibatches = [order[i::cfg.updates_per_step] for i in range(cfg.updates_per_step)]
        totals = {"loss": 0.0, "tokens": 0, "clipped": 0.0, "kl": 0.0, "entropy": 0.0, "ratio_max": 1.0}
        grad_norm = 0.0
        self.optimizer.set_lr_multiplier(self.schedule.multiplier(self.step))
        for minibatch in (m for m in minibatches if m):
            self.optimizer.zero_grad()
            mask_total = sum(samples[i][0].generated for i in minibatch)
            normalizer = float(mask_total) if cfg.aggregation == "token" else float(len(minibatch))
            for part in self._micro_batches(minibatch, [samples[i][0] for i in minibatch]):
                rollouts = [samples[i][0] for i in part]
                logp, entropy, mask = self._logprobs(rollouts, grad=True)
                width = logp.shape[1]
                parts = policy_loss(logp, _stack([old[i] for i in part], width, logp.device),
                                    torch.tensor([samples[i][1] for i in part], device=logp.device), mask,
                                    cfg.clip_low, cfg.clip_high, cfg.kl_coef,
                                    None if ref is None else _stack([ref[i] for i in part], width, logp.device),
                                    cfg.aggregation, normalizer)
                parts.loss.backward()
                totals["loss"] += float(parts.loss.detach())
                totals["tokens"] += parts.tokens
                totals["clipped"] += parts.clipped
                totals["kl"] += parts.kl
                totals["entropy"] += float((entropy * mask).sum())
                totals["ratio_max"] = max(totals["ratio_max"], parts.ratio_max)
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip) if cfg.grad_clip > 0 else \
                torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params]))
            grad_norm = max(grad_norm, float(norm))
            if not math.isfinite(float(norm)):
                raise OpenflashError(f"the RL gradient became {float(norm)} at step {self.step + 1}; lower --lr "
                                     f"(now {cfg.lr}); the last checkpoint is kept")
            # The first mini-batch's ratio is 1 everywhere (old = current), so nothing is clipped: a zero gradient
            # with non-zero advantages means saturated logits (an adapter blown up by the learning rate).
            if minibatch is minibatches[0] and float(norm) == 0 and any(samples[i][1] != 0 for i in minibatch):
                raise OpenflashError(f"the RL update collapsed at step {self.step + 1}: gradient 0 with non-zero "
                                     f"advantages (saturated logits); lower --lr (now {cfg.lr}); the last "
                                     "checkpoint is kept")
            self.optimizer.step()
            if not all(bool(torch.isfinite(p).all()) for p in self.params):
                raise OpenflashError(f"the adapter's weights became non-finite at step {self.step + 1}; lower --lr "
                                     f"(now {cfg.lr}); the last checkpoint is kept")
        reset_expert_loads(self.model)
        tokens = max(totals["tokens"], 1)
        return {"policy_loss": _round(totals["loss"] / len([m for m in minibatches if m])),
                "kl": _round(totals["kl"] / tokens), "clip_fraction": _round(totals["clipped"] / tokens),
                "entropy": _round(totals["entropy"] / tokens), "ratio_max": _round(totals["ratio_max"]),
                "grad_norm": _round(grad_norm), "sampler_logprob_gap": _round(sampler_gap)}

    def _micro_batches(self, items: list, rollouts: list[Rollout]) -> list[list]:
        """`items` (one per rollout) cut in order into training forwards of at most --micro-batch sequences and
        --micro-batch-tokens padded tokens (sequences x the longest), one sequence at least."""
        parts: list[list] = [[]]
        longest = 0
        for item, r in zip(items, rollouts):
            n = len(r.task.prompt_ids) + len(r.completion_ids)
            part = parts[-1]
            if part and (len(part) == self.cfg.micro_batch or
                         (len(part) + 1) * max(longest, n) > self.cfg.micro_batch_tokens):
                parts.append(part := [])
                longest = 0
            part.append(item)
            longest = max(longest, n)
        return [p for p in parts if p]

    def _logprobs(self, rollouts: list[Rollout], grad: bool) -> Any:
        """The training forward's log-probs of each rollout's completion tokens: with grad, (logp [B, T], entropy
        [B, T], mask [B, T]) of the rollouts as one batch; without, a list of 1-D tensors, one per rollout, computed
        a micro-batch at a time."""
        if not grad:
            out = []
            for part in self._micro_batches(rollouts, rollouts):
                logp, _, _ = self._logprobs(part, grad=True)
                out.extend(logp[i, :len(r.completion_ids)].detach() for i, r in enumerate(part))
            return out
        seqs = [list(r.task.prompt_ids) + r.completion_ids for r in rollouts]
        width = max(len(r.completion_ids) for r in rollouts)
        ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)  # right-padded: causal
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
        # Only the completion's logits: a long prompt's over every position would be S x vocabulary floats a row.
        at, target_pos, valid = completion_positions(ids.shape[1], [len(r.task.prompt_ids) for r in rollouts],
                                                     [len(r.completion_ids) for r in rollouts], width)
        logits = self.runtime.forward(ids, logits_at=at).logits
        logp, entropy = picked_logprobs(logits, ids.gather(1, target_pos).to(logits.device), valid.to(logits.device),
                                        self.cfg.temperature)
        mask = torch.zeros(len(rollouts), width, dtype=torch.bool)  # the tokens the model wrote
        for i, r in enumerate(rollouts):
            mask[i, :len(r.trained)] = torch.tensor(r.trained, dtype=torch.bool)
        return logp, entropy, mask.to(logp.device)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def _save(self) -> Path:
        cfg = self.cfg
        if self._last_saved_step == self.step:
            return self.run.path / "checkpoints" / f"step_{self.step:08d}"
        state = {"step": self.step, "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state(),
                 "train_args": asdict(cfg)}
        weights = adapter_weights(self.model)

        def write(folder: Path) -> None:
            write_adapter(folder, weights, cfg.lora, lora_alpha(cfg.lora, cfg.lora_alpha), cfg.init, self.base)
            self.runtime.tokenizer.save(str(folder / "tokenizer.json"))
            torch.save(state, folder / STATE_FILE)
            write_manifest(folder)

        final = self.run.save(self.step, write, cfg.keep_checkpoints)
        self._last_saved_step = self.step
        return final

    def _load(self, checkpoint: Path) -> None:
        load_adapter_weights(self.model, read_adapter(checkpoint), checkpoint)
        state = read_trainer_state(checkpoint)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError, RuntimeError) as exc:
            raise OpenflashError(f"{checkpoint / STATE_FILE}: optimizer state does not fit the adapter ({exc})") \
                from None
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self._last_saved_step = self.step


def _stack(rows: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(rows), width, device=device)
    for i, row in enumerate(rows):
        out[i, :row.numel()] = row.to(device)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def _round(value: float) -> float:
    return round(float(value), 6)
