"""The serving engine: paged cache, packed formats, scheduling, batched decode vs sequential, stops, aborts.

The tiny preset with random weights; equality tests run the "plain" numerics (no quantization), because batched and
single-row matmuls differ in the last bits on CPU and an FP8 rounding flip would turn that into a different token
(see the engine report); the packed-format test runs the default fp32 numerics, where the cache QDQs happen.
"""

from __future__ import annotations

import time

import pytest
import torch

from openflash import formats, kernels
from openflash.config import load_config
from openflash.engine.block_pool import BlockPool, EntryLayout, encode_kv_exact
from openflash.engine.cache import CacheFactory
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.generate import generate
from openflash.engine.prompt import EMPTY, INVALID_IMAGES, INVALID_TOKEN, MAX_TOKENS, TOO_LONG, PromptError
from openflash.engine.request import ABORT, LENGTH, STOP, EngineStoppedError, QueueFullError, Sequence, SequenceStatus
from openflash.engine.sampling import SamplerState, SamplingParams
from openflash.engine.scheduler import Scheduler, SchedulerConfig
from openflash.errors import OpenflashError
from openflash.model.cache import ModelCache
from openflash.model.numerics import NUMERICS
from openflash.runtime.open import open_model

from error_bounds import gamma

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_runtime):
    return tiny_runtime


@pytest.fixture
def plain(tiny):
    tiny.model.set_numerics(NUMERICS["plain"])
    return tiny


@pytest.fixture
def fp32(tiny):
    """fp32 numerics (the cache QDQs the packed storage holds), plain again afterwards."""
    tiny.model.set_numerics(NUMERICS["fp32"])
    yield tiny
    tiny.model.set_numerics(NUMERICS["plain"])


def prompts(n: int, lo: int = 5, hi: int = 70, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 1000, (k,), generator=g).tolist() for k in lengths]


def sequential(rt, ps, params):
    return [generate(rt, p, params).token_ids for p in ps]


# ---- cache -------------------------------------------------------------------------------------------------------


def test_paged_cache_matches_dense_and_frees_blocks(plain):
    rt = plain
    factory = CacheFactory.create(rt.cfg, "fp32", block_size=4)
    ps = prompts(3, 20, 40, seed=1)
    dense, paged = [], []
    for p in ps:
        d, q = rt.new_cache(1), factory.empty(1)
        for i in range(0, len(p), 7):  # chunked prefill across compressor groups and blocks
            chunk = torch.tensor([p[i:i + 7]])
            last = i + 7 >= len(p)
            ld = rt.step(chunk, d, mode="bounded", last_chunk=last)
            lq = rt.step(chunk, q, mode="bounded", last_chunk=last)
        assert torch.equal(ld, lq)
        dense.append(d)
        paged.append(q)
    d_batch, q_batch = ModelCache.concat(dense), ModelCache.concat(paged)
    for q in paged:
        q.release()
    tokens = torch.tensor([7, 8, 9])
    for _ in range(6):
        ld, lq = rt.decode(tokens, d_batch), rt.decode(tokens, q_batch)
        assert torch.equal(ld, lq)
        tokens = ld.argmax(-1)
    # Regroup (drop the middle row) and keep decoding: still identical.
    d_two, q_two = d_batch.select([0, 2]), q_batch.select([0, 2])
    q_batch.release()
    ld, lq = rt.decode(tokens[[0, 2]], d_two), rt.decode(tokens[[0, 2]], q_two)
    assert torch.equal(ld, lq)
    assert factory.pool.blocks_in_use > 0
    q_two.release()
    assert factory.pool.blocks_in_use == 0


