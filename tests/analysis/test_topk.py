"""Top-k comparison: tokens and probabilities against torch.topk of the head, the three ways
of choosing contexts, the vocabulary check, the text layout, and the CLI."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from highrank.analysis.contexts import load_run_split
from highrank.analysis.output import run_record_path
from highrank.analysis.topk import (
    MARK,
    TopKError,
    check_positions,
    check_same_vocabulary,
    format_record,
    margin_positions,
    random_positions,
    rows_at,
    target_log_probs,
    topk_records,
)
from highrank.cli import main
from highrank.config import load_config
from highrank.data import Vocab
from highrank.models import build_model
from highrank.runs.run_dir import CONFIG_FILE

V = 19
VOCAB = Vocab([f"w{i}" for i in range(V)])
SMALL = ["model.d_embed=8", "model.d_hidden=12", "model.n_layers=2"]


def small_model(head: str = "softmax", seed: int = 0, *extra: str):
    torch.manual_seed(seed)
    return build_model(load_config(None, [*SMALL, f"head.name={head}", *extra]), vocab_size=V)


def stream(n: int = 120) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def full_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """``(N - 1, V)``: head.log_prob of every context, the stream run as one sequence."""
    model.eval()
    hidden, _, _ = model.backbone(ids[:-1, None], model.init_state(1))  # (N - 1, 1, d)
    return model.head.log_prob(hidden[:, 0])


# ---- rows, top tokens and target log-probs -------------------------------------------------------


def test_top_tokens_and_probabilities_equal_torch_topk_of_the_head():
    models, ids = [small_model("softmax"), small_model("mos", 1, "head.n_components=3")], stream()
    positions = [33, 0, 99, 5]  # any order
    records = topk_records(models, ids, VOCAB, positions, names=["a", "b"], k=4, bptt=9)
    for model, column in zip(models, range(2), strict=True):
        values, indices = torch.topk(full_log_probs(model, ids)[positions], 4)
        for record, top_v, top_i in zip(records, values, indices, strict=True):
            entry = record["models"][column]
            assert entry["name"] == "ab"[column]
            assert [t["id"] for t in entry["top"]] == top_i.tolist()
            assert [t["word"] for t in entry["top"]] == [f"w{i}" for i in top_i.tolist()]
            np.testing.assert_allclose([t["log_prob"] for t in entry["top"]], top_v, atol=1e-5)
            np.testing.assert_allclose([t["prob"] for t in entry["top"]], top_v.exp(), atol=1e-6)
    assert [r["position"] for r in records] == positions
    assert [r["target_id"] for r in records] == [int(ids[p + 1]) for p in positions]


def test_the_reference_token_is_rated_and_ranked():
    model, ids = small_model("softmax"), stream()
    matrix = full_log_probs(model, ids)
    (record,) = topk_records([model], ids, VOCAB, [40], k=V, context_words=3)
    entry, target = record["models"][0], int(ids[41])
    assert entry["target_log_prob"] == pytest.approx(float(matrix[40, target]), abs=1e-5)
    expected_rank = int((matrix[40] > matrix[40, target]).sum()) + 1
    assert entry["target_rank"] == expected_rank
    assert entry["target_in_top"]  # k = V: every token is in the top k
    assert record["context"] == [f"w{i}" for i in ids[38:41].tolist()]
    assert record["context_truncated"] and record["target"] == f"w{target}"


def test_rows_at_and_target_log_probs_match_the_whole_matrix():
    model, ids = small_model("mos", 2, "head.n_components=2"), stream()
    matrix = full_log_probs(model, ids)
    torch.testing.assert_close(rows_at(model, ids, [7, 70, 7], bptt=11), matrix[[7, 70, 7]])
    targets = target_log_probs(model, ids, bptt=11)
    expected = matrix.gather(1, ids[1:, None])[:, 0].double().numpy()
    np.testing.assert_allclose(targets, expected, atol=1e-5)
    assert target_log_probs(model, ids, max_contexts=30).shape == (30,)


# ---- choosing contexts -------------------------------------------------------------------------


def test_margin_selection_on_hand_made_vectors():
    a = np.array([0.0, 3.0, 1.0, 5.0, 2.0, 3.0])
    b = np.array([0.0, 0.0, 0.0, 0.0, 5.0, 0.0])
    # differences 0, 3, 1, 5, -3, 3: at least 1 are positions 3 (5), 1 and 5 (3, tie: by
    # position), 2 (1).
    positions, margins = margin_positions(a, b, 1.0, 10)
    assert positions.tolist() == [3, 1, 5, 2] and margins.tolist() == [5.0, 3.0, 3.0, 1.0]
    assert margin_positions(a, b, 1.0, 2)[0].tolist() == [3, 1]
    assert margin_positions(a, b, 6.0, 10)[0].tolist() == []


def test_margin_selection_picks_exactly_the_largest_differences_of_two_models():
    ids = stream(200)
    model_a, model_b = small_model("mos", 3, "head.n_components=2"), small_model("softmax", 4)
    a, b = target_log_probs(model_a, ids), target_log_probs(model_b, ids)
    difference = a - b
    margin = float(np.quantile(difference, 0.7))  # about 60 qualifying contexts
    positions, margins = margin_positions(a, b, margin, 12)
    qualifying = np.flatnonzero(difference >= margin)
    expected = qualifying[np.argsort(-difference[qualifying], kind="stable")][:12]
    assert positions.tolist() == expected.tolist()
    np.testing.assert_array_equal(margins, difference[expected])
    assert np.all(np.diff(margins) <= 0) and margins.min() >= margin
    # Every context left out that qualifies has a difference no larger than the last chosen.
    assert difference[np.setdiff1d(qualifying, positions)].max() <= margins[-1]


def test_random_positions_are_reproducible_distinct_sorted_and_in_range():
    chosen = random_positions(50, 10, seed=3)
    assert chosen == random_positions(50, 10, seed=3) == sorted(set(chosen))
    assert chosen != random_positions(50, 10, seed=4)
    assert 0 <= min(chosen) and max(chosen) < 50 and len(chosen) == 10
    assert random_positions(5, 5, seed=0) == [0, 1, 2, 3, 4]
    with pytest.raises(TopKError, match="--random 6: expected 1 .. 5"):
        random_positions(5, 6, seed=0)


def test_explicit_positions_are_checked_and_deduplicated():
    assert check_positions([4, 1, 4], 10) == [4, 1]
    with pytest.raises(TopKError, match="--positions 10, -1: out of range.*0 .. 9"):
        check_positions([3, 10, -1], 10)


def test_mismatched_vocabularies_name_both_runs():
    other = Vocab(["w1", "w0", *VOCAB.words[2:]])
    check_same_vocabulary(["a", "b"], [VOCAB, Vocab(VOCAB.words)])  # equal: no error
    with pytest.raises(TopKError, match="runs a and c have different vocabularies.*id 0"):
        check_same_vocabulary(["a", "b", "c"], [VOCAB, VOCAB, other])
    with pytest.raises(TopKError, match=f"{V} vs 3 tokens"):
        check_same_vocabulary(["a", "b"], [VOCAB, Vocab(["w0", "w1", "w2"])])


# ---- text --------------------------------------------------------------------------------------


def test_the_text_block_puts_models_side_by_side_and_marks_the_reference():
    models, ids = [small_model("softmax"), small_model("softmax", 5)], stream()
    (record,) = topk_records(models, ids, VOCAB, [20], names=["left", "right"], k=V)
    text = format_record(record, 1)
    lines = text.splitlines()
    assert lines[0].startswith("#1  position 20")
    assert lines[1].endswith(f"[{record['target']}]") and lines[1].strip().startswith("...")
    assert "left" in lines[2] and "right" in lines[2]  # one header line, two columns
    assert len(lines) == 3 + V + 1  # header, context, names, k token lines, reference
    # k = V, so the reference is in both top-k lists: marked once in each column, and
    # nothing else is marked.
    assert text.count(f"{MARK} {record['target']} ") == 2 and text.count(MARK) == 2
    (short,) = topk_records(models, ids, VOCAB, [20], names=["left", "right"], k=1)
    in_top = sum(entry["target_in_top"] for entry in short["models"])
    assert format_record(short).count(MARK) == in_top


# ---- the command line --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tiny_run, tmp_path_factory):
    """Three run directories: a copy of the tiny softmax run, a MoS run on the same corpus,
    and a softmax run on a corpus with other words (another vocabulary)."""
    from highrank.train import TrainOptions, train

    root = tmp_path_factory.mktemp("topk")
    softmax = shutil.copytree(tiny_run, root / "softmax")
    words = "red green blue cyan black white".split()
    other = root / "other-corpus"
    other.mkdir()
    rng = np.random.default_rng(0)
    for split, lines in (("train", 40), ("valid", 6), ("test", 6)):
        text = "\n".join(" ".join(rng.choice(words, 6)) for _ in range(lines))
        (other / f"{split}.txt").write_text(text + "\n")
    variants = {
        "mos": ["head.name=mos", "head.n_components=2"],
        "other": [f"data.dir={other}"],
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, overrides in variants.items():
            config = load_config(tiny_run / CONFIG_FILE, [*overrides, f"run.out_dir={root / name}"])
            train(config, options=TrainOptions(progress=False))
    finally:
        torch.set_num_threads(threads)
    return {"softmax": softmax, "mos": root / "mos", "other": root / "other"}


def test_cli_positions_prints_side_by_side_and_writes_json_and_text(runs, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["analyze", "topk", str(runs["softmax"]), str(runs["mos"]), "--no-progress"]
    assert main([*args, "--positions", "3,12,3", "--k", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "#1  position 3" in printed and "#2  position 12" in printed
    assert "softmax" in printed and "mos" in printed and "p=" in printed
    record = json.loads((out / "topk.json").read_text())
    assert [c["position"] for c in record["contexts"]] == [3, 12]
    assert [r["head"] for r in record["runs"]] == ["softmax", "mos"]
    assert all(len(m["top"]) == 3 for c in record["contexts"] for m in c["models"])
    assert record["selection"] == {"mode": "positions", "positions": [3, 12]}
    assert (out / "topk.txt").read_text() in printed


def test_cli_random_with_one_run_writes_into_its_analysis_folder(runs, tmp_path, capsys):
    run = shutil.copytree(runs["softmax"], tmp_path / "run")
    args = ["analyze", "topk", str(run), "--random", "3", "--seed", "1", "--no-progress"]
    assert main(args) == 0
    record = json.loads(run_record_path(run, "topk", "test-best").read_text())
    assert record["selection"] == {"mode": "random", "count": 3, "seed": 1}
    n_contexts = record["n_contexts"]
    assert [c["position"] for c in record["contexts"]] == random_positions(n_contexts, 3, 1)
    assert "wrote" in capsys.readouterr().out


def test_cli_margin_shows_the_contexts_where_a_beats_b_most(runs, tmp_path):
    out = tmp_path / "out"
    a, b = str(runs["mos"]), str(runs["softmax"])
    args = ["analyze", "topk", a, b, "--margin", "-100", "--count", "4", "--no-progress"]
    assert main([*args, "--out", str(out)]) == 0
    record = json.loads((out / "topk.json").read_text())
    split_a, split_b = load_run_split(a, "test"), load_run_split(b, "test")
    lp_a = target_log_probs(split_a.model, split_a.ids)
    lp_b = target_log_probs(split_b.model, split_b.ids)
    expected, margins = margin_positions(lp_a, lp_b, -100.0, 4)
    assert [c["position"] for c in record["contexts"]] == expected.tolist()
    np.testing.assert_allclose([c["margin"] for c in record["contexts"]], margins)
    assert record["selection"]["qualifying"] == len(lp_a)  # every context beats -100 nats


def test_cli_errors_are_one_line_with_exit_status_2(runs, capsys):
    softmax, other = str(runs["softmax"]), str(runs["other"])
    base = ["analyze", "topk", "--no-progress"]
    assert main([*base, softmax, other, "--positions", "1"]) == 2
    error = capsys.readouterr().err
    assert "different vocabularies" in error and "softmax" in error and "other" in error
    assert main([*base, softmax, "--margin", "1"]) == 2
    assert "compares two runs" in capsys.readouterr().err
    assert main([*base, softmax, "--positions", "100000"]) == 2
    assert "out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: exactly one way of choosing contexts
        main([*base, softmax, "--positions", "1", "--random", "2"])
