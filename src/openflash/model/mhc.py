"""Single-pass mHC: manifold-constrained hyper-connections over `hc` residual streams (spec: architecture.md §4).

Each sublayer computes (pre, post, comb) from its own input residual R [B, S, hc, D]:
- post and comb mix the sublayer output back into the streams: R_new[k] = post[k] * y + sum_j comb[j, k] * R[j];
- pre is handed to the NEXT sublayer, which uses it to collapse its input: u = sum_i pre[i] * R[i].
The parameters of one sublayer are `fn` [(2 + hc) * hc, hc * D], `base` [(2 + hc) * hc] and `scale` [3], with rows
ordered pre (hc), post (hc), comb (hc x hc, row-major, first index = source stream).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openflash.model.numerics import Numerics


def hc_coefficients(residual: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    hc: int, sinkhorn_iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [B,S,hc], post [B,S,hc], comb [B,S,hc,hc]) from the residual, all fp32 (§4.2)."""
    x = residual.flatten(-2).float()
    # One RMS scalar per token over all hc*D values, applied after the projection (same math as before it).
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-20)
    m = F.linear(x, fn.float()) * r
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc: 2 * hc] * scale[1] + base[hc: 2 * hc])
    comb = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    return pre, post, sinkhorn(comb, sinkhorn_iters, eps)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax (+eps), column normalisation, then (iters - 1) x (row, column) normalisations (§4.2 step 7).

    The order matters: the last step is a column normalisation, so each destination stream receives an
    (approximately) convex combination of the sources.
    """
    c = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    c = c / c.sum(dim=-1, keepdim=True) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def collapse(residual: torch.Tensor, pre: torch.Tensor, numerics: Numerics) -> torch.Tensor:
    """u = sum_i pre[i] * R[i] in fp32 (pre is not normalised to sum 1) (§4.3)."""
    u = (pre.unsqueeze(-1) * residual.float()).sum(dim=-2)
    return numerics.round(u)


def expand_and_mix(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                   numerics: Numerics) -> torch.Tensor:
    """R_new[k] = post[k] * y + sum_j comb[j, k] * R[j]: comb transposed onto the streams (§4.3)."""
    if numerics.bf16_boundaries:  # the reference's elementwise form, summing the 4 sources in order
        mixed = (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(dim=2)
    else:
        mixed = torch.einsum("bsjk,bsjd->bskd", comb, residual.float())
    return numerics.round(post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed)
