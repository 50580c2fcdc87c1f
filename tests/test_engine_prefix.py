"""Prefix caching: equal outputs, fewer prompt tokens computed, no aliasing, LRU eviction, persistence, replay."""

from __future__ import annotations

import pytest
import torch

from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.sampling import SamplingParams
from openflash.errors import OpenflashError
from openflash.model.numerics import NUMERICS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_runtime):
    return tiny_runtime


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_one(engine: LLMEngine, prompt: list[int], max_tokens: int = 4):
    seq = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), ignore_eos=True)
    while engine.has_work():
        engine.step()
    return seq


def test_snapshot_hits_equal_outputs_and_cut_ttft(tiny):
    rt = tiny
    system = ids(192, seed=1)
    prompts = [system + ids(6 + i, seed=10 + i) for i in range(4)]
    cold = LLMEngine(rt, EngineConfig(prefill_chunk=64, prefix_cache=False))
    warm = LLMEngine(rt, EngineConfig(prefill_chunk=64, prefix_cache=True))
    want = [run_one(cold, p).output_ids for p in prompts]
    got = [run_one(warm, p) for p in prompts]
    assert [s.output_ids for s in got] == want
    assert [s.num_cached for s in got] == [0, 192, 192, 192]
    pc = warm.prefix_cache.stats
    assert (pc.lookups, pc.hits) == (4, 3) and pc.hit_rate == 0.75
    assert warm.metrics.cached_prompt_tokens == 3 * 192
    assert warm.metrics.prompt_tokens == sum(len(p) for p in prompts) - 3 * 192
    ttft = [s.first_token_time - s.arrival_time for s in got]
    assert sorted(ttft[1:])[1] < ttft[0], ttft  # one prefill call instead of four
    # With nothing running, the only blocks in use are the cache's.
    assert warm.factory.pool.blocks_in_use == len(warm.prefix_cache.block_refs)


def test_cached_state_is_copied_not_aliased(tiny):
    rt = tiny
    # 5-entry pool blocks: the cached prefix ends inside a block, which the hits then append to.
    engine = LLMEngine(rt, EngineConfig(prefill_chunk=16, prefix_cache=True, kv_block_size=5))
    base = ids(40, seed=2)
    first = run_one(engine, base + [5, 6], max_tokens=6)
    pool = engine.factory.pool
    held = sorted(engine.prefix_cache.block_refs)
    before = {name: t[held].clone() for name, t in pool.planes.items()}
    # Hits that append to the shared partial block and decode past it, several at once.
    for s in engine.generate([base + [7], base + [8, 9], base + [5, 6]], SamplingParams(max_tokens=6),
                             ignore_eos=True):
        assert s.num_cached == 32
    after = {name: t[held] for name, t in pool.planes.items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
    again = run_one(engine, base + [5, 6], max_tokens=6)
    assert again.output_ids == first.output_ids and again.num_cached == 32


def test_lru_eviction_bounds_bytes(tiny):
    rt = tiny
    engine = LLMEngine(rt, EngineConfig(prefill_chunk=16, prefix_cache=True, prefix_cache_bytes=250_000))
    for i in range(4):
        run_one(engine, ids(40, seed=100 + i), max_tokens=1)
    pc = engine.prefix_cache
    assert pc.stats.evictions > 0 and 0 < pc.nbytes <= 250_000
    assert engine.factory.pool.blocks_in_use == len(pc.block_refs)
    # The most recent prompt's prefix survived, the oldest did not.
    assert pc.lookup(ids(40, seed=103)) is not None and pc.lookup(ids(40, seed=100)) is None
    pc.clear()
    assert engine.factory.pool.blocks_in_use == 0


@pytest.mark.parametrize("kv_storage", ["fp32", "packed"])
def test_persisted_cache_survives_a_restart(tiny, tmp_path, kv_storage):
    """Each window ring saved by its planes (WindowStore.planes) and rebuilt by its storage's class (packed rings
    hold the fp32 policy's FP8 cache format, so that run uses it)."""
    rt = tiny
    numerics = rt.model.numerics
    rt.model.set_numerics(NUMERICS["fp32"] if kv_storage == "packed" else numerics)
    try:
        prompt = ids(70, seed=3)
        config = EngineConfig(prefill_chunk=32, prefix_cache=True, prefix_cache_dir=str(tmp_path / "pc"),
                              kv_storage=kv_storage)
        first = LLMEngine(rt, config)
        a = run_one(first, prompt)
        first.shutdown(drain_timeout=0)
        assert (tmp_path / "pc" / "prefix_cache.json").exists()
        second = LLMEngine(rt, config)
        assert len(second.prefix_cache.entries) == len(first.prefix_cache.entries) == 2
        saved = [e for e in second.prefix_cache.entries.values() if e.window is not None]
        assert saved and all(w.storage == kv_storage for e in saved for w in e.window)
        b = run_one(second, prompt)
        assert b.num_cached == 64 and b.output_ids == a.output_ids
        other = EngineConfig(prefill_chunk=16, prefix_cache=True, prefix_cache_dir=str(tmp_path / "pc"),
                             kv_storage=kv_storage)
        with pytest.raises(OpenflashError, match="fingerprint"):
            LLMEngine(rt, other)
    finally:
        rt.model.set_numerics(numerics)


@pytest.mark.parametrize("prefill_mode", ["bounded", "exact"])
def test_replay_restore(tiny, prefill_mode):
    rt = tiny
    window = rt.cfg.sliding_window  # 16: a prefix this short is replayed whole, so exactly
    config = dict(prefill_chunk=32, prefill_mode=prefill_mode, prefix_restore="replay", prefix_block_tokens=window)
    cold = LLMEngine(rt, EngineConfig(prefill_chunk=32, prefill_mode=prefill_mode, prefix_cache=False))
    warm = LLMEngine(rt, EngineConfig(prefix_cache=True, **config))
    short = ids(window, seed=4)
    run_one(warm, short + [9, 9, 9])
    s = run_one(warm, short + [11, 12])
    assert s.num_cached == window and s.output_ids == run_one(cold, short + [11, 12]).output_ids
    # Longer prefixes: entries at every 16-token boundary (global KV only), restored by replaying the last 16.
    long = ids(80, seed=5)
    run_one(warm, long + [3])
    hit = run_one(warm, long + [4, 5], max_tokens=3)
    assert hit.num_cached == 80 and len(hit.output_ids) == 3
    entry = warm.prefix_cache.lookup(long + [4])
    assert entry.window is None and entry.replay is None  # nothing bounded is stored
