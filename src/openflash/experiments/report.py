"""Each study's plot (PNG) and markdown summary, written from its results dict alone (so a report can be redrawn
from a results JSON without re-measuring)."""

from __future__ import annotations

from pathlib import Path

from openflash.experiments.plan import ENGRAM_ARM


def _fmt(s: dict, digits: int = 4) -> str:
    """mean ± std [95% CI] of a stats.Summary dict."""
    if s["n"] < 2:
        return f"{s['mean']:.{digits}f} (one seed)"
    return f"{s['mean']:+.{digits}f} ± {s['std']:.{digits}f} [{s['ci_low']:+.{digits}f}, {s['ci_high']:+.{digits}f}]"


def _loss(s: dict) -> str:
    return f"{s['mean']:.4f} ± {s['std']:.4f}"


def _verdict(diff: dict, better: str, worse: str) -> str:
    if diff["n"] < 2:
        return "one seed: no interval"
    if diff["ci_high"] < 0:
        return f"{better} (the 95% interval excludes 0)"
    if diff["ci_low"] > 0:
        return f"{worse} (the 95% interval excludes 0)"
    return "no difference resolved at this noise level (the 95% interval includes 0)"


def summary(name: str, r: dict) -> str:
    return {"engram-vs-moe": _engram_vs_moe, "allocation": _allocation, "depth-probe": _depth_probe,
            "reuse": _reuse, "replay": _replay, "offload": _offload}[name](r)


def _engram_vs_moe(r: dict) -> str:
    a, d = r["arms"], r["engram_minus_moe"]
    acc = r["accounting"]
    return "\n".join([
        "| arm | total params | routed experts | Engram tables | active / token | val loss (mean ± std over seeds) |",
        "|---|---|---|---|---|---|",
        *(f"| {arm} | {acc[arm]['total']:,} | {acc[arm]['routed_experts']:,} | {acc[arm]['engram_tables']:,} | "
          f"{acc[arm]['active_per_token']:,} | {_loss(a[arm])} |" for arm in a),
        "",
        f"Engram - MoE, paired by seed: {_fmt(d)} nats (mean ± std [95% CI]); per seed "
        f"{', '.join(f'{x:+.4f}' for x in d['per_seed'])}. Verdict: "
        f"{_verdict(d, 'Engram + MoE is better', 'pure MoE is better')}."])


def _allocation(r: dict) -> str:
    rows = ["| rho | routed experts | Engram tables | val loss | minus rho = 0 (paired, 95% CI) | minus the best |",
            "|---|---|---|---|---|---|"]
    for p in r["points"]:
        diff = "reference" if p["minus_moe"] is None else _fmt(p["minus_moe"])
        best = "best" if p["minus_best"] is None else _fmt(p["minus_best"])
        rows.append(f"| {p['rho']:g} | {p['routed_experts']:,} | {p['engram_tables']:,} | "
                    f"{p['mean']:.4f} ± {p['std']:.4f} | {diff} | {best} |")
    rho = r["points"][-1]["rho"]
    if r["interior_minimum"] and r["fall_resolved"] and r["rise_resolved"]:
        shape = "a U-curve: both ends are resolved above the best point"
    elif r["interior_minimum"]:
        shape = (f"the fall from rho = 0 is {'resolved' if r['fall_resolved'] else 'not resolved'}, the rise to rho = "
                 f"{rho:g} {'is resolved' if r['rise_resolved'] else 'is not (within noise)'}: "
                 f"{'a U-curve' if r['fall_resolved'] and r['rise_resolved'] else 'no U-curve resolved'}")
    else:
        shape = "the minimum sits at an end of the range: no U-curve"
    return "\n".join(rows + ["", f"Lowest mean loss at rho = {r['best_rho']:g}; {shape}."])


