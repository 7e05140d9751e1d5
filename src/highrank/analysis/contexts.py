"""Contexts of a corpus as a trained model sees them: the head's input for each position.

A *context* is a prefix ``x_1 .. x_t`` of the token stream; the model summarises it in the
hidden state ``g_t`` that its output head turns into ``P(. | x_1 .. x_t)``. Every analysis
that looks at next-token distributions (the log-probability matrix, pairwise KL, top-k) reads
contexts from :func:`iter_contexts`, which runs the backbone exactly as evaluation does
(:func:`highrank.evaluate.evaluate_perplexity`): the stream laid out in ``batch_size`` columns,
segments of ``bptt`` tokens, the hidden state carried, every dropout off.

With ``batch_size=1`` (the papers' test setting, and the default) contexts come in stream
order: context ``i`` ends at token ``i`` and predicts token ``i + 1``, for ``i = 0 .. N - 2``.
With more columns they come segment by segment, column-major within a segment; each block
carries the stream positions so that no analysis has to know the layout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from highrank.config import Config
from highrank.data import Vocab, iter_batches
from highrank.data.streaming import batch_view, split_stream
from highrank.evaluate.perplexity import default_bptt
from highrank.evaluate.run import load_for_eval
from highrank.models import LanguageModel
from highrank.runs.checkpoint import CheckpointError
from highrank.util.progress import progress_bar


@dataclass(frozen=True, eq=False)
class ContextBlock:
    """A block of n contexts.

    Attributes:
        positions: ``(n,)`` int64, the stream position of each context's last token.
        targets: ``(n,)`` int64, the token that followed (``ids[position + 1]``).
        hidden: ``(n, d)`` the head's input for each context.
    """

    positions: torch.Tensor
    targets: torch.Tensor
    hidden: torch.Tensor

    def __len__(self) -> int:
        return self.positions.numel()


@dataclass(frozen=True, eq=False)
class RunSplit:
    """A trained run's model with one split of its corpus, ready to read contexts from."""

    run_dir: Path
    model: LanguageModel
    config: Config
    vocab: Vocab
    # (N,) the split's token ids: an int64 tensor, or for a data.memmap run the read-only
    # int32 memory map of its cache (streaming.split_stream), which stays on disk
    ids: torch.Tensor | np.ndarray
    split: str
    source: str  # the split's file, for messages

    @property
    def bptt(self) -> int:
        """The run's segment length (:func:`highrank.evaluate.default_bptt`: a Transformer's
        training window, 70 for AWD-LSTM)."""
        return default_bptt(self.config)


def load_run_split(
    run_dir: str | os.PathLike,
    split: str = "test",
    *,
    which: str = "best",
    data_dir: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
) -> RunSplit:
    """The model of ``run_dir`` (checkpoint ``which``) and the token ids of ``split``.

    The corpus is the run's ``data.dir`` unless ``data_dir`` names another folder; it must
    give the same vocabulary the run was trained with (a clear error says otherwise). A run
    trained with ``data.memmap`` gets the split as its memory map, which :func:`iter_contexts`
    reads a segment at a time: no split is loaded whole, the train split included. The run
    is read as ``highrank eval`` reads it (:func:`~highrank.evaluate.run.load_for_eval`): an
    unreadable ``config.toml`` is refused by every analysis too.
    """
    loaded = load_for_eval(run_dir, which, data_dir=data_dir, device=device)
    model, config, corpus = loaded.model, loaded.config, loaded.corpus
    if model.head.reads != ("hidden",):
        raise CheckpointError(
            f"{run_dir}: its head {config.head.name!r} reads {', '.join(model.head.reads)}; "
            "the analyses read a head's rows from hidden states alone (`highrank eval` "
            "scores this run)"
        )
    return RunSplit(
        Path(run_dir),
        model,
        config,
        corpus.vocab,
        split_stream(corpus, split),
        split,
        str(corpus.path(split)),
    )


def count_contexts(n_tokens: int, batch_size: int = 1) -> int:
    """How many contexts :func:`iter_contexts` yields for a stream of ``n_tokens``: one per
    row of each column except the last (which has no next token)."""
    rows = n_tokens // batch_size
    return max(rows - 1, 0) * batch_size


@torch.no_grad()
def iter_contexts(
    model: LanguageModel,
    ids: torch.Tensor | np.ndarray,
    *,
    batch_size: int = 1,
    bptt: int = 70,
    max_contexts: int | None = None,
    progress: bool = False,
    name: str = "token stream",
) -> Iterator[ContextBlock]:
    """Blocks of contexts of the stream ``ids`` (a tensor, or a memory map read a segment at a
    time: :func:`highrank.data.streaming.batch_view`), at most ``max_contexts`` in all.

    The model is put in eval mode for the duration (its training flag is restored after);
    ``hidden`` is on the model's device, positions and targets on the CPU.
    """
    if max_contexts is not None and max_contexts < 1:
        raise ValueError(f"max_contexts must be a positive int or None; got {max_contexts!r}")
    device = next(model.parameters()).device
    source = batch_view(ids, batch_size, name=name)  # (T, B)
    rows = source.shape[0]
    total = count_contexts(len(ids), batch_size)
    if max_contexts is not None:
        total = min(total, max_contexts)
    column_start = torch.arange(batch_size) * rows  # stream position of each column's row 0
    was_training = model.training
    model.eval()
    try:
        state = model.init_state(batch_size)
        done = 0
        with progress_bar(total=total, desc="contexts", unit="ctx", disable=not progress) as bar:
            for index, (tokens, target) in enumerate(iter_batches(source, bptt)):
                row = index * bptt  # the segment's first row
                hidden, state, _ = model.backbone(tokens.to(device), state)  # (L, B, d)
                length = tokens.shape[0]
                # (L, B) -> column-major rows so that B = 1 is plain stream order.
                positions = (column_start[None, :] + row + torch.arange(length)[:, None]).t()
                block = ContextBlock(
                    positions.reshape(-1),
                    target.t().reshape(-1),
                    hidden.transpose(0, 1).reshape(length * batch_size, -1),
                )
                take = min(len(block), total - done)
                if take < len(block):
                    block = ContextBlock(
                        block.positions[:take], block.targets[:take], block.hidden[:take]
                    )
                yield block
                done += take
                bar.update(take)
                if done >= total:
                    break
    finally:
        model.train(was_training)
