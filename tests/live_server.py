"""Driving the OpenAI-compatible server live in tests: uvicorn on a free port (`LiveServer`), the `stack` fixture (the
tiny preset, random weights, "plain" numerics for exact equality, with a 1024-token BPE tokenizer trained on a few
stdlib files so that text prompts and chat messages map to ids the model has), an app over it (`make_app`), and
the checks the server tests share."""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from openflash.chat import chat_format
from openflash.config import load_config
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.generate import generate
from openflash.engine.sampling import SamplingParams
from openflash.memory.tokenmap import build_compressed_token_map
from openflash.model.numerics import NUMERICS
from openflash.model.transformer import Transformer
from openflash.runtime.runtime import Runtime
from openflash.serve.app import ServerConfig, build_app
from openflash.train.tokenizer import stdlib_source_dir, train_bpe_tokenizer

CORPUS = ("textwrap.py", "string.py", "glob.py", "fnmatch.py", "shlex.py", "bisect.py")
MAX_CONTEXT = 256
NAME = "tiny-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn on a free port in a background thread."""

    def __init__(self, app, graceful: float = 5.0) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=graceful))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    old_cache = os.environ.get("OPENFLASH_CACHE")
    os.environ["OPENFLASH_CACHE"] = str(tmp / "cache")  # token maps are cached there, not in ~/.cache
    try:
        tok = train_bpe_tokenizer([stdlib_source_dir() / f for f in CORPUS], 1024, tmp / "tokenizer.json")
        vocab = tok.get_vocab_size(with_added_tokens=True)
        token_map = build_compressed_token_map(tok, vocab)
        cfg = load_config("tiny").replace(vocab_size=vocab, engram_compressed_vocab_size=int(token_map.max()) + 1,
                                          image_token_id=None)
        torch.manual_seed(0)
        model = Transformer(cfg)  # the engine addresses its Engram tables through `tok`'s token map
        model.set_numerics(NUMERICS["plain"]).eval()
        yield Runtime.of(model, tok)
    finally:
        if old_cache is None:
            os.environ.pop("OPENFLASH_CACHE", None)
        else:
            os.environ["OPENFLASH_CACHE"] = old_cache


def make_app(rt, server_kw=None, **engine_kw):
    config = dict(max_batch=32, max_context=MAX_CONTEXT, prefill_chunk=32, max_step_tokens=256)
    engine = LLMEngine(rt, EngineConfig(**{**config, **engine_kw}))
    fmt = chat_format(rt.tokenizer, rt.cfg.bos_token_id, rt.cfg.eos_token_id)
    return engine, build_app(engine, rt.tokenizer, ServerConfig(NAME, fmt, drain_timeout=2.0, **(server_kw or {})))


def idle(engine: LLMEngine, timeout: float = 30.0) -> bool:
    """Wait until nothing runs and the only KV blocks in use are the prefix cache's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = len(engine.prefix_cache.block_refs) if engine.prefix_cache is not None else 0
        if not engine.has_work() and engine.runner.batch is None and engine.factory.pool.blocks_in_use == held:
            return True
        time.sleep(0.02)
    return False


def reference(rt, prompt, max_tokens: int) -> str:
    return generate(rt, prompt, SamplingParams(max_tokens=max_tokens)).text


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]
