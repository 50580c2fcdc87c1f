"""Speculative decoding with the DSpark drafter: draft, verify in one batched target step, accept, roll back.

One round for every running sequence at once (rows at their own positions; anchor = the row's last sampled token,
not yet run by the target):
    draft   d_1..d_K after the anchor (model.draft: one call of the drafter's stages on the block)
    verify  the target on [anchor, d_1..d_K] (one step of K+1 tokens per row), logits of every position
    accept  the longest prefix the target agrees with, then one token of its own (correction or bonus):
            greedy: d_j is kept while it is the target's argmax; sampling: kept with probability
            min(1, p(d_j) / q(d_j)), the first rejected position resampled from norm(max(0, p - q)), so every
            committed token is distributed as the target's own sample (Leviathan et al. 2023; Chen et al. 2023)
    undo    what the rejected positions wrote (ModelCache.rollback: window rings, the compressor's open group,
            compressed entries, the Engram hash history); the drafter's rings get the committed positions
Rows accept different lengths; the batch stays one cache.

The acceptance rule is not in the reference (spec vision_and_dspark.md B.4: UNCERTAIN); this is the standard
rule, which keeps the output distribution the target's. The confidence head's adaptive verification (engines
shorten the block when confidence is low) is not used: every round verifies K drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openflash.engine.sampling import NO_TOKEN, SamplerState, filtered_probs, sample


@dataclass
class Acceptance:
    drafted: int  # drafts verified
    accepted: int  # drafts kept
    tokens: list[int]  # committed tokens: the kept drafts, then the target's token


class DraftChooser:
    """Chooses the drafter's tokens row by row with each sequence's sampler (argmax for greedy), keeping the
    draft distributions q that sampled rows need for verification."""

    def __init__(self, samplers: list[SamplerState]) -> None:
        self.samplers = samplers
        self.q: dict[tuple[int, int], torch.Tensor] = {}  # (row, block row) -> q, sampled rows only

    def __call__(self, logits: torch.Tensor, i: int) -> torch.Tensor:
        out = logits.argmax(-1).cpu()
        for b, state in enumerate(self.samplers):
            if not state.params.greedy:
                q = filtered_probs(logits[b].cpu(), state.params)
                self.q[b, i] = q
                out[b] = torch.multinomial(q, 1, generator=state.generator)[0]
        return out.to(logits.device)


def accept(target_logits: torch.Tensor, drafts: list[int], state: SamplerState,
           draft_q: list[torch.Tensor] | None) -> Acceptance:
    """Verify one row: target_logits [K+1, V] after the anchor and each draft; drafts d_1..d_K; draft_q the
    distributions they were sampled from (None for greedy). Logits holding NaN or inf accept nothing and commit
    NO_TOKEN (the engine fails that request alone)."""
    if not bool(torch.isfinite(target_logits).all()):
        return Acceptance(len(drafts), 0, [NO_TOKEN])
    if state.params.greedy:
        target = target_logits.argmax(-1).tolist()
        k = 0
        while k < len(drafts) and drafts[k] == target[k]:
            k += 1
        return Acceptance(len(drafts), k, drafts[:k] + [target[k]])
    for j, d in enumerate(drafts):
        p = filtered_probs(target_logits[j].cpu(), state.params)
        q = draft_q[j]
        u = torch.rand((), generator=state.generator)
        if u * q[d] < p[d]:  # accepted with probability min(1, p/q)
            continue
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        token = torch.multinomial(residual / total if total > 0 else p, 1, generator=state.generator)[0]
        return Acceptance(len(drafts), j, drafts[:j] + [int(token)])
    bonus = int(sample(target_logits[len(drafts):len(drafts) + 1], [state])[0])
    return Acceptance(len(drafts), len(drafts), drafts + [bonus])
