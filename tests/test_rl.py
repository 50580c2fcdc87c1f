"""RL (openflash rl, rl/): the GRPO math against hand-worked numbers, masking, the engine's sampled log-probs against
the training forward's, tasks and rewards read with named errors, the reward sandbox's limits, and runs on `tiny`:
the reward rises on a trivially learnable task, an interrupted run resumed equals an uninterrupted one, the adapter
serves."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from openflash.cli import main as cli_main
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.sampling import SamplingParams, TokenLogprob
from openflash.errors import OpenflashError
from openflash.files.peft import adapter_folder, read_adapter
from openflash.rl.config import RLConfig
from openflash.rl.grpo import completion_logprobs, equal_groups, group_advantages, overlong_penalty, policy_loss
from openflash.rl.rewards import ExactAnswer, make_reward
from openflash.rl.sandbox import Sandbox
from openflash.rl.tasks import Task, read_tasks
from openflash.rl.trainer import RLTrainer, adapters_off
from openflash.runtime.open import open_model

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the math ---------------------------------------------------------------------------------------------------
def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    # group 0: mean 0.5, sample std sqrt((4 x 0.25) / 3) = 0.57735; group 1: all equal, advantages 0
    adv = group_advantages(rewards)
    assert torch.allclose(adv[0], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025], dtype=torch.float64),
                          atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4, dtype=torch.float64))
    assert torch.equal(group_advantages(rewards, scale=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5],
                                                                               dtype=torch.float64))
    assert equal_groups(rewards).tolist() == [False, True]


def test_overlong_penalty_by_hand():
    assert [overlong_penalty(n, 10, 4) for n in (3, 6, 7, 8, 10, 12)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(10, 10, 0) == 0.0


def _two_tokens(ratio_a: float, ratio_b: float) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    return torch.log(torch.tensor([[0.5 * ratio_a, 0.5 * ratio_b]])).requires_grad_(), old


def test_clipped_surrogate_by_hand():
    # A = +1, ratios 1.5 and 0.5, clip 0.2: per token -min(1.5, 1.2) = -1.2 (clipped) and -min(0.5, 0.8) = -0.5
    logp, old = _two_tokens(1.5, 0.5)
    mask = torch.ones(1, 2)
    parts = policy_loss(logp, old, torch.tensor([1.0]), mask, 0.2, 0.2)
    assert math.isclose(float(parts.loss.detach()), -0.85, abs_tol=1e-6) and parts.clipped == 1 and parts.tokens == 2
    parts.loss.backward()
    # the clipped token has no gradient; the other: d(-rho A / 2)/d logp = -rho / 2 = -0.25
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.25]]), atol=1e-6)
    # A = -1: -min(-1.5, -1.2) = 1.5 (not clipped), -min(-0.5, -0.8) = 0.8 (clipped)
    logp, old = _two_tokens(1.5, 0.5)
    parts = policy_loss(logp, old, torch.tensor([-1.0]), mask, 0.2, 0.2)
    assert math.isclose(float(parts.loss.detach()), 1.15, abs_tol=1e-6) and parts.clipped == 1
    # an asymmetric clip (DAPO): with clip_high 0.6 the first token is inside: -min(1.5, 1.6) = -1.5
    logp, old = _two_tokens(1.5, 0.5)
    parts = policy_loss(logp, old, torch.tensor([1.0]), mask, 0.2, 0.6)
    assert math.isclose(float(parts.loss.detach()), -1.0, abs_tol=1e-6) and parts.clipped == 0


def test_masked_tokens_and_aggregations():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 1e-30], [0.5, 0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.5, 0.5, 0.9], [0.5, 0.5, 0.5, 0.5]]))  # ratios 2, 1, 1, ~0 | 1, 1, 1, 1
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])  # row 0 trains on its first token only
    adv = torch.tensor([1.0, 1.0])
    token = policy_loss(logp, old, adv, mask, 0.2, 10.0, aggregation="token")
    # token: (-2 - 4 x 1) / 5 tokens; the masked tokens (ratio ~0, ratio 1) count for nothing
    assert math.isclose(float(token.loss), -6 / 5, abs_tol=1e-6) and token.tokens == 5
    sequence = policy_loss(logp, old, adv, mask, 0.2, 10.0, aggregation="sequence")
    assert math.isclose(float(sequence.loss), (-2 + -1) / 2, abs_tol=1e-6)
    half = policy_loss(logp, old, adv, mask, 0.2, 10.0, aggregation="token", normalizer=10.0)
    assert math.isclose(float(half.loss), -6 / 10, abs_tol=1e-6)


def test_kl_to_the_base_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.5, 0.5]]))  # token 2: q - p = log 2: KL_t = 2 - log 2 - 1
    parts = policy_loss(logp, logp.clone(), torch.tensor([0.0]), torch.ones(1, 2), 0.2, 0.2, kl_coef=0.5,
                        logp_ref=ref)
    kl = 1 - math.log(2)
    assert math.isclose(parts.kl, kl, abs_tol=1e-6)
    assert math.isclose(float(parts.loss.detach()), 0.5 * kl / 2, abs_tol=1e-6)


def test_completion_logprobs_pick_the_next_token():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    ids = torch.randint(0, 11, (2, 6))
    logp, entropy = completion_logprobs(logits, ids, starts=[3, 2], lengths=[3, 2], width=3, temperature=0.5)
    full = torch.log_softmax(logits / 0.5, dim=-1)
    assert torch.allclose(logp[0], torch.stack([full[0, t - 1, ids[0, t]] for t in (3, 4, 5)]))
    assert torch.allclose(logp[1, :2], torch.stack([full[1, t - 1, ids[1, t]] for t in (2, 3)]))
    assert float(logp[1, 2]) == 0.0 and float(entropy[1, 2]) == 0.0
    assert torch.allclose(entropy[0, 0], -(full[0, 2].exp() * full[0, 2]).sum())


# ---- the engine's log-probs are the training forward's ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return open_model("tiny")


def test_sampled_logprobs_match_the_forward(tiny):
    engine = LLMEngine(tiny, EngineConfig(max_batch=4, max_context=64, prefill_mode="exact"))
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    params = [SamplingParams(temperature=t, max_tokens=6, seed=3, logprobs=True, logprobs_of="sampler")
              for t in (0.0, 0.7)]
    seqs = engine.generate(prompts, params, ignore_eos=True)
    for seq, p in zip(seqs, params):
        assert len(seq.output_logprobs) == len(seq.output_ids) == 6
        ids = torch.tensor([seq.prompt_ids + seq.output_ids])
        with torch.no_grad():
            logits = tiny.forward(ids).logits
        temp = p.temperature or 1.0
        want, _ = completion_logprobs(logits, ids, [len(seq.prompt_ids)], [6], 6, temp)
        got = torch.tensor([[t.logprob for t in seq.output_logprobs]])
        assert torch.allclose(got, want, atol=2e-4), (got, want)
    plain = engine.generate([prompts[0]], SamplingParams(max_tokens=3))[0]
    assert plain.output_logprobs == []


# ---- tasks and rewards --------------------------------------------------------------------------------------------
def _task(fields: dict, chat: bool = False) -> Task:
    return Task("t.jsonl:1", (1, 2), chat, fields)


def test_tasks_name_bad_lines_and_keep_the_good(tiny, tmp_path, caplog):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "2 + 2 =", "answer": "4"}), "{not json", json.dumps([1, 2]),
                               json.dumps({"prompt": "3 + 3 ="}), json.dumps({"prompt": "", "answer": "1"}),
                               json.dumps({"messages": [{"role": "user", "content": "hi"}], "answer": "x"}),
                               json.dumps({"messages": [{"role": "robot", "content": "hi"}], "answer": "x"})]) + "\n")
    tasks = read_tasks(path, tiny.tokenizer, tiny.cfg.bos_token_id, tiny.cfg.eos_token_id, needs="answer")
    assert [t.where.rsplit(":", 1)[1] for t in tasks] == ["1", "6"]
    assert tasks[1].chat and not tasks[0].chat
    log = caplog.text
    for line, why in ((2, "not JSON"), (3, "expected a JSON object"), (4, "no 'answer' field"), (5, "non-empty"),
                      (7, "messages.0")):
        assert f"tasks.jsonl:{line}: " in log and why in log, (line, why)
    empty = tmp_path / "none.jsonl"
    empty.write_text("[]\n")
    with pytest.raises(OpenflashError, match="no usable task"):
        read_tasks(empty, tiny.tokenizer, None, None)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "2 + 2 =", "answer": "4"}) + "\n" +
                    json.dumps({"prompt": "cat dog " * 200, "answer": "4"}) + "\n")
    kept = read_tasks(long, tiny.tokenizer, None, None, max_prompt_tokens=64)
    assert [t.where.rsplit(":", 1)[1] for t in kept] == ["1"]
    assert "long.jsonl:2: the prompt is" in caplog.text and "past --max-prompt-tokens 64" in caplog.text
    # a 10 MB prompt (text or chat) is refused by its length, before the tokenizer sees it
    huge = tmp_path / "huge.jsonl"
    huge.write_text(json.dumps({"prompt": "2 + 2 =", "answer": "4"}) + "\n" +
                    json.dumps({"prompt": "x = 1\n" * ((10 << 20) // 6), "answer": "4"}) + "\n" +
                    json.dumps({"messages": [{"role": "user", "content": "y" * (10 << 20)}], "answer": "4"}) + "\n")
    huge.write_text(huge.read_text() + '{"prompt": "a\\ud800b", "answer": "4"}\n')
    start = time.monotonic()
    kept = read_tasks(huge, tiny.tokenizer, None, None, max_prompt_tokens=8192)
    assert [t.where.rsplit(":", 1)[1] for t in kept] == ["1"] and time.monotonic() - start < 20
    assert "huge.jsonl:2: the prompt is 10,485," in caplog.text and "huge.jsonl:3: the prompt is" in caplog.text
    assert "huge.jsonl:4: the prompt holds a lone UTF-16 surrogate (U+D800) at character 1" in caplog.text


def test_rewards_exact_and_user_functions(tmp_path):
    exact = make_reward("exact")
    assert exact(_task({"answer": "4"}), " 4 \n").value == 1.0
    assert exact(_task({"answer": 4}), "4").value == 1.0 and exact(_task({"answer": "4"}), "44").value == 0.0
    pattern = ExactAnswer(__import__("re").compile(r"answer: (\d+)"))
    assert pattern(_task({"answer": "7"}), "answer: 3 ... answer: 7 done").value == 1.0
    assert pattern(_task({"answer": "7"}), "no idea").value == 0.0
    module = tmp_path / "my_reward.py"
    module.write_text("def length(task, completion):\n    return len(completion) / task['scale']\n"
                      "def broken(task, completion):\n    raise KeyError('oops')\n"
                      "def nan(task, completion):\n    return float('nan')\n"
                      "def slow(task, completion):\n    import time\n    time.sleep(30)\n"
                      "def leave(task, completion):\n    import sys\n    sys.exit(0)\n")
    assert make_reward(f"{module}:length")(_task({"scale": 4}), "ab").value == 0.5
    score = make_reward(f"{module}:broken")(_task({}), "ab")
    assert score.value == 0.0 and "raised KeyError" in score.problem
    assert "not a finite number" in make_reward(f"{module}:nan")(_task({}), "x").problem
    started = time.monotonic()
    late = make_reward(f"{module}:slow", timeout=0.5)(_task({}), "x")
    assert late.value == 0.0 and "took more than 0.5 s" in late.problem and time.monotonic() - started < 5
    exited = make_reward(f"{module}:leave")(_task({}), "x")  # ends its own thread, not the run
    assert exited.value == 0.0 and "raised SystemExit" in exited.problem
    with pytest.raises(OpenflashError, match="has no function 'missing'"):
        make_reward(f"{module}:missing")
    with pytest.raises(OpenflashError, match="cannot import no_such_module"):
        make_reward("no_such_module:f")
    with pytest.raises(OpenflashError, match="exact, tests or MODULE:FUNCTION"):
        make_reward("exactly")
    with pytest.raises(OpenflashError, match="not a regular expression"):
        make_reward("exact", answer_pattern="(")


# ---- tool episodes --------------------------------------------------------------------------------------------------
D = "｜DSML｜"
PRICE_TOOL = {"type": "function", "function": {"name": "price", "parameters": {
    "type": "object", "properties": {"item": {"type": "string"}}}}}
ENV = ("def price(call, task):\n"
       "    return task['prices'][call['arguments']['item']]\n")


def _call(item: str) -> str:
    return (f'\n\n<{D} calls>\n<{D} invoke name="price">\n<{D} parameter name="item" string="true">{item}'
            f'</{D} parameter>\n</{D} invoke>\n</{D} calls>')


@dataclasses.dataclass
class _Turn:
    """What the engine returns for one turn (engine/request.Sequence's fields that rollouts read)."""
    output_ids: list
    output_logprobs: list
    text: str
    finish_reason: str = "stop"
    error: str | None = None


class ScriptedTurns:
    """A Generator whose turns come from scripts keyed by text the prompt ends with; records every prompt."""

    def __init__(self, tokenizer, eos: int, scripts: dict[str, str]) -> None:
        self.tokenizer, self.eos, self.scripts, self.prompts = tokenizer, eos, scripts, []

    def generate(self, prompts, params):
        out = []
        for ids, p in zip(prompts, params):
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            self.prompts.append(text)
            reply = next(v for k, v in self.scripts.items() if k in text[-80:])
            ids = self.tokenizer.encode(reply, add_special_tokens=False).ids + [self.eos]
            out.append(_Turn(ids, [TokenLogprob(t, -0.5) for t in ids], reply))
        return out


def test_a_tool_episode_is_one_rollout_with_the_results_masked(tmp_path, caplog):
    """A chat task naming an environment: the reply's DSML call goes to the function, its result comes back as the
    template's tool turn, the model answers; the rollout holds both turns, only the model's tokens trained, and the
    second turn's context is exactly the rendered conversation. A failing function answers with its error."""
    from openflash.chat import chat_format
    from openflash.chat.conversation import ChatOptions, ToolCall, ToolSpec, Turn
    from openflash.config import load_config
    from openflash.rl.rollout import run_episodes
    from openflash.tokenizer import load_tokenizer

    tok, cfg = load_tokenizer("deepseek"), load_config("tiny")
    fmt = chat_format(tok, cfg.bos_token_id, cfg.eos_token_id)
    assert fmt.name == "deepseek-v4.1"
    (tmp_path / "shop.py").write_text(ENV)
    line = lambda item: {"messages": [{"role": "user", "content": f"Price of {item}?"}], "tools": [PRICE_TOOL],  # noqa
                         "environment": f"{tmp_path / 'shop.py'}:price", "answer": "3", "prices": {"apple": 3}}
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (line("apple"), line("pear"))))
    tasks = read_tasks(path, tok, cfg.bos_token_id, cfg.eos_token_id, needs="answer")
    scripts = {"apple?<｜Assistant｜></think>": "Let me look." + _call("apple"),
               "pear?<｜Assistant｜></think>": "Let me look." + _call("pear"),
               "<tool_result>3</tool_result><｜Assistant｜></think>": "3",
               "</tool_result><｜Assistant｜></think>": "I could not find it."}
    gen = ScriptedTurns(tok, cfg.eos_token_id, scripts)
    batch = run_episodes(gen, tok, fmt, cfg.eos_token_id, 4096, tasks, 2, 64, 1.0, (), 0, 0, max_turns=3)
    apple, pear = (group[0] for group in batch.groups)
    assert [(r.turns, r.tool_calls, r.tool_errors, r.text) for r in (apple, pear)] == \
        [(2, 1, 0, "3"), (2, 1, 1, "I could not find it.")]
    assert make_reward("exact")(apple.task, apple.text).value == 1.0
    assert "price raised KeyError" in caplog.text and "error: KeyError: 'pear'" in gen.prompts[-1]
    # The second turn's context: the conversation as the template renders it (the reply, the tool result).
    options = ChatOptions(tools=(ToolSpec("price", PRICE_TOOL["function"]["parameters"]),))
    reply = Turn("assistant", ("Let me look.",), tool_calls=(ToolCall("any", "price", '{"item": "apple"}'),))
    want = fmt.render([Turn("user", ("Price of apple?",)), reply, Turn("tool", ("3",), tool_call_id="any")],
                      options)
    assert gen.prompts[len(tasks) * 2] == want
    # The mask: the model's two turns trained, the template's tool turn between them not; logprobs aligned.
    fed = [i for i, t in zip(apple.completion_ids, apple.trained) if not t]
    assert tok.decode(fed, skip_special_tokens=False) == \
        "<｜User｜><tool_result>3</tool_result><｜Assistant｜></think>"
    assert apple.trained == [True] * (len(apple.completion_ids) - len(fed) - 2) + [False] * len(fed) + [True] * 2
    assert [lp for lp, t in zip(apple.logprobs, apple.trained) if not t] == [0.0] * len(fed)
    assert apple.generated == len(apple.completion_ids) - len(fed) and batch.tokens == 2 * sum(
        r.generated for r in (apple, pear))
    # One turn allowed: the call is made but not answered.
    once = run_episodes(ScriptedTurns(tok, cfg.eos_token_id, scripts), tok, fmt, cfg.eos_token_id, 4096, tasks, 1,
                        64, 1.0, (), 0, 0, max_turns=1)
    assert once.groups[0][0].turns == 1 and all(once.groups[0][0].trained)
    # What an environment needs: a chat task with tools, a template that parses calls, a function that imports.
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in (
        {**line("apple"), "environment": "no_such_module:f"}, {"prompt": "2+2", "environment": "x:y"},
        {k: v for k, v in line("apple").items() if k != "tools"}, line("apple"))))
    assert len(read_tasks(bad, tok, cfg.bos_token_id, cfg.eos_token_id)) == 1
    for n, why in ((1, "cannot import no_such_module"), (2, "needs a chat task with 'tools'"),
                   (3, "needs a chat task with 'tools'")):
        assert f"bad.jsonl:{n}: " in caplog.text and why in caplog.text


