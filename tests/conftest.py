"""Fixtures shared by the engine and server tests, and the intra-op thread count of parallel test workers."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch

from openflash.checkpoint import open_model


def pytest_configure(config) -> None:
    """Under pytest-xdist (`make test`: a worker per core), each worker gets its share of the cores for torch's
    intra-op threads: OpenMP threads of several processes spinning on the same cores slow every one of them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model is bound by per-op overhead; one intra-op thread is as fast and does not collapse when the
    machine is shared (OpenMP threads spinning against other processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_runtime():
    """The tiny preset with random weights and no quantization: its Runtime (model, tokenizer, Engram memory)."""
    return open_model("tiny", numerics="plain")


def wait_for_health(url: str, proc: subprocess.Popen, seconds: float) -> None:
    """Until `url`/health answers 200 (a server started as `proc`); fails if proc exits or time runs out."""
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, f"the server at {url} did not come up"
        time.sleep(0.2)
