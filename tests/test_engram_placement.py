"""Engram tiers in the running model: every placement gives the same logits as `device` (engram.md §5): bit for bit
within one process, to fp32 rounding across processes."""

from __future__ import annotations

import copy
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openflash.checkpoint import save_checkpoint
from openflash.config import load_config
from openflash.errors import ConfigError, EngramTableError
from openflash.memory.checkpoint_tables import export_engram_tables
from openflash.memory.placement import EngramMemory
from openflash.memory.rows import EngramTable
from openflash.memory.table_file import read_table_header, table_file_name, write_table_file
from openflash.memory.tiers.disk import DiskTable
from openflash.model.transformer import Transformer
from openflash.runtime.runtime import Runtime
from openflash.tokenizer import preset_tokenizer

GOLDEN_A = Path(__file__).parent / "goldens" / "A"  # a checkpoint of another tiny config (Engram layers 0, 3)
BATCH = 2
STEPS = 4  # decode steps after the prefill


def make_model() -> Transformer:
    """The tiny preset with random weights and random FP8 Engram tables (same weights in every process)."""
    cfg = load_config("tiny")
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    for lid in cfg.engram_layer_ids:
        model.layers[lid].engram.embed = model.layers[lid].engram.embed.to_fp8()
    return model


def prompt(vocab_size: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (BATCH, 7), generator=torch.Generator().manual_seed(1))


def next_tokens(logits: torch.Tensor, step: int) -> torch.Tensor:
    """Decode schedule: per step, each row takes its likeliest token (inside any top-k speculation) or its least
    likely one (outside), so speculation sees both rows covered, one of two, none, then both again."""
    top, low = logits.argmax(-1), logits.argmin(-1)
    pattern = [(top, top), (top, low), (low, low), (top, top)][step % 4]
    return torch.stack([pattern[0][0], pattern[1][1]])[:, None]


def run(model: Transformer, memory: EngramMemory, k: int = 0) -> torch.Tensor:
    """Logits [STEPS + 1, B, V] of a prefill and STEPS decode steps of a runtime reading `memory`."""
    rt = Runtime(model, preset_tokenizer(model.cfg), memory)
    cache = rt.new_cache(BATCH)
    ids, out = prompt(model.cfg.vocab_size), []
    for step in range(STEPS + 1):
        logits = rt.step(ids, cache)
        out.append(logits)
        if k:
            rt.speculate(logits, cache, k)
        ids = next_tokens(logits, step)
    return torch.stack(out)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from a second thread, and an oversubscribed machine makes them crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base() -> Transformer:
    return make_model()


@pytest.fixture(scope="module")
def reference(base) -> torch.Tensor:
    model = copy.deepcopy(base)
    return run(model, EngramMemory.attach(model, "device"))


