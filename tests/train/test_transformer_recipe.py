"""highrank.train.transformer: the Transformer LM recipe through `highrank train` — the config
family, AdamW groups, the warm-up/decay schedule, windows, gradient accumulation, bf16, exact
resume, and the eval / analyze verbs on a tiny Transformer run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from highrank.config import ConfigError, load_config
from highrank.data import load_corpus
from highrank.heads import PAPER_HEADS
from highrank.models import build_model, count_parameters
from highrank.models.backbones.transformer import CausalTransformer
from highrank.runs.checkpoint import load_checkpoint
from highrank.runs.run_dir import read_metrics
from highrank.train import TrainOptions, finetune, resume, train
from highrank.train.recipe import Stage
from highrank.train.schedule import lr_factor
from highrank.train.transformer import TransformerRecipe, adamw_groups, window_starts
from tests.conftest import TINY_TRANSFORMER as TINY

QUIET = TrainOptions(progress=False)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(corpus: Path, out: Path, *overrides: str):
    return load_config(None, [f"data.dir={corpus}", f"run.out_dir={out}", *TINY, *overrides])


def n_windows(corpus: Path) -> int:
    """Windows of 6 rows in the tiny corpus's training batch of 4 columns."""
    rows = load_corpus(corpus).batchify("train", 4).size(0)
    return len(range(0, rows - 1, 6))


def trajectory(run_dir: Path) -> list[tuple]:
    keys = ("kind", "epoch", "step", "train_loss", "val_loss", "phase", "lr")
    return [tuple(r.get(k) for k in keys) for r in read_metrics(run_dir / "metrics.jsonl")]


# ---- config and model -------------------------------------------------------------------------


def test_the_transformer_family_builds_a_causal_transformer_with_a_tied_head(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path / "run", "head.name=mos", "head.n_components=2")
    model = build_model(config, 31)
    assert isinstance(model.backbone, CausalTransformer)
    assert model.backbone.n_layers == 2 and model.backbone.inputs.kind == "learned"
    assert model.head.weight is model.backbone.embedding.weight
    assert model.head.dropout_time_dim == 0  # time-major windows: one mask per column
    # embedding 31x8, positions 6x8, 2 blocks (4*64+4*8 + 2*8*16+16+8 + 4*8), final LN 16;
    # MoS: prior 8x2, latent 8x16 + 16, decoder bias 31
    block = 4 * 64 + 32 + 2 * 8 * 16 + 16 + 8 + 32
    assert count_parameters(model) == 31 * 8 + 6 * 8 + 2 * block + 16 + 16 + 8 * 16 + 16 + 31


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.d_hidden=10", "model.d_hidden is a key of model.backbone = 'awd-lstm'"),
        ("train.optimizer=sgd", "train.optimizer is a key of model.backbone = 'awd-lstm'"),
        ("model.n_heads=3", "model.n_heads = 3 does not divide model.d_embed = 8"),
        ("model.max_len=5", "model.max_len = 5 is shorter than the windows (train.bptt = 6)"),
        ("train.accumulate=0", "train.accumulate = 0 is out of range"),
        ("model.n_encoder_layers=2", "is a key of model.backbone = 'seq2seq'"),
    ],
)
def test_config_errors_name_the_key(corpus, tmp_path, override, message):
    with pytest.raises(ConfigError, match=re_escape(message)):
        tiny_config(corpus, tmp_path / "run", override)


def test_a_cosine_schedule_needs_updates_after_the_warmup(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path / "run", "train.warmup_steps=40")  # 2 x 17 updates
    with pytest.raises(ConfigError, match="train.warmup_steps = 40 leaves no updates to decay"):
        train(config, options=QUIET)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_rotary_positions_have_no_length_limit_in_the_config(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path / "run", "model.positions=rotary", "model.max_len=2")
    assert build_model(config, 31).backbone.inputs.table is None


# ---- the optimizer and the schedule -----------------------------------------------------------


