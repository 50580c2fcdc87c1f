"""Fine-tuning from a checkpoint (`openflash train --init MODEL [--lora RANK]`).

Full fine-tuning (`init_model`): a checkpoint in the official layout holds FP8 dense weights, FP4 experts, FP8
Engram rows and bf16 tensors; it trains a model of the same architecture with every weight in fp32 ("float"
storage), initialised with the checkpoint's values dequantized exactly (checkpoint.md §4).

LoRA (`lora_model`): the checkpoint stays as stored ("stored" residency: FP8, FP4, bf16 bytes, never an fp32 copy),
frozen, under the `finetune` numerics (its activation and cache QDQs straight-through); fp32 adapters on the target
linears are all that trains (model/lora.py).

Either way its Engram addressing (the token map it carries, or its tokenizer's) comes along, and the data must have
been prepared with a tokenizer of its vocabulary.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from openflash import formats
from openflash.checkpoint import build_model, checkpoint_folder
from openflash.config import PRESETS, FlashConfig
from openflash.errors import OpenflashError
from openflash.files.manifest import folder_fingerprint, verify_manifest
from openflash.files.peft import BASE_FILE, Adapter, read_adapter
from openflash.memory.frontend import EngramFrontend
from openflash.model.adapters import add_lora
from openflash.model.engram_rows import TrainedRows
from openflash.model.engram_table import DeviceTable
from openflash.model.layers import Linear
from openflash.model.lora import DEFAULT_TARGETS, LoRA
from openflash.model.numerics import FINETUNE, Numerics
from openflash.model.transformer import Transformer
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.runtime.runtime import Runtime
from openflash.tokenizer import tokenizer_sha256
from openflash.train.config import TrainConfig
from openflash.train.dataset import TokenDataset

log = logging.getLogger("openflash.train")


def fp32_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's state with every stored weight as its fp32 value: quantized linears and bf16 matrices
    dequantized, FP8 Engram rows decoded; their scales dropped."""
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, Linear):
            state[prefix + "weight"] = module.dequantized_weight().detach().float().clone()
        elif isinstance(module, DeviceTable) and module.storage == "fp8":
            state[prefix + "weight"] = formats.dequantize_fp8_rows(module.weight, module.scale)
    for key, value in model.state_dict().items():
        owner = key.rsplit(".", 1)[0]
        if key not in state and not (key.endswith(".scale") and owner + ".weight" in state):
            state[key] = value.detach().float() if value.is_floating_point() else value
    return state


def init_model(init: str | Path, data: TokenDataset, numerics: Numerics,
               device: torch.device | str = "cpu") -> tuple[Transformer, EngramFrontend | None, Path | None]:
    """The checkpoint (or run folder, or preset) `init` as an fp32 model to train on `device` (its Engram tables in
    it: they train), its Engram frontend, and its folder (None for a preset). data: the prepared training data,
    whose tokenizer must be the model's."""
    runtime = open_model(str(init), numerics="fp32", placement=Placement(device="cpu", weights="dequantized",
                                                                         engram="device"))
    cfg: FlashConfig = runtime.cfg
    _check_tokenizer(runtime, init, data)
    model = build_model(cfg.replace(weight_dtype="fp32", expert_dtype="fp32"), numerics, device=device)
    missing, unexpected = model.load_state_dict(fp32_state(runtime.model), strict=False)
    if missing or unexpected:
        raise OpenflashError(f"--init {init}: its weights do not map onto an fp32 model of its config (missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]})")
    return model, runtime.frontend, runtime.folder


