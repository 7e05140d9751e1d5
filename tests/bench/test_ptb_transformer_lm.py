"""benchmarks/ptb_transformer_lm.py: a table row gathers a run's records (no training here)."""

from __future__ import annotations

import json


def test_a_row_holds_the_evaluations_the_rank_and_the_training_time(tmp_path):
    from benchmarks import ptb_transformer_lm

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
