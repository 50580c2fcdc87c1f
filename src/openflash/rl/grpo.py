"""The GRPO objective, as pure functions of tensors (tests/test_rl.py works them by hand).

For a prompt sampled G times with rewards r_1..r_G, each completion's advantage is its reward against the group's
(Shao et al. 2024, DeepSeekMath §4.1): A_i = (r_i - mean(r)) / (std(r) + eps), std the sample standard deviation
(torch's default, as TRL computes it); without the scaling (Liu et al. 2025, "Dr. GRPO") A_i = r_i - mean(r).
Every token of completion i carries A_i. With the token's probability ratio rho = exp(log p - log p_old) against
the policy that sampled it, the per-token objective is PPO's clipped surrogate

    min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)  -  beta KL_t,

KL_t = exp(q - p) - (q - p) - 1 with q the base model's log-prob (the k3 estimator GRPO uses: unbiased, >= 0).
DAPO (Yu et al. 2025) changes three things, each an option here: a higher upper clip (eps_high > eps_low), the
loss averaged over all completion tokens of the batch instead of per sequence first ("token" aggregation, so long
completions are not down-weighted), groups whose rewards are all equal dropped (their advantages are all 0), and a
soft penalty for completions that run into the length budget (`overlong_penalty`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages [N, G] of rewards [N, G] (N prompts, G completions each): centred on each group's mean, divided
    by its standard deviation + eps when `scale`."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def equal_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[N] bool: the groups whose G rewards are all the same (no signal: DAPO drops them)."""
    return (rewards == rewards[:, :1]).all(dim=1)


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer tokens, then falling linearly to -1 at
    max_tokens (a completion cut by the budget gets -1); 0 when buffer is 0."""
    if buffer <= 0 or length <= max_tokens - buffer:
        return 0.0
    if length >= max_tokens:
        return -1.0
    return (max_tokens - buffer - length) / buffer


@dataclass
class LossParts:
    loss: torch.Tensor  # the objective to minimise (scalar, with grad)
    tokens: int  # completion tokens it covers
    clipped: float  # sum over tokens of "the clip was active" (the surrogate's gradient is 0 there)
    kl: float  # sum over tokens of KL_t (0 without a reference)
    ratio_max: float


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float, clip_high: float, kl_coef: float = 0.0, logp_ref: torch.Tensor | None = None,
                aggregation: str = "token", normalizer: float | None = None) -> LossParts:
    """The clipped surrogate over the masked tokens of a batch of completions.

    logp, logp_old, logp_ref, mask: [B, T] (log-probs of the completion tokens under the policy being trained, the
    one that sampled them and the base; mask 1 on tokens trained on); advantages [B]. aggregation "token": sum over
    tokens / normalizer (default the batch's token count: pass a mini-batch's total when micro-batches accumulate);
    "sequence": each sequence's token mean, summed / normalizer (default B)."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - logp_old)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logp)
    if kl_coef and logp_ref is not None:
        diff = logp_ref - logp
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + kl_coef * kl
    if aggregation == "token":
        loss = (per_token * mask).sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1))
    elif aggregation == "sequence":
        per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        loss = per_seq.sum() / (normalizer if normalizer is not None else max(per_seq.shape[0], 1))
    else:
        raise ValueError(f"aggregation must be 'token' or 'sequence', got {aggregation!r}")
    active = (clipped < unclipped) & (mask > 0)  # min() took the clipped term: no gradient through rho
    ratio_max = float(ratio.detach()[mask > 0].max()) if bool((mask > 0).any()) else 1.0
    return LossParts(loss, int(mask.sum()), float(active.sum()), float((kl.detach() * mask).sum()), ratio_max)


def completion_positions(seq_len: int, starts: list[int], lengths: list[int],
                         width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each row's completion tokens ids[b, starts[b] : starts[b] + lengths[b]] sit in sequences of `seq_len`:
    (the positions whose logits predict them [B, width], their own positions [B, width], valid [B, width]); past a
    row's length both repeat its last position, marked not valid."""
    offsets = torch.arange(width).unsqueeze(0)
    target_pos = (torch.tensor(starts).unsqueeze(1) + offsets).clamp(max=seq_len - 1)
    return (target_pos - 1).clamp(min=0), target_pos, offsets < torch.tensor(lengths).unsqueeze(1)


def picked_logprobs(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, W] of `targets` under softmax(logits / temperature) (logits [B, W, V], each position's
    distribution over the token it predicts), and the entropy of each distribution; both 0 where not valid."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp.masked_fill(~valid, 0.0), entropy.masked_fill(~valid, 0.0).detach()


def completion_logprobs(logits: torch.Tensor, ids: torch.Tensor, starts: list[int], lengths: list[int],
                        width: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`picked_logprobs` of each row's completion tokens from the logits of every position [B, S, V] (the
    logits at position t predict id t + 1): log-probs and entropies [B, width], 0 past a row's length."""
    at, target_pos, valid = (t.to(ids.device) for t in completion_positions(ids.shape[1], starts, lengths, width))
    b = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
    return picked_logprobs(logits[b, at], ids[b, target_pos], valid, temperature)