def test_the_update_trains_on_the_tokens_the_model_wrote(tmp_path):
    from openflash.rl.rollout import Rollout
    trainer = RLTrainer(_config(tmp_path, "mask", steps=1))
    r = Rollout(trainer.tasks[0], 0, [5, 6, 7, 8], [0.0] * 4, [True, False, False, True])
    logp, _, mask = trainer._logprobs([r], grad=True)
    assert mask.tolist() == [[True, False, False, True]] and logp.shape == (1, 4)


# ---- the sandbox ------------------------------------------------------------------------------------------------
ADD = "def add(a, b):\n    return a + b\n"


def test_sandbox_scores_the_share_of_tests_passed():
    box = Sandbox(timeout=5.0)
    assert box.run(ADD, ["assert add(2, 3) == 5"]).score == 1.0
    half = box.run(ADD, ["assert add(2, 3) == 5", "assert add(2, 3) == 6"])
    assert half.score == 0.5 and "test 1: AssertionError" in half.problem
    broken = box.run("def add(a, b) return", ["assert add(1, 1) == 2"])
    assert broken.score == 0.0 and "SyntaxError" in broken.problem
    reward = make_reward("tests")
    reply = "Here it is:\n```python\n" + ADD + "```\n"
    assert reward(_task({"tests": ["assert add(1, 2) == 3"]}), reply).value == 1.0


