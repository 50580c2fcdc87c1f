"""Fine-tuning cost: peak memory and tokens/s of `train --lora` on a released-width checkpoint kept as stored, and of
full fine-tuning against LoRA on the `small` preset.

    python benchmarks/finetune.py [--experts 64] [--steps 4] [--seq-len 64] [--dir DIR] [--skip-released]

The released-width run goes twice: as is, and with `--checkpoint-activations`.

released: `openflash checkpoint synth flash DIR --layers 2 --experts E` (the release's widths: hidden 5120, FP8 dense
weights, FP4 experts 2304 wide, bf16 embedding and head over 129,280 ids; Engram tables as sparse files on the disk
tier), LoRA rank 8 on the default targets. Its target: peak RSS within 1.5x of the checkpoint's stored bytes,
Engram tables aside (the weights kept as stored + adapters + their optimizer state + one step's activations; no
fp32 copy of the base).
small: a `small` checkpoint in the official layout, full fine-tuning (fp32 master weights, AdamW) against LoRA rank 8.

Each run is a fresh process (its peak RSS is its own), training on chats rendered with the model's template.
Writes benchmarks/results/finetune.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
GiB = 1 << 30


def chats(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"ANSWER: {2 * i}"}]} for i in range(n)]


def stored_bytes(folder: Path) -> int:
    """Bytes of the checkpoint's tensors as stored, its Engram tables left out (on the disk tier they are read a
    row at a time, never held): from the safetensors headers."""
    total = 0
    for shard in folder.glob("*.safetensors"):
        with shard.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(end - start for name, t in header.items() if name != "__metadata__"
                     and "engram.embed" not in name for start, end in [t["data_offsets"]])
    return total


def peak_rss_bytes() -> int:
    """This process's peak RSS since its exec (VmHWM). Not ru_maxrss: Linux carries the parent's peak across a
    vfork+exec (subprocess's default), so a child spawned after the parent synthesized a checkpoint would report it."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) * 1024


def child(args: argparse.Namespace) -> None:
    """One training run in this process; prints a JSON line of its figures."""
    from openflash.train.trainer import TrainConfig, Trainer

    times: list[float] = []
    cfg = TrainConfig(data=args.data, out=args.out, init=args.init, steps=args.steps, batch_size=1,
                      seq_len=args.seq_len, lr=1e-4, warmup=1, eval_every=0, eval_batches=1, save_every=0,
                      progress=False, lora=args.lora, checkpoint_activations=args.checkpoint_activations)
    trainer = Trainer(cfg, on_step=lambda t, r: times.append(r["step_seconds"]))
    trainer.fit()
    trained = sum(p.numel() for p in trainer.params)
    print(json.dumps({"steps": len(times), "step_seconds": times,
                      "tokens_per_s": args.seq_len / statistics.median(times[1:] or times),
                      "trainable_params": trained, "peak_rss_bytes": peak_rss_bytes()}))


def run(init: Path, data: Path, out: Path, lora: int | None, steps: int, seq_len: int,
        recompute: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", "--init", str(init), "--data", str(data), "--out", str(out),
           "--steps", str(steps), "--seq-len", str(seq_len)] + (["--lora", str(lora)] if lora else []) + \
        (["--checkpoint-activations"] if recompute else [])
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["wall_seconds"] = time.perf_counter() - start
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64, help="routed experts per layer of the released-width cut")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    ap.add_argument("--skip-released", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--lora", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-activations", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    import torch

    from openflash.checkpoint import build_model, save_checkpoint
    from openflash.tools.synth import synthesize
    from openflash.train.chats import prepare_chats
    from openflash.train.tokenizer import train_bpe_tokenizer
    from openflash.train.trainer import training_model_config

    scratch = tempfile.TemporaryDirectory() if args.dir is None else None
    root = Path(args.dir or scratch.name)
    root.mkdir(parents=True, exist_ok=True)
    source = root / "chats.jsonl"
    source.write_text("\n".join(json.dumps(c) for c in chats(400)) + "\n")
    results: dict = {"torch_threads": torch.get_num_threads(), "steps": args.steps, "seq_len": args.seq_len}

    if not args.skip_released:
        base = root / f"flash_l2_e{args.experts}"
        if not (base / "config.json").exists():
            synthesize("flash", base, layers=2, experts=args.experts, vision=False)
        data = root / "flash_data"
        if not data.exists():
            own = base / "tokenizer.json"  # synth writes one for a cut vocabulary; the full one is DeepSeek's
            prepare_chats([source], str(own) if own.exists() else "deepseek", data, val_fraction=0.05)
        for key, recompute in (("released_width_lora", False), ("released_width_lora_recompute", True)):
            lora = run(base, data, root / "flash_lora", 8, args.steps, args.seq_len, recompute)
            lora["checkpoint_stored_bytes"] = stored_bytes(base)
            lora["rss_over_checkpoint"] = lora["peak_rss_bytes"] / lora["checkpoint_stored_bytes"]
            results[key] = lora
            print(f"released widths, 2 layers, {args.experts} experts: checkpoint "
                  f"{lora['checkpoint_stored_bytes'] / GiB:.2f} GiB stored; LoRA rank 8 "
                  f"({lora['trainable_params'] / 1e6:.1f} M params){' with --checkpoint-activations' * recompute}: "
                  f"peak RSS {lora['peak_rss_bytes'] / GiB:.2f} GiB ({lora['rss_over_checkpoint']:.2f}x the "
                  f"checkpoint; target <= 1.5x), {lora['tokens_per_s']:.1f} tokens/s", flush=True)

    small = root / "small_base"
    tok = root / "small_tok.json"
    if not (small / "config.json").exists():
        train_bpe_tokenizer([source], 2000, tok)
        torch.manual_seed(0)
        save_checkpoint(build_model(training_model_config("small", tok)), small, tokenizer_json=tok, dtype="fp8")
    data = root / "small_data"
    if not data.exists():
        prepare_chats([source], str(tok), data, val_fraction=0.05)
    for name, rank in (("small_full", None), ("small_lora", 8)):
        figures = run(small, data, root / name, rank, args.steps, args.seq_len)
        figures["checkpoint_stored_bytes"] = stored_bytes(small)
        results[name] = figures
        print(f"small, {'full fine-tuning' if rank is None else 'LoRA rank 8'}: {figures['trainable_params'] / 1e6:.2f} M "
              f"trained params, peak RSS {figures['peak_rss_bytes'] / GiB:.2f} GiB, {figures['tokens_per_s']:.1f} "
              f"tokens/s", flush=True)

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "finetune.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS / 'finetune.json'}")


if __name__ == "__main__":
    main()
