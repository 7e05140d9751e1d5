"""Bad input: one clear line, exit status 2, nothing written (issue 12)."""

from __future__ import annotations

from pathlib import Path

import pytest

from highrank.cli import main
from highrank.config import ConfigError, load_config

KNOBS_OUT_OF_RANGE = [
    (["head.name=mos", "head.n_components=0"], "head.n_components = 0 is out of range"),
    (["head.name=mos", "head.latent_dropout=1.5"], "head.latent_dropout = 1.5 is out of range"),
    (["head.name=moc", "head.n_components=0"], "head.n_components = 0 is out of range"),
    (["head.name=mixtape", "head.frequent_fraction=2"], "head.frequent_fraction = 2.0 is out"),
    (["head.name=mixtape", "head.gate_dim=0"], "head.gate_dim = 0 is out of range"),
    (["head.name=gss", "head.slope=-1"], "head.slope = -1.0 is out of range"),
    (["head.name=plif", "head.low=30.0"], "head.low = 30.0 is out of range"),
    (["head.name=plif", "head.low=5.0", "head.high=1.0"], "head.low = 5.0, head.high = 1.0 are"),
]


@pytest.mark.parametrize(("overrides", "expected"), KNOBS_OUT_OF_RANGE)
def test_head_knobs_out_of_range_are_config_errors_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert expected in str(error.value)
    assert str(error.value).startswith("override 'head.")  # where the value came from


def test_a_head_knob_out_of_range_in_a_file_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(
        f'[data]\ndir = "{tmp_path / "no-corpus"}"\n[head]\nname = "mos"\nn_components = 0\n'
    )
    assert main(["train", str(path), f"--run.out_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    # checked with the config: the missing corpus is never read
    assert f"{path}, line 5: head.n_components = 0 is out of range" in err[0]
    assert not (tmp_path / "out").exists()


def test_valid_knobs_still_load():
    config = load_config(None, ["head.name=mixtape", "head.gate_weight_norm=true"])
    assert config.head.knobs["gate_weight_norm"] is True


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "x.toml", "--head.n_component=3"], "did you mean head.n_components"),
        (["eval", "r", "--spli", "test"], "did you mean --split"),
        (["finetune", "r", "--resum"], "did you mean --resume"),
        (["analyze", "rank", "r", "--whic", "best"], "unrecognized"),
        (["compare", "a", "b", "--", "c", "d", "--welc"], "unrecognized"),
    ],
)
def test_abbreviated_options_are_refused(argv, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert expected in capsys.readouterr().err


def test_every_parser_refuses_abbreviations():
    import argparse

    from highrank.cli import build_parser

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    found = list(parsers(build_parser()))
    assert len(found) > 15  # the verbs and the analyze kinds
    assert all(p.allow_abbrev is False for p in found), [p.prog for p in found if p.allow_abbrev]


def test_train_without_arguments_says_what_is_missing(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "nothing to train: give a config file" in err and "--resume RUN_DIR" in err


@pytest.mark.parametrize("verb", [["train"], ["config", "show"]])
def test_a_mistyped_config_path_says_did_you_mean_in_one_line(verb, capsys):
    """Issue 29: `highrank train configs/ptb/small-softmx.toml` named no close file."""
    assert main([*verb, "configs/ptb/small-softmx.toml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "config file 'configs/ptb/small-softmx.toml' not found; did you mean " in err[0]
    assert "configs/ptb/small-softmax.toml" in err[0]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (99999999999999999999, "TOML integers are 64-bit"),  # beyond int64: C++ frames before
        (9999999999999999, "more elements than any machine has"),  # a RuntimeError traceback
    ],
)
def test_an_impossible_size_is_one_line_naming_the_key(value, reason, tmp_path, capsys):
    """Issue 29: `d_embed = 99999999999999999999` printed 16 lines of C++ frames."""
    path = tmp_path / "big.toml"
    path.write_text(f'[data]\ndir = "{tmp_path / "no-corpus"}"\n[model]\nd_embed = {value}\n')
    for verb in (["train"], ["config", "show"]):
        assert main([*verb, str(path), f"--run.out_dir={tmp_path / 'out'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert f"{path}, line 4: model.d_embed = {value} is out of range" in err[0]
        assert reason in err[0] and "frame #" not in err[0]
    assert not (tmp_path / "out").exists()


def _one_error_line(err: str, verb: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"highrank {verb}: error: "), err
    return lines[0]


@pytest.mark.parametrize(("device", "expected"), [
    ("banana", "--device = 'banana' is not a device: expected cpu, cuda, cuda:N, mps or auto"),
    ("cuda:7", "--device = 'cuda:7', but this torch"),
])
def test_a_device_this_torch_cannot_use_is_one_line(tiny_run, device, expected, capsys):
    """A new user's walk: torch's RuntimeError / AssertionError tracebacks, from every verb."""
    for verb in ("rank", "kl"):
        assert main(["analyze", verb, str(tiny_run), "--device", device, "--no-progress"]) == 2
        assert expected in _one_error_line(capsys.readouterr().err, "analyze")


def test_logits_of_a_head_without_them_is_one_line(tmp_path, capsys):
    from tests.conftest import train_tiny_run

    mos = train_tiny_run(tmp_path, "mos", "head.name=mos", "head.n_components=2")
    capsys.readouterr()
    argv = ["analyze", "rank", str(mos), "--kind", "logits", "--max-contexts", "5", "--no-progress"]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err, "analyze rank")
    assert "kind='logits' needs a head of the softmax family" in line


@pytest.mark.parametrize(("name", "expected"), [
    ("nll.csv", "expected a .tsv or .npy file name"),
    ("missing/nll.tsv", "the folder {tmp}/missing does not exist"),
])
def test_a_token_nll_path_that_cannot_be_written_is_refused_before_the_evaluation(
    tiny_run, tmp_path, name, expected, capsys, monkeypatch
):
    import highrank.evaluate.run as evaluate_run

    monkeypatch.setattr(evaluate_run, "evaluate_run", lambda *a, **k: pytest.fail("evaluated"))
    assert main(["eval", str(tiny_run), "--token-nll", str(tmp_path / name)]) == 2
    line = _one_error_line(capsys.readouterr().err, "eval")
    assert expected.format(tmp=tmp_path) in line


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_folder_that_cannot_be_made_is_one_line(tiny_run, capsys):
    """A new user's walk: a FileNotFoundError traceback from mkdir (no folder can be made in
    /proc, even by root)."""
    out = "/proc/highrank-cannot-be-here"
    for argv, verb in ((["analyze", "rank", str(tiny_run), "--out", out], "analyze rank"),
                       (["report", str(tiny_run), "--out", out], "report")):
        assert main(argv) == 2
        line = _one_error_line(capsys.readouterr().err, verb)
        assert line.endswith(f"--out {out}: cannot make the folder for " + (
            "the records" if verb != "report" else "report.html and its files") + " here: "
            "No such file or directory")
