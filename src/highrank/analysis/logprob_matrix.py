"""The log-probability matrix A of a model on a corpus, streamed to an on-disk ``.npy``.

``A[i, w] = log P(w | context i)``: rows are contexts (see :mod:`highrank.analysis.contexts`),
columns the vocabulary, float32 (Yang et al., 2018, Sec. 2: a softmax head with d-dimensional
contexts gives rank(A) <= d + 1, d + 2 with a decoder bias). For the sigsoftmax family the
matrix of *transformed logits* f(E g + b) can be written instead (``kind="logits"``), the
matrix the rank study of Kanai et al. / Ganea et al. looks at before normalisation.

The matrix is written block by block (PTB test: 82,429 x 10,000 = 3.3 GB; the WikiText-2 test
set: 245,568 x 33,278 = 33 GB), so it never has to fit in memory, to a temporary file that is
renamed into place when complete (:func:`highrank.util.npy.write_matrix`). Next to
``NAME.npy`` go ``NAME.contexts.npz`` (``positions`` and ``targets`` of each row) and
``NAME.json`` (what was written, from what, and how). :func:`iter_row_blocks` reads it back in
blocks with plain file reads, not a memory map, so a reader's resident memory stays at one
block however large the file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from highrank.analysis.contexts import count_contexts, iter_contexts
from highrank.analysis.output import read_json, write_json
from highrank.heads import OutputHead
from highrank.models import LanguageModel
from highrank.util.denormals import flush_denormals
from highrank.util.npy import MATRIX_DTYPE, write_matrix  # noqa: F401  (its old home)

MATRIX_KINDS = ("log_prob", "logits")
_DTYPE = MATRIX_DTYPE
_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


@torch.no_grad()
def head_rows(head: OutputHead, hidden: torch.Tensor, kind: str = "log_prob") -> torch.Tensor:
    """``(n, V)`` float32 rows of the matrix for head inputs ``hidden (n, d)`` (no autograd)."""
    check_kind(head, kind)
    if kind == "logits":
        return head.transformed_logits(hidden).float()
    return head.log_prob(hidden).float()


class MatrixKindError(ValueError):
    """A matrix kind the head cannot give (one line on the command line)."""


def check_kind(head: OutputHead, kind: str) -> None:
    """``kind`` is one of :data:`MATRIX_KINDS` and ``head`` can give it."""
    if kind not in MATRIX_KINDS:
        raise MatrixKindError(f"kind must be one of {', '.join(MATRIX_KINDS)}; got {kind!r}")
    if kind == "logits" and not hasattr(head, "transformed_logits"):
        raise MatrixKindError(
            f"kind='logits' needs a head of the softmax family (softmax, sigsoftmax, gss, "
            f"plif) with transformed_logits(); {type(head).__name__} has none: use "
            "kind='log_prob'"
        )


# ---- writing ------------------------------------------------------------------------------


class DiskSpaceError(ValueError):
    """A matrix would not fit in the free space of the disk it is to be written to."""


def check_disk_space(path: str | os.PathLike, shape: tuple[int, int]) -> int:
    """The bytes of a float32 matrix of ``shape``; :class:`DiskSpaceError` (one line) when
    they exceed the free space where ``path`` is to be written."""
    needed = 4 * int(shape[0]) * int(shape[1])
    folder = Path(path).parent
    while not folder.exists():  # the nearest existing folder is on the same disk
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise DiskSpaceError(
            f"the {shape[0]:,} x {shape[1]:,} float32 matrix needs {needed / 1e9:.2f} GB in "
            f"{Path(path).parent}, which has {free / 1e9:.2f} GB free; use --max-contexts or "
            "another --out"
        )
    return needed


@flush_denormals()
def write_head_matrix(
    path: str | os.PathLike,
    head: OutputHead,
    hidden: torch.Tensor,
    *,
    kind: str = "log_prob",
    block_rows: int = 1024,
) -> Path:
    """The matrix of ``head`` for the head inputs ``hidden (N, d)`` (e.g. the demo's free
    context vectors), computed and written ``block_rows`` contexts at a time."""
    was_training = head.training
    head.eval()
    try:
        with torch.no_grad():
            blocks = (
                head_rows(head, hidden[start : start + block_rows], kind)
                for start in range(0, hidden.shape[0], block_rows)
            )
            return write_matrix(path, blocks, (hidden.shape[0], head.vocab_size))
    finally:
        head.train(was_training)


@flush_denormals()
def write_log_prob_matrix(
    path: str | os.PathLike,
    model: LanguageModel,
    ids: torch.Tensor,
    *,
    kind: str = "log_prob",
    batch_size: int = 1,
    bptt: int = 70,
    max_contexts: int | None = None,
    progress: bool = False,
    source: str = "token stream",
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the matrix of ``model`` on the stream ``ids`` to ``path`` (a ``.npy``), with its
    ``.contexts.npz`` and ``.json`` side files; returns the JSON record.

    ``max_contexts`` keeps the first contexts only (a prefix of the stream when
    ``batch_size`` is 1). ``metadata`` (e.g. the run directory and split) goes into the record.
    """
    check_kind(model.head, kind)
    rows = count_contexts(len(ids), batch_size)  # len: ids may be a memory map
    if max_contexts is not None:
        rows = min(rows, max_contexts)

    def blocks() -> Iterator[ContextRows]:
        for block in iter_contexts(
            model,
            ids,
            batch_size=batch_size,
            bptt=bptt,
            max_contexts=max_contexts,
            progress=progress,
            name=source,
        ):
            yield block.positions, block.targets, head_rows(model.head, block.hidden, kind)

    record = {
        **(metadata or {}),
        "kind": kind,
        "head": type(model.head).__name__,
        "batch_size": batch_size,
        "bptt": bptt,
        "source": source,
    }
    return write_context_matrix(path, blocks(), (rows, model.head.vocab_size), record)