@pytest.mark.parametrize("storage", ["fp32", "packed"])
def test_a_decode_step_reads_the_index_keys_and_only_the_picked_entries(fp32, storage, monkeypatch):
    """A decode step reads a store's index keys and gathers the picked entries' KV, never every entry's KV (the
    lazy CompressedView); `gather` gives the rows of `read` it names, and `read_index` read's index keys."""
    rt = fp32
    factory = CacheFactory.create(rt.cfg, storage, block_size=4)
    cache = factory.empty(2)
    rt.step(torch.tensor(prompts(2, 45, 46, seed=9)), cache)
    for store in cache.compressed.values():
        n = int(store.length.max())
        kv, index_k = store.read(n)
        picks = torch.tensor([[[0, n - 1, 3]], [[2, 1, n - 2]]])
        assert torch.equal(store.gather(picks), kv[torch.arange(2).view(2, 1, 1), picks])
        assert torch.equal(store.read_index(n), index_k)
    want = rt.decode(torch.tensor([5, 6]), cache.select([0, 1]))

    def whole(self, n):
        raise AssertionError("a decode step read every entry's KV")

    monkeypatch.setattr(type(next(iter(cache.compressed.values()))), "read", whole)
    assert torch.equal(rt.decode(torch.tensor([5, 6]), cache), want)


@pytest.mark.skipif(not kernels.triton_products.available(), reason="Triton is not installed")
@pytest.mark.parametrize("storage", ["fp32", "packed"])
def test_the_pool_s_keys_and_entries_are_read_in_place_where_kernels_read_them(fp32, storage, monkeypatch):
    """Where `kernels.cache_kernel` names them (CUDA; forced here, Triton's interpreter on the CPU), a prefill chunk
    and a decode step score the index keys in the pool (kernels/triton_index.py) and attend the picked entries there
    and the window rings (kernels/triton_attention.py), reading none out (the packed rings' `kv` decodes them): the
    same logits as the keys, entries and rings read out."""
    rt = fp32
    factory = CacheFactory.create(rt.cfg, storage, block_size=4)
    cache = factory.empty(2)
    rt.step(torch.tensor(prompts(2, 45, 46, seed=10)), cache)
    chunk = torch.tensor(prompts(2, 5, 6, seed=11))
    copy = cache.select([0, 1])
    want_chunk = rt.step(chunk, copy)
    want = rt.decode(torch.tensor([5, 6]), copy)
    monkeypatch.setattr(kernels, "cache_kernel", lambda device: "triton")

    def read_out(self, *args):
        raise AssertionError("the index keys or the picked entries were read out")

    for name in ("read_index", "read", "gather"):
        monkeypatch.setattr(type(next(iter(cache.compressed.values()))), name, read_out)
    if storage == "packed":
        monkeypatch.setattr(type(cache.window[0]), "kv", property(read_out))
    # The two paths differ in the order of the attention's and the indexer's fp32 reductions alone: each reordered
    # reduction of n terms moves by at most gamma_n of its terms' absolute sum (tests/error_bounds.py), here n is at
    # most head_dim (the scores) or a window plus picks (the weighted sums), and the normalised residual stream
    # carries one such change per layer to the logits: a first-order tolerance of layers x 2 gamma_n x max |logit|.
    cfg = rt.cfg
    n = max(cfg.head_dim, cfg.index_head_dim, cfg.sliding_window + cfg.index_topk * max(cfg.compress_ratios))
    for got, expected in ((rt.step(chunk, cache), want_chunk), (rt.decode(torch.tensor([5, 6]), cache), want)):
        tolerance = cfg.num_hidden_layers * 2 * gamma(n) * float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)


def test_block_pool_copy_on_write_and_growth():
    cfg = load_config("tiny")
    pool = BlockPool(EntryLayout(cfg.head_dim, cfg.index_head_dim, "fp32"), block_size=2, initial_blocks=2)
    factory = CacheFactory(cfg, pool)
    a = factory.empty(1)
    c = a.compressed[4]  # ratio-1 owner layer of the tiny preset
    kv, ik = torch.randn(5, cfg.head_dim), torch.randn(5, cfg.index_head_dim)
    c.write(torch.zeros(5, dtype=torch.long), torch.arange(5), kv, ik)  # grows the pool past 2 blocks
    assert pool.num_blocks > 2 and c.blocks_per_row() == [3]
    b = a.select([0])  # shares a's blocks
    shared = int(b.compressed[4].table[0, 2])
    b.compressed[4].write(torch.tensor([0]), torch.tensor([5]), torch.ones(1, cfg.head_dim),
                          torch.ones(1, cfg.index_head_dim))
    assert int(b.compressed[4].table[0, 2]) != shared  # b copied the block before appending
    kv_a, _ = c.read(6)
    assert torch.equal(kv_a[0, :5], kv) and torch.equal(kv_a[0, 5], torch.zeros(cfg.head_dim))
    kv_b, _ = b.compressed[4].read(6)
    assert torch.equal(kv_b[0, :5], kv) and torch.equal(kv_b[0, 5], torch.ones(cfg.head_dim))
    a.release()
    b.release()
    assert pool.blocks_in_use == 0


