"""What a run trains, as one of two strategies the trainer holds (trainer.py declares the `Tuning` protocol and never
asks which one it has):

- `FullTuning`: every weight in fp32 trains, the router's load-balancing bias included; a new run builds the model
  (a preset's config, or an --init checkpoint dequantized: finetune.init_model) and checkpoints are whole models
  (fp32, official names).
- `LoRATuning` (`--lora RANK`): the --init checkpoint stays frozen as stored and fp32 adapters train
  (finetune.lora_model, read again on every start: checkpoints hold only the adapters, PEFT layout, with the Engram
  rows trained by --train-engram); under torchrun the base and adapters are sharded over the ranks (FSDP2).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from openflash.checkpoint import build_model, save_checkpoint
from openflash.config import FlashConfig, load_config
from openflash.errors import OpenflashError
from openflash.files.peft import read_adapter, read_engram_rows, write_adapter, write_engram_rows
from openflash.files.run_dir import read_checkpoint_weights
from openflash.memory.frontend import EngramFrontend
from openflash.memory.tokenmap import find_token_map_file
from openflash.model.engram_rows import TrainedRows
from openflash.model.lora import adapter_weights, lora_alpha
from openflash.model.numerics import Numerics
from openflash.model.transformer import Transformer
from openflash.runtime.runtime import Runtime
from openflash.train.config import TrainConfig
from openflash.train.dataset import TokenDataset
from openflash.train.distributed import DistContext
from openflash.train.finetune import init_model, load_adapter_weights, lora_model
from openflash.train.sharded import full_tensors, shard_lora_model


@dataclass
class Built:
    """A run's model as its strategy built it."""

    model: Transformer
    runtime: Runtime | None  # the runtime it was opened in (LoRA: the base's tokenizer and Engram memory), or None
    token_map_file: Path | None  # the Engram token map copied into every checkpoint (None: the tokenizer's own)
    frontend: EngramFrontend | None  # the Engram frontend that came with an --init checkpoint, or None


@dataclass
class RunModel:
    """What a strategy's build needs to know of the run."""

    init: str | None  # the checkpoint to start from (a resumed LoRA run: the base it began on), or None
    config: FlashConfig | None  # a full run's model config (new from a preset, or its checkpoint's on resume)
    data: TokenDataset
    numerics: Numerics
    device: torch.device
    resume_from: Path | None


class FullTuning:
    updates_router_bias = True

    def resumed_config(self, checkpoint: Path) -> FlashConfig | None:
        """The model config a resumed run rebuilds from: the checkpoint's own."""
        return load_config(checkpoint)

    def build(self, run: RunModel) -> Built:
        if run.init is not None and run.resume_from is None:
            model, frontend, folder = init_model(run.init, run.data, run.numerics, run.device)
            return Built(model, None, find_token_map_file(folder) if folder is not None else None, frontend)
        token_map = find_token_map_file(run.resume_from) if run.resume_from is not None else None
        return Built(build_model(run.config, run.numerics, device=run.device), None, token_map, None)

    def distribute(self, model: Transformer, ctx: DistContext, resume_from: Path | None,
                   trained_rows: dict[str, TrainedRows]) -> bool:
        """Every rank starts from rank 0's weights (a resumed run reads the same checkpoint on each); never sharded."""
        if resume_from is None:
            ctx.broadcast_module_(model)
        return False

    def gather(self, model: Transformer, sharded: bool) -> dict[str, torch.Tensor]:
        return {}  # the model itself is what a checkpoint saves

    def write(self, folder: Path, model: Transformer, gathered: dict[str, torch.Tensor],
              trained_rows: dict[str, TrainedRows], tokenizer_path: Path) -> None:
        save_checkpoint(model, folder, dtype="fp32", tokenizer_json=tokenizer_path)

    def load(self, checkpoint: Path, model: Transformer, trained_rows: dict[str, TrainedRows], sharded: bool) -> None:
        model.load_state_dict(read_checkpoint_weights(checkpoint, model.state_dict()))


@dataclass
class LoRATuning:
    cfg: TrainConfig
    base: dict[str, str] | None  # the checkpoint trained on, {"path", "fingerprint"} (finetune.fine_tune_base)
    updates_router_bias = False  # the base, router bias included, stays frozen

    def resumed_config(self, checkpoint: Path) -> FlashConfig | None:
        return None  # the model is its --init's, read again on every start

    def build(self, run: RunModel) -> Built:
        cfg = self.cfg
        runtime = lora_model(run.init, run.data, cfg.lora, cfg.lora_alpha, cfg.lora_targets, cfg.train_engram,
                             run.device)
        return Built(runtime.model, runtime, None, None)

    def distribute(self, model: Transformer, ctx: DistContext, resume_from: Path | None,
                   trained_rows: dict[str, TrainedRows]) -> bool:
        """Under torchrun the base and the adapters are sharded over the ranks (FSDP2, which also averages the
        gradients); the adapters are made equal first (resumed: loaded whole, before sharding). True: sharded."""
        if not ctx.enabled:
            return False
        if trained_rows:
            raise OpenflashError("--train-engram runs in one process: each rank would train other rows")
        if resume_from is not None:
            load_adapter_weights(model, read_adapter(resume_from), resume_from)
        else:
            ctx.broadcast_([p for p in model.parameters() if p.requires_grad])
        shard_lora_model(model, ctx)
        return True

    def gather(self, model: Transformer, sharded: bool) -> dict[str, torch.Tensor]:
        """The adapters' weights, whole: every rank takes part where they are sharded."""
        adapters = adapter_weights(model)
        return full_tensors(adapters) if sharded else adapters

    def write(self, folder: Path, model: Transformer, gathered: dict[str, torch.Tensor],
              trained_rows: dict[str, TrainedRows], tokenizer_path: Path) -> None:
        cfg = self.cfg
        write_adapter(folder, gathered, cfg.lora, lora_alpha(cfg.lora, cfg.lora_alpha), cfg.init, self.base)
        if trained_rows:
            write_engram_rows(folder, {n: r.state_dict() for n, r in trained_rows.items()})
        shutil.copy(tokenizer_path, folder / "tokenizer.json")

    def load(self, checkpoint: Path, model: Transformer, trained_rows: dict[str, TrainedRows], sharded: bool) -> None:
        if not sharded:  # (a sharded run loaded them before sharding: `distribute`)
            load_adapter_weights(model, read_adapter(checkpoint), checkpoint)
        saved = read_engram_rows(checkpoint)
        if set(saved) != set(trained_rows):
            raise OpenflashError(f"{checkpoint}: trained Engram rows of {sorted(saved)}, this run trains "
                                 f"{sorted(trained_rows)}")
        for name, rows in saved.items():
            trained_rows[name].load_state_dict(rows)


def tuning_for(cfg: TrainConfig, base: dict[str, str] | None) -> FullTuning | LoRATuning:
    """The run's strategy: LoRA when --lora names a rank, else full training."""
    return LoRATuning(cfg, base) if cfg.lora is not None else FullTuning()


__all__ = ["Built", "RunModel", "FullTuning", "LoRATuning", "tuning_for"]
