"""Training under torchrun (highrank.train.distributed): two gloo processes on the CPU.

Each test spawns its processes here (``torch.multiprocessing``, "spawn"), which meet through a
file in the test's temporary folder (``init_method="file://..."``) and run a job function of
this module; each writes its result to a file. A deadline (``DEADLINE`` seconds) turns a hang
into a failure: the processes still alive then are killed.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from highrank.config import ConfigError, load_config
from highrank.data import load_corpus
from highrank.models import build_model
from highrank.runs.run_dir import read_metrics
from highrank.train import distributed
from highrank.train.asgd import switch_to_asgd
from tests.conftest import TINY_AWD_LSTM, write_train_corpus

DEADLINE = 120.0  # seconds for all the processes of one test, imports included
NO_DROPOUT = [
    "model.dropout_embedding=0",
    "model.dropout_input=0",
    "model.dropout_hidden=0",
    "model.dropout_output=0",
    "model.weight_drop=0",
]
AWD = TINY_AWD_LSTM  # the training tests' tiny AWD-LSTM (tests/conftest.py)
TRANSFORMER = [
    "model.backbone=transformer",
    "model.d_embed=8",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.d_ff=16",
    "model.positions=learned",
    "model.max_len=6",
    "model.dropout_input=0",
    "model.dropout_attention=0",
    "model.dropout_residual=0",
    "train.batch_size=4",
    "train.bptt=6",
    "train.eval_batch_size=2",
    "train.lr=0.01",
    "train.warmup_steps=2",
    "train.accumulate=2",  # micro-batches: DDP averages once per update (no_sync)
]
# Heads whose losses take the fused closed-form gradients (softmax, MoS: mixture_ce; Mixtape:
# mixtape_ce), with several chunks per window.
HEADS = {
    "softmax": ["head.name=softmax"],
    "mos": ["head.name=mos", "head.n_components=2", "head.latent_dropout=0"],
    "mixtape": ["head.name=mixtape", "head.gate_dim=3", "head.frequent_fraction=0.3"],
}


def config(corpus: Path, out: Path, *overrides: str):
    return load_config(None, [f"data.dir={corpus}", f"run.out_dir={out}", *overrides])


# ---- spawning ---------------------------------------------------------------------------------


def _child(rank: int, world: int, folder: str, job, args: tuple) -> None:
    """One process: join the group through the file, run ``job(*args)``, save its result."""
    out = Path(folder) / f"result-{rank}.pt"
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world
        )
        result = job(*args)
        dist.barrier()
        dist.destroy_process_group()
        torch.save({"result": result}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def spawn(folder: Path, job, *args, world: int = 2) -> list:
    """``job(*args)``'s result in each of ``world`` processes, in rank order."""
    folder.mkdir(parents=True, exist_ok=True)
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=_child, args=(rank, world, str(folder), job, args))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    _join(processes, DEADLINE)
    results = []
    for rank in range(world):
        saved = torch.load(folder / f"result-{rank}.pt", weights_only=False)
        if "error" in saved:
            pytest.fail(f"process {rank} failed:\n{saved['error']}")
        results.append(saved["result"])
    return results


def _join(processes: list, deadline: float) -> None:
    import time

    end = time.monotonic() + deadline
    for process in processes:
        process.join(max(0.0, end - time.monotonic()))
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
        process.join()
    if hung:
        pytest.fail(f"{len(hung)} process(es) still running after {deadline:.0f} s: killed")
    codes = [p.exitcode for p in processes]
    if any(codes):
        pytest.fail(f"exit codes {codes}")


# ---- jobs (run in the spawned processes, and in this one as the reference) --------------------


def steps_job(corpus: str, overrides: list[str], steps: int, asgd_after: int | None) -> dict:
    """``steps`` training steps of a fresh recipe (ASGD from step ``asgd_after`` on): each step's
    logged NLL, then the gradients, weights and ASGD averages."""
    from highrank.train.runner import build_recipe, train_stage
    from highrank.train.startup import seed_everything
    from highrank.train.state import Progress

    cfg = config(Path(corpus), Path(corpus) / "unused", *overrides)
    data = load_corpus(cfg.data.dir, cache_dir=str(Path(corpus) / "cache"))
    seed_everything(cfg.train.seed)
    model = build_model(cfg, len(data.vocab))
    recipe = build_recipe(cfg, model, data, train_stage(cfg), torch.device("cpu"))
    progress, losses = Progress(), []
    for step in range(steps):
        if step == asgd_after:
            recipe.optimizer = switch_to_asgd(recipe.optimizer)
        batch = recipe.next_batch(progress)
        losses.append(recipe.train_step(batch).nll)
        progress.position += batch.advance
        progress.step += 1
    named = dict(model.named_parameters())
    state = recipe.optimizer.state
    return {
        "losses": losses,
        "valid": recipe.validate(),
        "grads": {name: p.grad.clone() for name, p in named.items()},
        "weights": {name: p.detach().clone() for name, p in named.items()},
        "averages": {name: state[p]["ax"].clone() for name, p in named.items() if "ax" in state[p]},
    }