def _depth_probe(r: dict) -> str:
    lens = r["lens_loss"]
    n = len(lens["moe"])
    rows = ["| layer | LogitLens loss, MoE | LogitLens loss, Engram | Engram ahead by (layers of the MoE curve) | "
            "most similar MoE layer (CKA) |", "|---|---|---|---|---|"]
    for i in range(n):
        lead = r["lens_lead_layers"][i]
        rows.append(f"| {i} | {lens['moe'][i]:.3f} | {lens[ENGRAM_ARM][i]:.3f} | "
                    f"{'-' if lead is None else f'{lead:+.2f}'} | {r['most_similar_moe_layer'][i]} "
                    f"(CKA {r['cka'][i][r['most_similar_moe_layer'][i]]:.3f}) |")
    return "\n".join(rows + ["", f"Over {r['tokens']:,} validation tokens, mean of the seeds."])


def _reuse(r: dict) -> str:
    a, d = r["arms"], r["released_minus_all_full"]
    acc = r["accounting"]
    rows = [f"Topology of the released pattern: {' '.join(r['topology'])}.", "",
            "| arm | total params | active / token | val loss |", "|---|---|---|---|",
            *(f"| {arm} | {acc[arm]['total']:,} | {acc[arm]['active_per_token']:,} | {_loss(a[arm])} |"
              for arm in a), "",
            f"Released (reuse) - all FULL, paired by seed: {_fmt(d)} nats. Verdict: "
            f"{_verdict(d, 'reuse is better', 'reuse costs loss')}.", "",
            "Top-k agreement in the all-FULL models: the share of layer j's own selection that equals the layer it "
            "would read from in the released pattern.", "",
            "| layer | mode in the release | reads from | agreement (mean ± std) | chance |", "|---|---|---|---|---|"]
    for p in r["topk_agreement"]:
        rows.append(f"| {p['layer']} | {p['mode']} | {p['reads_from']} | {p['mean']:.3f} ± {p['std']:.3f} | "
                    f"{p['chance']:.3f} |")
    return "\n".join(rows)


def _after_first(values: list[float]) -> float:
    """Mean over the teacher-forced decode tokens (everything after the prompt's next token)."""
    return sum(values[1:]) / max(1, len(values) - 1)


def _replay(r: dict) -> str:
    rows = ["| prompt length | NLL next token, exact | bounded | mean abs diff | KL(exact, bounded) | NLL of the next "
            f"{r['decode']} tokens, exact / bounded |", "|---|---|---|---|---|---|"]
    for p in r["by_length"]:
        kl = sum(p["kl_first"]) / len(p["kl_first"])
        rows.append(f"| {p['prompt_len']} | {p['nll_exact'][0]:.4f} | {p['nll_bounded'][0]:.4f} | "
                    f"{p['abs_diff'][0]:.4f} | {kl:.5f} | {_after_first(p['nll_exact']):.4f} / "
                    f"{_after_first(p['nll_bounded']):.4f} |")
    return "\n".join(rows + ["", f"{r['windows']} validation windows per length; bounded replay runs decoder layers "
                                 f"{r['decoder_layers']} on the last {r['sliding_window']} prompt positions; the "
                                 f"models were trained on {r['trained_seq_len']}-token windows."])


def _offload(r: dict) -> str:
    rows = ["| tier | tokens/s (mean ± std) | vs device (paired by round, 95% CI) |", "|---|---|---|"]
    for tier, t in r["tiers"].items():
        s = t["tokens_per_s"]
        vs = "reference" if t["vs_device"] is None else \
            f"{t['vs_device']['mean']:+.2%} [{t['vs_device']['ci_low']:+.2%}, {t['vs_device']['ci_high']:+.2%}]"
        rows.append(f"| {tier} | {s['mean']:.1f} ± {s['std']:.1f} | {vs} |")
    return "\n".join(rows + ["", f"{len(r['rounds'])} rounds of greedy generation ({r['prompt_tokens']} prompt + "
                                 f"{r['decode_tokens']} generated tokens), Engram table {r['table_bytes'] / 2**20:.0f} "
                                 f"MiB vs a backbone of {r['backbone_params']:,} parameters, {r['threads']} threads."])


# ---- plots ----------------------------------------------------------------------------------------------------

