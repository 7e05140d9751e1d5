"""benchmarks.heads.denormals: every part writes its rows, and flushing denormals never moves
a loss (the benchmark measures each step both ways with the same random masks)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.heads import denormals


@pytest.mark.skipif(not torch.set_flush_denormal(False), reason="this CPU cannot flush denormals")
def test_the_synthetic_and_the_map_parts_write_their_rows(tiny_run, tmp_path):
    out = tmp_path / "out"
    assert denormals.main(["--vocab", "200", "--d", "16", "--tokens", "8", "--scales", "1,128",
                           "--repeats", "1", "--map-runs", str(tiny_run), "--out", str(out)]) == 0
    record = json.loads((out / "denormals.json").read_text())
    assert [(r["head"], r["scale"]) for r in record["synthetic"]] == [
        ("softmax", 1.0), ("softmax", 128.0), ("mos", 1.0), ("mos", 128.0)]
    assert record["study"] == []  # no --study-work-dir
    (row,) = record["map"]
    assert row["run"] == tiny_run.name and row["kept_s"] > 0 and row["flushed_s"] > 0
    assert row["loss_difference"] == 0.0  # flat distributions: nothing to flush
    assert all(r["loss_difference"] < 1e-6 for r in record["synthetic"])
    # a scale of 128 spreads the logits far enough that some exponentials are denormal
    assert next(r for r in record["synthetic"] if r["scale"] == 128.0 and r["head"] == "softmax"
                )["share_in_denormal_band"] > 0
    assert f"| {tiny_run.name} |" in (out / "denormals.md").read_text()
