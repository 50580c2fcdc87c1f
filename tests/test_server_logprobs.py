"""Log-probabilities through the server, read by the field's clients: the `openai` SDK (its own types parse every
response and chunk) and EleutherAI's lm-evaluation-harness (`local-completions` with the server's remote tokenizer,
a multiple-choice log-likelihood task and an exact-match task shipped in tests/lm_eval_tasks/)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from live_server import NAME, LiveServer, idle, make_app, stack  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

TASKS = Path(__file__).parent / "lm_eval_tasks"


@pytest.fixture(scope="module")
def live(stack):
    engine, app = make_app(stack)
    with LiveServer(app) as server:
        yield server, engine


def _teacher_forced(rt, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(rt.forward(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def test_echoed_prompt_logprobs_in_openai_s_shape(live, stack):
    server, engine = live
    rt, client = stack, server.client()
    prompt = "def split(self, text):\n    return text"
    ids = rt.tokenizer.encode(prompt).ids
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0, logprobs=3, echo=True)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = _teacher_forced(rt, ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], want)) < 1e-4
    text = out.choices[0].text
    for token, start, end in zip(lp.tokens, lp.text_offset, lp.text_offset[1:] + [len(text)]):
        # a token's text starts at its offset; a piece of a character ("bytes:...") shares the character's
        assert text[start:end] == token or token.startswith("bytes:") and start <= end, (token, text[start:end])
    for token, value, top in zip(lp.tokens[len(ids):], lp.token_logprobs[len(ids):], lp.top_logprobs[len(ids):]):
        assert 3 <= len(top) <= 4 and top[token] == value == max(top.values())  # greedy: its own is the likeliest
    only = client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == rt.tokenizer.decode(ids) and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    plain = client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0, logprobs=0)
    # a chunked prefill against one call: fp32 rounding in another order only (plain numerics), far below 1e-4
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[len(ids):], abs=1e-4)
    assert plain.choices[0].logprobs.text_offset[0] == len(rt.tokenizer.decode(ids))  # OpenAI: after the prompt
    assert idle(engine)


def test_streamed_logprobs_equal_the_whole_response_s(live):
    server, engine = live
    client = server.client()
    kwargs = dict(model=NAME, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(messages=[{"role": "user", "content": "import os"}], logprobs=True,
                                           top_logprobs=2, **kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    for c in content:  # greedy: the likeliest is the token; its bytes are its text's, or those it names
        assert c.top_logprobs[0].logprob == c.logprob
        assert c.bytes == list(c.token.encode()) or c.token == "bytes:" + "".join(f"\\x{b:02x}" for b in c.bytes)
    streamed = []
    for chunk in client.chat.completions.create(messages=[{"role": "user", "content": "import os"}], logprobs=True,
                                                top_logprobs=2, stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    texts = []
    for chunk in client.completions.create(prompt="import os", logprobs=1, stream=True, **kwargs):
        texts += chunk.choices[0].logprobs.tokens if chunk.choices and chunk.choices[0].logprobs else []
    full = client.completions.create(prompt="import os", logprobs=1, **kwargs)
    assert texts == full.choices[0].logprobs.tokens
    assert idle(engine)


def test_tokenizer_endpoints_as_vllm_serves_them(live, stack):
    server, _ = live
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == stack.tokenizer.id_to_token(stack.cfg.eos_token_id) and info["model_max_length"]
    plain = httpx.post(server.url + "/tokenize", json={"prompt": "import os", "add_special_tokens": False}).json()
    assert plain["tokens"] == stack.tokenizer.encode("import os", add_special_tokens=False).ids
    assert httpx.post(server.url + "/detokenize", json={"tokens": plain["tokens"]}).json()["prompt"] == "import os"


def test_lm_eval_runs_both_task_kinds_and_its_loglikelihoods_are_the_model_s(live, stack, monkeypatch, tmp_path):
    server, engine = live
    monkeypatch.chdir(TASKS)  # the tasks' data files are relative
    for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                        ("HF_DATASETS_CACHE", str(tmp_path / "datasets")), ("TOKENIZERS_PARALLELISM", "false")):
        monkeypatch.setenv(name, value)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="local-completions",
        model_args=f"base_url={server.url}/v1/completions,model={NAME},tokenizer_backend=remote,num_concurrent=4,"
                   f"max_retries=1,max_length=256",
        tasks=["openflash_mc", "openflash_exact"], task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    assert 0 <= results["results"]["openflash_mc"]["acc,none"] <= 1
    assert "exact_match,none" in results["results"]["openflash_exact"]
    tok = stack.tokenizer
    checked = 0
    for sample in results["samples"]["openflash_mc"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            n_spaces = len(context) - len(context.rstrip())  # lm-eval moves trailing blanks to the continuation
            if n_spaces:
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            ctx = tok.encode(context, add_special_tokens=False).ids
            whole = tok.encode(context + continuation, add_special_tokens=False).ids
            want = sum(_teacher_forced(stack, whole)[len(ctx) - 1:])
            assert abs(resp[0][0] - want) < 1e-4 * max(1, len(whole) - len(ctx)), (context, continuation)
            checked += 1
    assert checked == 24
    generated = [s["resps"][0][0] for s in results["samples"]["openflash_exact"]]
    assert len(generated) == 4 and all(isinstance(g, str) for g in generated)
    assert idle(engine)
