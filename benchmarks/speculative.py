"""DSpark speculative decoding against plain decoding, side by side in one run.

    python benchmarks/speculative.py --model DRAFTED [--batches 1 8] [--max-tokens 64] [--rounds 2]
    python benchmarks/speculative.py --init RUN --train-steps 300 ...   # train the drafter first

--model: a checkpoint with a DSpark head (`openflash train --dspark --init RUN --out DRAFTED`); --init trains one
into a temporary folder first. Greedy decoding of code prompts (the demo's, plus lines of the model's validation
data); for each batch size the plain and the speculative engine run alternately `--rounds` times. Prints decode
tokens/s (generated tokens after the first, over the time since each request's first token), accepted drafts per
round and by block position, and checks that both produce the same tokens. Writes
benchmarks/results/speculative.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.sampling import SamplingParams
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.runtime.runtime import Runtime
from openflash.tools.demo import PROMPTS

RESULTS = Path(__file__).parent / "results"
EXTRA_PROMPTS = ("for i in range(", "    return ", "from typing import ", "if __name__ == ")


def _decode_rate(seqs, batch: int) -> float:
    """Generated tokens after each request's first, per second of decoding: one request at a time (batch 1), each
    request's own span; concurrent requests, the span from the first first-token to the last token."""
    tokens = sum(len(s.output_ids) - 1 for s in seqs)
    if batch == 1:
        return tokens / sum(s.token_times[-1] - s.token_times[0] for s in seqs)
    return tokens / (max(s.token_times[-1] for s in seqs) - min(s.token_times[0] for s in seqs))


def run(rt: Runtime, prompts, batch: int, max_tokens: int, speculative: bool, k: int | None) -> dict:
    engine = LLMEngine(rt, EngineConfig(max_batch=batch, prefix_cache=False,
                                        speculative="dspark" if speculative else None,
                                        num_speculative_tokens=k if speculative else None))
    begin = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens), ignore_eos=True)
    m = engine.metrics
    out = {"tokens_per_s": _decode_rate(seqs, batch), "seconds": time.perf_counter() - begin,
           "outputs": [s.output_ids for s in seqs]}
    if speculative:
        out.update(rounds=m.spec_rounds, drafted=m.spec_drafted, accepted=m.spec_accepted,
                   acceptance_length=m.acceptance_length(),
                   accepted_at={p: m.spec_accepted_at.get(p, 0) / m.spec_rounds for p in range(1, (k or 5) + 1)})
    return out


def part_costs(rt: Runtime, prompt: list[int], k: int, repeats: int = 20) -> dict:
    """Median milliseconds, batch 1, after the prompt: one plain decode step, one verify step of k + 1 tokens, one
    draft call (a cache copy per call, so every call starts from the same state)."""
    from openflash.model.transformer import TargetHidden

    base = rt.new_cache(spare=k + 1)
    _, hidden = rt.step_hidden(torch.tensor([prompt]), base)
    last = TargetHidden(hidden.values[:, -1:], hidden.positions[:, -1:])

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            cache = base.select([0])
            begin = time.perf_counter()
            fn(cache)
            times.append(time.perf_counter() - begin)
        return 1000 * statistics.median(times)

    def verify(cache, n):
        rt.step(torch.full((1, n), 5), cache, all_logits=True)

    anchor = torch.tensor([5])
    return {"decode_step_ms": timed(lambda c: verify(c, 1)), "verify_step_ms": timed(lambda c: verify(c, k + 1)),
            "draft_ms": timed(lambda c: rt.model.draft(anchor, last, c, lambda logits, i: logits.argmax(-1)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder with a DSpark head")
    ap.add_argument("--init", default=None, help="or: a trained run; a drafter is trained for it first")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    scratch = None
    if args.model is None:
        if args.init is None:
            sys.exit("give --model DRAFTED or --init RUN")
        from openflash.train.dspark import DraftTrainConfig, train_drafter
        scratch = tempfile.TemporaryDirectory(prefix="openflash-drafter-")
        summary = train_drafter(DraftTrainConfig(init=args.init, out=scratch.name, steps=args.train_steps))
        print(f"trained a drafter for {args.init}: {summary['steps']} steps, greedy agreement "
              f"{summary['first']['greedy_agreement']:.2f} -> {summary['last']['greedy_agreement']:.2f}")
        args.model = scratch.name
    rt = open_model(args.model, placement=Placement(weights="dequantized"))
    if rt.cfg.dspark is None:
        sys.exit(f"{args.model} has no DSpark head (train one: openflash train --dspark --init RUN --out DIR)")
    tok = rt.tokenizer
    all_prompts = [tok.encode(p).ids for p in PROMPTS + EXTRA_PROMPTS]
    results = []
    for batch in args.batches:
        prompts = all_prompts  # 8 requests: one at a time (batch 1) or together (batch 8)
        runs = {"plain": [], "speculative": []}
        for _ in range(args.rounds):  # alternate, so that drift on a shared machine hits both alike
            for name in runs:
                runs[name].append(run(rt, prompts, batch, args.max_tokens, name == "speculative",
                                      args.num_speculative_tokens))
        same = all(r["outputs"] == runs["plain"][0]["outputs"] for r in runs["plain"] + runs["speculative"])
        spec = runs["speculative"][-1]
        row = {"batch": batch, "requests": len(prompts), "max_tokens": args.max_tokens,
               "plain_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["plain"]),
               "speculative_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["speculative"]),
               "acceptance_length": spec["acceptance_length"], "accepted_per_round": spec["accepted"] / spec["rounds"],
               "accepted_at_position": spec["accepted_at"], "identical_outputs": same}
        row["speedup"] = row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
        results.append(row)
        print(f"batch {batch}: plain {row['plain_tokens_per_s']:.1f} tok/s, speculative "
              f"{row['speculative_tokens_per_s']:.1f} tok/s (x{row['speedup']:.2f}); "
              f"{row['acceptance_length']:.2f} tokens per verification, accepted by position "
              + ", ".join(f"{p}: {v:.2f}" for p, v in row["accepted_at_position"].items())
              + f"; identical outputs: {same}")
    costs = part_costs(rt, all_prompts[0], args.num_speculative_tokens or rt.cfg.dspark.block_size)
    print("batch 1 costs: plain decode step {decode_step_ms:.1f} ms, verify step {verify_step_ms:.1f} ms, "
          "draft {draft_ms:.1f} ms".format(**costs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(args.model), "threads": args.threads, "results": results,
                                    "costs": costs}, indent=1) + "\n")
    print(f"wrote {args.out}")
    if scratch is not None:
        scratch.cleanup()


if __name__ == "__main__":
    main()
