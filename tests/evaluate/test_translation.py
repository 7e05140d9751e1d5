"""Translation runs end to end on generated sentence pairs: training (the seq2seq recipe),
exact resume, translating and BLEU records, the CLI, and bad inputs.

The corpus: sources are 2-6 words from a 13-word vocabulary; the target reverses the words and
spells each backwards with an ``x`` (``the red dog`` -> ``godx derx ehtx``). Models are tiny
(d 16, one layer each side) and run a few dozen steps on one thread.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("sentencepiece", reason="translation needs the mt extra (sentencepiece)")
pytest.importorskip("sacrebleu", reason="translation needs the mt extra (sacrebleu)")

from highrank.cli import main  # noqa: E402
from highrank.config import ConfigError, load_config  # noqa: E402
from highrank.runs.checkpoint import load_checkpoint  # noqa: E402
from highrank.runs.run_dir import read_metrics  # noqa: E402
from highrank.train import TrainOptions, resume, train  # noqa: E402
from highrank.train.schedule import lr_factor  # noqa: E402

WORDS = "the a red blue dog cat runs sits on big small house tree".split()
QUIET = TrainOptions(progress=False)


def write_corpus(folder: Path, sizes=(("train", 160), ("valid", 16), ("test", 12))) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in sizes:
        src, tgt = [], []
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
            src.append(" ".join(words))
            tgt.append(" ".join(w[::-1] + "x" for w in reversed(words)))
        (folder / f"{split}.en").write_text("\n".join(src) + "\n", encoding="utf-8")
        (folder / f"{split}.de").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return folder


TOML = """\
[data]
dir = "{data}"
src_lang = "en"
tgt_lang = "de"
subword_vocab_size = 48

[model]
backbone = "seq2seq"
d_embed = 16
n_heads = 2
n_encoder_layers = 1
n_decoder_layers = 1
d_ff = 32
max_len = 40
dropout_input = 0.1
dropout_attention = 0.1
dropout_residual = 0.1

[head]
name = "{head}"

[train]
lr = 0.01
warmup_steps = 4
max_tokens = 192
label_smoothing = 0.1
epochs = {epochs}
eval_every = 5
clip = 1.0
weight_decay = 0.01
log_every = 1
seed = 3

[decode]
beam_size = 2
max_len_b = 5

[run]
out_dir = "{out}"
device = "cpu"
"""


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("bitext") / "pairs")


def config_file(folder: Path, data: Path, out: Path, head="softmax", epochs=2, extra="") -> Path:
    path = folder / f"{out.name}.toml"
    text = TOML.format(data=data, out=out, head=head, epochs=epochs)
    path.write_text(text + extra, encoding="utf-8")
    return path


def trajectory(run_dir: Path) -> list[tuple]:
    keys = ("kind", "epoch", "step", "train_loss", "val_loss", "phase", "lr")
    return [tuple(r.get(k) for k in keys) for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A finished 2-epoch softmax run (shared by the decoding tests)."""
    folder = tmp_path_factory.mktemp("runs")
    out = folder / "softmax"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a module fixture runs before the per-test one-thread fixture
    try:
        train(load_config(config_file(folder, corpus, out)), options=QUIET)
    finally:
        torch.set_num_threads(threads)
    return out


# ---- training ---------------------------------------------------------------------------------


def test_training_lowers_the_validation_loss_and_keeps_the_run_layout(trained):
    evals = [r for r in read_metrics(trained / "metrics.jsonl") if "val_loss" in r]
    assert len(evals) >= 3
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5
    for name in ("config.toml", "vocab.json", "subwords/subwords.json", "subwords/joint.model"):
        assert (trained / name).is_file(), name
    assert (trained / "checkpoints/best.pt").is_file()
    steps = [r for r in read_metrics(trained / "metrics.jsonl") if r["kind"] == "step"]
    assert steps[0]["phase"] == "warmup" and steps[-1]["phase"] == "inverse-sqrt"
    # lr of update t is lr * factor(t): warm-up for 4 updates, then inverse-sqrt
    assert steps[0]["lr"] == pytest.approx(0.01 * 1 / 4)
    assert steps[9]["lr"] == pytest.approx(0.01 * (4 / 10) ** 0.5)


@pytest.mark.parametrize("head", ["mixtape"])
def test_resume_is_bit_identical(corpus, tmp_path, head):
    """A run stopped mid-epoch and resumed logs the same losses and ends with the same weights
    as one that ran straight through (stochastic heads' dropout and noise included)."""
    knobs = {
        "mixtape": ["head.gate_noise=0.1", "head.gate_dropout=0.1", "head.component_dropout=0.1"],
    }[head]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for out in (straight, stopped):
        config = load_config(config_file(tmp_path, corpus, out, head=head), knobs)
        max_steps = None if out is straight else 7
        result = train(config, options=TrainOptions(progress=False, max_steps=max_steps))
    assert result.stop_reason == "max_steps"
    resume(stopped, options=QUIET)
    assert trajectory(stopped) == trajectory(straight)
    a = load_checkpoint(straight / "checkpoints/last.pt")
    b = load_checkpoint(stopped / "checkpoints/last.pt")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["training"]["updates"] == b["training"]["updates"]


