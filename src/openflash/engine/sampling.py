"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, stop conditions.

Every request draws from its own `torch.Generator`, so what a request samples does not depend on which other
requests share its batch (greedy needs no generator at all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from openflash.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False  # keep each sampled token's log-probability (`token_logprobs`) on its Sequence

    def validate(self, max_tokens_limit: int | None = None) -> "SamplingParams":
        """Raise RequestError naming the first invalid field."""
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and 0 <= self.temperature <= 100):
            raise RequestError(f"temperature must be a number in [0, 100], got {self.temperature!r}",
                               param="temperature")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}", param="top_k")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise RequestError(f"max_tokens {self.max_tokens} exceeds the limit of {max_tokens_limit}",
                               param="max_tokens")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class SamplerState:
    """Per-request randomness."""

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)

    @classmethod
    def create(cls, params: SamplingParams) -> "SamplerState":
        gen = None
        if not params.greedy:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        return cls(params, gen)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k and top-p (fp32)."""
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cut = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


NO_TOKEN = -1  # what `sample` gives a row whose logits hold NaN or inf: that request fails, its batch does not


class NonFiniteLogits(RuntimeError):
    """A request's logits held NaN or inf (a poisoned adapter, an overflow): nothing can be sampled from them."""

    def __init__(self) -> None:
        super().__init__("the model's logits for this request hold NaN or inf values (a LoRA adapter or input that "
                         "overflows?); nothing can be sampled from them")


def sample(logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
    """One token per row of logits [B, V]; row b follows states[b]. A row whose logits are not all finite gets
    NO_TOKEN (and draws nothing from its generator): one request's NaN must not fail the others."""
    out = torch.empty(logits.shape[0], dtype=torch.long)
    greedy = logits.argmax(dim=-1).cpu()
    finite = torch.isfinite(logits).all(dim=-1).cpu()
    for b, state in enumerate(states):
        if not finite[b]:
            out[b] = NO_TOKEN
        elif state.params.greedy:
            out[b] = greedy[b]
        else:
            probs = filtered_probs(logits[b].cpu(), state.params)
            out[b] = torch.multinomial(probs, 1, generator=state.generator)[0]
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """log p(token) of each row under softmax(logits / temperature) [B] (fp32; a greedy row's temperature is 1). The
    distribution before top-k / top-p: the policy's own, which an RL update recomputes (rl/grpo.py)."""
    scaled = logits.float() / temperatures.to(logits.device, torch.float32).unsqueeze(-1)
    picked = tokens.clamp(min=0).to(logits.device).unsqueeze(-1)
    return torch.log_softmax(scaled, dim=-1).gather(-1, picked).squeeze(-1).cpu()


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None
