"""Where ``highrank eval`` / ``dynamic-eval`` keep a figure, and what it was computed from.

A record ``RUN_DIR/<kind>-<split>-<which>.json`` (``eval-test-best.json``) holds the figure of
the *full split of the run's own corpus* (its ``data.dir``). A figure of anything else gets its
own name, so it can never replace that one: another data directory adds
``-data<8 hex of the split's sha256>``, ``--max-tokens N`` adds ``-first<N>``
(``eval-test-best-data1a2b3c4d-first2000.json``). Every record names the checkpoint (file and
sha256), the data directory, the split file and its sha256, and whether it is the full split
of the run's corpus (``"default_data"``), which ``highrank report`` and ``compare`` rely on.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from highrank.config import Config, load_config
from highrank.data.streaming import split_files
from highrank.runs.checkpoint import CONFIG_FILE, checkpoint_path


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for piece in iter(lambda: handle.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def split_sha256(path: str | os.PathLike) -> str:
    """:func:`file_sha256` of a split file; of a shard folder (a ``data.memmap`` split), the
    sha256 over each shard's name and sha256 in the order the shards are read."""
    path = Path(path)
    if not path.is_dir():
        return file_sha256(path)
    digest = hashlib.sha256()
    for shard in split_files(path.parent, path.name):
        digest.update(f"{shard.name}\0{file_sha256(shard)}\0".encode())
    return digest.hexdigest()


def data_facts(
    run_dir: str | os.PathLike,
    which: str,
    split: str,
    corpus,
    *,
    max_tokens: int | None = None,
    own_config: Config | None = None,
) -> dict[str, Any]:
    """What a record says about its inputs (see the module docstring): checkpoint ``which`` of
    ``run_dir`` scored on ``split`` of ``corpus`` (its first ``max_tokens`` tokens when given).
    ``own_config``: the run's ``config.toml`` when the caller has read it (read here when
    None), whose ``data.dir`` tells whether ``corpus`` is the run's own."""
    checkpoint = checkpoint_path(run_dir, which)
    if own_config is None:
        own_config = load_config(Path(run_dir) / CONFIG_FILE)
    own_dir = Path(own_config.data.dir).resolve()
    data_dir = Path(corpus.directory).resolve()
    split_file = corpus.path(split)
    return {
        "checkpoint_file": str(checkpoint.resolve()),
        "checkpoint_sha256": file_sha256(checkpoint),
        "data_dir": str(data_dir),
        "split_file": str(split_file.resolve()),
        "data_sha256": split_sha256(split_file),  # a shard folder: over its shards
        "max_tokens": max_tokens,
        "default_data": data_dir == own_dir and max_tokens is None,
        "own_data_dir": data_dir == own_dir,
    }


def record_path(
    run_dir: str | os.PathLike, kind: str, split: str, which: str, facts: dict[str, Any]
) -> Path:
    """``RUN_DIR/<kind>-<split>-<which>[-data<hash>][-first<N>].json``."""
    name = f"{kind}-{split}-{Path(which).stem}"
    if not facts["own_data_dir"]:
        name += f"-data{facts['data_sha256'][:8]}"
    if facts["max_tokens"] is not None:
        name += f"-first{facts['max_tokens']}"
    return Path(run_dir) / f"{name}.json"


def describe(record: dict[str, Any]) -> str:
    """``best.pt on /data/ptb test.txt (82,430 tokens)``: where a figure came from."""
    checkpoint = Path(record.get("checkpoint_file") or record.get("checkpoint", "?")).name
    if not checkpoint.endswith(".pt"):
        checkpoint += ".pt"
    data = record.get("data_dir") or "the run's corpus (not recorded)"
    tokens = record.get("tokens")
    scored = " scored" if record.get("max_tokens") else ""
    count = f" ({tokens:,} tokens{scored})" if isinstance(tokens, int) else ""
    first = f", of the first {record['max_tokens']:,} read" if record.get("max_tokens") else ""
    return f"{checkpoint} on {data} {record.get('split', '?')}{count}{first}"


__all__ = ["data_facts", "describe", "file_sha256", "record_path", "split_sha256"]


def stale_checkpoint(run_dir: str | os.PathLike, record: dict[str, Any]) -> Path | None:
    """The run's checkpoint a record scored (``record["checkpoint"]``: best, last, ...) when
    its bytes have changed since (a resumed training rewrote it), else None."""
    kept, which = record.get("checkpoint_sha256"), record.get("checkpoint")
    if not kept or not isinstance(which, str):
        return None
    current = checkpoint_path(run_dir, which)
    return current if current.is_file() and file_sha256(current) != kept else None
