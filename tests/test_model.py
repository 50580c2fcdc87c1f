"""The model's two ways to run agree: full forward, chunked prefill, decode, batched rows at different positions;
CED bounded replay; training forward (loss falls, the indexer learns only from its KL term)."""

from __future__ import annotations

import pytest
import torch

from openflash.config import load_config
from openflash.model.cache import ModelCache
from openflash.model.numerics import FP32, PLAIN, TRAIN
from openflash.model.transformer import Transformer
from openflash.runtime.runtime import Runtime
from openflash.topology import LayerMode

TOL = 2e-5


@pytest.fixture(scope="module")
def tiny() -> Runtime:
    torch.manual_seed(0)
    return Runtime.of(Transformer(load_config("tiny")).eval().set_numerics(PLAIN))


def _ids(cfg, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg.vocab_size, (batch, length), generator=g)


def test_tiny_exercises_every_mode(tiny):
    assert {t.mode for t in tiny.cfg.topology.layers} == set(LayerMode)


@pytest.mark.parametrize("chunks", [(70,), (17, 53), (1, 2, 3, 64), (16, 16, 16, 22)])
def test_chunked_prefill_and_decode_match_full_forward(tiny, chunks):
    ids = _ids(tiny.cfg, 2, 90)
    with torch.no_grad():
        full = tiny.forward(ids).logits
    cache = tiny.new_cache(2)
    pos = 0
    for n in chunks:
        logits = tiny.step(ids[:, pos: pos + n], cache)
        pos += n
        assert (logits - full[:, pos - 1]).abs().max() < TOL
    for t in range(pos, 90):
        logits = tiny.decode(ids[:, t], cache)
        assert (logits - full[:, t]).abs().max() < TOL, t
    assert cache.pos.tolist() == [90, 90]


def test_batched_decode_rows_at_different_positions(tiny):
    a, b = _ids(tiny.cfg, 1, 60, seed=2), _ids(tiny.cfg, 1, 45, seed=3)
    with torch.no_grad():
        full_a, full_b = tiny.forward(a).logits, tiny.forward(b).logits
    ca, cb = tiny.new_cache(1), tiny.new_cache(1)
    tiny.step(a[:, :40], ca)
    tiny.step(b[:, :21], cb)
    batch = ModelCache.concat([ca, cb])
    for i in range(20):
        logits = tiny.decode(torch.stack([a[0, 40 + i], b[0, 21 + i]]), batch)
        assert (logits[0] - full_a[0, 40 + i]).abs().max() < TOL
        assert (logits[1] - full_b[0, 21 + i]).abs().max() < TOL
    # regrouping keeps each row's state
    only_b = batch.select([1])
    logits = tiny.decode(b[0, 41:42], only_b)
    assert (logits[0] - full_b[0, 41]).abs().max() < TOL


def test_bounded_replay_equals_exact_within_window(tiny):
    ids = _ids(tiny.cfg, 2, tiny.cfg.sliding_window)
    exact, bounded = tiny.new_cache(2), tiny.new_cache(2)
    a = tiny.step(ids, exact, mode="exact")
    b = tiny.step(ids, bounded, mode="bounded")
    assert (a - b).abs().max() < TOL


def test_bounded_replay_keeps_encoder_state_exact(tiny):
    """Longer prompts: the encoder half and the decoder's KV owner see every token in both modes; only the
    decoder layers' window rings differ (they hold just the replayed tail)."""
    cfg = tiny.cfg
    ids = _ids(cfg, 1, 3 * cfg.sliding_window + 5)
    exact, bounded = tiny.new_cache(1), tiny.new_cache(1)
    tiny.step(ids, exact, mode="exact")
    tiny.step(ids[:, :20], bounded, mode="bounded", last_chunk=False)
    tiny.step(ids[:, 20:], bounded, mode="bounded")
    split = cfg.topology.decoder_start
    for owner, state in exact.compressed.items():  # incl. the decoder's owner (its compressor saw every token)
        n = int(state.length.max())
        assert torch.allclose(state.read(n)[0], bounded.compressed[owner].read(n)[0], atol=TOL)
    for i in range(split):
        assert torch.equal(exact.window[i].pos, bounded.window[i].pos)
        assert torch.allclose(exact.window[i].kv, bounded.window[i].kv, atol=TOL)
    for i in range(split, cfg.num_hidden_layers):
        assert torch.equal(exact.window[i].pos, bounded.window[i].pos)  # the tail covers the ring
    assert torch.equal(exact.engram.history, bounded.engram.history)
    # decode continues from both; tiny random weights amplify the approximation, so only check it runs sanely
    la, lb = tiny.decode(ids[:, -1], exact), tiny.decode(ids[:, -1], bounded)
    assert torch.isfinite(la).all() and torch.isfinite(lb).all()


