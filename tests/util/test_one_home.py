"""One home each: the JSON writer, the memory probe and the streamed matrix writer live in
``util/``; their old names elsewhere are the same functions (old imports keep working)."""

from __future__ import annotations

import json
import math

from highrank.util import atomic, machine, npy


def test_old_names_are_the_util_functions():
    from highrank.analysis import logprob_matrix, output, rank
    from highrank.train import sizes

    assert output.write_json is atomic.write_json
    assert rank.available_memory_bytes is machine.available_memory
    assert sizes.available_memory is machine.available_memory
    assert logprob_matrix.write_matrix is npy.write_matrix


def test_write_json_takes_what_records_hold(tmp_path):
    import numpy as np
    import torch

    path = atomic.write_json(tmp_path / "new" / "r.json", {
        "a": np.float32(0.5), "b": torch.tensor([1, 2]), "c": (math.inf, np.nan),
        "d": tmp_path, "e": {1: np.int64(3)}})
    assert path.read_text().endswith("}\n")
    assert json.loads(path.read_text()) == {"a": 0.5, "b": [1, 2], "c": [None, None],
                                            "d": str(tmp_path), "e": {"1": 3}}


def test_the_memory_probe_answers_for_the_cpu_and_not_for_other_devices():
    assert machine.available_memory("cpu") is None or machine.available_memory("cpu") > 0
    assert machine.available_memory("meta") is None
