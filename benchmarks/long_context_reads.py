"""What a decode step reads from the compressed cache: every entry's KV (as before) against the index keys and only
the picked entries' KV (CompressedView reads lazily), side by side in one run.

    python benchmarks/long_context_reads.py [--contexts 2048 8192 32768 1048576] [--threads 2] [--rounds 5]

Three measurements, the variants alternating round by round:
- store: one owner layer's paged cache in the engine's packed storage at the released widths (head_dim 512, index
  keys 128, ratio 4, index_topk 512, one row): `read` of every entry against `read_index` + `gather` of the top-k;
- top-k: one query's picks among the same entries (k 512): two sorts (`top_entries`, the rule as stated), the
  threshold selection of 2026-12-05 and the keyed selection every policy runs now (`top_entries_select`), the
  same picks;
- model: `small` (head_dim 64, index keys 64, index_topk 16) with the engine's packed paged cache, a decode step
  after a prompt of each length, the lazy view against one whose KV is read whole (as every step did before).

Random weights, fp32 numerics, eager. Writes benchmarks/results/long_context_reads.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from openflash import formats
from openflash.engine.block_pool import BlockPool, EntryLayout
from openflash.engine.cache import CacheFactory, PagedCompressedCache
from openflash.model.context import CompressedView
from openflash.model.indexer import top_entries, top_entries_select
from openflash.runtime.open import open_model

RESULTS = Path(__file__).parent / "results" / "long_context_reads.json"


def _alternate(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median milliseconds of each variant, the variants alternating round by round (after one warm-up each)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}


def store_reads(context: int, rounds: int) -> dict[str, float]:
    """One released-width owner layer (ratio 4): every entry's KV and index keys against the index keys and the
    top-k entries' KV."""
    ratio, topk, head_dim, index_dim = 4, 512, 512, 128
    pool = BlockPool(EntryLayout(head_dim, index_dim, "packed"), block_size=64)
    store = PagedCompressedCache.empty(pool, 1, ratio, head_dim)
    n = context // ratio
    g = torch.Generator().manual_seed(0)
    kv = formats.fp4_qdq_e4m3(torch.randn(n, head_dim, generator=g))  # what the model stores: QDQ'd values
    index_k = formats.fp4_qdq_ue8m0(torch.randn(n, index_dim, generator=g))
    store.write(torch.zeros(n, dtype=torch.long), torch.arange(n), kv, index_k)
    picks = torch.sort(torch.randperm(n, generator=g)[:min(topk, n)]).values.view(1, 1, -1)
    return _alternate({"whole_ms": lambda: store.read(n),
                       "picked_ms": lambda: (store.read_index(n), store.gather(picks))}, rounds)


def _threshold_select(scores: torch.Tensor, k: int, n_visible: torch.Tensor) -> torch.Tensor:
    """The selection before the keyed one (2026-12-05): the k-th score as a threshold, the entries above it, then
    the smallest ids among those equal to it, ranked by a second top-k. The same picks (tests/test_trainer.py
    checks the keyed one against the sorts)."""
    threshold = torch.topk(scores, k, dim=-1).values[..., -1:]
    above, tied = scores > threshold, scores == threshold
    chosen = above | (tied & (torch.cumsum(tied, dim=-1) <= k - above.sum(-1, keepdim=True)))
    T = scores.shape[-1]
    picks = T - torch.topk(torch.where(chosen, torch.arange(T, 0, -1), 0), k, dim=-1).values
    return torch.where(picks < n_visible.unsqueeze(-1), picks, torch.full_like(picks, -1))


def top_k(context: int, rounds: int) -> dict[str, float]:
    """One query's top-512 among context / 4 entries: the two sorts, the threshold selection and the keyed one
    every policy runs now."""
    n = context // 4
    scores = torch.randn(1, 1, n, generator=torch.Generator().manual_seed(1))
    visible = torch.tensor([[n]])
    k = min(512, n)
    want = top_entries(scores, k, visible)
    assert torch.equal(_threshold_select(scores, k, visible), want)
    assert torch.equal(top_entries_select(scores, k, visible), want)
    return _alternate({"sorts_ms": lambda: top_entries(scores, k, visible),
                       "threshold_ms": lambda: _threshold_select(scores, k, visible),
                       "selection_ms": lambda: top_entries_select(scores, k, visible)}, rounds)


def model_decode(contexts: list[int], rounds: int) -> dict[str, dict[str, float]]:
    """`small` with the engine's packed cache: a decode step after each prompt length, KV read lazily (now) or
    whole at the view's creation (before)."""
    rt = open_model("small", numerics="fp32")
    factory = CacheFactory.create(rt.model.cfg, "packed", 16)
    picked = CompressedView.picked
    out: dict[str, dict[str, float]] = {}
    g = torch.Generator().manual_seed(0)
    for context in contexts:
        cache = factory.empty(1)
        ids = torch.randint(3, rt.model.cfg.vocab_size, (1, context), generator=g)
        for start in range(0, context, 512):
            logits = rt.step(ids[:, start:start + 512], cache)
        token = logits.argmax(-1)

        def step() -> None:  # on a copy of the cache: every round decodes at the same position
            snapshot = cache.select([0])
            rt.decode(token, snapshot)
            snapshot.release()

        def whole(view: CompressedView, picks: torch.Tensor) -> torch.Tensor:
            view.kv  # noqa: B018  (read whole, as every step did before)
            return picked(view, picks)

        def before() -> None:
            CompressedView.picked = whole
            try:
                step()
            finally:
                CompressedView.picked = picked

        out[str(context)] = _alternate({"whole_ms": before, "picked_ms": step}, rounds)
        cache.release()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--model-contexts", type=int, default=32768, help="the longest prompt `small` prefills")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "rounds": args.rounds,
               "store_released_widths": {str(c): store_reads(c, args.rounds) for c in args.contexts},
               "top_k_released": {str(c): top_k(c, args.rounds) for c in args.contexts},
               "small_decode_step": model_decode([c for c in args.contexts if c <= args.model_contexts], args.rounds)}
    print(json.dumps(results, indent=1))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