def test_encode_kv_exact_round_trips_qdq_values():
    torch.manual_seed(0)
    # Magnitudes around the E4M3 subnormal scales, where the plain encoder can pick a smaller scale.
    x = torch.randn(3000, 64) * torch.logspace(-3, 0, 3000).unsqueeze(1)
    v = formats.fp4_qdq_e4m3(x)
    plain = formats.decode_kv_fp4(*formats.encode_kv_fp4(v))
    assert not torch.equal(plain, v)  # the case the exact encoder exists for
    packed, scales = encode_kv_exact(v.clone())
    assert torch.equal(formats.decode_kv_fp4(packed, scales), v)


def test_global_cache_bytes_per_token_at_released_dims():
    cfg = load_config("flash")
    packed = CacheFactory(cfg, BlockPool(EntryLayout(cfg.head_dim, cfg.index_head_dim, "packed"), initial_blocks=2),
                          "packed")
    fp32 = CacheFactory(cfg, BlockPool(EntryLayout(cfg.head_dim, cfg.index_head_dim, "fp32"), initial_blocks=2))
    assert packed.global_bytes_per_token() == 890  # quant_and_cache.md §6.1
    assert fp32.global_bytes_per_token() == 3 * (512 + 128) * 4 / 2 + (512 + 128) * 4
    assert packed.window_bytes_per_sequence() == len(cfg.topology.layers) * 128 * 528


def test_packed_storage_gives_identical_outputs(tiny):
    rt = tiny
    rt.model.set_numerics(NUMERICS["fp32"])  # cache QDQ on: the packed formats hold exactly these values
    try:
        ps, params = prompts(6, seed=2), SamplingParams(max_tokens=6)
        outs = {}
        for storage in ("fp32", "packed"):
            engine = LLMEngine(rt, EngineConfig(max_batch=4, prefill_chunk=16, kv_storage=storage,
                                                        prefix_cache=False))
            outs[storage] = [s.output_ids for s in engine.generate(ps, params)]
            assert engine.factory.pool.blocks_in_use == 0
        assert outs["fp32"] == outs["packed"]
    finally:
        rt.model.set_numerics(NUMERICS["plain"])
    with pytest.raises(OpenflashError, match="cache QDQ"):
        LLMEngine(rt, EngineConfig(kv_storage="packed"))


# ---- scheduling and batching -------------------------------------------------------------------------------------


def _seq(n: int, rid: str) -> Sequence:
    params = SamplingParams(max_tokens=4)
    return Sequence(rid, list(range(3, 3 + n)), params, SamplerState.create(params))


