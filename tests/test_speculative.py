"""Speculative decoding with the DSpark drafter: greedy output identical to plain decoding (every layer mode, both
prefill modes, continuous batching, prefix-cache hits, packed KV), the target's distribution kept under sampling
(chi-square), what the verification writes rolled back, and the counters."""

from __future__ import annotations

import httpx
import pytest
import torch

from openflash.config import load_config
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.sampling import SamplingParams, filtered_probs
from openflash.errors import OpenflashError
from openflash.model.numerics import NUMERICS
from openflash.model.transformer import Transformer
from openflash.runtime.runtime import Runtime
from openflash.tokenizer import preset_tokenizer
from openflash.topology import LayerMode

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def drafted():
    """The tiny preset (every layer mode) with a random DSpark head. Embeddings scaled up, as golden D does, so
    that the streams are dominated by the current token and random drafts partly agree with the target."""
    torch.manual_seed(0)
    cfg = load_config("tiny").with_dspark()
    model = Transformer(cfg).set_numerics(NUMERICS["plain"]).eval()
    with torch.no_grad():
        model.embed.weight.mul_(12)
    return Runtime.of(model, preset_tokenizer(cfg))


def _prompts(lengths, vocab):
    return [torch.randint(3, vocab - 30, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


@pytest.mark.parametrize("engine_kw", [dict(prefill_mode="bounded"), dict(prefill_mode="exact"),
                                       dict(prefill_mode="bounded", kv_storage="packed", numerics="fp32"),
                                       dict(prefill_mode="exact", num_speculative_tokens=2)],
                         ids=["bounded", "exact", "packed-fp32", "k2"])
def test_greedy_with_speculation_equals_greedy_without(drafted, engine_kw):
    rt = drafted
    assert {t.mode for t in rt.cfg.topology.layers} == set(LayerMode)
    engine_kw = dict(engine_kw)
    rt.model.set_numerics(NUMERICS[engine_kw.pop("numerics", "plain")])
    k = engine_kw.pop("num_speculative_tokens", None)
    try:
        # Lengths past the 16-token window and the chunk size; the 40-token prompt twice (a prefix-cache hit).
        prompts = _prompts((5, 17, 40, 23), rt.cfg.vocab_size)
        prompts.append(prompts[2][:37] + [7, 8, 9])
        config = dict(max_batch=3, prefill_chunk=16, max_step_tokens=64, **engine_kw)
        params = [SamplingParams(max_tokens=n) for n in (30, 9, 24, 1, 17)]  # rows finish at different steps
        plain = LLMEngine(rt, EngineConfig(**config)).generate(prompts, params, ignore_eos=True)
        engine = LLMEngine(rt, EngineConfig(**config, speculative="dspark", num_speculative_tokens=k))
        spec = engine.generate(prompts, params, ignore_eos=True)
        assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
        assert [len(s.output_ids) for s in spec] == [p.max_tokens for p in params]
        m = engine.metrics
        assert m.spec_rounds > 0 and 0 < m.spec_accepted < m.spec_drafted  # drafts both kept and rejected
        assert m.acceptance_length() == pytest.approx((m.spec_accepted + m.spec_rounds) / m.spec_rounds)
        assert sum(m.spec_accepted_at.values()) == m.spec_accepted
        assert engine.metrics.cached_prompt_tokens > 0  # the fifth prompt reused the third's prefix
    finally:
        rt.model.set_numerics(NUMERICS["plain"])


@pytest.mark.parametrize("mode", ["bounded", "exact"])
def test_padded_prefill_seeds_the_drafter_as_one_prompt_at_a_time(drafted, mode):
    """Prompts of 5-40 tokens prefilled in one right-padded call leave the drafter's rings as prefilling each alone
    does: the same drafts are proposed and accepted, round by round."""
    rt = drafted
    prompts = _prompts((5, 17, 40, 23), rt.cfg.vocab_size)
    params = SamplingParams(max_tokens=12)
    runs = []
    for padding in (0.0, 0.75):
        engine = LLMEngine(rt, EngineConfig(max_batch=4, prefill_chunk=64, max_step_tokens=256,
                                                    prefill_mode=mode, prefix_cache=False, speculative="dspark",
                                                    prefill_padding=padding))
        outputs = [s.output_ids for s in engine.generate(prompts, params, ignore_eos=True)]
        m = engine.metrics
        runs.append((outputs, engine.runner.prefill_calls, m.spec_drafted, m.spec_accepted, dict(m.spec_accepted_at)))
    assert [r[1] for r in runs] == [4, 1]
    assert runs[0][0] == runs[1][0] and runs[0][2:] == runs[1][2:]
    assert runs[1][3] > 0


def test_sampling_keeps_the_target_distribution(drafted):
    """The token after a speculative round's anchor, over many seeds, follows the target's own distribution: a
    chi-square test of the counts against the target's probabilities given each run's first token."""
    rt = drafted
    prompt = _prompts((12,), rt.cfg.vocab_size)[0]
    params = [SamplingParams(temperature=1.0, top_k=6, max_tokens=3, seed=s) for s in range(600)]
    engine = LLMEngine(rt, EngineConfig(max_batch=64, prefill_chunk=16, max_step_tokens=1024, max_waiting=1000,
                                                speculative="dspark", num_speculative_tokens=1))
    seqs = engine.generate([prompt] * len(params), params, ignore_eos=True)
    m = engine.metrics
    assert 0.1 < m.spec_accepted / m.spec_drafted < 0.9  # both branches (accept, resample) ran many times
    expected: dict[int, float] = {}
    by_first: dict[int, torch.Tensor] = {}
    for s in seqs:
        first = s.output_ids[0]
        if first not in by_first:
            logits = rt.step(torch.tensor([prompt + [first]]), rt.new_cache())[0]
            by_first[first] = filtered_probs(logits, params[0])
        for token, p in enumerate(by_first[first].tolist()):
            if p > 0:
                expected[token] = expected.get(token, 0.0) + p
    observed: dict[int, int] = {}
    for s in seqs:
        observed[s.output_ids[1]] = observed.get(s.output_ids[1], 0) + 1
    assert set(observed) <= set(expected)  # nothing outside the target's support
    bins = [t for t in expected if expected[t] >= 5]
    stat = sum((observed.get(t, 0) - expected[t]) ** 2 / expected[t] for t in bins)
    df = len(bins) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))
    assert df >= 5 and p_value > 1e-3, (stat, df, p_value)


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected >= 5
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_rejection_sampling_commits_the_target_distribution():
    """`accept` alone, many draws: whatever the draft distribution q, the first committed token follows p."""
    from openflash.engine.sampling import SamplerState
    from openflash.engine.speculative import accept

    params = SamplingParams(temperature=1.0, max_tokens=8)
    target = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]] * 2)  # rows: after the anchor, after d_1
    p = filtered_probs(target[0], params)
    for q_logits in (torch.tensor([0.0, 2.5, 0.0, 1.0, 0.0, 0.0, -2.0, 0.0]), target[0]):  # unlike p, and equal
        q = filtered_probs(q_logits, params)
        counts = torch.zeros(8)
        accepted = 0
        state = SamplerState.create(SamplingParams(temperature=1.0, max_tokens=8, seed=1))
        n = 12000
        for _ in range(n):
            d = int(torch.multinomial(q, 1, generator=state.generator)[0])
            result = accept(target, [d], state, [q])
            counts[result.tokens[0]] += 1
            accepted += result.accepted
        assert _chi_square_p(counts, p * n) > 1e-3
        overlap = float(torch.minimum(p, q).sum())  # the acceptance probability of the rule
        assert abs(accepted / n - overlap) < 0.03


