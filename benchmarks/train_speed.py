"""Training speed on this machine: tokens/s and MFU of full training steps (forward, backward, optimizer).

    python benchmarks/train_speed.py [--presets tiny small] [--batch-size 8] [--seq-len 256] [--steps 6]
                                     [--threads N] [--backends eager compiled] [--profile]

MFU = achieved model FLOP/s / peak. Model FLOPs per token = 6 x active params (matrices only; no token embedding,
no Engram tables, routed experts counted at top-k / n_experts) + attention (scores and value mixing over the
window and the picked compressed entries, x3 for forward + backward, and the indexer's scores). The peak is this
machine's fp32 matmul rate, measured by the script itself (a large square matmul, same thread count).
Writes benchmarks/results/train_speed.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from openflash.checkpoint import build_model
from openflash.config import FlashConfig, load_config
from openflash.model.numerics import TRAIN
from openflash.runtime.runtime import Runtime
from openflash.tokenizer import preset_tokenizer
from openflash.train.optim import (OptimConfig, TrainOptimizer, expert_loads, is_engram_table, reset_expert_loads,
                                   update_router_bias)

RESULTS = Path(__file__).parent / "results"


def matmul_peak(n: int = 2048, reps: int = 8, rounds: int = 5) -> float:
    """Best fp32 matmul FLOP/s over a few rounds (the machine may be shared; the best round is the peak)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - start))
    return best


def active_matrix_params(model: torch.nn.Module) -> int:
    cfg = model.cfg
    total = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name == "embed.weight" or is_engram_table(name):
            continue
        share = cfg.num_experts_per_tok / cfg.n_routed_experts if ".ffn.experts." in name else 1.0
        total += p.numel() * share
    return int(total)


def attention_flops_per_token(cfg: FlashConfig, seq_len: int) -> float:
    """Forward + backward attention FLOPs per token, averaged over the positions of a training sequence."""
    total = 0.0
    for t in cfg.topology.layers:
        for pos in range(seq_len):
            keys = min(pos + 1, cfg.sliding_window)
            if t.compress_ratio:
                visible = (pos + 1) // t.compress_ratio
                keys += min(cfg.index_topk, visible)
                if t.has_indexer:  # index scores against every visible entry
                    total += 3 * 2 * cfg.index_n_heads * cfg.index_head_dim * visible
            total += 3 * 4 * cfg.num_attention_heads * cfg.head_dim * keys  # q.k and p.v, forward + backward
    return total / seq_len