def test_scheduler_chunks_budget_and_batch_limit():
    admitted = []

    def admit(seq):
        admitted.append(seq.request_id)
        return True

    s = Scheduler(SchedulerConfig(max_batch=2, max_step_tokens=18, prefill_chunk=8, max_waiting=3), admit)
    for i, n in enumerate((19, 5, 6)):
        s.add(_seq(n, f"r{i}"))
    with pytest.raises(QueueFullError, match="queue is full"):
        s.add(_seq(3, "r3"))
    plan = s.schedule()
    # r0: aligned chunks [0,8) [8,16) fit the 18-token budget, [16,19) does not; r1 is not admitted yet (2 < 5).
    assert [(c.seq.request_id, c.start, c.end) for c in plan.prefills] == [("r0", 0, 8), ("r0", 8, 16)]
    assert admitted == ["r0"]
    for c in plan.prefills:
        c.seq.num_prefilled = c.end
    plan = s.schedule()
    assert [(c.seq.request_id, c.start, c.end) for c in plan.prefills] == [("r0", 16, 19), ("r1", 0, 5)]
    assert admitted == ["r0", "r1"]  # max_batch 2: r2 waits
    for c in plan.prefills:
        c.seq.num_prefilled = c.end
        s.promote(c.seq)
    plan = s.schedule()
    assert [q.request_id for q in plan.decodes] == ["r0", "r1"] and not plan.prefills
    s.remove(plan.decodes[0])
    plan = s.schedule()
    assert [(c.seq.request_id, c.start, c.end) for c in plan.prefills] == [("r2", 0, 6)]
    assert plan.decodes[0].status == SequenceStatus.RUNNING


def test_batched_greedy_equals_sequential(plain):
    rt = plain
    ps = prompts(12, 1, 60, seed=3) + [[7]]  # a one-token prompt: no compressed entry yet
    params = SamplingParams(max_tokens=8)
    engine = LLMEngine(rt, EngineConfig(max_batch=5, prefill_chunk=16, max_step_tokens=40,
                                                prefix_cache=False))
    seqs = engine.generate(ps, params, ignore_eos=True)
    assert [s.output_ids for s in seqs] == sequential(rt, ps, params)
    assert engine.runner.regroups > 1  # the batch really changed membership
    assert engine.factory.pool.blocks_in_use == 0 and engine.runner.batch is None


def test_padded_decode_batches_give_the_same_tokens(plain, monkeypatch):
    """Decode batches padded with idle rows up to their bucket (what a CUDA graph recorded per size needs): the
    same tokens as one prompt at a time, finished sequences turn their rows idle in place (the batch's tensors
    stay), and every block goes back to the pool."""
    rt = plain
    ps = prompts(9, 1, 60, seed=5)
    params = [SamplingParams(max_tokens=3 + 2 * (i % 4)) for i in range(len(ps))]  # they finish at different steps
    engine = LLMEngine(rt, EngineConfig(max_batch=6, prefill_chunk=16, max_step_tokens=40, prefix_cache=False,
                                        decode_buckets=(2, 4, 8)))
    seen: list[tuple[int, list[str | None]]] = []  # each decode step's batch size and rows (None: idle)
    decode = rt.decode

    def watched(tokens, cache, adapters=None):
        rows = list(engine.runner.batch_ids)
        seen.append((cache.batch_size, rows))
        assert all(int(cache.pos[i]) == 0 for i, r in enumerate(rows) if r is None)  # idle rows stay at 0
        return decode(tokens, cache, adapters)

    monkeypatch.setattr(rt, "decode", watched)
    seqs = engine.generate(ps, params, ignore_eos=True)
    monkeypatch.undo()
    assert [s.output_ids for s in seqs] == [generate(rt, p, sp).token_ids for p, sp in zip(ps, params)]
    assert {size for size, _ in seen} <= {2, 4, 8}
    in_place = [rows for _, rows in seen if None in rows and rows[-1] is not None]  # an idle row before a live one
    assert in_place, seen
    assert engine.stats()["idle_decode_rows"] == sum(rows.count(None) for _, rows in seen)
    assert engine.factory.pool.blocks_in_use == 0 and engine.runner.batch is None
    with pytest.raises(OpenflashError, match="decode_buckets must be increasing"):
        EngineConfig(decode_buckets=(4, 2)).validate()


