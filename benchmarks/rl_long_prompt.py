"""One RL step on `tiny` with a long prompt: wall time and peak RSS (what a long agent or code prompt costs the
update; the training attention's scores grow with the square of the prompt).

    python benchmarks/rl_long_prompt.py [--words 2047] [--phases]

Two tasks of `--words` random words (about two tokens each: 2047 words are 4,094 tokens), LoRA rank 4, one prompt
a step, a group of 2, 2 new tokens, `--reward exact`. Prints the prompt's tokens, the seconds from building the
trainer to the end of the step, and the process's peak RSS (getrusage); `--phases` also prints the peak
after the rollouts and after each log-probs pass of the update.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path

from openflash.rl.config import RLConfig
from openflash.rl.trainer import RLTrainer

WORDS = ["cat", "dog", "sun", "tree", "book", "fish"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", type=int, default=2047)
    ap.add_argument("--phases", action="store_true", help="the peak RSS after each phase of the step")
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        tasks = Path(tmp) / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(args.words)),
                                             "answer": "x"}) + "\n" for _ in range(2)))
        cfg = RLConfig(init="tiny", tasks=str(tasks), out=str(Path(tmp) / "run"), reward="exact", lora=4, steps=1,
                       prompts_per_step=1, group_size=2, max_tokens=2, lr=1e-3, progress=False,
                       max_prompt_tokens=1 << 20)
        start = time.time()
        trainer = RLTrainer(cfg)
        if args.phases:
            _report_phases(trainer)
        trainer.fit()
        peak = _peak_mib()
        print(f"prompt {len(trainer.tasks[0].prompt_ids)} tokens: {time.time() - start:.1f} s, peak RSS "
              f"{peak:.0f} MiB")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _report_phases(trainer: RLTrainer) -> None:
    """Wrap the trainer's rollouts and log-probs passes to print the peak RSS after each."""
    print(f"built: peak RSS {_peak_mib():.0f} MiB")
    for name in ("_rollouts", "_logprobs"):
        method = getattr(trainer, name)

        def wrapped(*a, _method=method, _name=name, **k):
            out = _method(*a, **k)
            print(f"after {_name} (grad={k.get('grad', '-')}): peak RSS {_peak_mib():.0f} MiB")
            return out

        setattr(trainer, name, wrapped)


if __name__ == "__main__":
    main()
