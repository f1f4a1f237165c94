"""`elasticrl plot`: real PNGs from a metrics file, errors that name the folder."""
from __future__ import annotations

import json

from elasticrl.plot import plot_run, series
from tests.conftest import run_cli


def test_plot_writes_one_png_per_metric_group(tmp_path):
    rows = [{"step": s, "loss": 1.0 / (s + 1), "eval/accuracy": s / 10, "sync/transport": "shm",
             "sync/seconds": 0.1, "nan_metric": float("nan")} for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = series(rows)
    assert "sync/transport" not in data and "nan_metric" not in data
    assert data["eval/accuracy"] == ([0, 1, 2, 3, 4], [0.0, 0.1, 0.2, 0.3, 0.4])
    files = plot_run(tmp_path)
    assert sorted(f.name for f in files) == ["eval.png", "sync.png", "train.png"]
    assert all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files)
    assert not [p for p in (tmp_path / "plots").iterdir() if p.name.startswith(".")]


def test_plot_cli_errors_name_the_folder(tmp_path):
    proc = run_cli("plot", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and f"{tmp_path}/metrics.jsonl: no metrics here" in proc.stderr
    assert "Traceback" not in proc.stderr
