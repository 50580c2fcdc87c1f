"""Error bounds of fp32 computations against their fp64 value, for tests whose result depends on summation order.

A tolerance read off one machine holds there and fails on the next: the order of an fp32 reduction (BLAS kernel,
tile shape, instruction set, Triton's interpreter going through numpy's BLAS) moves the last bits. These bounds
instead follow the standard a-priori analysis (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1):
a sum of n terms computed in any order errs by at most gamma_n * sum |term|, gamma_n = n u / (1 - n u), u = 2^-24.
They hold for every order, so a test using them fails only when the computation is wrong, not when it is reordered.
"""

from __future__ import annotations

import math

import torch

U32 = 2.0 ** -24  # unit roundoff of fp32


def gamma(n: int | torch.Tensor, u: float = U32):
    """gamma_n = n u / (1 - n u): the relative bound of an n-term fp32 sum or dot product, whatever its order."""
    return n * u / (1 - n * u)


def partial_softmax_bound(q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, scale: float,
                          tile: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bounds on |fp32 - exact| of the un-normalised partial softmax (acc [R, H, D], max [R, H], total [R, H]) of
    q [R, H, D] over keys [R, N, D] where seen [R, N], computed in fp32 in any order, online in tiles of `tile`
    entries or at once (kernels/triton_attention.py; tests/test_triton_products.py `_part` is the exact value).

    First order, per entry k of a row and head:
      the score   z_k = scale * q . k_k          errs by  e_k = gamma_D * scale * sum_d |q_d k_kd| + 2u |z_k|
      the maximum m = max_k z_k                  errs by  e_m = max_k e_k (the max of computed scores)
      the weight  p_k = exp(z_k - m)             errs relatively by  eta_k = e_k + e_m + u |z_k - m| + 4u
                                                 (the exp's argument and result), plus 6u per tile's rescale
      total = sum_k p_k, acc_d = sum_k p_k v_kd  err by  sum_k p_k |v_kd| (eta_k + gamma_N + gamma_tiles)
    The second-order terms are covered by a factor 2 (e^x - 1 <= 2x for x <= 1; the bound asserts eta < 0.5)."""
    q, keys, mask = q.double(), keys.double(), seen.unsqueeze(1)  # [R, 1, N]
    R, H, D = q.shape
    N = keys.shape[1]
    tiles = math.ceil(N / tile)
    z = torch.einsum("rhd,rkd->rhk", q, keys) * scale
    magnitude = torch.einsum("rhd,rkd->rhk", q.abs(), keys.abs()) * scale
    e = torch.where(mask, gamma(D) * magnitude + 2 * U32 * z.abs(), 0.0)
    e_max = e.amax(-1)
    m = z.masked_fill(~mask, float("-inf")).amax(-1).clamp(min=-1e30)
    p = torch.exp(z - m.unsqueeze(-1)).masked_fill(~mask, 0.0)
    eta = e + e_max.unsqueeze(-1) + U32 * (z - m.unsqueeze(-1)).abs() + (4 + 6 * tiles) * U32
    assert float(eta.masked_fill(~mask, 0.0).max()) < 0.5, "the first-order bound does not apply (eta >= 0.5)"
    weight = p * (eta + gamma(N) + gamma(tiles))  # [R, H, N]
    acc = 2 * torch.einsum("rhk,rkd->rhd", weight, keys.abs())
    total = 2 * weight.sum(-1)
    return acc, e_max + U32 * m.abs(), total  # (the floor -1e30 rounds to fp32 too)


def assert_within(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """|got - want| <= bound elementwise (fp64 comparisons), with the worst element named on failure."""
    error = (got.double().reshape(want.shape) - want.double()).abs()
    excess = error - bound
    if bool((excess > 0).any()):
        i = int(excess.argmax())
        raise AssertionError(f"{name}: {int((excess > 0).sum())} of {excess.numel()} elements past their bound; "
                             f"worst at flat index {i}: error {float(error.view(-1)[i]):.3g}, "
                             f"bound {float(bound.reshape(-1)[i]):.3g}")
