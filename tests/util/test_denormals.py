"""highrank.util.denormals: denormals flushed inside a block or a decorated function, per
thread, nested blocks keeping the flag, PyTorch's default (off) after; torch's worker threads
created inside a block flush too; the library's entry points that train or score are wrapped."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import threading

import pytest
import torch

import highrank.util.denormals as denormals
from highrank.cli import main
from highrank.util.denormals import flush_denormals

TINY = 1e-39  # below float32's smallest normal number (1.18e-38)

pytestmark = pytest.mark.skipif(not torch.set_flush_denormal(False),
                                reason="this CPU cannot flush denormals")


def flushed() -> bool:
    """Whether this thread treats a denormal input as zero now (one element: no workers)."""
    return (torch.tensor([TINY], dtype=torch.float32) * 1.0).item() == 0.0


def test_a_block_flushes_nested_blocks_keep_it_and_the_default_comes_back():
    assert not flushed()
    with flush_denormals():
        assert flushed()
        with flush_denormals():
            assert flushed()
        assert flushed()  # the inner block's end leaves the outer one's setting
    assert not flushed()


def test_a_decorated_function_flushes_and_an_error_restores_the_default():
    @flush_denormals()
    def inside() -> bool:
        return flushed()

    assert inside() and not flushed()

    @flush_denormals()
    def fails() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fails()
    assert not flushed()


def test_each_thread_has_its_own_blocks():
    """A review: one process-wide depth let a second thread's block run unflushed (the first
    thread's block was open) and left the first thread flushed after its block."""
    seen: dict[str, bool] = {}
    a_inside, b_done = threading.Event(), threading.Event()

    def a() -> None:
        with flush_denormals():
            a_inside.set()
            b_done.wait(10)
        seen["a after its block"] = flushed()

    def b() -> None:
        a_inside.wait(10)
        with flush_denormals():
            seen["b inside its block"] = flushed()
        b_done.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == {"a after its block": False, "b inside its block": True}


WORKERS = """
import sys
import numpy as np
import torch
from highrank.util.denormals import flush_denormals
torch.set_num_threads(2)
# denormals made by NumPy: no torch operation (a torch fill inside a block would convert
# 1e-39 on a flushing thread, to 0), large enough for a product split over the 2 threads
x = torch.from_numpy(np.full(1 << 22, 1e-39, dtype=np.float32))
if sys.argv[1] == "before":  # a parallel operation before the block starts the workers
    (torch.ones(1 << 22) * 2.0).sum()
with flush_denormals():
    print(int((x * 1.0).count_nonzero()))
"""


@pytest.mark.parametrize(("started", "unflushed"), [("inside", 0), ("before", 1 << 21)])
def test_torch_workers_take_the_flag_of_the_thread_that_starts_them(started, unflushed):
    """Started inside a block (a fresh process: the block holds torch's first parallel
    operation), the workers flush too; started before it, the worker's half of a product stays
    unflushed (the module docstring's limit, for a notebook)."""
    out = subprocess.run([sys.executable, "-c", WORKERS, started], capture_output=True,
                         text=True, check=True, env={"OMP_NUM_THREADS": "2", "PATH": ""}).stdout
    assert out.split() == [str(unflushed)]


# The functions a verb calls first to train or score (the module docstring's list).
EXPECTED_ENTRY_POINTS = {
    "highrank.train.runner.train", "highrank.train.runner.resume", "highrank.train.runner.finetune",
    "highrank.integrations.retrofit.run.retrofit",
    "highrank.integrations.retrofit.train.train_loop",
    "highrank.integrations.retrofit.score.evaluate_head",
    "highrank.evaluate.run.evaluate_run", "highrank.evaluate.perplexity.evaluate_perplexity",
    "highrank.evaluate.dynamic.gradient_statistics", "highrank.evaluate.dynamic.dynamic_evaluate",
    "highrank.evaluate.translation.translate_split", "highrank.evaluate.translation.evaluate_bleu",
    "highrank.analysis.logprob_matrix.write_head_matrix",
    "highrank.analysis.logprob_matrix.write_log_prob_matrix",
    "highrank.analysis.logprob_matrix.write_context_matrix",
}


def test_the_entry_points_that_train_or_score_are_wrapped():
    for module in {name.rsplit(".", 1)[0] for name in EXPECTED_ENTRY_POINTS}:
        importlib.import_module(module)
    assert denormals.ENTRY_POINTS >= EXPECTED_ENTRY_POINTS
    for name in EXPECTED_ENTRY_POINTS:  # wrapped by the decorator itself, not only registered
        module, function = name.rsplit(".", 1)
        assert hasattr(getattr(importlib.import_module(module), function), "__wrapped__"), name


def test_highrank_eval_scores_with_denormals_flushed(tiny_run, tmp_path, monkeypatch):
    run = shutil.copytree(tiny_run, tmp_path / "run")
    calls: list[bool] = []
    real = torch.set_flush_denormal
    monkeypatch.setattr(denormals.torch, "set_flush_denormal",
                        lambda mode: calls.append(mode) or real(mode))
    assert main(["eval", str(run), "--split", "valid", "--no-progress"]) == 0
    assert calls == [True, False] and not flushed()
