"""Engine replicas in lockstep: serving with expert parallelism.

With `--expert-parallel N` every rank holds the whole model but 1/N of each layer's routed experts, and each MoE
layer sums the ranks' expert outputs with one all_reduce (memory/experts.py). So every rank must run the same model
calls on the same tokens, in the same order. Each rank runs its own engine (scheduler, caches, prefix cache): the
leader (rank 0, the one with the HTTP server) sends what enters and leaves before each step, the requests that
arrived and the aborts, and every rank applies them and steps. Scheduling, sampling (each request's seed is fixed
by the leader) and the all_reduced logits are deterministic and equal on every rank, so the replicas never drift
apart, and only the leader delivers outputs.

The message goes out with `torch.distributed.broadcast_object_list` (gloo on CPU; on NCCL through the current
device). An idle leader still steps every KEEPALIVE_SECONDS with nothing to do, so that followers waiting in the
broadcast do not reach the process group's timeout; shutting down, it sends `stop`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from openflash.engine.request import Sequence
from openflash.engine.sampling import SamplingParams
from openflash.model.lora import BASE
from openflash.vision.prompt import PromptImage

KEEPALIVE_SECONDS = 60.0  # an idle leader's empty steps, well inside the process group's timeout (30 min default)


class LockstepError(RuntimeError):
    """The group's step link broke: this rank's engine cannot go on without its replicas."""


@dataclass
class RequestSpec:
    """What a follower needs to create the leader's request: everything that decides its tokens."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # with its seed set when it samples
    eos_token_id: int | None
    images: list[PromptImage] = field(default_factory=list)
    adapter: int = BASE  # LoRA adapter slot (none)

    @classmethod
    def of(cls, seq: Sequence) -> "RequestSpec":
        return cls(seq.request_id, seq.prompt_ids, seq.params, seq.eos_token_id, seq.images, seq.adapter)


@dataclass
class StepInputs:
    """What changes the engines' state before a step, as the leader saw it."""

    arrivals: list[RequestSpec] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    abort_all: bool = False  # shutdown: cancel everything still running
    stop: bool = False  # the leader stopped: followers return


class Lockstep:
    """This rank's end of the broadcast: the leader's `share` sends, a follower's receives."""

    def __init__(self, rank: int, world_size: int) -> None:
        if world_size < 2:
            raise ValueError(f"lockstep needs a process group of at least 2 ranks, got {world_size}")
        self.rank, self.world_size = rank, world_size

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, inputs: StepInputs | None) -> StepInputs:
        """The leader's inputs (given on the leader, None on a follower), on every rank; a broken link is a
        LockstepError (this rank's engine cannot go on without its replicas)."""
        box = [inputs if self.leader else None]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception as exc:
            raise LockstepError(f"the expert-parallel group lost its step link ({type(exc).__name__}: {exc}); "
                                f"this rank stops") from exc
        return box[0]

    def intake(self, arrived: list[Sequence], aborts: list[str], abort_all: bool) -> StepInputs:
        """A step's intake on every rank: the leader shares the requests that arrived (as RequestSpec) and its
        aborts; a follower gets them to apply (its own arguments are empty)."""
        return self.share(StepInputs([RequestSpec.of(s) for s in arrived], aborts, abort_all) if self.leader
                          else None)


__all__ = ["Lockstep", "LockstepError", "StepInputs", "RequestSpec", "KEEPALIVE_SECONDS"]