@pytest.mark.parametrize("code, why", [
    ("while True:\n    pass\n", "killed after"),
    ("import os\nwhile True:\n    os.fork()\n", ""),  # a fork bomb: stopped by the process limit or the kill
    ("x = bytearray(2 << 30)\n", "MemoryError"),
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "output"),
    ("import os\nos.abort()\n", "without a result"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9))\n", "network access is disabled"),
])
def test_sandbox_limits_score_zero_and_leave_nothing_behind(code, why):
    box = Sandbox(timeout=1.0, memory=256 << 20)
    start = time.monotonic()
    outcome = box.run(code, ["assert True"])
    assert outcome.score == 0.0 and why in outcome.problem, outcome
    assert time.monotonic() - start < 10
    assert box.network in ("namespace", "python guard")
    left = _left_running()
    assert not left, f"sandbox processes left running: {left}"


HOSTILE = {
    "write_outside": "open({canary!r}, 'w').write('owned')\nopen('/usr/owned', 'w').write('x')\n",
    "delete_outside": "import os\nos.remove({canary!r})\n",
    "read_host_file": "raise RuntimeError(open('/etc/passwd').read())\n",
    "kill_the_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)\n",
    "daemon": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               "        time.sleep(60)\n    os._exit(0)\n"),
    "unix_socket": ("import _socket\ns = _socket.socket(_socket.AF_UNIX)\ns.connect({socket_path!r})\n"
                    "s.send(b'hello')\n"),
    "forge_report_high": "import os\nos.write(4, b'pass x\\n' * 1000 + b'{{\"passed\": 1000000, \"total\": 1}}\\n')\n",
    "forge_list": "import os\nos.write(4, b'[1, 2, 3]\\n')\nos._exit(0)\n",
    "forge_string": "import os\nos.write(4, b'\"passed\"\\npass\\n')\nos._exit(0)\n",
    "forge_inf": "import os\nos.write(4, b'{{\"passed\": Infinity, \"total\": 1}}\\n')\nos._exit(0)\n",
    "forge_huge": "import os\nos.write(4, b'{{\"passed\": ' + b'9' * 5000 + b'}}\\n')\nos._exit(0)\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_code_scores_zero_and_leaves_the_host_unchanged(name, tmp_path):
    """Code that writes, deletes or reads the host's files, kills its parent, leaves a daemon, talks to a host Unix
    socket or forges the harness's report (five shapes): scores 0, and the host is as it was (the canary file, the
    socket silent, no sandbox process left)."""
    import socket as host_socket

    canary = tmp_path / "canary.txt"
    canary.write_text("untouched")
    os.chmod(tmp_path, 0o777)
    server = host_socket.socket(host_socket.AF_UNIX)
    server.bind(str(tmp_path / "host.sock"))
    server.listen(1)
    server.setblocking(False)
    code = HOSTILE[name].format(canary=str(canary), socket_path=str(tmp_path / "host.sock"))
    outcome = Sandbox(timeout=3.0).run(code, ["assert False", "assert False"])
    assert outcome.score == 0.0, outcome
    assert "root:" not in (outcome.problem or "")
    assert canary.read_text() == "untouched" and not Path("/usr/owned").exists()
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()
    assert not _left_running()


