"""EleutherAI's lm-evaluation-harness with openflash's engine as the model, in-process (`openflash eval`), as vLLM
offers it (`lm_eval --model vllm`): no server.

Every request kind lm-eval has:
- `loglikelihood` (multiple choice): context and continuation tokenized as lm-eval tokenizes them (trailing blanks
  moved to the continuation, the continuation the whole text's tokens after the context's), scored by the engine's
  prompt log-probs (`SamplingParams.prompt_logprobs`: one exact prefill call per scored sequence, the teacher-forced
  forward), all requests in the engine's batches. The same numbers `openflash serve` returns with `echo` and
  `logprobs` for the same model (tests/test_evaluation.py, tests/test_server_logprobs.py).
- `loglikelihood_rolling` (perplexity): lm-eval's disjoint rolling windows of `max_length`, each scored alike.
- `generate_until`: the engine's batched generation with the task's stop strings, greedy unless the task samples.
Tokens are the model's tokenizer's without special tokens, as lm-eval's remote tokenizer sends them; an empty context
is the BOS token. With `apply_chat_template`, prompts are rendered by the model's chat format (chat/).
"""

from __future__ import annotations

from typing import Any, Sequence

from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from openflash.chat.conversation import ChatOptions, Turn
from openflash.engine.engine import LLMEngine
from openflash.engine.sampling import SamplingParams
from openflash.errors import OpenflashError


class EngineLM(LM):
    """lm-eval's model interface over an `LLMEngine` (its runtime, tokenizer and served adapters)."""

    def __init__(self, engine: LLMEngine, max_length: int, adapter: str | None = None,
                 chat_format: Any = None, max_gen_toks: int = 256) -> None:
        super().__init__()
        if max_length < 2 or max_length + 1 >= engine.config.max_context:
            raise OpenflashError(f"max_length {max_length} must be at least 2 and below the engine's max_context "
                                 f"{engine.config.max_context} minus 1 (a scored window holds max_length + 1 tokens)")
        self.engine, self.adapter, self.max_length = engine, adapter, max_length
        self.tokenizer, self.chat_format, self.max_gen_toks = engine.tokenizer, chat_format, max_gen_toks
        self.bos = engine.cfg.bos_token_id

    # ---- tokens --------------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split of a (context, continuation): blanks that end the context start the continuation, and
        the continuation is the whole text's tokens after the context's (a causal model's view)."""
        blanks = len(context) - len(context.rstrip())
        if blanks:
            context, continuation = context[:-blanks], context[-blanks:] + continuation
        if not context:
            return [self.bos], self.encode(continuation)
        ctx = self.encode(context)
        return ctx, self.encode(context + continuation)[len(ctx):]

    # ---- scoring -------------------------------------------------------------------------------------------------
    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p, whether every token is the likeliest) of each continuation after its context; a sequence
        longer than max_length + 1 keeps its last max_length + 1 tokens (max_length predicted positions, as
        lm-eval's windows count them)."""
        prompts, lengths = [], []
        for ctx, cont in pairs:
            if not cont:
                raise OpenflashError("lm-eval asked to score an empty continuation")
            ids = (ctx + cont)[-(self.max_length + 1):]
            prompts.append(ids)
            lengths.append(min(len(cont), len(ids) - 1))
        params = SamplingParams(max_tokens=0, prompt_logprobs=1)
        seqs = self.engine.generate(prompts, params, adapters=[self.adapter] * len(prompts))
        out = []
        for seq, n in zip(seqs, lengths):
            if seq.error is not None:
                raise OpenflashError(f"scoring request {seq.request_id} failed: {seq.error}")
            records = seq.prompt_logprobs[-n:]
            out.append((sum(r.logprob for r in records), all(r.top[0][0] == r.token for r in records)))
        return out

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self.score([self.pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, r in enumerate(requests):
            for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.encode(r.args[0]), prefix_token=self.bos, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((ctx, pred))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self.score(windows)):
            totals[i] += logprob
        return totals

    # ---- generation ----------------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for r in requests:
            context, kwargs = r.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0))
            ids = (self.encode(context) if context else [self.bos])[-(self.max_length - 1):]
            prompts.append(ids)
            params.append(SamplingParams(temperature=temperature if sample else 0.0, max_tokens=max(1, min(
                max_gen, self.max_length - len(ids))), stop=tuple(s for s in until if s), seed=kwargs.pop("seed", 0)))
        seqs = self.engine.generate(prompts, params, adapters=[self.adapter] * len(prompts))
        for seq in seqs:
            if seq.error is not None:
                raise OpenflashError(f"generation request {seq.request_id} failed: {seq.error}")
        return [seq.text for seq in seqs]

    # ---- chat ----------------------------------------------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return f"openflash-{getattr(self.chat_format, 'name', 'none')}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer_name if self.chat_format is not None else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.chat_format is None:
            raise OpenflashError("this evaluation has no chat format; run it without --apply-chat-template")
        if not add_generation_prompt:
            raise OpenflashError("the chat format renders a conversation for its answer; lm-eval asked to prefill "
                                 "an assistant message, which it does not render")
        turns = [Turn("system" if m["role"] == "developer" else m["role"], (m["content"],)) for m in chat_history]
        return self.chat_format.render(turns, ChatOptions())


__all__ = ["EngineLM"]