def test_adamw_decays_linear_weights_only_and_keeps_a_heads_own_lr(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path / "run", "head.name=plif", "head.n_pieces=50")
    model = build_model(config, 31)
    groups = adamw_groups(model, 0.01, 0.1)
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # each exactly once
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    for group in groups:
        decayed = group["weight_decay"] > 0
        assert all((id(p) in linear) == decayed for p in group["params"])
    undecayed = {id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    backbone = model.backbone
    for param in (backbone.embedding.weight, backbone.inputs.table.weight, model.head.bias):
        assert id(param) in undecayed
    slopes = [g for g in groups if any(p is model.head.slope_logits for p in g["params"])]
    assert slopes[0]["peak_lr"] == model.head.slope_lr and slopes[0]["weight_decay"] == 0


# ---- windows and training -------------------------------------------------------------------


def test_an_epoch_visits_every_window_once_in_a_shuffled_order(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path / "run")
    data = load_corpus(corpus)
    model = build_model(config, len(data.vocab))
    recipe = TransformerRecipe(config, model, data, Stage("train", 2, "last", "best"), "cpu")
    rows = recipe.splits.train.size(0)
    assert recipe.starts == window_starts(rows, 6) == list(range(0, rows - 1, 6))
    assert sorted(recipe.order) == list(range(len(recipe.starts)))
    assert recipe.order != sorted(recipe.order)
    assert recipe.epoch_size().positions == len(recipe.starts) == n_windows(corpus)


def test_a_few_steps_lower_the_loss_and_the_lr_follows_warmup_then_cosine(corpus, tmp_path):
    out = tmp_path / "run"
    result = train(tiny_config(corpus, out, "train.lr=0.03"), options=QUIET)
    assert result.stop_reason == "epochs"
    metrics = out / "metrics.jsonl"
    validations = sorted(
        read_metrics(metrics, "eval") + read_metrics(metrics, "epoch"), key=lambda r: r["step"]
    )
    assert validations[-1]["val_loss"] < validations[0]["val_loss"] - 0.1
    steps = read_metrics(metrics, "step")
    assert steps[-1]["train_loss"] < steps[0]["train_loss"] - 0.1
    total = 2 * math.ceil(n_windows(corpus) / 2)  # two epochs of two windows per update
    assert [s["step"] for s in steps] == list(range(1, total + 1))
    for record in steps:
        factor = lr_factor(record["step"], warmup_steps=3, schedule="cosine", total_steps=total)
        assert record["lr"] == pytest.approx(0.03 * factor)
        assert record["phase"] == ("warmup" if record["step"] <= 3 else "cosine")


def test_bf16_autocast_trains_with_float32_weights(corpus, tmp_path):
    out = tmp_path / "run"
    train(
        tiny_config(corpus, out, "train.bf16=true"),
        options=TrainOptions(progress=False, max_steps=4),
    )
    saved = load_checkpoint(out / "checkpoints/last.pt")
    assert all(t.dtype == torch.float32 for t in saved["model"].values() if t.is_floating_point())
    assert all(math.isfinite(r["train_loss"]) for r in read_metrics(out / "metrics.jsonl", "step"))


SOFTMAX = ["head.name=softmax"]
MIXTAPE = ["head.name=mixtape", "head.gate_dim=3", "head.gate_noise=0.1", "head.gate_dropout=0.2"]


@pytest.mark.parametrize(
    ("head", "stop"),
    [(SOFTMAX, 4), (SOFTMAX, 19), (MIXTAPE, 6)],  # mid-epoch, in epoch 2, at a validation
    ids=["softmax-mid-epoch", "softmax-epoch-2", "mixtape-at-validation"],
)
def test_an_interrupted_transformer_run_resumes_bit_identically(corpus, tmp_path, stop, head):
    straight = tmp_path / "straight"
    train(tiny_config(corpus, straight, *head), options=QUIET)
    out = tmp_path / "interrupted"
    first = train(
        tiny_config(corpus, out, *head), options=TrainOptions(progress=False, max_steps=stop)
    )
    assert first.stop_reason == "max_steps"
    resume(out, options=QUIET)
    assert trajectory(out) == trajectory(straight)
    for name in ("last.pt", "best.pt"):
        ours = load_checkpoint(out / "checkpoints" / name)
        theirs = load_checkpoint(straight / "checkpoints" / name)
        assert ours["model"].keys() == theirs["model"].keys()
        for key in ours["model"]:
            assert torch.equal(ours["model"][key], theirs["model"][key]), key
    ours = load_checkpoint(out / "checkpoints/last.pt")["training"]["optimizer"]["state"]
    theirs = load_checkpoint(straight / "checkpoints/last.pt")["training"]["optimizer"]["state"]
    for index in theirs:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours[index][key], theirs[index][key])


def test_a_transformer_run_has_no_finetuning_stage(corpus, tmp_path):
    out = tmp_path / "run"
    train(tiny_config(corpus, out), options=TrainOptions(progress=False, max_steps=4))
    with pytest.raises(ConfigError, match="a transformer run has no 'finetune' stage"):
        finetune(out, overrides=["finetune.epochs=1"], options=QUIET)


# ---- the verbs on a Transformer run -----------------------------------------------------------


def train_tiny_run(corpus: Path, tmp_path: Path, *extra: str) -> Path:
    from highrank.cli import main

    out = tmp_path / "run"
    config = tmp_path / "tiny.toml"
    config.write_text('[model]\nbackbone = "transformer"\n')
    overrides = [f"--{o}" for o in TINY[1:]] + [f"--data.dir={corpus}", f"--run.out_dir={out}"]
    words = ["train", str(config), *overrides, *extra, "--train.epochs=1", "--no-progress"]
    assert main(words) == 0
    return out