@pytest.mark.parametrize("mode", ["bounded", "exact"])
def test_packed_prefill_equals_one_prompt_at_a_time(plain, mode):
    """Prompt chunks of equal length share a model call (pending bounded replays and Engram hash histories joined
    and split back); greedy outputs equal prefilling one prompt per call, with fewer calls."""
    rt = plain
    ps = prompts(9, 20, 70, seed=5) + [[9] * 33, [11] * 33]  # multi-chunk prompts, two of one length
    params = SamplingParams(max_tokens=6)
    outputs, calls = [], []
    for batch in (1, 16):
        engine = LLMEngine(rt, EngineConfig(max_batch=11, prefill_chunk=16, max_step_tokens=200,
                                                    prefill_mode=mode, prefix_cache=False, prefill_batch=batch))
        outputs.append([s.output_ids for s in engine.generate(ps, params, ignore_eos=True)])
        calls.append(engine.runner.prefill_calls)
        assert engine.factory.pool.blocks_in_use == 0
    assert outputs[0] == outputs[1] == [generate(rt, p, params, mode=mode).token_ids for p in ps]
    assert calls[0] == sum(-(-len(p) // 16) for p in ps) and calls[1] < 0.6 * calls[0]


@pytest.mark.parametrize("mode", ["bounded", "exact"])
def test_prompts_of_different_lengths_share_a_prefill_call(plain, mode):
    """Prompts of 12-30 tokens (window 16: bounded replay tails of 12 and 16) prefill in one right-padded call
    (94 real tokens of 120, within the default padding share 0.25); greedy outputs equal plain generation."""
    rt = plain
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (30, 24, 12, 28)]
    params = SamplingParams(max_tokens=5)

    def run(prompts: list[list[int]], **config) -> tuple[list[list[int]], int]:
        engine = LLMEngine(rt, EngineConfig(max_batch=4, prefill_chunk=64, max_step_tokens=256,
                                                    prefill_mode=mode, prefix_cache=False, **config))
        outputs = [s.output_ids for s in engine.generate(prompts, params, ignore_eos=True)]
        assert engine.factory.pool.blocks_in_use == 0
        return outputs, engine.runner.prefill_calls

    outputs, calls = run(ps)
    assert calls == 1 and outputs == [generate(rt, p, params, mode=mode).token_ids for p in ps]
    assert run(ps, prefill_padding=0) == (outputs, 4)  # no padding: one call per length
    assert run([ps[0], ps[2][:9]])[1] == 2  # 30 + 9 tokens padded to 60: 35% padding, over the share
    with pytest.raises(OpenflashError, match=r"prefill_padding must be in \[0, 1\), got 1.0"):
        LLMEngine(rt, EngineConfig(prefill_padding=1.0))


def test_a_failing_packed_prefill_fails_only_its_requests(plain, monkeypatch):
    rt = plain
    # Two rows a call: the two 16-token prompts share one (longest first), the 9-token prompt gets its own.
    engine = LLMEngine(rt, EngineConfig(max_batch=4, prefill_chunk=16, prefix_cache=False, prefill_batch=2))
    real = rt.step

    def flaky(ids, cache, **kwargs):
        if ids.shape == (2, 16):
            raise RuntimeError("injected failure")
        return real(ids, cache, **kwargs)

    monkeypatch.setattr(rt, "step", flaky)
    seqs = engine.generate([[5] * 16, [6] * 16, [7] * 9], SamplingParams(max_tokens=3), ignore_eos=True)
    assert [s.finish_reason for s in seqs] == ["error", "error", "length"]
    assert "injected failure" in seqs[0].error and len(seqs[2].output_ids) == 3
    assert engine.factory.pool.blocks_in_use == 0


def test_seeded_sampling_is_independent_of_the_batch(plain):
    rt = plain
    ps = prompts(5, seed=4)
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=6, seed=100 + i) for i in range(5)]
    engine = LLMEngine(rt, EngineConfig(max_batch=5, prefix_cache=False))
    seqs = engine.generate(ps, params)
    assert [s.output_ids for s in seqs] == [generate(rt, p, sp).token_ids for p, sp in zip(ps, params)]


