"""`train --lora` over several processes (torchrun): the frozen base and the adapters sharded with FSDP2.

Each linear (its stored weight, scales and adapter), then the rest of the model, becomes one `fully_shard` unit:
every rank keeps 1/N of the rows of each weight (FP8 and FP4 codes, their scales, bf16 and fp32 tensors, the
adapters), all-gathers a unit's weights just before it runs and frees them after, in the forward and again in the
backward; the adapters' gradients are reduce-scattered (averaged over the ranks), and each rank's optimizer updates
its shard. Linears rather than blocks are the units because FSDP2 rebuilds the dataclasses among a unit's inputs
that hold tensors with gradients, and a block's step context must stay the one object every block writes to (CSA2:
later layers read what earlier ones publish there). The Engram tables stay whole on every rank: the memory reads
their rows outside the model's forward (they are frozen under LoRA).

FSDP2 reduces the gradients of every sharded parameter on every rank, so every adapter must get one on every rank:
the MoE calls each routed expert each step (an expert with no tokens gets an empty batch and gives zero
gradients), where a single process calls only the experts it routed to.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from openflash.model.engram_table import DeviceTable
from openflash.model.layers import Linear
from openflash.model.moe import MoE
from openflash.model.transformer import Transformer
from openflash.train.distributed import DistContext


def _as_frozen_parameters(module: nn.Module, names: tuple[str, ...]) -> None:
    """Stored weights are buffers (they never train); FSDP2 shards parameters: make them frozen parameters."""
    for name in names:
        if name in module._buffers:
            tensor = module._buffers.pop(name)
            module.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def shard_lora_model(model: Transformer, ctx: DistContext) -> None:
    """Shard `model` (adapters attached, base frozen) over the ranks of `ctx`'s process group, in place."""
    mesh = init_device_mesh(model.device.type, (ctx.world_size,))
    for module in model.modules():
        if isinstance(module, Linear):
            _as_frozen_parameters(module, ("weight", "scale"))
        elif isinstance(module, MoE):
            module.every_expert = True
    # wo_a's weight is read as grouped factors (attention.output), never called: it stays in the root unit.
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]:
        if not name.endswith(".wo_a"):
            fully_shard(linear, mesh=mesh)
    tables = {p for m in model.modules() if isinstance(m, DeviceTable) for p in m.parameters()}
    fully_shard(model, mesh=mesh, ignored_params=tables)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state gathered whole, keyed by parameter name (a collective: every rank calls it)."""
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """`full_optimizer_state`'s result back into a sharded optimizer (every rank calls it with the same state)."""
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def full_tensors(weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Sharded adapter weights gathered whole (a collective: every rank calls it)."""
    return {name: (a.full_tensor(), b.full_tensor()) for name, (a, b) in weights.items()}


__all__ = ["shard_lora_model", "full_tensors", "full_optimizer_state", "load_full_optimizer_state"]
