"""Data-parallel training over torch.distributed (gloo on CPU, nccl on GPUs).

Every rank holds the whole model and takes its rows of the global batch (`BatchLoader(rank, world_size)`). After
backward the gradients are averaged with one all_reduce over a flat buffer (deterministic, and experts that got
no tokens on some rank need no special handling, unlike DDP); MoE expert loads are summed before the router-bias
update, so every rank applies the same update. Only rank 0 writes files.

Launch with `torchrun --nproc_per_node N -m openflash.cli train ...` (the environment variables torchrun sets are
read by `init_from_env`), or from Python with `spawn(fn, world_size)`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls) -> "DistContext":
        """The running process group's rank and size (a single process when none is initialised)."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    # ---- collectives (no-ops in a single process) ---------------------------------------------------------
    def all_reduce_mean_(self, flat: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
        return flat

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def any_each(self, flags: list[bool]) -> list[bool]:
        """Each flag true on every rank if it is true on any rank (so all ranks stop at the same step)."""
        if not self.enabled:
            return list(flags)
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v > 0) for v in t.tolist()]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def broadcast_module_(self, module: nn.Module) -> None:
        """Make every rank start from rank 0's parameters and buffers."""
        self.broadcast_(list(module.parameters()) + list(module.buffers()))

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Make every rank hold rank 0's values of these tensors."""
        if self.enabled:
            for t in tensors:
                dist.broadcast(t.data, src=0)


def all_reduce_grads(params: list[nn.Parameter], ctx: DistContext) -> None:
    """Average gradients across ranks with one all_reduce over a flat copy (params without a grad count as 0)."""
    if not ctx.enabled or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    ctx.all_reduce_mean_(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def init_from_env(device: torch.device | None = None) -> DistContext:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
    a single process when WORLD_SIZE is unset or 1. device: this rank's (placement.resolve_device gives each rank
    its LOCAL_RANK's GPU): NCCL for a CUDA device, gloo for the CPU (default: the CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return DistContext.current()


def collective_device() -> torch.device:
    """Where a collective's tensors must be: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, threads: int, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(DistContext(rank, world_size), *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, threads_per_rank: int = 1) -> None:
    """Run fn(ctx, *args) in `world_size` fresh processes joined by a gloo group on 127.0.0.1 (CPU data-parallel).

    fn must be importable (a module-level function); results travel back through files or queues in args.
    """
    port = free_port()
    mp.start_processes(_worker, args=(world_size, port, threads_per_rank, fn, args), nprocs=world_size,
                       join=True, start_method="spawn")


__all__ = ["DistContext", "all_reduce_grads", "init_from_env", "collective_device", "spawn", "free_port"]
