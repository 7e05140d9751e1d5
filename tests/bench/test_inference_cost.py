"""benchmarks.heads.inference_cost at tiny shapes: every timing run records the machine's load."""

from __future__ import annotations

import json

import torch

from benchmarks.heads import inference_cost


def tiny(monkeypatch):
    monkeypatch.setattr(inference_cost, "D_MODEL", 8)
    monkeypatch.setattr(inference_cost, "VOCAB", 64)
    return ["--threads", str(torch.get_num_threads())]


def test_every_timing_run_records_the_load_average_before_and_after(tmp_path, monkeypatch):
    threads = tiny(monkeypatch)
    assert inference_cost.main(["--rows", "1,2", "--repeats", "1", "--out", str(tmp_path),
                                *threads]) == 0  # fmt: skip
    record = json.loads((tmp_path / "log_prob.json").read_text())
    assert set(record["load_average"]) == {"1", "2"} == set(record["rows"])
    for load in record["load_average"].values():
        for when in ("before", "after"):
            assert len(load[when]) == 3 and all(value >= 0 for value in load[when])
    table = (tmp_path / "log_prob.md").read_text()
    assert "Load average (1 / 5 / 15 min" in table and "2 rows:" in table

    assert inference_cost.main(["--profile", "2", "--out", str(tmp_path), *threads]) == 0
    profile = json.loads((tmp_path / "profile-2.json").read_text())
    assert len(profile["load_average"]["before"]) == 3
    assert "Load average" in (tmp_path / "profile-2.md").read_text()


def test_the_load_reads_not_available_where_the_platform_keeps_none(monkeypatch):
    def missing():
        raise OSError("no load average here")

    monkeypatch.setattr(inference_cost.os, "getloadavg", missing)
    assert inference_cost.load_average() is None
    line = inference_cost.load_line({"256 rows": {"before": None, "after": [0.5, 0.25, 1.0]}})
    assert line == ("Load average (1 / 5 / 15 min, `os.getloadavg()`): 256 rows: not available "
                    "before, 0.50 / 0.25 / 1.00 after.\n")  # fmt: skip
