"""The device as a placement (runtime/placement.py): --device on the commands, one Placement value from flags or plan.json,
Engram tables off the accelerator by default; the CUDA graph recording's bookkeeping (runtime/cuda_graph.py). The
tests marked `cuda` need a GPU and skip without one (benchmarks/gpu.py runs the same checks and times them)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from openflash.cli import main as cli_main
from openflash.engine.generate import generate
from openflash.engine.sampling import SamplingParams
from openflash.errors import OpenflashError
from openflash.runtime.cuda_graph import Binding, NotRecordable, bindings
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement, resolve_device

pytestmark = pytest.mark.usefixtures("one_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu.py runs it there)")


def test_devices_resolve_or_are_refused_in_one_line(capsys):
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(OpenflashError, match=r"--device cuda: no CUDA device is visible here"):
            resolve_device("cuda")
        for command in (["generate", "--model", "tiny", "--prompt", "x", "--device", "cuda:0"],
                        ["train", "--dspark", "--init", "tiny", "--out", "unwritten", "--device", "cuda"],
                        ["train", "--vision-data", "pairs.jsonl", "--init", "tiny-vl", "--out", "unwritten",
                         "--device", "cuda"]):
            assert cli_main(command) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and "no CUDA device" in err, (command, err)
    with pytest.raises(OpenflashError, match=r"--device 'gpu0': not a device"):
        resolve_device("gpu0")
    with pytest.raises(OpenflashError, match="openflash runs on the CPU or on CUDA"):
        resolve_device("meta")


def test_one_placement_from_the_flags_or_a_plan(tmp_path):
    args = argparse.Namespace(device="cpu", weights="stored", expert_placement="host", expert_cache_bytes=7,
                              expert_prefetch=False, expert_direct_io=False, engram_placement="disk",
                              engram_table_dir=None, engram_cache_bytes=0, engram_io_threads=2, compile=False,
                              placement=None)
    placement = Placement.from_args(args)
    assert (placement.device, placement.weights, placement.experts, placement.engram) == ("cpu", "stored", "host",
                                                                                          "disk")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"run": {"weights": "stored", "expert_placement": "disk", "expert_cache_bytes": 5,
                                        "engram_placement": "host", "engram_cache_bytes": 0}}))
    with pytest.raises(OpenflashError, match=r"--placement .* sets --weights, --expert-placement"):
        Placement.from_args(argparse.Namespace(**{**vars(args), "placement": str(plan)}))
    defaults = argparse.Namespace(**{**vars(args), "weights": "auto", "expert_placement": "device",
                                     "expert_cache_bytes": 0, "engram_placement": "auto", "placement": str(plan)})
    planned = Placement.from_args(defaults)
    assert (planned.experts, planned.expert_cache_bytes, planned.engram) == ("disk", 5, "host")
    with pytest.raises(OpenflashError, match="Engram placement must be one of"):
        Placement(engram="hbm")


def test_engram_auto_is_the_model_memory_on_the_cpu_and_host_next_to_a_gpu():
    on_cpu = Placement(device="cpu")
    assert on_cpu.engram_tier(fp8_tables=True) == "device"
    assert Placement(device="cpu", engram="host").engram_tier(fp8_tables=False) == "host"
    if torch.cuda.is_available():
        assert Placement(device="cuda").engram_tier(fp8_tables=True) == "host"
        assert Placement(device="cuda").engram_tier(fp8_tables=False) == "device"


def test_generate_on_the_cpu_through_the_device_flag(capsys):
    assert cli_main(["generate", "--model", "tiny", "--prompt", "def f", "--max-tokens", "3", "--device", "cpu",
                     "--engram-placement", "host"]) == 0
    assert "3 generated" in capsys.readouterr().out


def test_a_checkpoint_on_the_host_tier_never_loads_its_tables_into_the_model(tmp_path):
    """With the Engram tier off the device, the checkpoint's tables are read by the host tier straight from the
    files (the model's own tables stay unread, on the meta device): what keeps them out of a GPU's memory."""
    from openflash.checkpoint import build_model, save_checkpoint
    from openflash.config import load_config
    from openflash.tokenizer import preset_tokenizer

    cfg = load_config("tiny")
    preset_tokenizer(cfg).save(str(tmp_path / "tok.json"))
    torch.manual_seed(0)
    save_checkpoint(build_model(cfg), tmp_path / "ckpt", tokenizer_json=tmp_path / "tok.json", dtype="fp8")
    hosted = open_model(str(tmp_path / "ckpt"), placement=Placement(device="cpu", engram="host"))
    own = open_model(str(tmp_path / "ckpt"), placement=Placement(device="cpu", engram="device"))
    assert hosted.memory.placement == "host"
    assert all(t.weight.device.type == "meta" for t in hosted.model.engram_tables().values())
    params = SamplingParams(max_tokens=6)
    assert generate(hosted, "def fib(n):", params).token_ids == generate(own, "def fib(n):", params).token_ids


@dataclass
class _Store:
    kv: torch.Tensor
    length: torch.Tensor


@dataclass
class _Cache:
    pos: torch.Tensor
    stores: dict
    engram: object = None


def test_bindings_find_every_tensor_and_container_of_a_cache_and_undo_rebinds():
    """What a CUDA graph recording checks and restores: every tensor reachable from the cache with its holder,
    containers included (a replaced store is seen), the skipped attributes left out."""
    cache = _Cache(torch.zeros(2), {3: _Store(torch.zeros(2, 4), torch.zeros(2))}, engram=torch.ones(1))
    found = bindings(cache, skip=("engram",))
    tensors = {id(b.value) for b in found if isinstance(b.value, torch.Tensor)}
    assert tensors == {id(cache.pos), id(cache.stores[3].kv), id(cache.stores[3].length)}
    assert any(b.value is cache.stores for b in found) and any(b.value is cache.stores[3] for b in found)
    pos = next(b for b in found if b.key == "pos")
    cache.pos = cache.pos + 1  # a step's rebinding, undone as a failed recording does
    assert pos.current() is not pos.value
    pos.bind(pos.value)
    assert cache.pos is pos.value
    dict_binding = Binding(cache.stores, 3, cache.stores[3])
    cache.stores[3] = _Store(torch.zeros(2, 8), torch.zeros(2))  # a store grown into a new one: seen
    assert dict_binding.current() is not dict_binding.value
    with pytest.raises(NotRecordable, match="tuple of tensors"):
        bindings(_Cache(torch.zeros(1), {0: (torch.zeros(1),)}))


def test_a_recording_moves_to_a_cache_of_the_same_shapes_and_both_keep_their_state():
    """`take_over`: the engine's batch regrouped at the same padded size is a new cache of the same structure; it
    takes the recorded tensors over (its values copied in), the old cache keeps copies of its own state, the block
    pool stays shared, and both step on exactly as before. Another structure is refused."""
    from openflash.engine.cache import CacheFactory
    from openflash.model.numerics import NUMERICS
    from openflash.runtime.cuda_graph import take_over
    from openflash.runtime.decode_graph import DecodeGraph

    rt = open_model("tiny", numerics="plain")
    factory = CacheFactory.create(rt.model.cfg, block_size=4)
    old, new = factory.empty(2), factory.empty(2)
    g = torch.Generator().manual_seed(0)
    rt.step(torch.randint(3, 900, (2, 19), generator=g), old)
    rt.step(torch.randint(3, 900, (2, 23), generator=g), new)
    graph = DecodeGraph(rt.model)
    for cache in (old, new):
        graph.prepare(cache, None)  # what a decode step does first: both at the same capacity bucket
    recorded = bindings(old, skip=("engram",))
    tensors = lambda layout: [b.value for b in layout if isinstance(b.value, torch.Tensor)]  # noqa: E731
    old_values = [t.clone() for t in tensors(recorded)]
    new_values = [t.clone() for t in tensors(bindings(new, skip=("engram",)))]
    assert take_over(recorded, bindings(factory.empty(3), skip=("engram",))) is None
    moved = take_over(recorded, bindings(new, skip=("engram",)))
    assert moved is not None
    now_new, now_old = tensors(bindings(new, skip=("engram",))), tensors(bindings(old, skip=("engram",)))
    assert all(a is b for a, b in zip(now_new, tensors(recorded)))  # new holds the recorded tensors
    assert all(torch.equal(a, b) for a, b in zip(now_new, new_values))  # with its own values
    assert all(torch.equal(a, b) for a, b in zip(now_old, old_values))  # old kept its values
    shared = [a is b for a, b in zip(now_new, now_old)]
    assert any(shared) and all(a is b for a, b, same in zip(now_new, now_old, shared) if same)  # the pool
    assert all(not a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
               for a, b, same in zip(now_new, now_old, shared) if not same)
    rt.model.set_numerics(NUMERICS["plain"])
    ids = torch.randint(3, 900, (2, 1), generator=g)
    for cache in (old, new):
        twin = cache.select([0, 1])  # a copy of the same state through another road
        assert torch.equal(rt.decode(ids, cache), rt.decode(ids, twin))


class _HostRecorder:
    """Stands in for CUDA graphs on the CPU: recording runs nothing (as a capture runs no kernel); each replay runs
    the recorded body again (the step on the recording's input buffers, then the copies back into the tensors the
    cache held) and writes its output where the first went."""

    def record(self, body, device):
        out = torch.empty(0)

        def replay() -> None:
            result = body()
            out.resize_(result.shape).copy_(result)

        return replay, out


def test_the_engine_replays_recordings_across_regroups_and_padded_batches(monkeypatch):
    """The engine's decode steps through CudaGraphStep on the CPU (the step traced by dynamo on its eager backend,
    recorded by a stand-in for CUDA graphs): requests joining and finishing at different steps are served from
    replays, a regrouped batch of a recorded size takes the recording over, and the tokens are those of the same
    steps run without recordings."""
    from openflash.engine.engine import EngineConfig, LLMEngine
    from openflash.runtime import decode_graph
    from openflash.runtime.decode_graph import DecodeGraph

    monkeypatch.setattr(decode_graph, "BACKEND", "eager")
    rt = open_model("tiny", numerics="plain")
    graph = DecodeGraph(rt.model, recorder=_HostRecorder())
    monkeypatch.setattr(rt, "_graph", lambda: graph)  # decode steps through the graph, as on a compiled model
    prompts = [list(range(5 + i, 30 + 3 * i)) for i in range(7)]
    params = [SamplingParams(max_tokens=4 + 3 * (i % 3)) for i in range(7)]
    config = EngineConfig(max_batch=4, prefix_cache=False, decode_buckets=(4,))  # one size: one dynamo graph
    replayed = [s.output_ids for s in LLMEngine(rt, config).generate(prompts, params, ignore_eos=True)]
    stats = graph.stats()
    assert stats["cuda_graphs_off"] is None and stats["cuda_graphs_taken_over"] > 0, stats
    assert stats["cuda_graph_replays"] > stats["steps"] // 2, stats
    graph._replayed = None
    assert [s.output_ids for s in LLMEngine(rt, config).generate(prompts, params, ignore_eos=True)] == replayed


# ---- on a GPU ------------------------------------------------------------------------------------------------

@cuda
def test_cuda_graph_replay_equals_the_compiled_step():
    """The same compiled decode graph, replayed from CUDA graph recordings and run as compiled code: the same
    kernels, so the same logits step by step (teacher-forced), while the cache advances alike."""
    rt = open_model("tiny", numerics="fp32", placement=Placement(device="cuda", compile=True))
    prompt, tokens = list(range(5, 40)), list(range(50, 70))

    def forced() -> list[torch.Tensor]:
        cache = rt.new_cache(1)
        out = [rt.step(torch.tensor([prompt]), cache).cpu()]
        out += [rt.decode(torch.tensor([t]), cache).cpu() for t in tokens]
        return out

    replayed = forced()
    graph = next(iter(rt.graphs.values()))
    stats = graph.stats()
    assert stats["cuda_graphs_recorded"] >= 1 and stats["cuda_graph_replays"] >= len(tokens) - 3
    graph._replayed = None
    for a, b in zip(replayed, forced()):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), float((a - b).abs().max())


@cuda
def test_the_engine_replays_its_decode_graphs_across_regroups():
    """On CUDA the engine pads its decode batches (1, 2, 4 here) and a regrouped batch takes the recording of its
    size over: requests that join and finish at different steps are served from replays, with the tokens of the
    same compiled steps run without recordings."""
    from dataclasses import replace

    from openflash.engine.engine import EngineConfig, LLMEngine

    rt = open_model("tiny", numerics="fp32", placement=Placement(device="cuda", compile=True))
    prompts = [list(range(5 + i, 30 + 3 * i)) for i in range(7)]
    params = [SamplingParams(max_tokens=4 + 3 * (i % 3)) for i in range(7)]
    config = EngineConfig(max_batch=4, prefix_cache=False)
    engine = LLMEngine(rt, config)
    assert engine.runner.decode_buckets == (1, 2, 4)
    graphed = [s.output_ids for s in engine.generate(prompts, params, ignore_eos=True)]
    graph = next(iter(rt.graphs.values()))
    stats = graph.stats()
    assert stats["cuda_graphs_off"] is None and stats["cuda_graph_replays"] > 0, stats
    assert stats["cuda_graphs_taken_over"] > 0, stats
    graph._replayed = None
    unrecorded = LLMEngine(rt, replace(config, decode_buckets=(1, 2, 4)))
    assert [s.output_ids for s in unrecorded.generate(prompts, params, ignore_eos=True)] == graphed


@cuda
@pytest.mark.parametrize("storage", ["fp32", "packed"])
def test_the_cache_kernels_on_cuda_give_the_logits_of_the_caches_read_out(storage, monkeypatch):
    """On CUDA the index keys, picked entries and window rings are read in place by the Triton kernels
    (kernels.cache_kernel): a prefill chunk and decode steps give the logits of the same steps with them read out."""
    from openflash import kernels
    from openflash.engine.cache import CacheFactory

    rt = open_model("tiny", numerics="fp32", placement=Placement(device="cuda"))
    assert kernels.cache_kernel(rt.model.device) == "triton"
    cache = CacheFactory.create(rt.cfg, storage, 4, device=rt.model.device).empty(2)
    ids = torch.randint(3, 900, (2, 45), generator=torch.Generator().manual_seed(8))
    rt.step(ids, cache)
    twin = cache.select([0, 1])
    chunk, tokens = ids[:, :6], torch.tensor([5, 6])
    got = [rt.step(chunk, cache), rt.decode(tokens, cache), rt.decode(tokens, cache)]
    monkeypatch.setattr(kernels, "cache_kernel", lambda device: None)
    want = [rt.step(chunk, twin), rt.decode(tokens, twin), rt.decode(tokens, twin)]
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-4)


@cuda
@pytest.mark.parametrize("numerics", ["fp32", "reference"])
@pytest.mark.parametrize("weights", ["dequantized", "stored"])
def test_parity_on_cuda(numerics, weights):
    from openflash.tools.parity import run_golden

    for golden in ("tests/goldens/A", "tests/goldens/A2", "tests/goldens/B2", "tests/goldens/D"):
        failed = [c.key for c in run_golden(golden, numerics, weights=weights, device="cuda") if not c.passed]
        assert not failed, (golden, failed[:5])


class _HostCopies(TorchDispatchMode):
    """Counts operations that mix CPU tensors into work on the meta device (a stand-in for a GPU): on CUDA each is
    a host-to-device copy, which a CUDA graph cannot record."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {a.device.type for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)}
        target = kwargs.get("device")
        if "cpu" in devices and ("meta" in devices or (target is not None and torch.device(target).type == "meta")):
            self.seen.append(str(func))
        return func(*args, **kwargs)