def test_tests_reward_is_refused_in_one_line_where_the_sandbox_cannot_run(monkeypatch):
    """No bubblewrap (or namespaces refused): --reward tests is refused at start, naming why, instead of running
    the model's code unconfined."""
    import openflash.rl.sandbox as sandbox

    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    sandbox.check.cache_clear()
    try:
        with pytest.raises(OpenflashError, match="needs the reward sandbox: bubblewrap is not installed"):
            make_reward("tests")
    finally:
        sandbox.check.cache_clear()


def test_the_score_counts_only_the_harness_s_tokens():
    """A completion that passes one test of two and writes its own claims on the report scores 1/2."""
    code = ADD + "import os\nos.write(4, b'pass 0\\npass 1\\n')\n"
    assert Sandbox(timeout=5.0).run(code, ["assert add(1, 1) == 2", "assert add(1, 1) == 3"]).score == 0.5


def _left_running() -> list[str]:
    """This process's sandbox processes still running: below it, or orphaned to init (not another pytest worker's
    sandboxes, which may be running meanwhile)."""
    return [p for p in os.listdir("/proc") if p.isdigit() and _is_sandbox(p) and _ours_or_orphaned(int(p))]


def _ours_or_orphaned(pid: int) -> bool:
    """Whether `pid` descends from this process, or was orphaned to init (its parent is pid 1)."""
    for hop in range(64):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if parent == os.getpid() or (hop == 0 and parent == 1):
            return True
        if parent <= 1:
            return False
        pid = parent
    return False


