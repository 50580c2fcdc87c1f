"""Single-pass mHC: manifold-constrained hyper-connections over `hc` residual streams (spec: architecture.md §4).

Each sublayer computes (pre, post, comb) from its own input residual R [B, S, hc, D]:
- post and comb mix the sublayer output back into the streams: R_new[k] = post[k] * y + sum_j comb[j, k] * R[j];
- pre is handed to the NEXT sublayer, which uses it to collapse its input: u = sum_i pre[i] * R[i].
The parameters of one sublayer are `fn` [(2 + hc) * hc, hc * D], `base` [(2 + hc) * hc] and `scale` [3], with rows
ordered pre (hc), post (hc), comb (hc x hc, row-major, first index = source stream).

Training (`Numerics.fused_train_ops`) runs the same math through `HcIn`, `HcOut` and `Sinkhorn`: autograd
functions with hand-written backward passes. The residual streams are the largest activations of the model and
every elementwise pass over them is memory-bound on a CPU, so these read and write them as few times as possible
and hand autograd one gradient per input instead of one per use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from openflash.model.compiled import compiled, graph_linear
from openflash.model.numerics import Numerics

_RMS_EPS = 1e-20  # of the per-token RMS over all hc*D residual values


def hc_projection(residual: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """The RMS-scaled projection m [B, S, (2 + hc) * hc] of the residual that the coefficients come from (§4.2)."""
    x = residual.flatten(-2).float()
    # One RMS scalar per token over all hc*D values, applied after the projection (same math as before it).
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _RMS_EPS)
    return graph_linear(x, fn.float()) * r


def coefficients_from_projection(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                                 sinkhorn_iters: int, eps: float, fused: bool = False
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre, post, comb from the RMS-scaled projection m [..., (2 + hc) * hc] (§4.2 steps 3-7)."""
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc: 2 * hc] * scale[1] + base[hc: 2 * hc])
    comb = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = Sinkhorn.apply(comb, sinkhorn_iters, eps) if fused else sinkhorn(comb, sinkhorn_iters, eps)
    return pre, post, comb


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
    mixed = torch.einsum("bsjk,bsjd->bskd", comb, residual.float())
    return numerics.round(post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed)