@pytest.fixture(scope="module")
def checkpoint_dir(base, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("engram") / "ckpt"
    save_checkpoint(base, path)
    return path


@pytest.fixture(scope="module")
def table_dir(checkpoint_dir) -> Path:
    """`openflash engram export` of a checkpoint of the base model."""
    export_engram_tables(checkpoint_dir, checkpoint_dir.parent / "tables")
    return checkpoint_dir.parent / "tables"


def test_the_tables_matter(base, reference):
    """Guard: the comparisons below can fail, because the logits depend on the table rows."""
    model = copy.deepcopy(base)
    embed = model.layers[model.cfg.engram_layer_ids[0]].engram.embed
    embed.weight.data = embed.weight.data.view(torch.uint8).roll(1, dims=0).view(torch.float8_e4m3fn)
    assert not torch.equal(run(model, EngramMemory.attach(model, "device")), reference)


TIERS = {
    "host": dict(placement="host"),
    "host-speculate": dict(placement="host", k=3),
    "host-no-prefetch": dict(placement="host", prefetch=False, k=2),
    "host-from-checkpoint": dict(placement="host", checkpoint=True),
    "disk": dict(placement="disk"),
    "disk-cache-speculate": dict(placement="disk", cache_bytes=40 * 33, k=2),
    "disk-no-prefetch": dict(placement="disk", prefetch=False),
}


@pytest.mark.parametrize("placement", ["device", "host", "disk"])
def test_every_tier_meets_the_table_protocol(base, table_dir, placement):
    """The memory asks its tables through `EngramTable` alone (rows.py): counters where a tier keeps them, what
    it is, closing; the sharded tier's test (two processes, below) checks `collective`."""
    model = copy.deepcopy(base)
    memory = EngramMemory.attach(model, placement, table_dir=table_dir if placement == "disk" else None)
    for table in memory.tables.values():
        assert isinstance(table, EngramTable) and not table.collective
        assert table.host_ids == (placement == "disk") and table.problem() is None
    run(model, memory, k=2 if placement == "disk" else 0)
    counted = memory.stats()["tables"]
    assert (counted == {}) if placement == "device" else all(c["gathers"] > 0 for c in counted.values())
    memory.reset_stats()
    assert all(c["gathers"] == 0 for c in memory.stats()["tables"].values())
    memory.close()
    if placement == "disk":
        assert all("closed" in t.problem() for t in memory.tables.values())


@pytest.mark.parametrize("tier", list(TIERS))
def test_tier_matches_device(base, reference, table_dir, checkpoint_dir, tier):
    opts = dict(TIERS[tier])
    placement, k = opts.pop("placement"), opts.pop("k", 0)
    if opts.pop("checkpoint", False):
        opts["checkpoint_dir"] = checkpoint_dir
    model = copy.deepcopy(base)
    memory = EngramMemory.attach(model, placement, table_dir=table_dir if placement == "disk" else None, **opts)
    with memory:
        assert torch.equal(run(model, memory, k), reference)
        stats = memory.stats()
    layers = model.cfg.engram_layer_ids
    assert stats["placement"] == placement
    assert sorted(stats["wait_seconds"]) == layers and stats["lookups"] == {lid: STEPS + 1 for lid in layers}
    spec = stats["speculation"]
    if opts.get("prefetch", True):
        assert stats["sync_gathers"] == 0 and sorted(stats["slack_seconds"]) == layers
        # Speculation serves covered rows: the step after a full cover submits no prefetch at all.
        fully_covered = 2 if k else 0
        assert stats["prefetches"] == STEPS + 1 - fully_covered
    else:
        assert stats["sync_gathers"] == len(layers) * (STEPS + 1) and stats["prefetches"] == 0
    if k:
        # Rows covered per decode step: 2, 1, 0, 2 (see next_tokens).
        assert (spec["speculations"], spec["rows_checked"], spec["rows_covered"]) == (STEPS + 1, 2 * STEPS, 5)
        assert spec["rows_served"] == (5 if opts.get("prefetch", True) else 0)
        assert spec["coverage"] == 5 / 8
    if "cache_bytes" in opts:
        assert 0 < stats["hit_rate"] < 1 and set(stats["tables"]) == set(layers)


def test_speculation_survives_an_interleaved_prefill(base, reference):
    """An engine prefills new prompts between decode steps: a speculation made for the decode batch waits for it."""
    model = copy.deepcopy(base)
    with EngramMemory.attach(model, "host") as memory:
        ids, batch = prompt(model.cfg.vocab_size), model.new_cache(BATCH)
        logits = model.step(ids, batch, engram=memory.prepare(ids, batch))
        memory.speculate(logits, batch, 2)
        other = model.new_cache(1)  # another request's prompt
        model.step(ids[:1], other, engram=memory.prepare(ids[:1], other))
        tokens = next_tokens(logits, 0)  # both rows take their likeliest token: covered
        assert torch.equal(model.step(tokens, batch, engram=memory.prepare(tokens, batch)), reference[1])
        spec = memory.stats()["speculation"]
    assert (spec["rows_served"], spec["unused"]) == (2, 0)


def test_chunked_prefill_carries_the_hash_state(base, table_dir):
    """A prompt prefilled in chunks (bounded mode) hashes across the chunk boundary exactly like device."""
    ids = prompt(base.cfg.vocab_size)

    def chunked(placement: str) -> torch.Tensor:
        with Runtime.of(copy.deepcopy(base)) as rt:
            rt.place_engram(placement, table_dir=table_dir)
            cache = rt.new_cache(BATCH)
            for chunk, last in ((ids[:, :4], False), (ids[:, 4:], True)):
                logits = rt.step(chunk, cache, mode="bounded", last_chunk=last)
            return torch.stack([logits, rt.decode(logits.argmax(-1), cache)])

    assert torch.equal(chunked("disk"), chunked("device"))


def test_training_prefetches_the_next_batch(base):
    batches = [torch.randint(3, base.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(s))
               for s in range(3)]
    reference = Runtime.of(copy.deepcopy(base))
    want = [reference.forward(x).logits for x in batches]
    model = copy.deepcopy(base)
    with EngramMemory.attach(model, "host") as memory:
        upcoming = memory.prefetch_batch(batches[0])
        for n, x in enumerate(batches):
            rows = upcoming
            if n + 1 < len(batches):
                upcoming = memory.prefetch_batch(batches[n + 1])  # gathers while batch n computes
            assert torch.equal(model(x, engram=rows).logits, want[n])
        stats = memory.stats()
    assert stats["prefetches"] == 3 and stats["sync_gathers"] == 0


def test_a_step_takes_the_rows_prepared_for_it(base, reference):
    """The model hashes nothing: a step of a model with Engram layers needs the rows its memory prepared, and
    rows prepared for other steps (never used) change nothing."""
    model = copy.deepcopy(base)
    with EngramMemory.attach(model, "host") as memory:
        ids = prompt(model.cfg.vocab_size)
        with pytest.raises(ValueError, match="run it through its runtime"):
            model.step(ids, model.new_cache(BATCH))
        memory.prepare(ids[:, :3], model.new_cache(BATCH))  # prefetched, then never used
        memory.prepare(ids.flip(1), model.new_cache(BATCH))
        cache = model.new_cache(BATCH)
        assert torch.equal(model.step(ids, cache, engram=memory.prepare(ids, cache)), reference[0])


def test_attach_releases_the_device_tables(base, tmp_path):
    model = copy.deepcopy(base)
    embed = model.layers[model.cfg.engram_layer_ids[0]].engram.embed
    memory = EngramMemory.attach(model, "host")
    assert embed.weight.shape == (0, embed.dim) and embed.scale.shape == (0, embed.dim // 32)
    assert embed.released == "host" and embed.num_rows == model.cfg.engram_num_embeddings[0]
    with pytest.raises(EngramTableError, match=r"layers\.1\.engram\.embed\.weight: .*released to the 'host' tier"):
        model.state_dict()
    with pytest.raises(EngramTableError, match="cannot be saved with its tables"):
        save_checkpoint(model, tmp_path / "ckpt")
    with pytest.raises(EngramTableError, match="layer 1: its table was already released to the 'host' tier"):
        EngramMemory.attach(model, "host")
    memory.close()
    with pytest.raises(EngramTableError, match="moved to the 'host' tier"):
        embed.gather(torch.tensor([0]))
    with pytest.raises(EngramTableError, match="layer 1: its table was already released"):
        EngramMemory.attach(model, "disk", table_dir="/nonexistent")


def test_bad_attach_arguments(base, table_dir, tmp_path):
    with pytest.raises(EngramTableError, match=re.escape(f"{GOLDEN_A}: its Engram tables (layers [0, 3], rows "
                                                         f"[304, 462], dim 32) are not addressed like this model's "
                                                         f"(layers [1, 2]")):
        EngramMemory.attach(copy.deepcopy(base), "host", checkpoint_dir=GOLDEN_A)
    with pytest.raises(ConfigError, match="applies to placements 'host' and 'sharded', not 'disk'"):
        EngramMemory.attach(copy.deepcopy(base), "disk", table_dir=table_dir, checkpoint_dir=GOLDEN_A)
    with pytest.raises(ConfigError, match="unknown Engram placement 'ssd'"):
        EngramMemory.attach(copy.deepcopy(base), "ssd")
    with pytest.raises(ConfigError, match="only applies to Engram placement 'disk', not 'host'"):
        EngramMemory.attach(copy.deepcopy(base), "host", table_dir=table_dir)
    with pytest.raises(ConfigError, match="placement 'disk' needs the folder"):
        EngramMemory.attach(copy.deepcopy(base), "disk")
    fp32 = Transformer(base.cfg)  # trainable fp32 tables
    with pytest.raises(EngramTableError, match="layer 1: placement 'host' holds FP8 rows but the model's table is "
                                               "fp32; quantize it first"):
        EngramMemory.attach(fp32, "host")
    assert fp32.layers[1].engram.embed.released is None  # nothing was released by the failed attach


def _table_copy(table_dir: Path, dest: Path, layer_id: int, rows: int | None = None,
                fingerprint: str | None = None) -> Path:
    """A copy of the exported tables with one layer's file rewritten (other rows or another fingerprint)."""
    dest.mkdir()
    for path in table_dir.iterdir():
        (dest / path.name).write_bytes(path.read_bytes())
    with DiskTable.open(table_dir / table_file_name(layer_id), None, None, None) as good:
        data = good.read_records(0, rows or good.num_rows)
        write_table_file(dest / table_file_name(layer_id), data[:, :good.dim].copy(), data[:, good.dim:].copy(),
                         fingerprint or good.header.layout_fingerprint)
    return dest


def test_wrong_table_files_fail_clearly(base, table_dir, tmp_path):
    lid, rows = base.cfg.engram_layer_ids[1], base.cfg.engram_num_embeddings[1]
    cases = {
        "missing": (tmp_path / "nowhere", f"table file not found: {tmp_path / 'nowhere' / table_file_name(1)}"),
        "rows": (_table_copy(table_dir, tmp_path / "rows", lid, rows=rows - 1),
                 f"{table_file_name(lid)}: table has {rows - 1} rows, the model expects {rows}"),
        "fingerprint": (_table_copy(table_dir, tmp_path / "fp", lid, fingerprint="another-config"),
                        f"{table_file_name(lid)}: Engram hash layout fingerprint mismatch"),
    }
    for name, (folder, message) in cases.items():
        model = copy.deepcopy(base)
        with pytest.raises(EngramTableError, match=re.escape(message)):
            EngramMemory.attach(model, "disk", table_dir=folder)
        assert model.layers[lid].engram.embed.released is None, name


def _bad_sector(*args, **kwargs):
    """Stands in for os.pread: fails like a bad disk sector."""
    raise OSError(5, "Input/output error")


def test_read_error_fails_that_step(base, reference, table_dir, monkeypatch):
    model = copy.deepcopy(base)
    with EngramMemory.attach(model, "disk", table_dir=table_dir) as memory:
        cache, ids = model.new_cache(BATCH), prompt(model.cfg.vocab_size)
        assert torch.equal(model.step(ids, cache, engram=memory.prepare(ids, cache)), reference[0])
        disk = memory.tables[1]
        ids = next_tokens(reference[0], 0)
        message = re.escape(f"{disk.path.parent}/engram_layer") + r"\d+\.oftable: read error in rows .*Input/output error"
        with monkeypatch.context() as patch, pytest.raises(EngramTableError, match=message):
            patch.setattr("openflash.memory.tiers.disk.os.pread", _bad_sector)
            model.step(ids, cache, engram=memory.prepare(ids, cache))
        # the memory is usable again: a new sequence gives the right logits
        assert torch.equal(run(model, memory), reference)


def test_table_truncated_while_in_use_fails_the_step_not_the_process(base, reference, table_dir, tmp_path):
    """A table file cut short under a running model: the lookup fails with the file named (a mapped file would
    have killed the process with SIGBUS), and the memory works again once the file is whole."""
    folder = tmp_path / "tables"
    shutil.copytree(table_dir, folder)
    model = copy.deepcopy(base)
    with EngramMemory.attach(model, "disk", table_dir=folder) as memory:
        cache, ids = model.new_cache(BATCH), prompt(model.cfg.vocab_size)
        assert torch.equal(model.step(ids, cache, engram=memory.prepare(ids, cache)), reference[0])
        path = memory.tables[1].path
        whole = path.read_bytes()
        assert memory.problem() is None
        os.truncate(path, read_table_header(path).data_offset + 64)
        assert f"{path}: the file has {read_table_header(path).data_offset + 64} bytes" in memory.problem()
        with pytest.raises(EngramTableError, match=re.escape(f"{path}: truncated while in use")):
            run(model, memory)
        path.write_bytes(whole)
        assert memory.problem() is None
        assert torch.equal(run(model, memory), reference)


def test_a_server_over_a_truncated_table_answers_503_without_paths(base, table_dir, tmp_path, caplog):
    """Clients get a 503 that names no server file (the log does), /health says degraded until the file is whole."""
    import httpx
    from live_server import LiveServer

    from openflash.chat import chat_format
    from openflash.engine.engine import EngineConfig, LLMEngine
    from openflash.serve.app import ServerConfig, build_app

    folder = tmp_path / "tables"
    shutil.copytree(table_dir, folder)
    rt = Runtime.of(copy.deepcopy(base))
    rt.place_engram("disk", table_dir=folder)
    tok, memory = rt.tokenizer, rt.memory
    engine = LLMEngine(rt, EngineConfig(max_batch=2, max_context=64, prefix_cache=False))
    app = build_app(engine, tok, ServerConfig("tiny", chat_format(tok, 0, 1), drain_timeout=1.0))
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 2}
    path = memory.tables[1].path
    whole = path.read_bytes()
    with LiveServer(app) as server:
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        os.truncate(path, read_table_header(path).data_offset + 64)
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engram_unavailable", r.text
        assert str(tmp_path) not in r.text and "oftable" not in r.text
        assert any(str(path) in rec.getMessage() or (rec.exc_info and str(path) in str(rec.exc_info[1]))
                   for rec in caplog.records)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "degraded" and "oftable" not in health.text
        path.write_bytes(whole)
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    memory.close()


# ----------------------------------------------------------------------------------------------------------------
# sharded: two gloo processes, each holding half of every table's rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same_logits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Logits of another process: the rows are the same bits, but the worker runs 1 intra-op thread and the parent
    may run more, and the BLAS may split its sums differently (last-bit differences; a wrong row moves logits by
    ~1e-1). Within one process and thread count, the tests above compare bit for bit."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _sharded_worker(rank: int, port: int, out_dir: str, base: Transformer, want: torch.Tensor,
                    checkpoint_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model, results = copy.deepcopy(base), {}
        with EngramMemory.attach(model, "sharded") as memory:
            local = memory.tables[0].weight.shape[0]
            results["half the rows"] = local == -(-model.cfg.engram_num_embeddings[0] // 2)
            results["collective"] = all(t.collective and not t.host_ids for t in memory.tables.values())
            results["logits"] = _same_logits(run(model, memory), want)
            results["speculated logits"] = _same_logits(run(model, memory, k=2), want)
        model = copy.deepcopy(base)
        with EngramMemory.attach(model, "sharded", prefetch=False) as memory:
            # Lookups made when each layer asks still go through the worker, in the same order on both ranks.
            results["gathered when asked"] = _same_logits(run(model, memory), want)
            results["counted"] = memory.stats()["sync_gathers"] == len(model.cfg.engram_layer_ids) * (STEPS + 1)
        model = copy.deepcopy(base)
        with EngramMemory.attach(model, "sharded", checkpoint_dir=checkpoint_dir) as memory:  # reads its block only
            results["from checkpoint"] = _same_logits(run(model, memory), want)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_sharded_tier_matches_device(base, reference, checkpoint_dir, tmp_path):
    # The model (with its token map) and the device logits travel to the workers, which only shard and compare.
    mp.spawn(_sharded_worker, args=(_free_port(), str(tmp_path), base, reference, checkpoint_dir), nprocs=2,
             join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results and all(results.values()), (rank, results)


def test_serve_disk_tier_of_a_model_with_fp32_tables(tmp_path):
    """`openflash serve --engram-placement disk` on a model trained here (fp32 tables, no engram_tables folder):
    its tables are quantized to FP8 rows and exported for the disk tier, which then serves the same rows."""
    from openflash.runtime.open import open_model

    served, reference = open_model("tiny", numerics="plain"), open_model("tiny", numerics="plain")  # same seed
    assert reference.model.quantize_engram_tables() == reference.model.cfg.engram_layer_ids
    with served:
        served.place_engram("disk")
        exported = Path(served.memory.tables[0].path).parent
        assert served.memory.placement == "disk" and sorted(p.name for p in exported.iterdir()) == \
            [table_file_name(lid) for lid in served.model.cfg.engram_layer_ids]
        ids = prompt(served.model.cfg.vocab_size)
        got, want = served.step(ids, served.new_cache(BATCH)), reference.step(ids, reference.new_cache(BATCH))
        assert _same_logits(got, want)  # two model instances: see _same_logits
    assert not exported.exists()  # close() removed the exported tables