def test_quantized_numerics_consistent_for_one_row(tiny):
    """With the FP8/FP4 quantization points on, incremental decode still reproduces the full forward."""
    tiny.model.set_numerics(FP32)
    try:
        ids = _ids(tiny.cfg, 1, 40, seed=5)
        with torch.no_grad():
            full = tiny.forward(ids).logits
        cache = tiny.new_cache(1)
        tiny.step(ids[:, :25], cache)
        for t in range(25, 40):
            assert (tiny.decode(ids[:, t], cache) - full[:, t]).abs().max() < 1e-2  # rare QDQ rounding flips
    finally:
        tiny.model.set_numerics(PLAIN)


def test_training_loss_falls_and_indexer_learns_only_from_kl():
    torch.manual_seed(0)
    rt = Runtime.of(Transformer(load_config("tiny")).train().set_numerics(TRAIN))
    model = rt.model
    ids = _ids(model.cfg, 4, 48, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        out = rt.forward(ids[:, :-1], ids[:, 1:])
        losses.append(out.loss.item())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert losses[-1] < losses[0] - 1.0, losses
    # The LM loss sends no gradient into the indexer; its KL loss sends gradient only into the indexer.
    model.zero_grad()
    out = rt.forward(ids[:, :-1], ids[:, 1:])
    out.loss.backward()
    indexer = {n: p for n, p in model.named_parameters() if ".attn.indexer." in n}
    assert indexer and all(p.grad is None or p.grad.abs().sum() == 0 for p in indexer.values())
    model.zero_grad()
    out = rt.forward(ids[:, :-1], ids[:, 1:], dense_indexer=True)
    assert out.indexer_loss is not None and out.indexer_loss > 0
    out.indexer_loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all(".attn.indexer." in n for n in grads)


def test_released_shape_builds_on_meta():
    with torch.device("meta"):
        model = Transformer(load_config("flash"))
    assert len(model.layers) == 40
    assert model.layers[1].engram.embed.num_rows == 384_006_168
    assert model.layers[20].attn.indexer.wk.out_features == 128


@pytest.mark.parametrize("mode, spare", [("exact", 0), ("bounded", 0), ("exact", 3)])
def test_right_padded_rows_equal_each_row_on_its_own(tiny, mode, spare):
    """Prompts of different lengths in one call (a packed prefill): rows right-padded, `lengths` saying what is
    real. Each row's logits and everything its cache keeps equal running it alone; decoding (and rolling back)
    continues alike. Chunks shorter and longer than the window, groups left open, rows at different positions."""
    cfg = tiny.cfg
    chunks = [(16, 3, 40), (5, 21, 9), (11, 7, 2)]  # per row: its chunk lengths, in order
    prompts = [_ids(cfg, 1, sum(c), seed=10 + b)[0] for b, c in enumerate(chunks)]
    batch, alone = tiny.new_cache(3, spare=spare), [tiny.new_cache(1, spare=spare) for _ in chunks]
    done = [0, 0, 0]
    for j in range(3):
        sizes = [c[j] for c in chunks]
        width = max(sizes)
        ids = torch.stack([torch.cat((p[d:d + n], p.new_zeros(width - n))) for p, d, n in zip(prompts, done, sizes)])
        lengths = torch.tensor(sizes)
        last = j == 2
        packed = tiny.step(ids, batch, mode=mode, last_chunk=last, lengths=lengths)
        for b, (p, n) in enumerate(zip(prompts, sizes)):
            own = tiny.step(p[done[b]:done[b] + n].unsqueeze(0), alone[b], mode=mode, last_chunk=last)
            if packed is not None or own is not None:
                assert (packed[b] - own[0]).abs().max() < TOL, (j, b)
            done[b] += n
    for b, cache in enumerate(alone):
        row = batch.select([b])
        assert torch.equal(row.pos, cache.pos) and torch.equal(row.engram.history, cache.engram.history)
        for i, state in cache.compressed.items():
            assert torch.equal(row.compressed[i].length, state.length)
            n = int(state.length.max())
            assert torch.allclose(row.compressed[i].read(n)[0], state.read(n)[0], atol=TOL)
            assert torch.allclose(row.compressed[i].partial_kv, state.partial_kv, atol=TOL)
        for mine, theirs in zip(row.window, cache.window):
            assert torch.equal(mine.pos, theirs.pos)
            assert torch.allclose(mine.kv, theirs.kv, atol=TOL)
    nxt = torch.stack([_ids(cfg, 1, 4, seed=20 + b)[0] for b in range(3)])  # [3, 4] decode tokens
    for t in range(4):
        logits = tiny.decode(nxt[:, t], batch)
        for b, cache in enumerate(alone):
            assert (logits[b] - tiny.decode(nxt[b:b + 1, t], cache)[0]).abs().max() < TOL, (t, b)
    if spare:
        batch.rollback(batch.pos - 2)
        for b, cache in enumerate(alone):
            cache.rollback(cache.pos - 2)
        logits = tiny.decode(nxt[:, 2], batch)
        for b, cache in enumerate(alone):
            assert (logits[b] - tiny.decode(nxt[b:b + 1, 2], cache)[0]).abs().max() < TOL, b


def test_right_padded_rows_are_checked(tiny):
    cache = tiny.new_cache(2)
    ids = _ids(tiny.cfg, 2, 5)
    for bad in ([5], [0, 5], [6, 2]):
        with pytest.raises(ValueError, match=r"lengths must hold one value in \[1, 5\] per row"):
            tiny.step(ids, cache, lengths=torch.tensor(bad))


class _Recorder:
    """A probe that keeps what the model records (the indexer's picks, pool and scores)."""

    def __init__(self) -> None:
        self.seen: dict[str, torch.Tensor] = {}

    def record(self, name: str, value: torch.Tensor) -> None:
        self.seen[name] = value.detach().clone()

    def force(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return value


def test_the_indexer_in_row_blocks_picks_what_it_picks_whole(tiny, monkeypatch):
    """A long sequence's indexer scores, pools and selects query rows in blocks (ROW_BLOCK_ELEMENTS). Rows are
    independent, so from the same scores the blocks pick exactly the entries one block picks, and the scores
    themselves, computed in blocks or whole, are within the fp32 bound of the fp64 score: each is
    sum_h w_h ReLU(q_h . k), so |error| <= gamma_(D+H+1) * sum_h |w_h| sum_d |q_hd k_d| in any summation order."""
    from error_bounds import gamma

    from openflash.model import indexer as ix

    ids = _ids(tiny.cfg, 2, 48)
    whole, blocked = _Recorder(), _Recorder()
    with torch.no_grad():
        tiny.forward(ids, probe=whole)
        monkeypatch.setattr(ix, "ROW_BLOCK_ELEMENTS", 96)  # a few rows a block at tiny's widths
        assert len(ix._row_blocks(48, 2 * 4 * 48)) > 1
        tiny.forward(ids, probe=blocked)
    names = [n for n in whole.seen if n.startswith("indexer")]
    assert {n.split(".")[1] for n in names} == {"scores", "topk", "candidates"}
    for name in names:
        if not name.endswith(".scores"):
            assert torch.equal(whole.seen[name], blocked.seen[name]), name
    # the selection and the pool from given scores, blocked against whole (exact)
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 48, 40, generator=gen)
    n_visible = torch.randint(0, 41, (2, 48), generator=gen)
    allowed = torch.rand(2, 48, 40, generator=gen) < 0.5
    want = ix.top_entries(scores.masked_fill(~allowed, float("-inf")), 8, n_visible)
    assert torch.equal(ix.IndexKernels().top_entries(scores, 8, n_visible, allowed), want)
    # the scores: whole and blocked, each within the bound of the fp64 value
    q, k, w = torch.randn(2, 48, 4, 32, generator=gen), torch.randn(2, 40, 32, generator=gen), \
        torch.randn(2, 48, 4, generator=gen)
    exact = ix.index_scores(q.double(), k.double(), w.double())
    bound = gamma(32 + 4 + 1) * torch.einsum("bsh,bshd,btd->bst", w.double().abs(), q.double().abs(),
                                             k.double().abs())
    monkeypatch.setattr(ix, "ROW_BLOCK_ELEMENTS", 1 << 22)
    one = ix.IndexKernels().row_scores(q, k, w)
    monkeypatch.setattr(ix, "ROW_BLOCK_ELEMENTS", 4 * 40 * 2 * 5)  # 5 rows a block
    for got in (one, ix.IndexKernels().row_scores(q, k, w), ix.TrainIndexKernels().row_scores(q, k, w)):
        assert ((got.double() - exact).abs() <= bound).all()


def test_logits_at_some_positions_are_those_positions_logits(tiny):
    """An RL update asks for its completions' logits only (a long prompt's over every position would be S x V):
    the head is per position, so they equal the whole forward's logits there, up to the order of the head's fp32
    sums (a product of another shape): |error| <= 2 gamma_D |x| . |W| per logit, x the normed hidden."""
    from error_bounds import gamma

    ids = _ids(tiny.cfg, 2, 40)
    at = torch.tensor([[3, 17, 39], [0, 0, 25]])
    seen = _Recorder()
    with torch.no_grad():
        full = tiny.forward(ids, probe=seen).logits
        some = tiny.forward(ids, logits_at=at).logits
    assert some.shape == (2, 3, tiny.cfg.vocab_size)
    pick = at.unsqueeze(-1).expand(-1, -1, full.shape[-1])
    x = seen.seen["final_norm"].double()
    bound = 2 * gamma(x.shape[-1]) * (x.abs() @ tiny.model.head.weight.double().abs().T)
    assert ((some - full.gather(1, pick)).abs() <= bound.gather(1, pick)).all()
    with pytest.raises(ValueError, match="logits_at"):
        tiny.forward(ids, ids, logits_at=at)
