"""The ``highrank`` command line: one smoke test per verb, help, version and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from highrank import __version__
from highrank.cli import VERBS, main
from highrank.heads import HEADS
from tests.conftest import SHARED_DATA

TINY = ["--rank", "6", "--dim", "2", "--vocab", "20", "--contexts", "12", "--steps", "20"]


def test_demo_verb_writes_files_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", *TINY, "--heads", "softmax,mos", "--out", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["heads"]) == ["softmax", "mos"]
    assert results["settings"]["rank"] == 6 and results["settings"]["steps"] == 20
    assert (out / "kl_curves.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "Press rank" in printed and "softmax" in printed and "d + 2 = 4" in printed


def test_demo_gives_the_same_numbers_in_a_fresh_process(tmp_path):
    args = ["demo", *TINY, "--heads", "softmax,plif", "--no-progress"]
    main([*args, "--out", str(tmp_path / "here")])
    subprocess.run(
        [sys.executable, "-m", "highrank", *args, "--out", str(tmp_path / "there")],
        check=True,
        capture_output=True,
    )
    here, there = (
        json.loads((tmp_path / name / "results.json").read_text()) for name in ("here", "there")
    )
    for name in ("softmax", "plif"):
        assert here["heads"][name]["kl"] == there["heads"][name]["kl"]
        assert here["heads"][name]["curve"] == there["heads"][name]["curve"]


def test_python_dash_m_help_lists_every_verb():
    done = subprocess.run(
        [sys.executable, "-m", "highrank", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0
    assert all(verb.name in done.stdout for verb in VERBS)


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "c.toml", "--train.lr=20", "--checkpoint-every", "5", "--head.name", "mos"],
        ["finetune", "r", "--resume", "--finetune.lr", "5", "--max-steps", "3"],
        ["config", "show", "--vocab-size", "7"],
        ["eval", "r", "--split", "valid", "--beam", "2"],
        ["demo", "--rank", "3", "--heads", "softmax,mos"],
        ["analyze", "rank", "r", "--split", "valid"],
    ],
)
def test_the_lazy_parser_of_main_parses_as_the_whole_one(argv):
    """main() declares a verb's options (and the config keys) only when they are used."""
    from highrank.cli import build_parser

    whole, lazy = (vars(build_parser(lazy=flag).parse_args(argv)) for flag in (False, True))
    assert whole.pop("parser").prog == lazy.pop("parser").prog
    assert whole == lazy


def test_the_torch_free_copies_the_options_are_declared_from_equal_the_library():
    """cli/choices.py copies the names and defaults the verbs' options show (heads, bench
    cases, the analyses' defaults), so --help imports no torch; each copy must stay equal."""
    import dataclasses
    import importlib

    from highrank.cli import choices
    from highrank.demo import DemoSettings

    for name, module, original in choices.ORIGINALS:
        value = getattr(importlib.import_module(module), original)
        expected = tuple(value) if isinstance(value, dict) else value
        assert getattr(choices, name) == expected, f"cli.choices.{name} != {module}.{original}"
    settings = dataclasses.asdict(DemoSettings())
    assert {k: settings[k] for k in choices.DEMO_DEFAULTS} == choices.DEMO_DEFAULTS


def test_demo_help_says_which_heads_run_by_default(capsys):
    """Issue 29: `demo --help` listed mlp_softmax among the default heads; seven run."""
    from highrank.demo import DemoSettings
    from highrank.heads import PAPER_HEADS

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default: the seven papers' heads, {','.join(PAPER_HEADS)};" in text
    assert "mlp_softmax, the capacity control, only when named" in text
    assert DemoSettings().heads == PAPER_HEADS and len(PAPER_HEADS) == 7


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_demo_help_names_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--rank",
        "--dim",
        "--vocab",
        "--contexts",
        "--heads",
        "--steps",
        "--seed",
        "--mixtape-frequent-fraction",
    ):
        assert option in text
    assert "--out" in text


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], ["VERB"]),
        (["nope"], ["nope", "demo"]),
        (["demo", "--heads", "softmax,foo"], ["--heads", "'foo'", *HEADS]),
        (["demo", "--heads", "mos,mos"], ["--heads", "twice"]),
        (["demo", "--heads", ","], ["--heads", "empty"]),
        (["demo", "--rank", "0"], ["--rank", "positive integer"]),
        (["demo", "--dim", "two"], ["--dim", "'two'"]),
        (["demo", "--steps", "-5"], ["--steps"]),
        (["demo", "--seed", "-1"], ["--seed"]),
        (
            ["demo", "--rank", "50", "--vocab", "40", "--contexts", "30"],
            ["contexts=30", "vocab=40"],
        ),
    ],
)
def test_bad_arguments_exit_2_with_a_message_naming_the_option(argv, words, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path)] if argv[:1] == ["demo"] else argv)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert all(word in message for word in words), message
    assert not (tmp_path / "results.json").exists()


