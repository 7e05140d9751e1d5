"""Smoke tests of the head benchmark at tiny shapes (the real numbers come from benchmarks/)."""

from __future__ import annotations

import json

import pytest

from highrank.bench import heads as bench


def test_every_case_builds_a_working_step():
    for case in [bench.BASELINE, *bench.CASES.values()]:
        step = bench.build_step(case, vocab_size=300, tokens=bench.BPTT, device="cpu")
        step()  # forward + backward without error


def test_interleaved_timing_reports_medians_and_ratios():
    calls = []
    timing = bench.time_interleaved(
        lambda: calls.append("head"),
        lambda: calls.append("base"),
        repeats=3,
        warmup=1,
        device="cpu",
    )
    assert calls == ["head", "base"] + ["base", "head"] * 3  # warm-up, then alternating
    assert set(timing) == {"head_ms", "baseline_ms", "time_ratio", "median_of_run_ratios"}
    assert timing["time_ratio"] > 0


def test_peak_memory_grows_with_the_vocabulary():
    small = bench.peak_memory_mb(bench.BASELINE, vocab_size=1000, tokens=140, device="cpu")
    large = bench.peak_memory_mb(bench.BASELINE, vocab_size=40000, tokens=140, device="cpu")
    # Logits, their gradient and the decoder gradient: at least 2 x 140 x 40000 floats.
    assert large - small > 2 * 140 * 39000 * 4 / 2**20


def test_run_benchmark_writes_json_and_markdown(tmp_path):
    result = bench.run_benchmark(
        vocab_sizes=[200],
        labels=["softmax", "mos"],
        tokens=bench.BPTT,
        repeats=1,
        warmup=0,
        budget_mb=50,
        progress=lambda message: None,
    )
    json_path, md_path = bench.write_results(result, tmp_path)
    loaded = json.loads(json_path.read_text())
    assert [row["case"] for row in loaded["rows"]] == ["softmax", "mos"]
    assert loaded["machine"]["torch_threads"] >= 1
    assert all(row["budget"]["tokens"] % bench.BPTT == 0 for row in loaded["rows"])
    table = md_path.read_text()
    assert "| 200 | mos | auto |" in table and "Same memory budget" in table


def test_unknown_case_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown bench case.*choose from: softmax"):
        bench.run_benchmark(vocab_sizes=[100], labels=["softmax", "moz"])
