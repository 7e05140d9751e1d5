"""``highrank train CONFIG --init-from SOFTMAX_RUN``: the new run starts at the softmax run's
distribution with its head switched (tiny AWD-LSTM runs; an untied decoder with a projection,
so the softmax's projection is carried over too)."""

from __future__ import annotations

import pytest
import torch

from highrank.cli import main
from highrank.config import ConfigError, load_config
from highrank.models import build_model, load_run
from highrank.runs.checkpoint import CheckpointError
from highrank.train.warm_start import init_from_run, with_base_init
from tests.conftest import TINY, train_tiny_run


@pytest.fixture(scope="module")
def softmax_run(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("softmax"), "softmax", "model.d_last=10")


def config_for(softmax_run, head: str, *more: str):
    corpus = softmax_run.parent / "corpus"
    return load_config(None, [f"data.dir={corpus}", f"run.out_dir={softmax_run.parent / head}",
                              *TINY, "model.d_last=10", f"head.name={head}", *more])


@pytest.mark.parametrize("head", ["mos", "moc", "mixtape", "gss", "plif", "mlp_softmax"])
def test_the_switched_model_starts_at_the_softmax_runs_distribution(softmax_run, head):
    source, _, vocab = load_run(softmax_run)
    config = with_base_init(config_for(softmax_run, head))
    model = build_model(config, len(vocab)).eval()
    init_from_run(model, softmax_run, vocab)
    tokens = torch.randint(0, len(vocab), (7, 3))
    with torch.no_grad():
        expected, _ = source.log_prob(tokens)
        got, _ = model.log_prob(tokens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_the_command_records_the_warm_start_and_trains(softmax_run, capsys):
    corpus = softmax_run.parent / "corpus"
    out = softmax_run.parent / "cli-mos"
    toml = softmax_run.parent / "mos.toml"
    toml.write_text('[head]\nname = "mos"\nn_components = 2\n')
    argv = ["train", str(toml), f"--data.dir={corpus}",
            f"--run.out_dir={out}", *(f"--{o}" for o in TINY), "--model.d_last=10",
            "--init-from", str(softmax_run), "--max-steps", "2", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "residual_contexts = true" in (out / "config.toml").read_text()
    assert "--init-from" in (out / "command.txt").read_text()


def test_what_cannot_be_switched_is_refused(softmax_run, tmp_path):
    with pytest.raises(ConfigError, match=r"--init-from: head 'sigsoftmax' cannot start at"):
        with_base_init(config_for(softmax_run, "sigsoftmax"))
    _, _, vocab = load_run(softmax_run)
    wider = with_base_init(config_for(softmax_run, "mos", "model.d_embed=9"))
    with pytest.raises(CheckpointError, match=r"its model differs from this config's outside"):
        init_from_run(build_model(wider, len(vocab)), softmax_run, vocab)
    mos_run = train_tiny_run(tmp_path, "mos", "model.d_last=10", "head.name=mos",
                             "head.n_components=2")
    config = with_base_init(config_for(softmax_run, "mos"))
    with pytest.raises(CheckpointError, match=r"its head is MixtureOfSoftmaxes; a warm start"):
        init_from_run(build_model(config, len(vocab)), mos_run, vocab)
