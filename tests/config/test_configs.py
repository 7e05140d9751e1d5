"""configs/: every recipe loads and validates; paper recipes have the published parameter counts;
``highrank config show`` prints the resolved config and the parameter count."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from highrank.config import SECTIONS, load_config
from highrank.heads import PAPER_HEADS
from highrank.train import parameter_count

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ALL = sorted(CONFIGS.glob("*/*.toml"))
VOCAB = {"ptb": 10_000, "wt2": 33_278}  # read from no file: the published sizes
DATA_DIR = {
    "ptb": "../shared/data/ptb",
    "ptb-char": "../shared/data/ptb",  # the same files, read as characters
    "wt2": "../shared/data/wikitext-2",
    "multi30k": "../shared/data/multi30k",
}

# Published parameter counts (millions): Merity et al. 2018 (AWD-LSTM), Yang et al. 2018 (MoS),
# Ganea et al. 2019 (LMS-PLIF), and the rank study (Parthiban et al. 2021, supplementary Tables
# 10-11: SS, GSS and MoC). Mixtape is sized to MoS's count, as the Mixtape paper compares them.
PUBLISHED = {
    **{f"ptb/awd-lstm-{head}": 24.22 for head in ("softmax", "sigsoftmax", "gss")},
    **{f"ptb/awd-lstm-{head}": 21.50 for head in ("mos", "moc", "mixtape")},
    "ptb/awd-lstm-plif": 24.32,
    **{f"wt2/awd-lstm-{head}": 33.55 for head in ("softmax", "sigsoftmax", "gss")},
    **{f"wt2/awd-lstm-{head}": 34.90 for head in ("mos", "moc", "mixtape")},
    "wt2/awd-lstm-plif": 33.65,
}


def name_of(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def test_there_is_a_paper_recipe_per_head_and_dataset_and_a_small_one_per_head():
    names = {name_of(p) for p in ALL}
    for head in PAPER_HEADS:  # the capacity control mlp_softmax is no paper's recipe
        assert {f"ptb/awd-lstm-{head}", f"wt2/awd-lstm-{head}", f"ptb/small-{head}"} <= names


@pytest.mark.parametrize("path", ALL, ids=name_of)
def test_every_config_loads_validates_and_names_its_head_and_data(path):
    config = load_config(path)
    dataset = path.parent.name
    assert config.data.dir == DATA_DIR[dataset]
    assert path.stem.endswith(f"-{config.head.name}")
    assert config.run.out_dir == f"runs/{dataset}/{path.stem}"
    # Every table of the file is a real section; nothing silently defaulted by a typo.
    assert set(tomllib.loads(path.read_text())) <= set(SECTIONS)


def test_every_paper_recipe_has_a_published_parameter_count():
    assert {name_of(p) for p in ALL if p.stem.startswith("awd-lstm-")} == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_paper_recipes_have_the_published_parameter_counts(name):
    config = load_config(CONFIGS / f"{name}.toml")
    count = parameter_count(config, VOCAB[name.split("/")[0]])
    published = PUBLISHED[name] * 1e6
    assert abs(count - published) / published < 0.01, f"{name}: {count:,} vs {published:,.0f}"


def test_small_recipes_are_small():
    for path in CONFIGS.glob("ptb/small-*.toml"):
        assert parameter_count(load_config(path), VOCAB["ptb"]) < 6e6, path.name


# ---- highrank config show ---------------------------------------------------------------------


def test_config_show_prints_the_resolved_toml_and_the_parameter_count(capsys, tmp_path):
    from highrank.cli import main

    path = CONFIGS / "ptb/awd-lstm-mos.toml"
    overrides = ["--data.dir=/nowhere", "--train.lr=25"]
    assert main(["config", "show", str(path), *overrides, "--vocab-size", "10000"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 21500620" in out.splitlines()
    toml_part = out.split("\n# vocabulary size")[0]
    shown = tmp_path / "shown.toml"
    shown.write_text(toml_part)
    assert load_config(shown) == load_config(path, ["data.dir=/nowhere", "train.lr=25"])


def test_config_show_reads_the_vocabulary_size_from_the_corpus(capsys, tmp_path):
    from highrank.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "valid", "test"):
        (corpus / f"{split}.txt").write_text("a b c\nd e\n")
    argv = ["config", "show", f"--data.dir={corpus}", "--model.d_embed=4", "--model.d_hidden=5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "vocabulary size 6 (the corpus at" in out
    count = int(out.strip().splitlines()[-1].removeprefix("parameters: "))
    assert count == parameter_count(
        load_config(None, [f"data.dir={corpus}", "model.d_embed=4", "model.d_hidden=5"]), 6
    )


def test_config_show_without_corpus_or_vocab_size_says_what_to_pass(capsys):
    from highrank.cli import main

    assert main(["config", "show", "--data.dir=/nowhere"]) == 2
    err = capsys.readouterr().err
    assert "'/nowhere' is not a directory" in err and "--vocab-size" in err
    with pytest.raises(SystemExit) as exit_info:  # an unknown key is an argparse error
        main(["config", "show", "--train.nope=1"])
    assert exit_info.value.code == 2
    assert "unknown config key 'train.nope'" in capsys.readouterr().err


def test_a_model_too_large_to_exist_is_one_line(capsys, tmp_path):
    """Issue: --model.d_hidden=1000000000 gave a storage-overflow traceback."""
    from highrank.cli import main
    from tests.conftest import write_corpus

    config, big = "configs/ptb/small-softmax.toml", "--model.d_hidden=1000000000"
    corpus = write_corpus(tmp_path / "corpus")
    assert main(["config", "show", config, big, "--vocab-size", "10000"]) == 2
    assert main(["train", config, big, f"--data.dir={corpus}", f"--run.out_dir={tmp_path}/r"]) == 2
    for line in capsys.readouterr().err.strip().splitlines():
        assert "cannot be built: one of its tensors would hold more bytes" in line