def test_the_round_leaves_the_cache_as_plain_decoding_would(drafted):
    """After a round the batch cache holds exactly the committed positions: its window rings, hash history and
    positions equal those of a plain decode of the same tokens."""
    rt = drafted
    prompt = _prompts((21,), rt.cfg.vocab_size)[0]
    engine = LLMEngine(rt, EngineConfig(max_batch=2, prefill_chunk=16, speculative="dspark",
                                                prefix_cache=False))
    engine.add_request(prompt, SamplingParams(max_tokens=40), ignore_eos=True)
    for _ in range(6):
        engine.step()
    seq = engine.scheduler.all_sequences()[0]
    batch = engine.runner.batch
    assert int(batch.pos[0]) == len(prompt) + len(seq.output_ids) - 1  # the last token is the next anchor
    plain = LLMEngine(rt, EngineConfig(max_batch=2, prefill_chunk=16, prefix_cache=False))
    ref = plain.runner.new_cache()
    ids = torch.tensor([prompt + seq.output_ids[:-1]])
    rt.step(ids, ref)
    recent = int(batch.pos[0]) - rt.cfg.sliding_window  # the spare slots may keep older (masked) positions
    for mine, theirs in zip(batch.window, ref.window):
        held = theirs.pos[0][theirs.pos[0] >= 0]
        assert sorted(mine.pos[0][mine.pos[0] >= recent].tolist()) == sorted(held.tolist())
        assert int(mine.pos.max()) == int(batch.pos[0]) - 1  # nothing of the rejected drafts left
    h = rt.cfg.engram_max_ngram_size - 1  # the hash history: the last max_ngram - 1 committed tokens
    assert torch.equal(batch.engram.padded(h)[0], ref.engram.padded(h)[0])
    assert all(int(r.pos.max()) == int(batch.pos[0]) - 1 for r in batch.draft)  # rings: committed positions only


