"""From a step's logits to each request's next token: the shaping a request asks for (OpenAI's presence and
frequency penalties, vLLM's repetition penalty, a logit bias, min_tokens, a grammar's mask for structured output,
serve/grammar.py), sampling (engine/sampling.py), and the token's log-probability.

The engine hands each step's logits [B, V] here with the rows' sequences (`choose_tokens`); only rows that ask are
shaped, on a copy. Log-probabilities are read from the logits before shaping: they are the model's (or the
sampler's temperature-scaled distribution, for RL), not the shaped ones. Speculative rounds sample inside the
verifier, so a request that shapes its logits or asks for log-probs is refused there (`speculative_conflict`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from openflash.engine.sampling import SamplerState, SamplingParams, TokenLogprob, sample, token_logprobs

NO_CHOICE = -2  # what `choose_tokens` gives a row whose shaping excludes every token: that request fails


class NoTokenAllowed(RuntimeError):
    """A request's shaping left no token to sample (min_tokens holds back the end its grammar requires)."""

    def __init__(self) -> None:
        super().__init__("the request's constraints exclude every token (min_tokens holds back the end of "
                         "sequence that its response_format's grammar requires next)")


class TokenConstraint(Protocol):
    """A grammar a request's completion must follow (serve/grammar.py)."""

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """A bool mask [vocab_size] of the tokens that may come next."""

    def advance(self, token: int) -> bool:
        """Take the token that came; False when the grammar does not allow it."""

    @property
    def finished(self) -> bool:
        """The grammar is complete and accepts nothing more: the request stops."""


class Row(Protocol):
    """What choosing a row's token reads from its request, and the log-prob it leaves there (engine/request.py's
    Sequence)."""

    params: SamplingParams
    constraint: TokenConstraint | None
    prompt_ids: list[int]
    output_ids: list[int]
    eos_token_id: int | None
    sampler: SamplerState
    pending_logprob: TokenLogprob | None


def shapes(seq: Row) -> bool:
    """seq's logits change before sampling."""
    return seq.params.shapes_logits or seq.constraint is not None


def shape_logits(logits: torch.Tensor, seqs: list[Row]) -> torch.Tensor:
    """logits [B, V] with each row shaped as its sequence asks (the input itself when no row asks)."""
    rows = [b for b, s in enumerate(seqs) if shapes(s)]
    if not rows:
        return logits
    out = logits.float().clone()
    for b in rows:
        out[b] = _shape_row(out[b], seqs[b])
    return out


def _shape_row(row: torch.Tensor, seq: Row) -> torch.Tensor:
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


def choose_tokens(logits: torch.Tensor, seqs: list[Row]) -> list[int]:
    """The next token of each sequence from its logits row [B, V], shaped as it asks and sampled with its own
    sampler; a sequence that asked for log-probs gets the token's on `pending_logprob` (from the unshaped logits),
    which the engine keeps when it appends the token."""
    finite = torch.isfinite(logits).all(dim=-1).cpu()  # (a grammar's mask adds -inf; NaN from the model is not)
    shaped = shape_logits(logits, seqs)
    open_ = torch.ones_like(finite) if shaped is logits else torch.isfinite(shaped).any(dim=-1).cpu()
    tokens = sample(shaped, [s.sampler for s in seqs], finite & open_)
    tokens[finite & ~open_] = NO_CHOICE
    wanting = [b for b, s in enumerate(seqs) if s.params.logprobs]
    if wanting:
        rows = torch.tensor(wanting)
        temps = torch.tensor([seqs[b].params.temperature if seqs[b].params.logprobs_of == "sampler"
                              and not seqs[b].params.greedy else 1.0 for b in wanting])
        top = max(seqs[b].params.top_logprobs for b in wanting)
        for b, record in zip(wanting, token_logprobs(logits[rows.to(logits.device)], tokens[rows], temps, top)):
            seqs[b].pending_logprob = replace(record, top=record.top[:seqs[b].params.top_logprobs])
    return tokens.tolist()


def speculative_conflict(params: SamplingParams, constraint: TokenConstraint | None) -> str | None:
    """The first field a speculative round cannot honour (its accepted tokens are drawn by rejection sampling
    inside the verifier, not from one shaped distribution each), or None."""
    asked = (("logprobs", params.logprobs), ("response_format", constraint is not None),
             ("presence_penalty", params.presence_penalty), ("frequency_penalty", params.frequency_penalty),
             ("repetition_penalty", params.repetition_penalty != 1), ("logit_bias", params.logit_bias),
             ("min_tokens", params.min_tokens), ("min_p", params.min_p))
    return next((name for name, on in asked if on), None)


__all__ = ["TokenConstraint", "choose_tokens", "shape_logits", "shapes", "speculative_conflict", "NO_CHOICE",
           "NoTokenAllowed"]
