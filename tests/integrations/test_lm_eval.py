"""lm-eval (issue 21, item 2): a saved highrank model is scored by lm-eval's HFLM from Python
and by `lm_eval --model hf` from the shell (a fresh process that never imported highrank:
the folder's auto_map and highrank_auto.py), and its rolling log-likelihood is the highrank
loss. Tiny random models, a word-level tokenizer and a local task built here (offline)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import VOCAB, tiny_gpt2, word_tokenizer

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
hf = pytest.importorskip("highrank.integrations.hf", reason="the hf extra is not installed")
lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed (the clients extra: pip install -e '.[clients]')"
)

EOS = 2  # word_tokenizer's end of text: lm-eval's prefix token for rolling windows


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in torch.randint(3, VOCAB, (n,)).tolist())


def highrank_rolling_nll(model, text: str, max_length: int) -> float:
    """The highrank loss (summed NLL) of every token of ``text``, scored in the disjoint
    windows lm-eval's rolling log-likelihood uses (the first after the EOS prefix token)."""
    from lm_eval import utils

    tokens = word_tokenizer()(text, add_special_tokens=False)["input_ids"]
    windows = utils.get_rolling_token_windows(
        token_list=tokens, prefix_token=EOS, max_seq_len=max_length, context_len=1
    )
    total = 0.0
    for context, continuation in map(utils.make_disjoint_window, windows):
        inputs = torch.tensor([(context + continuation)[:-1]])  # at most max_length tokens
        scored = [-100] * (inputs.shape[1] - len(continuation)) + continuation
        with torch.no_grad():
            loss = model(inputs, shift_labels=torch.tensor([scored])).loss  # mean NLL
        total += float(loss) * len(continuation)
    return total


@pytest.mark.parametrize(("head", "length"), [("mos", 20), ("mixtape", 150)])
def test_hflm_rolling_loglikelihood_is_the_highrank_loss(head, length):
    """150 tokens exceed tiny GPT-2's 64 positions: lm-eval must read the context length
    from the config (max_position_embeddings) and roll its windows."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from tests.conftest import SMALL_KNOBS

    model = hf.attach_head(tiny_gpt2(), head, init="paper", **SMALL_KNOBS[head]).eval()
    lm = HFLM(pretrained=model, tokenizer=word_tokenizer(), batch_size=1, device="cpu")
    assert lm.max_length == 64
    text = words(length)
    request = Instance("loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    (score,) = lm.loglikelihood_rolling([request], disable_tqdm=True)
    expected = -highrank_rolling_nll(model, text, 64)
    assert score == pytest.approx(expected, rel=1e-5)


TASK = """\
task: highrank_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
metadata:
  version: 1.0
"""


def saved_model(tmp_path: Path):
    """A tiny GPT-2 with a MoS head and its tokenizer saved in ``tmp_path/model``."""
    from tests.conftest import SMALL_KNOBS

    model = hf.attach_head(tiny_gpt2(), "mos", init="paper", **SMALL_KNOBS["mos"]).eval()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return model, folder


def fresh_process_env(tmp_path: Path) -> dict:
    """Offline, with transformers' module cache in ``tmp_path`` and this highrank importable
    (but not imported: the child never imports it itself)."""
    source = str(Path(hf.__file__).parents[2])
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
        "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    }  # fmt: skip


FRESH_HFLM = """
import sys, transformers
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
assert "highrank" not in sys.modules
try:
    transformers.AutoConfig.from_pretrained(sys.argv[1])
except ValueError as error:
    print("refused:", str(error).replace(chr(10), " "))
lm = HFLM(pretrained=sys.argv[1], trust_remote_code=True, batch_size=1, device="cpu")
request = Instance("loglikelihood_rolling", doc={}, arguments=(sys.argv[2],), idx=0)
print(repr(lm.loglikelihood_rolling([request], disable_tqdm=True)[0]))
"""


def test_a_fresh_process_scores_a_saved_folder_as_lm_eval_hf_does(tmp_path):
    """What `lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True` runs
    (HFLM given the folder's path), in a process that has not imported highrank; without
    trust_remote_code, transformers says to pass it."""
    model, folder = saved_model(tmp_path)
    text = words(30)
    done = subprocess.run(
        [sys.executable, "-c", FRESH_HFLM, str(folder), text], env=fresh_process_env(tmp_path),
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    refused, score = done.stdout.strip().splitlines()[-2:]
    # (transformers asks "Do you wish to run the custom code?" first, answered by no stdin)
    assert "refused:" in refused and "trust_remote_code=True" in refused
    assert float(score) == pytest.approx(-highrank_rolling_nll(model, text, 64), rel=1e-5)


@pytest.mark.slow  # lm_eval indexes its thousands of built-in tasks first: 15-40 s
def test_lm_eval_from_the_shell_loads_a_saved_highrank_model(tmp_path):
    executable = shutil.which("lm_eval", path=str(Path(sys.executable).parent))
    if executable is None:
        pytest.skip("lm-eval's lm_eval command is not beside this Python")
    model, folder = saved_model(tmp_path)
    text = words(30)
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "highrank_rolling.yaml").write_text(TASK.format(data=data))
    env = fresh_process_env(tmp_path)
    command = [
        executable, "--model", "hf", "--model_args",
        f"pretrained={folder},trust_remote_code=True,dtype=float32", "--tasks",
        "highrank_rolling", "--include_path", str(tasks), "--device", "cpu",
        "--batch_size", "1", "--output_path", str(tmp_path / "out"), "--log_samples",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = (tmp_path / "out").rglob("samples_highrank_rolling_*.jsonl")
    record = json.loads(samples.read_text().splitlines()[0])
    score = record["filtered_resps"][0]
    score = float(score[0] if isinstance(score, list) else score)
    assert score == pytest.approx(-highrank_rolling_nll(model, text, 64), rel=1e-5)
