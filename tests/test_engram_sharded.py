"""ShardedTable over 2 CPU processes (gloo): each rank gets the full rows (engram.md §5, checkpoint.md §6)."""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GOLDEN_A = Path(__file__).parent / "goldens" / "A"
WORLD = 2
ROWS, DIM = 1001, 64  # odd: the last rank's block of ceil(1001 / 2) = 501 rows ends with one padding row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str) -> None:
    from safetensors import safe_open

    from openflash.memory.tables import open_tables
    from openflash.memory.tiers.sharded import ShardedTable, shard_block_rows
    from openflash.model.engram_table import DeviceTable

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        # Same seed on both ranks: the full table and the ids are identical everywhere, as in TP inference.
        g = torch.Generator().manual_seed(0)
        weight = torch.randint(0, 256, (ROWS, DIM), generator=g, dtype=torch.uint8)
        weight[(weight & 0x7F) == 0x7F] = 0  # no NaN codes
        scale = torch.randint(100, 150, (ROWS, DIM // 32), generator=g, dtype=torch.uint8)
        ids = torch.randint(0, ROWS, (3, 4, 24), generator=g)
        ids[0, 0, :] = torch.tensor([0, ROWS - 1, 500, 501] * 6)  # both sides of the block boundary

        full = DeviceTable.from_fp8(weight, scale)
        sharded = ShardedTable.from_full(weight, scale)
        block = shard_block_rows(ROWS, WORLD)
        assert sharded.weight.shape == (block, DIM) and block == 501
        if rank == WORLD - 1:  # padding: weight 0, scale byte 127 (checkpoint.md §6)
            assert sharded.weight[-1].eq(0).all() and sharded.scale[-1].eq(127).all()
        got, want = sharded.gather(ids), full.gather(ids)
        results = {"random": torch.equal(got.view(torch.int32), want.view(torch.int32))}

        # From a checkpoint: each rank reads only its block of golden A's tables.
        tables = open_tables("sharded", layer_ids=[0, 3], num_rows=[304, 462], dim=32, checkpoint_dir=GOLDEN_A)
        with safe_open(str(GOLDEN_A / "model.safetensors"), framework="pt") as f:
            for j, lid in enumerate([0, 3]):
                ref = DeviceTable.from_fp8(f.get_tensor(f"layers.{lid}.engram.embed.weight"),
                                           f.get_tensor(f"layers.{lid}.engram.embed.scale"))
                every = torch.arange(ref.num_rows).reshape(2, -1)
                results[f"golden{lid}"] = torch.equal(tables[j].gather(every).view(torch.int32),
                                                      ref.gather(every).view(torch.int32))
                results[f"golden{lid}_local_rows"] = tables[j].weight.shape[0] == -(-ref.num_rows // WORLD)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_sharded_table_matches_full_table(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results and all(results.values()), (rank, results)
