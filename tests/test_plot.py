"""Loss plots from metrics.jsonl (openflash.train.plot)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from openflash.cli import main as cli_main
from openflash.errors import OpenflashError
from openflash.train.plot import plot_run, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(run: Path, n: int = 40) -> None:
    run.mkdir(parents=True, exist_ok=True)
    lines = [{"event": "start", "config": "small"}]
    for step in range(1, n + 1):
        lines.append({"step": step, "loss": 6.0 * math.exp(-step / 15) + 2.0, "lr": 1e-3, "tokens_per_s": 1234.5})
        if step % 10 == 0:
            lines.append({"step": step, "val_loss": 6.2 * math.exp(-step / 15) + 2.1})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")


def test_read_metrics(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "run", n=30)
    curves = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert curves.train_steps == list(range(1, 31)) and len(curves.train_loss) == 30
    assert curves.val_steps == [10, 20, 30]
    assert curves.val_loss[0] == pytest.approx(6.2 * math.exp(-10 / 15) + 2.1)


def test_plot_writes_png(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_metrics(run)
    path = plot_run(run)
    assert path == run / "loss.png"
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    custom = plot_run(run, tmp_path / "figs" / "curve.png")
    assert custom.read_bytes().startswith(PNG_MAGIC)


def test_plot_validation_only(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "val_loss": 5.5}\n{"step": 100, "val_loss": 4.0}\n')
    assert plot_run(run).read_bytes().startswith(PNG_MAGIC)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(OpenflashError, match=r"metrics file not found: .*nothing/metrics.jsonl"):
        plot_run(tmp_path / "nothing")


def test_no_loss_lines(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"event": "start"}\n{"step": 1, "lr": 0.1}\n')
    with pytest.raises(OpenflashError, match=r"metrics.jsonl has no loss lines"):
        plot_run(tmp_path)


def test_malformed_line_named(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n\n{"step": 2, "loss": \n')
    with pytest.raises(OpenflashError, match=r"metrics.jsonl:3: not valid JSON"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n[1, 2]\n')
    with pytest.raises(OpenflashError, match=r"metrics.jsonl:2: expected a JSON object"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"loss": 3.0}\n')
    with pytest.raises(OpenflashError, match=r"metrics.jsonl:1: 'loss' line needs an integer 'step'"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "val_loss": "high"}\n')
    with pytest.raises(OpenflashError, match=r"metrics.jsonl:1: 'val_loss' must be a number"):
        plot_run(tmp_path)


def test_cli_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _write_metrics(run)
    out = tmp_path / "out.png"
    assert cli_main(["plot", str(run), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC) and str(out) in capsys.readouterr().out
    assert cli_main(["plot", str(tmp_path / "missing")]) == 2
    assert "metrics file not found" in capsys.readouterr().err
