"""Checksum manifests: `checksums.sha256` beside the files a checkpoint save or a table export writes.

The format is `sha256sum`'s (`<hex digest>  <file name>` per line), so `sha256sum -c checksums.sha256` checks a
folder as well as `openflash verify` does. Loading never hashes unless asked (`--verify`): hashing reads every
byte, minutes for the released checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from openflash.errors import OpenflashError

MANIFEST_FILE = "checksums.sha256"
_READ_BYTES = 8 << 20


def file_sha256(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            digest.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return digest.hexdigest()


def _listed_files(folder: Path) -> list[Path]:
    """The regular files a manifest covers: everything at the folder's top level but the manifest and leftovers
    of interrupted writes (`*.tmp`, `*.partial`, hidden files)."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE
                  and not p.name.startswith(".") and not p.name.endswith((".tmp", ".partial")))


def write_manifest(folder: str | Path) -> Path:
    """Hash the folder's files into `checksums.sha256` (written atomically); returns its path."""
    folder = Path(folder)
    lines = [f"{file_sha256(p)}  {p.name}\n" for p in _listed_files(folder)]
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=MANIFEST_FILE, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.writelines(lines)
    os.replace(tmp, folder / MANIFEST_FILE)
    return folder / MANIFEST_FILE


def read_manifest(folder: Path) -> dict[str, str]:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise OpenflashError(f"{folder}: no {MANIFEST_FILE} to verify against (openflash writes one with every "
                             f"checkpoint and table export; `openflash verify --write {folder}` records one for a "
                             f"folder you trust)")
    entries: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        digest, sep, name = line.partition("  ")
        name = name.removeprefix("*")  # sha256sum's binary-mode marker
        if not sep or len(digest) != 64 or not name or "/" in name or name in (".", ".."):
            raise OpenflashError(f"{path}:{number}: not a '<sha256>  <file name>' line: {line[:100]!r}")
        entries[name] = digest.lower()
    return entries


@dataclass
class VerifyReport:
    folder: Path
    files: int
    bytes: int

    def summary(self) -> str:
        return f"{self.folder}: {self.files} files ({self.bytes / 2**20:.1f} MiB) match {MANIFEST_FILE}"


def verify_manifest(folder: str | Path, on_bytes: Callable[[int], None] | None = None) -> VerifyReport:
    """Check every file the manifest lists; an OpenflashError names each missing or changed file."""
    folder = Path(folder)
    entries = read_manifest(folder)
    bad: list[str] = []
    total = 0
    for name, want in entries.items():
        path = folder / name
        if not path.is_file():
            bad.append(f"{path}: missing")
            continue
        total += path.stat().st_size
        if file_sha256(path, on_bytes) != want:
            bad.append(f"{path}: sha256 differs from {MANIFEST_FILE} (the file changed or is damaged)")
    if bad:
        raise OpenflashError(f"{folder}: {len(bad)} of {len(entries)} files fail verification: " + "; ".join(bad))
    return VerifyReport(folder, len(entries), total)


_SAMPLE_BYTES = 1 << 20


def folder_fingerprint(folder: str | Path) -> str:
    """Which checkpoint a folder holds, cheaply: config.json and, of each weight file, its name, size and three
    sampled MiB (start, middle, end). Not an integrity check (`verify_manifest` is): it tells two checkpoints apart,
    a training run's steps included, without reading the weights, and does not change when a manifest is added."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and (p.suffix == ".safetensors"
                                                                         or p.name == "config.json")):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            for start in sorted({0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)}):
                f.seek(start)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()