def plot(name: str, r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draw = {"engram-vs-moe": _plot_curves, "allocation": _plot_allocation, "depth-probe": _plot_depth,
            "reuse": _plot_reuse, "replay": _plot_replay, "offload": _plot_offload}[name]
    fig = draw(plt, r)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_curves(plt, r):
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, a in r["arms"].items():
        steps, losses = zip(*a["curve"])
        ax.plot(steps[1:], losses[1:], marker="o", label=f"{arm}: {a['mean']:.4f} ± {a['std']:.4f}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (mean of seeds)")
    ax.set_title("Engram + MoE vs MoE, equal total parameters")
    ax.legend()
    return fig


def _plot_allocation(plt, r):
    fig, ax = plt.subplots(figsize=(6, 4))
    pts = r["points"]
    ax.errorbar([p["rho"] for p in pts], [p["mean"] for p in pts], yerr=[p["std"] for p in pts], marker="o",
                capsize=4)
    for p in pts:
        ax.scatter([p["rho"]] * len(p["val_loss"]), p["val_loss"], color="gray", s=8, zorder=3)
    ax.set_xlabel("rho: share of the routed-expert budget moved to Engram")
    ax.set_ylabel("validation loss (mean ± std; dots: seeds)")
    ax.set_title("Sparse-budget allocation")
    return fig


def _plot_depth(plt, r):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm, v in r["lens_loss"].items():
        a1.plot(range(len(v)), v, marker="o", label=arm)
    a1.set_xlabel("layer")
    a1.set_ylabel("LogitLens loss")
    a1.set_title("LogitLens: loss of each layer's output")
    a1.legend()
    im = a2.imshow(r["cka"], origin="lower", cmap="viridis", vmin=0, vmax=1)
    a2.set_xlabel("MoE layer")
    a2.set_ylabel("Engram-model layer")
    a2.set_title("linear CKA")
    fig.colorbar(im, ax=a2)
    return fig


def _plot_reuse(plt, r):
    fig, ax = plt.subplots(figsize=(6, 4))
    pts = r["topk_agreement"]
    labels = [f"{p['layer']}<-{p['reads_from']}\n{p['mode']}" for p in pts]
    x = range(len(pts))
    ax.bar([i - 0.2 for i in x], [p["mean"] for p in pts], 0.4, yerr=[p["std"] for p in pts], capsize=4,
           label="own top-k = reused top-k")
    ax.bar([i + 0.2 for i in x], [p["chance"] for p in pts], 0.4, label="chance")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("share of the top-k in common")
    d = r["released_minus_all_full"]
    ax.set_title(f"CSA2 reuse: loss released - all FULL = {d['mean']:+.4f} ± {d['std']:.4f}")
    ax.legend()
    return fig


def _plot_replay(plt, r):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    lengths = [p["prompt_len"] for p in r["by_length"]]
    a1.plot(lengths, [p["nll_exact"][0] for p in r["by_length"]], marker="o", label="exact")
    a1.plot(lengths, [p["nll_bounded"][0] for p in r["by_length"]], marker="x", label="bounded replay")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("prompt length")
    a1.set_ylabel("NLL of the next token")
    a1.legend()
    a2.plot(lengths, [p["abs_diff"][0] for p in r["by_length"]], marker="o", label="next token")
    a2.plot(lengths, [_after_first(p["abs_diff"]) for p in r["by_length"]], marker="x",
            label=f"next {r['decode']} decode tokens")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("prompt length")
    a2.set_ylabel("mean |NLL exact - NLL bounded|")
    a2.legend()
    return fig


def _plot_offload(plt, r):
    fig, ax = plt.subplots(figsize=(6, 4))
    tiers = [t for t in r["tiers"] if r["tiers"][t]["vs_device"] is not None]
    vs = [r["tiers"][t]["vs_device"] for t in tiers]
    ax.bar(tiers, [100 * v["mean"] for v in vs],
           yerr=[[100 * (v["mean"] - v["ci_low"]) for v in vs], [100 * (v["ci_high"] - v["mean"]) for v in vs]],
           capsize=6)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.axhline(-3, color="red", linestyle="--", linewidth=0.8, label="-3% (the claim's bound)")
    ax.set_ylabel("throughput vs device, % (95% CI)")
    ax.set_title("Engram table offload, end to end")
    ax.legend()
    return fig
