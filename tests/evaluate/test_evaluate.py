"""Evaluation: perplexity against naive loops, token-NLL export, dynamic evaluation against a
hand-written reference of Krause et al. (2017)'s update, dropout off while adapting."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from highrank.config import load_config
from highrank.data import CorpusError, Vocab
from highrank.evaluate import (
    DYNAMIC_EVAL_DEFAULTS,
    EvalResult,
    decay_rates,
    dynamic_evaluate,
    evaluate_perplexity,
    gradient_statistics,
    write_token_nll,
)
from highrank.evaluate.dynamic import unmeasured_statistics
from highrank.evaluate.scoring import scoring_mode
from highrank.models import build_model
from highrank.models.backbones.regularizers import LockedDropout, WeightDrop
from highrank.train import TrainingError

V = 20
SMALL = ["model.d_embed=16", "model.d_hidden=24", "model.n_layers=2"]


def _model(*extra: str):
    """A tiny tied AWD-LSTM with every dropout at its (non-zero) default, in train mode."""
    return build_model(load_config(None, [*SMALL, *extra]), vocab_size=V)


def _stream(n: int) -> torch.Tensor:
    return torch.randint(0, V, (n,))


def _naive_nll_per_step(model, ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """NLL ``(T - 1, B)`` from one time step at a time over the B contiguous columns."""
    rows = ids.numel() // batch_size
    columns = ids[: rows * batch_size].view(batch_size, rows).t()  # (T, B)
    model.eval()
    state, steps = None, []
    with torch.no_grad():
        for t in range(rows - 1):
            nll, state = model.nll(columns[t : t + 1], columns[t + 1 : t + 2], state)
            steps.append(nll[0])
    return torch.stack(steps)


# ---- static evaluation --------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 3, 10])
def test_perplexity_is_exp_mean_nll_of_a_step_by_step_loop(batch_size):
    model, ids = _model(), _stream(203)
    result = evaluate_perplexity(model, ids, batch_size=batch_size, bptt=7)
    naive = _naive_nll_per_step(model, ids, batch_size).double()
    assert result.tokens == naive.numel() == (203 // batch_size - 1) * batch_size
    assert result.loss == pytest.approx(naive.mean().item(), rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(naive.mean().item()), rel=1e-6)


def _nll_resetting_state(model, columns: torch.Tensor, bptt: int) -> torch.Tensor:
    """NLL ``(T - 1, B)`` when every segment of ``bptt`` rows starts from a zero state."""
    rows = columns.shape[0]
    model.eval()
    with torch.no_grad():
        pieces = [
            model.nll(columns[i : min(i + bptt, rows - 1)], columns[i + 1 : i + 1 + bptt])[0]
            for i in range(0, rows - 1, bptt)
        ]
    return torch.cat(pieces)


def test_state_is_carried_across_segments():
    model, ids = _model(), _stream(150)
    short = evaluate_perplexity(model, ids, batch_size=2, bptt=5)
    whole = evaluate_perplexity(model, ids, batch_size=2, bptt=1000)  # one segment
    assert short.loss == pytest.approx(whole.loss, rel=1e-6)
    carried = _naive_nll_per_step(model, ids, batch_size=2)  # (74, 2)
    assert short.loss == pytest.approx(carried.double().mean().item(), rel=1e-6)
    reset = _nll_resetting_state(model, ids.view(2, 75).t(), bptt=5)  # (74, 2)
    torch.testing.assert_close(reset[:5], carried[:5])  # the first segment starts at zero too
    assert (reset[5:] - carried[5:]).abs().max() > 1e-2  # later ones lose their context


def test_training_flags_are_restored():
    model = _model()
    model.train()
    model.head.eval()  # a mixed state must come back as it was
    before = [m.training for m in model.modules()]
    evaluate_perplexity(model, _stream(40), batch_size=2, bptt=5)
    assert [m.training for m in model.modules()] == before
    model.eval()
    evaluate_perplexity(model, _stream(40), batch_size=2, bptt=5)
    assert not any(m.training for m in model.modules())


def test_short_stream_error_names_the_split_and_what_was_expected():
    with pytest.raises(CorpusError, match=r"test\.txt is shorter than one batch: 15 tokens.*20"):
        evaluate_perplexity(_model(), _stream(15), batch_size=10, name="test.txt")
    with pytest.raises(ValueError, match="bptt must be a positive int"):
        evaluate_perplexity(_model(), _stream(50), batch_size=1, bptt=0)


# ---- token NLL export ---------------------------------------------------------------------


def test_token_nll_comes_back_in_stream_order():
    model, ids = _model(), _stream(23)  # B = 3: T = 7, two tokens trimmed
    result = evaluate_perplexity(model, ids, batch_size=3, bptt=4, return_token_nll=True)
    token_nll = result.token_nll
    assert token_nll.shape == (22,) and torch.equal(result.target_ids, ids[1:])
    model.eval()
    for b in range(3):  # each column alone, from a zero state, predicts ids[7b+1 .. 7b+6]
        column = ids[7 * b : 7 * b + 7]
        with torch.no_grad():
            expected, _ = model.nll(column[:-1, None], column[1:, None])
        torch.testing.assert_close(token_nll[7 * b : 7 * b + 6], expected[:, 0])
    unscored = torch.isnan(token_nll).nonzero().flatten().tolist()
    assert unscored == [6, 13, 20, 21]  # column ends and the trimmed tail
    assert token_nll[~torch.isnan(token_nll)].double().mean().item() == pytest.approx(result.loss)


def test_token_nll_files(tmp_path):
    vocab = Vocab([f"w{i}" for i in range(V)])
    model, ids = _model(), _stream(12)
    result = evaluate_perplexity(model, ids, batch_size=2, bptt=3, return_token_nll=True)
    lines = write_token_nll(tmp_path / "nll.tsv", result, vocab).read_text().splitlines()
    assert lines[0] == "position\ttarget\tnll" and len(lines) == 1 + result.tokens
    position, word, nll = lines[1].split("\t")
    assert (position, word) == ("1", f"w{ids[1]}")
    assert float(nll) == pytest.approx(result.token_nll[0].item(), abs=1e-6)
    assert lines[6].split("\t")[:2] == ["7", f"w{ids[7]}"]  # column 2 starts at position 6
    ids_only = write_token_nll(tmp_path / "ids.tsv", result).read_text().splitlines()
    assert ids_only[1].split("\t")[1] == str(int(ids[1]))
    array = np.load(write_token_nll(tmp_path / "nll.npy", result))
    np.testing.assert_array_equal(array, result.token_nll.numpy())
    with pytest.raises(ValueError, match=r"\.tsv or \.npy"):
        write_token_nll(tmp_path / "nll.csv", result)
    with pytest.raises(ValueError, match="return_token_nll=True"):
        write_token_nll(tmp_path / "x.tsv", EvalResult(1.0, math.e, 5))


# ---- gradient statistics and decay rates --------------------------------------------------


def test_gradient_statistics_shapes_positivity_and_tied_weight_once():
    model = _model()
    stats = gradient_statistics(model, _stream(400), batch_size=10, bptt=5)
    named = dict(model.named_parameters())
    assert set(stats) == set(named) and "head.weight" not in stats  # tied: counted once
    for key, ms in stats.items():
        assert ms.shape == named[key].shape
        assert torch.isfinite(ms).all() and (ms >= 0).all() and ms.sum() > 0
    assert all(p.grad is None for p in model.parameters())  # .grad never touched


def test_gradient_statistics_are_root_sum_of_squared_segment_gradients():
    model, ids = _model(), _stream(60)
    stats = gradient_statistics(model, ids, batch_size=4, bptt=5, max_batches=2)
    columns = ids.view(4, 15).t()
    reference = copy.deepcopy(model).eval()
    squares = [torch.zeros_like(p) for p in reference.parameters()]
    state = None
    for i in (0, 5):
        reference.zero_grad()
        nll, state = reference.nll(columns[i : i + 5], columns[i + 1 : i + 6], state)
        nll.mean().backward()
        state = reference.backbone.detach_state(state)
        for square, p in zip(squares, reference.parameters(), strict=True):
            square += p.grad**2
    for (key, _), square in zip(reference.named_parameters(), squares, strict=True):
        torch.testing.assert_close(stats[key], square.sqrt())


def test_decay_rates_normalise_by_the_sum_of_tensor_means_and_clip_at_one_over_lambda():
    stats = {"a": torch.tensor([1.0, 100.0]), "b": torch.tensor([1.0])}
    total = 50.5 + 1.0  # mean(a) + mean(b)
    unclipped = decay_rates(stats, prior_decay=0.1)  # limit 10: nothing clipped
    torch.testing.assert_close(unclipped["a"], torch.tensor([1.0, 100.0]) / total)
    clipped = decay_rates(stats, prior_decay=0.75)  # limit 4/3 < 100 / 51.5
    torch.testing.assert_close(clipped["a"], torch.tensor([1.0 / total, 1.0 / 0.75]))
    torch.testing.assert_close(clipped["b"], torch.tensor([1.0 / total]))
    assert decay_rates(stats, prior_decay=0.0)["a"][1] == pytest.approx(100.0 / total)
    with pytest.raises(ValueError, match="expected a positive finite number"):
        decay_rates({"a": torch.zeros(3)}, prior_decay=0.1)


# ---- dynamic evaluation -------------------------------------------------------------------


def test_dynamic_eval_without_steps_equals_static_evaluation():
    """eta = 0, lambda = 0: nothing moves, so it must be static evaluation at the same B and
    bptt, with every dropout (all non-zero here, weight drop 0.5) off."""
    model, ids = _model(), _stream(97)
    stats = gradient_statistics(model, _stream(300), batch_size=10, bptt=5)
    knobs = {"lr": 0.0, "epsilon": 0.001, "prior_decay": 0.0, "return_token_nll": True}
    for batch_size in (1, 3):
        static = evaluate_perplexity(
            model, ids, batch_size=batch_size, bptt=5, return_token_nll=True
        )
        dynamic = dynamic_evaluate(model, ids, stats, batch_size=batch_size, **knobs)
        assert dynamic.tokens == static.tokens
        assert dynamic.loss == pytest.approx(static.loss, rel=1e-6)
        torch.testing.assert_close(dynamic.token_nll, static.token_nll, equal_nan=True)


@pytest.mark.parametrize(
    "head",
    [
        ["head.name=mos", "head.n_components=3", "head.latent_dropout=0.5"],
        ["head.name=mixtape", "head.gate_dim=4", "head.gate_noise=0.5", "head.gate_dropout=0.5"],
        ["head.name=plif", "head.n_pieces=100", "head.learn_slopes=false"],  # a frozen tensor
    ],
    ids=["mos", "mixtape", "frozen-plif"],
)
def test_dynamic_eval_works_with_every_kind_of_head(head):
    model, ids = _model("model.d_last=12", *head), _stream(41)
    stats = gradient_statistics(model, _stream(200), batch_size=10, bptt=5)
    trainable = {key for key, p in model.named_parameters() if p.requires_grad}
    assert set(stats) == trainable
    static = evaluate_perplexity(model, ids, batch_size=1, bptt=5)
    still = dynamic_evaluate(model, ids, stats, lr=0.0, epsilon=0.001, prior_decay=0.0)
    assert still.loss == pytest.approx(static.loss, rel=1e-6)
    moved = dynamic_evaluate(model, ids, stats, lr=0.01, epsilon=0.001, prior_decay=0.1)
    assert math.isfinite(moved.loss) and moved.loss != static.loss


def _reference_dynamic_eval(model, ids, stats, lr, epsilon, lamb, bptt=5) -> float:
    """Krause et al.'s loop written plainly, B = 1: ``.backward()`` and ``model.parameters()``
    (which yields a tied tensor once), on a copy. Returns the mean NLL."""
    model = copy.deepcopy(model).eval()
    named = dict(model.named_parameters())
    decay = decay_rates(stats, lamb)
    prior = {key: p.detach().clone() for key, p in named.items()}
    column = ids[:, None]  # (N, 1)
    state, total = None, 0.0
    for i in range(0, ids.numel() - 1, bptt):
        length = min(bptt, ids.numel() - 1 - i)
        model.zero_grad()
        nll, state = model.nll(column[i : i + length], column[i + 1 : i + 1 + length], state)
        total += nll.double().sum().item()
        nll.mean().backward()
        state = model.backbone.detach_state(state)
        with torch.no_grad():
            for key, p in named.items():
                step = lamb * decay[key] * (prior[key] - p) - lr * p.grad / (stats[key] + epsilon)
                p += step
    return total / (ids.numel() - 1)


def test_dynamic_eval_matches_a_plain_reference_of_the_update_rule():
    model, ids = _model(), _stream(38)  # 8 segments, the last one of 2 tokens
    stats = gradient_statistics(model, _stream(300), batch_size=10, bptt=5)
    knobs = {"lr": 0.02, "epsilon": 0.001, "prior_decay": 0.3}
    result = dynamic_evaluate(model, ids, stats, **knobs)
    expected = _reference_dynamic_eval(model, ids, stats, 0.02, 0.001, 0.3)
    assert result.loss == pytest.approx(expected, rel=1e-5)
    static = evaluate_perplexity(model, ids, batch_size=1, bptt=5)
    assert abs(result.loss - static.loss) > 1e-3  # the steps did something


def test_dynamic_eval_helps_on_a_repetitive_stream():
    model = _model()
    stream = torch.randint(0, V, (25,)).repeat(12)  # a random phrase, said 12 times
    stats = gradient_statistics(model, _stream(2000), batch_size=10, bptt=5)
    static = evaluate_perplexity(model, stream, batch_size=1, bptt=5)
    dynamic = dynamic_evaluate(model, stream, stats, **{**DYNAMIC_EVAL_DEFAULTS["ptb"], "lr": 0.01})
    assert dynamic.perplexity < 0.95 * static.perplexity


def test_callers_model_is_unchanged_after_dynamic_eval_even_on_error(monkeypatch):
    model = _model()
    model.train()
    before = {key: p.detach().clone() for key, p in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    stats = gradient_statistics(model, _stream(300), batch_size=10, bptt=5)
    dynamic_evaluate(model, _stream(60), stats, lr=0.5, epsilon=0.001, prior_decay=0.1)

    def unchanged() -> bool:
        after = model.state_dict()
        return all(torch.equal(after[key], value) for key, value in before.items())

    assert unchanged() and [m.training for m in model.modules()] == flags
    assert all(p.grad is None for p in model.parameters())
    calls, real_nll = [], model.nll

    def failing_nll(*args):
        calls.append(1)
        if len(calls) == 4:  # after three updates
            raise RuntimeError("interrupted")
        return real_nll(*args)

    monkeypatch.setattr(model, "nll", failing_nll)
    with pytest.raises(RuntimeError, match="interrupted"):
        dynamic_evaluate(model, _stream(60), stats, lr=0.5, epsilon=0.001, prior_decay=0.1)
    assert unchanged() and [m.training for m in model.modules()] == flags


def test_a_diverging_adaptation_stops_naming_the_segment_and_the_unmeasured_statistics():
    """Statistics of 0 (a parameter the statistics' segments never reached) make steps of
    lr * grad / epsilon; an adaptation that reaches a non-finite NLL stops (TrainingError,
    the CLI's exit 1), not a perplexity of nan, and the model is restored."""
    torch.manual_seed(0)
    model = _model()
    before = {key: p.detach().clone() for key, p in model.state_dict().items()}
    stats = gradient_statistics(model, _stream(300), batch_size=10, bptt=5)
    stats = {key: torch.zeros_like(ms) if "decoder" in key or "head" in key else ms
             for key, ms in stats.items()}
    assert unmeasured_statistics(stats)[0] > 0
    with pytest.raises(TrainingError, match=r"^dynamic evaluation diverged: segment \d+ .* "
                       r"elements of the gradient statistics are 0 \(.*--max-stats-batches"):
        dynamic_evaluate(model, _stream(60), stats, lr=1e30, epsilon=1e-30, prior_decay=0.0)
    after = model.state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items())


def test_a_checkpoint_that_scores_non_finite_values_is_named_not_the_learning_rate():
    model = _model()
    stats = gradient_statistics(model, _stream(300), batch_size=10, bptt=5)
    with torch.no_grad():
        next(model.head.parameters()).fill_(float("nan"))
    with pytest.raises(TrainingError, match=r"^dynamic evaluation stopped: the first segment's "
                       r"NLL is not finite before any adaptation"):
        dynamic_evaluate(model, _stream(60), stats, lr=0.01, epsilon=0.001, prior_decay=0.0)


def test_weight_drop_and_every_dropout_are_off_while_adapting(monkeypatch):
    model = _model("model.weight_drop=0.9", "model.dropout_output=0.9")
    model.train()

    def no_mask(self):
        raise AssertionError("a weight-drop mask was drawn")

    monkeypatch.setattr(WeightDrop, "draw_mask", no_mask)
    seen = []
    for module in model.modules():
        if isinstance(module, LockedDropout | WeightDrop) or module is model.backbone:
            module.register_forward_pre_hook(lambda m, _: seen.append(m.training))
    stats = gradient_statistics(model, _stream(100), batch_size=4, bptt=5)
    dynamic_evaluate(model, _stream(30), stats, lr=0.01, epsilon=0.001, prior_decay=0.1)
    assert seen and not any(seen)
    # In the adapting mode two forward passes with gradients on agree exactly.
    tokens = _stream(12).view(6, 2)
    with scoring_mode(model, adapting=True):
        first, _ = model.nll(tokens[:-1], tokens[1:])
        second, _ = model.nll(tokens[:-1], tokens[1:])
        assert first.requires_grad
    assert torch.equal(first, second)


def test_dynamic_eval_rejects_bad_arguments():
    model = _model()
    stats = gradient_statistics(model, _stream(100), batch_size=4, bptt=5)
    ids = _stream(30)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        dynamic_evaluate(model, ids, stats, lr=0.01, epsilon=0.0, prior_decay=0.1)
    with pytest.raises(ValueError, match="lr must be a number >= 0"):
        dynamic_evaluate(model, ids, stats, lr=-1.0, epsilon=0.01, prior_decay=0.1)
    partial = {key: ms for key, ms in stats.items() if key != "head.bias"}
    with pytest.raises(ValueError, match=r"missing \['head.bias'\]"):
        dynamic_evaluate(model, ids, partial, lr=0.01, epsilon=0.01, prior_decay=0.1)
    wrong = {**stats, "head.bias": torch.ones(3)}
    with pytest.raises(ValueError, match="'head.bias' has shape"):
        dynamic_evaluate(model, ids, wrong, lr=0.01, epsilon=0.01, prior_decay=0.1)


def test_defaults_are_the_published_hyperparameters():
    assert DYNAMIC_EVAL_DEFAULTS["ptb"] == {"lr": 0.002, "epsilon": 0.001, "prior_decay": 0.075}
    assert DYNAMIC_EVAL_DEFAULTS["wt2"] == {"lr": 0.002, "epsilon": 0.002, "prior_decay": 0.02}


def test_eval_refuses_a_checkpoint_copied_from_another_run(tiny_run, tmp_path, capsys):
    """Issue: another run's best.pt copied into a run was scored and its record written into
    this run as its own; train --resume already refused it."""
    import shutil

    from highrank.cli import main
    from tests.conftest import train_tiny_run

    ours = shutil.copytree(tiny_run, tmp_path / "ours")
    theirs = train_tiny_run(tmp_path, "theirs", "model.d_hidden=14")
    shutil.copy(theirs / "checkpoints" / "best.pt", ours / "checkpoints" / "best.pt")
    capsys.readouterr()  # the trainings' output
    assert main(["eval", str(ours), "--split", "valid"]) == 2
    err = capsys.readouterr().err
    assert "belongs to another run" in err and len(err.strip().splitlines()) == 1
    assert not list(ours.glob("eval-*.json"))


def test_a_checkpoint_of_another_run_named_by_path_is_refused(tiny_run, tmp_path, capsys):
    """A new user's walk: `eval RUN --which OTHER.pt` (and every analysis) measured another
    run's checkpoint and filed its figures under RUN; the run's own .pt copied out is fine."""
    import shutil

    from highrank.cli import main
    from tests.conftest import train_tiny_run

    ours = shutil.copytree(tiny_run, tmp_path / "ours")
    theirs = train_tiny_run(tmp_path, "theirs")  # the same model, another run
    outside = shutil.copy(theirs / "checkpoints" / "best.pt", tmp_path / "elsewhere.pt")
    capsys.readouterr()
    assert main(["eval", str(ours), "--split", "valid", "--which", str(outside)]) == 2
    err = capsys.readouterr().err
    assert "belongs to another run" in err and len(err.strip().splitlines()) == 1
    assert not list(ours.glob("eval-*.json"))
    own = shutil.copy(ours / "checkpoints" / "best.pt", tmp_path / "own-copy.pt")
    assert main(["eval", str(ours), "--split", "valid", "--which", str(own)]) == 0


def test_a_window_beyond_a_transformers_learned_positions_is_one_line(tmp_path, capsys):
    """Issue: eval / analyze of a Transformer run with --bptt beyond its position table ended
    in a ValueError traceback from the backbone."""
    from highrank.cli import main
    from tests.conftest import write_corpus

    corpus = write_corpus(tmp_path / "corpus")
    sizes = ["--model.d_embed=8", "--model.n_layers=1", "--model.n_heads=2", "--model.d_ff=16",
             "--train.bptt=8", "--model.max_len=8", "--train.batch_size=4",
             "--train.warmup_steps=2"]
    run = tmp_path / "run"
    assert main(["train", "configs/ptb/transformer-softmax.toml", f"--data.dir={corpus}",
                 f"--run.out_dir={run}", *sizes, "--max-steps", "2", "--no-progress"]) == 0
    capsys.readouterr()
    for verb in (["eval", str(run)], ["analyze", "rank", str(run), "--max-contexts", "20"]):
        assert main([*verb, "--which", "last", "--bptt", "50"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and "exceeds this Transformer run's learned position table" in err[0]


def test_max_tokens_n_reads_n_tokens_and_says_how_many_it_scores(tiny_run, tmp_path, capsys):
    """Issue 29: `eval --max-tokens 2000` scored 1,999 tokens without saying why: N tokens
    are read and a column's first has no prediction; the help, the record and the printed
    line say so."""
    import json
    import shutil

    from highrank.cli import main
    from highrank.evaluate.records import describe

    run = shutil.copytree(tiny_run, tmp_path / "run")
    capsys.readouterr()
    assert main(["eval", str(run), "--max-tokens", "40", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "over 39 tokens (of the first 40 read: a column's first has no prediction)" in out
    record = json.loads((run / "eval-test-best-first40.json").read_text())
    assert (record["tokens"], record["tokens_read"], record["max_tokens"]) == (39, 40, 40)
    assert describe(record).endswith("test (39 tokens scored), of the first 40 read")
    assert main(["eval", str(run), "--max-tokens", "40", "--batch-size", "3"]) == 0
    assert "over 36 tokens (of the first 40 read" in capsys.readouterr().out  # (40 // 3 - 1) x 3
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "so N - 1 are scored in one column" in " ".join(capsys.readouterr().out.split())