def _is_sandbox(pid: str) -> bool:
    """A live (not zombie) sandbox harness process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"harness.py" not in f.read():
                return False
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


# ---- runs on tiny -------------------------------------------------------------------------------------------------
WORDS = ["cat", "dog", "sun", "tree", "book", "fish", "lamp", "rock", "milk", "door", "bird", "rain"]
# Trivially learnable: a completion that starts with a space (about a fifth of tiny's vocabulary does).
REWARD = "def space_first(task, completion):\n    return float(completion.startswith(' '))\n"


def _write_tasks(path, words):
    path.write_text("".join(json.dumps({"prompt": f"Say {w}:", "answer": w}) + "\n" for w in words))
    return path


def _config(tmp, out, **kw) -> RLConfig:
    (tmp / "space_reward.py").write_text(REWARD)
    base = dict(init="tiny", tasks=str(_write_tasks(tmp / "tasks.jsonl", WORDS[:8])),
                reward=f"{tmp / 'space_reward.py'}:space_first", out=str(tmp / out), lora=4, steps=2,
                prompts_per_step=4, group_size=8, max_tokens=2, lr=3e-2, progress=False)
    return RLConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A 10-step run through the CLI, with held-out tasks."""
    tmp = tmp_path_factory.mktemp("rl")
    cfg = _config(tmp, "run")
    held_out = _write_tasks(tmp / "held_out.jsonl", WORDS[8:])
    assert cli_main(["rl", "--init", "tiny", "--tasks", cfg.tasks, "--reward", cfg.reward, "--out", cfg.out,
                     "--lora", "4", "--steps", "10", "--prompts-per-step", "4", "--group-size", "8", "--max-tokens",
                     "2", "--lr", "3e-2", "--eval-tasks", str(held_out), "--save-every", "5"]) == 0
    lines = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return tmp, lines


