"""evaluate_run: the library call behind `highrank eval` (issue 31 item 3): the same record the
command writes, the same errors, the run's config.toml read once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from highrank.cli import main
from highrank.config import ConfigError, load_config
from highrank.evaluate import evaluate_run
from highrank.evaluate.run import record_file
from highrank.runs.checkpoint import CheckpointError
from highrank.util.atomic import write_json
from tests.conftest import train_tiny_run


@pytest.fixture
def run(tiny_run, tmp_path) -> Path:
    """A copy of the shared tiny run: the tests write records into it, and break its config."""
    return shutil.copytree(tiny_run, tmp_path / "run")


@pytest.mark.parametrize(
    "argv, kwargs",
    [
        ([], {}),
        (["--split", "valid", "--max-tokens", "50", "--bptt", "4"],
         {"split": "valid", "max_tokens": 50, "bptt": 4}),
        (["--which", "last", "--batch-size", "3"], {"which": "last", "batch_size": 3}),
    ],
)  # fmt: skip
def test_evaluate_run_is_the_record_the_cli_writes(run, tmp_path, argv, kwargs):
    assert main(["eval", str(run), *argv, "--no-progress"]) == 0
    written = {p: p.read_bytes() for p in run.glob("eval-*.json")}
    assert len(written) == 1
    (path, cli_bytes), = written.items()  # fmt: skip

    record = evaluate_run(run, **kwargs)
    assert record == json.loads(cli_bytes)
    assert record_file(run, record) == path
    again = write_json(tmp_path / "again.json", record)  # the CLI's writer: the same bytes
    assert again.read_bytes() == cli_bytes


def test_token_nll_and_another_data_dir(run, tiny_corpus, tmp_path):
    cli_nll, lib_nll = tmp_path / "cli.tsv", tmp_path / "lib.tsv"
    assert main(["eval", str(run), "--data-dir", str(tiny_corpus), "--token-nll", str(cli_nll),
                 "--no-progress"]) == 0  # fmt: skip
    record = evaluate_run(run, data_dir=tiny_corpus, token_nll=lib_nll)
    assert lib_nll.read_text() == cli_nll.read_text()
    assert record == json.loads((run / "eval-test-best.json").read_text())
    assert record["default_data"] is True


def test_the_run_config_is_read_once(run, monkeypatch):
    import highrank.config.loader as loader

    parsed = []
    real = loader._parse_toml

    def counting(text, source):
        parsed.append(source)
        return real(text, source)

    monkeypatch.setattr(loader, "_parse_toml", counting)
    evaluate_run(run, max_tokens=30)
    assert len(parsed) == 1, parsed
    parsed.clear()
    assert main(["eval", str(run), "--max-tokens", "30", "--no-progress"]) == 0
    assert len(parsed) == 1, parsed


def cli_error(argv: list[str], capsys) -> str:
    assert main([*argv, "--no-progress"]) == 2
    return capsys.readouterr().err.strip().splitlines()[-1].split(": error: ", 1)[1]


def test_bad_input_raises_what_the_cli_reports(run, tmp_path, capsys):
    nowhere = tmp_path / "nowhere"
    with pytest.raises(CheckpointError) as missing:
        evaluate_run(nowhere)
    assert str(missing.value) == cli_error(["eval", str(nowhere)], capsys)

    short = train_tiny_run(tmp_path, "short", max_steps=3)
    with pytest.raises(CheckpointError, match="pass --which last") as no_best:
        evaluate_run(short)
    assert str(no_best.value) == cli_error(["eval", str(short)], capsys)

    with pytest.raises(CheckpointError) as unknown:
        evaluate_run(run, which="nonesuch.pt")
    assert str(unknown.value) == cli_error(["eval", str(run), "--which", "nonesuch.pt"], capsys)

    (run / "config.toml").write_text("[model\n")  # unreadable: said before any scoring
    with pytest.raises(ConfigError) as broken:
        evaluate_run(run)
    assert str(broken.value) == cli_error(["eval", str(run)], capsys)
    assert not list(run.glob("eval-*.json"))


def test_arguments_the_command_line_cannot_give(run, tmp_path):
    with pytest.raises(ValueError, match="split must be one of"):
        evaluate_run(run, split="train")
    for name in ("max_tokens", "batch_size", "bptt"):
        with pytest.raises(ValueError, match=name):
            evaluate_run(run, **{name: 0})
    seq2seq = load_config(None, ["model.backbone=seq2seq"])
    with pytest.raises(CheckpointError, match="translation run: its figure is BLEU"):
        evaluate_run(tmp_path, own_config=seq2seq)
