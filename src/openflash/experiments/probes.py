"""Measurements on trained models: LogitLens and CKA per layer, CSA2 top-k agreement, bounded-replay NLL.

All of them read the model through its public seams: `forward(..., probe=)` for named intermediates (the same
Probe protocol parity.py implements) and `step` for incremental inference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from openflash.errors import OpenflashError
from openflash.model.mhc import collapse
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.runtime.runtime import Runtime
from openflash.topology import LayerMode
from openflash.train.dataset import TokenDataset, eval_batches


@dataclass
class Recorder:
    """A Probe that keeps the intermediates whose names start with one of `prefixes`."""

    prefixes: tuple[str, ...]
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    def record(self, name: str, value: torch.Tensor) -> None:
        if name.startswith(self.prefixes):
            self.values[name] = value.detach()

    def force(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return value


def load_trained(checkpoint: Path) -> Runtime:
    return open_model(str(checkpoint), placement=Placement(weights="dequantized"))


def validation_windows(data_dir: Path, windows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`windows` non-overlapping windows of the validation split, spread evenly over it (its files differ in
    style: the first few would be one file): inputs and targets [N, length]."""
    dataset = TokenDataset(data_dir, "val")
    available = (dataset.num_tokens - 1) // length
    if available < windows:
        raise OpenflashError(f"{data_dir}: the validation split has {available} windows of {length + 1} tokens, "
                             f"fewer than the {windows} a probe reads")
    inputs, targets = eval_batches(dataset, available, length, 1)[0]
    pick = torch.linspace(0, available - 1, windows).round().long()
    return inputs[pick], targets[pick]


# ---- depth probe ----------------------------------------------------------------------------------------------

@torch.no_grad()
def layer_states(trained: Runtime, inputs: torch.Tensor,
                 targets: torch.Tensor) -> tuple[list[torch.Tensor], list[float]]:
    """Per layer: its output read out as the model reads its last layer's (the mHC streams collapsed with the
    block's own pre weights) [N*S, D], and the LogitLens loss of that read-out (the final norm and head applied
    to it; the last layer's is the model's own loss)."""
    model = trained.model
    probe = Recorder(("block",))
    trained.forward(inputs, targets, probe=probe)
    states, lens = [], []
    for i in range(len(model.layers)):
        h = collapse(probe.values[f"block{i}.out"], probe.values[f"block{i}.pre"], model.numerics)  # [N, S, D]
        logits = model.head(model.norm(h).float())
        lens.append(float(F.cross_entropy(logits.flatten(0, 1), targets.flatten())))
        states.append(h.flatten(0, 1))
    return states, lens


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of two representations of the same N examples [N, Dx], [N, Dy] (Kornblith et al. 2019)."""
    x = (x - x.mean(0)).double()
    y = (y - y.mean(0)).double()
    cross = (x.T @ y).pow(2).sum()
    return float(cross / ((x.T @ x).pow(2).sum().sqrt() * (y.T @ y).pow(2).sum().sqrt()))


# ---- CSA2 reuse -----------------------------------------------------------------------------------------------

def reuse_pairs(topology) -> list[tuple[int, int, str]]:
    """(layer, the layer whose top-k it reads, its mode) for every layer of a released-style topology that does not
    choose its own top-k from its own keys: REUSE layers (read their owner's selection) and REINDEX layers (own
    indexer over another layer's keys)."""
    pairs = []
    for t in topology.layers:
        if t.mode == LayerMode.REUSE and t.topk_owner is not None:
            pairs.append((t.index, t.topk_owner, "REUSE"))
        elif t.mode == LayerMode.REINDEX and t.kv_owner is not None:
            pairs.append((t.index, t.kv_owner, "REINDEX"))
    return pairs


@torch.no_grad()
def topk_agreement(trained: Runtime, inputs: torch.Tensor, pairs: list[tuple[int, int, str]]) -> list[dict]:
    """In a model where every compressed layer picks its own top-k (all-full), how much of layer j's selection
    equals that of the layer it would read under the released topology. Over queries that see more entries than
    k (otherwise both pick everything); `chance` is the overlap two uniform random selections would have."""
    model = trained.model
    probe = Recorder(("indexer",))
    trained.forward(inputs, probe=probe)
    ratios = model.cfg.compress_ratios
    out = []
    for layer, owner, mode in pairs:
        a, b = probe.values[f"indexer{layer}.topk"], probe.values[f"indexer{owner}.topk"]
        k = a.shape[-1]
        visible = (torch.arange(inputs.shape[1]) + 1) // ratios[layer]  # entries a query at position s can see
        rows = (visible > k).expand(inputs.shape[0], -1)
        same = ((a.unsqueeze(-1) == b.unsqueeze(-2)) & (a.unsqueeze(-1) >= 0)).any(-1).sum(-1).float()
        agreement = (same / (a >= 0).sum(-1).clamp(min=1))[rows]
        chance = (k / visible.float()).expand_as(rows)[rows]
        out.append({"layer": layer, "reads_from": owner, "mode": mode, "agreement": float(agreement.mean()),
                    "chance": float(chance.mean()), "queries": int(rows.sum())})
    return out


# ---- CED bounded replay ---------------------------------------------------------------------------------------

@torch.no_grad()
def replay_nll(trained: Runtime, windows: torch.Tensor, prompt_len: int, decode: int) -> dict:
    """Prefill windows[:, :prompt_len] exactly and with bounded replay, then teacher-force `decode` more tokens
    from each cache. Per position after the prompt: mean NLL of both and the mean |difference|; plus the KL
    divergence exact || bounded of the first predicted token."""
    per_mode: dict[str, list[torch.Tensor]] = {}
    first: dict[str, torch.Tensor] = {}
    for mode in ("exact", "bounded"):
        cache = trained.new_cache(windows.shape[0])
        prompt = windows[:, :prompt_len]
        logits = trained.step(prompt, cache, mode=mode)
        first[mode] = logits.log_softmax(-1)
        nll = []
        for t in range(decode + 1):
            target = windows[:, prompt_len + t]
            nll.append(-logits.log_softmax(-1).gather(-1, target[:, None])[:, 0])
            if t < decode:
                logits = trained.decode(target, cache)
        per_mode[mode] = torch.stack(nll, 1)  # [N, decode + 1]
    exact, bounded = per_mode["exact"], per_mode["bounded"]
    kl = (first["exact"].exp() * (first["exact"] - first["bounded"])).sum(-1)
    return {"prompt_len": prompt_len, "nll_exact": exact.mean(0).tolist(), "nll_bounded": bounded.mean(0).tolist(),
            "abs_diff": (exact - bounded).abs().mean(0).tolist(), "kl_first": float(kl.mean()),
            "windows": int(windows.shape[0])}
