"""Fixtures shared by the engine and server tests."""

from __future__ import annotations

import pytest
import torch

from openflash.checkpoint import open_model


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model is bound by per-op overhead; one intra-op thread is as fast and does not collapse when the
    machine is shared (OpenMP threads spinning against other processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_engine_model():
    """The tiny preset with random weights and no quantization, with its tokenizer: (model, tokenizer)."""
    model, tok, _ = open_model("tiny", numerics="plain")
    return model, tok
