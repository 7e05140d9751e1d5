"""highrank.runs.checkpoint: atomic writes, weights_only loading, RNG round trips, fallbacks."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from highrank.config import load_config
from highrank.models import load_run
from highrank.runs.checkpoint import (
    CheckpointError,
    NonFiniteCheckpointError,
    capture_rng,
    evaluation_state_dict,
    load_checkpoint,
    load_resumable,
    previous_path,
    restore_rng,
    save_checkpoint,
)
from highrank.runs.run_dir import read_metrics
from highrank.train import TrainOptions, resume, train
from highrank.train.asgd import switch_to_asgd
from tests.conftest import write_train_corpus

QUIET = TrainOptions(progress=False)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def payload(**model: torch.Tensor) -> dict:
    """A minimal valid checkpoint payload."""
    return {
        "format": "highrank-checkpoint",
        "version": 1,
        "kind": "last",
        "config": {},
        "vocab_size": 3,
        "model": model,
    }


@pytest.fixture(scope="module")
def trained_two_epochs(tmp_path_factory) -> Path:
    """A finished 2-epoch run of a tiny model on a tiny corpus, trained once: read-only."""
    root = tmp_path_factory.mktemp("two-epochs")
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for split, lines in (("train", 60), ("valid", 20), ("test", 20)):
        text = [" ".join(rng.choices("abcdefghij", k=rng.randint(2, 7))) for _ in range(lines)]
        (corpus / f"{split}.txt").write_text("\n".join(text) + "\n")
    out = root / "run"
    overrides = ["model.d_embed=6", "model.d_hidden=8", "model.n_layers=2", "train.bptt=5"]
    overrides += ["train.batch_size=3", "train.eval_batch_size=2", "train.epochs=2"]
    config = load_config(None, [f"data.dir={corpus}", f"run.out_dir={out}", *overrides])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a module fixture runs before the per-test one-thread fixture
    try:
        train(config, options=QUIET)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture
def two_epoch_run(trained_two_epochs, tmp_path) -> Path:
    """A copy of the 2-epoch run (its own: 2 epochs leave a last.prev.pt), for a test to break."""
    return shutil.copytree(trained_two_epochs, tmp_path / "run")


# ---- writing ----------------------------------------------------------------------------------


def test_saved_checkpoint_loads_with_weights_only_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "sub" / "a.pt"
    save_checkpoint(payload(w=torch.arange(3.0)), path)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["model"]["w"], torch.arange(3.0))
    assert [p.name for p in path.parent.iterdir()] == ["a.pt"]


def test_keep_previous_renames_the_replaced_file(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(payload(w=torch.zeros(2)), path, keep_previous=True)
    assert not previous_path(path).exists()
    save_checkpoint(payload(w=torch.ones(2)), path, keep_previous=True)
    assert previous_path(path).name == "last.prev.pt"
    assert torch.equal(load_checkpoint(previous_path(path))["model"]["w"], torch.zeros(2))
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(2))


def test_non_finite_weights_are_refused_and_the_old_file_kept(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(payload(w=torch.zeros(2)), path)
    bad = payload(w=torch.tensor([1.0, float("nan")]))
    with pytest.raises(NonFiniteCheckpointError, match=r"last\.pt: model\['w'\] holds 1 non-fin"):
        save_checkpoint(bad, path, keep_previous=True)
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_every_checkpoint_of_a_run_loads_with_weights_only(two_epoch_run):
    for path in (two_epoch_run / "checkpoints").iterdir():
        loaded = torch.load(path, weights_only=True)
        assert loaded["format"] == "highrank-checkpoint"
        assert {"optimizer", "rng", "progress", "hidden", "trigger"} <= loaded["training"].keys()


# ---- reading and fallbacks --------------------------------------------------------------------


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_truncated_checkpoint_is_a_clear_error_naming_the_file(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(payload(w=torch.zeros(1000)), path)
    truncate(path)
    with pytest.raises(CheckpointError, match=r"last\.pt cannot be read: the file is truncated"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    save_checkpoint(payload(w=torch.zeros(1000)), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: torch's zip reader does not notice
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"last\.pt.*corrupted"):
        load_checkpoint(path)
    torch.save({"hello": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a highrank checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


def test_resume_falls_back_to_the_previous_checkpoint_when_last_is_truncated(two_epoch_run):
    checkpoints = two_epoch_run / "checkpoints"
    truncate(checkpoints / "last.pt")
    with pytest.warns(RuntimeWarning, match=r"resuming from .*last\.prev\.pt instead.*last\.pt"):
        loaded, path = load_resumable(checkpoints)
    assert path.name == "last.prev.pt"
    truncate(checkpoints / "last.prev.pt", 0.1)
    with pytest.warns(RuntimeWarning, match=r"best\.pt instead"):
        assert load_resumable(checkpoints)[1].name == "best.pt"
    (checkpoints / "best.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        load_resumable(checkpoints)


def test_a_run_with_a_corrupted_last_checkpoint_resumes_from_the_previous_one(two_epoch_run):
    before = read_metrics(two_epoch_run / "metrics.jsonl", "epoch")
    corrupted = two_epoch_run / "checkpoints" / "last.pt"
    data = bytearray(corrupted.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64  # garbage inside the zip
    corrupted.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="last.prev.pt"):
        result = resume(two_epoch_run, overrides=["train.epochs=3"], options=QUIET)
    assert result.epochs_completed == 3
    after = read_metrics(two_epoch_run / "metrics.jsonl", "epoch")
    assert [r["epoch"] for r in after] == [1, 2, 3]
    # last.prev.pt was written at the end of epoch 1: epoch 2 was redone, with the same losses.
    assert [(r["train_loss"], r["val_loss"]) for r in after[:2]] == [
        (r["train_loss"], r["val_loss"]) for r in before
    ]


# ---- RNG, averaged weights, load_run -----------------------------------------------------------


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    generator = torch.Generator().manual_seed(3)
    random.seed(1), np.random.seed(2), torch.manual_seed(4)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    path = tmp_path / "rng.pt"
    save_checkpoint(payload() | {"rng": capture_rng(generator)}, path)
    expected = (
        random.random(),
        np.random.rand(),
        torch.rand(2),
        torch.rand(2, generator=generator),
    )
    random.seed(9), np.random.seed(9), torch.manual_seed(9), generator.manual_seed(9)
    restore_rng(load_checkpoint(path)["rng"], generator)
    again = (random.random(), np.random.rand(), torch.rand(2), torch.rand(2, generator=generator))
    assert again[:2] == expected[:2]
    assert torch.equal(again[2], expected[2]) and torch.equal(again[3], expected[3])


def test_evaluation_state_dict_holds_the_asgd_averages_themselves():
    model = torch.nn.Linear(2, 2)
    optimizer = switch_to_asgd(torch.optim.SGD(model.parameters(), lr=0.1))
    before = evaluation_state_dict(model, optimizer)  # no averages yet: the plain weights
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in before.items())
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    state = evaluation_state_dict(model, optimizer)
    assert state["weight"] is optimizer.state[model.weight]["ax"]
    assert not torch.equal(state["weight"], model.weight)


def test_load_run_builds_the_model_without_touching_the_global_rng(two_epoch_run):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    model, config, vocab = load_run(two_epoch_run, "last")
    assert torch.equal(torch.rand(3), expected)
    assert not model.training and config.model.d_embed == 6 and len(vocab) == 11
    best = load_checkpoint(two_epoch_run / "checkpoints/best.pt")["model"]
    model, _, _ = load_run(two_epoch_run)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in best.items())
    with pytest.raises(CheckpointError, match="finetune"):
        load_run(two_epoch_run, "finetuned")
    with pytest.raises(CheckpointError, match="names no checkpoint"):
        load_run(two_epoch_run, "nope")


# ---- runs written by earlier versions ----------------------------------------------------------

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run-v1"


def losses(records: list[dict]) -> list[tuple]:
    keys = ("kind", "stage", "epoch", "step", "phase", "lr", "train_loss", "val_loss")
    return [tuple(r.get(k) for k in keys) for r in records]


def test_a_run_written_before_train_became_a_package_loads_and_resumes(tmp_path):
    """tests/fixtures/run-v1 was written by highrank at commit e6f2a2c, when training was one
    module (make_fixture.py there): a MoS head, ET-ASGD switching after epoch 1 (step 32),
    stopped at step 40. Its checkpoints load and evaluate, and resuming it (on the corpus moved,
    so data.dir is overridden) logs the losses its uninterrupted twin logged."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", run)
    corpus = write_train_corpus(tmp_path / "corpus")  # the one run-v1 was trained on
    model, config, vocab = load_run(run, "best")
    assert config.head.name == "mos" and len(vocab) == 31 and not model.training
    last = load_checkpoint(run / "checkpoints" / "last.pt")
    assert last["training"]["phase"] == "asgd" and last["training"]["progress"]["step"] == 40
    # run.device: the fixture's twin ran on a CPU; a GPU's arithmetic differs in the last bits
    result = resume(run, overrides=[f"data.dir={corpus}", "run.device=cpu"], options=QUIET)
    assert (result.stop_reason, result.phase, result.steps) == ("epochs", "asgd", 64)
    ours = losses(read_metrics(run / "metrics.jsonl"))
    straight = losses(read_metrics(FIXTURE / "straight-metrics.jsonl"))
    assert len(ours) == len(straight) == 66  # 64 steps (log_every 1) and 2 epochs
    assert (
        ours == straight
        or all(  # exact on the machine that wrote the fixture
            mine[:6] == theirs[:6] and close(mine[6:], theirs[6:])
            for mine, theirs in zip(ours, straight, strict=True)
        )
    )


def close(ours: tuple, theirs: tuple) -> bool:
    """Equal up to float rounding (another CPU), None (no validation) equal to None."""
    return all(
        (a is None and b is None) or (None not in (a, b) and a == pytest.approx(b, rel=1e-5))
        for a, b in zip(ours, theirs, strict=True)
    )
