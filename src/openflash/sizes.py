"""Sizes on the command line: one parser for every flag that takes bytes (`24GiB`, `512MiB`, `80GB`, `4096`)."""

from __future__ import annotations

import argparse
import re

from openflash.errors import OpenflashError

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 1 << 10, "M": 1e6, "MB": 1e6, "MIB": 1 << 20, "G": 1e9,
          "GB": 1e9, "GIB": 1 << 30, "T": 1e12, "TB": 1e12, "TIB": 1 << 40}
SIZE_HELP = "bytes: a number, or with a unit (512MiB, 8GiB, 80GB; KiB/MiB/GiB/TiB are powers of 2, KB/MB/GB/TB of 10)"


def _problem(text: str | int) -> str:
    return f"{text!r} is not a size (e.g. 24GiB, 80GB, 512MiB, 4096; at most 1 EiB)"


MAX_BYTES = 1 << 60  # an exbibyte: past any machine (and `1e400` is no size, not an overflow)


def _bytes(text: str | int) -> int | None:
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").upper() if m else ""
    if not m or unit not in _UNITS:
        return None
    value = float(m.group(1)) * _UNITS[unit]
    return int(value) if value <= MAX_BYTES else None


def parse_size(text: str | int, what: str) -> int:
    """'24GiB', '80GB', '512MiB', '1e9', 4096 -> bytes; OpenflashError naming `what` otherwise."""
    value = _bytes(text)
    if value is None:
        raise OpenflashError(f"{what}: {_problem(text)}")
    return value


def size_bytes(text: str) -> int:
    """The argparse `type` of a size flag: the value in bytes, or argparse's one-line usage error (which names the
    flag)."""
    value = _bytes(text)
    if value is None:
        raise argparse.ArgumentTypeError(_problem(text))
    return value


__all__ = ["parse_size", "size_bytes", "SIZE_HELP"]
