"""What structured output costs a decode step: the grammar's mask (serve/grammar.py, llguidance) over the real
DeepSeek vocabulary (129,280 ids), and the engine's shaping of a logits row with it (engine/logits.py), per token
of JSON that follows a schema.

    python benchmarks/grammar_mask.py [--tokens 400] [--out benchmarks/results/grammar_mask.json]

One grammar state walks a valid document token by token (the likeliest allowed token each step, from a fixed random
logits row): for each step, the mask (`allowed`), the shaping of one [V] row (`shape_logits`) and the token's
advance are timed; figures are median / 90th percentile in microseconds, plus the tokenizer index's one-time build.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from openflash.engine.logits import shape_logits
from openflash.engine.request import Sequence
from openflash.engine.sampling import SamplerState, SamplingParams
from openflash.serve.grammar import GrammarCompiler
from openflash.serve.protocol import ResponseFormat
from openflash.tokenizer import deepseek_tokenizer_path

RESULTS = Path(__file__).parent / "results" / "grammar_mask.json"
VOCAB, EOS = 129280, 1
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "score"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
                         "score": {"type": "integer", "minimum": 0, "maximum": 1000}}}


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=400, help="most steps to walk")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_file(str(deepseek_tokenizer_path()))
    compiler = GrammarCompiler(tokenizer, VOCAB, EOS)
    start = time.perf_counter()
    grammar = compiler.grammar(ResponseFormat(type="json_schema", json_schema={"name": "x", "schema": SCHEMA}))
    index_s = time.perf_counter() - start
    state = compiler.start(grammar)
    seq = Sequence("bench", [0], SamplingParams(), SamplerState.create(SamplingParams()), eos_token_id=EOS)
    seq.constraint = state
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    mask_us, shape_us, advance_us, tokens = [], [], [], []
    for _ in range(args.tokens):
        t0 = time.perf_counter()
        state.allowed(VOCAB)
        t1 = time.perf_counter()
        row = shape_logits(logits, [seq])  # (computes the mask again, inside, as the engine does)
        t2 = time.perf_counter()
        token = int(row.argmax())
        if token == EOS:
            break
        state.advance(token)
        t3 = time.perf_counter()
        mask_us.append((t1 - t0) * 1e6)
        shape_us.append((t2 - t1) * 1e6)
        advance_us.append((t3 - t2) * 1e6)
        tokens.append(token)
        if state.finished:
            break
    text = tokenizer.decode(tokens)
    json.loads(text)  # the walk produced a valid document
    report = {
        "vocabulary": VOCAB, "steps": len(tokens), "document chars": len(text),
        "tokenizer index + schema compile s (once)": round(index_s, 3),
        "mask us (median / p90)": f"{statistics.median(mask_us):.0f} / {_pct(mask_us, 0.9):.0f}",
        "shape one row us (median / p90)": f"{statistics.median(shape_us):.0f} / {_pct(shape_us, 0.9):.0f}",
        "advance us (median / p90)": f"{statistics.median(advance_us):.0f} / {_pct(advance_us, 0.9):.0f}",
        "torch": torch.__version__,
    }
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
