"""A highrank HF model under the engines (issue 33): what transformers and accelerate read of
the class (``_no_split_modules``, tied weights, meta construction, ``device_map="auto"``), and
training in two CPU processes (gloo) against one process on the same global batch.

The two-process cases (``tests/integrations/hf_engines.py``: 3 SGD steps, batch 4 x 9,
dropout off): DDP and FSDP2 (``fully_shard_highrank``) for MoS, Mixtape and softmax, each
tied (GPT-2) and untied (Llama): 12 cases in one spawn of two processes; the transformers
``Trainer`` under torchrun (DDP) for MoS tied, Mixtape untied and softmax tied, in one
torchrun launch. Each matches one process's step losses (1e-5) and final weights (1e-5), and
its one saved folder reloads in this process with those weights. ``Trainer(fsdp=...)`` on
the CPU runs DDP: accelerate 1.15 turns FSDP on only for accelerator devices (documented in
docs/distributed-training.md), so FSDP through the Trainer is a GPU check
(benchmarks/checks/engines_gpu_check.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from highrank.heads import HEADS
from tests.integrations import hf_engines
from tests.train import test_distributed as spawning

from .conftest import BASES, VOCAB

hf = pytest.importorskip("highrank.integrations.hf", reason="the hf extra is not installed")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
ENGINE_CASES = [
    (engine, base, head)
    for engine in ("ddp", "fsdp2")
    for base in ("gpt2", "llama")
    for head in ("mos", "mixtape", "softmax")
]
TRAINER_CASES = [("gpt2", "mos"), ("llama", "mixtape"), ("gpt2", "softmax")]
SPAWN_SECONDS = 400.0  # two processes importing transformers on a loaded 2-core machine


# ---- the class, as transformers and accelerate read it ------------------------------------------


@pytest.mark.parametrize("base", sorted(BASES))
def test_no_split_modules_and_tied_weights_in_the_form_of_transformers_5(base):
    model = hf.attach_head(BASES[base](), "mos", n_components=2)
    block = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}[base]
    assert {"MixtureOfSoftmaxes", block} <= set(model._no_split_modules)
    assert {cls.__name__ for cls in HEADS.values()} <= set(model._no_split_modules)
    if base == "gpt2":  # tied: a dict {target: source}, as LlamaForCausalLM declares it
        assert model._tied_weights_keys == {"head.weight": "model.wte.weight"}
        assert model.all_tied_weights_keys == {"head.weight": "model.wte.weight"}
    else:
        assert not model._tied_weights_keys and not model.all_tied_weights_keys


@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("base", sorted(BASES))
def test_construction_on_the_meta_device_reads_no_tensor_value(base, head):
    """What from_pretrained and accelerate's init_empty_weights do: every head, tied and
    untied, is built on "meta" (a value read there, .item() or a host copy, raises)."""
    config = hf.attach_head(BASES[base](), "softmax").config
    config.head_name, config.head_knobs = head, hf_engines.KNOBS.get(head, {})
    with torch.device("meta"):
        model = hf.HighrankForCausalLM(config)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert (model.head.weight is model.get_input_embeddings().weight) == (base == "gpt2")


@pytest.mark.parametrize("base", sorted(BASES))
def test_device_map_auto_places_a_saved_model(base, tmp_path):
    model = hf.attach_head(BASES[base](), "mixtape", init="paper", gate_dim=4).eval()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto")
    assert isinstance(loaded, hf.HighrankForCausalLM)
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    assert (loaded.head.weight is loaded.get_input_embeddings().weight) == (base == "gpt2")
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_a_device_map_never_splits_the_head_and_keeps_a_tied_one_with_its_embedding():
    """accelerate's planner with the model's declarations, the CPU holding half or 95 % of the
    model and the rest offloaded to disk: the head is one entry, beside the embedding when
    tied. (With only the body's blocks declared, 95 % split the untied MoS head between the
    CPU and the disk, and the tied one made accelerate fail with an IndexError.)"""
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes

    for base in sorted(BASES):
        model = hf.attach_head(BASES[base](), "mos", n_components=3)
        total = compute_module_sizes(model)[""]
        for share in (0.5, 0.95):
            budget = {"cpu": int(share * total), "disk": 10 * total}
            placed = infer_auto_device_map(
                model, max_memory=budget, no_split_module_classes=list(model._no_split_modules)
            )
            assert not [name for name in placed if name.startswith("head.")], placed
            if base == "gpt2" and "head" in placed:
                assert placed["head"] == placed["model.wte"], placed


# ---- training in two processes ------------------------------------------------------------------


def assert_weights_close(got: dict, expected: dict, tolerance: float = 1e-5) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=tolerance, atol=tolerance,
                                   msg=name)


def reloaded_weights(folder: Path) -> tuple[dict, bool]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(model, hf.HighrankForCausalLM)
    tied = model.head.weight is model.get_input_embeddings().weight
    return {k: v.detach() for k, v in model.state_dict().items()}, tied


def test_ddp_and_fsdp2_train_as_one_process_and_save_one_folder(tmp_path, monkeypatch):
    """DDP and FSDP2 (fully_shard_highrank: the tied head grouped with the embedding), MoS /
    Mixtape / softmax, tied (GPT-2) and untied (Llama), 2 gloo processes x 2 sequences:
    the step losses and final weights of one process on the 4 sequences, the same weights
    on process 0 and in the saved folder, which reloads here (tied stays tied)."""
    monkeypatch.setattr(spawning, "DEADLINE", SPAWN_SECONDS)
    out = tmp_path / "saved"
    twos = spawning.spawn(tmp_path / "spawned", hf_engines.train_cases, str(out), ENGINE_CASES)
    references = {}
    for i, (engine, base, head) in enumerate(ENGINE_CASES):
        name = f"{engine}-{base}-{head}"
        if (base, head) not in references:
            references[base, head] = hf_engines.train("one", base, head)
        one, two = references[base, head], twos[0][i]
        assert two["losses"] == twos[1][i]["losses"]  # every process saw the same averages
        assert two["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-5), name
        assert one["losses"][-1] < one["losses"][0]  # the steps did train
        assert_weights_close(two["weights"], one["weights"])
        saved, tied = reloaded_weights(out / name)
        assert tied == (base == "gpt2"), name
        assert_weights_close(saved, two["weights"], tolerance=0.0)
        config = json.loads((out / name / "config.json").read_text())
        assert config["architectures"] == ["HighrankForCausalLM"], name


def test_the_trainer_under_torchrun_trains_as_one_process(tmp_path):
    """transformers.Trainer in two processes started by torchrun (accelerate: DDP over gloo),
    2 sequences each: the logged losses and the saved folder's weights are those of one
    process on the 4 sequences, for MoS (tied), Mixtape (untied) and softmax (tied)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "tests.integrations.hf_engines", str(tmp_path),
               *(f"{base}:{head}" for base, head in TRAINER_CASES)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SPAWN_SECONDS)
    assert done.returncode == 0, done.stderr[-4000:]
    for base, head in TRAINER_CASES:
        folder = tmp_path / f"{base}-{head}"
        one = hf_engines.train("one", base, head)
        losses = json.loads((folder / "losses.json").read_text())
        assert losses == pytest.approx(one["losses"], rel=1e-5, abs=1e-5), (base, head)
        saved, tied = reloaded_weights(folder / "model")
        assert tied == (base == "gpt2")
        assert_weights_close(saved, one["weights"])
