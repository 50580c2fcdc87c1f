"""A user's Python function named on the command line or in a task: `MODULE:FUNCTION` (an importable module, or a
.py file), imported once, and called under a time limit (`call_limited`)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from openflash.errors import OpenflashError


def import_function(spec: str, what: str) -> Callable[..., Any]:
    """The function `spec` names; OpenflashError naming `what` (the flag or field) when it cannot be had."""
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise OpenflashError(f"{what} must be MODULE:FUNCTION, got {spec!r}")
    module_name, function_name = spec.split(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            found = importlib.util.spec_from_file_location(path.stem, path)
            if found is None or not path.is_file():
                raise ImportError(f"no file {path}")
            module = importlib.util.module_from_spec(found)
            sys.modules[path.stem] = module
            found.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise OpenflashError(f"{what} {spec}: cannot import {module_name} ({type(exc).__name__}: {exc})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise OpenflashError(f"{what} {spec}: {module_name} has no function {function_name!r}")
    return function


@dataclass(frozen=True)
class Outcome:
    """What a limited call gave: its value, or the exception it raised (sys.exit included), or neither when it took
    longer than the limit."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


def call_limited(function: Callable[..., Any], args: tuple[Any, ...], seconds: float, name: str) -> Outcome:
    """function(*args) in a thread of its own, waited for `seconds`: a call that hangs is left behind (Python cannot
    stop a thread) and reported as timed out, and one that calls sys.exit ends that thread, not the run."""
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["value"] = function(*args)
        except BaseException as exc:  # a user's bug, or exit: the caller decides what it means
            result["error"] = exc

    worker = threading.Thread(target=call, name=name, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        return Outcome(timed_out=True)
    return Outcome(result.get("value"), result.get("error"))