def test_cli_train_eval_and_analyze_rank_on_a_tiny_transformer_run(corpus, tmp_path, capsys):
    import json

    from highrank.cli import main

    out = train_tiny_run(corpus, tmp_path)
    capsys.readouterr()
    assert main(["eval", str(out), "--split", "test", "--bptt", "6", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "perplexity" in printed.lower()
    assert main(["analyze", "rank", str(out), "--bptt", "6", "--no-progress"]) == 0
    record = json.loads((out / "analysis" / "rank-test-best-bptt6.json").read_text())
    assert record["head"] == "softmax" and record["press_rank"] <= 8 + 2  # d + 2 for softmax


@pytest.mark.parametrize(
    "head", ["--head.name=mfs", "--head.name=cpr --head.reranker_k1=6 --head.reranker_k2=3"]
)
def test_heads_that_read_the_layers_and_tokens_train_and_evaluate(corpus, tmp_path, capsys, head):
    """MFS and CPR get the window's last 3 layers (2 blocks and the embedding) and tokens;
    eval scores the run; the analyses, which read rows of hidden states, refuse it in a line."""
    import json

    from highrank.cli import main
    from highrank.models import load_run

    out = train_tiny_run(corpus, tmp_path, *head.split())
    model, config, _ = load_run(out)
    assert model.head.time_dim == 0 and model.head.input_layers == 3
    assert main(["eval", str(out), "--split", "test", "--no-progress"]) == 0
    record = json.loads((out / "eval-test-best.json").read_text())
    assert math.isfinite(record["loss"]) and record["loss"] < math.log(31) + 1
    capsys.readouterr()
    assert main(["analyze", "rank", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "reads hidden, layers" in err and "highrank eval" in err


def test_eval_and_the_analyses_read_a_transformer_run_in_its_own_windows(corpus, tmp_path, capsys):
    """With no --bptt, eval, rank, kl and topk use the run's train.bptt (6 here: its learned
    positions cover no more, so the AWD-LSTM default of 70 would be refused)."""
    import json

    from highrank.cli import main

    out = train_tiny_run(corpus, tmp_path)
    assert main(["eval", str(out), "--split", "test", "--no-progress"]) == 0
    assert json.loads((out / "eval-test-best.json").read_text())["bptt"] == 6
    assert main(["analyze", "rank", str(out), "--no-progress"]) == 0
    assert json.loads((out / "analysis" / "rank-test-best.json").read_text())["bptt"] == 6
    assert main(["analyze", "kl", str(out), "--no-progress"]) == 0
    assert json.loads((out / "analysis" / "kl-test-best.json").read_text())["bptt"] == 6
    assert main(["analyze", "topk", str(out), "--random", "3", "--no-progress"]) == 0
    assert (
        json.loads((out / "analysis" / "topk-test-best.json").read_text())["runs"][0]["bptt"] == 6
    )
    capsys.readouterr()


def test_dynamic_eval_refuses_a_transformer_run_in_one_line(corpus, tmp_path, capsys):
    from highrank.cli import main

    out = train_tiny_run(corpus, tmp_path)
    capsys.readouterr()
    assert main(["dynamic-eval", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "needs a recurrent run" in err and "'transformer'" in err
    assert not list(out.glob("dynamic-eval*.json"))


def test_eval_of_a_character_run_records_bits_per_character(corpus, tmp_path, capsys):
    import json
    import math

    from highrank.cli import main

    out = train_tiny_run(corpus, tmp_path, "--data.mode=char")
    capsys.readouterr()
    assert main(["eval", str(out), "--split", "valid", "--no-progress"]) == 0
    record = json.loads((out / "eval-valid-best.json").read_text())
    assert record["bits_per_char"] == pytest.approx(record["loss"] / math.log(2), rel=1e-12)
    assert f"{record['bits_per_char']:.4f} bits per character" in capsys.readouterr().out


# ---- the recipes in configs/ ------------------------------------------------------------------

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("dataset", ["ptb", "wt2"])
@pytest.mark.parametrize("head", sorted(PAPER_HEADS))
def test_a_transformer_recipe_per_head_states_its_parameter_count(dataset, head):
    import re

    from highrank.train import parameter_count

    path = CONFIGS / dataset / f"transformer-{head}.toml"
    config = load_config(path)
    assert config.model.backbone == "transformer" and config.head.name == head
    stated = re.search(r"Parameters: ([\d,]+) \(V = ([\d,]+);", path.read_text())
    count, vocab = (int(group.replace(",", "")) for group in stated.groups())
    assert vocab == {"ptb": 10_000, "wt2": 33_278}[dataset]
    assert parameter_count(config, vocab) == count


def test_the_character_recipes_have_equal_parameter_counts_as_stated():
    """configs/ptb-char: softmax and MoS within 0.1% of each other (V = 50, ptb.char)."""
    import re

    from highrank.train import parameter_count

    counts = {}
    for head in ("softmax", "mos"):
        path = CONFIGS / "ptb-char" / f"transformer-{head}.toml"
        config = load_config(path)
        assert config.data.mode == "char" and config.head.name == head
        counts[head] = parameter_count(config, 50)
        stated = re.search(r"Parameters: ([\d,]+) \(", path.read_text()).group(1)
        assert counts[head] == int(stated.replace(",", ""))
    assert abs(counts["mos"] - counts["softmax"]) <= 0.001 * counts["softmax"]
