"""What changes a request's logits before its token is sampled: OpenAI's presence and frequency penalties, vLLM's
repetition penalty, a logit bias, min_tokens, and a grammar's mask (structured output, serve/grammar.py).

The engine hands each step's logits [B, V] here with the rows' sequences; only rows that ask are touched, on a copy.
Log-probabilities are read from the logits before this (engine.next_tokens): they are the model's, not the shaped
ones. Speculative rounds sample inside the verifier, so a request that shapes its logits is refused there.
"""

from __future__ import annotations

from typing import Protocol

import torch

from openflash.engine.request import Sequence


class TokenConstraint(Protocol):
    """A grammar a request's completion must follow (serve/grammar.py)."""

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """A bool mask [vocab_size] of the tokens that may come next."""

    def advance(self, token: int) -> bool:
        """Take the token that came; False when the grammar does not allow it."""

    @property
    def finished(self) -> bool:
        """The grammar is complete and accepts nothing more: the request stops."""


def shapes(seq: Sequence) -> bool:
    """seq's logits change before sampling."""
    return seq.params.shapes_logits or seq.constraint is not None


def shape_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [B, V] with each row shaped as its sequence asks (the input itself when no row asks)."""
    rows = [b for b, s in enumerate(seqs) if shapes(s)]
    if not rows:
        return logits
    out = logits.float().clone()
    for b in rows:
        out[b] = _shape_row(out[b], seqs[b])
    return out


def _shape_row(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p, vocab = seq.params, row.shape[-1]
    device = row.device
    if p.repetition_penalty != 1:  # over prompt and output tokens (vLLM's and the CTRL paper's definition)
        seen = torch.tensor(seq.prompt_ids + seq.output_ids, dtype=torch.long, device=device).unique()
        seen = seen[seen < vocab]
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_ids:  # over output tokens (OpenAI's definition)
        counts = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long, device=device),
                                minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=device)
        row[ids] += torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype, device=device)
    if len(seq.output_ids) < p.min_tokens:  # nothing may end the completion yet
        ends = [t for t in (*p.stop_token_ids, seq.eos_token_id) if t is not None and 0 <= t < vocab]
        row[ends] = float("-inf")
    if seq.constraint is not None:
        row = row.masked_fill(~seq.constraint.allowed(vocab).to(device), float("-inf"))
    return row


__all__ = ["TokenConstraint", "shape_logits", "shapes"]
