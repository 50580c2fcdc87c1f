"""LoRA adapters served beside a runtime's base model: each read and checked whole before any is attached
(model/adapters.py), with the key that salts the prefix cache per adapter."""

from __future__ import annotations

from pathlib import Path

from openflash.errors import OpenflashError
from openflash.files.manifest import folder_fingerprint, verify_manifest
from openflash.files.peft import ENGRAM_ROWS_FILE, adapter_folder, check_base, read_adapter
from openflash.model.adapters import attach_adapters
from openflash.model.lora import AdapterSelection
from openflash.model.transformer import Transformer


def served_adapters(model: Transformer, named: dict[str, str | Path], base_folder: Path | None,
                    experts_in_store: bool, verify: bool = False) -> tuple[AdapterSelection, list[int]]:
    """The adapters `named` (name -> a PEFT adapter folder, or a `train --lora` run: its latest checkpoint)
    attached to `model`, and per adapter a digest of its product (prefix-cache keys). Each is checked whole first
    (files/peft.py read_adapter: finite weights and alpha) and refused where it records another base than
    `base_folder`; verify: first each folder against its checksums.sha256. experts_in_store: the routed experts
    are read from an expert store, which adapters of routed experts cannot reach."""
    loaded, keys = {}, []
    base_fingerprint: str | None = None  # computed once, for the first adapter that records its base
    for name, path in named.items():
        try:
            folder = adapter_folder(path)
            if verify:
                verify_manifest(folder)
            if (folder / ENGRAM_ROWS_FILE).is_file():
                raise OpenflashError(f"{folder} also trained Engram rows ({ENGRAM_ROWS_FILE}), which adapters "
                                     f"served per request do not carry; serve `openflash lora merge` of it")
            adapter = read_adapter(folder)
            if adapter.base is not None and base_fingerprint is None and base_folder is not None:
                base_fingerprint = folder_fingerprint(base_folder)
            check_base(adapter, folder, base_folder, base_fingerprint)
        except OpenflashError as exc:
            raise OpenflashError(f"--lora {name}: {exc}") from None
        loaded[name] = adapter
        keys.append(int(adapter.key[:14], 16))  # salts the prefix cache: config and weights alike
    experts = [(n, m) for n, a in loaded.items() for m in a.weights if ".ffn.experts." in m]
    if experts and experts_in_store:
        raise OpenflashError(f"--lora: adapter {experts[0][0]!r} adapts routed experts ({experts[0][1]}, ...), "
                             f"which this run reads from an expert store: serve it with the experts in the "
                             f"model (--expert-placement device)")
    try:
        return attach_adapters(model, loaded), keys
    except ValueError as exc:
        raise OpenflashError(f"--lora: {exc} (an adapter trained on another model?)") from None


__all__ = ["served_adapters"]
