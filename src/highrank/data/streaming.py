"""Corpora that do not fit in memory: a one-pass vocabulary, memory-mapped token ids, shards.

The streaming counterpart of :func:`highrank.data.load_corpus` (``data.memmap = true``), for
One-Billion-Word-sized corpora (Chelba et al., 2013: 0.8B training words in 100 shards, a
vocabulary cut to the most frequent words, the rest ``<unk>``) as the MoS (Yang et al., 2018,
Table 3) and Mixtape (Yang et al., 2019, Table 4) papers train on:

* **splits**: ``<split>.txt`` or a folder ``<split>/`` of shard files read in sorted name
  order (hidden files skipped), as if concatenated. Tokenisation is :mod:`highrank.data`'s
  (``word`` or ``char`` mode, one ``<eos>`` per line), read in blocks of whole lines, so
  memory holds one block, never a split.
* **vocabulary**, built in one pass over train: each new token gets the next provisional id
  (so provisional ids are in order of first appearance) and the ids are written to disk while
  their counts accumulate (``np.bincount``); memory grows with the vocabulary, not the corpus.
  The final ids sort by count, ties by first appearance, exactly as :meth:`Vocab.from_tokens`
  (tests/data/test_streaming.py checks the two agree), and the ids on disk are remapped in place.
  ``max_vocab`` keeps ``<eos>`` and the ``max_vocab - 2`` most frequent other tokens (ties by
  first appearance) and adds ``<unk>``, which takes the counts of every dropped token (and of
  a literal ``<unk>``) and its place in the frequency order; a corpus with at most
  ``max_vocab`` types is left whole (no ``<unk>`` added).
* **ids**: int32, raw little-endian files in a cache folder keyed like the in-memory cache
  (sha256 of every file's bytes, the mode, ``max_vocab``, :data:`STREAM_VERSION`), written
  into a temporary folder renamed into place, so a reader sees a complete cache or none; read
  back with ``np.memmap``.
* **batches**: :class:`StreamBatches` is :func:`highrank.data.batchify`'s ``(T, B)`` layout as a
  view: ``view[i:i+L]`` reads only those rows (``L * B`` ids) from the map, so
  :func:`highrank.data.get_batch` and the AWD-LSTM / Transformer recipes use it unchanged and
  see the same tensors as from an in-memory corpus. Evaluation, dynamic evaluation and the
  analyses read a run's splits the same way (:func:`split_stream`, :func:`batch_view`): a
  segment at a time from the map, never a whole split in memory.
* **sentence-shuffled batching** (``data.batching = "sentences"``, the 1B-Word recipe's
  reader, e.g. Jozefowicz et al., 2016): before each epoch the training sentences (lines, each
  with its ``<eos>``) are permuted by a generator seeded with ``(train.seed, epoch)`` and
  packed into one stream, laid out as above; the order is a function of seed and epoch, so a
  resumed run reads what an uninterrupted one reads. Memory: about 20 bytes per sentence.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path

import numpy as np
import torch

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

from highrank.data import corpus as in_memory  # load_corpus read per call: tests patch it
from highrank.data.corpus import (
    EOS,
    SPLITS,
    UNK,
    CorpusError,
    Vocab,
    batchify,
    check_directory,
    check_mode,
    check_split_name,
    default_cache_dir,
    empty_split_error,
    tokenize,
)
from highrank.util.atomic import sync

# Bump when the tokenisation, the vocabulary rule or the cache layout changes.
STREAM_VERSION = 2  # 2: meta.json holds each split's ids crc32
BATCHINGS = ("stream", "sentences")  # data.batching
BLOCK_BYTES = 1 << 20  # text read per block, cut at its last newline (its tokens: tens of MiB)
ID_DTYPE = np.dtype("<i4")


# ---- the splits' files --------------------------------------------------------------------


def split_files(directory: Path, split: str) -> list[Path]:
    """The files of ``split``: ``[directory/<split>.txt]`` or the sorted shards of the folder
    ``directory/<split>/``; errors name what is missing, empty or ambiguous."""
    single, folder = directory / f"{split}.txt", directory / split
    if single.is_file() and folder.is_dir():
        raise CorpusError(
            f"{directory} holds both {single.name} and a folder {split}/; expected one of them "
            f"as the {split} split"
        )
    if single.is_file():
        return [single]
    if folder.is_dir():
        entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
        strange = [p for p in entries if not p.is_file()]
        if strange:  # a sub-folder or a broken link would silently lose part of the split
            what = "a folder" if strange[0].is_dir() else "a broken link or not a regular file"
            raise CorpusError(
                f"shard folder {folder} holds {strange[0].name}, {what}; every entry must be a "
                "text file (a shard): move it out, or fix the link"
            )
        shards = entries
        if not shards:
            raise CorpusError(
                f"shard folder {folder} holds no files; expected the {split} split as one or "
                f"more text files (read in sorted name order)"
            )
        return shards
    present = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    raise CorpusError(
        f"missing split {split}: neither {single} nor a shard folder {folder}/ exists; "
        f"{directory} holds: {', '.join(present) if present else 'nothing'}"
    )


def _decode_block(path: Path, data: bytes, first_line: int, offset: int) -> str:
    """UTF-8 text of a block of whole lines starting at byte ``offset`` / line ``first_line``
    of ``path``; a NUL byte or invalid UTF-8 is one error naming the file, offset and line."""
    nul = data.find(b"\0")
    if nul >= 0:
        line = first_line + data.count(b"\n", 0, nul)
        raise CorpusError(
            f"{path} holds a NUL byte at byte offset {offset + nul} (line {line}); a corpus is "
            f"plain text: is this a binary or truncated file?"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + data.count(b"\n", 0, err.start)
        raise CorpusError(
            f"{path} is not valid UTF-8: byte 0x{data[err.start]:02x} at byte offset "
            f"{offset + err.start} (line {line}): {err.reason}; re-encode the file as UTF-8 "
            f"(e.g. iconv -f latin1 -t utf-8)"
        ) from None


def iter_blocks(
    files: list[Path], block_bytes: int | None = None
) -> Iterator[tuple[Path, int, str]]:
    """``(file, number of its first line, text)`` for blocks of whole lines of ``files`` in
    order; each text ends with ``"\\n"`` (a last line without one gets it). Blocks are about
    ``block_bytes`` (default :data:`BLOCK_BYTES`) long, or one line when a line is longer.
    A shard's last line ends with the shard, newline or not."""
    block_bytes = block_bytes or BLOCK_BYTES
    for path in files:
        with open(path, "rb") as handle:
            head = handle.read(3)
            if head == b"\xef\xbb\xbf":
                raise CorpusError(
                    f"{path} starts with a UTF-8 byte-order mark (bytes ef bb bf), which would "
                    f"become part of its first word; remove it "
                    f"(e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' {path})"
                )
            carry, line, offset = head, 1, 0
            while chunk := handle.read(block_bytes):
                data = carry + chunk
                cut = data.rfind(b"\n") + 1  # 0: no newline yet (a very long line)
                if cut:
                    yield path, line, _decode_block(path, data[:cut], line, offset)
                    line += data.count(b"\n", 0, cut)
                    offset += cut
                carry = data[cut:]
            if carry:  # a last line without "\n" (or a file of at most 3 bytes)
                text = carry if carry.endswith(b"\n") else carry + b"\n"
                yield path, line, _decode_block(path, text, line, offset)


