"""Fixtures shared by the engine and server tests, the intra-op thread count of parallel test workers, and the
test tiers: the modules in SLOW compile with inductor, train, run a released-width layer or spawn processes;
`pytest -n 2 -m "not slow"` runs the rest (the model, engine, server and file-format basics) in about 1.5
minutes, and `make test` runs everything."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch

# Triton's kernels (kernels/triton_products.py) run in its interpreter on CPU tensors where there is no GPU: the
# switch is read when Triton is imported, which the openflash imports below do.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from openflash.runtime.open import open_model  # noqa: E402 (after the switch above)


# Heaviest first (cold-cache seconds in `make test`, docs/benchmarks.md): pytest-xdist's loadfile hands whole files
# to the workers in collection order, so the long ones start first and no worker is left alone with one at the end.
SLOW = ("test_compiled", "test_experiments", "test_train_distributed", "test_trainer", "test_decode_graph",
        "test_synth", "test_expert_offload", "test_placement_plan", "test_dspark_train", "test_lora_run",
        "test_server_chat", "test_engram_placement", "test_demo", "test_parity", "test_speculative",
        "test_vision_train", "test_lora_hostile", "test_checkpoint_compat", "test_weight_residency", "test_chats")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOW)}
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in rank:
            item.add_marker(pytest.mark.slow)
    # (a stable sort: each file's tests stay together and in order)
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(SLOW)))


def pytest_configure(config) -> None:
    """Under pytest-xdist (`make test`: a worker per core), each worker gets its share of the cores for torch's
    intra-op threads: OpenMP threads of several processes spinning on the same cores slow every one of them. So do
    the processes a test starts (servers, training runs, torchrun workers): they inherit the share through
    OMP_NUM_THREADS, set here rather than by whoever types `make test`. For the same reason inductor compiles in
    each worker's own process (no pool of compile processes per worker)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)
        import torch._inductor.config as inductor

        inductor.compile_threads = share


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


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal fp32 tensors bit for bit (where the code guarantees it: rows copied or decoded, never summed)."""
    return a.dtype == b.dtype == torch.float32 and a.shape == b.shape and torch.equal(a.view(torch.int32),
                                                                                       b.view(torch.int32))


def random_ids(shape: tuple[int, ...], rows: int, seed: int = 1) -> torch.Tensor:
    """Row ids of a table of `rows` rows, with plenty of repeats (every third the first)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, shape, generator=g, dtype=torch.int64)
    ids.view(-1)[::3] = ids.view(-1)[0]
    return ids