def test_resume_reloads_the_saved_subwords(corpus, tmp_path):
    out = tmp_path / "run"
    train(load_config(config_file(tmp_path, corpus, out)), options=TrainOptions(max_steps=2))
    model = (out / "subwords/joint.model").read_bytes()
    resume(out, options=TrainOptions(progress=False, max_steps=3))
    assert (out / "subwords/joint.model").read_bytes() == model
    (out / "subwords/joint.model").write_bytes(b"not a model")
    assert main(["train", "--resume", str(out), "--max-steps", "4", "--no-progress"]) == 2


# ---- decoding and BLEU ------------------------------------------------------------------------


def test_translate_writes_hypotheses_and_a_bleu_record(trained, tmp_path, capsys):
    out = tmp_path / "hyp.de"
    assert main(["translate", str(trained), "--beam", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "BLEU = " in printed and "signature: nrefs:1|case:mixed" in printed
    record_path = trained / "translate-test-best-beam2-lp1-len1.5x+5.json"
    record = json.loads(record_path.read_text())
    assert record["sentences"] == 12 and record["hypotheses"] == str(out)
    assert 0.0 <= record["bleu"] <= 100.0 and record["signature"].startswith("nrefs:1")
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 12
    from highrank.mt.bleu import corpus_bleu

    test_de = Path(record["references"]).read_text(encoding="utf-8").splitlines()
    assert corpus_bleu(lines, test_de).score == pytest.approx(record["bleu"])


def test_beam_one_equals_greedy_through_the_cli(trained, tmp_path):
    beam, greedy = tmp_path / "beam.txt", tmp_path / "greedy.txt"
    assert main(["translate", str(trained), "--beam", "1", "--out", str(beam)]) == 0
    assert main(["eval", str(trained), "--bleu", "--greedy", "--out", str(greedy)]) == 0
    assert beam.read_text() == greedy.read_text()
    assert (trained / "translate-test-best-greedy-len1.5x+5.json").is_file()


# ---- bad inputs -------------------------------------------------------------------------------


def test_mismatched_line_counts_name_the_file_and_line(tmp_path, capsys):
    data = write_corpus(tmp_path / "bad")
    (data / "train.de").write_text(
        "\n".join((data / "train.de").read_text().splitlines()[:-1]) + "\n"
    )
    path = config_file(tmp_path, data, tmp_path / "run")
    assert main(["train", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "train.en has 160 lines but" in err and "line 160 of" in err


def test_an_unknown_language_names_the_missing_file(corpus, tmp_path, capsys):
    path = config_file(tmp_path, corpus, tmp_path / "run")
    assert main(["train", str(path), "--data.src_lang=fr", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing file" in err and "train.fr" in err


def test_a_missing_subword_model_is_one_line(trained, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    (copy / "subwords/joint.model").unlink()
    assert main(["translate", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "joint.model does not exist" in err


@pytest.mark.parametrize(
    ("table", "line", "message"),
    [
        ("decode", "beam = 4", "unknown key 'decode.beam'"),
        ("decode", "beam_size = 0", "decode.beam_size = 0 is out of range"),
        ("train", "label_smoothing = 1.5", "train.label_smoothing = 1.5 is out of range"),
        ("data", 'src_lang = "e.n"', 'data.src_lang = "e.n" is out of range'),
    ],
)
def test_bad_translation_keys_name_file_and_line(tmp_path, table, line, message):
    path = tmp_path / "bad.toml"
    path.write_text(f'[model]\nbackbone = "seq2seq"\n\n[{table}]\n{line}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}, line 5: {message}")


def test_label_smoothing_and_heads_keys_belong_to_the_family(tmp_path):
    with pytest.raises(ConfigError, match="train.label_smoothing is a key of model.backbone"):
        load_config(None, ["train.label_smoothing=0.2"])
    with pytest.raises(ConfigError, match="n_heads = 3 does not divide model.d_embed = 16"):
        load_config(None, ["model.backbone=seq2seq", "model.d_embed=16", "model.n_heads=3"])


# ---- the schedule -----------------------------------------------------------------------------


def test_lr_factor_closed_forms():
    assert lr_factor(1, warmup_steps=4, schedule="inverse-sqrt", total_steps=None) == 0.25
    assert lr_factor(4, warmup_steps=4, schedule="inverse-sqrt", total_steps=None) == 1.0
    assert lr_factor(16, warmup_steps=4, schedule="inverse-sqrt", total_steps=None) == 0.5
    assert lr_factor(9, warmup_steps=0, schedule="inverse-sqrt", total_steps=None) == 1 / 3
    assert lr_factor(4, warmup_steps=4, schedule="cosine", total_steps=12) == 1.0
    assert lr_factor(8, warmup_steps=4, schedule="cosine", total_steps=12) == pytest.approx(0.5)
    assert lr_factor(12, warmup_steps=4, schedule="cosine", total_steps=12) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="total_steps > warmup_steps"):
        lr_factor(5, warmup_steps=4, schedule="cosine", total_steps=None)


def test_a_run_stopped_before_its_first_checkpoint_starts_again_in_place(corpus, tmp_path, capsys):
    """Issue: `train --resume R` and the original command both said "R already holds a run",
    so a translation run killed before its first checkpoint could never be continued."""

    def crash(info):
        if info.step == 2:
            raise KeyboardInterrupt("a crash before any checkpoint")

    straight = tmp_path / "straight"
    train(load_config(config_file(tmp_path, corpus, straight)), options=QUIET)
    out = tmp_path / "run"
    config = load_config(config_file(tmp_path, corpus, out), ["train.checkpoint_minutes=0"])
    for again in (lambda: resume(out, options=QUIET), lambda: train(config, options=QUIET)):
        with pytest.raises(KeyboardInterrupt):
            train(config, options=TrainOptions(progress=False, callback=crash))
        assert (out / "config.toml").exists() and not any((out / "checkpoints").iterdir())
        again()
        assert trajectory(out) == trajectory(straight)
        assert "stopped before its first checkpoint; starting it again" in capsys.readouterr().err
        for path in (out / "checkpoints").iterdir():
            path.unlink()  # the next round starts from a run with no checkpoint again


@pytest.mark.parametrize("verb", [["dynamic-eval"], ["finetune"], ["analyze", "rank"]])
def test_verbs_for_word_corpora_say_they_do_not_apply_to_a_translation_run(trained, capsys, verb):
    """Issue: they said "missing train.txt"."""
    assert main([*verb, str(trained)]) == 2
    err = capsys.readouterr().err
    assert "translation run" in err and "train.txt" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_training_says_how_many_pairs_max_len_leaves_out(corpus, tmp_path, capsys):
    """Issue: over-long training pairs were dropped without a word."""
    out = tmp_path / "short"
    config = load_config(config_file(tmp_path, corpus, out), ["model.max_len=6"])
    train(config, options=TrainOptions(progress=False, max_steps=3))
    notes = [line for line in capsys.readouterr().err.splitlines() if "left out" in line]
    assert len(notes) == 1
    assert notes[0].startswith("note: ") and "more than model.max_len = 6 tokens" in notes[0]


def test_eval_refuses_word_options_and_translate_a_folder_as_out(trained, tmp_path, capsys):
    """Issue: eval --max-tokens 100 translated every sentence and overwrote earlier outputs;
    translate --out DIR ended in a traceback after decoding."""
    before = sorted(p.name for p in trained.iterdir())
    assert main(["eval", str(trained), "--max-tokens", "100"]) == 2
    assert "--max-tokens applies to language-model runs" in capsys.readouterr().err
    assert main(["translate", str(trained), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a folder; give the file" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in trained.iterdir()) == before


def test_a_model_no_memory_holds_is_one_line_before_any_work(corpus, tmp_path, capsys):
    """Campaign: --model.d_ff=1e11 ended in the CPU allocator's traceback (the LM families said
    "make the model smaller"); refused before the subwords are learned, nothing written."""
    out = tmp_path / "huge"
    argv = ["train", str(config_file(tmp_path, corpus, out)), "--model.d_ff=100000000000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.d_ff = 100000000000" in err and "make the model smaller" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize(
    ("clip", "advised"),
    [(1.0, "a tighter gradient clip (train.clip = 1, e.g. --train.clip=0.5)"),
     (0.0, "a gradient clip (train.clip = 0: none, e.g. --train.clip=1)")],
)  # fmt: skip
def test_the_non_finite_stop_never_advises_the_clip_in_use(clip, advised):
    """Issue 29: a run with train.clip = 1 that diverged was told "--train.clip=1"."""
    from types import SimpleNamespace

    from highrank.train.seq2seq import Seq2SeqRecipe

    train = SimpleNamespace(lr=7e-4, warmup_steps=400, clip=clip)
    advice = Seq2SeqRecipe.divergence_advice(SimpleNamespace(config=SimpleNamespace(train=train)))
    assert advice.endswith(advised) and "--train.lr=0.00035" in advice
