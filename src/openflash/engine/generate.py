"""Single-request generation with the incremental path (prefill, then decode steps), and `openflash generate`.

The serving engine (scheduler, batching, prefix cache) lives next to this file; this is the plain loop that the
demo and the CLI use, and the sequential baseline the engine's batched results are compared against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from openflash.engine.prompt import PromptIntake
from openflash.engine.sampling import NO_TOKEN, NonFiniteLogits, SamplerState, SamplingParams, find_stop, sample
from openflash.errors import OpenflashError
from openflash.runtime.runtime import Runtime
from openflash.vision.preprocess import ImageSource
from openflash.vision.prompt import EncodedImages, PromptImage, text_prompt


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" or "length"
    prefill_seconds: float
    decode_seconds: float

    @property
    def decode_tokens_per_second(self) -> float:
        steps = max(len(self.token_ids) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")


@torch.no_grad()
def generate(runtime: Runtime, prompt: str | list[int], params: SamplingParams, *, mode: str = "bounded",
             prefill_chunk: int = 512, images: Sequence[ImageSource] | Sequence[PromptImage] = (),
             adapter: str | None = None) -> GenerationResult:
    """Prefill the prompt in chunks, then decode until max_tokens, a stop token id or a stop string.

    images: with a text prompt, PIL images, paths or encoded bytes, placed at each `<image>` of the text (or before
    it); with a token-id prompt, its PromptImage spans (vision/prompt.py). adapter: a LoRA adapter the runtime
    serves (Runtime.load_adapters), or None for the base model."""
    params.validate()
    slots = [runtime.adapter_slot(adapter)]
    model, tokenizer = runtime.model, runtime.tokenizer
    intake = PromptIntake.of(model.cfg, tokenizer, max_context=None)
    if isinstance(prompt, str) and images:
        ids, placed = text_prompt(tokenizer, prompt, list(images), model.cfg)
        intake.check_ids(ids)
    else:
        ids, placed = intake.encode(prompt), list(images)
    intake.check_images(ids, placed)
    device = model.device
    cache = runtime.new_cache(1)
    state = SamplerState.create(params)
    start = time.perf_counter()
    logits = None
    encoded = EncodedImages(placed, model)
    for i in range(0, len(ids), prefill_chunk):
        chunk = torch.tensor([ids[i: i + prefill_chunk]], device=device)
        spans = encoded.window(i, i + chunk.shape[1], device)
        logits = runtime.step(chunk, cache, mode=mode, last_chunk=i + prefill_chunk >= len(ids), images=spans,
                              adapters=slots)
    prefill_s = time.perf_counter() - start
    out: list[int] = []
    finish, text = "length", ""
    start = time.perf_counter()
    while True:
        token = int(sample(logits, [state])[0])
        if token == NO_TOKEN:
            raise OpenflashError(f"{NonFiniteLogits()} (after {len(out)} generated tokens)")
        out.append(token)
        if token in params.stop_token_ids or token == model.cfg.eos_token_id:
            finish, text = "stop", tokenizer.decode(out[:-1])
            break
        text = tokenizer.decode(out)
        cut = find_stop(text, params.stop)
        if cut is not None:
            finish, text = "stop", text[:cut]
            break
        if len(out) >= params.max_tokens:
            break
        logits = runtime.decode(torch.tensor([token], device=device), cache, adapters=slots)
    decode_s = time.perf_counter() - start
    return GenerationResult(text, out, len(ids), finish, prefill_s, decode_s)