def test_the_reward_rises_on_a_learnable_task(learned):
    tmp, lines = learned
    steps = [r for r in lines if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 11))
    first, rest = (sum(r["reward_mean"] for r in part) / len(part) for part in (steps[:3], steps[3:]))
    assert rest >= first + 0.1, [r["reward_mean"] for r in steps]
    for r in steps:  # the rollouts' log-probs are the training forward's (fp32 vs finetune numerics, one policy)
        assert r["sampler_logprob_gap"] < 1e-3 and r["trained_sequences"] + 8 * r["groups_empty"] <= 32
        assert r["rollout_tokens_per_s"] > 0 and r["completion_len"] <= 2
    evals = [r for r in lines if "eval_solved" in r]
    assert [r["step"] for r in evals] == [0, 10] and all(r["eval_tasks"] == 4 for r in evals)
    # held out (greedy): the policy's likeliest first token now starts with a space on prompts it never saw
    assert evals[1]["eval_solved"] >= 0.75 and evals[1]["eval_solved"] > evals[0]["eval_solved"], evals
    assert (tmp / "run" / "checkpoints" / "step_00000010" / "adapter_model.safetensors").is_file()
    # the same curves as TensorBoard events (read back with tensorboard's own reader)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp / "run" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("rl/reward_mean")] == \
        [(r["step"], round(r["reward_mean"], 4)) for r in steps]
    assert [e.step for e in events.Scalars("eval/eval_solved")] == [0, 10]
    assert {"rl/kl", "rl/entropy", "rl/lr", "rl/solved"} <= set(events.Tags()["scalars"])
    assert cli_main(["plot", str(tmp / "run")]) == 0 and (tmp / "run" / "reward.png").is_file()


