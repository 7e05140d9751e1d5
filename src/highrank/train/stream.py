"""What the two stream-LM recipes share (AWD-LSTM, :mod:`highrank.train.awd_lstm`, and the
decoder-only Transformer, :mod:`highrank.train.transformer`): the training and validation
batches of a token stream, and the validation loss over it with the state carried.

Here so that the recipes never import each other (tests/test_layering.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from highrank.config import Config
from highrank.data import Corpus, iter_batches
from highrank.models import LanguageModel
from highrank.train.distributed import average, shard_columns
from highrank.train.steps import head_chunk_size


class Splits(NamedTuple):
    train: torch.Tensor  # (T, batch_size)
    valid: torch.Tensor  # (T, eval_batch_size)


def load_splits(config: Config, corpus: Corpus, device: torch.device) -> Splits:
    """The corpus's train / validation batches (train.batch_size, train.eval_batch_size);
    under torchrun this process's share of their columns (:mod:`highrank.train.distributed`:
    the training batch must divide by the number of processes)."""
    train = corpus.batchify("train", config.train.batch_size)
    valid = corpus.batchify("valid", config.train.eval_batch_size)
    train = shard_columns(train, "train.batch_size")
    valid = shard_columns(valid, "train.eval_batch_size", strict=False)
    return Splits(train.to(device), valid.to(device))


def validation_loss(model: LanguageModel, config: Config, valid: torch.Tensor) -> float:
    """:func:`evaluate_loss` of the validation columns ``valid``, averaged over the processes
    under torchrun when each holds a share of them (the same columns everywhere otherwise)."""
    loss = evaluate_loss(model, valid, config.train.bptt, chunk_size=head_chunk_size(config))
    return average(loss) if valid.size(1) != config.train.eval_batch_size else loss


@torch.no_grad()
def evaluate_loss(
    model: LanguageModel,
    source: torch.Tensor,
    bptt: int,
    *,
    chunk_size: int | None | str = "auto",
) -> float:
    """Mean NLL per predicted token of ``source (T, B)`` (from :func:`highrank.data.batchify`),
    read in segments of ``bptt`` with the hidden state carried (AWD-LSTM ``evaluate``).
    Perplexity is ``exp`` of it. Leaves the model in eval mode."""
    model.eval()
    state = model.init_state(source.size(1))
    total, count = 0.0, 0
    for tokens, target in iter_batches(source, bptt):
        loss, state, _ = model(tokens, target, state, chunk_size=chunk_size, reduction="sum")
        total += float(loss)
        count += target.numel()
    return total / count


__all__ = ["Splits", "evaluate_loss", "load_splits", "validation_loss"]
