"""`openflash plan --memory`: a placement that fits, refused clearly when nothing does, and runs that respect it
(placement_plan.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from openflash.errors import OpenflashError
from openflash.sizes import parse_size
from openflash.tools.placement_plan import WORK_RESERVE, GiB, StoredModel, plan_placement
from openflash.tools.synth import synthesize


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openflash.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_released_model_on_smaller_machines():
    flash = StoredModel.of("flash")  # (the released model built on meta: once, not per plan)
    small = plan_placement(flash, 24 * GiB, context=65536)
    assert small.where == {"dense": "host", "kv": "host", "experts": "disk", "engram": "disk"}
    assert 0 < small.expert_cache_bytes < 24 * GiB and small.run_settings()["expert_placement"] == "disk"
    big = plan_placement(flash, 1024 * GiB, context=65536)
    assert big.where["experts"] == "host" and big.run_settings()["expert_placement"] == "device"
    assert big.tokens_per_second > small.tokens_per_second
    gpu = plan_placement(flash, 512 * GiB, accelerator_memory=80 * GiB, context=65536)
    assert gpu.where["dense"] == "accelerator" and gpu.where["experts"] == "host"
    assert gpu.run_settings()["expert_placement"] == "host" and gpu.expert_cache_bytes > 0
    with pytest.raises(OpenflashError, match="nothing fits: the dense weights .* but the host has 8.00 GiB"):
        plan_placement(flash, 8 * GiB)
    assert parse_size("24GiB", "--memory") == 24 * GiB and parse_size("80GB", "x") == 80 * 10 ** 9
    with pytest.raises(OpenflashError, match="is not a size"):
        parse_size("lots", "--memory")


def test_a_run_respects_the_written_placement(tmp_path):
    ckpt = tmp_path / "ckpt"
    synthesize("tiny", ckpt)
    room = WORK_RESERVE + (3 << 20)  # the dense weights (2.2 MiB) and KV fit; the routed experts (1.5 MiB) do not
    out = _cli("plan", str(ckpt), "--memory", str(room), "--context", "256", "--out", str(tmp_path / "plan.json"))
    assert out.returncode == 0, out.stderr
    run = json.loads((tmp_path / "plan.json").read_text())["run"]
    plan = json.loads((tmp_path / "plan.json").read_text())["plan"]
    assert plan["where"]["experts"] == "disk" and run["expert_placement"] == "disk" and run["weights"] == "stored"
    gen = _cli("generate", "--model", str(ckpt), "--prompt", "def f(x):", "--max-tokens", "3",
               "--placement", str(tmp_path / "plan.json"))
    assert gen.returncode == 0, gen.stderr
    assert "routed experts on disk" in gen.stdout and "weights stored" in gen.stdout
    assert f"cache {run['expert_cache_bytes']} bytes" in gen.stdout and "# experts (disk):" in gen.stdout
    clash = _cli("generate", "--model", str(ckpt), "--prompt", "x", "--placement", str(tmp_path / "plan.json"),
                 "--expert-placement", "host")
    assert clash.returncode == 2 and "give one or the other" in clash.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    bad = _cli("generate", "--model", str(ckpt), "--prompt", "x", "--placement", str(broken))
    assert bad.returncode == 2 and "not a placement written by `openflash plan --out`" in bad.stderr
    none = _cli("plan", "tiny", "--memory", "1GiB")  # (the released model is refused the same way, test above)
    assert none.returncode == 2 and "nothing fits" in none.stderr and "Traceback" not in none.stderr