def cases_job(corpus: str, cases: list[tuple]) -> list[dict]:
    """:func:`steps_job` of each ``(overrides, steps, asgd_after)`` (one spawn for all)."""
    return [steps_job(corpus, *case) for case in cases]


def run_job(corpus: str, out: str, overrides: list[str], stop: int | None) -> list[float]:
    """A run's step losses: straight to the end (``stop`` None), or stopped after ``stop``
    steps and resumed."""
    from highrank.train import TrainOptions, resume, train

    losses: list[float] = []
    options = TrainOptions(progress=False, callback=lambda info: losses.append(info.loss))
    cfg = config(Path(corpus), Path(out), f"data.cache_dir={corpus}/cache", *overrides)
    if stop is None:
        train(cfg, options=options)
        return losses
    stopped = TrainOptions(progress=False, max_steps=stop, callback=options.callback)
    train(cfg, options=stopped)
    resume(out, options=options)
    return losses


def runs_job(corpus: str, runs: list[tuple]) -> list[list[float]]:
    """:func:`run_job` of each ``(out, overrides, stop)``."""
    return [run_job(corpus, *run) for run in runs]


# ---- tests ------------------------------------------------------------------------------------


def assert_close(a: dict, b: dict, tolerance: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=tolerance, atol=tolerance, msg=name)


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# (name, overrides, steps, ASGD from this step on)
CASES = [
    *(
        (f"awd-lstm {name}", [*AWD, *NO_DROPOUT, *head, "train.chunk_size=5", "train.clip=0"], 3, 1)
        for name, head in HEADS.items()
    ),
    ("transformer softmax", [*TRANSFORMER, "train.chunk_size=5", "train.clip=0"], 2, None),
]


def test_two_processes_compute_the_one_process_step_on_the_global_batch(tmp_path):
    """Dropout off: each step's loss within 1e-6 and the gradients within 1e-5 of one process
    on the same global batch of 4 columns (2 per process), for every loss path of the heads
    (chunks of 5 tokens: DDP sees the gradients the heads compute in their forward pass),
    hidden state carried, ASGD averages from step 2, Transformer micro-batches; and
    bit-identical weights, gradients and averages on both processes."""
    corpus = write_train_corpus(tmp_path / "corpus")
    cases = [case[1:] for case in CASES]
    ones = [steps_job(str(corpus), *case) for case in cases]
    twos = spawn(tmp_path / "spawned", cases_job, str(corpus), cases)
    for i, (name, *_rest) in enumerate(CASES):
        one, two = ones[i], [twos[0][i], twos[1][i]]
        for key in ("grads", "weights", "averages"):
            assert_equal(two[0][key], two[1][key])  # identical on every process
        assert two[0]["losses"] == two[1]["losses"] and two[0]["valid"] == two[1]["valid"]
        assert two[0]["losses"] == pytest.approx(one["losses"], rel=1e-6, abs=1e-6), name
        assert two[0]["valid"] == pytest.approx(one["valid"], rel=1e-6, abs=1e-6), name
        assert_close(two[0]["grads"], one["grads"], 1e-5)
        if name.startswith("awd"):  # (AdamW's g / sqrt(v) blows up rounding noise where g ~ 0)
            assert_close(two[0]["weights"], one["weights"], 1e-5)
            assert_close(two[0]["averages"], one["averages"], 1e-5)
            assert one["averages"]


