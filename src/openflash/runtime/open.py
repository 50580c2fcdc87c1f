"""`open_model`: a preset, a checkpoint folder or a training run folder opened as a placed `Runtime`."""

from __future__ import annotations

from typing import Any

import torch

from openflash.checkpoint import build_model, checkpoint_folder, load_checkpoint
from openflash.config import PRESETS, load_config
from openflash.errors import CheckpointError
from openflash.memory.experts import ExpertStore
from openflash.model.compiled import check_toolchain
from openflash.model.numerics import NUMERICS
from openflash.runtime.placement import Placement
from openflash.runtime.runtime import DISK_ROW_CACHE_BYTES, Runtime
from openflash.tokenizer import load_tokenizer, preset_tokenizer


def open_model(spec: str, tokenizer: str | None = None, numerics: str = "fp32",
               placement: Placement | None = None, *, verify: bool = False, expert_group: Any = None) -> Runtime:
    """The runtime (runtime.py: the model in eval mode, its tokenizer, Engram memory and expert store) of a preset
    name (random weights, seed 0, for smoke tests and benchmarks), a checkpoint folder or a training run folder (its
    latest checkpoint), placed as `placement` says (placement.py: device, weights, experts' and Engram tables'
    tiers, compiled backend; default: the defaults there). The Engram tables of a checkpoint whose tier is not the
    device are never loaded into the model: the host tier reads them from the checkpoint, the disk tier from table
    files.
    verify: first check the checkpoint against its checksums.sha256 (and the disk tier's table files)."""
    placement = placement if placement is not None else Placement()
    if numerics not in NUMERICS:
        raise CheckpointError(f"numerics must be one of {list(NUMERICS)}, got {numerics!r}")
    device = placement.torch_device
    policy = NUMERICS[numerics].with_compile(placement.compile)
    if placement.compile:
        check_toolchain(device)
    if placement.expert_direct_io and placement.experts == "device":
        raise CheckpointError("--expert-direct-io reads routed experts from the shards: it needs --expert-placement "
                              "host or disk")
    folder = None if spec in PRESETS else checkpoint_folder(spec)
    tier = placement.engram_tier(load_config(spec if folder is None else folder).weight_dtype == "fp8")
    if folder is None:
        if placement.experts != "device":
            raise CheckpointError(f"--expert-placement {placement.experts} reads experts from a checkpoint's shards; "
                                  f"preset {spec!r} has none (write one with `openflash checkpoint synth {spec} DIR`)")
        cfg = load_config(spec)
        tok = load_tokenizer(tokenizer) if tokenizer else preset_tokenizer(cfg)  # ids within the preset's vocabulary
        torch.manual_seed(0)
        runtime = Runtime.of(build_model(cfg, policy, device=device).eval(), tok,
                             note=f"preset '{spec}' with random weights (outputs are noise)",
                             tokenizer_source=f"--tokenizer {tokenizer}" if tokenizer else
                             f"preset {spec!r}'s cut of the DeepSeek tokenizer")
    else:
        offload = placement.experts != "device"
        model, report = load_checkpoint(folder, device=device, numerics=policy, tokenizer_path=tokenizer,
                                        verify=verify, weights=placement.weights, skip_experts=offload,
                                        skip_engram_tables=tier != "device")
        store = ExpertStore(folder, model.cfg, model.numerics, placement.experts, placement.expert_cache_bytes,
                            device, group=expert_group, prefetch=placement.expert_prefetch,
                            direct_io=placement.expert_direct_io) if offload else None
        cache = placement.expert_cache_bytes
        note = report.summary() + (f"; routed experts on {placement.experts}" +
                                   (f" (cache {cache} bytes)" if cache else "") if offload else "")
        runtime = Runtime.of(model, report.tokenizer, frontend=report.engram_frontend, experts=store, note=note,
                             tokenizer_source=report.tokenizer_source, folder=folder)
    runtime.place_engram(tier, table_dir=placement.engram_table_dir,
                         cache_bytes=placement.engram_cache_bytes or DISK_ROW_CACHE_BYTES,
                         io_threads=placement.engram_io_threads, verify=verify)
    return runtime