# (positions (b,), targets (b,), rows (b, V)) of b contexts: the stream position of each
# context's last token, the token that followed it, and the matrix rows.
ContextRows = tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]


@flush_denormals()
def write_context_matrix(
    path: str | os.PathLike,
    blocks: Iterable[ContextRows],
    shape: tuple[int, int],
    record: dict[str, Any],
) -> dict[str, Any]:
    """Stream ``blocks`` of context rows into the float32 ``.npy`` at ``path`` (``shape``
    rows in all), then write ``NAME.contexts.npz`` (positions and targets of every row) and
    the ``NAME.json`` record: ``record`` plus the file's name, shape and dtype. Any source
    of contexts (a run's model, a Hugging Face causal LM) writes its matrix through here."""
    path = Path(path)
    if path.suffix != ".npy":
        raise ValueError(f"the matrix is written as .npy; got {path}")
    positions, targets = [], []

    def rows() -> Iterator[np.ndarray | torch.Tensor]:
        for block_positions, block_targets, block_rows in blocks:
            positions.append(np.asarray(block_positions, dtype=np.int64))
            targets.append(np.asarray(block_targets, dtype=np.int64))
            yield block_rows

    write_matrix(path, rows(), shape)
    empty = np.empty(0, dtype=np.int64)
    np.savez(
        contexts_path(path),
        positions=np.concatenate(positions) if positions else empty,
        targets=np.concatenate(targets) if targets else empty,
    )
    record = {
        **record,
        "matrix": path.name,
        "shape": [int(shape[0]), int(shape[1])],
        "dtype": "float32",
    }
    write_json(path.with_suffix(".json"), record)
    return record


def contexts_path(matrix_path: str | os.PathLike) -> Path:
    """``NAME.contexts.npz`` beside ``NAME.npy``: the stream position and target of each row."""
    return Path(matrix_path).with_suffix(".contexts.npz")


def matrix_record(matrix_path: str | os.PathLike) -> dict[str, Any]:
    """The ``NAME.json`` record beside a matrix written by :func:`write_log_prob_matrix`."""
    return read_json(Path(matrix_path).with_suffix(".json"))


# ---- reading ------------------------------------------------------------------------------


def npy_layout(path: str | os.PathLike) -> tuple[tuple[int, ...], np.dtype, int]:
    """``(shape, dtype, data offset)`` of a C-ordered ``.npy`` file, read from its header."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            version = np.lib.format.read_magic(file)
            if version not in _HEADER_READERS:
                raise ValueError(f"unsupported .npy format version {version}")
            shape, fortran_order, dtype = _HEADER_READERS[version](file)
            offset = file.tell()
    except FileNotFoundError:
        raise FileNotFoundError(f"matrix file {path} does not exist") from None
    except ValueError as error:
        raise ValueError(f"{path} is not a .npy file: {error}") from None
    if fortran_order:
        raise ValueError(f"{path} is stored in Fortran order; expected C order (rows contiguous)")
    expected = offset + int(np.prod(shape)) * dtype.itemsize
    if path.stat().st_size != expected:
        raise ValueError(
            f"{path} is truncated or padded: {path.stat().st_size:,} bytes, but its header "
            f"{shape} {dtype} needs {expected:,}"
        )
    return tuple(int(n) for n in shape), dtype, offset


def iter_row_blocks(
    path: str | os.PathLike, block_rows: int, start_row: int = 0
) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, rows (b, cols))`` blocks of a 2-D ``.npy`` from ``start_row`` on, read
    with plain file reads into one reused buffer (copy a block you want to keep)."""
    shape, dtype, offset = npy_layout(path)
    if len(shape) != 2:
        raise ValueError(f"{path} holds a {len(shape)}-D array; expected a 2-D matrix")
    rows, cols = shape
    buffer = np.empty((min(block_rows, max(rows - start_row, 0)), cols), dtype=dtype)
    with open(path, "rb", buffering=0) as file:
        file.seek(offset + start_row * cols * dtype.itemsize)
        for first in range(start_row, rows, block_rows):
            view = buffer[: min(block_rows, rows - first)]
            if file.readinto(memoryview(view).cast("B")) != view.nbytes:
                raise ValueError(f"{path} ended early at row {first}")
            yield first, view
