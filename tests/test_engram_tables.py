"""Engram table tiers, table files and the prefetcher (spec: engram.md §3, §5); export: test_engram_export.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_ids, same_bits

from openflash.errors import EngramTableError
from openflash.memory.prefetch import EngramPrefetcher
from openflash.memory.rows import TableStats
from openflash.memory.table_file import read_table_header, write_table_file
from openflash.memory.tiers.disk import DiskTable
from openflash.memory.tiers.host import HostTable
from openflash.model.engram_table import DeviceTable

ROWS, DIM = 1000, 64
RECORD = DIM + DIM // 32
FINGERPRINT = "test-layout-0123"


def random_table(rows: int = ROWS, dim: int = DIM, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 bytes (NaN codes 0x7F / 0xFF excluded) and scale bytes around 2^0; the first rows get the
    smallest scales (2^-127...), where the fp32 products fall below bf16's subnormal range and round."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(0, 256, (rows, dim), generator=g, dtype=torch.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0x38
    scale = torch.randint(110, 140, (rows, dim // 32), generator=g, dtype=torch.uint8)
    scale[:8] = torch.arange(8, dtype=torch.uint8).unsqueeze(1)
    return weight, scale


def reference_decode(weight: torch.Tensor, scale: torch.Tensor, bf16: bool = True) -> torch.Tensor:
    """engram.md §5 written out independently: e4m3 bits -> value, times 2^(scale-127) in fp32, then bf16."""
    b = weight.numpy().astype(np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7.0)) * sign
    factor = 2.0 ** (np.repeat(scale.numpy().astype(np.float64), 32, axis=1) - 127)
    fp32 = torch.from_numpy((value * factor).astype(np.float32))
    return fp32.to(torch.bfloat16).to(torch.float32) if bf16 else fp32


@pytest.fixture(scope="module")
def table_bytes() -> tuple[torch.Tensor, torch.Tensor]:
    return random_table()


@pytest.fixture()
def table_file(tmp_path: Path, table_bytes) -> Path:
    path = tmp_path / "t.oftable"
    write_table_file(path, table_bytes[0], table_bytes[1], FINGERPRINT, chunk_rows=128)
    return path


# ----------------------------------------------------------------------------------------------------------------
# Tiers


def test_device_table_decodes_rows_per_spec(table_bytes):
    weight, scale = table_bytes
    table = DeviceTable.from_fp8(weight.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu))
    ids = random_ids((4, 7, 6), ROWS)
    ids[0, 0] = torch.arange(6)  # rows with tiny scales, where the bf16 rounding shows
    rows = table.gather(ids)
    assert rows.shape == (4, 7, 6, DIM) and rows.dtype == torch.float32
    expected = reference_decode(weight, scale)[ids]
    assert same_bits(rows, expected)
    assert not same_bits(rows, reference_decode(weight, scale, bf16=False)[ids])
    # The rows are bf16 values: rounding again changes nothing.
    assert torch.equal(rows, rows.to(torch.bfloat16).float())
    assert set(table.state_dict()) == {"weight", "scale"}
    assert table.weight.dtype == torch.float8_e4m3fn and table.scale.dtype == torch.float8_e8m0fnu
    assert not any(p.requires_grad for p in table.parameters())
    assert table.row_bytes == RECORD

    # Casting the model (e.g. model.to(torch.bfloat16)) must not decode the FP8 storage.
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), table).to(torch.bfloat16).float()
    assert table.weight.dtype == torch.float8_e4m3fn and table.scale.dtype == torch.float8_e8m0fnu
    assert model[0].weight.dtype == torch.float32
    assert same_bits(table.gather(ids), expected)
    meta = DeviceTable(3, DIM, device="meta").to_empty(device="cpu")
    assert meta.weight.dtype == torch.float8_e4m3fn and meta.weight.device.type == "cpu"


def test_every_tier_returns_the_device_rows(table_bytes, table_file):
    weight, scale = table_bytes
    device = DeviceTable.from_fp8(weight, scale)
    ids = random_ids((3, 5, 24), ROWS)
    expected = device.gather(ids)
    host = HostTable.from_device_table(device)
    assert same_bits(host.gather(ids), expected)
    for cache_bytes in (0, 300 * RECORD):
        with DiskTable.open(table_file, ROWS, DIM, FINGERPRINT, cache_bytes=cache_bytes) as disk:
            assert same_bits(disk.gather(ids), expected)
            assert same_bits(disk.gather(ids), expected)  # second time from the cache, when there is one
    # The thread-pool read path (many missing rows split across readers) gives the same rows.
    with DiskTable.open(table_file, ROWS, DIM, FINGERPRINT, io_threads=3) as disk:
        disk.parallel_min_rows = 4
        assert same_bits(disk.gather(ids), expected)


def test_out_of_range_ids_are_refused(table_bytes, table_file):
    weight, scale = table_bytes
    bad = torch.tensor([[0, ROWS]])
    for table in (DeviceTable.from_fp8(weight, scale), HostTable(weight, scale)):
        with pytest.raises(EngramTableError, match=f"hash id {ROWS} is outside the table's {ROWS} rows"):
            table.gather(bad)
    with DiskTable.open(table_file, ROWS, DIM, FINGERPRINT) as disk:
        with pytest.raises(EngramTableError, match=f"{table_file}.*hash id -1"):
            disk.gather(torch.tensor([3, -1]))


def test_fp32_table_trains_and_quantizes_to_row_format():
    torch.manual_seed(0)
    table = DeviceTable(50, DIM, storage="fp32")
    ids = torch.tensor([[1, 2, 2], [7, 1, 0]])
    rows = table.gather(ids)
    assert torch.equal(rows, table.weight[ids])  # no bf16 rounding while training
    rows.square().sum().backward()
    assert table.weight.grad is not None and torch.equal(table.weight.grad[2], 4 * table.weight[2].detach())
    assert table.row_bytes == 4 * DIM

    fp8 = table.to_fp8()
    assert fp8.storage == "fp8" and fp8.weight.shape == (50, DIM) and fp8.scale.shape == (50, DIM // 32)
    # Per-row 1x32 blocks with a power-of-two scale: every value within FP8's half-ulp (2^-4 relative to the
    # block's scale times 448 / 2^8 at worst), and exact values survive.
    back = fp8.gather(torch.arange(50))
    w = table.weight.detach()
    block_amax = w.abs().unflatten(1, (DIM // 32, 32)).amax(-1).repeat_interleave(32, 1)
    assert ((back - w).abs() <= block_amax / 16).all()
    exact = DeviceTable(4, DIM, storage="fp32")
    with torch.no_grad():
        exact.weight.copy_(torch.tensor([0.5, -1.0, 3.0, 0.0]).repeat(4, DIM // 4))
    assert torch.equal(exact.to_fp8().gather(torch.arange(4)), exact.weight.detach())


# ----------------------------------------------------------------------------------------------------------------
# Table files


def test_table_file_layout(table_bytes, table_file):
    weight, scale = table_bytes
    header = read_table_header(table_file)
    assert (header.rows, header.dim, header.record_bytes, header.layout_fingerprint) == (ROWS, DIM, RECORD,
                                                                                           FINGERPRINT)
    raw = table_file.read_bytes()
    assert raw[:8] == b"OFENGRAM" and len(raw) == header.data_offset + ROWS * RECORD
    # Row r is one contiguous record: its FP8 bytes, then its scale bytes.
    r = 417
    record = raw[header.data_offset + r * RECORD: header.data_offset + (r + 1) * RECORD]
    assert record == weight[r].numpy().tobytes() + scale[r].numpy().tobytes()


def _rewrite(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_open_refuses_bad_files(tmp_path, table_file):
    def refused(path: Path, *message: str, rows: int = ROWS, dim: int = DIM, fp: str = FINGERPRINT) -> None:
        with pytest.raises(EngramTableError) as info:
            DiskTable.open(path, rows, dim, fp)
        text = str(info.value)
        assert str(path) in text
        for part in message:
            assert part in text, text

    refused(tmp_path / "absent.oftable", "not found")
    refused(table_file, "fingerprint mismatch", FINGERPRINT, "'other-layout'", fp="other-layout")
    refused(table_file, f"{ROWS} rows", "expects 999", rows=999)
    refused(table_file, "dim 64", "expects 32", dim=32)

    size = table_file.stat().st_size
    truncated = tmp_path / "truncated.oftable"
    truncated.write_bytes(table_file.read_bytes()[:size - 10])
    refused(truncated, "truncated", f"{size - 10} bytes", f"expected {size}")
    tiny = tmp_path / "tiny.oftable"
    tiny.write_bytes(b"OFENG")
    refused(tiny, "truncated")
    longer = tmp_path / "longer.oftable"
    longer.write_bytes(table_file.read_bytes() + b"\0")
    refused(longer, "1 unexpected bytes")

    wrong_magic = tmp_path / "magic.oftable"
    wrong_magic.write_bytes(table_file.read_bytes())
    _rewrite(wrong_magic, 0, b"NOTATABL")
    refused(wrong_magic, "not an openflash Engram table file", "NOTATABL")
    wrong_version = tmp_path / "version.oftable"
    wrong_version.write_bytes(table_file.read_bytes())
    _rewrite(wrong_version, 8, (7).to_bytes(4, "little"))
    refused(wrong_version, "format version 7")
    corrupt = tmp_path / "corrupt.oftable"
    corrupt.write_bytes(table_file.read_bytes())
    raw = corrupt.read_bytes()
    at = raw.index(b'"rows": 1000')
    _rewrite(corrupt, at, b'"rows": 1001')  # a plausible edit the checksum must catch
    refused(corrupt, "header checksum mismatch")


def test_write_refuses_mismatched_scale(tmp_path, table_bytes):
    weight, scale = table_bytes
    with pytest.raises(EngramTableError, match="not FP8 rows"):
        write_table_file(tmp_path / "x.oftable", weight, scale[:, :1], FINGERPRINT)
    assert not (tmp_path / "x.oftable").exists() and not (tmp_path / "x.oftable.partial").exists()


def test_row_cache_accounting(table_bytes, table_file):
    weight, scale = table_bytes
    device = DeviceTable.from_fp8(weight, scale)
    with DiskTable.open(table_file, ROWS, DIM, FINGERPRINT, cache_bytes=2 * RECORD + 5) as disk:
        assert disk.cache.capacity_rows == 2
        steps = [([1, 2, 1, 1], 0, 2), ([1], 1, 0), ([3], 0, 1), ([2], 0, 1), ([3, 5], 1, 1), ([1], 0, 1)]
        # least recently used first: 1,2 | 2,1 | 1,3 (2 evicted) | 3,2 | 3,5 (2 evicted) | 5,1 (3 evicted)
        hits = misses = 0
        for ids, step_hits, step_misses in steps:
            before = TableStats(**{k: v for k, v in disk.stats.__dict__.items()})
            ids_t = torch.tensor(ids)
            assert same_bits(disk.gather(ids_t), device.gather(ids_t))
            assert disk.stats.hits - before.hits == step_hits, ids
            assert disk.stats.misses - before.misses == step_misses, ids
            hits, misses = hits + step_hits, misses + step_misses
        assert disk.stats.bytes_read == misses * RECORD
        assert disk.stats.hit_rate == pytest.approx(hits / (hits + misses))
        assert disk.stats.rows_requested == 10 and disk.stats.unique_rows == hits + misses
        assert disk.stats.gathers == len(steps)
        assert disk.drop_page_cache() is True  # Linux has posix_fadvise; rows still read correctly after it
        assert same_bits(disk.gather(torch.tensor([999])), device.gather(torch.tensor([999])))
    with DiskTable.open(table_file, ROWS, DIM, FINGERPRINT) as uncached:
        uncached.gather(torch.tensor([4, 4, 4]))
        uncached.gather(torch.tensor([4]))
        assert (uncached.stats.hits, uncached.stats.misses, uncached.stats.hit_rate) == (0, 2, 0.0)


def _bad_sector(*args, **kwargs):
    """Stands in for os.pread: every read fails like a bad disk sector."""
    raise OSError(5, "Input/output error")


@pytest.mark.parametrize("parallel", [False, True])
def test_read_error_surfaces_as_table_error(table_file, parallel, monkeypatch):
    with DiskTable.open(table_file, ROWS, DIM, FINGERPRINT, io_threads=2) as disk:
        if parallel:
            disk.parallel_min_rows = 2
        with monkeypatch.context() as patch, \
                pytest.raises(EngramTableError, match=rf"{table_file}: read error in rows 5\.\.\d+.*Input/output"):
            patch.setattr("openflash.memory.tiers.disk.os.pread", _bad_sector)
            disk.gather(torch.tensor([9, 5, 700, 5]))
        # a later gather works again and nothing bad was cached
        assert disk.gather(torch.tensor([5])).shape == (1, DIM)


# ----------------------------------------------------------------------------------------------------------------
# Prefetcher


class _SlowTable:
    """Wraps a table and delays each gather, so the consumer has to wait for the rows (the rest of the EngramTable
    protocol is the wrapped table's)."""

    def __init__(self, table, delay: float) -> None:
        self.table, self.delay = table, delay

    def __getattr__(self, name):
        return getattr(self.table, name)

    def gather(self, ids):
        import time

        time.sleep(self.delay)
        return self.table.gather(ids)


class _BrokenTable(_SlowTable):
    def gather(self, ids):
        raise RuntimeError("device lost")


def test_prefetcher_returns_direct_rows_and_records_waits(table_bytes, table_file):
    weight, scale = table_bytes
    device = DeviceTable.from_fp8(weight, scale)
    with DiskTable.open(table_file, ROWS, DIM, FINGERPRINT, cache_bytes=64 * RECORD) as disk:
        tables = {0: disk, 1: _SlowTable(HostTable(weight, scale), delay=0.05)}
        hash_ids = random_ids((2, 3, 2, 6), ROWS)
        with EngramPrefetcher(tables) as prefetcher:
            for step in range(2):
                prefetch = prefetcher.submit(hash_ids)
                rows = {j: prefetch.rows(j) for j in (1, 0)}  # layer 1 first: it is still sleeping
                assert prefetch.done()
                assert set(prefetch.wait_seconds) == {0, 1}
                assert prefetch.wait_seconds[1] > 0.03
                for j in (0, 1):
                    assert rows[j].shape == (2, 3, 6, DIM)
                    assert same_bits(rows[j], device.gather(hash_ids[:, :, j]))
            assert prefetcher.stats.prefetches == 2
            assert prefetcher.stats.waits == {0: 2, 1: 2}
            assert prefetcher.stats.wait_seconds[1] > 2 * 0.03
            assert prefetcher.stats.rows_gathered == 2 * hash_ids.numel()
            with pytest.raises(EngramTableError, match="no layer position 2"):
                prefetch.rows(2)
            with pytest.raises(EngramTableError, match=r"hash ids \[B, S, L=2, C\]"):
                prefetcher.submit(hash_ids[:, :, :1])


def test_prefetch_errors_are_table_errors(table_bytes, table_file, monkeypatch):
    weight, scale = table_bytes
    with DiskTable.open(table_file, ROWS, DIM, FINGERPRINT) as disk:
        tables = {0: _BrokenTable(HostTable(weight, scale), 0.0), 1: disk}
        with EngramPrefetcher(tables) as prefetcher:
            prefetch = prefetcher.submit(random_ids((1, 2, 2, 6), ROWS))
            with pytest.raises(EngramTableError, match="layer position 0 failed: RuntimeError: device lost"):
                prefetch.rows(0)
            # a file read error in the background arrives as the table's own error
            monkeypatch.setattr("openflash.memory.tiers.disk.os.pread", _bad_sector)
            prefetch = prefetcher.submit(random_ids((1, 2, 2, 6), ROWS))
            with pytest.raises(EngramTableError, match=f"{table_file}: read error"):
                prefetch.rows(1)


def test_speculate_warms_disk_caches(table_bytes, table_file):
    weight, scale = table_bytes
    with DiskTable.open(table_file, ROWS, DIM, FINGERPRINT, cache_bytes=100 * RECORD) as disk:
        tables = {0: HostTable(weight, scale), 1: disk}
        candidates = torch.tensor([[[[1, 2, 3], [10, 11, 10]]], [[[1, 2, 3], [12, 10, 13]]]])  # [K=2, 1, L, C]
        with EngramPrefetcher(tables) as prefetcher:
            assert prefetcher.speculate(candidates).result() == 4  # rows 10..13 of layer 1
            assert prefetcher.speculate(candidates).result() == 0  # already warm
            assert disk.stats.rows_warmed == 4 and disk.stats.misses == 0
            prefetch = prefetcher.submit(candidates[:1].reshape(1, 1, 2, 3))
            prefetch.rows(1)
            assert (disk.stats.hits, disk.stats.misses) == (2, 0)
            assert prefetcher.stats.speculations == 2 and prefetcher.stats.rows_warmed == 4