def expand_and_mix_elementwise(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                               numerics: Numerics) -> torch.Tensor:
    """expand_and_mix in the reference's elementwise form, summing the sources in order (its rounding)."""
    mixed = (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(dim=2)
    return numerics.round(post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed)


# ---- the kernels of one numerics policy ------------------------------------------------------------------------

@dataclass(frozen=True)
class HcKernels:
    """What a block does with its residual streams, one implementation per numerics policy, chosen once
    (`hc_kernels`): `read` (residual, pre, fn) -> (projection m, collapsed input u); `coefficients` (m, base,
    scale, hc, iters, eps) -> (pre, post, comb); `write` (y, residual, post, comb) -> new residual. Plain (fp32),
    reference (bf16 rounding points, the reference's elementwise mix) and fused training (`HcIn`, `Sinkhorn`,
    `HcOut` with hand-written backward passes) compute the same math."""

    numerics: Numerics  # its rounding points (reference: bf16) and its mixing form

    def read(self, residual: torch.Tensor, pre: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hc_projection(residual, fn), collapse(residual, pre, self.numerics)

    def coefficients(self, m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return coefficients_from_projection(m, base, scale, hc, iters, eps)

    def write(self, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return expand_and_mix(y, residual, post, comb, self.numerics)


class ReferenceHcKernels(HcKernels):
    """The reference's rounding points (through `numerics`) and its elementwise stream mix."""

    def write(self, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return expand_and_mix_elementwise(y, residual, post, comb, self.numerics)


class TrainHcKernels(HcKernels):
    """Training: one pass over the streams each way, autograd functions with hand-written backward passes."""

    def read(self, residual: torch.Tensor, pre: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return HcIn.apply(residual, pre, fn)

    def coefficients(self, m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return coefficients_from_projection(m, base, scale, hc, iters, eps, fused=True)

    def write(self, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return HcOut.apply(y, residual, post, comb)


class CompiledHcKernels(HcKernels):
    """The same functions fused by torch.compile (model/compiled.py): Sinkhorn's 20 iterations become one loop."""

    def read(self, residual: torch.Tensor, pre: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return compiled(hc_projection)(residual, fn), compiled(collapse)(residual, pre, self.numerics)

    def coefficients(self, m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return compiled(coefficients_from_projection)(m, base, scale, hc, iters, eps)

    def write(self, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return compiled(expand_and_mix)(y, residual, post, comb, self.numerics)


@lru_cache(maxsize=None)
def hc_kernels(numerics: Numerics) -> HcKernels:
    """The mHC kernels of a numerics policy (one object per policy)."""
    if numerics.bf16_boundaries:
        return ReferenceHcKernels(numerics)
    if numerics.fused_train_ops:
        return TrainHcKernels(numerics)
    return CompiledHcKernels(numerics) if numerics.compiled else HcKernels(numerics)


# ---- fused training path -------------------------------------------------------------------------------------

class HcIn(torch.autograd.Function):
    """What a sublayer reads from its input streams R [B,S,hc,D] (§4.2, §4.3), one pass over R each:

        m = (x fn^T) * r,  r = rsqrt(mean(x^2) + 1e-20),  x = R as [.., hc*D]   (projection for the coefficients)
        u = sum_i pre_in[i] * R[i]                                           (collapse with the previous pre)

    Backward, with z = x fn^T:  dx = r (g_m fn) - (r^3 / (hc*D)) (g_m . z) x + pre_in (outer) g_u.
    """

    @staticmethod
    def forward(ctx, residual: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor):
        shape = residual.shape
        hc, dim = shape[-2:]
        R = residual.reshape(-1, hc, dim)
        x = R.view(R.shape[0], hc * dim)
        z = x @ fn.t()
        r = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / (hc * dim) + _RMS_EPS)
        p = pre_in.reshape(-1, 1, hc)
        u = torch.bmm(p, R)
        ctx.save_for_backward(R, p, fn, z, r)
        ctx.shape = shape
        return (z * r).view(*shape[:-2], -1), u.view(*shape[:-2], dim)

    @staticmethod
    def backward(ctx, g_m: torch.Tensor, g_u: torch.Tensor):
        R, p, fn, z, r = ctx.saved_tensors
        n, hc, dim = R.shape
        x = R.view(n, hc * dim)
        g_m = g_m.reshape(n, -1)
        g_u = g_u.reshape(n, 1, dim)
        gz = g_m * r
        coef = (g_m * z).sum(-1, keepdim=True) * r.pow(3) * (-1.0 / (hc * dim))
        dx = torch.mm(gz, fn).addcmul_(x, coef)
        d_residual = dx.view(n, hc, dim).addcmul_(p.view(n, hc, 1), g_u)
        d_pre = torch.bmm(R, g_u.view(n, dim, 1))
        d_fn = gz.t() @ x
        return d_residual.view(ctx.shape), d_pre.view(ctx.shape[:-1]), d_fn


class HcOut(torch.autograd.Function):
    """expand_and_mix: R_new[k] = post[k] * y + sum_j comb[j, k] * R[j] (§4.3), y [..,D], R [..,hc,D].

    Backward: dy = sum_k post[k] g[k], dpost[k] = g[k] . y, dR[j] = sum_k comb[j, k] g[k], dcomb[j, k] = R[j] . g[k].
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        shape = residual.shape
        hc, dim = shape[-2:]
        R = residual.reshape(-1, hc, dim)
        Y = y.reshape(-1, 1, dim)
        P = post.reshape(-1, hc, 1)
        C = comb.reshape(-1, hc, hc).contiguous()
        out = torch.bmm(C.transpose(1, 2), R).addcmul_(P, Y)
        ctx.save_for_backward(Y, R, P, C)
        ctx.shape, ctx.y_shape = shape, y.shape
        return out.view(shape)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        Y, R, P, C = ctx.saved_tensors
        n, hc, dim = R.shape
        g = g.reshape(n, hc, dim).contiguous()
        d_y = torch.bmm(P.transpose(1, 2), g)
        d_post = torch.bmm(g, Y.transpose(1, 2))
        d_residual = torch.bmm(C, g)
        d_comb = torch.bmm(R, g.transpose(1, 2))
        lead = ctx.shape[:-2]
        return d_y.view(ctx.y_shape), d_residual.view(ctx.shape), d_post.view(*lead, hc), d_comb.view(*lead, hc, hc)


class Sinkhorn(torch.autograd.Function):
    """`sinkhorn` with a hand-written backward through its normalisations (the unrolled iterations, exactly).

    Works on the [hc, hc, N] layout, where both normalisations reduce over a leading dimension. A normalisation
    c' = c / (sum c + eps) has the gradient dc = (g - sum(g * c')) / (sum c + eps) over the same group. Only the
    row softmax is kept for the backward, which reruns the iterations from it: they are hc^2 values a token, and
    keeping all 2 x iters - 1 of them would hold 39 copies (20 MB a call at 4K tokens and hc 4).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float):
        shape = logits.shape
        hc = shape[-1]
        c = logits.reshape(-1, hc, hc).permute(1, 2, 0).contiguous()  # [row i, column j, token]
        p = torch.softmax(c, dim=1)  # row softmax (rows are dim 1 here: source i, over destinations j)
        ctx.save_for_backward(p)
        ctx.iters, ctx.eps, ctx.shape = iters, eps, shape
        outputs, _ = Sinkhorn._normalisations(p, iters, eps)
        return outputs[-1].permute(2, 0, 1).contiguous().view(shape)  # token-major again: bmm wants dense batches

    @staticmethod
    def _normalisations(p: torch.Tensor, iters: int, eps: float) -> tuple[list, list]:
        """Each normalisation's output and divisor, from the row softmax p (column normalisation first, then
        alternating)."""
        c = p + eps
        outputs, sums = [], []
        for step in range(2 * iters - 1):
            s = c.sum(dim=step % 2, keepdim=True).add_(eps)
            c = c / s
            outputs.append(c)
            sums.append(s)
        return outputs, sums

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        p, = ctx.saved_tensors
        outputs, sums = Sinkhorn._normalisations(p, ctx.iters, ctx.eps)
        hc = ctx.shape[-1]
        g = g.reshape(-1, hc, hc).permute(1, 2, 0).contiguous()  # the [hc, hc, N] layout, densely
        for step in reversed(range(len(outputs))):
            g = (g - (g * outputs[step]).sum(dim=step % 2, keepdim=True)) / sums[step]
        g = p * (g - (g * p).sum(dim=1, keepdim=True))  # softmax backward
        return g.permute(2, 0, 1).contiguous().view(ctx.shape), None, None
