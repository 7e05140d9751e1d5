"""benchmarks/studies/synthetic_sweep.py on a tiny grid: cells written, reused on a rerun,
summarised."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib", reason="the sweep's figure needs matplotlib")


def test_a_tiny_sweep_writes_cells_and_a_summary_and_resumes(tmp_path, capsys):
    from benchmarks.studies import synthetic_sweep

    argv = ["--ranks", "4,8", "--dims", "2", "--seeds", "0,1", "--steps", "3",
            "--heads", "softmax,mos", "--out", str(tmp_path)]  # fmt: skip
    assert synthetic_sweep.main(argv) == 0
    cells = sorted(p.name for p in (tmp_path / "cells").iterdir())
    assert cells == [f"r{r}-d2-seed{s}.json" for r in (4, 8) for s in (0, 1)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(row["r"], row["head"]) for row in summary["rows"]] == [
        (4, "softmax"), (4, "mos"), (8, "softmax"), (8, "mos")
    ]  # fmt: skip
    softmax = [r for r in summary["rows"] if r["head"] == "softmax"]
    assert all(row["rank_mean"] <= 2 + 2 for row in softmax)  # d + 2 at most
    assert (tmp_path / "sweep.png").stat().st_size > 0
    capsys.readouterr()
    # a rerun fits nothing again: every cell is read back
    stamp = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cells").iterdir()}
    assert synthetic_sweep.main(argv) == 0
    assert "r=4" not in capsys.readouterr().out
    assert stamp == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cells").iterdir()}
