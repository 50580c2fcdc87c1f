"""A decode step replayed as a CUDA graph: the launches of a step recorded once, then replayed with one call.

The decode graph (decode_graph.py) is one compiled program, but on a GPU the hundreds of kernel launches it makes,
not their arithmetic, are a small model's step. A CUDA graph records those launches and replays them; what it
needs is that every tensor a step touches sits at the same address on every replay:

- what is new each step (the token ids, the Engram rows) is copied into input buffers the recording owns;
- the cache is read and written where it lies, so a recording serves one cache as laid out then: every tensor and
  container reachable from it (`bindings`), checked by identity before each replay. A cache of the same structure
  and shapes (the engine's batch regrouped at the same padded size) takes the recording over (`take_over`): its
  values are copied into the recorded tensors, which it then holds, and a cache still holding them keeps copies.
  When a shape changes (a new batch size, a compressed store grown into its next capacity bucket) the step is
  recorded again;
- the step's Python code rebinds a few cache attributes to new tensors (`cache.pos = cache.pos + 1`): inside the
  recording, each new value is copied back into the tensor the cache held before, which is bound again, so after
  every replay the cache holds the same tensors, advanced by one token.

Recording does not run anything, so a step at shapes not seen before first runs normally (compiling what it needs,
outside any recording); the next step at those shapes is recorded, then replayed. A recording that fails (an
operation CUDA graphs cannot hold, a structural change inside the step) restores the cache's bindings, which is
all it touched, logs why, and turns recording off: the step runs as compiled code from then on (what failed once,
a host-to-device copy say, fails at every shape). What records is a `Recorder`: CUDA graphs (`CudaRecorder`), or in
the tests a stand-in on the CPU that replays the recorded body as Python, on the cache that holds the recording.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

log = logging.getLogger("openflash.model")

MAX_RECORDINGS = 16  # shapes kept recorded (the least recently used is dropped); they share one memory pool


class NotRecordable(Exception):
    """The step cannot be recorded as it is (the reason says why)."""


class Recorder(Protocol):
    """Records `body` (a step and its bookkeeping) once; returns what replays it and the body's output, which each
    replay overwrites."""

    def record(self, body: Callable[[], torch.Tensor], device: torch.device) -> tuple[Callable[[], None],
                                                                                     torch.Tensor]: ...


class CudaRecorder:
    """CUDA graphs, every recording in one memory pool (the recordings never run at the same time)."""

    def __init__(self) -> None:
        self._pool: Any = None

    def record(self, body: Callable[[], torch.Tensor], device: torch.device) -> tuple[Callable[[], None],
                                                                                     torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(device)
        with torch.cuda.graph(graph, pool=self._pool):
            out = body()
        return graph.replay, out


@dataclass(frozen=True)
class Binding:
    """One object held by a container of the cache: holder[key] or holder.key."""

    holder: Any
    key: Any
    value: Any

    def current(self) -> Any:
        return self.holder[self.key] if isinstance(self.holder, (dict, list)) else getattr(self.holder, self.key)

    def bind(self, value: Any) -> None:
        if isinstance(self.holder, (dict, list)):
            self.holder[self.key] = value
        else:
            setattr(self.holder, self.key, value)


def bindings(root: Any, skip: tuple[str, ...] = ()) -> list[Binding]:
    """Every tensor and container reachable from `root` through attributes, dicts and lists, with where it is held
    (root's attributes named in `skip` left out). Tuples holding tensors are refused: a rebinding inside one could
    not be undone."""
    out: list[Binding] = []
    seen: set[int] = set()
    stack: list[Any] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, list):
            items = list(enumerate(obj))
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
            items = [(k, v) for k, v in vars(obj).items() if not (obj is root and k in skip)]
        else:
            continue
        for key, value in items:
            if isinstance(value, torch.Tensor):
                out.append(Binding(obj, key, value))
            elif isinstance(value, tuple):
                if any(isinstance(v, torch.Tensor) for v in value):
                    raise NotRecordable(f"a tuple of tensors at {type(obj).__name__}.{key}")
            elif isinstance(value, (dict, list)) or (hasattr(value, "__dict__") and not isinstance(value, type)):
                out.append(Binding(obj, key, value))
                stack.append(value)
    return out


def take_over(recorded: list[Binding], layout: list[Binding]) -> list[Binding] | None:
    """Move a recording's tensors to another cache of the same structure (`layout`, its bindings): each of its
    tensors is copied into the recorded one at the same place, which it then holds; a holder of the recorded cache
    that still holds a recorded tensor gets a copy of it instead (a cache stepped again later keeps its state).
    A tensor both caches hold at the same place (a block pool's planes) stays shared. Returns the recording's new
    layout, or None where the structures differ (a tensor held in two places must be so in both)."""
    if len(recorded) != len(layout):
        return None
    pairs: dict[int, int] = {}  # recorded tensor -> its counterpart, and back: one to one
    for r, b in zip(recorded, layout):
        if r.key != b.key or type(r.holder) is not type(b.holder) or type(r.value) is not type(b.value):
            return None
        if isinstance(b.value, torch.Tensor):
            if (b.value.shape, b.value.dtype, b.value.device) != (r.value.shape, r.value.dtype, r.value.device):
                return None
            if pairs.setdefault(id(r.value), id(b.value)) != id(b.value) or \
                    pairs.setdefault(-1 - id(b.value), id(r.value)) != id(r.value):
                return None
    ours = {id(r.value) for r in recorded if isinstance(r.value, torch.Tensor)}
    if any(isinstance(b.value, torch.Tensor) and b.value is not r.value and id(b.value) in ours
           for r, b in zip(recorded, layout)):
        return None  # a recorded tensor held elsewhere by the new cache: no copy order is safe
    copies: dict[int, torch.Tensor] = {}
    for r, b in zip(recorded, layout):  # first the old holders keep their state (aliases stay aliases)
        if isinstance(r.value, torch.Tensor) and b.value is not r.value and r.current() is r.value:
            r.bind(copies.setdefault(id(r.value), r.value.clone()))
    moved = []
    for r, b in zip(recorded, layout):
        if isinstance(b.value, torch.Tensor) and b.value is not r.value:
            r.value.copy_(b.value)
            b.bind(r.value)
            moved.append(Binding(b.holder, b.key, r.value))
        else:
            moved.append(b)
    return moved


@dataclass
class _Recording:
    ids: torch.Tensor  # input buffers, copied into before each replay
    rows: dict[int, torch.Tensor] | None
    cache: Any  # the cache that holds the recorded tensors now
    layout: list[Binding]  # its bindings: the recorded tensors and where it holds them
    replay: Callable[[], None] = lambda: None  # (set by the recorder)
    logits: torch.Tensor | None = None  # the step's output, overwritten by each replay

    def fits(self, ids: torch.Tensor, rows: dict[int, torch.Tensor] | None) -> bool:
        if ids.shape != self.ids.shape or (rows is None) != (self.rows is None):
            return False
        if rows is not None and any(rows[s].shape != t.shape for s, t in self.rows.items()):
            return False
        return all(b.current() is b.value for b in self.layout)


class CudaGraphStep:
    """Runs `step(model, ids, cache, rows)` through CUDA graph recordings (module doc); `rows` is a mapping
    slot -> tensor wrapped by `wrap_rows` before the step sees it."""

    def __init__(self, step: Callable[..., torch.Tensor], wrap_rows: Callable[[dict[int, torch.Tensor]], Any],
                 skip: tuple[str, ...] = (), recorder: Recorder | None = None) -> None:
        self.step, self.wrap_rows, self.skip = step, wrap_rows, skip
        self.recorder = CudaRecorder() if recorder is None else recorder
        self._recordings: OrderedDict[tuple, _Recording] = OrderedDict()
        self._warm: set[tuple] = set()  # shapes a step has run at (compiled there)
        self.off: str | None = None  # why recording was turned off (a recording failed), or None
        self.replays = 0
        self.recorded = 0
        self.taken_over = 0  # recordings moved to another cache of the same shapes

    def __call__(self, model: Any, ids: torch.Tensor, cache: Any, rows: dict[int, torch.Tensor] | None
                 ) -> torch.Tensor:
        if self.off is not None:
            return self._plain(model, ids, cache, rows)
        for key, rec in reversed(self._recordings.items()):
            if rec.fits(ids, rows):
                return self._replay(key, rec, ids, rows)
        try:
            layout = bindings(cache, self.skip)
        except NotRecordable as exc:
            return self._turn_off(str(exc), model, ids, cache, rows)
        shapes = (tuple(ids.shape), tuple(sorted((s, tuple(t.shape)) for s, t in (rows or {}).items())),
                  tuple(tuple(b.value.shape) for b in layout if isinstance(b.value, torch.Tensor)))
        for key, rec in reversed(self._recordings.items()):
            moved = take_over(rec.layout, layout) if key[0] == shapes else None
            if moved is not None:
                rec.cache, rec.layout = cache, moved
                self.taken_over += 1
                return self._replay(key, rec, ids, rows)
        if shapes not in self._warm:
            self._warm.add(shapes)
            return self._plain(model, ids, cache, rows)
        try:
            rec = self._record(model, ids, cache, rows, layout)
        except Exception as exc:  # nothing ran: the cache's bindings are back as they were
            return self._turn_off(f"{type(exc).__name__}: {exc}", model, ids, cache, rows)
        key = (shapes, id(rec))
        self._recordings[key] = rec
        while len(self._recordings) > MAX_RECORDINGS:
            self._recordings.popitem(last=False)
        return self._replay(key, rec, ids, rows)

    def _replay(self, key: tuple, rec: _Recording, ids: torch.Tensor, rows: dict[int, torch.Tensor] | None
                ) -> torch.Tensor:
        self._recordings.move_to_end(key)
        rec.ids.copy_(ids)
        if rows is not None:
            for slot, buffer in rec.rows.items():
                buffer.copy_(rows[slot])
        rec.replay()
        self.replays += 1
        return rec.logits.clone()

    def _plain(self, model: Any, ids: torch.Tensor, cache: Any, rows: dict[int, torch.Tensor] | None
               ) -> torch.Tensor:
        return self.step(model, ids, cache, None if rows is None else self.wrap_rows(rows))

    def _turn_off(self, why: str, model: Any, ids: torch.Tensor, cache: Any,
                  rows: dict[int, torch.Tensor] | None) -> torch.Tensor:
        self.off = why
        self._recordings.clear()
        log.warning("decode steps are not recorded as CUDA graphs (%s); they run as compiled code", why)
        return self._plain(model, ids, cache, rows)

    def _record(self, model: Any, ids: torch.Tensor, cache: Any, rows: dict[int, torch.Tensor] | None,
                layout: list[Binding]) -> _Recording:
        rec = _Recording(ids.clone(), None if rows is None else {s: t.clone() for s, t in rows.items()}, cache, layout)

        def body() -> torch.Tensor:  # (a CUDA recording runs it once; `rec` names the cache that holds it now)
            logits = self.step(model, rec.ids, rec.cache, None if rec.rows is None else self.wrap_rows(rec.rows))
            for b in rec.layout:  # rebound by the step: copied back into the tensor the cache held
                now = b.current()
                if now is b.value:
                    continue
                if not (isinstance(now, torch.Tensor) and isinstance(b.value, torch.Tensor)
                        and now.shape == b.value.shape and now.dtype == b.value.dtype):
                    raise NotRecordable(f"the step replaced {type(b.holder).__name__}.{b.key}")
                b.value.copy_(now)
                b.bind(b.value)
            if len(bindings(rec.cache, self.skip)) != len(rec.layout):
                raise NotRecordable("the step changed the cache's structure")
            return logits

        try:
            rec.replay, rec.logits = self.recorder.record(body, ids.device)
        except Exception:
            for b in layout:
                b.bind(b.value)
            raise
        self.recorded += 1
        return rec


__all__ = ["CudaGraphStep", "CudaRecorder", "Recorder", "bindings", "take_over", "Binding", "NotRecordable",
           "MAX_RECORDINGS"]
