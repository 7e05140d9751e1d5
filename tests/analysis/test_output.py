import json
import math

import numpy as np
import pytest

from highrank.analysis.output import read_json, run_record_path, text_table, write_json


def test_write_json_converts_numpy_and_non_finite(tmp_path):
    path = write_json(
        tmp_path / "a" / "r.json",
        {"n": np.int64(3), "x": np.float32(0.5), "v": np.arange(3), "bad": math.nan},
    )
    assert json.loads(path.read_text()) == {"n": 3, "x": 0.5, "v": [0, 1, 2], "bad": None}
    assert read_json(path)["v"] == [0, 1, 2]
    assert not list(path.parent.glob(".*.tmp"))  # no temporary file left behind


def test_read_json_names_the_broken_file(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{\n  'x': 1")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        read_json(bad)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        read_json(tmp_path / "missing.json")


def test_run_record_path(tmp_path):
    assert run_record_path(tmp_path, "rank", "test") == tmp_path / "analysis" / "rank-test.json"
    assert run_record_path(tmp_path, "kl") == tmp_path / "analysis" / "kl.json"


def test_text_table_aligns_numbers_right():
    table = text_table(["model", "rank", "ppl"], [["softmax", 402, 58.84], ["mos", 9983, None]])
    lines = table.splitlines()
    assert lines[0].split() == ["model", "rank", "ppl"]
    assert lines[2].split() == ["softmax", "402", "58.84"]
    assert lines[3].split() == ["mos", "9,983", "-"]
    assert lines[2].index("402") + 3 == lines[3].index("9,983") + 5  # right-aligned
    markdown = text_table(["model", "rank"], [["mos", 1]], markdown=True)
    assert markdown.splitlines()[1] == "| --- | ---: |"