def _file_digest(path: Path) -> bytes:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()


def cache_key(files: dict[str, list[Path]], mode: str, max_vocab: int | None) -> str:
    """sha256 over the format version, the settings and every file's name, size and bytes."""
    digest = hashlib.sha256(
        f"highrank-stream v{STREAM_VERSION} mode={mode} max_vocab={max_vocab}".encode()
    )
    for split in SPLITS:
        for path in files[split]:
            digest.update(f"|{split}/{path.name}:{path.stat().st_size}:".encode())
            digest.update(_file_digest(path))
    return digest.hexdigest()


# ---- the one-pass vocabulary --------------------------------------------------------------


class _FirstSeen(dict):
    """token -> provisional id, a new token getting the next id (order of first appearance)."""

    def __missing__(self, token: str) -> int:
        self[token] = len(self)
        return self[token]


def frequency_order(
    words: list[str], counts: np.ndarray, max_vocab: int | None
) -> tuple[Vocab, np.ndarray]:
    """``(vocabulary, remap)``: the tokens ``words`` (in order of first appearance, with
    ``counts``) sorted by count, ties by first appearance; ``remap[provisional id]`` is the
    final id (``<unk>``'s for a dropped token). See the module docstring for ``max_vocab``."""
    order = np.argsort(-counts, kind="stable")  # stable: equal counts keep first appearance
    remap = np.empty(len(words), dtype=ID_DTYPE)
    if max_vocab is None or len(words) <= max_vocab:
        remap[order] = np.arange(len(words), dtype=ID_DTYPE)
        return Vocab(words[p] for p in order), remap
    index = {word: p for p, word in enumerate(words) if word in (EOS, UNK)}
    regular = [int(p) for p in order if words[p] not in index][: max_vocab - 2]
    kept = regular + [index[EOS]]
    dropped = np.ones(len(words), dtype=bool)
    dropped[kept] = False
    first_dropped = int(np.flatnonzero(dropped)[0])
    # (count, first appearance, token, provisional ids) per entry; <unk> stands for the dropped.
    entries = [(int(counts[p]), p, words[p], [p]) for p in kept]
    entries.append((int(counts[dropped].sum()), first_dropped, UNK, np.flatnonzero(dropped)))
    entries.sort(key=lambda entry: (-entry[0], entry[1]))
    for final, (_, _, _, members) in enumerate(entries):
        remap[members] = final
    return Vocab(entry[2] for entry in entries), remap


