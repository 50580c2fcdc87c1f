"""Moving a runtime's Engram tables to another tier (memory/placement.py): host and disk hold FP8 rows (fp32 tables
are quantized first); tables a checkpoint load left unread (`skip_engram_tables`) come straight from the
checkpoint: the host tier reads them into (pinned) RAM, the disk tier exports them. The disk tier reads
`table_dir`, else the checkpoint folder's `engram_tables/`, else table files exported into a scratch folder the
runtime removes when it closes."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from openflash.errors import OpenflashError
from openflash.files.manifest import verify_manifest
from openflash.memory.checkpoint_tables import export_engram_tables
from openflash.memory.placement import EngramMemory
from openflash.memory.table_file import table_file_name, write_table_file
from openflash.model.transformer import Transformer

log = logging.getLogger("openflash.runtime")


def placed_memory(model: Transformer, current: EngramMemory, folder: Path | None, placement: str, *,
                  table_dir: str | Path | None, cache_bytes: int, io_threads: int,
                  verify: bool) -> tuple[EngramMemory, tempfile.TemporaryDirectory | None]:
    """A new Engram memory of `model` on tier `placement`, addressed as `current` is (its frontend), and the
    scratch folder of tables exported for it (None: none written). `folder`: the checkpoint the model came from."""
    if placement == "sharded":
        raise OpenflashError("Engram placement 'sharded' splits the tables over a torch.distributed group, which "
                             "`generate` and `serve` do not set up (with or without --expert-parallel): use host "
                             "or disk")
    unread = folder is not None and any(t.weight.device.type == "meta" for t in model.engram_tables().values())
    if not unread:
        quantized = model.quantize_engram_tables()
        if quantized:
            log.info("Engram layers %s: fp32 tables quantized to FP8 rows for the %s tier", quantized, placement)
    kwargs: dict[str, Any] = {}
    scratch = None
    if placement == "disk" and current.layer_ids:
        tables, scratch = _table_dir(model, current, folder, table_dir, verify, unread)
        kwargs = dict(table_dir=str(tables), cache_bytes=cache_bytes, io_threads=io_threads)
    elif placement == "host" and unread:
        kwargs = dict(checkpoint_dir=folder)
    elif placement == "device" and unread:
        raise OpenflashError("the Engram tables were left in the checkpoint at load (another tier was chosen); "
                             "load the model again with --engram-placement device")
    return EngramMemory.attach(model, placement, frontend=current.frontend, **kwargs), scratch


def _table_dir(model: Transformer, current: EngramMemory, folder: Path | None, given: str | Path | None,
               verify: bool, unread: bool) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    if given is not None and not Path(given).is_dir():
        raise OpenflashError(f"--engram-table-dir {given}: not a folder (write one with `openflash engram export`)")
    tables = Path(given) if given is not None else (folder / "engram_tables" if folder else None)
    if tables is not None and tables.is_dir():
        if verify:
            log.info("%s", verify_manifest(tables).summary())
        return tables, None
    scratch = tempfile.TemporaryDirectory(prefix="openflash-engram-")
    out = Path(scratch.name)
    if unread:  # the tables never entered the model: straight from the checkpoint's files
        export_engram_tables(folder, out)
    else:
        fingerprint = current.frontend.layout.layout_fingerprint()
        weights = model.engram_tables()
        for slot, lid in enumerate(model.cfg.engram_layer_ids):
            write_table_file(out / table_file_name(lid), weights[slot].weight.detach().cpu(),
                             weights[slot].scale.detach().cpu(), fingerprint)
    log.info("Engram tables exported to %s for the disk tier (the model has no engram_tables folder)", out)
    return out, scratch


__all__ = ["placed_memory"]
