"""`openflash plan` reproduces the spec's numbers for the released config (numbers.md)."""

from __future__ import annotations

import subprocess
import sys

from openflash.tools.plan import build_plan


def test_released_numbers():
    plan = build_plan("flash", context=1_048_576)
    assert plan.params_backbone == 551_880_850_544
    assert plan.params_engram_tables == 196_613_849_600
    assert plan.params_dspark == 14_225_362_530
    assert plan.params_vision == 485_253_120
    assert plan.params_total == 763_205_315_794
    assert plan.active_prefill_token == 8_554_801_336
    assert plan.active_decode_token == 16_792_509_552
    assert plan.kv_bytes_per_token == 890
    assert plan.window_bytes_per_sequence == 2_906_112  # 43 rings x 128 x 528 B, DSpark stages included
    assert plan.bytes_by_location["host"] == 202_758_032_400  # Engram tables, FP8 rows + UE8M0 scales


def test_cli_tiny_json():
    out = subprocess.run([sys.executable, "-m", "openflash.cli", "plan", "tiny", "--json", "--context", "4096"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"kv_bytes_per_token"' in out.stdout