def _count_and_write(files: list[Path], mode: str, out: Path) -> tuple[list[str], np.ndarray, int]:
    """One pass over the train files: provisional ids to ``out``; ``(tokens in order of first
    appearance, their counts, number of lines)``."""
    seen, counts, lines = _FirstSeen(), np.zeros(0, dtype=np.int64), 0
    with open(out, "wb") as handle:
        for _, _, text in iter_blocks(files):
            tokens, n_lines = tokenize(text, mode)
            ids = np.fromiter(map(seen.__getitem__, tokens), dtype=ID_DTYPE, count=len(tokens))
            block_counts = np.bincount(ids, minlength=len(seen))
            block_counts[: len(counts)] += counts
            counts, lines = block_counts, lines + n_lines
            handle.write(ids.tobytes())
        sync(handle)
    return list(seen), counts, lines


def _remap_in_place(path: Path, remap: np.ndarray, block: int = 1 << 20) -> None:
    """Replace every provisional id in the int32 file ``path`` by ``remap[id]``, ``block`` ids
    at a time (read and written through the file, not a map, so that memory stays one block)."""
    with open(path, "r+b") as handle:
        while (ids := np.fromfile(handle, dtype=ID_DTYPE, count=block)).size:
            handle.seek(-ids.nbytes, os.SEEK_CUR)
            handle.write(remap[ids].tobytes())
        sync(handle)


def _encode_to(files: list[Path], vocab: Vocab, mode: str, out: Path) -> tuple[int, int]:
    """Encode valid/test with the train vocabulary into ``out``: ``(lines, tokens sent to
    <unk>)``; an unknown token without ``<unk>`` names its file and line."""
    stoi, unk, lines, oov = vocab._stoi, vocab.unk_id, 0, 0
    with open(out, "wb") as handle:
        for path, first_line, text in iter_blocks(files):
            tokens, n_lines = tokenize(text, mode)
            if unk is None:
                ids = _encode_strict(tokens, stoi, path, first_line, text, mode, vocab)
            else:
                ids = np.fromiter(map(stoi.get, tokens, repeat(unk)), ID_DTYPE, len(tokens))
                oov += int(np.count_nonzero(ids == unk)) - tokens.count(UNK)
            lines += n_lines
            handle.write(ids.tobytes())
        sync(handle)
    return lines, oov


