"""`openflash eval`: lm-evaluation-harness tasks or held-out perplexity, in-process (evaluation/run.py).

The handler takes the parsed arguments and returns an exit code (cli.py declares the arguments)."""

from __future__ import annotations

import argparse


def evaluate(args: argparse.Namespace) -> int:
    from openflash.evaluation.run import EvalConfig, run_eval, summary

    tasks = tuple(t.strip() for t in (args.tasks or "").split(",") if t.strip())
    cfg = EvalConfig(model=args.model, tasks=tasks, perplexity=args.perplexity, lora=args.lora, limit=args.limit,
                     num_fewshot=args.num_fewshot, max_length=args.max_length, max_batch=args.max_batch,
                     apply_chat_template=args.apply_chat_template, seed=args.seed, numerics=args.numerics,
                     tokenizer=args.tokenizer, out=args.out)
    results = run_eval(cfg.validate())
    print(summary(results))
    if args.out:
        print(f"results: {args.out}")
    return 0