def test_a_shared_prompt_is_prefilled_once_and_each_twin_samples_its_own(plain):
    """Four requests of one prompt (an RL group, a completion's n) and one of another: the shared prompt's chunks run
    once, the three twins take copies of its state (copy-on-write blocks) and draw their own tokens, which equal
    those of each request served alone. A twin whose leader stops before its prefill ends prefills itself."""
    rt = plain
    shared, other = prompts(2, 33, 34, seed=9)  # three chunks of 16
    params = [SamplingParams(temperature=0.8, max_tokens=6, seed=40 + i, logprobs=True) for i in range(5)]
    engine = LLMEngine(rt, EngineConfig(max_batch=8, prefill_chunk=16, max_step_tokens=32, prefix_cache=False))
    alone = [engine.generate([p], [sp], ignore_eos=True)[0] for p, sp in zip([shared] * 4 + [other], params)]
    engine.metrics.prompt_tokens = engine.metrics.cached_prompt_tokens = 0
    seqs = engine.generate([shared] * 4 + [other], params, ignore_eos=True)
    assert [s.output_ids for s in seqs] == [a.output_ids for a in alone]
    assert len({tuple(s.output_ids) for s in seqs[:4]}) > 1  # their own seeds: the group really differs
    for seq, single in zip(seqs, alone):
        assert [t.logprob for t in seq.output_logprobs] == pytest.approx([t.logprob for t in single.output_logprobs],
                                                                   abs=1e-5)
    assert engine.metrics.prompt_tokens == 2 * 33 and engine.metrics.cached_prompt_tokens == 3 * 33
    assert [s.num_cached for s in seqs] == [0, 33, 33, 33, 0] and engine.factory.pool.blocks_in_use == 0
    apart = LLMEngine(rt, EngineConfig(max_batch=8, prefill_chunk=16, max_step_tokens=32, prefix_cache=False,
                                       share_prompts=False))
    assert [s.output_ids for s in apart.generate([shared] * 4 + [other], params, ignore_eos=True)] == \
        [s.output_ids for s in seqs] and apart.metrics.prompt_tokens == 5 * 33

    outs: dict[str, list] = {}
    lead, *twins = [engine.add_request(shared, sp, ignore_eos=True, on_output=lambda o: outs.setdefault(
        o.request_id, []).append(o)) for sp in params[:3]]
    engine.step()  # the leader's first chunk; its twins wait
    assert engine.scheduler.twins == {lead.request_id: twins}
    engine.abort(lead.request_id)
    while engine.has_work():
        engine.step()
    assert outs[lead.request_id][-1].finish_reason == ABORT
    assert [t.output_ids for t in twins] == [a.output_ids for a in alone[1:3]]
    assert engine.factory.pool.blocks_in_use == 0


def test_stop_strings_stop_ids_and_length(plain):
    rt = plain
    p = prompts(1, 20, 21, seed=5)[0]
    ref = generate(rt, p, SamplingParams(max_tokens=10))
    engine = LLMEngine(rt, EngineConfig(prefix_cache=False))
    (full,) = engine.generate([p], SamplingParams(max_tokens=10), ignore_eos=True)
    assert full.output_ids == ref.token_ids and full.finish_reason == LENGTH and full.text == ref.text
    # A stop token id: generation ends with it, and its text is not part of the output.
    stop_id = ref.token_ids[3]
    (s,) = engine.generate([p], SamplingParams(max_tokens=10, stop_token_ids=(stop_id,)))
    k = ref.token_ids.index(stop_id)
    assert s.output_ids == ref.token_ids[:k + 1] and s.finish_reason == STOP
    assert s.text == rt.tokenizer.decode(ref.token_ids[:k])
    # A stop string cut from the middle of the reference text; streamed pieces never contain it.
    text = ref.text
    start = len(text) // 2
    stop = text[start:start + 2]
    pieces = []
    engine.add_request(p, SamplingParams(max_tokens=10, stop=(stop,)), on_output=lambda o: pieces.append(o))
    while engine.has_work():
        engine.step()
    assert pieces[-1].finished and pieces[-1].finish_reason == STOP
    streamed = "".join(o.text for o in pieces)
    assert streamed == text[:text.find(stop)]
    assert sum(len(o.token_ids) for o in pieces) == pieces[-1].completion_tokens


