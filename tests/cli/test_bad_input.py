"""Bad input: one clear line, exit status 2, nothing written (issue 12)."""

from __future__ import annotations

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
