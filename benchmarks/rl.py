"""RL at CPU scale: does `openflash rl` teach a model to do what its pretraining data got wrong, measured on tasks it
never trained on?

    python benchmarks/rl.py [--steps 40] [--pretrain-steps 400] [--dir DIR] [--init MODEL] [--released]

The task, with a checkable answer (exact reward on the completion's first number, `--answer-pattern`):

    k = 47
    q = 12
    assert k ==           -> " 47"

The base: `tiny` pretrained here (`openflash train`, a 512-id BPE) on such programs whose assert is right only 35% of
the time and names the distractor (the second value) otherwise, so greedy decoding starts almost always wrong while
the right answer is in the samples: RL with a verifiable reward has to overturn what the data taught. The RL
tasks (fresh programs) and the held-out ones use disjoint variable names (a-m, n-z); the held-out solved share (greedy, before
and every 10 steps) measures what generalizes. Also measured: the rollouts' tokens/s against `LLMEngine.generate`
alone on the same prompts and sampling, and the update's seconds per step. `--init MODEL` skips the pretraining
(the task then needs a model that knows it). `--released`: one RL step (LoRA rank 8) on a released-width cut
(`checkpoint synth flash --layers 2 --experts E`), its peak RSS against the checkpoint's stored bytes.

Writes benchmarks/results/rl.json and the reward curve (RUN/reward.png).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
GiB = 1 << 30
PATTERN = r"^\s*(\d+)"


def program(rng: random.Random, first: str) -> tuple[str, int, int]:
    """A prompt, its answer and the distractor (the other value)."""
    a, c = rng.sample(first, 2)
    value, other = rng.sample(range(10, 100), 2)
    return f"{a} = {value}\n{c} = {other}\nassert {a} ==", value, other


def tasks(rng: random.Random, first: str, n: int) -> list[dict]:
    return [{"prompt": prompt, "answer": str(value)} for prompt, value, _ in (program(rng, first) for _ in range(n))]


def pretrain(root: Path, steps: int) -> str:
    """`tiny` trained on programs whose assert is right 35% of the time (the distractor otherwise); its run folder."""
    from openflash.cli import main as cli_main

    run = root / "base"
    if (run / "checkpoints").is_dir():
        return str(run)
    rng = random.Random(7)
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for part in range(20):  # (several files: data prepare holds some out for validation)
        with (corpus / f"programs_{part:02d}.txt").open("w") as f:
            for _ in range(2_000):
                prompt, value, other = program(rng, string.ascii_lowercase)
                f.write(f"{prompt} {value if rng.random() < 0.35 else other}\n\n")
    tok = root / "tokenizer.json"
    for command in (["tokenizer", "train", str(corpus), "--vocab-size", "512", "--out", str(tok)],
                    ["data", "prepare", str(corpus), "--tokenizer", str(tok), "--out", str(root / "data")],
                    ["train", "--config", "tiny", "--data", str(root / "data"), "--out", str(run), "--steps",
                     str(steps), "--batch-size", "16", "--seq-len", "128", "--lr", "3e-3", "--warmup", "20",
                     "--eval-every", "0", "--save-every", "0"]):
        if cli_main(command) != 0:
            raise SystemExit(f"openflash {' '.join(command)} failed")
    return str(run)


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def engine_alone(init: str, task_file: Path, prompts: int, group: int, max_tokens: int) -> float:
    """Tokens/s of LLMEngine.generate on a step's prompts (group samples each), the base model, same sampling."""
    from openflash.engine.config import EngineConfig
    from openflash.engine.engine import LLMEngine
    from openflash.engine.sampling import SamplingParams
    from openflash.runtime.open import open_model

    runtime = open_model(init)
    rows = [json.loads(line) for line in task_file.read_text().splitlines()][:prompts]
    ids = [runtime.tokenizer.encode(r["prompt"], add_special_tokens=False).ids for r in rows]
    engine = LLMEngine(runtime, EngineConfig(max_batch=prompts * group, max_context=max(map(len, ids)) + max_tokens + 1,
                                             prefill_mode="exact", max_waiting=prompts * group + 1))
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i, stop=("\n",)) for i in range(prompts * group)]
    start = time.perf_counter()
    seqs = engine.generate([p for p in ids for _ in range(group)], params)
    return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - start)


def released_child(args: argparse.Namespace) -> None:
    from openflash.rl.config import RLConfig
    from openflash.rl.trainer import RLTrainer

    trainer = RLTrainer(RLConfig(init=args.init, tasks=args.tasks, out=args.out, reward="exact", lora=8,
                                 steps=1, prompts_per_step=2, group_size=2, max_tokens=4, micro_batch=4,
                                 answer_pattern=PATTERN, progress=False))
    record = trainer.train_step()
    sys.path.insert(0, str(Path(__file__).parent))
    from finetune import peak_rss_bytes

    record["peak_rss_bytes"] = peak_rss_bytes()
    print(json.dumps(record))


