"""Where analysis results go and how they look: JSON records and plain-text tables.

Every ``highrank analyze`` verb keeps one JSON record per run in ``RUN_DIR/analysis/``
(:func:`run_record_path`), so ``highrank report`` can assemble them later without recomputing,
and prints a table a person reads. Records are written by the package's one JSON writer,
:func:`highrank.util.atomic.write_json` (atomically: an interrupted analysis never leaves half a
file; NumPy values as plain numbers, non-finite floats as null), importable from here too.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from highrank.util.atomic import write_json  # noqa: F401  (the one JSON writer)

ANALYSIS_DIR = "analysis"


def run_record_path(run_dir: str | os.PathLike, kind: str, tag: str = "") -> Path:
    """``RUN_DIR/analysis/<kind>[-<tag>].json``: where a run's ``kind`` analysis is kept."""
    name = f"{kind}-{tag}" if tag else kind
    return Path(run_dir) / ANALYSIS_DIR / f"{name}.json"


def record_tag(
    split: str,
    which: str,
    *,
    kind: str = "log_prob",
    max_contexts: int | None = None,
    batch_size: int = 1,
    bptt: int | None = None,
) -> str:
    """``test-best``, ``test-best-logits``, ``valid-last-first5000``, ``test-best-b10``, ...:
    the ``<tag>`` of a record computed on ``split`` with checkpoint ``which`` (a ``.pt`` path
    gives its stem), from a non-default matrix ``kind``, on the first ``max_contexts`` contexts
    only, read in ``batch_size`` columns (1: stream order, the default) or segments of a given
    ``bptt``: a reading other than the default never replaces the default record."""
    tag = f"{split}-{Path(which).stem}"
    if kind != "log_prob":
        tag += f"-{kind}"
    if max_contexts is not None:
        tag += f"-first{max_contexts}"
    if batch_size != 1:
        tag += f"-b{batch_size}"
    if bptt is not None:
        tag += f"-bptt{bptt}"
    return tag


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by :func:`write_json`; a clear error names a missing or broken file."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON (line {error.lineno}): {error.msg}") from None


def read_npy(path: str | os.PathLike, mmap_mode: str | None = None) -> np.ndarray:
    """An array saved beside a record (singular values, a log-prob matrix), read without
    pickling; a missing, truncated or pickled file is one RunDirError naming it."""
    from highrank.runs.run_dir import RunDirError  # torch (config -> heads): output is numpy only

    path = Path(path)
    try:
        return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except FileNotFoundError:
        raise RunDirError(f"{path} does not exist; run the analysis again to write it") from None
    except (ValueError, OSError, EOFError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RunDirError(
            f"{path} cannot be read as a plain array ({reason}); delete it and run the "
            "analysis again"
        ) from None


def text_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], *, markdown: bool = False
) -> str:
    """Rows under headers, columns aligned; numbers right-aligned, floats to 4 significant
    digits (ints with thousands separators). ``markdown=True`` gives a Markdown table."""
    cells = [[format_cell(value) for value in row] for row in rows]
    numeric = [
        all(is_number(row[i]) for row in rows) if rows else False for i in range(len(headers))
    ]
    if markdown:
        rule = ["---:" if right else "---" for right in numeric]
        lines = [headers, rule, *cells]
        return "\n".join("| " + " | ".join(line) + " |" for line in lines) + "\n"
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            value.rjust(width) if right else value.ljust(width)
            for value, width, right in zip(values, widths, numeric, strict=True)
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)]) + "\n"


def format_cell(value: Any) -> str:
    """How tables show a value: ``-`` for None, ints with separators, floats to 4 digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | np.integer):
        return f"{int(value):,}"
    if isinstance(value, float | np.floating):
        value = float(value)
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def is_number(value: Any) -> bool:
    """A number or None (a missing number): right-aligned in tables."""
    return value is None or (
        isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    )
