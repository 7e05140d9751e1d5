"""A float32 matrix streamed block by block into a ``.npy`` file, atomically.

The rows arrive in blocks (a log-probability matrix of 245,568 x 33,278 entries is 33 GB: it
never has to fit in memory); they go to a temporary file beside the target (the pieces of
:mod:`highrank.util.atomic`), which is renamed into place only when every announced row has
arrived. A reader therefore finds the whole matrix or none. What the matrix means is its
writer's business (:mod:`highrank.analysis.logprob_matrix`, a retrofit's evaluation).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from highrank.util.atomic import fsync_directory, remove_temporaries, sync, temporary_beside

MATRIX_DTYPE = np.dtype("<f4")


class NpyWriter:
    """Appends float32 row blocks to a ``.npy`` of known shape, atomically renamed on
    :meth:`commit` (nothing appears at ``path`` before); :meth:`abort` removes the temporary."""

    def __init__(self, path: Path, shape: tuple[int, int]) -> None:
        self.path, self.shape, self.rows_written = path, shape, 0
        # A write killed outright (SIGKILL, out of memory) leaves its temporary file: the next
        # write of the same matrix deletes it (and the fixed-name one of older versions), so at
        # most one stays behind. Two processes must never write one matrix at once.
        remove_temporaries(path)
        path.with_name(f".{path.name}.partial").unlink(missing_ok=True)
        self.file: BinaryIO
        self.file, self.temporary = temporary_beside(path)
        header = {"descr": MATRIX_DTYPE.str, "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_2_0(self.file, header)

    def append(self, rows: np.ndarray) -> None:
        if rows.ndim != 2 or rows.shape[1] != self.shape[1]:
            raise ValueError(f"a block of shape {rows.shape} does not fit a {self.shape} matrix")
        if self.rows_written + rows.shape[0] > self.shape[0]:
            raise ValueError(f"more rows than the {self.shape[0]} announced for {self.path}")
        self.file.write(np.ascontiguousarray(rows, dtype=MATRIX_DTYPE).tobytes())
        self.rows_written += rows.shape[0]

    def commit(self) -> None:
        if self.rows_written != self.shape[0]:
            raise ValueError(
                f"{self.path}: {self.rows_written} rows written but {self.shape[0]} announced"
            )
        sync(self.file)
        self.file.close()
        os.replace(self.temporary, self.path)
        fsync_directory(self.path.parent)

    def abort(self) -> None:
        self.file.close()
        Path(self.temporary).unlink(missing_ok=True)


def write_matrix(path: str | os.PathLike, blocks: Iterable, shape: tuple[int, int]) -> Path:
    """Stream row ``blocks`` (NumPy arrays or torch tensors, each ``(n_i, cols)``, summing to
    ``shape[0]`` rows) into the float32 ``.npy`` at ``path``; nothing appears at ``path``
    unless every row arrived."""
    writer = NpyWriter(Path(path), (int(shape[0]), int(shape[1])))
    try:
        for block in blocks:
            if hasattr(block, "detach"):  # a torch tensor (torch is not imported here)
                block = block.detach().float().cpu().numpy()
            writer.append(block)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return Path(path)


__all__ = ["MATRIX_DTYPE", "NpyWriter", "write_matrix"]