def test_the_trained_adapter_serves_as_the_policy(learned):
    tmp, _ = learned
    adapter = read_adapter(adapter_folder(tmp / "run"))
    assert adapter.scaling == 2.0 and adapter.weights
    served = open_model("tiny")
    served.load_adapters({"rl": str(tmp / "run")})
    engine = LLMEngine(served, EngineConfig(max_batch=2, max_context=32, prefill_mode="exact"))
    prompt = served.tokenizer.encode("Say milk:").ids
    base, tuned = engine.generate([prompt, prompt], SamplingParams(max_tokens=2, logprobs=True),
                                  adapters=[None, "rl"])
    assert base.output_logprobs != tuned.output_logprobs
    # the same adapter put on the model as training does computes what the served bank computes
    cfg = _config(tmp, "probe", steps=1)
    trainer = RLTrainer(cfg)
    from openflash.train.finetune import load_adapter_weights
    load_adapter_weights(trainer.model, adapter, tmp / "run")
    trainer.model.eval()
    ids = torch.tensor([prompt + tuned.output_ids])
    with torch.no_grad():
        logits = trainer.runtime.forward(ids).logits
        want, _ = completion_logprobs(logits, ids, [len(prompt)], [2], 2)
        assert torch.allclose(torch.tensor([[t.logprob for t in tuned.output_logprobs]]), want, atol=2e-4)
        with adapters_off(trainer.model):
            base_logits = trainer.runtime.forward(ids).logits
    assert not torch.allclose(logits, base_logits)


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    straight = RLTrainer(_config(tmp_path, "straight"))
    straight.fit()

    def stop_after_first(trainer, record):
        trainer.request_stop()

    first = RLTrainer(_config(tmp_path, "resumed"), on_step=stop_after_first)
    assert first.fit()["step"] == 1
    with pytest.raises(OpenflashError, match="group_size"):
        RLTrainer(_config(tmp_path, "resumed", resume=True, group_size=4))
    second = RLTrainer(_config(tmp_path, "resumed", resume=True))
    assert second.step == 1 and second.fit()["step"] == 2
    a, b = (read_adapter(adapter_folder(tmp_path / name)) for name in ("straight", "resumed"))
    for name, (wa, wb) in a.weights.items():
        assert torch.allclose(wa, b.weights[name][0], atol=1e-6) and torch.allclose(wb, b.weights[name][1], atol=1e-6)
    lines = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "reward_mean" in r] == [1, 2]


