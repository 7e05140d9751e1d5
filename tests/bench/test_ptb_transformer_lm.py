"""benchmarks/studies/ptb_transformer_lm.py: a table row gathers a run's records (no training
here)."""

from __future__ import annotations

import json


def test_a_row_holds_the_evaluations_the_rank_and_the_training_time(tmp_path):
    from benchmarks.studies import ptb_transformer_lm

    records = [
        {"kind": "step", "stage": "train", "epoch": 1, "step": 5, "seconds": 1.0},
        {"kind": "eval", "stage": "train", "epoch": 1, "step": 10, "seconds": 20.0},
        {"kind": "epoch", "stage": "train", "epoch": 1, "step": 10, "seconds": 21.5},
        {"kind": "epoch", "stage": "train", "epoch": 2, "step": 20, "seconds": 19.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    evals = {
        split: {"loss": loss, "perplexity": ppl, "bits_per_char": bpc}
        for split, loss, ppl, bpc in (("valid", 1.0, 2.7, 1.44), ("test", 0.9, 2.5, 1.30))
    }
    ranks = {"press_rank": 51, "effective_rank": {"0.001": 7}, "shape": [64, 50]}
    row = ptb_transformer_lm.row("char", "mos", tmp_path, evals, ranks)
    assert row["updates"] == 20 and row["train_seconds"] == 21.5 + 19.0
    assert (row["valid_bpc"], row["test_bpc"], row["test_ppl"]) == (1.44, 1.30, 2.5)
    assert row["press_rank"] == 51 and row["logprob_matrix_shape"] == [64, 50]
    table = ptb_transformer_lm.table_markdown("char", [row])
    assert "| mos | 1.440 | 1.300 | 51 | 20 | 0.7 |" in table


def test_evaluate_writes_the_records_highrank_eval_writes(tmp_path):
    """The study's eval stage calls evaluate_run in process (issue 31 item 3): the records are
    byte for byte those of `highrank eval`, and the command is logged."""
    import argparse

    from benchmarks.studies import ptb_transformer_lm
    from highrank.cli import main
    from highrank.train import TrainOptions, train
    from tests.conftest import tiny_awd_lstm

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split, lines in (("train", 60), ("valid", 12), ("test", 12)):
        text = [" ".join(f"w{(i * 7 + j) % 20}" for j in range(6)) for i in range(lines)]
        (corpus / f"{split}.txt").write_text("\n".join(text) + "\n")
    run = tmp_path / "run"
    train(tiny_awd_lstm(corpus, run), options=TrainOptions(progress=False))
    args = argparse.Namespace(threads=1, out=str(tmp_path / "out"))
    (tmp_path / "out").mkdir()

    records = ptb_transformer_lm.evaluate(args, run)
    for split in ("valid", "test"):
        path = run / f"eval-{split}-best.json"
        ours = path.read_bytes()
        assert records[split] == json.loads(ours)
        path.unlink()
        assert main(["eval", str(run), "--split", split, "--no-progress"]) == 0
        assert path.read_bytes() == ours
    logged = (tmp_path / "out" / "commands.txt").read_text().splitlines()
    assert [line.split("  #")[0] for line in logged] == [
        f"highrank eval {run} --split {split} --no-progress" for split in ("valid", "test")
    ]