def test_request_validation(plain):
    """Every prompt check is the one intake's (engine/prompt.py), each refusal a PromptError with its code."""
    rt = plain
    engine = LLMEngine(rt, EngineConfig(max_context=64, max_waiting=2, prefix_cache=False))
    refused = {TOO_LONG: (list(range(3, 70)), 1, (), "64"), MAX_TOKENS: (list(range(3, 50)), 20, (), "max_tokens 20"),
               INVALID_TOKEN: ([5, 5000], 1, (), "vocabulary"), EMPTY: ([], 1, (), "empty"),
               INVALID_IMAGES: ([5], 1, [object()], "vision tower")}
    for code, (ids, max_tokens, images, words) in refused.items():
        with pytest.raises(PromptError, match=words) as e:
            engine.add_request(ids, SamplingParams(max_tokens=max_tokens), images=images)
        assert e.value.code == code
    assert engine.prompt_intake.max_token_chars is not None  # the preset tokenizer bounds characters per token
    with pytest.raises(PromptError, match="characters, so at least") as e:  # refused before it is tokenized
        engine.add_request("x" * 64 * engine.prompt_intake.max_token_chars, SamplingParams(max_tokens=1))
    assert e.value.code == TOO_LONG
    with pytest.raises(OpenflashError, match="temperature"):
        engine.add_request([5], SamplingParams(temperature=-1))
    engine.add_request([5], SamplingParams(max_tokens=1))
    engine.add_request([6], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFullError):
        engine.add_request([7], SamplingParams(max_tokens=1))


def test_abort_frees_state_and_shutdown_drains(plain):
    rt = plain
    engine = LLMEngine(rt, EngineConfig(max_batch=4, prefill_chunk=16, prefix_cache=False))
    outs: dict[str, list] = {}

    def collect(o):
        outs.setdefault(o.request_id, []).append(o)

    long = [engine.add_request(p, SamplingParams(max_tokens=500), on_output=collect, ignore_eos=True)
            for p in prompts(3, 30, 40, seed=6)]
    for _ in range(4):
        engine.step()
    assert engine.factory.pool.blocks_in_use > 0
    for s in long:
        engine.abort(s.request_id)
    engine.step()
    assert all(outs[s.request_id][-1].finish_reason == ABORT for s in long)
    assert engine.factory.pool.blocks_in_use == 0 and not engine.has_work()
    # Background loop: a short request drains, a long one is aborted at the deadline, then intake is closed.
    engine.start()
    short = engine.add_request(prompts(1, seed=7)[0], SamplingParams(max_tokens=3), on_output=collect)
    slow = engine.add_request(prompts(1, seed=8)[0], SamplingParams(max_tokens=500), on_output=collect,
                              ignore_eos=True)
    time.sleep(0.05)
    engine.shutdown(drain_timeout=1.0)
    assert outs[short.request_id][-1].finish_reason == LENGTH
    assert outs[slow.request_id][-1].finish_reason == ABORT
    assert engine.factory.pool.blocks_in_use == 0
    with pytest.raises(EngineStoppedError):
        engine.add_request([5], SamplingParams())


def test_engram_host_tier_gives_identical_outputs():
    """--engram-placement host: hash ids computed from token ids before each step, rows fetched by the memory tier."""
    runtimes = []
    for _ in range(2):
        rt = open_model("tiny", numerics="plain")
        for lid in rt.cfg.engram_layer_ids:  # the host tier holds FP8 rows; give both models the same tables
            rt.model.layers[lid].engram.embed = rt.model.layers[lid].engram.embed.to_fp8()
        runtimes.append(rt)
    device, host = runtimes
    with host:
        host.place_engram("host")
        ps, params = prompts(4, seed=9), SamplingParams(max_tokens=5)
        config = EngineConfig(max_batch=4, prefill_chunk=16, prefix_cache=False)
        want = [s.output_ids for s in LLMEngine(device, config).generate(ps, params)]
        engine = LLMEngine(host, EngineConfig(max_batch=4, prefill_chunk=16, prefix_cache=False, engram_speculate=2))
        assert [s.output_ids for s in engine.generate(ps, params)] == want
        stats = engine.stats()["engram"]
        assert stats["placement"] == "host" and stats["steps"] > 0 and stats["speculation"]["speculations"] > 0