def _train_step(rt: Runtime, opt, params, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    """One full training step (as the trainer runs it); (forward, backward, optimizer) seconds."""
    model = rt.model
    t0 = time.perf_counter()
    opt.zero_grad()
    out = rt.forward(x, y)
    t1 = time.perf_counter()
    (out.loss + 0.01 * out.indexer_loss).backward()
    t2 = time.perf_counter()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    update_router_bias(model, expert_loads(model), 1e-3)
    reset_expert_loads(model)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def _loss_grads_loads(rt: Runtime, x: torch.Tensor,
                      y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    """The objective, every gradient and the per-expert token counts of one forward and backward."""
    model = rt.model
    model.zero_grad(set_to_none=True)
    reset_expert_loads(model)
    out = rt.forward(x, y)
    objective = out.loss + 0.01 * out.indexer_loss
    objective.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loads = expert_loads(model)
    reset_expert_loads(model)
    return float(objective), grads, loads


def backend_parity(a: tuple, b: tuple) -> dict:
    """How two backends' (objective, gradients, expert loads) on the same weights and batch compare. The loss
    agrees to fp32 rounding; the gradients also move where a last-bit difference flips a discrete choice (a
    token's expert, an indexer pick, near a tie), which moves that token's whole contribution: the loads count the
    routing flips (half the summed load differences, a lower bound)."""
    (loss_a, grads_a, loads_a), (loss_b, grads_b, loads_b) = a, b
    diff = sum(float((grads_a[n] - grads_b[n]).pow(2).sum()) for n in grads_a) ** 0.5
    norm = sum(float(g.pow(2).sum()) for g in grads_a.values()) ** 0.5
    return {"loss": [loss_a, loss_b], "loss_rel_diff": abs(loss_a - loss_b) / abs(loss_a),
            "grad_rel_l2_diff": diff / norm, "routing_flips": int((loads_a - loads_b).abs().sum()) // 2,
            "routed_pairs": int(loads_a.sum())}


def bench_preset(preset: str, batch: int, seq_len: int, steps: int, backends: list[str],
                 profile: bool = False) -> list[dict]:
    """One row per backend. The backends share one model and alternate step by step (the machine may be shared:
    interleaving exposes both to the same load); the compiled backend compiles in its warm-up steps."""
    torch.manual_seed(0)
    cfg = load_config(preset).replace(weight_dtype="fp32", expert_dtype="fp32")
    model = build_model(cfg, "train").train()
    rt = Runtime.of(model, preset_tokenizer(cfg))
    opt = TrainOptimizer(model, OptimConfig(lr=1e-3))
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, cfg.vocab_size, (steps + 2, batch, seq_len + 1), generator=gen)
    numerics = {b: TRAIN.with_compile(b == "compiled") for b in backends}
    warmup: dict[str, float] = {}
    for b in backends:  # the first steps pay one-off costs: allocation, initialisation, compilation
        model.set_numerics(numerics[b])
        start = time.perf_counter()
        for i in range(2):
            _train_step(rt, opt, params, tokens[i, :, :-1], tokens[i, :, 1:])
        warmup[b] = time.perf_counter() - start
    parity = None
    if len(backends) > 1:  # the same weights and batch through each backend
        x, y = tokens[0, :, :-1], tokens[0, :, 1:]
        results = []
        for b in backends:
            model.set_numerics(numerics[b])
            results.append(_loss_grads_loads(rt, x, y))
        parity = backend_parity(*results)
    times = {b: {"forward": [], "backward": [], "optimizer": [], "step": []} for b in backends}
    for i in range(2, steps + 2):
        for b in backends:
            model.set_numerics(numerics[b])
            f, bw, o = _train_step(rt, opt, params, tokens[i, :, :-1], tokens[i, :, 1:])
            for key, value in zip(times[b], (f, bw, o, f + bw + o)):
                times[b][key].append(value)
    if profile:
        for b in backends:
            model.set_numerics(numerics[b])
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for i in range(2):
                    _train_step(rt, opt, params, tokens[i, :, :-1], tokens[i, :, 1:])
            print(f"{preset} {b}: top ops of 2 training steps by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
    tokens_per_step = batch * seq_len
    active = active_matrix_params(model)
    flops_per_token = 6 * active + attention_flops_per_token(cfg, seq_len)
    rows = []
    for b in backends:
        step = statistics.median(times[b]["step"])
        rows.append({
            "preset": preset,
            "backend": b,
            "batch_size": batch,
            "seq_len": seq_len,
            "params": sum(p.numel() for p in model.parameters()),
            "active_matrix_params": active,
            "model_flops_per_token": flops_per_token,
            "warmup_seconds": warmup[b],
            "step_seconds_median": step,
            "step_seconds_best": min(times[b]["step"]),
            "forward_seconds": statistics.median(times[b]["forward"]),
            "backward_seconds": statistics.median(times[b]["backward"]),
            "optimizer_seconds": statistics.median(times[b]["optimizer"]),
            "tokens_per_s": tokens_per_step / step,
            "model_flops_per_s": flops_per_token * tokens_per_step / step,
            "parity": parity,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per preset (after 2 warm-up steps)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--backends", nargs="+", default=["eager"], choices=["eager", "compiled"],
                        help="eager: the train policy as the trainer runs it by default; compiled: `openflash train "
                             "--compile` (each block through torch.compile); several alternate step by step")
    parser.add_argument("--profile", action="store_true",
                        help="also print the torch.profiler table of the top ops of 2 steps per backend")
    parser.add_argument("--out", default=str(RESULTS / "train_speed.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # The machine may be shared: the peak is the best of measurements before and after the runs.
    peak = matmul_peak()
    rows = [row for preset in args.presets
            for row in bench_preset(preset, args.batch_size, args.seq_len, args.steps, args.backends,
                                    args.profile)]
    peak = max(peak, matmul_peak())
    print(f"fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    for row in rows:
        row["mfu"] = row["model_flops_per_s"] / peak
        row["mfu_best_step"] = row["model_flops_per_token"] * row["batch_size"] * row["seq_len"] / (
            row["step_seconds_best"] * peak)
    print(f"{'preset':8s} {'backend':9s} {'batch x seq':>12s} {'warm-up s':>9s} {'step s':>7s} {'fwd':>6s} "
          f"{'bwd':>6s} {'opt':>6s} {'tokens/s':>9s} {'MFLOP/tok':>10s} {'GFLOP/s':>8s} {'MFU':>6s} {'best step':>10s}")
    for r in rows:
        print(f"{r['preset']:8s} {r['backend']:9s} {r['batch_size']:>5d} x {r['seq_len']:<5d} "
              f"{r['warmup_seconds']:9.1f} {r['step_seconds_median']:7.2f} {r['forward_seconds']:6.2f} {r['backward_seconds']:6.2f} "
              f"{r['optimizer_seconds']:6.2f} {r['tokens_per_s']:9.0f} {r['model_flops_per_token'] / 1e6:10.1f} "
              f"{r['model_flops_per_s'] / 1e9:8.1f} {100 * r['mfu']:5.1f}% {100 * r['mfu_best_step']:9.1f}%")
    print("(step s, fwd, bwd, opt, tokens/s and MFU are medians over the timed steps; 'best step' is the MFU of the "
          "fastest step; warm-up: the first 2 steps, compilation included)")
    for r in rows:
        if r["parity"] is not None and r["backend"] == args.backends[0]:
            q = r["parity"]
            print(f"{r['preset']}: same weights and batch through {' and '.join(args.backends)}: loss "
                  f"{q['loss'][0]:.6f} / {q['loss'][1]:.6f} (relative difference {q['loss_rel_diff']:.1e}); "
                  f"gradients differ by {100 * q['grad_rel_l2_diff']:.2f}% (L2, all parameters); "
                  f"{q['routing_flips']} of {q['routed_pairs']} routed (token, expert) pairs flipped")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": {"threads": torch.get_num_threads(), "torch": torch.__version__,
                          "processor": platform.processor() or platform.machine(),
                          "matmul_peak_flops": peak},
              "results": rows}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