def test_refusals(drafted):
    rt = drafted
    with pytest.raises(OpenflashError, match="num_speculative_tokens must be in 1..5"):
        LLMEngine(rt, EngineConfig(speculative="dspark", num_speculative_tokens=6))
    with pytest.raises(OpenflashError, match="speculative must be"):
        EngineConfig(speculative="eagle").validate()
    plain = Transformer(load_config("tiny"))
    with pytest.raises(OpenflashError, match="needs a model with a DSpark draft head"):
        LLMEngine(rt.with_model(plain), EngineConfig(speculative="dspark"))
    # A target layer in the CED encoder half: bounded prefill cannot feed the drafter, exact prefill can.
    torch.manual_seed(0)
    early = rt.with_model(Transformer(load_config("tiny").with_dspark(target_layer_ids=[0, 6, 7])).eval())
    assert not early.cfg.dspark_bounded_ok and rt.cfg.dspark_bounded_ok
    with pytest.raises(OpenflashError, match="use --prefill-mode exact"):
        LLMEngine(early, EngineConfig(speculative="dspark", prefill_mode="bounded"))
    engine = LLMEngine(early, EngineConfig(speculative="dspark", prefill_mode="exact"))
    out = engine.generate([_prompts((20,), early.cfg.vocab_size)[0]], SamplingParams(max_tokens=6), ignore_eos=True)
    assert len(out[0].output_ids) == 6


def test_metrics_report_acceptance(drafted):
    from openflash.serve.metrics import render

    rt = drafted
    engine = LLMEngine(rt, EngineConfig(max_batch=2, speculative="dspark", num_speculative_tokens=3))
    engine.generate(_prompts((9, 14), rt.cfg.vocab_size), SamplingParams(max_tokens=12), ignore_eos=True)
    text = render(engine)
    m = engine.metrics
    assert f"openflash_spec_decode_num_draft_tokens_total {m.spec_drafted}" in text
    assert f"openflash_spec_decode_num_accepted_tokens_total {m.spec_accepted}" in text
    assert 'openflash_spec_decode_num_accepted_tokens_per_pos_total{position="3"}' in text
    assert "openflash_spec_decode_acceptance_length" in text
    assert "spec_decode" not in render(LLMEngine(rt, EngineConfig(max_batch=2)))


def test_server_with_speculation_answers_as_without(drafted):
    from live_server import LiveServer

    from openflash.chat import chat_format
    from openflash.serve.app import ServerConfig, build_app

    rt = drafted
    prompt = _prompts((15,), rt.cfg.vocab_size)[0]
    texts = []
    for speculative in (None, "dspark"):
        engine = LLMEngine(rt, EngineConfig(max_batch=4, max_context=256, speculative=speculative))
        app = build_app(engine, rt.tokenizer, ServerConfig("drafted", chat_format(rt.tokenizer, 0, 1), drain_timeout=2.0))
        with LiveServer(app) as server:
            out = server.client().completions.create(model="drafted", prompt=prompt, max_tokens=16, temperature=0,
                                                     extra_body={"ignore_eos": True})
            texts.append(out.choices[0].text)
            metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert ("openflash_spec_decode_num_draft_tokens_total" in metrics) == (speculative is not None)
    assert texts[0] == texts[1] and texts[0]
