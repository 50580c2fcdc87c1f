"""The model configs the studies compare, and their parameter / FLOP accounting.

Every arm is the scale's preset at the scale's width with one thing changed:

    moe          the pure-MoE reference: n_routed_experts experts, no Engram
    engram-rhoR  a share R of the routed experts' parameters moved into an Engram table (one Engram layer before
                 layer 1, 2- and 3-grams, 2 heads of 32-wide rows); the table is sized so the total
                 parameter count equals the reference's. Top-k, expert width and everything else are unchanged,
                 so the active FLOPs differ only by the Engram projection (a few %, printed and bounded).
    all-full     CSA2 without reuse: every compressed-attention layer FULL (own compressor, index keys, indexer)

The released topology (Full / Reuse / Reindex) is the reference's own: `moe` is also the `reuse` study's baseline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from openflash.config import FlashConfig, load_config
from openflash.errors import OpenflashError
from openflash.experiments.scale import Scale
from openflash.memory.hashing import find_table_primes
from openflash.model.engram_table import DeviceTable
from openflash.model.transformer import Transformer
from openflash.tools.plan import build_plan

ENGRAM_LAYERS = [1]  # in the encoder half, so bounded replay stays available (Topology.bounded_replay_ok)
ENGRAM_MAX_NGRAM = 3
ENGRAM_HEADS, ENGRAM_ROW_DIM = 2, 32  # narrow rows keep the projection (the iso-FLOP gap) small at these widths
PARAM_TOLERANCE = 1e-3  # iso-parameter: totals within 0.1%
FLOP_TOLERANCE = 0.06  # iso-FLOP: active per token within 6% (the Engram projection is the difference)


@dataclass(frozen=True)
class Accounting:
    total: int  # every parameter the model holds (tables included)
    routed_experts: int
    engram_tables: int
    engram_dense: int  # the Engram projection and gains
    active_per_token: int  # parameters a training token touches (build_plan's count for a generated token)

    @property
    def sparse(self) -> int:
        """The budget the allocation study splits: routed experts plus everything Engram adds."""
        return self.routed_experts + self.engram_tables + self.engram_dense

    @property
    def flops_per_token(self) -> int:
        return 2 * self.active_per_token  # forward multiply-adds; training costs about 3x this

    def as_dict(self) -> dict:
        return {**asdict(self), "sparse": self.sparse, "flops_per_token": self.flops_per_token}


def account(cfg: FlashConfig) -> Accounting:
    """Counted on the model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    routed = tables = engram_dense = 0
    for name, module in model.named_modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        if ".ffn.experts." in f"{name}.":
            routed += own
        elif isinstance(module, DeviceTable):
            tables += own
        elif ".engram" in f".{name}":
            engram_dense += own
    return Accounting(total=sum(p.numel() for p in model.parameters()), routed_experts=routed,
                      engram_tables=tables, engram_dense=engram_dense,
                      active_per_token=build_plan(cfg).active_decode_token)


def moe_config(scale: Scale, vocab_size: int) -> FlashConfig:
    return load_config(scale.preset).replace(
        vocab_size=vocab_size, hidden_size=scale.hidden_size, moe_intermediate_size=scale.moe_intermediate_size,
        n_routed_experts=scale.n_routed_experts, image_token_id=None, weight_dtype="fp32", expert_dtype="fp32",
        engram_layer_ids=[], engram_num_embeddings=[], engram_compressed_vocab_size=vocab_size)


def _with_table(cfg: FlashConfig, engram_vocab_size: int) -> FlashConfig:
    primes = find_table_primes(engram_vocab_size, ENGRAM_LAYERS, ENGRAM_MAX_NGRAM, ENGRAM_HEADS)
    return cfg.replace(engram_layer_ids=list(ENGRAM_LAYERS), engram_max_ngram_size=ENGRAM_MAX_NGRAM,
                       engram_n_heads=ENGRAM_HEADS, engram_head_dim=ENGRAM_ROW_DIM,
                       engram_vocab_size=engram_vocab_size, engram_num_embeddings=[sum(p) for p in primes])


def engram_config(scale: Scale, vocab_size: int, rho: float) -> FlashConfig:
    """The reference with a share `rho` of its routed experts traded for an Engram table of equal parameters."""
    reference = moe_config(scale, vocab_size)
    moved = rho * scale.n_routed_experts
    experts = scale.n_routed_experts - round(moved)
    if abs(moved - round(moved)) > 1e-9 or rho <= 0:
        raise OpenflashError(f"rho {rho} must be a positive multiple of 1/{scale.n_routed_experts} (whole experts "
                             f"of the {scale.n_routed_experts}-expert reference)")
    if experts < reference.num_experts_per_tok:
        raise OpenflashError(f"rho {rho} leaves {experts} routed experts, fewer than the "
                             f"{reference.num_experts_per_tok} each token uses")
    target = account(reference).total
    cfg = reference.replace(n_routed_experts=experts)
    columns = (ENGRAM_MAX_NGRAM - 1) * ENGRAM_HEADS
    smallest = _with_table(cfg, 2)
    base = account(smallest)
    rows = (target - (base.total - base.engram_tables)) // ENGRAM_ROW_DIM
    if rows < columns * 3:
        raise OpenflashError(f"rho {rho}: the Engram projection alone takes more than the {round(moved)} experts' "
                             f"parameters; use a larger rho or a wider scale")
    def table_rows(vocab: int) -> int:
        return sum(sum(p) for p in find_table_primes(vocab, ENGRAM_LAYERS, ENGRAM_MAX_NGRAM, ENGRAM_HEADS))

    lo, hi = 2, rows  # table_rows grows with the prime search's start: bisect for the row count
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if table_rows(mid) <= rows else (lo, mid)
    vocab = min((lo, hi), key=lambda v: abs(table_rows(v) - rows))
    return _with_table(cfg, vocab)


def all_full_config(scale: Scale, vocab_size: int) -> FlashConfig:
    """The reference with every compressed-attention layer FULL: no layer reuses another's KV or top-k."""
    cfg = moe_config(scale, vocab_size)
    compressed = [i for i, ratio in enumerate(cfg.compress_ratios) if ratio > 0]
    return cfg.replace(kv_source_layer_ids=compressed, index_source_layer_ids=compressed)


def check_iso(reference: Accounting, arms: dict[str, Accounting]) -> list[str]:
    """Lines of the accounting table; raises when an arm breaks iso-parameter or iso-FLOP."""
    lines = [f"{'arm':<16} {'total':>11} {'experts':>11} {'tables':>10} {'engram proj':>11} {'active/token':>12}"]
    problems = []
    for name, a in arms.items():
        dp = (a.total - reference.total) / reference.total
        df = (a.active_per_token - reference.active_per_token) / reference.active_per_token
        lines.append(f"{name:<16} {a.total:>11,} {a.routed_experts:>11,} {a.engram_tables:>10,} "
                     f"{a.engram_dense:>11,} {a.active_per_token:>12,}  (params {dp:+.3%}, active {df:+.2%})")
        if abs(dp) > PARAM_TOLERANCE:
            problems.append(f"{name}: total parameters differ by {dp:+.3%} (tolerance {PARAM_TOLERANCE:.1%})")
        if abs(df) > FLOP_TOLERANCE:
            problems.append(f"{name}: active parameters per token differ by {df:+.2%} (tolerance "
                            f"{FLOP_TOLERANCE:.0%})")
    if problems:
        raise OpenflashError("the arms are not comparable: " + "; ".join(problems))
    return lines
