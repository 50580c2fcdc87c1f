"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, stop conditions; log-probabilities.

Every request draws from its own `torch.Generator`, so what a request samples does not depend on which other
requests share its batch (greedy needs no generator at all). What changes the logits before sampling (penalties,
logit bias, min_tokens, a grammar's mask) is engine/logits.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from openflash.errors import RequestError


MAX_TOP_LOGPROBS = 20  # the most alternatives a token's log-probability comes with (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False  # a stop string that ends the text stays in it
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the likeliest's (0 = off)
    # engine/logits.py: what changes the logits before they are sampled
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times the count of each token already generated
    repetition_penalty: float = 1.0  # vLLM / CTRL: a seen token's (prompt or output) logit / this if > 0, x if < 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # the end-of-sequence and stop token ids are masked until this many tokens are out
    # Log-probabilities (`TokenLogprob`): of each sampled token (with the `top_logprobs` likeliest), and with
    # prompt_logprobs = k >= 0 of each prompt token after the first (and its k likeliest), from an exact prefill.
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    # Whose distribution: "model" (softmax of the logits, temperature 1: what a client evaluating the model reads) or
    # "sampler" (softmax(logits / temperature), before top-k / top-p: the policy an RL update recomputes).
    logprobs_of: str = "model"

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
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 0):
            raise RequestError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}", param="max_tokens")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise RequestError("max_tokens 0 generates nothing: it is for prompt log-probabilities (echo with "
                               "logprobs)", param="max_tokens")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise RequestError(f"max_tokens {self.max_tokens} exceeds the limit of {max_tokens_limit}",
                               param="max_tokens")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}", param="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2 <= value <= 2):
                raise RequestError(f"{name} must be a number in [-2, 2], got {value!r}", param=name)
        if not (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty <= 100
                and math.isfinite(self.repetition_penalty)):
            raise RequestError(f"repetition_penalty must be a number in (0, 100], got {self.repetition_penalty!r}",
                               param="repetition_penalty")
        for token, bias in self.logit_bias:
            if not (isinstance(bias, (int, float)) and -100 <= bias <= 100):
                raise RequestError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias!r}",
                                   param="logit_bias")
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens):
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], got "
                               f"{self.min_tokens!r}", param="min_tokens")
        for name in ("top_logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_TOP_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}", param=name)
        if self.logprobs_of not in ("model", "sampler"):
            raise RequestError(f"logprobs_of must be 'model' or 'sampler', got {self.logprobs_of!r}",
                               param="logprobs_of")
        return self

    @property
    def shapes_logits(self) -> bool:
        """Something changes the logits before sampling (engine/logits.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

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
    """Probabilities [V] after temperature, top-k, min-p and top-p (fp32)."""
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
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


def sample(logits: torch.Tensor, states: list[SamplerState], finite: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits [B, V]; row b follows states[b]. A row whose logits are not all finite (or
    not `finite[b]`, for logits masked on purpose) gets NO_TOKEN (and draws nothing from its generator): one
    request's NaN must not fail the others."""
    out = torch.empty(logits.shape[0], dtype=torch.long)
    greedy = logits.argmax(dim=-1).cpu()
    if finite is None:
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


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability, and the likeliest tokens' at its position (id, log p), likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor,
                   top: int = 0) -> list[TokenLogprob]:
    """log p(token) of each row of logits [N, V] under softmax(logits / temperature) (fp32), with the `top`
    likeliest tokens'. The distribution before top-k / top-p: with the sampling temperature, the policy's own that
    an RL update recomputes (rl/grpo.py); with temperature 1, the model's (a teacher-forced likelihood)."""
    scaled = logits.float() / temperatures.to(logits.device, torch.float32).unsqueeze(-1)
    logp = torch.log_softmax(scaled, dim=-1)
    picked = logp.gather(-1, tokens.clamp(min=0).to(logits.device).unsqueeze(-1)).squeeze(-1).cpu().tolist()
    if top <= 0:
        return [TokenLogprob(int(t), lp) for t, lp in zip(tokens.tolist(), picked)]
    values, ids = (x.cpu().tolist() for x in torch.topk(logp, min(top, logp.shape[-1]), dim=-1))
    return [TokenLogprob(int(t), lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens.tolist(), picked, ids, values)]


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None
