"""``highrank retrofit`` in two processes (issue 33 item 2), gloo on the CPU, tiny GPT-2 and
Llama models saved with a word-level tokenizer; 14 steps of 16 tokens (frozen: 8 cached rows
per process) or 2 windows of 8 (lora / full: one window per process), states every 10 steps.

* ``torchrun --nproc-per-node 2 -m highrank retrofit`` in every mode (dropout on: GPT-2's and
  MoS's latent dropout): exit 0, its lines printed once, a state of both processes' random
  generators, a model that reloads;
* the same plans in two spawned processes with one of them killed (SIGKILL: frozen while
  caching, lora at step 12 on process 1, full at step 12 on process 0): the other stops with
  an error, never hangs, and the same plan run again ends bit-identical to torchrun's
  uninterrupted run (weights, step losses, scores);
* dropout off, in every mode: the two processes' step losses, cache (bit-identical) and
  scores match one process on the same global batch;
* full mode with ``--fsdp`` (the model sharded by FSDP2, tied MoS head with the embedding):
  the same three checks (a kill at step 12 of process 1 resumes bit-identical; the losses
  match one process without sharding).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="retrofit needs the hf extra")
pytest.importorskip("peft", reason="--mode lora needs peft")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import highrank.integrations.hf  # noqa: E402, F401  (registers the model type)
from highrank.integrations.retrofit import RetrofitPlan, retrofit  # noqa: E402
from tests.analysis.test_hf_contexts import save_tiny_model, write_text  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 400.0  # seconds for a spawn or a torchrun of two processes on a loaded machine
STEPS = 14
SETTINGS = {"window": 8, "batch_tokens": 16, "steps": STEPS, "warmup_steps": 2, "lr": 1e-2,
            "seed": 0, "device": "cpu"}
MOS = {"n_components": 2}
# name: (model, mode, head, knobs, who is killed where: (rank, "cache" | "step", at))
RESUMED = {
    "frozen-llama-mos": ("llama", "frozen", "mos", MOS, (1, "cache", 2)),
    "lora-gpt2-mos": ("gpt2", "lora", "mos", MOS, (1, "step", 12)),
    "full-gpt2-softmax": ("gpt2", "full", "softmax", {}, (0, "step", 12)),
    "full-llama-mos-fsdp": ("llama", "full", "mos", MOS, (1, "step", 12)),
}
NO_DROPOUT = {  # (Llama has none; GPT-2's is switched off by the frozen body's eval mode)
    "frozen-gpt2-mos": ("gpt2", "frozen", "mos", {**MOS, "latent_dropout": 0.0}),
    "lora-llama-mixtape": ("llama", "lora", "mixtape", {"gate_dim": 4, "frequent_fraction": 0.3}),
    "full-llama-mos": ("llama", "full", "mos", {**MOS, "latent_dropout": 0.0}),
    "full-llama-mos-fsdp": ("llama", "full", "mos", {**MOS, "latent_dropout": 0.0}),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrofit-ddp")
    models = {arch: save_tiny_model(root / arch, arch) for arch in ("gpt2", "llama")}
    texts = {split: write_text(root / f"{split}.txt", n_words=n, seed=i)
             for i, (split, n) in enumerate((("train", 200), ("valid", 60), ("test", 60)))}
    return models, texts


def plan_fields(inputs, case: tuple, out: Path, *, sharded: bool = True) -> dict:
    """The plan of ``case``, in ``out``; a case named ``...-fsdp`` (its ``out``) shards the
    model unless ``sharded`` is False (one process cannot)."""
    models, texts = inputs
    arch, mode, head, knobs = case[:4]
    fsdp = {"fsdp": True} if sharded and out.name.endswith("-fsdp") else {}
    return {"model": str(models[arch]), "head": head, "knobs": knobs, "mode": mode,
            "out": str(out), **{split: str(path) for split, path in texts.items()}, **SETTINGS,
            **fsdp}


def argv(fields: dict) -> list[str]:
    """The command line of ``fields`` (a plan)."""
    line = ["retrofit", "--hf", fields["model"], "--head", fields["head"], "--mode",
            fields["mode"], "--out", fields["out"], "--threads", "1"]
    for split in ("train", "valid", "test"):
        line += [f"--{split}", fields[split]]
    for key in ("window", "batch_tokens", "steps", "warmup_steps", "lr", "seed", "device"):
        line += [f"--{key.replace('_', '-')}", str(fields[key])]
    for key, value in fields["knobs"].items():
        line += ["--knob", f"{key}={json.dumps(value)}"]
    return line + (["--fsdp"] if fields.get("fsdp") else [])


# ---- two processes -------------------------------------------------------------------------------


def _child(rank: int, world: int, folder: str, job, args: tuple) -> None:
    """One spawned process: join the group through a file, run ``job(*args)``, keep what it
    returned or raised (a process killed by the job's hook keeps nothing)."""
    out = Path(folder) / f"result-{rank}.pt"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        torch.save({"result": job(*args)}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        os._exit(1)  # the group may be broken: no clean leave
    dist.destroy_process_group()


def spawn(folder: Path, job, *args, world: int = 2) -> list[dict]:
    """``job(*args)`` in ``world`` processes: per rank ``{"result": ...}``, ``{"error": ...}``
    or ``{"killed": exit code}``; a process still running after ``DEADLINE`` fails the test."""
    folder.mkdir(parents=True, exist_ok=True)
    context = mp.get_context("spawn")
    processes = [context.Process(target=_child, args=(rank, world, str(folder), job, args))
                 for rank in range(world)]
    for process in processes:
        process.start()
    end = time.monotonic() + DEADLINE
    for process in processes:
        process.join(max(0.0, end - time.monotonic()))
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
        process.join()
    assert not hung, f"{len(hung)} process(es) still running after {DEADLINE:.0f} s: killed"
    outcomes = []
    for rank, process in enumerate(processes):
        saved = folder / f"result-{rank}.pt"
        outcomes.append(torch.load(saved, weights_only=False) if saved.exists()
                        else {"killed": process.exitcode})
    return outcomes


def retrofit_job(runs: list[tuple[dict, tuple | None]]) -> list[dict]:
    """``retrofit`` of each ``(plan fields, kill)``; ``kill = (rank, where, at)`` makes that
    process SIGKILL itself at training step ``at`` ("step") or at its ``at``-th batch of
    cached windows ("cache")."""
    from highrank.integrations.retrofit import cache as cache_module
    from highrank.integrations.retrofit import train as train_module

    results = []
    for fields, kill in runs:
        if kill is not None and kill[0] == dist.get_rank():
            _, where, at = kill
            if where == "step":
                real = train_module.batch_indices

                def batch_indices(budget, n, step, real=real, at=at):
                    if step == at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(budget, n, step)

                train_module.batch_indices = batch_indices
            else:
                real, calls = cache_module._hidden_rows, []

                def hidden_rows(*args, real=real, at=at, calls=calls):
                    calls.append(1)
                    if len(calls) == at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*args)

                cache_module._hidden_rows = hidden_rows
        results.append(retrofit(RetrofitPlan(**fields), progress=False))
    return results


def torchrun(fields: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "highrank", *argv(fields)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=DEADLINE)


# ---- what runs are compared by -------------------------------------------------------------------


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model" / "model.safetensors")


def losses(folder: Path) -> list:
    return [step["loss"] for step in json.loads((folder / "history.json").read_text())["history"]]


def scores(folder: Path) -> dict:
    results = json.loads((folder / "results.json").read_text())
    return {kind: {split: {k: v for k, v in score.items() if k != "seconds" and v is not None}
                   for split, score in results[kind].items()} for kind in ("base", "trained")}


# ---- the tests -----------------------------------------------------------------------------------


def test_torchrun_in_every_mode_and_a_killed_process_resumes_bit_identical(inputs, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for name, case in RESUMED.items():
        done = torchrun(plan_fields(inputs, case, straight / name))
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("valid perplexity: base") == 1, done.stdout  # process 0 only
        state = torch.load(straight / name / "state.pt", weights_only=True)
        assert state["world_size"] == 2 and len(state["ranks"]) == 2, name
        assert not torch.equal(state["ranks"][0]["rng"], state["ranks"][1]["rng"])
        results = json.loads((straight / name / "results.json").read_text())
        assert results["processes"] == 2 and results["training"]["steps_done"] == STEPS
        assert results["training"].get("sharded") == ("fsdp2" if "fsdp" in name else None)
        assert transformers.AutoModelForCausalLM.from_pretrained(straight / name / "model")

    for name, case in RESUMED.items():
        fields = plan_fields(inputs, case, killed / name)
        rank, where, at = case[4]
        first = spawn(tmp_path / f"{name}-killed", retrofit_job, [(fields, case[4])])
        assert "killed" in first[rank], (name, first[rank])
        survivor = first[1 - rank].get("error", "")  # stopped in one line, not hung
        assert "TrainingError: another process of this torchrun stopped" in survivor, survivor
        assert not (killed / name / "results.json").exists()
        if where == "step":  # the state of step 10 was kept
            assert len(torch.load(killed / name / "state.pt", weights_only=True)["history"]) == 10
        again = spawn(tmp_path / f"{name}-again", retrofit_job, [(fields, None)])
        assert all("result" in outcome for outcome in again), again
        a, b = weights(straight / name), weights(killed / name)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)
        assert losses(straight / name) == losses(killed / name), name
        assert scores(straight / name) == scores(killed / name), name


def test_two_processes_train_as_one_on_the_same_global_batch(inputs, tmp_path):
    runs = [(plan_fields(inputs, case, tmp_path / "two" / name), None)
            for name, case in NO_DROPOUT.items()]
    outcomes = spawn(tmp_path / "spawned", retrofit_job, runs)
    assert all("result" in outcome for outcome in outcomes), outcomes
    for name, case in NO_DROPOUT.items():
        one, two = tmp_path / "one" / name, tmp_path / "two" / name
        retrofit(RetrofitPlan(**plan_fields(inputs, case, one, sharded=False)), progress=False)
        sharded = json.loads((two / "results.json").read_text())["training"].get("sharded")
        assert sharded == ("fsdp2" if name.endswith("-fsdp") else None), name
        assert losses(two) == pytest.approx(losses(one), rel=1e-5), name
        s1, s2 = scores(one), scores(two)
        for kind in s1:
            for split in s1[kind]:
                assert s2[kind][split] == pytest.approx(s1[kind][split], rel=1e-5, abs=1e-5), (
                    name, split)
        w1, w2 = weights(one), weights(two)
        for key in w1:
            # Adam's g / sqrt(v) turns rounding noise into up to a step's size (lr) where a
            # gradient is near 0 (measured: 2.4e-3 at most); losses and scores agree to 1e-5
            torch.testing.assert_close(w2[key], w1[key], rtol=0, atol=SETTINGS["lr"], msg=key)
        if case[1] == "frozen":  # the cache made in two processes is the one process's
            for split in ("train", "valid", "test"):
                for file in ("features.npy", "targets.npy"):
                    assert (one / f"cache-{split}" / file).read_bytes() == (
                        two / f"cache-{split}" / file).read_bytes(), (split, file)


def test_a_global_batch_that_does_not_divide_is_one_line(inputs, tmp_path, monkeypatch):
    from highrank.integrations.retrofit import RetrofitError
    from highrank.train import distributed

    monkeypatch.setattr(distributed, "world_size", lambda: 3)
    fields = plan_fields(inputs, NO_DROPOUT["lora-llama-mixtape"], tmp_path / "out")
    with pytest.raises(RetrofitError, match=r"= 2 windows per step is the global batch, split "
                                            r"among 3 processes: it must divide by 3"):
        retrofit(RetrofitPlan(**fields), progress=False)


def test_fsdp_is_refused_in_one_line_where_it_cannot_shard(inputs, tmp_path):
    from highrank.integrations.retrofit import RetrofitError

    fields = plan_fields(inputs, NO_DROPOUT["full-llama-mos"], tmp_path / "out")
    with pytest.raises(RetrofitError, match="only --mode full trains; got --mode lora"):
        RetrofitPlan(**{**fields, "mode": "lora", "fsdp": True})
    with pytest.raises(RetrofitError, match="--fsdp shards the model across the processes of "
                                            "a torchrun: start it with `torchrun"):
        retrofit(RetrofitPlan(**{**fields, "fsdp": True}), progress=False)
    assert not (tmp_path / "out").exists()
