"""Routed experts off the model: host RAM or the checkpoint's own shards on disk, behind a byte-budgeted cache
(memory/experts.py). Outputs are bit-identical to the model's own experts."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import wait_for_health

from openflash.checkpoint import load_checkpoint
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.sampling import SamplingParams
from openflash.errors import CheckpointError, OpenflashError
from openflash.memory.experts import ExpertStore
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.runtime.runtime import Runtime
from openflash.serve.metrics import render
from openflash.tools.synth import synthesize


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("experts") / "ckpt"
    synthesize("tiny", folder, shard_bytes=1 << 20)  # several shards: experts are read from whichever holds them
    return folder


def _run(model, report, store=None) -> list[torch.Tensor]:
    rt = Runtime.of(model, report.tokenizer, frontend=report.engram_frontend, experts=store)
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (2, 40))
    cache = rt.new_cache(2)
    out = [rt.step(ids, cache)]
    for _ in range(4):
        out.append(rt.decode(out[-1].argmax(-1), cache))
    return out


@pytest.mark.parametrize("placement,cache_bytes,prefetch", [("host", 0, True), ("disk", 0, True), ("disk", 1, True),
                                                             ("disk", 1, False), ("disk", 600_000, True)])
def test_experts_from_host_or_disk_give_bit_identical_logits(ckpt, placement, cache_bytes, prefetch):
    want = _run(*load_checkpoint(ckpt, weights="stored"))
    model, report = load_checkpoint(ckpt, weights="stored", skip_experts=True)
    assert model.layers[0].ffn.experts[0].w1.weight.is_meta  # none of them resident
    store = ExpertStore(ckpt, model.cfg, model.numerics, placement, cache_bytes=cache_bytes, prefetch=prefetch)
    got = _run(model, report, store)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    s = store.summary()
    assert s["misses"] > 0 and s["cached_bytes"] <= (cache_bytes or float("inf"))
    if cache_bytes == 1:  # nothing fits: every lookup reads from the shards (hinted reads once, used or not)
        assert s["hits"] == 0 and s["bytes_read"] == sum(
            store.expert_bytes(0, 0) * (c["misses"] - c["prefetched"] + c["prefetch_reads"])
            for c in s["layers"].values())
        assert (s["prefetched"] > 0) == prefetch and s["prefetched"] <= s["prefetch_reads"]
    if placement == "disk" and cache_bytes != 1:
        assert s["hits"] > 0 and s["bytes_read"] > 0
    store.close()


def test_engine_serves_with_disk_experts_and_reports_them(ckpt):
    loaded = open_model(str(ckpt), placement=Placement(weights="stored", experts="disk", expert_cache_bytes=400_000,
                                                       expert_prefetch=True))
    own = open_model(str(ckpt), placement=Placement(weights="stored"))
    params = SamplingParams(max_tokens=6, temperature=0)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42]]
    want = [s.output_ids for s in LLMEngine(own, EngineConfig(max_batch=2)).generate(prompts, params)]
    engine = LLMEngine(loaded, EngineConfig(max_batch=2))
    assert [s.output_ids for s in engine.generate(prompts, params)] == want
    text = render(engine)
    assert 'openflash_expert_cache_misses_total{layer="0"}' in text and "openflash_expert_bytes_read_total" in text
    assert "openflash_expert_prefetched_total" in text and loaded.experts.summary()["prefetched"] > 0
    assert "routed experts on disk" in loaded.note


def test_a_model_without_its_experts_says_what_it_needs(ckpt):
    model, report = load_checkpoint(ckpt, skip_experts=True)
    with pytest.raises(ValueError, match="loaded without its routed experts; pass experts="):
        _run(model, report)


def test_missing_or_truncated_expert_tensors_are_named(ckpt, tmp_path):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / index["weight_map"]["layers.3.ffn.experts.5.w2.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ckpt.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    model, _ = load_checkpoint(ckpt, skip_experts=True)
    store = ExpertStore(broken, model.cfg, model.numerics, "disk")
    (broken / shard.name).write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated while in use
    with pytest.raises(CheckpointError, match="truncated"):
        for layer in range(model.cfg.num_hidden_layers):
            store.experts(layer, list(range(model.cfg.n_routed_experts)))
    with pytest.raises(CheckpointError, match="cannot read safetensors header: tensor .* do not hold"):
        ExpertStore(broken, model.cfg, model.numerics, "disk")  # a new store sees the damage at once
    cut = model.cfg.replace(n_routed_experts=model.cfg.n_routed_experts + 1,
                            num_experts_per_tok=model.cfg.num_experts_per_tok)
    with pytest.raises(CheckpointError, match="routed experts missing from the shards"):
        ExpertStore(ckpt, cut, model.numerics, "disk")
    with pytest.raises(CheckpointError, match="preset 'tiny' has none"):
        open_model("tiny", placement=Placement(experts="disk"))


def _expert_parallel_rank(ctx, folder: str, out: str) -> None:
    """One rank of test_expert_parallel_matches_one_process (module level: spawned processes import it)."""
    model, report = load_checkpoint(folder, weights="stored", skip_experts=True)
    store = ExpertStore(folder, model.cfg, model.numerics, "host", group=ctx)
    assert all(e % ctx.world_size == ctx.rank for (_, e) in store._host)  # only this rank's share is resident
    logits = _run(model, report, store)
    if ctx.rank == 0:
        torch.save(logits, out)


def test_expert_parallel_matches_one_process(ckpt, tmp_path):
    from openflash.train.distributed import spawn

    spawn(_expert_parallel_rank, 2, str(ckpt), str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    want = _run(*load_checkpoint(ckpt, weights="stored"))
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # the all_reduce sums in another order


def _lockstep_rank(ctx, folder: str, out: str) -> None:
    """One rank of test_expert_parallel_engines_step_together: rank 0 takes requests (and aborts one), rank 1
    follows; each records what its replica produced."""
    import time

    from openflash.engine.lockstep import Lockstep

    loaded = open_model(folder, expert_group=ctx, placement=Placement(experts="host"))
    engine = LLMEngine(loaded, EngineConfig(max_batch=3, prefill_chunk=16), Lockstep(ctx.rank, ctx.world_size))
    outputs: dict[str, list] = {}

    def record(o) -> None:
        outputs.setdefault(o.request_id, []).extend(o.token_ids)
        if o.finished:
            outputs[o.request_id].append(o.finish_reason)

    if ctx.rank == 0:
        engine.start()
        seqs = [engine.add_request(p, sp, request_id=f"r{i}", on_output=record, ignore_eos=True)
                for i, (p, sp) in enumerate(_lockstep_requests())]
        while "r4" not in outputs:  # r4 runs long: abort it once it has started
            time.sleep(0.01)
        engine.abort("r4")
        while not all(s.finished for s in seqs):
            time.sleep(0.01)
        engine.shutdown(5)
        torch.save({"outputs": outputs, "seeds": [s.params.seed for s in seqs]}, out + ".0")
    else:
        engine.follow(on_output=record)
        torch.save({"outputs": outputs}, out + ".1")


def _lockstep_requests() -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (40, 9, 23, 31, 12)]
    params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=12, temperature=0.8),  # seed set by rank 0
              SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=7), SamplingParams(max_tokens=10),
              SamplingParams(max_tokens=200)]
    return list(zip(prompts, params))


def test_expert_parallel_engines_step_together(ckpt, tmp_path):
    """Expert-parallel serving: two ranks' engines in lockstep (engine/lockstep.py). The follower's replica
    produces exactly the leader's tokens, aborts included, and the leader's equal one process serving alone."""
    from dataclasses import replace

    from openflash.train.distributed import spawn

    spawn(_lockstep_rank, 2, str(ckpt), str(tmp_path / "out"))
    leader, follower = torch.load(tmp_path / "out.0"), torch.load(tmp_path / "out.1")
    assert follower["outputs"] == leader["outputs"]
    assert leader["outputs"]["r4"][-1] == "abort" and leader["seeds"][1] is not None
    loaded = open_model(str(ckpt), placement=Placement(experts="host"))
    alone = LLMEngine(loaded, EngineConfig(max_batch=3, prefill_chunk=16))
    requests = _lockstep_requests()[:4]
    seqs = alone.generate([p for p, _ in requests], [replace(sp, seed=seed) for (_, sp), seed in
                                                     zip(requests, leader["seeds"])], ignore_eos=True)
    for i, seq in enumerate(seqs):
        assert leader["outputs"][f"r{i}"] == seq.output_ids + ["length"], i


def test_serve_with_expert_parallelism_under_torchrun(ckpt):
    """`torchrun --nproc_per_node 2 -m openflash.cli serve --expert-parallel 2`: rank 0 answers HTTP with the
    tokens one process would give, rank 1 steps with it, and Ctrl-C stops both."""
    import signal
    import subprocess
    import sys

    import httpx

    from openflash.train.distributed import free_port

    port, master = free_port(), free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(master),
           "-m", "openflash.cli", "serve", "--model", str(ckpt), "--expert-parallel", "2", "--port", str(port),
           "--max-batch", "4", "--max-context", "128"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc, 180)
        prompt = torch.randint(3, 1000, (30,), generator=torch.Generator().manual_seed(5)).tolist()
        body = {"model": ckpt.name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        got = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        loaded = open_model(str(ckpt), placement=Placement(experts="host"))
        alone = LLMEngine(loaded, EngineConfig(max_batch=4, max_context=128))
        assert got == alone.generate([prompt], SamplingParams(max_tokens=8), ignore_eos=True)[0].text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            log, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
            raise AssertionError("the expert-parallel server did not stop on SIGINT:\n" + log[-3000:])
    # (torchrun itself exits 1 with its own SignalException after forwarding a SIGINT; the ranks stop cleanly)
    assert "Application shutdown complete" in log and "rank 1: rank 0 stopped the group" in log, log[-3000:]
    assert "LockstepError" not in log and "engine step of request" not in log, log[-3000:]


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]], ids=["generate", "serve"])
def test_expert_parallel_needs_its_processes(ckpt, command):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "openflash.cli", command[0], "--model", str(ckpt), *command[1:],
                          "--expert-parallel", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"torchrun --nproc_per_node 2 -m openflash.cli {command[0]} ..." in out.stderr


def test_engine_replicas_refuse_what_they_cannot_share(ckpt, tmp_path):
    """A persisted prefix cache with expert parallelism is refused by name; a follower takes no add_request."""
    from openflash.engine.lockstep import Lockstep

    loaded = open_model(str(ckpt))
    with pytest.raises(OpenflashError, match="persisted prefix cache .prefix_cache_dir. is not supported with expert "
                                             "parallelism"):
        LLMEngine(loaded, EngineConfig(prefix_cache_dir=str(tmp_path)), Lockstep(0, 2))
    follower = LLMEngine(loaded, EngineConfig(), Lockstep(1, 2))
    with pytest.raises(RuntimeError, match="a follower engine takes its requests from the leader"):
        follower.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="at least 2 ranks"):
        Lockstep(0, 1)


def test_bad_store_settings_are_named(ckpt):
    model, _ = load_checkpoint(ckpt, skip_experts=True)
    with pytest.raises(OpenflashError, match="--expert-cache-bytes must be >= 0, got -1"):
        ExpertStore(ckpt, model.cfg, model.numerics, "disk", cache_bytes=-1)
    with pytest.raises(OpenflashError, match="the store serves host or disk"):
        ExpertStore(ckpt, model.cfg, model.numerics, "device")


def test_direct_reads_give_the_same_tensors_and_logits(ckpt):
    """O_DIRECT (`--expert-direct-io`) reads whole aligned blocks around each tensor: the tensors are the buffered
    reads' own, whatever their offsets, and a model on direct-read disk experts gives the same tokens."""
    from openflash.files.shards import ShardReader, tensor_locations

    buffered, direct = ShardReader(), ShardReader(direct=True)
    try:
        for name, loc in tensor_locations(ckpt).items():
            a, b = buffered.read(loc), direct.read(loc)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(
                a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name
    except CheckpointError as exc:
        if "refuses O_DIRECT" in str(exc):  # tmpfs and some overlay file systems
            pytest.skip(str(exc))
        raise
    finally:
        buffered.close(), direct.close()
    params = SamplingParams(max_tokens=4, temperature=0)
    want = LLMEngine(open_model(str(ckpt), placement=Placement(weights="stored")),
                     EngineConfig()).generate([[5, 6, 7]], params)
    loaded = open_model(str(ckpt), placement=Placement(weights="stored", experts="disk", expert_direct_io=True))
    got = LLMEngine(loaded, EngineConfig()).generate([[5, 6, 7]], params)
    assert got[0].output_ids == want[0].output_ids and loaded.experts.summary()["bytes_read"] > 0
    with pytest.raises(CheckpointError, match="--expert-direct-io reads routed experts from the shards: it needs"):
        open_model(str(ckpt), placement=Placement(expert_direct_io=True))
