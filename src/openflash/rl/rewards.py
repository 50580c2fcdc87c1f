"""Rewards: a completion scored against its task, in [0, 1] for the built-in ones.

- `exact`: the final answer equals the task's "answer" (both stripped). The answer is the completion's text, or in a
  chat task the reply's answer part (after the reasoning, without tool calls); with `--answer-pattern REGEX` the
  last match in it (group 1 where the pattern has a group).
- `tests`: the task's "tests" (Python source, or a list of sources each counted apart) run against the completion's
  code (its last ```python block, else the whole answer) in the sandbox (rl/sandbox.py); the share that passes.
- `MODULE:FUNCTION`: a user's function `f(task_fields: dict, completion: str) -> float`, imported once.

A reward that raises, exits, runs past `--reward-timeout` or returns something that is not a finite number scores 0,
and the problem is logged; it never stops training.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from openflash.chat.completion import parse_completion
from openflash.chat.conversation import Content
from openflash.errors import OpenflashError
from openflash.rl.sandbox import Sandbox, require
from openflash.rl.tasks import Task
from openflash.rl.user_code import call_limited, import_function

CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class Score:
    value: float
    problem: str | None = None  # why a sample scored 0 against its will (the reward raised, the sandbox killed it)


class Reward(Protocol):
    """Scores one completion of a task."""

    needs: str | None  # the task field it reads ("answer", "tests"), checked when tasks are read

    def __call__(self, task: Task, completion: str) -> Score: ...


def answer_text(task: Task, completion: str) -> str:
    """What the model answered: a chat reply's answer part, else the completion's text."""
    if not task.chat:
        return completion
    return "".join(p.text for p in parse_completion(completion, task.thinking) if isinstance(p, Content))


@dataclass
class ExactAnswer:
    pattern: re.Pattern[str] | None = None
    needs: str | None = "answer"

    def extract(self, task: Task, completion: str) -> str | None:
        text = answer_text(task, completion)
        if self.pattern is None:
            return text.strip()
        matches = list(self.pattern.finditer(text))
        if not matches:
            return None
        last = matches[-1]
        return (last.group(1) if self.pattern.groups else last.group(0)).strip()

    def __call__(self, task: Task, completion: str) -> Score:
        got = self.extract(task, completion)
        return Score(float(got is not None and got == str(task.fields["answer"]).strip()))


@dataclass
class UnitTests:
    sandbox: Sandbox
    needs: str | None = "tests"

    def __call__(self, task: Task, completion: str) -> Score:
        tests = task.fields["tests"]
        tests = [tests] if isinstance(tests, str) else tests
        if not (isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests)):
            return Score(0.0, f"{task.where}: 'tests' must be Python source or a non-empty list of sources")
        text = answer_text(task, completion)
        blocks = CODE_BLOCK.findall(text)
        outcome = self.sandbox.run(blocks[-1] if blocks else text, tests)
        return Score(outcome.score, outcome.problem)


@dataclass
class UserReward:
    name: str
    function: Callable[[dict[str, Any], str], Any]
    timeout: float = 5.0  # seconds a call may take (--reward-timeout)
    needs: str | None = None

    def __call__(self, task: Task, completion: str) -> Score:
        # A call that hangs scores 0 after the timeout, one that calls sys.exit ends its thread, not the run.
        outcome = call_limited(self.function, (dict(task.fields), completion), self.timeout, f"reward {self.name}")
        if outcome.timed_out:
            return Score(0.0, f"{self.name} took more than {self.timeout:g} s (--reward-timeout)")
        if outcome.error is not None:
            exc = outcome.error
            return Score(0.0, f"{self.name} raised {type(exc).__name__}: {exc}")
        value = outcome.value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return Score(0.0, f"{self.name} returned {value!r}, not a finite number")
        return Score(float(value))


def make_reward(spec: str, answer_pattern: str | None = None, timeout: float = 5.0,
                memory: int = 512 << 20) -> Reward:
    """The reward `--reward` names: "exact", "tests" or "MODULE:FUNCTION" (the module importable, or a .py file)."""
    if spec == "exact":
        try:
            return ExactAnswer(re.compile(answer_pattern) if answer_pattern else None)
        except re.error as exc:
            raise OpenflashError(f"--answer-pattern {answer_pattern!r}: not a regular expression ({exc})") from None
    if answer_pattern is not None:
        raise OpenflashError("--answer-pattern goes with --reward exact")
    if spec == "tests":
        require()  # refused at start, in one line, where the kernel cannot isolate the tested code
        return UnitTests(Sandbox(timeout, memory))
    if ":" not in spec:
        raise OpenflashError(f"--reward must be exact, tests or MODULE:FUNCTION, got {spec!r}")
    return UserReward(spec, import_function(spec, "--reward"), timeout)