def lora_model(init: str | Path, data: TokenDataset | None, rank: int, alpha: float | None = None,
               targets: tuple[str, ...] | None = None, train_engram: bool = False,
               device: torch.device | str = "cpu") -> Runtime:
    """The checkpoint `init` kept as stored and frozen on `device`, with fresh fp32 LoRA adapters (`add_lora`) on
    `targets` (default: model/lora.py DEFAULT_TARGETS), in training mode, as a runtime. Engram tables exported
    beside the checkpoint (`engram_tables/`, as the released one ships) stay on the disk tier: frozen, they need no
    gradient, and the released ones would not fit in memory; next to a GPU, FP8 tables stay in host memory
    (runtime/placement.py's `auto`). data: the prepared training data, whose tokenizer must be the model's (None: the
    caller tokenizes with the model's own, as RL does). train_engram: the tables held in the model train too, only the rows batches touch
    (model/engram_rows.py)."""
    on_disk = Path(init).is_dir() and (Path(init) / "engram_tables").is_dir()
    if train_engram and on_disk:
        raise OpenflashError(f"--train-engram: {init}'s Engram tables are read from {Path(init) / 'engram_tables'} "
                             f"on the disk tier, where rows do not train; without that folder they load into memory")
    engram = "disk" if on_disk else "device" if train_engram else "auto"
    runtime = open_model(str(init), numerics="fp32",
                         placement=Placement(device=str(device), weights="stored", engram=engram))
    if data is not None:
        _check_tokenizer(runtime, init, data)
    runtime.model.set_numerics(FINETUNE).train()
    try:
        add_lora(runtime.model, rank, alpha, tuple(targets) if targets else DEFAULT_TARGETS)
    except ValueError as exc:
        raise OpenflashError(f"--lora: {exc}") from None
    if train_engram:
        tables = [m for m in runtime.model.modules() if isinstance(m, DeviceTable)]
        if not tables:
            raise OpenflashError(f"--train-engram: {init} has no Engram tables")
        for table in tables:
            table.trained = TrainedRows(table.dim, table.weight.device)
    return runtime


@torch.no_grad()
def load_adapter_weights(model: Transformer, adapter: Adapter, source: str | Path) -> None:
    """Copy a saved adapter (`read_adapter`) into the model's trained adapters (`add_lora`): the same modules and
    shapes, or an OpenflashError naming `source`."""
    own = {name: m.adapter for name, m in model.named_modules() if isinstance(m, Linear) and isinstance(m.adapter, LoRA)}
    if set(own) != set(adapter.weights):
        odd = sorted(set(own) ^ set(adapter.weights))
        raise OpenflashError(f"{source}: the adapter covers other modules than this run's --lora-targets "
                             f"(differing: {odd[:3]})")
    for name, (a, b) in adapter.weights.items():
        lora = own[name]
        if a.shape != lora.lora_A.shape or b.shape != lora.lora_B.shape:
            raise OpenflashError(f"{source}: {name} has A {list(a.shape)}, B {list(b.shape)}; this run's adapter has "
                                 f"A {list(lora.lora_A.shape)}, B {list(lora.lora_B.shape)}")
        lora.lora_A.copy_(a)
        lora.lora_B.copy_(b)


def _check_tokenizer(runtime: Runtime, init: str | Path, data: TokenDataset) -> None:
    if tokenizer_sha256(runtime.tokenizer) != data.tokenizer_sha256 or data.vocab_size > runtime.cfg.vocab_size:
        raise OpenflashError(f"--init {init}: {data.data_dir} was prepared with another tokenizer ({data.vocab_size} "
                             f"ids; the model has {runtime.cfg.vocab_size}): prepare it with the model's tokenizer "
                             f"({runtime.tokenizer_source})")


def fine_tune_base(cfg: TrainConfig, resume_from: Path | None) -> dict[str, str] | None:
    """The checkpoint a fine-tuning run trains on, as {"path", "fingerprint"} (None for a preset). A resumed LoRA run
    keeps the base it started on (its checkpoint's base_model.json), although --init (a run folder) may resolve to
    a newer checkpoint now; the recorded one is refused if its files changed. cfg.verify_init: checked against its
    checksums first."""
    recorded = None
    if resume_from is not None and cfg.lora is not None and (resume_from / BASE_FILE).is_file():
        recorded = read_adapter(resume_from).base
    if recorded is None and cfg.init in PRESETS:
        return None
    folder = Path(recorded["path"]) if recorded is not None else checkpoint_folder(cfg.init)
    if recorded is not None:
        if not folder.is_dir():
            raise OpenflashError(f"--resume: the base this run started on, {folder} "
                                 f"({resume_from / BASE_FILE}), is gone")
        now = checkpoint_folder(cfg.init) if cfg.init not in PRESETS else None
        if now is not None and now.resolve() != folder.resolve():
            log.warning("--resume: continuing on the base this run started on, %s (--init %s now means %s)",
                        folder, cfg.init, now)
    if cfg.verify_init:
        try:
            verify_manifest(folder)
        except OpenflashError as exc:
            raise OpenflashError(f"--verify: {exc}") from None
    fingerprint = folder_fingerprint(folder)
    if recorded is not None and recorded["fingerprint"] != fingerprint:
        raise OpenflashError(f"--resume: the base this run started on, {folder}, has changed since (its "
                             f"fingerprint differs from {resume_from / BASE_FILE}'s)")
    return {"path": str(folder.resolve()), "fingerprint": fingerprint}


__all__ = ["fp32_state", "init_model", "lora_model", "load_adapter_weights", "fine_tune_base"]
