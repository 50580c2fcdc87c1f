"""The six studies: each turns the trained runs (and measurements on them) into a results dict and a summary.

Every study reads the same `StudyContext`; none trains anything itself (the sweep in runs.py did), so their order
does not matter and a rerun only re-measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from openflash.config import FlashConfig
from openflash.experiments import offload as ab
from openflash.experiments import probes
from openflash.experiments.arms import account, check_iso
from openflash.experiments.plan import ENGRAM_ARM, RHOS, arm_config
from openflash.experiments.runs import StudyData
from openflash.experiments.scale import Scale
from openflash.experiments.stats import summarize
from openflash.runtime.runtime import Runtime
from openflash.tools.plan import build_plan


@dataclass
class StudyContext:
    scale: Scale
    out: Path
    data: StudyData
    runs: dict[str, list[dict]]  # arm -> the result of each seed, seed order
    say: Callable[[str], None]
    configs: dict[str, FlashConfig] = field(default_factory=dict)  # arm -> its config (the runs' own, or built)

    def config(self, arm: str) -> FlashConfig:
        if arm not in self.configs:
            self.configs[arm] = arm_config(arm, self.scale, self.data.vocab_size)
        return self.configs[arm]

    def losses(self, arm: str) -> list[float]:
        return [r["val_loss"] for r in self.runs[arm]]

    def paired_diff(self, arm: str, reference: str) -> dict:
        """arm - reference, seed by seed (same seed = same data order), with its 95% interval."""
        diffs = [a - b for a, b in zip(self.losses(arm), self.losses(reference))]
        return {"per_seed": diffs, **summarize(diffs).as_dict()}

    def arm_summary(self, arm: str) -> dict:
        return {"val_loss": self.losses(arm), **summarize(self.losses(arm)).as_dict(),
                "curve": _mean_curve(self.runs[arm])}

    def trained(self, arm: str, seed: int) -> Runtime:
        return probes.load_trained(self.out / self.runs[arm][seed]["checkpoint"])


def _mean_curve(results: list[dict]) -> list[tuple[int, float]]:
    steps = [s for s, _ in results[0]["val_curve"]]
    return [(step, sum(r["val_curve"][i][1] for r in results) / len(results)) for i, step in enumerate(steps)]


def _accounting(ctx: StudyContext, arms: list[str]) -> tuple[dict, list[str]]:
    table = {arm: account(ctx.config(arm)) for arm in arms}
    lines = check_iso(table[arms[0]], table)
    return {arm: a.as_dict() for arm, a in table.items()}, lines


# ---- 1. engram-vs-moe -----------------------------------------------------------------------------------------

def engram_vs_moe(ctx: StudyContext) -> dict:
    accounting, lines = _accounting(ctx, ["moe", ENGRAM_ARM])
    ctx.say("\n".join(lines))
    return {"accounting": accounting, "arms": {a: ctx.arm_summary(a) for a in ("moe", ENGRAM_ARM)},
            "engram_minus_moe": ctx.paired_diff(ENGRAM_ARM, "moe")}


# ---- 2. allocation --------------------------------------------------------------------------------------------

def allocation(ctx: StudyContext) -> dict:
    arms = ["moe", *(f"engram-rho{r:g}" for r in RHOS)]
    accounting, lines = _accounting(ctx, arms)
    ctx.say("\n".join(lines))
    points = []
    for rho, arm in zip((0.0, *RHOS), arms):
        a = accounting[arm]
        points.append({"rho": rho, "arm": arm, "routed_experts": a["routed_experts"],
                       "engram_tables": a["engram_tables"], **summarize(ctx.losses(arm)).as_dict(),
                       "val_loss": ctx.losses(arm),
                       "minus_moe": None if arm == "moe" else ctx.paired_diff(arm, "moe")})
    best = min(points, key=lambda p: p["mean"])
    for p in points:
        p["minus_best"] = None if p is best else ctx.paired_diff(p["arm"], best["arm"])
    # A U-curve needs the best point inside the range and both ends resolved above it (paired 95% intervals).
    ends = {"fall": points[0], "rise": points[-1]}
    resolved = {k: p["minus_best"] is not None and p["minus_best"]["ci_low"] > 0 for k, p in ends.items()}
    return {"accounting": accounting, "points": points, "best_rho": best["rho"],
            "interior_minimum": best["rho"] not in (0.0, RHOS[-1]), "fall_resolved": resolved["fall"],
            "rise_resolved": resolved["rise"]}


# ---- 3. depth-probe -------------------------------------------------------------------------------------------

def depth_probe(ctx: StudyContext) -> dict:
    inputs, targets = probes.validation_windows(ctx.data.data_dir, ctx.scale.probe_windows, ctx.scale.seq_len)
    lens = {"moe": [], ENGRAM_ARM: []}
    cka = []
    for seed in range(ctx.scale.seeds):
        states = {}
        for arm in lens:
            states[arm], lens_loss = probes.layer_states(ctx.trained(arm, seed), inputs, targets)
            lens[arm].append(lens_loss)
        cka.append([[probes.linear_cka(e, m) for m in states["moe"]] for e in states[ENGRAM_ARM]])
    n_layers = len(cka[0])
    mean_cka = [[sum(c[i][j] for c in cka) / len(cka) for j in range(n_layers)] for i in range(n_layers)]
    mean_lens = {arm: [sum(v[i] for v in runs) / len(runs) for i in range(n_layers)] for arm, runs in lens.items()}
    # For each Engram-model layer: the baseline layer it is most similar to (CKA), and how many layers deeper the
    # baseline has to go to reach its LogitLens loss.
    most_similar = [max(range(n_layers), key=lambda j: row[j]) for row in mean_cka]
    return {"lens_lead_layers": [_lead(mean_lens["moe"], e, i) for i, e in enumerate(mean_lens[ENGRAM_ARM])],
            "windows": int(inputs.shape[0]), "tokens": int(targets.numel()), "lens_loss": mean_lens,
            "lens_loss_per_seed": lens, "cka": mean_cka, "cka_per_seed": cka, "most_similar_moe_layer": most_similar}


def _lead(reference: list[float], value: float, layer: int) -> float | None:
    """How many layers ahead of `layer` the reference's lens-loss curve (linearly interpolated between layers)
    reaches `value`; None outside the curve's range."""
    for j in range(len(reference) - 1):
        hi, lo = reference[j], reference[j + 1]
        if hi >= value >= lo and hi > lo:
            return j + (hi - value) / (hi - lo) - layer
    return None


