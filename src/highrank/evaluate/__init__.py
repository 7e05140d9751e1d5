"""Scoring a trained model on a token stream: perplexity, dynamic evaluation, their records.

    scoring.py     what both share: EvalResult, columns read in segments with the state
                   carried, eval mode, the float64 tally
    perplexity.py  perplexity (AWD-LSTM's protocol), the per-token NLL export, default_bptt
    dynamic.py     dynamic evaluation (Krause et al. 2017): gradient statistics, the RMS update
    records.py     where ``highrank eval`` / ``dynamic-eval`` keep a figure and what it was
                   computed from
    run.py         evaluate_run(run_dir, split, which, ...) -> the record ``highrank eval``
                   writes: the one library call that evaluates a run
    translation.py a translation run: loading it, translating a split, its BLEU record
                   (evaluate_bleu; imported by its path, so this package loads no mt module)

``from highrank.evaluate import evaluate_perplexity, dynamic_evaluate`` keeps working as it did
when this package was one module.
"""

from highrank.evaluate.dynamic import (
    DYNAMIC_EVAL_DEFAULTS,
    decay_rates,
    dynamic_evaluate,
    gradient_statistics,
    refuse_transformer_dynamic_eval,
)
from highrank.evaluate.perplexity import (
    AWD_LSTM_EVAL_BPTT,
    default_bptt,
    evaluate_perplexity,
    write_token_nll,
)
from highrank.evaluate.run import evaluate_run
from highrank.evaluate.scoring import EvalResult, TokenIds

__all__ = [
    "AWD_LSTM_EVAL_BPTT",
    "DYNAMIC_EVAL_DEFAULTS",
    "EvalResult",
    "TokenIds",
    "decay_rates",
    "default_bptt",
    "dynamic_evaluate",
    "evaluate_perplexity",
    "evaluate_run",
    "gradient_statistics",
    "refuse_transformer_dynamic_eval",
    "write_token_nll",
]
