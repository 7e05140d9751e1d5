"""No file highrank reads can run code: a crafted pickle offered to every loader is refused.

``torch.load(weights_only=False)`` and ``np.load(allow_pickle=True)`` execute whatever a
pickle's ``__reduce__`` names. Each loader is offered a file whose payload would create a
marker file, and must refuse it with a clear error and leave no marker; a scan of the package
and of ``benchmarks/`` finds no call that could unpickle arbitrary objects.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from highrank.runs.checkpoint import CheckpointError, load_checkpoint

ROOT = Path(__file__).resolve().parents[1]


class _Payload:
    """Unpickling this calls ``Path(marker).touch()``: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def write_malicious(path: Path, marker: Path, **extra) -> Path:
    torch.save({**extra, "payload": _Payload(marker)}, path)
    return path


def test_the_payload_runs_under_an_unsafe_load(tmp_path):
    """The probe itself works: without weights_only its code runs (so the tests below can fail)."""
    marker = tmp_path / "ran"
    torch.load(write_malicious(tmp_path / "x.pt", marker), weights_only=False)
    assert marker.exists()


def test_a_malicious_checkpoint_is_refused_without_running(tmp_path):
    marker = tmp_path / "ran"
    path = write_malicious(tmp_path / "last.pt", marker, format="highrank-checkpoint")
    with pytest.raises(CheckpointError, match=r"last\.pt cannot be read"):
        load_checkpoint(path)
    assert not marker.exists()


def test_a_malicious_retrofit_state_is_refused_without_running(tmp_path):
    pytest.importorskip("transformers", reason="the retrofit needs the hf extra")
    from highrank.heads import build_head
    from highrank.integrations.retrofit import (
        TrainBudget,
        Trainee,
        load_train_state,
        read_train_state,
    )

    head = build_head("softmax", d_in=4, vocab_size=7)
    optimizer = torch.optim.Adam(head.parameters())
    marker = tmp_path / "ran"
    path = write_malicious(tmp_path / "state.pt", marker, budget={}, head={})
    budget = TrainBudget(steps=2, batch_tokens=2, lr=1e-3)
    with pytest.raises(ValueError, match=r"state\.pt cannot be read as a head's training state"):
        load_train_state(path, Trainee.head(head, budget.lr), optimizer, budget, [])
    with pytest.raises(ValueError, match=r"state\.pt cannot be read as a model's training state"):
        read_train_state(path, "trainable", "a model's")
    assert not marker.exists()


UNSAFE = [
    (re.compile(r"torch\.load\((?!.*weights_only=True)"), "torch.load, not weights-only"),
    (re.compile(r"allow_pickle\s*=\s*True"), "np.load(allow_pickle=True)"),
    (re.compile(r"\bpickle\.loads?\("), "pickle.load"),
]


@pytest.mark.parametrize("folder", ["src", "benchmarks"])
def test_no_loader_can_unpickle_arbitrary_objects(folder):
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if "``" in code:  # a docstring naming the call, not a call
                continue
            found += [f"{path.relative_to(ROOT)}:{number}: {why}"
                      for pattern, why in UNSAFE if pattern.search(code)]
    assert not found, "\n".join(found)