# ---- 4. reuse -------------------------------------------------------------------------------------------------

def reuse(ctx: StudyContext) -> dict:
    table = {arm: account(ctx.config(arm)) for arm in ("moe", "all-full")}
    released = ctx.config("moe").topology
    pairs = probes.reuse_pairs(released)
    inputs, _ = probes.validation_windows(ctx.data.data_dir, ctx.scale.probe_windows, ctx.scale.seq_len)
    per_seed = [probes.topk_agreement(ctx.trained("all-full", seed), inputs, pairs) for seed in range(ctx.scale.seeds)]
    agreement = []
    for i, (layer, owner, mode) in enumerate(pairs):
        values = [s[i]["agreement"] for s in per_seed]
        agreement.append({"layer": layer, "reads_from": owner, "mode": mode, **summarize(values).as_dict(),
                          "per_seed": values, "chance": per_seed[0][i]["chance"],
                          "queries": per_seed[0][i]["queries"]})
    return {"accounting": {a: t.as_dict() for a, t in table.items()},
            "topology": [t.mode.value for t in released.layers],
            "arms": {a: ctx.arm_summary(a) for a in ("moe", "all-full")},
            "released_minus_all_full": ctx.paired_diff("moe", "all-full"), "topk_agreement": agreement}


# ---- 5. replay ------------------------------------------------------------------------------------------------

REPLAY_DECODE = 8  # teacher-forced tokens after each prompt


def replay(ctx: StudyContext) -> dict:
    longest = max(ctx.scale.replay_lengths) + REPLAY_DECODE + 1
    windows, _ = probes.validation_windows(ctx.data.data_dir, ctx.scale.probe_windows, longest)
    by_length = []
    models = [ctx.trained(ENGRAM_ARM, seed) for seed in range(ctx.scale.seeds)]
    for length in ctx.scale.replay_lengths:
        per_seed = [probes.replay_nll(m, windows, length, REPLAY_DECODE) for m in models]
        mean = lambda key: [sum(s[key][t] for s in per_seed) / len(per_seed)  # noqa: E731
                            for t in range(REPLAY_DECODE + 1)]
        by_length.append({"prompt_len": length, "nll_exact": mean("nll_exact"), "nll_bounded": mean("nll_bounded"),
                          "abs_diff": mean("abs_diff"), "kl_first": [s["kl_first"] for s in per_seed]})
    cfg = models[0].model.cfg
    return {"arm": ENGRAM_ARM, "windows": int(windows.shape[0]), "decode": REPLAY_DECODE,
            "sliding_window": cfg.sliding_window, "decoder_layers": list(cfg.topology.decoder_layers),
            "trained_seq_len": ctx.scale.seq_len, "by_length": by_length}


# ---- 6. offload -----------------------------------------------------------------------------------------------

def offload(ctx: StudyContext) -> dict:
    from openflash.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ctx.data.tokenizer_path)
    cfg = ab.offload_config(ctx.config(ENGRAM_ARM), tokenizer,
                            ctx.scale.offload_table_mib)
    tiers = ab.build_tiers(cfg, tokenizer, ctx.out / "offload_tables")
    prompt_len = 64
    windows, _ = probes.validation_windows(ctx.data.data_dir, ctx.scale.offload_rounds + 1, prompt_len)
    prompts = [w.tolist() for w in windows]
    ab.ab_rounds(tiers, prompts[:1], 2)  # warm-up (first-call allocations), not counted
    rounds = ab.ab_rounds(tiers, prompts[1:], ctx.scale.offload_tokens)
    table_bytes = sum(rows * (cfg.engram_head_dim + cfg.engram_head_dim // 32) for rows in cfg.engram_num_embeddings)
    result = {"table_bytes": table_bytes, "backbone_params": build_plan(cfg).params_backbone,
              "prompt_tokens": prompt_len, "decode_tokens": ctx.scale.offload_tokens, "threads": torch.get_num_threads(),
              "rounds": rounds, "tiers": {}}
    for tier in ab.TIERS:
        speeds = [r[tier] for r in rounds]
        relative = [r[tier] / r["device"] - 1 for r in rounds]
        result["tiers"][tier] = {"tokens_per_s": summarize(speeds).as_dict(),
                                 "vs_device": summarize(relative).as_dict() if tier != "device" else None}
    return result


STUDIES: dict[str, Callable[[StudyContext], dict]] = {
    "engram-vs-moe": engram_vs_moe, "allocation": allocation, "depth-probe": depth_probe, "reuse": reuse,
    "replay": replay, "offload": offload}