def test_dim_at_least_rank_minus_1_runs_with_a_note(tmp_path, capsys):
    argv = ["demo", "--rank", "3", "--dim", "4", "--vocab", "8", "--contexts", "8"]
    code = main([*argv, "--steps", "5", "--heads", "softmax", "--out", str(tmp_path)])
    assert code == 0
    assert "no bottleneck" in capsys.readouterr().err


SHARED_PTB = SHARED_DATA / "ptb"


def _tiny_corpus(folder: Path) -> Path:
    folder.mkdir()
    for split, text in {"train": "a b c\nb c\n", "valid": "a b\n", "test": "c a\n"}.items():
        (folder / f"{split}.txt").write_text(text)
    return folder


def test_data_stats_prints_lines_tokens_and_vocabulary(tmp_path, capsys):
    corpus = _tiny_corpus(tmp_path / "corpus")
    assert main(["data", "stats", str(corpus), "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "vocabulary: 4 tokens" in out  # a, b, c and <eos>
    assert main(["data", "stats", str(corpus), "--json", "--cache-dir", str(tmp_path / "c")]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["splits"]["train"]["tokens"] == 7 and stats["vocab_size"] == 4


def test_data_stats_on_penn_treebank(tmp_path, capsys):
    if not SHARED_PTB.is_dir():
        pytest.skip(f"Penn Treebank not found at {SHARED_PTB} (the shared data folder)")
    assert main(["data", "stats", str(SHARED_PTB), "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for figure in ("929,589", "73,760", "82,430", "vocabulary: 10,000"):
        assert figure in out


def test_data_stats_on_a_missing_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["data", "stats", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_data_stats_on_a_file_says_a_folder_is_expected(tmp_path, capsys):
    """Issue 29: `data stats FILE` said the file "does not exist"."""
    (tmp_path / "train.txt").write_text("a b\n")
    assert main(["data", "stats", str(tmp_path / "train.txt")]) == 2
    err = capsys.readouterr().err
    assert f"corpus directory {tmp_path / 'train.txt'} is a file, not a folder" in err
    assert "expected a folder holding train.txt, valid.txt and test.txt" in err
    assert "does not exist" not in err


def test_bench_heads_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", "heads", "--vocab", "300", "--cases", "softmax,mixtape", "--tokens", "70"]
    assert main([*argv, "--repeats", "1", "--warmup", "0", "--out", str(out)]) == 0
    assert "| 300 | mixtape |" in capsys.readouterr().out
    assert json.loads((out / "heads.json").read_text())["settings"]["vocab_sizes"] == [300]


def test_bench_rejects_unknown_cases():
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "heads", "--cases", "softmax,moz"])
    assert exit_info.value.code == 2


def test_an_unknown_config_key_is_named_with_the_closest_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "configs/ptb/small-softmax.toml", "--train.lrr=20"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown config key 'train.lrr'; did you mean train.lr" in err
    assert err.splitlines()[0].startswith("usage: highrank train")


def test_missing_run_dir_and_missing_best_checkpoint_say_what_to_do(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nowhere")]) == 2
    assert f"run directory {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.pt").write_bytes(b"")
    assert main(["eval", str(tmp_path / "run")]) == 2
    assert "stopped before one (e.g. --max-steps); pass --which last" in capsys.readouterr().err


def test_eval_of_a_file_says_it_is_a_file_not_that_it_does_not_exist(tmp_path, capsys):
    """Issue 29: `eval FILE` said "does not exist" for an existing file."""
    (tmp_path / "best.pt").write_bytes(b"")
    for verb in ("eval", "dynamic-eval"):
        assert main([verb, str(tmp_path / "best.pt")]) == 2
        err = capsys.readouterr().err
        assert f"run directory {tmp_path / 'best.pt'} is a file, not a folder" in err, err
        assert "does not exist" not in err


OPENMP_PROBE = """
import os, sys
{before}
from highrank.cli import main
try:
    main(["--version"])
except SystemExit:
    pass
print(os.environ.get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize(
    ("preset", "before", "expected"),
    [
        ({}, "", "PASSIVE"),  # the default: idle OpenMP threads sleep
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "", "ACTIVE"),  # the user's choice wins
        ({"GOMP_SPINCOUNT": "300000"}, "", "None"),  # so does a spin count of their own
        ({}, "import torch", "None"),  # too late: libgomp has read its settings already
    ],
)
def test_the_command_line_lets_idle_openmp_threads_sleep_unless_told_otherwise(
    preset, before, expected
):
    unset = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    env = {k: v for k, v in os.environ.items() if k not in unset} | preset
    probe = OPENMP_PROBE.format(before=before)
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split()[-1] == expected


def test_a_run_stopped_before_any_validation_says_so():
    """Issue: every --max-steps run ended with "no validation improvement" though no
    validation had run."""
    from pathlib import Path

    from highrank.cli.train import result_line
    from highrank.train import TrainResult

    def line(loss, epoch):
        return result_line(TrainResult(Path("r"), "train", 0, 5, loss, epoch, "sgd", "max_steps"))

    assert "no validation has run yet" in line(float("inf"), 0)
    assert "best validation perplexity 2.72 (epoch 1)" in line(1.0, 1)