def _encode_strict(tokens, stoi, path: Path, first_line: int, text: str, mode: str, vocab):
    """Ids of ``tokens`` (a block of ``path`` from line ``first_line``) for a vocabulary without
    ``<unk>``: an unknown token is an error naming the file, line and token."""
    try:
        return np.fromiter(map(stoi.__getitem__, tokens), ID_DTYPE, len(tokens))
    except KeyError as err:
        token = err.args[0]
        kind = "word" if mode == "word" else "character"
        line = next(
            (
                first_line + n
                for n, row in enumerate(text.split("\n"))
                if (token in row.split() if mode == "word" else token in row)
            ),
            "?",
        )
        raise CorpusError(
            f"{path} line {line}: {kind} {token!r} does not occur in the train split, and the "
            f"vocabulary ({len(vocab)} tokens) has no {UNK!r} to map it to; add {UNK!r} to the "
            f"train split or replace the {kind} in {path.name}"
        ) from None


# ---- the cache folder ---------------------------------------------------------------------


def _build(folder: Path, files: dict[str, list[Path]], mode: str, max_vocab: int | None) -> dict:
    """Write ``vocab.json``, ``<split>.ids`` and ``meta.json`` into ``folder``; the meta."""
    words, counts, train_lines = _count_and_write(files["train"], mode, folder / "train.ids")
    _check_not_empty(files, "train", int(counts.sum()), train_lines, mode)
    vocab, remap = frequency_order(words, counts, max_vocab)
    _remap_in_place(folder / "train.ids", remap)
    literal_unk = int(counts[words.index(UNK)]) if UNK in words else 0
    unk = vocab.unk_id
    oov = {"train": 0 if unk is None else int(counts[remap == unk].sum()) - literal_unk}
    lines = {"train": train_lines}
    for split in ("valid", "test"):
        out = folder / f"{split}.ids"
        lines[split], oov[split] = _encode_to(files[split], vocab, mode, out)
        _check_not_empty(files, split, out.stat().st_size // ID_DTYPE.itemsize, lines[split], mode)
    sizes = {s: (folder / f"{s}.ids").stat().st_size // ID_DTYPE.itemsize for s in SPLITS}
    vocab.save(folder / "vocab.json")
    crc = {s: ids_crc32(np.memmap(folder / f"{s}.ids", dtype=ID_DTYPE, mode="r")) for s in SPLITS}
    meta = {"version": STREAM_VERSION, "tokens": sizes, "lines": lines, "oov": oov, "crc32": crc}
    return meta


def _check_not_empty(files, split: str, tokens: int, lines: int, mode: str) -> None:
    """A split of only ``<eos>`` (blank lines, or no bytes) is the in-memory loader's error."""
    if tokens > lines:
        return
    paths = files[split]
    where = paths[0] if paths[0].name == f"{split}.txt" else paths[0].parent
    raise empty_split_error(where, split, sum(p.stat().st_size for p in paths), lines, mode)


def _read_cached(folder: Path, key: str) -> tuple[Vocab, dict] | None:
    """The cached ``(vocabulary, meta)``, or None when absent, stale or incomplete."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if meta["key"] != key or meta["version"] != STREAM_VERSION:
            return None
        for split in SPLITS:
            size = (folder / f"{split}.ids").stat().st_size
            if size != meta["tokens"][split] * ID_DTYPE.itemsize or size == 0:
                return None
            int(meta["crc32"][split], 16)  # a meta without checksums is stale
        return Vocab.load(folder / "vocab.json"), meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(folder: Path, files, mode: str, max_vocab: int | None, key: str) -> None:
    """Build into a temporary sibling folder and rename it to ``folder`` (atomic); a stale or
    incomplete ``folder`` is moved aside and deleted first."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Builds killed outright (SIGKILL, out of memory) leave their temporary folders; under the
    # build lock no other builder of this key is running, so they are removed here.
    for leftover in folder.parent.glob(f".{folder.name}.*"):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        meta = _build(tmp, files, mode, max_vocab) | {"key": key}
        (tmp / "meta.json").write_text(json.dumps(meta))
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a cache is meant to be shared
        if folder.exists():
            aside = Path(f"{tmp}.stale")
            os.rename(folder, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.rename(tmp, folder)
    except OSError as err:
        raise CorpusError(f"cannot write the token-id cache {folder}: {err}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left to remove after the rename


@contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """A blocking ``flock`` on ``<folder>.lock``, so that processes started together (torchrun)
    build a cache once: the others wait, then read it. The kernel releases it if the holder
    dies; the small lock file stays (as :mod:`highrank.runs.locks` explains)."""
    if fcntl is None:  # pragma: no cover - Windows: no lock
        yield
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f"{folder.name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---- the corpus ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StreamCorpus:
    """A corpus whose token ids stay on disk: what :class:`highrank.data.Corpus` offers the
    training and evaluation code (``vocab``, ``lines``, ``oov``, ``path``, ``split``,
    ``batchify``), the streams ``ids[split]`` being read-only int32 memory maps.

    ``batching`` and ``seed`` decide what ``batchify("train", B)`` gives: the stream as it is,
    or (``"sentences"``) its sentences shuffled per epoch (:meth:`StreamBatches.for_epoch`).
    """

    directory: Path
    mode: str
    vocab: Vocab
    ids: dict[str, np.ndarray]
    files: dict[str, list[Path]]
    lines: dict[str, int]
    oov: dict[str, int]
    cache: Path
    batching: str = "stream"
    seed: int = 0
    checksums: dict[str, str] | None = None  # {split: crc32 of its ids}, from meta.json

    def path(self, name: str) -> Path:
        """The file of split ``name``, or its shard folder."""
        check_split_name(name)
        files = self.files[name]
        return files[0] if files[0].name == f"{name}.txt" else files[0].parent

    def split(self, name: str) -> torch.Tensor:
        """Split ``name`` as an in-memory int64 tensor (this reads it whole: fine for
        valid/test; train is meant to be read through :meth:`batchify`)."""
        check_split_name(name)
        return torch.from_numpy(np.asarray(self.ids[name], dtype=np.int64))

    @property
    def train(self) -> torch.Tensor:
        return self.split("train")

    @property
    def valid(self) -> torch.Tensor:
        return self.split("valid")

    @property
    def test(self) -> torch.Tensor:
        return self.split("test")

    def batchify(self, name: str, batch_size: int) -> StreamBatches:
        """The ``(T, B)`` view of split ``name`` (sentence-shuffled for train when
        ``batching == "sentences"``)."""
        check_split_name(name)
        order = None
        if name == "train" and self.batching == "sentences":
            order = SentenceOrder(sentence_ends(self.ids[name], self.vocab.eos_id), self.seed)
        return StreamBatches(self.ids[name], batch_size, name=str(self.path(name)), order=order)


def load_stream_corpus(
    directory: str | os.PathLike,
    *,
    mode: str = "word",
    max_vocab: int | None = None,
    batching: str = "stream",
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
) -> StreamCorpus:
    """Open (building once) the memory-mapped corpus of ``directory`` (see the module
    docstring); ``cache_dir`` defaults to :func:`highrank.data.default_cache_dir`."""
    directory = check_directory(directory)
    check_mode(mode)
    if max_vocab is not None and (isinstance(max_vocab, bool) or max_vocab < 2):
        raise CorpusError(
            f"data.max_vocab = {max_vocab!r}; expected an int >= 2 (<eos> and <unk> at least)"
        )
    if batching not in BATCHINGS:
        raise CorpusError(f"data.batching = {batching!r}; expected one of {', '.join(BATCHINGS)}")
    files = {split: split_files(directory, split) for split in SPLITS}
    key = cache_key(files, mode, max_vocab)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    for place in (root, *root.parents):
        if place.exists() and not place.is_dir():
            raise CorpusError(
                f"the token cache folder {root} cannot be made: {place} is a file (set by "
                "data.cache_dir, $HIGHRANK_CACHE_DIR or $XDG_CACHE_HOME); point it at a folder"
            )
    folder = root / f"{directory.resolve().name}-{mode}-stream-{key[:16]}"
    cached = _read_cached(folder, key)
    if cached is None:
        with _build_lock(folder):
            cached = _read_cached(folder, key)  # another process may have built it meanwhile
            if cached is None:
                _write_cache(folder, files, mode, max_vocab, key)
                cached = _read_cached(folder, key)
        if cached is None:
            raise CorpusError(f"the token-id cache {folder} was written but cannot be read back")
    vocab, meta = cached
    ids = {s: np.memmap(folder / f"{s}.ids", dtype=ID_DTYPE, mode="r") for s in SPLITS}
    for split, split_ids in ids.items():
        _check_ids(folder / f"{split}.ids", split_ids, len(vocab), meta["crc32"][split])
    return StreamCorpus(
        directory, mode, vocab, ids, files, meta["lines"], meta["oov"], folder, batching, seed,
        checksums=dict(meta["crc32"]),
    )  # fmt: skip


def _check_ids(
    path: Path, ids: np.ndarray, vocab_size: int, crc32: str, block: int = 1 << 24
) -> None:
    """Every cached id lies in [0, V) and the ids have the crc32 written with them: a damaged
    cache is one error, not silent wrong training (one pass over the ids, a block at a time:
    about a second per 100M tokens)."""
    crc = 0
    for start in range(0, ids.size, block):
        part = _read_ids(ids, start, block)
        low, high = int(part.min()), int(part.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise CorpusError(
                f"the token-id cache {path} holds the id {bad}, outside the vocabulary of "
                f"{vocab_size}: the cache is damaged; delete {path.parent} to rebuild it"
            )
        crc = zlib.crc32(part.astype("<i4", copy=False).tobytes(), crc)
    if f"{crc:08x}" != crc32:
        raise CorpusError(
            f"the token-id cache {path} does not match the checksum written with it (crc32 "
            f"{crc:08x}, expected {crc32}): the cache is damaged; delete {path.parent} to "
            "rebuild it"
        )


def ids_crc32(ids: np.ndarray | torch.Tensor, block: int = 1 << 24) -> str:
    """crc32 (8 hex digits) of a token-id stream as int32 little-endian bytes: the same for a
    memory-mapped split and the in-memory int64 tensor of the same ids."""
    array = ids.numpy() if isinstance(ids, torch.Tensor) else ids
    crc = 0
    for start in range(0, array.size, block):
        part = _read_ids(array, start, block)
        crc = zlib.crc32(part.astype("<i4", copy=False).tobytes(), crc)
    return f"{crc:08x}"


def corpus_checksums(corpus) -> dict[str, str]:
    """``{split: crc32}`` of a corpus's token ids (memory-mapped: as written with its cache;
    in memory: computed now); a run keeps them to tell a changed corpus on resume."""
    stored = getattr(corpus, "checksums", None)
    if stored:
        return dict(stored)
    return {split: ids_crc32(corpus.split(split)) for split in SPLITS}


# ---- batches ------------------------------------------------------------------------------


def _read_ids(ids: np.ndarray, start: int, count: int) -> np.ndarray:
    """``ids[start : start + count]`` of a whole-file memory map (as :func:`load_stream_corpus`
    opens them) read from its file, so that a scan does not leave the whole file resident in
    this process's mapped memory; a plain array is sliced."""
    filename = getattr(ids, "filename", None)
    whole_file = filename is not None and ids.offset == 0 and ids.base is getattr(ids, "_mmap", 0)
    if not whole_file:  # a plain array, or a slice of a map (numpy keeps its file and offset 0)
        return np.asarray(ids[start : start + count])
    count = min(count, ids.size - start)
    return np.fromfile(
        filename, dtype=ids.dtype, count=count, offset=ids.offset + start * ids.itemsize
    )


def sentence_ends(ids: np.ndarray, eos_id: int | None, block: int = 1 << 22) -> np.ndarray:
    """Exclusive end positions (int64) of the sentences of ``ids``: one past each ``<eos>``,
    found a block at a time; tokens after the last ``<eos>`` end one more sentence."""
    if eos_id is None:
        raise CorpusError("sentence-shuffled batching needs <eos> in the vocabulary; it has none")
    parts = [
        np.flatnonzero(_read_ids(ids, start, block) == eos_id) + (start + 1)
        for start in range(0, ids.size, block)
    ]
    ends = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if ends.size == 0 or ends[-1] != ids.size:
        ends = np.append(ends, ids.size)
    return ends.astype(np.int64, copy=False)


@dataclass(eq=False)
class SentenceOrder:
    """Where each position of an epoch's sentence-shuffled stream reads from.

    Epoch ``e`` packs sentence ``perm[0]``, then ``perm[1]``, ... where ``perm`` is a
    permutation drawn by ``numpy.random.Generator(PCG64([seed, e]))``, so it depends on the seed
    and the epoch only. The last epoch's tables are kept (perm, ends in the shuffled stream).
    """

    ends: np.ndarray  # (S,) int64, exclusive ends of the sentences in the stored stream
    seed: int
    _epoch: int | None = field(default=None, repr=False)
    _tables: tuple[np.ndarray, ...] | None = field(default=None, repr=False)

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's sentence order (indices into the stored sentences)."""
        rng = np.random.Generator(np.random.PCG64([int(self.seed), int(epoch)]))
        return rng.permutation(self.ends.size)

    def _for(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(perm, shuffled_ends)``: the epoch's order and the exclusive end of each of its
        sentences in the shuffled stream, ``(S,)`` each."""
        if self._epoch != epoch:
            perm = self.permutation(epoch)
            if perm.size < 2**31:
                perm = perm.astype(np.int32)  # 4 bytes a sentence instead of 8
            lengths = np.diff(self.ends, prepend=0)
            self._tables = (perm, np.cumsum(lengths[perm]))
            self._epoch = epoch
        return self._tables

    def source_positions(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Positions in the stored stream of ``positions`` of epoch ``epoch``'s stream.

        Shuffled sentence k is stored sentence j = perm[k]; both end with the same token, so
        a position's distance to its sentence's end is the same in both streams."""
        perm, shuffled_ends = self._for(epoch)
        k = np.searchsorted(shuffled_ends, positions, side="right")  # shuffled sentence index
        return positions + (self.ends[perm[k]] - shuffled_ends[k])


class StreamBatches:
    """:func:`highrank.data.batchify`'s ``(T, B)`` layout of a 1-D id stream, as a view.

    Column ``b`` holds stream positions ``b T .. (b + 1) T - 1`` (``T = N // B``); ``view[i:j]``
    reads rows ``i .. j - 1`` of the columns in view, as an int64 tensor ``(j - i, B)`` on the
    view's device, and nothing else is read. It has the few tensor methods the recipes,
    :func:`highrank.data.get_batch` and :func:`highrank.train.distributed.shard_columns` call
    (``dim``, ``size``, ``shape``, ``device``, ``to``, ``narrow`` along the columns,
    ``contiguous``). With a :class:`SentenceOrder` the stream is the epoch's shuffled one:
    :meth:`for_epoch` picks the epoch (see :func:`epoch_view`).
    """

    def __init__(
        self,
        ids: np.ndarray,
        batch_size: int,
        *,
        name: str = "token stream",
        order: SentenceOrder | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise CorpusError(f"batch_size must be a positive int; got {batch_size!r}")
        rows = ids.size // batch_size
        if rows < 2:
            raise CorpusError(
                f"{name} is shorter than one batch: {ids.size} tokens, but batch_size "
                f"{batch_size} needs at least {2 * batch_size} (2 per column: an input and its "
                "target); use a smaller batch size or a longer file"
            )
        self.ids, self.name, self.order, self.rows = ids, name, order, rows
        self.first, self.columns = 0, batch_size  # the columns in view: [first, first + columns)
        self.device = torch.device("cpu")
        self.epoch: int | None = None

    def _copy(self, **changes) -> StreamBatches:
        other = object.__new__(StreamBatches)
        other.__dict__.update(self.__dict__, **changes)
        return other

    # -- the tensor methods used on a batchified split --
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.columns))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 2

    def to(self, device: torch.device | str) -> StreamBatches:
        return self._copy(device=torch.device(device))

    def contiguous(self) -> StreamBatches:
        return self

    def narrow(self, dim: int, start: int, length: int) -> StreamBatches:
        """Columns ``start .. start + length - 1`` (dim 1 only: rows are cut by slicing)."""
        if dim != 1 or not 0 <= start <= start + length <= self.columns:
            raise CorpusError(f"{self.name}: narrow({dim}, {start}, {length}) is out of range")
        return self._copy(first=self.first + start, columns=length)

    def for_epoch(self, epoch: int) -> StreamBatches:
        """This view reading epoch ``epoch``'s sentence order (itself without an order)."""
        return self if self.order is None else self._copy(epoch=int(epoch))

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise CorpusError(f"{self.name}: a stream view is read by row slices; got {rows!r}")
        start, stop, _ = rows.indices(self.rows)
        stop = max(start, stop)
        columns = np.arange(self.first, self.first + self.columns, dtype=np.int64) * self.rows
        positions = np.arange(start, stop, dtype=np.int64)[:, None] + columns[None, :]  # (L, B)
        if self.order is not None:
            if self.epoch is None:
                raise CorpusError(
                    f"{self.name}: a sentence-shuffled stream is read per epoch; call "
                    f"for_epoch(epoch) first"
                )
            positions = self.order.source_positions(self.epoch, positions)
        batch = torch.from_numpy(self.ids[positions].astype(np.int64))
        return batch.to(self.device) if self.device.type != "cpu" else batch


def open_corpus(data, seed: int = 0, *, directory: str | os.PathLike | None = None):
    """The corpus a ``[data]`` config (:class:`highrank.config.DataConfig`) names: memory-mapped
    (:func:`load_stream_corpus`) when ``data.memmap``, else :func:`highrank.data.load_corpus`;
    ``directory`` overrides ``data.dir``; ``seed`` (train.seed) seeds sentence shuffling."""
    directory = directory or data.dir
    if not getattr(data, "memmap", False):
        return in_memory.load_corpus(directory, mode=data.mode, cache_dir=data.cache_dir)
    return load_stream_corpus(
        directory,
        mode=data.mode,
        max_vocab=data.max_vocab,
        batching=data.batching,
        seed=seed,
        cache_dir=data.cache_dir,
    )


def split_stream(corpus, name: str) -> torch.Tensor | np.ndarray:
    """Split ``name`` of ``corpus`` as a 1-D id stream, copying nothing: a :class:`StreamCorpus`'s
    read-only int32 memory map (the ids stay on disk; :func:`batch_view` reads them a segment
    at a time), an in-memory :class:`highrank.data.Corpus`'s int64 tensor. What evaluation and
    the analyses read a run's split through, so a run trained from a memory map is evaluated
    and analysed from it too (:meth:`StreamCorpus.split` would read the split whole)."""
    if isinstance(corpus, StreamCorpus):
        check_split_name(name)
        return corpus.ids[name]
    return corpus.split(name)


def batch_view(ids, batch_size: int, *, name: str = "token stream"):
    """:func:`highrank.data.batchify`'s ``(T, B)`` layout of the 1-D stream ``ids``: a
    :class:`StreamBatches` view of a memory map (a slice of rows reads only those rows; the
    ids are the same), :func:`~highrank.data.batchify`'s tensor of anything else."""
    if isinstance(ids, np.memmap):
        return StreamBatches(ids, batch_size, name=name)
    return batchify(ids, batch_size, name=name)


def streams_equal(a, b, block: int = 1 << 22) -> bool:
    """Whether the 1-D id streams ``a`` and ``b`` (tensors or memory maps, any integer dtype)
    hold the same ids; compared ``block`` ids at a time, so a memory map is never read whole."""
    if len(a) != len(b):
        return False
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)

    def piece(ids, start: int) -> np.ndarray:
        if isinstance(ids, torch.Tensor):
            return ids[start : start + block].cpu().numpy()
        return _read_ids(ids, start, block)

    return all(
        np.array_equal(piece(a, start), piece(b, start)) for start in range(0, len(a), block)
    )


def epoch_view(source, epoch: int):
    """The batch ``source`` reads in epoch ``epoch``: a sentence-shuffled
    :class:`StreamBatches` for that epoch, anything else as it is."""
    return source.for_epoch(epoch) if isinstance(source, StreamBatches) else source


__all__ = [
    "BATCHINGS",
    "STREAM_VERSION",
    "SentenceOrder",
    "StreamBatches",
    "StreamCorpus",
    "batch_view",
    "cache_key",
    "epoch_view",
    "frequency_order",
    "iter_blocks",
    "load_stream_corpus",
    "open_corpus",
    "sentence_ends",
    "split_files",
    "split_stream",
    "streams_equal",
]
