"""Static evaluation: perplexity with carried state, and the per-token NLL export.

:func:`evaluate_perplexity` follows AWD-LSTM (Merity et al., 2018): the stream is laid out as B
contiguous columns (validation B = 10, test B = 1), read in segments of ``bptt`` (70) with the
hidden state carried across segments, and

    perplexity = exp(total NLL / number of predicted tokens),

the total accumulated in float64. Every dropout, weight drop included, is off (eval mode).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from highrank.config import ConfigError
from highrank.data import Vocab
from highrank.evaluate.scoring import (
    EvalResult,
    NllTally,
    TokenIds,
    batchify_on,
    scoring_mode,
    segments,
)
from highrank.models import LanguageModel
from highrank.util.checks import check_positive_int
from highrank.util.denormals import flush_denormals

# ---- static evaluation --------------------------------------------------------------------


AWD_LSTM_EVAL_BPTT = 70  # AWD-LSTM / MoS evaluation segments (the state is carried across)


def default_bptt(config) -> int:
    """The segment length evaluation and analysis use when none is given.

    A Transformer run (``model.backbone = "transformer"``) carries no state between windows, so
    its own training window ``train.bptt`` is the protocol it was trained for (and its learned
    positions cover no more); an AWD-LSTM run carries its state, and the papers score it in
    segments of 70 whatever it was trained with.
    """
    if config.model.backbone == "transformer":
        return config.train.bptt
    return AWD_LSTM_EVAL_BPTT


def check_segment_length(config, bptt: int) -> int:
    """``bptt``, or a ConfigError when a Transformer run's learned position table is shorter
    (its windows cannot be longer than the positions it learned)."""
    if config is None:  # rows built from a bare model (tests, notebooks): nothing to check
        return bptt
    model = config.model
    if model.backbone == "transformer" and model.positions == "learned" and bptt > model.max_len:
        raise ConfigError(
            f"--bptt {bptt} exceeds this Transformer run's learned position table (model.max_len"
            f" = {model.max_len}): it scores windows of at most {model.max_len} tokens; use "
            f"--bptt {min(model.max_len, config.train.bptt)} (its training window) or less"
        )
    return bptt


@flush_denormals()
def evaluate_perplexity(
    model: LanguageModel,
    ids: TokenIds,
    *,
    batch_size: int,
    bptt: int = 70,
    progress: bool = False,
    return_token_nll: bool = False,
    name: str = "evaluation stream",
) -> EvalResult:
    """Perplexity of the 1-D token stream ``ids`` with the hidden state carried across segments.

    The stream is trimmed to a multiple of ``batch_size`` (B) and laid out as B contiguous
    columns (:func:`highrank.data.batchify`); the papers use B = 10 for validation and B = 1
    for test. Segments of ``bptt`` rows are scored in order, the state of one segment feeding
    the next, in eval mode (no dropout) and without gradients. Each module's training flag is
    restored afterwards. ``name`` (e.g. the split's file) appears in errors, such as a stream
    shorter than two tokens per column.
    """
    check_positive_int("bptt", bptt)
    source = batchify_on(model, ids, batch_size, name)  # (T, B)
    tally = NllTally(source, ids, keep_tokens=return_token_nll)
    with scoring_mode(model, adapting=False):
        state = model.init_state(batch_size)
        for tokens, target in segments(source, bptt, progress, "eval"):
            nll, state = model.nll(tokens, target, state)  # (L, B)
            tally.add(nll)
    return tally.result()


# ---- per-token export ---------------------------------------------------------------------


def write_token_nll(
    path: str | os.PathLike, result: EvalResult, vocab: Vocab | None = None
) -> Path:
    """Write ``result``'s per-token NLL (from ``return_token_nll=True``) to ``path``.

    * ``.tsv``: a header ``position<TAB>target<TAB>nll``, then one row per scored prediction in
      stream order: the 0-based position of the target token in the stream (``i + 1`` for
      ``token_nll[i]``), the target word (its id when ``vocab`` is None) and the NLL in nats.
    * ``.npy``: the float array ``token_nll`` of length N - 1, NaN where not scored.

    Returns the path written.
    """
    path = Path(path)
    if result.token_nll is None or result.target_ids is None:
        raise ValueError(
            "the EvalResult holds no per-token NLL; evaluate with return_token_nll=True"
        )
    suffix = path.suffix.lower()
    if suffix == ".npy":
        np.save(path, result.token_nll.numpy())
    elif suffix == ".tsv":
        path.write_text(_token_nll_tsv(result, vocab), encoding="utf-8")
    else:
        raise ValueError(f"cannot write token NLL to {path}: expected a .tsv or .npy file name")
    return path


def _token_nll_tsv(result: EvalResult, vocab: Vocab | None) -> str:
    """TSV text of the scored predictions (tokens never hold tabs or newlines)."""
    nll, targets = result.token_nll, result.target_ids
    scored = torch.nonzero(~torch.isnan(nll)).flatten().tolist()
    target_ids = targets[scored].tolist()
    words = vocab.decode(target_ids) if vocab is not None else [str(t) for t in target_ids]
    values = nll[scored].tolist()
    rows = (f"{i + 1}\t{w}\t{v:.6f}" for i, w, v in zip(scored, words, values, strict=True))
    return "\n".join(["position\ttarget\tnll", *rows]) + "\n"
