"""An RL run's arguments (`RLConfig`), validated as built: every refusal names its flag."""

from __future__ import annotations

import math
from dataclasses import dataclass

from openflash.errors import OpenflashError

# Arguments a resumed run must share with the run it continues (the rest, --steps for one, may change).
RESUME_FIXED = ("init", "lora", "lora_alpha", "lora_targets", "tasks", "reward", "group_size", "prompts_per_step",
                "seed")
AGGREGATIONS = ("token", "sequence")
# A step's rollouts are sampled together, each with its own cache; past these a step would not fit a machine's memory
# at any width worth training, and a typo (a group of a billion) would hang for minutes before failing.
MAX_GROUP_SIZE, MAX_ROLLOUTS = 1024, 16384


@dataclass
class RLConfig:
    init: str  # the base: preset, checkpoint or run folder (kept frozen as stored)
    tasks: str  # tasks JSONL (rl/tasks.py)
    out: str  # run folder
    reward: str = "exact"  # exact | tests | MODULE:FUNCTION (rl/rewards.py)
    lora: int = 8  # the trained adapter's rank
    lora_alpha: float | None = None  # default 2 x rank
    lora_targets: list[str] | None = None  # default model/lora.py DEFAULT_TARGETS
    steps: int = 100
    prompts_per_step: int = 8  # tasks per step; each sampled group_size times
    group_size: int = 8  # G: completions per prompt, whose rewards are compared among themselves
    max_tokens: int = 64  # a completion's token budget (an episode's, over all its turns)
    max_turns: int = 4  # turns of a tool episode (a task without an environment has one)
    max_prompt_tokens: int = 8192  # longer task prompts are named and skipped at load
    stop: list[str] | None = None  # stop strings ending a completion
    temperature: float = 1.0  # the rollouts' (and the update's log-probs')
    lr: float = 1e-4
    warmup: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    updates_per_step: int = 1  # optimizer steps per batch of rollouts (its mini-batches); the ratio is clipped
    micro_batch: int = 8  # sequences per training forward (gradients accumulate over a mini-batch)
    # Padded tokens per training forward (one sequence at least): long prompts go fewer at a time, so an update's
    # memory follows the longest sequence, not the group size.
    micro_batch_tokens: int = 4096
    # The update keeps each block's inputs only and reruns its forward in the backward: agent and code prompts are
    # long, and an update's kept activations grow with them (docs/benchmarks.md); the rerun costs one forward more
    # per update, small beside a step's sampling.
    checkpoint_activations: bool = True
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO: a higher upper clip)
    clip_high: float = 0.2
    kl_coef: float = 0.0  # weight of the KL to the base (the adapter switched off); 0: no reference forward
    scale_advantages: bool = True  # divide by the group's std (GRPO); off: Dr. GRPO's mean-centred rewards
    drop_equal_groups: bool = False  # DAPO: skip groups whose rewards are all equal (they carry no signal)
    overlong_buffer: int = 0  # DAPO: linear penalty over the last N tokens of max_tokens, -1 past it; 0: off
    aggregation: str = "token"  # token: mean over all completion tokens (DAPO); sequence: per sequence, then mean
    answer_pattern: str | None = None  # exact: the answer is this regex's last match (its group 1 when it has one)
    reward_timeout: float = 5.0  # tests: seconds of one sandboxed run
    reward_memory: int = 512 << 20  # tests: bytes of address space
    eval_tasks: str | None = None  # held-out tasks: solved share (greedy) before training and at every eval
    eval_every: int = 0  # 0: before and after training only
    save_every: int = 50  # 0: at the end only
    keep_checkpoints: int = 1
    resume: bool = False
    verify_init: bool = False  # check the base checkpoint against its checksums.sha256 first
    seed: int = 0
    device: str = "auto"
    progress: bool = True
    log_to: tuple[str, ...] = ("tensorboard",)  # besides metrics.jsonl (files/metric_sinks.py); () for none

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "max_tokens", "max_turns", "max_prompt_tokens",
                     "lora", "updates_per_step", "micro_batch", "micro_batch_tokens", "keep_checkpoints"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise OpenflashError(f"--{name.replace('_', '-')} must be a positive integer, got "
                                     f"{getattr(self, name)!r}")
        if self.group_size < 2:
            raise OpenflashError(f"--group-size must be at least 2 (advantages compare a prompt's completions), "
                                 f"got {self.group_size}")
        for name in ("warmup", "eval_every", "save_every", "overlong_buffer"):
            if getattr(self, name) < 0:
                raise OpenflashError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.overlong_buffer >= self.max_tokens:
            raise OpenflashError(f"--overlong-buffer ({self.overlong_buffer}) must be smaller than --max-tokens "
                                 f"({self.max_tokens})")
        for name in ("lr", "temperature", "reward_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise OpenflashError(f"--{name.replace('_', '-')} must be a positive number, got {value!r}")
        for name in ("clip_low", "clip_high", "kl_coef", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise OpenflashError(f"--{name.replace('_', '-')} must be a number >= 0, got {value!r}")
        if self.clip_low >= 1:
            raise OpenflashError(f"--clip-low must be below 1 (the ratio's floor is 1 - clip-low), got {self.clip_low}")
        if self.aggregation not in AGGREGATIONS:
            raise OpenflashError(f"--aggregation must be one of {list(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.lora_alpha is not None and not (isinstance(self.lora_alpha, (int, float))
                                                and math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise OpenflashError(f"--lora-alpha must be a positive number, got {self.lora_alpha!r}")
        if not 0 <= self.seed < 2 ** 63:
            raise OpenflashError(f"--seed must be in [0, 2^63), got {self.seed}")
        if self.group_size > MAX_GROUP_SIZE or self.rollouts_per_step > MAX_ROLLOUTS:
            raise OpenflashError(f"--group-size {self.group_size} x --prompts-per-step {self.prompts_per_step} = "
                                 f"{self.rollouts_per_step} rollouts a step: at most {MAX_ROLLOUTS} (and a group of "
                                 f"at most {MAX_GROUP_SIZE}), each holding its cache while the step samples")
        if self.reward_memory < 64 << 20:
            raise OpenflashError(f"--reward-memory must be at least 64MiB (a Python interpreter), got "
                                 f"{self.reward_memory}")

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.group_size