def released(root: Path, experts: int) -> dict:
    """One RL step on a released-width cut, in a child process: its peak RSS against the stored bytes."""
    sys.path.insert(0, str(Path(__file__).parent))
    from finetune import stored_bytes  # benchmarks/finetune.py: the checkpoint's bytes as stored, tables aside

    from openflash.tools.synth import synthesize

    base = root / f"flash_l2_e{experts}"
    if not (base / "config.json").exists():
        synthesize("flash", base, layers=2, experts=experts, vision=False)
    task_file = write(root / "released_tasks.jsonl", tasks(random.Random(1), "abc", 4))
    cmd = [sys.executable, __file__, "--child", "--init", str(base), "--tasks", str(task_file), "--out",
           str(root / "released_run")]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    stored = stored_bytes(base)
    figures = {"experts": experts, "checkpoint_stored_bytes": stored, "peak_rss_bytes": record["peak_rss_bytes"],
               "rss_over_checkpoint": record["peak_rss_bytes"] / stored, "rollout_seconds": record["rollout_seconds"],
               "update_seconds": record["update_seconds"], "wall_seconds": time.perf_counter() - start}
    print(f"released widths, 2 layers, {experts} experts: checkpoint {stored / GiB:.2f} GiB stored; one RL step "
          f"(2 prompts x 2 samples, LoRA rank 8): peak RSS {figures['peak_rss_bytes'] / GiB:.2f} GiB "
          f"({figures['rss_over_checkpoint']:.2f}x), rollouts {record['rollout_seconds']:.1f} s, update "
          f"{record['update_seconds']:.1f} s", flush=True)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", default=None, help="the base (default: tiny, pretrained here on the task's programs)")
    ap.add_argument("--pretrain-steps", type=int, default=400)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--dir", default=None, help="where tasks and the run go (default: a temporary folder)")
    ap.add_argument("--released", action="store_true", help="also one step on a released-width cut")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tasks", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return released_child(args)

    import torch

    from openflash.cli import main as cli_main

    scratch = tempfile.TemporaryDirectory() if args.dir is None else None
    root = Path(args.dir or scratch.name)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    train_file = write(root / "train.jsonl", tasks(rng, "abcdefghijklm", 400))
    held_file = write(root / "held_out.jsonl", tasks(rng, "nopqrstuvwxyz", 100))
    init = args.init or pretrain(root, args.pretrain_steps)
    run = root / "run"
    shutil.rmtree(run, ignore_errors=True)
    command = ["rl", "--init", init, "--tasks", str(train_file), "--eval-tasks", str(held_file), "--reward",
               "exact", "--answer-pattern", PATTERN, "--stop", "\n", "--max-tokens", "4", "--lora", "8",
               "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step), "--group-size",
               str(args.group_size), "--lr", str(args.lr), "--out", str(run), "--eval-every", "10", "--save-every", "0"]
    print("openflash " + " ".join(f"'{c}'" if c == "\n" or " " in c else c for c in command), flush=True)
    start = time.perf_counter()
    if cli_main(command) != 0:
        raise SystemExit("the RL run failed")
    wall = time.perf_counter() - start
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "reward_mean" in r]
    evals = [r for r in lines if "eval_solved" in r]
    cli_main(["plot", str(run)])
    alone = engine_alone(init, train_file, args.prompts_per_step, args.group_size, 4)
    median = sorted(r["rollout_tokens_per_s"] for r in steps)[len(steps) // 2]
    results = {"init": args.init or f"tiny pretrained {args.pretrain_steps} steps (benchmarks/rl.py)",
               "torch_threads": torch.get_num_threads(), "steps": len(steps),
               "wall_seconds": round(wall, 1), "held_out": [{k: r[k] for k in ("step", "eval_solved", "eval_reward")}
                                                           for r in evals],
               "reward_first_5": sum(r["reward_mean"] for r in steps[:5]) / 5,
               "reward_last_5": sum(r["reward_mean"] for r in steps[-5:]) / 5,
               "rollout_tokens_per_s_median": median, "engine_alone_tokens_per_s": round(alone, 1),
               "rollout_seconds_median": sorted(r["rollout_seconds"] for r in steps)[len(steps) // 2],
               "update_seconds_median": sorted(r["update_seconds"] for r in steps)[len(steps) // 2],
               "curve": [(r["step"], r["reward_mean"]) for r in steps]}
    print(f"held-out solved (greedy, {evals[0]['eval_tasks']} tasks): "
          + " -> ".join(f"{r['eval_solved']:.3f} (step {r['step']})" for r in evals))
    print(f"rollout reward: first 5 steps {results['reward_first_5']:.3f}, last 5 {results['reward_last_5']:.3f}")
    print(f"rollouts {median:.1f} tokens/s (median step) vs the engine alone {alone:.1f}; update "
          f"{results['update_seconds_median']:.2f} s/step; {wall / 60:.1f} min in all")

    if args.released:
        results["released_width"] = released(root, args.experts)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rl.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
