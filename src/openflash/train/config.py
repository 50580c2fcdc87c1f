"""A training run's arguments (`TrainConfig`, validated as built: every refusal names the flag) and the model config
a new run trains with a given tokenizer (`training_model_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openflash.config import FlashConfig, load_config
from openflash.errors import OpenflashError
from openflash.memory.tokenmap import build_compressed_token_map
from openflash.tokenizer import load_tokenizer

# Arguments a resumed run must share with the run it continues (the rest may change, e.g. --steps).
RESUME_FIXED = ("config", "batch_size", "seq_len", "seed", "optimizer", "indexer_warmup", "init", "lora", "lora_alpha",
                "lora_targets", "train_engram")


@dataclass
class TrainConfig:
    data: str  # folder written by `openflash data prepare`
    out: str  # run folder
    config: str | None = None  # preset name or config.json of a new model (default small); with init: none
    steps: int = 1000
    batch_size: int = 8  # global, split across ranks
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    indexer_warmup: int = 0
    indexer_loss_weight: float = 0.01
    optimizer: str = "adamw"
    weight_decay: float = 0.1
    engram_lr_mult: float = 5.0
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3
    eval_every: int = 100  # 0: only before and after training
    eval_batches: int = 8
    save_every: int = 200  # 0: only at the end
    keep_checkpoints: int = 1
    max_minutes: float | None = None
    steps_from_budget: bool = False  # time-budgeted: after a few timed steps, steps = what fits in max_minutes
    adaptive_threads: bool = False  # re-pick the torch thread count from step times (shared machines; see ThreadTuner)
    resume: bool = False
    verify: bool = True  # a resumed run first checks its checkpoint against the checksums.sha256 it wrote
    verify_init: bool = False  # check the init checkpoint against its checksums.sha256 before training on it
    seed: int = 0
    progress: bool = True
    log_to: tuple[str, ...] = ("tensorboard",)  # besides metrics.jsonl (files/metric_sinks.py); () for none
    compile: bool = False  # each block's training forward and backward through torch.compile (compiled_blocks.py)
    init: str | None = None  # fine-tune: start from this checkpoint, run folder or preset (train/finetune.py)
    lora: int | None = None  # LoRA rank: adapters on --init kept frozen as stored; checkpoints hold the adapters
    lora_alpha: float | None = None  # default 2 * rank
    lora_targets: list[str] | None = None  # regular expressions over module names (default model/lora.py's)
    checkpoint_activations: bool = False  # keep each block's inputs only; its forward reruns in the backward
    train_engram: bool = False  # with lora: the Engram rows batches touch train too (sparse, model/engram_rows.py)
    device: str = "auto"  # placement.resolve_device: the first CUDA device (under torchrun the rank's) or the CPU
    autocast: str = "off"  # "bf16": forward and backward under torch.autocast to bf16 (CUDA), master weights fp32

    def __post_init__(self) -> None:
        if self.init is not None and self.config is not None:
            raise OpenflashError(f"--config {self.config} with --init {self.init}: a fine-tuning run takes its model's "
                                 f"config from --init; leave --config out")
        if self.init is None and self.config is None:
            self.config = "small"
        if self.autocast not in ("off", "bf16"):
            raise OpenflashError(f"--autocast must be off or bf16, got {self.autocast!r}")
        if self.verify_init and self.init is None:
            raise OpenflashError("--verify checks the --init checkpoint; this run has none")
        for name in ("steps", "batch_size", "seq_len", "eval_batches", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise OpenflashError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("warmup", "indexer_warmup", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise OpenflashError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise OpenflashError(f"--lr must be positive, got {self.lr}")
        if self.indexer_warmup >= self.steps and not self.steps_from_budget:
            raise OpenflashError(f"--indexer-warmup ({self.indexer_warmup}) must be smaller than --steps "
                                 f"({self.steps}): the main model would never train")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise OpenflashError(f"--max-minutes must be positive, got {self.max_minutes}")
        if self.steps_from_budget and self.max_minutes is None:
            raise OpenflashError("a time-budgeted run needs max_minutes")
        if self.lora is not None:
            if self.lora < 1:
                raise OpenflashError(f"--lora (the adapter rank) must be >= 1, got {self.lora}")
            if self.init is None:
                raise OpenflashError("--lora trains adapters on a model: give it with --init MODEL")
            if self.indexer_warmup:
                raise OpenflashError("--lora keeps the indexer frozen; --indexer-warmup does not apply")
            if self.compile:
                raise OpenflashError("--lora trains through the stored weights eagerly; --compile does not apply")
        elif self.lora_alpha is not None or self.lora_targets or self.train_engram:
            raise OpenflashError("--lora-alpha, --lora-targets and --train-engram need --lora RANK (full "
                                 "fine-tuning trains the Engram tables anyway)")
        if self.compile and self.checkpoint_activations:
            raise OpenflashError("--checkpoint-activations reruns the eager blocks; it does not combine with --compile")
        if self.compile and self.adaptive_threads:
            # Inductor's CPU kernels fix their thread count when they are built: re-picking it would not reach them.
            raise OpenflashError("--compile builds its kernels for one thread count; it cannot run with adaptive "
                                 "threads (set the count with OMP_NUM_THREADS instead)")


def training_model_config(config: str | Path, tokenizer_path: str | Path) -> FlashConfig:
    """The model config for training with a given tokenizer: its vocabulary, its compressed Engram token map,
    no image token, and fp32 ("float") storage for every weight."""
    cfg = load_config(config)
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    changes: dict[str, Any] = dict(vocab_size=vocab, image_token_id=None, weight_dtype="fp32", expert_dtype="fp32")
    if cfg.engram_layer_ids:
        token_map = build_compressed_token_map(tokenizer, vocab)
        changes["engram_compressed_vocab_size"] = int(token_map.max()) + 1
    return cfg.replace(**changes)


__all__ = ["TrainConfig", "RESUME_FIXED", "training_model_config"]
