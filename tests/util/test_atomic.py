"""highrank.util.atomic: the one atomic writer (temporary beside, fsync, rename, fsync folder)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from highrank.util.atomic import (
    atomic_file,
    remove_temporaries,
    write_bytes_atomic,
    write_text_atomic,
)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_text_replaces_the_file_with_open_s_mode_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "deep" / "record.json"
    assert write_text_atomic(path, "first\n") == path
    write_text_atomic(path, "ünïcode\n")
    assert path.read_text(encoding="utf-8") == "ünïcode\n"
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]


def test_bytes_and_a_writer_callback(tmp_path):
    write_bytes_atomic(tmp_path / "raw", b"\x00\x01")
    assert (tmp_path / "raw").read_bytes() == b"\x00\x01"
    with atomic_file(tmp_path / "a.npy") as handle:
        np.save(handle, np.arange(3))
    assert np.load(tmp_path / "a.npy").tolist() == [0, 1, 2]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "kept.txt"
    write_text_atomic(path, "old")
    with pytest.raises(RuntimeError), atomic_file(path) as handle:
        handle.write(b"half")
        raise RuntimeError("disk full")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]


def test_remove_temporaries_finds_what_killed_writes_left(tmp_path):
    path = tmp_path / "m.npy"
    stale = [tmp_path / ".m.npy.abc123.tmp", tmp_path / ".m.npy.x.tmp"]
    for p in [*stale, tmp_path / ".other.npy.y.tmp"]:
        p.write_bytes(b"")
    assert sorted(remove_temporaries(path)) == sorted(stale)
    assert [p.name for p in tmp_path.iterdir()] == [".other.npy.y.tmp"]
