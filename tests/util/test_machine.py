"""highrank.util.machine: one description of the machine, one set of keys, for every record."""

from __future__ import annotations

import torch

from highrank.util.machine import describe_machine, machine_line

KEYS = {
    "platform",
    "python",
    "torch",
    "numpy",
    "cpu",
    "cpu_count",
    "torch_threads",
    "omp_wait_policy",
    "cuda",
    "gpus",
    "note",
}


def test_one_set_of_keys_whatever_is_given():
    plain, given = describe_machine(), describe_machine(threads=3, note="shared")
    assert set(plain) == set(given) == KEYS
    assert plain["torch"] == torch.__version__ and plain["cpu"]
    assert plain["torch_threads"] == torch.get_num_threads() and given["torch_threads"] == 3
    assert "; shared" in machine_line(given) and "(3 threads)" in machine_line(given)
