"""openflash on one GPU: parity, decode, the engine, training and the released-width cut, in one run.

    python benchmarks/gpu.py [--budget-s 470] [--cut-dir /tmp/openflash-cut] [--skip NAME ...] [--dry-run]

Runs from a checkout where PyTorch with CUDA is installed (PYTHONPATH=src, no `make`), prints one table and writes
benchmarks/results/gpu.json (a dry run: the temp folder). Sections, each timed against what is left of the budget
(one that would not fit is skipped and says so):

- hardware: a device-to-device copy (GB/s) and a bf16 matmul (TFLOP/s) measured here, the ceilings below;
- kernels (gpu_kernels.py): the Triton kernels at released shapes beside the PyTorch paths they replace: products
  on stored FP8 / MXFP4 weights, a MoE layer's routed experts in one call, the indexer's scores and a decode step's
  attention (window ring and picked entries) read in place from the packed cache;
- parity: every golden on the device, teacher-forced, in fp32 and reference numerics, the weights dequantized and
  as stored (failing keys named);
- decode: `small`, batch 1, 512-token prompt: eager, compiled (one graph) and compiled replayed as a CUDA graph;
- engine: `small` under LLMEngine at 1, 16 and 64 clients (128-token prompts, 64 tokens each), CUDA graphs;
- train: `small`, batch 16 x 512, fp32 and bf16 autocast: tokens/s and model FLOP utilization against the matmul
  above (6 x the parameters a token activates, the embedding lookup left out);
- released: a released-width cut (`checkpoint synth flash --layers 2 --experts 32 --no-vision`), weights stored and
  dequantized, Engram tables in HBM, pinned host memory and on disk: load time, GPU memory, decode ms/token at 1 and
  64 concurrent streams.

Peak GPU memory is recorded for each. --dry-run runs every section on the CPU at toy sizes, to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

if "--dry-run" in sys.argv:  # the Triton kernels on CPU tensors: the interpreter, on before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from openflash.config import load_config
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.sampling import SamplingParams
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.tools.parity import run_golden
from openflash.tools.plan import build_plan

from gpu_kernels import kernels  # (benchmarks/ is this script's own folder on sys.path)

RESULTS = Path(__file__).parent / "results"
GOLDENS = ("tests/goldens/A", "tests/goldens/A2", "tests/goldens/B2", "tests/goldens/D")
GiB = 1 << 30


class Bench:
    """The run's device, deadline and results."""

    def __init__(self, device: torch.device, budget_s: float, dry: bool, out: Path) -> None:
        self.device, self.dry, self.out = device, dry, out
        self.deadline = time.monotonic() + budget_s
        self.results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                                        else "cpu (dry run)", "torch": torch.__version__}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / GiB if self.device.type == "cuda" else None

    def section(self, name: str, needs_s: float, fn: Callable[["Bench"], Any]) -> None:
        if self.left() < needs_s:
            self.results[name] = {"skipped": f"{self.left():.0f} s left of the budget, needs ~{needs_s:.0f} s"}
            print(f"[{name}] skipped: {self.results[name]['skipped']}", flush=True)
            return
        start = time.monotonic()
        print(f"[{name}] ...", flush=True)
        try:
            self.results[name] = fn(self)
        except Exception as exc:  # one section's failure is recorded; the others still run
            self.results[name] = {"error": f"{type(exc).__name__}: {exc}",
                                  "trace": traceback.format_exc().splitlines()[-8:]}
        self.results[name + "_seconds"] = round(time.monotonic() - start, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)  # after every section: a run stopped later keeps it
        self.out.write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        print(f"[{name}] {time.monotonic() - start:.1f} s: {json.dumps(self.results[name], default=str)[:600]}",
              flush=True)


