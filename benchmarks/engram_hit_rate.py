"""How well does an LRU row cache serve the released Engram tables? Hit rate against cache size, on real text.

    python benchmarks/engram_hit_rate.py [--corpus code english] [--max-tokens 1000000]

The Engram paper proposes a multi-level cache for its tables (hot rows in fast memory, the rest on slower tiers)
but does not measure how hot the rows are. This script does, with the released hash: the `flash` preset's Engram
layout (layers 1 and 14, 24 columns each: n-gram orders 2, 3, 4 x 8 heads, real primes and multipliers, tables of
~384M rows = ~101 GB per layer) and the real DeepSeek tokenizer. Only hash ids are needed, no tables.

Each file (duplicates skipped) is one sequence (hash state reset at its start, engram.md §4), read token by token:
a token looks up 24 rows per layer, all distinct. Each layer has its own cache (as each table file has its own row
cache). For every
lookup the exact LRU stack distance is computed (the number of distinct rows touched since that row's previous
lookup); an LRU cache of C rows hits exactly when it is < C, so one pass gives the hit rate for every size. Sizes
are fractions of the layer's rows; a fraction of rows is the same fraction of the table's bytes (264 B per row).

Corpora (no downloads): `code` = the Python standard library sources (files in a fixed shuffled order); `english` =
the English prose available locally (Python's reference-manual topics in pydoc_data, IDLE's NEWS/help text,
/usr/share/common-licenses, and the .md/.rst/.txt files of the virtualenv's packages).

Writes benchmarks/results/engram_hit_rate.{json,png} and prints a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from openflash.config import load_config
from openflash.memory.frontend import EngramFrontend
from openflash.tokenizer import DEEPSEEK, load_tokenizer
from openflash.train.tokenizer import iter_text_files, read_text_file, stdlib_source_dir

RESULTS = Path(__file__).parent / "results"
FRACTIONS = [1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1]  # of the layer's table rows
ROW_BYTES = 264  # 256 FP8 values + 8 UE8M0 scales (engram.md §5)


# ----------------------------------------------------------------------------------------------------------------
# Corpora


def corpus_files(name: str) -> list[Path]:
    stdlib = stdlib_source_dir()
    if name == "code":
        files = list(iter_text_files([stdlib], ["*.py"]))
        random.Random(0).shuffle(files)  # a spread of modules, not just the alphabetically first ones
        return files
    if name == "english":
        files = [stdlib / "pydoc_data" / "topics.py"]
        files += list(iter_text_files([stdlib / "idlelib"], ["*.txt"]))
        files += list(iter_text_files(["/usr/share/common-licenses"], []))
        files += list(iter_text_files([Path(sys.prefix) / "lib"], ["*.md", "*.rst", "*.txt"]))
        return [f for f in files if f.is_file()]
    raise SystemExit(f"unknown corpus {name!r}: choose code or english")


def corpus_hash_ids(name: str, frontend: EngramFrontend, tokenizer, max_tokens: int) -> tuple[np.ndarray, int, int]:
    """Row ids [T, L, C] of the corpus (files as separate sequences, in order), tokens, files."""
    chunks, tokens, files, seen = [], 0, 0, set()
    for path in corpus_files(name):
        text, _ = read_text_file(path)
        digest = hashlib.sha256((text or "").encode()).digest()
        if not text or digest in seen:  # duplicates (symlinked licenses, vendored copies) would inflate hits
            continue
        seen.add(digest)
        ids = tokenizer.encode(text).ids[: max_tokens - tokens]
        if len(ids) < 2:
            continue
        x = torch.tensor([ids], dtype=torch.int64)
        rows, _ = frontend.hash(x, frontend.hasher.empty_state(1))
        chunks.append(rows[0].numpy())
        tokens, files = tokens + len(ids), files + 1
        if tokens >= max_tokens:
            break
    return np.concatenate(chunks), tokens, files


# ----------------------------------------------------------------------------------------------------------------
# Exact LRU stack distances


def previous_occurrence(stream: np.ndarray) -> np.ndarray:
    """prev[i] = index of the previous access to stream[i]'s row, -1 for a first access."""
    order = np.argsort(stream, kind="stable")
    prev = np.full(len(stream), -1, dtype=np.int64)
    same = stream[order[1:]] == stream[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    return prev


def earlier_greater(values: np.ndarray) -> np.ndarray:
    """count[i] = #{b < i : values[b] > values[i]}, by a bottom-up merge sort vectorised level by level.

    At each level, pairs of sorted runs (left, right) are merged with one stable sort (timsort merges the runs).
    A right element moves left in the merge by exactly the number of left elements greater than it; left
    elements only move right. So each element's count grows by max(old slot - new slot, 0) per level."""
    n = len(values)
    v = values.astype(np.int64) + 1  # >= 0
    bits = int(v.max(initial=0)).bit_length()
    slot = np.arange(n)
    pos = slot.copy()  # original index of the element in each slot
    counts = np.zeros(n, dtype=np.int64)  # aligned with the slots, moved along with the elements
    level = 0
    while (1 << level) < n:
        key = ((slot >> (level + 1)) << bits) | v  # (pair of runs, value)
        order = np.argsort(key, kind="stable")
        v, pos = v[order], pos[order]
        counts = counts[order] + np.maximum(order - slot, 0)  # the element now in slot k came from order[k]
        level += 1
    result = np.empty(n, dtype=np.int64)
    result[pos] = counts
    return result


def stack_distances(stream: np.ndarray) -> np.ndarray:
    """Distinct other rows touched since each access's previous access to the same row (-1: first access).

    distinct in (p, i) = (i - p - 1) - #{j in (p, i) whose next access is before i}, and those j are exactly the
    previous accesses p_b > p of the accesses b < i."""
    prev = previous_occurrence(stream)
    distance = np.arange(len(stream)) - prev - 1 - earlier_greater(prev)
    distance[prev < 0] = -1
    return distance


def lru_check(rng: np.random.Generator) -> None:
    """The stack distances against a direct LRU simulation on a small skewed stream."""
    stream = (rng.zipf(1.3, size=4000) % 500).astype(np.int64)
    distance = stack_distances(stream)
    for capacity in (1, 7, 50, 200):
        cache: OrderedDict[int, None] = OrderedDict()
        hits = []
        for row in stream.tolist():
            hits.append(row in cache)
            if row in cache:
                cache.move_to_end(row)
            else:
                cache[row] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
        predicted = (distance >= 0) & (distance < capacity)
        if not np.array_equal(predicted, np.array(hits)):
            raise SystemExit(f"self-check failed: stack distances disagree with an LRU of {capacity} rows")


# ----------------------------------------------------------------------------------------------------------------
# Main


def analyse(hash_ids: np.ndarray, table_rows: list[int], layer_ids: list[int], n_heads: int) -> dict:
    """Hit rates per layer / order / overall for every fraction in FRACTIONS."""
    T, L, C = hash_ids.shape
    order_of_column = 2 + np.arange(C) // n_heads
    hits = {f: {"all": 0} for f in FRACTIONS}
    per_order_total: dict[int, int] = {}
    per_layer, distinct = {}, 0
    for j in range(L):
        stream = hash_ids[:, j].reshape(-1)  # token-major, then column
        distance = stack_distances(stream)
        orders = np.tile(order_of_column, T)
        distinct += int((distance < 0).sum())
        layer_hits = {}
        for f in FRACTIONS:
            hit = (distance >= 0) & (distance < int(f * table_rows[j]))
            hits[f]["all"] += int(hit.sum())
            layer_hits[f] = float(hit.mean())
            for n in np.unique(order_of_column):
                hits[f][int(n)] = hits[f].get(int(n), 0) + int(hit[orders == n].sum())
        for n in np.unique(order_of_column):
            per_order_total[int(n)] = per_order_total.get(int(n), 0) + int((orders == n).sum())
        per_layer[layer_ids[j]] = {"hit_rate": layer_hits, "compulsory_miss_rate": float((distance < 0).mean())}
    total = T * L * C
    return {
        "lookups": total, "distinct_rows": distinct, "infinite_cache_hit_rate": 1 - distinct / total,
        "hit_rate": {str(f): hits[f]["all"] / total for f in FRACTIONS},
        "hit_rate_by_order": {str(n): {str(f): hits[f][n] / per_order_total[n] for f in FRACTIONS}
                              for n in sorted(per_order_total)},
        "by_layer": {str(lid): {"hit_rate": {str(f): v for f, v in d["hit_rate"].items()},
                                "compulsory_miss_rate": d["compulsory_miss_rate"]} for lid, d in per_layer.items()},
    }


def plot(results: dict, path: Path, table_rows: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (corpus, r) in zip(axes[0], results.items()):
        x = [100 * f for f in FRACTIONS]
        ax.plot(x, [100 * r["hit_rate"][str(f)] for f in FRACTIONS], "k-o", label="all orders", linewidth=2)
        for n, rates in r["hit_rate_by_order"].items():
            ax.plot(x, [100 * rates[str(f)] for f in FRACTIONS], "--o", markersize=3, label=f"{n}-grams")
        ax.axhline(100 * r["infinite_cache_hit_rate"], color="gray", linewidth=0.8, linestyle=":",
                   label="infinite cache")
        ax.set_xscale("log")
        ax.set_xlabel("LRU cache size, % of each layer's table rows")
        ax.set_ylabel("hit rate, %")
        ax.set_title(f"{corpus}: {r['tokens']:,} tokens, {r['lookups']:,} lookups")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        top = ax.secondary_xaxis("top", functions=(lambda p: p / 100 * table_rows * ROW_BYTES / 2**30,
                                                   lambda g: g * 2**30 / ROW_BYTES / table_rows * 100))
        top.set_xlabel("GiB per layer")
    fig.suptitle("Engram row cache (released hash: flash layers 1 and 14, DeepSeek tokenizer)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", nargs="+", default=["code", "english"], choices=["code", "english"])
    ap.add_argument("--max-tokens", type=int, default=1_000_000, help="per corpus")
    ap.add_argument("--out", type=Path, default=RESULTS / "engram_hit_rate.json")
    args = ap.parse_args()
    started = time.perf_counter()
    lru_check(np.random.default_rng(0))

    cfg = load_config("flash")
    tokenizer = load_tokenizer(DEEPSEEK)
    frontend = EngramFrontend.for_config(cfg, tokenizer)
    table_rows = [int(r) for r in frontend.layout.table_rows]
    results = {}
    for corpus in args.corpus:
        hash_ids, tokens, files = corpus_hash_ids(corpus, frontend, tokenizer, args.max_tokens)
        r = analyse(hash_ids, table_rows, list(cfg.engram_layer_ids), cfg.engram_n_heads)
        results[corpus] = {"tokens": tokens, "files": files, **r}
        print(f"{corpus}: {files} files, {tokens:,} tokens, {r['lookups']:,} lookups, {r['distinct_rows']:,} "
              f"distinct rows ({time.perf_counter() - started:.0f} s)", flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"layout": {"layer_ids": list(cfg.engram_layer_ids), "table_rows": table_rows,
                         "row_bytes": ROW_BYTES, "fractions": FRACTIONS}, "corpora": results,
              "seconds": time.perf_counter() - started}
    args.out.write_text(json.dumps(report, indent=1))
    png = args.out.with_suffix(".png")
    plot(results, png, min(table_rows))

    for corpus, r in results.items():
        working_set = r["distinct_rows"] / len(table_rows) / min(table_rows)
        print(f"\n### {corpus}: {r['tokens']:,} tokens from {r['files']} files; an infinite cache hits "
              f"{100 * r['infinite_cache_hit_rate']:.1f}% (the corpus touches {100 * working_set:.2f}% of each "
              f"table's rows: larger caches hold all of it)\n")
        print("| cache (% of rows) | rows per layer | GiB per layer | 2-grams | 3-grams | 4-grams | all |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for f in FRACTIONS:
            rows = int(f * min(table_rows))
            by_order = " | ".join(f"{100 * r['hit_rate_by_order'][n][str(f)]:.1f}%" for n in ("2", "3", "4"))
            print(f"| {100 * f:g}% | {rows:,} | {rows * ROW_BYTES / 2**30:.3f} | {by_order} | "
                  f"{100 * r['hit_rate'][str(f)]:.1f}% |")
    print(f"\nwrote {args.out} and {png}")


if __name__ == "__main__":
    main()
