"""Cache rollback (what speculative decoding needs): decode k tokens, roll back j, decode on = exactly as if the
j tokens had never been decoded, in every layer mode (tiny: WINDOW, FULL ratio 2 and 1, REUSE, REINDEX), with the
Engram hash history, for the dense stores and the engine's paged (fp32 and packed) stores, rows rolled back by
different amounts."""

from __future__ import annotations

import pytest
import torch

from openflash.config import load_config
from openflash.engine.cache import CacheFactory
from openflash.model.cache import ModelCache
from openflash.model.numerics import FP32, PLAIN
from openflash.model.transformer import Transformer
from openflash.runtime.runtime import Runtime
from openflash.topology import LayerMode

SPARE = 6
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(load_config("tiny")).eval()


def _tokens(cfg, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _run(rt, cache, ids: torch.Tensor) -> torch.Tensor:
    return rt.step(ids.view(cache.batch_size, -1), cache)


@pytest.mark.parametrize("store", ["dense", "paged", "packed"])
def test_rollback_is_as_if_never_decoded(model, store):
    assert {t.mode for t in model.cfg.topology.layers} == set(LayerMode)
    model.set_numerics(PLAIN if store != "packed" else FP32)  # packed storage holds the trained (QDQ) formats
    cfg, rt = model.cfg, Runtime.of(model)
    factory = None if store == "dense" else CacheFactory.create(cfg, "fp32" if store == "paged" else "packed",
                                                                block_size=4)

    def empty(batch: int) -> ModelCache:
        return ModelCache.empty(cfg, batch, spare=SPARE) if factory is None else factory.empty(batch, spare=SPARE)

    prompts = [_tokens(cfg, 21, 1), _tokens(cfg, 26, 2)]  # past the 16-token window; odd and even lengths
    drafted = [_tokens(cfg, SPARE, 3), _tokens(cfg, SPARE, 4)]  # decoded, then partly rolled back
    keep = [4, 1]  # tokens of `drafted` each row keeps (rolls back 2 and 5)
    after = torch.stack([_tokens(cfg, 5, 5), _tokens(cfg, 5, 6)])  # decoded after the rollback, batched

    def prefilled(row: int, extra: torch.Tensor) -> ModelCache:
        cache = empty(1)
        _run(rt, cache, prompts[row])
        for t in extra:
            _run(rt, cache, t)
        return cache

    def joined(parts: list[ModelCache]) -> ModelCache:  # as the engine regroups: the parts' blocks go back
        batch = ModelCache.concat(parts)
        for part in parts:
            part.release()
        return batch

    # Rolled back: each row decodes all of `drafted`, the batch rolls back to different positions per row.
    batch = joined([prefilled(0, drafted[0]), prefilled(1, drafted[1])])
    target = torch.tensor([len(prompts[0]) + keep[0], len(prompts[1]) + keep[1]])
    batch.rollback(target)
    assert batch.pos.tolist() == target.tolist()
    # Never decoded: each row decodes only what it keeps.
    fresh = joined([prefilled(0, drafted[0][:keep[0]]), prefilled(1, drafted[1][:keep[1]])])
    for t in range(after.shape[1]):
        got, want = _run(rt, batch, after[:, t]), _run(rt, fresh, after[:, t])
        assert torch.equal(got, want), (store, t, (got - want).abs().max())
    assert torch.equal(batch.engram.history[:, -3:], fresh.engram.history[:, -3:])
    for c in (batch, fresh):
        c.release()
    if factory is not None:
        assert factory.pool.blocks_in_use == 0
    model.set_numerics(PLAIN)


def test_rollback_is_bounded_by_the_spare_room(model):
    rt = Runtime.of(model)
    cache = ModelCache.empty(model.cfg, 1, spare=2)
    _run(rt, cache, _tokens(model.cfg, 10, 7))
    with pytest.raises(ValueError, match="only the last 2 tokens can be undone"):
        cache.rollback(7)
    with pytest.raises(ValueError, match="cannot roll back from positions"):
        cache.rollback(11)
    cache.rollback(8)
    assert cache.pos.tolist() == [8]
    plain = ModelCache.empty(model.cfg, 1)
    _run(rt, plain, _tokens(model.cfg, 10, 7))
    with pytest.raises(ValueError, match="only the last 0 tokens"):
        plain.rollback(9)


@pytest.mark.parametrize("store", ["dense", "paged", "packed"])
def test_a_restarted_row_runs_as_a_fresh_sequence_in_place(model, store):
    """`ModelCache.restart` (the engine's idle rows): in place, every tensor the cache holds stays the same object
    (a recorded CUDA graph still finds it), the row's blocks go back to the pool, and the row then runs a new prompt
    as a fresh one-row cache does, while the other row goes on as if nothing had happened."""
    from openflash.runtime.cuda_graph import bindings

    model.set_numerics(PLAIN if store != "packed" else FP32)
    cfg, rt = model.cfg, Runtime.of(model)
    factory = None if store == "dense" else CacheFactory.create(cfg, "fp32" if store == "paged" else "packed",
                                                                block_size=4)

    def empty(batch: int) -> ModelCache:
        return ModelCache.empty(cfg, batch) if factory is None else factory.empty(batch)

    first, other, new, more = (_tokens(cfg, 23, 8), _tokens(cfg, 23, 9), _tokens(cfg, 11, 10), _tokens(cfg, 11, 11))
    batch, untouched = empty(2), empty(2)
    for cache in (batch, untouched):
        _run(rt, cache, torch.stack([first, other]))
    held = factory.pool.blocks_in_use if factory is not None else 0
    before = [id(b.value) for b in bindings(batch)]
    batch.restart([0])
    assert [id(b.value) for b in bindings(batch)] == before  # the same objects
    assert batch.pos.tolist() == [0, 23]
    if factory is not None:
        assert factory.pool.blocks_in_use < held
    got = _run(rt, batch, torch.stack([new, more]))
    alone = _run(rt, empty(1), new)
    assert torch.allclose(got[0], alone[0], atol=1e-5, rtol=1e-5), (got[0] - alone[0]).abs().max()
    going_on = _run(rt, untouched, torch.stack([first[:11], more]))
    assert torch.allclose(got[1], going_on[1], atol=1e-5, rtol=1e-5), (got[1] - going_on[1]).abs().max()
    model.set_numerics(PLAIN)