def hardware(b: Bench) -> dict[str, float]:
    n = (256 << 20) if not b.dry else (8 << 20)
    src = torch.empty(n, dtype=torch.float32, device=b.device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        b.sync()
        t = time.perf_counter()
        dst.copy_(src)
        b.sync()
        times.append(time.perf_counter() - t)
    copy = 2 * src.numel() * 4 / min(times[2:]) / 1e9  # bytes read + written
    m = 8192 if not b.dry else 256
    dtype = torch.bfloat16 if not b.dry else torch.float32
    x, y = torch.randn(m, m, dtype=dtype, device=b.device), torch.randn(m, m, dtype=dtype, device=b.device)
    times = []
    for _ in range(12):
        b.sync()
        t = time.perf_counter()
        x @ y
        b.sync()
        times.append(time.perf_counter() - t)
    return {"copy_GBps": round(copy, 1), "bf16_matmul_TFLOPs": round(2 * m ** 3 / min(times[2:]) / 1e12, 1)}


def parity(b: Bench) -> dict[str, Any]:
    """`openflash parity` on the device: every golden, both numerics, the weights dequantized and as stored (the
    Triton products, experts and cache kernels)."""
    out = {}
    for weights in ("dequantized", "stored"):
        for numerics in ("fp32", "reference"):
            for golden in GOLDENS:
                failed = [c for c in run_golden(golden, numerics, weights=weights, device=str(b.device))
                          if not c.passed]
                out[f"{Path(golden).name}/{numerics}/{weights}"] = "PASS" if not failed else \
                    {"failed": len(failed), "keys": [f"{c.key} max|d|={c.max_abs:.2e}" for c in failed[:6]]}
    return out


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _decode_ms(b: Bench, rt: Any, prompt: list[int], steps: int, warm: int) -> float:
    cache = rt.new_cache(1)
    logits = rt.step(torch.tensor([prompt]), cache)
    times = []
    for i in range(warm + steps):
        token = logits.argmax(-1)
        b.sync()
        t = time.perf_counter()
        logits = rt.decode(token, cache)
        b.sync()
        if i >= warm:
            times.append(time.perf_counter() - t)
    return round(1000 * statistics.median(times), 3)


def _forced_logits(rt: Any, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The logits of each step of `tokens` fed one at a time after `prompt` (teacher-forced), on the CPU."""
    cache = rt.new_cache(1)
    out = [rt.step(torch.tensor([prompt]), cache).float().cpu()]
    for t in tokens:
        out.append(rt.decode(torch.tensor([t]), cache).float().cpu())
    return out


def decode(b: Bench) -> dict[str, Any]:
    preset = "small" if not b.dry else "tiny"
    prompt = _prompt(load_config(preset).vocab_size, 512 if not b.dry else 64)
    steps = 64 if not b.dry else 8
    out: dict[str, Any] = {}
    b.reset_peak()
    eager = open_model(preset, placement=Placement(device=str(b.device), weights="dequantized"))
    out["eager_ms"] = _decode_ms(b, eager, prompt, steps, warm=4)
    compiled = open_model(preset, placement=Placement(device=str(b.device), weights="dequantized", compile=True))
    start = time.perf_counter()
    out["graph_ms"] = _decode_ms(b, compiled, prompt, steps, warm=6)
    out["graph_first_steps_s"] = round(time.perf_counter() - start, 1)
    forced = _prompt(compiled.cfg.vocab_size, 16, seed=7)
    replayed = _forced_logits(compiled, prompt[:64], forced)
    graph = next(iter(compiled.graphs.values()))
    out["graph_stats"] = graph.stats()
    if graph._replayed is not None:  # the same compiled graph with CUDA graph replay off, for the A/B
        graph._replayed = None
        out["compiled_no_cuda_graph_ms"] = _decode_ms(b, compiled, prompt, steps, warm=4)
        plain = _forced_logits(compiled, prompt[:64], forced)
        out["replay_vs_compiled_max_abs"] = max(float((r - p).abs().max()) for r, p in zip(replayed, plain))
    eager_logits = _forced_logits(eager, prompt[:64], forced)
    out["compiled_vs_eager_max_abs"] = max(float((r - e).abs().max()) for r, e in zip(replayed, eager_logits))
    del eager
    out["peak_gib"] = b.peak_gib()
    return out


def engine(b: Bench) -> dict[str, Any]:
    preset = "small" if not b.dry else "tiny"
    rt = open_model(preset, placement=Placement(device=str(b.device), weights="dequantized", compile=True))
    vocab = rt.cfg.vocab_size
    out: dict[str, Any] = {}
    b.reset_peak()
    eng = LLMEngine(rt, EngineConfig(max_batch=64, max_context=256, prefill_batch=16, max_step_tokens=4096,
                                     prefix_cache=False))
    params = SamplingParams(max_tokens=64 if not b.dry else 8)
    for clients in ((1, 16, 64) if not b.dry else (1, 4)):
        prompts = [_prompt(vocab, 128 if not b.dry else 16, seed=i) for i in range(clients)]
        runs = []
        for _ in range(2):  # the first compiles and records; the second is the figure
            start = time.perf_counter()
            seqs = eng.generate(prompts, params, ignore_eos=True)
            b.sync()
            runs.append(sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - start))
        out[f"clients_{clients}_tokens_per_s"] = round(runs[-1], 1)
        out[f"clients_{clients}_first_run_tokens_per_s"] = round(runs[0], 1)
    out["decode_graph"] = rt.stats()["decode_graph"]
    out["peak_gib"] = b.peak_gib()
    return out


def train(b: Bench) -> dict[str, Any]:
    preset = "small" if not b.dry else "tiny"
    batch, seq = (16, 512) if not b.dry else (2, 32)
    cfg = load_config(preset)
    # 6 FLOPs per weight a token meets (forward + backward); the embedding is a lookup, the head a product
    flops_per_token = 6 * (build_plan(preset).active_decode_token - cfg.vocab_size * cfg.hidden_size)
    peak = b.results.get("hardware", {}).get("bf16_matmul_TFLOPs")
    out: dict[str, Any] = {"flops_per_token": flops_per_token}
    for autocast in ("off", "bf16") if b.device.type == "cuda" else ("off",):
        rt = open_model(preset, numerics="train", placement=Placement(device=str(b.device), engram="device"))
        rt.model.train()
        opt = torch.optim.AdamW([p for p in rt.model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(3, rt.cfg.vocab_size, (batch, seq + 1)).pin_memory() if b.device.type == "cuda" \
            else torch.randint(3, rt.cfg.vocab_size, (batch, seq + 1))
        b.reset_peak()
        times = []
        for i in range(8):
            b.sync()
            t = time.perf_counter()
            ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast == "bf16" else torch.autocast("cpu",
                                                                                                        enabled=False)
            with ctx:
                loss = rt.forward(ids[:, :-1], ids[:, 1:]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            b.sync()
            if i >= 3:
                times.append(time.perf_counter() - t)
        tokens_s = batch * seq / statistics.median(times)
        out[autocast] = {"step_ms": round(1000 * statistics.median(times), 1), "tokens_per_s": round(tokens_s),
                         "loss": round(float(loss.detach()), 3), "peak_gib": b.peak_gib(),
                         "mfu": round(flops_per_token * tokens_s / (peak * 1e12), 4) if peak else None}
        del rt, opt
    return out


def _streams_ms(b: Bench, rt: Any, streams: int, steps: int) -> float:
    """Decode ms per step of `streams` sequences at once (32-token prompts prefilled together)."""
    cache = rt.new_cache(streams)
    prompts = torch.tensor([_prompt(rt.cfg.vocab_size, 32, seed=s) for s in range(streams)])
    logits = rt.step(prompts, cache)
    times = []
    for i in range(steps + 2):
        token = logits.argmax(-1)
        b.sync()
        t = time.perf_counter()
        logits = rt.decode(token, cache)
        b.sync()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return round(1000 * statistics.median(times), 2)


def released(b: Bench, cut_dir: Path) -> dict[str, Any]:
    from openflash.tools.synth import synthesize

    out: dict[str, Any] = {}
    if not (cut_dir / "config.json").is_file():
        start = time.perf_counter()
        if b.dry:
            synthesize("tiny", cut_dir, seed=0, vision=False)
        else:
            synthesize("flash", cut_dir, layers=2, experts=32, seed=0, vision=False)
        out["synth_s"] = round(time.perf_counter() - start, 1)
    steps = 8 if not b.dry else 3
    for weights, engram in (("stored", "host"), ("stored", "device"), ("stored", "disk"), ("dequantized", "host")):
        name = f"{weights}/{engram}"
        if b.left() < 100 and not b.dry:
            out[name] = {"skipped": f"{b.left():.0f} s left"}
            continue
        b.reset_peak()
        start = time.perf_counter()
        try:
            rt = open_model(str(cut_dir), placement=Placement(device=str(b.device), weights=weights, engram=engram))
            loaded = time.perf_counter() - start
            row = {"load_s": round(loaded, 1),
                   "gpu_allocated_gib": round(torch.cuda.memory_allocated(b.device) / GiB, 2)
                   if b.device.type == "cuda" else None,
                   "ms_per_token_1": _streams_ms(b, rt, 1, steps),
                   "ms_per_step_64": _streams_ms(b, rt, 64 if not b.dry else 4, steps),
                   "peak_gib": b.peak_gib(), "engram_tier": rt.memory.placement}
            row["tokens_per_s_64"] = round((64 if not b.dry else 4) * 1000 / row["ms_per_step_64"], 1)
            rt.close()
            del rt
        except Exception as exc:
            row = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc().splitlines()[-6:]}
        out[name] = row
        print(f"  {name}: {json.dumps(row, default=str)[:400]}", flush=True)
    return out


def table(results: dict[str, Any]) -> str:
    lines = [f"openflash on {results['device']} (torch {results['torch']})"]
    for name, value in results.items():
        if isinstance(value, dict):
            lines.append(f"{name}:")
            for k, v in value.items():
                lines.append(f"  {k:<36} {json.dumps(v, default=str)[:160]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=470, help="stop starting sections after this many seconds")
    ap.add_argument("--cut-dir", default="/tmp/openflash-cut", help="where the released-width cut is written")
    ap.add_argument("--skip", nargs="*", default=[], help="sections to leave out")
    ap.add_argument("--dry-run", action="store_true", help="every section on the CPU at toy sizes")
    ap.add_argument("--out", default=None,
                    help="results JSON (default: benchmarks/results/gpu.json; a dry run's go to the temp folder)")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device (--dry-run checks it on the CPU)", file=sys.stderr)
        return 2
    default = Path(tempfile.gettempdir()) / "openflash-gpu-dry-run.json" if args.dry_run else RESULTS / "gpu.json"
    out = Path(args.out) if args.out else default  # a dry run's toy figures never land in the results folder
    b = Bench(torch.device("cuda" if not args.dry_run else "cpu"), args.budget_s, args.dry_run, out)
    sections = [("hardware", 5, hardware), ("kernels", 30, kernels), ("parity", 60, parity), ("decode", 90, decode),
                ("released", 150, lambda bb: released(bb, Path(args.cut_dir))), ("engine", 90, engine),
                ("train", 30, train)]
    for name, needs, fn in sections:
        if name not in args.skip:
            b.section(name, needs if not args.dry_run else 0, fn)
    print(table(b.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
