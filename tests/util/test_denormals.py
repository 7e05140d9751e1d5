"""highrank.util.denormals: denormals flushed inside a block or a decorated function, nested
blocks keeping the flag, PyTorch's default (off) after; the verbs that train and score use it."""

from __future__ import annotations

import pytest
import torch

import highrank.util.denormals as denormals
from highrank.cli import main
from highrank.util.denormals import flush_denormals

TINY = 1e-39  # below float32's smallest normal number (1.18e-38)


def flushed() -> bool:
    """Whether the CPU treats a denormal input as zero now (DAZ)."""
    return (torch.tensor([TINY], dtype=torch.float32) * 1.0).item() == 0.0


pytestmark = pytest.mark.skipif(not torch.set_flush_denormal(False),
                                reason="this CPU cannot flush denormals (not x86 with SSE3)")


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
    assert not flushed() and denormals._depth == 0


def test_highrank_eval_scores_with_denormals_flushed(tiny_run, tmp_path, monkeypatch):
    import shutil

    run = shutil.copytree(tiny_run, tmp_path / "run")
    calls: list[bool] = []
    real = torch.set_flush_denormal
    monkeypatch.setattr(denormals.torch, "set_flush_denormal",
                        lambda mode: calls.append(mode) or real(mode))
    assert main(["eval", str(run), "--split", "valid", "--no-progress"]) == 0
    assert calls == [True, False] and not flushed()
