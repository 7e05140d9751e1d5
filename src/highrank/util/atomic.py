"""Atomic file writes: the one way highrank replaces a file.

A file is written to a temporary file beside it, ``.<name>.<random>.tmp``, which is flushed and
fsynced, renamed onto the target (``os.replace``), and then the folder is fsynced so that the
rename itself survives a crash. A reader sees the old file or the whole new one, never part
of one; a write that fails removes its temporary file, and one killed outright leaves only a
``.<name>.*.tmp`` that :func:`remove_temporaries` (or a run directory's own clean-up) finds.

The file gets the mode a plain ``open()`` would give it (0o666 less the umask), not
``mkstemp``'s 0o600: caches, vocabularies, records and reports are meant to be read by others.

    write_json(path, payload)              a JSON record (indented; NumPy/torch values as plain
                                           numbers and lists, NaN/inf as null)
    write_text_atomic(path, text)          text (UTF-8)
    write_bytes_atomic(path, data)         bytes
    with atomic_file(path) as handle:      whatever writes to a binary file (np.save, np.savez)
        np.save(handle, array)

Writers with a sequence of their own (a checkpoint that keeps the file it replaces, a matrix
appended block by block) use the same pieces: :func:`temporary_beside`, :func:`sync`,
:func:`fsync_directory`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO


def temporary_beside(path: str | os.PathLike) -> tuple[BinaryIO, Path]:
    """A new temporary file ``.<name>.<random>.tmp`` in ``path``'s folder (created if need
    be), open for binary writing with the mode ``open()`` would give: ``(handle, its path)``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        return os.fdopen(fd, "wb"), Path(name)
    except BaseException:
        os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise


def sync(handle: BinaryIO) -> None:
    """Flush ``handle`` and fsync its file: its bytes are on disk before any rename."""
    handle.flush()
    os.fsync(handle.fileno())


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make the renames in ``directory`` durable; platforms that cannot open a directory (or
    fsync one) just skip it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file handle whose contents replace ``path`` atomically when the block ends
    without an error; on an error ``path`` is untouched and the temporary file is removed."""
    path = Path(path)
    handle, temporary = temporary_beside(path)
    try:
        with handle:
            yield handle
            sync(handle)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Replace ``path`` by ``data`` atomically; returns the path."""
    with atomic_file(path) as handle:
        handle.write(data)
    return Path(path)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Replace ``path`` by ``text`` (UTF-8) atomically; returns the path."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, payload: Any) -> Path:
    """Replace ``path`` by ``payload`` as indented JSON (and a newline), atomically; the folder
    is created if need be. NumPy and torch scalars and arrays become plain numbers and lists,
    non-finite floats ``null`` (the file stays valid JSON), paths and other values JSON cannot
    hold their ``str``. Returns the path: the one JSON writer of the package (run records,
    analysis records, retrofit plans, states' side files)."""
    text = json.dumps(json_ready(payload), indent=2, allow_nan=False, default=str) + "\n"
    return write_text_atomic(path, text)


def json_ready(value: Any) -> Any:
    """A copy of ``value`` that :func:`json.dumps` takes as it is meant: mappings with string
    keys, lists for tuples and arrays (anything with ``tolist``: NumPy, torch), ``None`` for
    NaN and infinities, ``str`` for paths."""
    if isinstance(value, Mapping):
        return {str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    if hasattr(value, "tolist") and not isinstance(value, str):  # NumPy, torch
        return json_ready(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, os.PathLike):
        return str(value)
    return value


def remove_temporaries(path: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that killed writes of ``path`` left beside it
    (``.<name>.*.tmp``); only call it when no other process may be writing ``path``.
    Returns the paths removed."""
    path = Path(path)
    stale = [p for p in path.parent.glob(f".{path.name}.*.tmp") if p.is_file()]
    for temporary in stale:
        temporary.unlink(missing_ok=True)
    return stale


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


__all__ = [
    "atomic_file",
    "fsync_directory",
    "json_ready",
    "remove_temporaries",
    "sync",
    "temporary_beside",
    "write_bytes_atomic",
    "write_json",
    "write_text_atomic",
]