def test_a_decode_step_copies_nothing_from_the_host_once_warm():
    """The whole-step decode graph's body on the meta device: after a first step (which copies the constant tables
    each device keeps, as a prefill does), a step reads no CPU tensor, so on a GPU it can be recorded as a CUDA
    graph. RoPE frequencies and the E2M1 tables were copied on every call before (the H200 run's failure)."""
    from openflash.checkpoint import build_model
    from openflash.config import load_config
    from openflash.model.numerics import NUMERICS
    from openflash.runtime.decode_graph import FetchedRows

    cfg = load_config("tiny")
    model = build_model(cfg, NUMERICS["fp32"], device="meta")
    cache = model.new_cache(1, capacity=64)
    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
    rows = FetchedRows({t.engram_slot: torch.zeros(1, 1, cfg.n_hash_columns, cfg.engram_head_dim, device="meta")
                        for t in cfg.topology.layers if t.engram_before})
    with torch.no_grad():
        model.static_decode(ids, cache, rows)
        watch = _HostCopies()
        with watch:
            model.static_decode(ids, cache, rows)
    assert watch.seen == []


def test_a_decode_step_on_the_engines_paged_cache_copies_nothing_from_the_host():
    """The same on the serving engine's cache: its block tables live on the host (allocation reads them there), and
    the step indexes the pool with their copy on the device, brought up to date before the step (`reserve`), not in
    it. Before, each step copied every table to the device, so the engine's decode could never be recorded."""
    from openflash.checkpoint import build_model
    from openflash.config import load_config
    from openflash.engine.cache import CacheFactory
    from openflash.model.numerics import NUMERICS
    from openflash.runtime.decode_graph import CAPACITY_TOKENS, FetchedRows

    cfg = load_config("tiny")
    model = build_model(cfg, NUMERICS["fp32"], device="meta")
    cache = CacheFactory.create(cfg, device="meta").empty(2)
    ids = torch.zeros(2, 1, dtype=torch.long, device="meta")
    rows = FetchedRows({t.engram_slot: torch.zeros(2, 1, cfg.n_hash_columns, cfg.engram_head_dim, device="meta")
                        for t in cfg.topology.layers if t.engram_before})

    def reserve() -> None:  # DecodeGraph.prepare's, which reads the largest position (a meta tensor has none)
        for store in cache.compressed.values():
            ratio = store.partial_kv.shape[1]
            store.reserve(-(-CAPACITY_TOKENS // ratio), torch.zeros(2, dtype=torch.long))

    with torch.no_grad():
        reserve()
        model.static_decode(ids, cache, rows)
        unchanged = _HostCopies()
        with unchanged:  # the same blocks as before: the device copy of the table is not sent again
            reserve()
        assert unchanged.seen == []
        watch = _HostCopies()
        with watch:
            model.static_decode(ids, cache, rows)
    assert watch.seen == []
