"""`openflash experiment`: the arms' accounting, the cached and resumable sweep, every study end to end (at the
test scale, where the numbers mean nothing but every code path runs)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from openflash.cli import main
from openflash.errors import OpenflashError
from openflash.experiments import STUDY_NAMES, resolve_scale, run_experiments
from openflash.experiments.arms import (FLOP_TOLERANCE, PARAM_TOLERANCE, account, all_full_config, check_iso,
                                        engram_config, moe_config)
from openflash.experiments.plan import RHOS, run_specs
from openflash.experiments.runs import RESULT_FILE, prepare_data, train_run
from openflash.experiments.scale import SCALES
from openflash.experiments.stats import summarize
from openflash.train.trainer import Trainer


@pytest.mark.parametrize("scale", ["cpu", "large", "test"])
def test_engram_arms_match_the_moe_reference_in_parameters_and_active_flops(scale: str) -> None:
    s = SCALES[scale]
    reference = account(moe_config(s, s.vocab_size))
    for rho in RHOS:
        arm = account(engram_config(s, s.vocab_size, rho))
        assert abs(arm.total - reference.total) <= PARAM_TOLERANCE * reference.total
        assert abs(arm.active_per_token - reference.active_per_token) <= FLOP_TOLERANCE * reference.active_per_token
        assert arm.routed_experts == round((1 - rho) * reference.routed_experts)
        assert arm.engram_tables > 0
    lines = check_iso(reference, {"moe": reference, "rho": account(engram_config(s, s.vocab_size, 0.25))})
    assert len(lines) == 3


def test_accounting_refuses_arms_that_are_not_comparable() -> None:
    s = SCALES["cpu"]
    reference = account(moe_config(s, s.vocab_size))
    with pytest.raises(OpenflashError, match="all-full: total parameters differ"):
        check_iso(reference, {"all-full": account(all_full_config(s, s.vocab_size))})
    with pytest.raises(OpenflashError, match="multiple of 1/16"):
        engram_config(s, s.vocab_size, 0.3)
    with pytest.raises(OpenflashError, match="fewer than the 2 each token uses"):
        engram_config(s, s.vocab_size, 0.9375)


def test_seed_statistics() -> None:
    s = summarize([1.0, 2.0, 3.0])
    assert (s.mean, s.std) == (2.0, 1.0)
    assert (s.ci_low, s.ci_high) == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)))
    one = summarize([5.0])
    assert one.std == 0.0 and math.isnan(one.ci_low)


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(OpenflashError, match="--seeds must be at least 2"):
        resolve_scale("test", seeds=1)
    with pytest.raises(OpenflashError, match="unknown --scale 'huge'"):
        resolve_scale("huge")
    with pytest.raises(OpenflashError, match="unknown experiment"):
        run_experiments(["engram-vs-dense"], SCALES["test"], Path("/nonexistent"), Path("/nonexistent"))
    assert main(["experiment", "no-such-study", "--scale", "test", "--out", "/nonexistent"]) != 0


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path: Path, monkeypatch) -> None:
    scale = replace(SCALES["test"], steps=6)
    data = prepare_data(tmp_path / "a", scale, say=lambda _: None)
    spec = run_specs(["replay"], scale, data)["engram-rho0.25"][0]
    monkeypatch.setattr("openflash.experiments.runs.SAVE_EVERY", 3)
    original = Trainer.train_step

    def stop_after_three(self: Trainer) -> dict:
        record = original(self)
        if self.step == 3:
            self.request_stop()
        return record

    monkeypatch.setattr(Trainer, "train_step", stop_after_three)
    with pytest.raises(OpenflashError, match="interrupted at step 3; run the study again"):
        train_run(spec, tmp_path / "a", threads=1)
    assert not (spec.folder(tmp_path / "a") / RESULT_FILE).exists()
    monkeypatch.setattr(Trainer, "train_step", original)
    resumed = train_run(spec, tmp_path / "a", threads=1)  # the thread count of the fresh run: same rounding
    fresh_data = prepare_data(tmp_path / "b", scale, say=lambda _: None)
    fresh_spec = run_specs(["replay"], scale, fresh_data)["engram-rho0.25"][0]
    fresh = train_run(fresh_spec, tmp_path / "b", threads=1)
    assert resumed["steps"] == fresh["steps"] == 6
    assert resumed["val_loss"] == pytest.approx(fresh["val_loss"], abs=1e-4)


@pytest.fixture(scope="module")
def all_studies(tmp_path_factory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("experiments")
    out, results = root / "runs", root / "results"
    done = run_experiments(list(STUDY_NAMES), SCALES["test"], out, results, jobs=2, say=lambda _: None)
    return out, results, done


def test_every_study_writes_results_plots_and_a_summary(all_studies) -> None:
    out, results, done = all_studies
    for name in STUDY_NAMES:
        record = json.loads((results / f"{name}.json").read_text())
        assert record["study"] == name and record["scale"]["name"] == "test"
        assert (results / f"{name}.png").stat().st_size > 1000
        assert "|" in (results / f"{name}.md").read_text()
    r = done["engram-vs-moe"]["result"]
    assert set(r["arms"]) == {"moe", "engram-rho0.25"}
    assert all(len(a["val_loss"]) == 2 and all(math.isfinite(v) for v in a["val_loss"]) for a in r["arms"].values())
    assert r["engram_minus_moe"]["per_seed"] == pytest.approx(
        [e - m for e, m in zip(r["arms"]["engram-rho0.25"]["val_loss"], r["arms"]["moe"]["val_loss"])])
    alloc = done["allocation"]["result"]
    assert [p["rho"] for p in alloc["points"]] == [0.0, *RHOS]
    depth = done["depth-probe"]["result"]
    assert len(depth["cka"]) == 8 and all(0 <= c <= 1 + 1e-9 for row in depth["cka"] for c in row)
    reuse = done["reuse"]["result"]
    assert [p["layer"] for p in reuse["topk_agreement"]] == [3, 5, 6, 7]
    assert all(0 <= p["mean"] <= 1 for p in reuse["topk_agreement"])
    replay = done["replay"]["result"]
    assert [p["prompt_len"] for p in replay["by_length"]] == list(SCALES["test"].replay_lengths)
    offload = done["offload"]["result"]
    assert set(offload["tiers"]) == {"device", "host", "disk"} and len(offload["rounds"]) == 2


def test_a_second_run_reuses_every_training_run_and_result(all_studies) -> None:
    out, results, _ = all_studies
    said: list[str] = []
    run_experiments(list(STUDY_NAMES), SCALES["test"], out, results, jobs=1, say=said.append)
    assert any(line.startswith("runs: 12 cached, 0 to train") for line in said)
    assert sum(line.endswith(f"cached ({results / f'{n}.json'})") for n in STUDY_NAMES for line in said) == 6


ONE_SEED = replace(SCALES["test"], seeds=1)  # under torchrun one run shows the data parallelism (and takes half)


def _replay_on_two_ranks(ctx, out: Path, results: Path) -> None:
    run_experiments(["replay"], ONE_SEED, out, results, jobs=2, say=lambda _: None)


def test_under_torchrun_each_run_trains_data_parallel_and_rank_0_reports(tmp_path: Path) -> None:
    from openflash.train.distributed import spawn

    spawn(_replay_on_two_ranks, 2, tmp_path / "runs", tmp_path / "results")
    record = json.loads((tmp_path / "results" / "replay.json").read_text())
    assert len(record["result"]["by_length"]) == len(ONE_SEED.replay_lengths)
    runs = [json.loads(p.read_text()) for p in sorted((tmp_path / "runs" / "runs").glob(f"*/{RESULT_FILE}"))]
    assert [(r["world_size"], r["steps"]) for r in runs] == [(2, ONE_SEED.steps)]
