"""The offload study's A/B: end-to-end greedy generation with the Engram table on each tier, rounds interleaved.

The model is the Engram arm's shape in the released storage formats (FP8 dense weights, FP4 experts, FP8 table
rows) with a table of `offload_table_mib`, far larger than the backbone; weights are random (throughput does not
depend on them). Every tier must produce the same tokens (checked). On a CPU-only machine `device` and `host`
share the same RAM, so the host figure measures the tier's machinery (gather, prefetch thread); disk reads a
memory-mapped table file with a warm page cache.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from openflash.config import FlashConfig
from openflash.engine.generate import generate
from openflash.engine.sampling import SamplingParams
from openflash.errors import OpenflashError
from openflash.experiments.arms import ENGRAM_LAYERS, ENGRAM_MAX_NGRAM
from openflash.memory.frontend import EngramFrontend
from openflash.memory.hashing import find_table_primes
from openflash.memory.table_file import table_file_name, write_table_file
from openflash.memory.tokenmap import build_compressed_token_map
from openflash.runtime.runtime import Runtime
from openflash.tokenizer import Tokenizer

TIERS = ("device", "host", "disk")


def offload_config(engram_arm: FlashConfig, tokenizer: Tokenizer, table_mib: int) -> FlashConfig:
    """The arm in stored formats, its Engram table grown to about `table_mib` MiB of FP8 rows (+ scales)."""
    row_bytes = engram_arm.engram_head_dim + engram_arm.engram_head_dim // 32
    columns = (ENGRAM_MAX_NGRAM - 1) * engram_arm.engram_n_heads
    vocab = max(2, table_mib * 2**20 // (row_bytes * columns * len(ENGRAM_LAYERS)))
    primes = find_table_primes(vocab, ENGRAM_LAYERS, ENGRAM_MAX_NGRAM, engram_arm.engram_n_heads)
    token_map = build_compressed_token_map(tokenizer, engram_arm.vocab_size)
    return engram_arm.replace(weight_dtype="fp8", expert_dtype="fp4", engram_vocab_size=vocab,
                              engram_num_embeddings=[sum(p) for p in primes],
                              engram_compressed_vocab_size=int(token_map.max()) + 1)


def build_tiers(cfg: FlashConfig, tokenizer: Tokenizer, table_dir: Path) -> dict[str, Runtime]:
    """One runtime per tier, each over its own copy of one model (the device tier's is the original)."""
    from openflash.checkpoint import build_model

    torch.manual_seed(0)
    reference = build_model(cfg, "fp32").eval()
    frontend = EngramFrontend.of(cfg, tokenizer)
    table_dir.mkdir(parents=True, exist_ok=True)
    for slot, lid in enumerate(cfg.engram_layer_ids):
        table = reference.engram_tables()[slot]
        write_table_file(table_dir / table_file_name(lid), table.weight.detach(), table.scale.detach(),
                         frontend.layout.layout_fingerprint(), chunk_rows=1 << 18)
    tiers = {}
    for name in TIERS:
        tiers[name] = Runtime.of(reference if name == "device" else copy.deepcopy(reference), tokenizer,
                                 frontend=frontend)
        tiers[name].place_engram(name, table_dir=table_dir, cache_bytes=0)
    return tiers


def ab_rounds(tiers: dict[str, Runtime], prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """One greedy generation per tier per prompt, the tier order rotated each round; tokens/s end to end."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rounds = []
    for r, prompt in enumerate(prompts):
        names = list(tiers)
        speeds, tokens = {}, {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            result = generate(tiers[name], prompt, params)
            speeds[name] = (len(prompt) + len(result.token_ids)) / (time.perf_counter() - start)
            tokens[name] = result.token_ids
        if len({tuple(t) for t in tokens.values()}) != 1:
            raise OpenflashError(f"offload round {r}: the tiers generated different tokens {tokens}")
        rounds.append(speeds)
    return rounds