def test_a_two_process_run_stopped_and_resumed_repeats_the_straight_run(tmp_path):
    """Dropout on (each process its own masks), ASGD from epoch 2: stopping at step 30 (in
    epoch 1: hidden states and RNG states of both processes in last.pt) and resuming gives
    the same step losses, metrics and weights as the straight run."""
    corpus = write_train_corpus(tmp_path / "corpus")
    overrides = [*AWD, "train.epochs=2", "train.optimizer=et-asgd", "train.switch_epoch=1"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    runs = [(str(straight), overrides, None), (str(stopped), overrides, 30)]
    (losses, again), other = spawn(tmp_path / "spawned", runs_job, str(corpus), runs)
    assert losses == again == other[0] == other[1]
    assert len(losses) > 30
    keys = ("kind", "epoch", "step", "train_loss", "val_loss", "phase")
    records = [
        [tuple(r.get(k) for k in keys) for r in read_metrics(run / "metrics.jsonl")]
        for run in (straight, stopped)
    ]
    assert records[0] == records[1]
    assert any(r[-1] == "asgd" for r in records[0])
    a, b = (
        torch.load(run / "checkpoints/last.pt", weights_only=True) for run in (straight, stopped)
    )
    assert_equal(a["model"], b["model"])
    assert_equal(a["training"]["model"], b["training"]["model"])
    assert a["training"]["world_size"] == 2 and len(a["training"]["rng"]["ranks"]) == 2
    # the hidden state is saved whole: the global batch's 4 columns
    assert a["training"]["hidden"][0][0].shape[1] == 4


def test_one_process_checkpoint_has_the_old_layout(tmp_path):
    """Without torchrun nothing changes but ``world_size`` = 1 (no per-process RNG list)."""
    corpus = write_train_corpus(tmp_path / "corpus")
    assert run_job(str(corpus), str(tmp_path / "run"), [*AWD, "train.epochs=1"], 5)
    saved = torch.load(tmp_path / "run/checkpoints/last.pt", weights_only=True)["training"]
    assert saved["world_size"] == 1 and "ranks" not in saved["rng"]


# ---- the pieces, in one process -----------------------------------------------------------------


@pytest.fixture
def three_processes(monkeypatch):
    """Pretend to be process 1 of 3 (the functions that read the group's size)."""
    monkeypatch.setattr(distributed, "world_size", lambda: 3)
    monkeypatch.setattr(distributed, "rank", lambda: 1)


def test_each_process_owns_a_contiguous_share_of_the_columns(three_processes):
    batch = torch.arange(12).view(2, 6)  # (T, B)
    assert distributed.shard_columns(batch, "train.batch_size").tolist() == [[2, 3], [8, 9]]


def test_a_global_batch_that_does_not_divide_is_one_clear_error(three_processes):
    with pytest.raises(ConfigError) as error:
        distributed.shard_columns(torch.zeros(5, 20), "train.batch_size")
    message = str(error.value)
    assert "train.batch_size = 20" in message and "must divide by 3" in message
    assert "--train.batch_size=18" in message and "\n" not in message
    # validation columns that do not divide: every process evaluates all of them
    assert distributed.shard_columns(torch.zeros(5, 10), "x", strict=False).shape == (5, 10)


def test_resuming_with_another_number_of_processes_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(distributed, "world_size", lambda: 1)
    distributed.note_world_size(2, "the train checkpoint")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "written by 2 process(es) and resumes in 1" in lines[0]
    assert "--nproc-per-node 2" in lines[0]
    distributed.note_world_size(1, "the train checkpoint")
    assert capsys.readouterr().err == ""


def test_without_torchrun_everything_is_local(monkeypatch):
    for key in distributed.ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    assert distributed.init_from_env() is False and not distributed.active()
    model = torch.nn.Linear(2, 2)
    assert distributed.distribute(model, 0) is model
    assert distributed.average(torch.tensor(2.5)) == 2.5
    assert distributed.any_rank(None) is None and distributed.any_rank(15) == 15
    assert distributed.gather_rng({"torch": 1}) == {"torch": 1}


def test_one_process_work_under_torchrun_runs_in_process_zero_only(monkeypatch, capsys):
    """Issue: `torchrun ... eval` evaluated in every process, and a translation config made
    every process refuse (torchrun then printed ChildFailedError)."""
    from highrank.train.distributed import only_process_zero

    assert only_process_zero("evaluation") is False  # outside torchrun: nothing changes
    for rank, stops in (("1", True), ("0", False)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert only_process_zero("evaluation") is stops
    assert capsys.readouterr().err.count("evaluation runs in one process") == 1


_WORKER = """import os, signal, sys, time
from pathlib import Path
from highrank.train.distributed import stop_with_the_launcher
marker = Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (marker.write_text("SIGTERM"), os._exit(0)))
stop_with_the_launcher()
marker.with_suffix(".ready").write_text(str(os.getpid()))
time.sleep(120)
"""
_LAUNCHER = """import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_a_worker_gets_sigterm_when_its_launcher_is_killed(tmp_path):
    """Campaign: kill -9 of the torchrun launcher left both processes training on as orphans
    (a later resume found the folder in use); now each gets a SIGTERM, which saves and stops."""
    import os
    import signal
    import subprocess
    import time

    marker = tmp_path / "worker.txt"
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _WORKER, str(marker)])
    ready = marker.with_suffix(".ready")
    try:
        deadline = time.time() + 120
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the worker did not start"
        launcher.kill()
        launcher.wait()
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.1)
        assert marker.exists() and marker.read_text() == "SIGTERM"
    finally:
        launcher.kill()
        if ready.exists() and not marker.exists():
            os.kill(int(ready.read_text()), signal.SIGKILL)
