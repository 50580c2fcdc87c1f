"""`openflash experiment`: the release's and the Engram paper's claims, reproduced at small scale.

    scale.py    how big (model width, tokens, seeds, data): one Scale for every arm of every study
    arms.py     the compared model configs and their parameter / FLOP accounting (iso checks)
    plan.py     which arms each study trains
    runs.py     data preparation and cached, resumable training runs; a sweep runs several at once
    probes.py   measurements on trained models (LogitLens, CKA, top-k agreement, replay NLL)
    offload.py  the Engram offload throughput A/B
    studies.py  the six studies: runs + measurements -> a results dict
    report.py   plots and markdown summaries from a results dict
    stats.py    seed statistics (mean, spread, t intervals)
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from openflash.errors import OpenflashError
from openflash.experiments.plan import STUDY_ARMS, STUDY_NAMES, run_specs
from openflash.experiments.report import plot, summary
from openflash.experiments.runs import prepare_data, run_all
from openflash.experiments.scale import Scale, get_scale
from openflash.experiments.studies import STUDIES, StudyContext


def resolve_scale(name: str, seeds: int | None = None) -> Scale:
    scale = get_scale(name)
    if seeds is not None:
        if seeds < 2:
            raise OpenflashError(f"--seeds must be at least 2 (the spread over seeds is the noise level), got {seeds}")
        scale = replace(scale, seeds=seeds)
    return scale


def run_experiments(names: list[str], scale: Scale, out: Path, results: Path, jobs: int = 1,
                    command: str = "", say: Callable[[str], None] = print) -> dict[str, dict]:
    """Train what the studies need (cached), then run each study and write RESULTS/NAME.{json,png,md}.

    A study's results are reused when its inputs (the scale and the keys of the runs it reads) are unchanged."""
    from openflash.train.distributed import DistContext

    unknown = [n for n in names if n not in STUDY_NAMES]
    if unknown:
        raise OpenflashError(f"unknown experiment(s) {unknown}; choose from {list(STUDY_NAMES)} or 'all'")
    if jobs < 1:
        raise OpenflashError(f"--jobs must be >= 1, got {jobs}")
    ctx = DistContext.current()
    if ctx.enabled:
        jobs = 1  # under torchrun each run is data parallel over the ranks instead
    out, results = Path(out), Path(results)
    if ctx.is_main:
        data = prepare_data(out, scale, say)
    ctx.barrier()
    if not ctx.is_main:  # rank 0 wrote it: a finished preparation only reads
        data = prepare_data(out, scale, say=lambda _: None)
    specs = run_specs(names, scale, data)
    say(f"scale {scale.name}: {scale.steps} steps x {scale.batch_size} x {scale.seq_len} tokens = "
        f"{scale.tokens_per_run:,} tokens per run, {scale.seeds} seeds; arms {list(specs)}")
    seed_major = [s for seeds in zip(*specs.values()) for s in seeds] if specs else []
    trained = run_all(seed_major, out, jobs, say)
    if not ctx.is_main:
        return {}
    study_ctx = StudyContext(scale, out, data, {arm: [trained[s] for s in runs] for arm, runs in specs.items()},
                             say, configs={arm: runs[0].config for arm, runs in specs.items()})
    results.mkdir(parents=True, exist_ok=True)
    done = {}
    for name in names:
        arms = {arm: [r["key"] for r in study_ctx.runs[arm]] for arm in STUDY_ARMS[name]}
        inputs = hashlib.sha256(json.dumps({"scale": scale.as_dict(), "runs": arms, "data": data.fingerprint},
                                           sort_keys=True).encode()).hexdigest()[:16]
        path = results / f"{name}.json"
        if path.is_file() and json.loads(path.read_text()).get("inputs") == inputs:
            say(f"{name}: cached ({path})")
            done[name] = json.loads(path.read_text())
            continue
        start = time.monotonic()
        say(f"{name}: measuring")
        result = STUDIES[name](study_ctx)
        record = {"study": name, "command": command, "scale": scale.as_dict(), "inputs": inputs,
                  "seconds": round(time.monotonic() - start, 1), "result": result,
                  "run_seconds": {arm: [r["seconds"] for r in study_ctx.runs[arm]] for arm in STUDY_ARMS[name]}}
        path.write_text(json.dumps(record, indent=1) + "\n")
        plot(name, result, results / f"{name}.png")
        (results / f"{name}.md").write_text(summary(name, result) + "\n")
        say(summary(name, result))
        done[name] = record
    return done


__all__ = ["run_experiments", "resolve_scale", "STUDY_NAMES"]
