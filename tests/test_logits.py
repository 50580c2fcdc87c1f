"""What the engine computes for a request beyond its tokens: log-probabilities (sampled tokens' and a prompt's) equal
to the teacher-forced forward, and the logit shaping of penalties, bias, min_tokens, min_p and a grammar."""

from __future__ import annotations

import math

import pytest
import torch

from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.logits import shape_logits
from openflash.engine.request import Sequence
from openflash.engine.sampling import SamplerState, SamplingParams, filtered_probs
from openflash.errors import RequestError
from openflash.runtime.open import open_model


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return open_model("tiny")  # the released numerics (activation and cache QDQ), not "plain"


def _teacher_forced(rt, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, from one forward over the whole sequence."""
    with torch.no_grad():
        logp = torch.log_softmax(rt.forward(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_prompt_and_sampled_logprobs_are_the_teacher_forced_forward_s(tiny):
    """A prompt longer than the prefill chunk is scored in one call (scheduler.py): in the released numerics a
    chunked prefill's logits differ from the whole forward's at the 1e-3 level, which a log-likelihood must not."""
    prompt = list(range(5, 45))
    engine = LLMEngine(tiny, EngineConfig(max_batch=4, max_context=128, prefill_chunk=16))  # bounded, chunks of 16
    scored, only_prompt = engine.generate(
        [prompt, prompt], [SamplingParams(max_tokens=3, logprobs=True, top_logprobs=2, prompt_logprobs=1),
                           SamplingParams(max_tokens=0, prompt_logprobs=1)], ignore_eos=True)
    want = _teacher_forced(tiny, prompt + scored.output_ids)
    got = torch.tensor([r.logprob for r in scored.prompt_logprobs + scored.output_logprobs])
    # one fp32 forward each, same shapes: only the decode steps' summation order differs
    assert (got - want).abs().max() < 1e-4
    assert [r.token for r in scored.prompt_logprobs] == prompt[1:]
    for r in scored.output_logprobs:  # greedy: the token is the likeliest, its own entry first
        assert len(r.top) == 2 and r.top[0] == (r.token, r.logprob) and r.top[1][1] <= r.logprob
    assert only_prompt.output_ids == [] and only_prompt.finish_reason == "length"
    assert [r.logprob for r in only_prompt.prompt_logprobs] == [r.logprob for r in scored.prompt_logprobs]
    assert engine.factory.pool.blocks_in_use == 0


def test_a_scored_prompt_is_not_restored_from_the_prefix_cache_and_twins_share_its_scores(tiny):
    prompt = list(range(7, 40))
    engine = LLMEngine(tiny, EngineConfig(max_batch=4, max_context=96, prefill_chunk=16, prefix_cache=True))
    engine.generate([prompt], SamplingParams(max_tokens=1))  # the prompt's blocks are cached now
    seqs = engine.generate([prompt] * 3, SamplingParams(max_tokens=1, prompt_logprobs=0), ignore_eos=True)
    assert seqs[0].num_cached == 0 and [s.num_cached for s in seqs[1:]] == [len(prompt)] * 2  # twins of the first
    want = _teacher_forced(tiny, prompt)
    for seq in seqs:
        assert len(seq.prompt_logprobs) == len(prompt) - 1
        assert (torch.tensor([r.logprob for r in seq.prompt_logprobs]) - want).abs().max() < 1e-4


def _seq(params: SamplingParams, prompt=(1, 2), output=(), eos: int | None = 9) -> Sequence:
    seq = Sequence("r", list(prompt), params, SamplerState.create(params), eos_token_id=eos)
    seq.output_ids = list(output)
    return seq


def test_penalties_and_bias_follow_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, 4.0, 1.5, 2.5]])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 10.0),))
    out = shape_logits(logits, [_seq(p, output=(3, 3, 5))])[0]
    want = logits[0].clone()
    want[3] -= 0.5 + 2 * 0.25  # OpenAI: presence once, frequency per occurrence, output tokens only
    want[5] -= 0.5 + 0.25
    want[4] += 10.0
    assert torch.equal(out, want) and torch.equal(logits[0, 3], torch.tensor(3.0))  # the input is untouched
    rep = shape_logits(logits, [_seq(SamplingParams(repetition_penalty=2.0), prompt=(1,), output=(0,))])[0]
    assert rep[0] == 1.0 and rep[1] == -2.0 and rep[2] == 0.5  # positive / 2, negative x 2, unseen as it was
    assert shape_logits(logits, [_seq(SamplingParams())]) is logits  # nothing asked: nothing copied


def test_min_tokens_holds_back_the_end_and_min_p_drops_the_unlikely():
    logits = torch.zeros(1, 10)
    p = SamplingParams(min_tokens=2, max_tokens=5, stop_token_ids=(4,))
    early = shape_logits(logits, [_seq(p, output=(1,))])[0]
    assert early[9] == -math.inf and early[4] == -math.inf and torch.isfinite(early[:4]).all()
    assert torch.isfinite(shape_logits(logits, [_seq(p, output=(1, 2))])[0]).all()
    probs = filtered_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), SamplingParams(temperature=1.0, min_p=0.2))
    assert probs[3] == 0 and probs[2] > 0 and math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


def test_engine_honours_bias_min_tokens_and_stop_strings(tiny):
    engine = LLMEngine(tiny, EngineConfig(max_batch=4, max_context=64, prefill_mode="exact"))
    eos = tiny.cfg.eos_token_id
    forced = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, logit_bias=((11, 100.0),)))[0]
    assert forced.output_ids == [11] * 4
    ends = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=8, min_tokens=3, logit_bias=((eos, 100.0),)))[0]
    assert ends.output_ids[:3] != [eos] * 3 and eos not in ends.output_ids[:3] and ends.output_ids[3] == eos
    assert ends.finish_reason == "stop"
    plain = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6), ignore_eos=True)[0]
    stop = plain.text[2:4]
    cut = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, stop=(stop,)), ignore_eos=True)[0]
    kept = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, stop=(stop,), include_stop_str_in_output=True),
                           ignore_eos=True)[0]
    at = plain.text.find(stop)
    assert cut.text == plain.text[:at] and kept.text == plain.text[:at + len(stop)]


def test_bad_sampling_values_name_their_field():
    for kwargs, field in ((dict(presence_penalty=3), "presence_penalty"),
                          (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"), (dict(logit_bias=((3, 200.0),)), "logit_bias"),
                          (dict(min_tokens=9, max_tokens=4), "min_tokens"), (dict(top_logprobs=21), "top_logprobs"),
                          (dict(max_tokens=0), "max_tokens"), (dict(logprobs_of="policy"), "logprobs_of")):
        with pytest.raises(RequestError) as e:
            SamplingParams(**kwargs).validate()
        assert e.value.param == field and field in str(e.value)


class _OnlyEnd:
    """A grammar whose only next token is the end (a finished document)."""

    finished = False

    def __init__(self, end: int) -> None:
        self.end = end

    def allowed(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.end] = True
        return mask

    def advance(self, token: int) -> bool:
        return token == self.end


def test_a_request_whose_shaping_leaves_no_token_fails_alone(tiny):
    """min_tokens holds back the end its grammar requires: that request fails with the reason, the others in the
    batch go on (the sampler is never handed a row without a finite logit)."""
    engine = LLMEngine(tiny, EngineConfig(max_batch=4, max_context=64, prefill_mode="exact"))
    eos = tiny.cfg.eos_token_id
    stuck = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, min_tokens=2, temperature=0.7, seed=1),
                               constraint=_OnlyEnd(eos))
    free = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), ignore_eos=True)
    while engine.has_work():
        engine.step()
    assert stuck.finish_reason == "error" and "min_tokens" in stuck.error
    assert free.finish_reason == "length" and len(free.output_ids) == 4