def test_an_update_cut_into_forwards_or_recomputed_is_the_same_update(tmp_path):
    """An update accumulates gradients over a mini-batch's training forwards, so cutting it by --micro-batch-tokens
    (here one sequence a forward) or rerunning each block in the backward (--checkpoint-activations, the default)
    changes only the order of fp32 sums (relative ~1e-6 at these sizes), never the update."""
    records, forwards = {}, {}
    for name, kw in (("whole", dict(checkpoint_activations=False, micro_batch=32)),
                     ("cut", dict(micro_batch_tokens=1)), ("recomputed", dict(micro_batch=32))):
        trainer = RLTrainer(_config(tmp_path, name, steps=1, **kw))
        calls = []
        forward = trainer.runtime.forward
        trainer.runtime.forward = lambda ids, **k: calls.append(ids.shape[0]) or forward(ids, **k)
        records[name], forwards[name] = trainer.train_step(), calls
    trained = records["whole"]["trained_sequences"]
    assert trained > 2 and forwards["whole"] == [trained, trained] and forwards["cut"] == [1] * (2 * trained)
    for name in ("cut", "recomputed"):
        for key in ("policy_loss", "grad_norm", "entropy"):
            assert math.isclose(records[name][key], records["whole"][key], rel_tol=1e-4, abs_tol=1e-7), (name, key)


def test_rl_refuses_bad_arguments_by_flag(tmp_path):
    for kw, flag in ((dict(group_size=1), "--group-size"), (dict(clip_low=1.0), "--clip-low"),
                     (dict(overlong_buffer=2), "--overlong-buffer"), (dict(aggregation="mean"), "--aggregation"),
                     (dict(lr=float("nan")), "--lr"), (dict(lora_alpha=float("nan")), "--lora-alpha"),
                     (dict(lora_alpha=float("inf")), "--lora-alpha"), (dict(seed=2 ** 63), "--seed"),
                     (dict(group_size=1_000_000_000), "--group-size"),
                     (dict(prompts_per_step=10_000_000), "--prompts-per-step"),
                     (dict(max_prompt_tokens=0), "--max-prompt-tokens"),
                     (dict(micro_batch_tokens=0), "--micro-batch-tokens")):
        with pytest.raises(OpenflashError, match=flag):
            _config(tmp_path, "bad", **kw)
    with pytest.raises(OpenflashError, match="no 'tests' field"):
        RLTrainer(_config(tmp_path, "tests", reward="tests"))


def test_a_blown_up_update_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    """--lr 1e10: the adapter is garbage after the first update. The run stops with one line naming --lr at the
    step that diverged, not at the end with rc 0, and the checkpoint on disk is the last good one."""
    trainer = RLTrainer(_config(tmp_path, "blown", lr=1e10, steps=4, save_every=1))
    with pytest.raises(OpenflashError, match="lower --lr"):
        trainer.fit()
    assert trainer.step <= 2


def test_a_tool_that_hangs_exits_or_floods_answers_with_an_error_and_the_run_goes_on():
    import sys

    from openflash.chat.conversation import ToolCall
    from openflash.rl.environment import MAX_RESULT_CHARS, ToolEnvironment

    call = ToolCall("c1", "price", json.dumps({"item": "milk"}))
    cases = [(lambda c, t: time.sleep(30), "error: the tool did not answer in time", "took more than 0.5 s"),
             (lambda c, t: sys.exit(0), "error: SystemExit", "raised SystemExit"),
             (lambda c, t: "\ud800", "error: UnicodeEncodeError", "not text or JSON"),
             (lambda c, t: {1, 2}, "error: TypeError", "not text or JSON")]
    for function, result, problem in cases:
        start = time.monotonic()
        text, why = ToolEnvironment("m:f", function, timeout=0.5).answer(call, {})
        assert text.startswith(result) and problem in why and time.monotonic() - start < 5, (text, why)
    text, why = ToolEnvironment("m:f", lambda c, t: "x" * (20 << 20)).answer(call, {})
    assert len(text) < MAX_RESULT_CHARS + 100 and "cut" in text and "20,971,520 characters" in why
    text, why = ToolEnvironment("m:f", lambda c, t: {"price": 3}).answer(call, {"answer": "3"})
    assert text == '{"price": 3}' and why is None
