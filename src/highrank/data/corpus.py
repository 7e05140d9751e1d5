"""Language-modelling corpora: reading, a frequency-ordered vocabulary, an on-disk cache, batching.

A corpus is a directory with ``train.txt``, ``valid.txt`` and ``test.txt`` (the Penn Treebank /
WikiText-2 layout). Two tokenisations, both with one ``<eos>`` per line, so a blank line is a
lone ``<eos>``:

* ``mode="word"``: the whitespace-split words of each line (as pytorch/examples
  ``word_language_model`` and AWD-LSTM count them).
* ``mode="char"``: every character is a token. Each line's whitespace is normalised first:
  runs of whitespace become one literal space token ``" "`` and leading/trailing whitespace is
  dropped (Mikolov's character-level PTB does the same, writing the space as ``_``). The
  literal space was chosen over ``_`` because after normalisation it can only mean "word
  boundary", while ``_`` may occur in the text itself. On PTB this is Mikolov's ptb.char
  symbol for symbol, ``<unk>`` spelled as its five characters as there (``highrank.data.chars``
  writes the files; tests/data/test_chars.py checks both): 5,017,482 / 393,042 / 442,423 tokens
  with ``<eos>``, 50 types; :func:`highrank.data.chars.bits_per_char` converts its losses to BPC.

The vocabulary is built from the training split only and ordered by training frequency, most
frequent first, ties broken by first appearance, so "the S most frequent tokens" are ids < S.
Words of valid/test missing from it map to ``<unk>`` when the vocabulary has one; otherwise they
are an error naming the file, line and word.

Token ids are cached as ``.npz`` keyed by the sha256 of the three files' bytes, the mode and
:data:`CACHE_VERSION`, so a second load skips tokenisation. A corrupted or stale cache file is
ignored and rebuilt.

Batching follows AWD-LSTM: :func:`batchify` trims a stream to a multiple of B and lays it out as B
contiguous columns, time-major ``(T, B)``; :func:`get_batch` cuts ``(seq_len, B)`` inputs and the
targets one step ahead.

Corpora that do not fit in memory (shard folders, ``data.max_vocab``, sentence-shuffled
batching): :mod:`highrank.data.streaming`, the same tokenisation, vocabulary order and batches with
the ids memory-mapped (``data.memmap = true``).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path

import numpy as np
import torch

from highrank.util.atomic import atomic_file, write_text_atomic
from highrank.util.paths import corpus_dir_problem

EOS = "<eos>"
UNK = "<unk>"
SPLITS = ("train", "valid", "test")
MODES = ("word", "char")
# Bump when the tokenisation or the cache layout changes: old cache files then miss and rebuild.
CACHE_VERSION = 1
VOCAB_FORMAT = "highrank-vocab"


class CorpusError(ValueError):
    """Bad corpus input: the message names the file (and line, word) and what was expected."""


# ---- vocabulary ---------------------------------------------------------------------------


class Vocab:
    """A bijection between tokens and ids ``0 .. len-1``.

    Built by :meth:`from_tokens` the ids follow training frequency (most frequent first, ties
    by first appearance). ``<eos>`` is an ordinary token; ``<unk>``, when present, is where
    :meth:`encode` sends unknown tokens.
    """

    def __init__(self, words: Iterable[str]) -> None:
        self._itos: list[str] = list(words)
        self._stoi: dict[str, int] = {}
        for i, word in enumerate(self._itos):
            if not isinstance(word, str) or not word:
                raise CorpusError(f"vocabulary entry {i} is {word!r}; expected a non-empty str")
            if word in self._stoi:
                raise CorpusError(
                    f"vocabulary lists {word!r} twice (ids {self._stoi[word]} and {i}); "
                    "expected each token once"
                )
            self._stoi[word] = i

    @classmethod
    def from_tokens(cls, tokens: Iterable[str]) -> Vocab:
        """Vocabulary of ``tokens`` ordered by count, most frequent first, ties by first sight."""
        counts = Counter(tokens)  # a dict: keeps first-appearance order
        # sorted() is stable, so equal counts keep their first-appearance order.
        return cls(sorted(counts, key=lambda word: -counts[word]))

    def __len__(self) -> int:
        return len(self._itos)

    def __contains__(self, word: object) -> bool:
        return word in self._stoi

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocab) and self._itos == other._itos

    def __repr__(self) -> str:
        head = ", ".join(repr(w) for w in self._itos[:5])
        return f"Vocab(size={len(self)}, first=[{head}{', ...' if len(self) > 5 else ''}])"

    @property
    def words(self) -> tuple[str, ...]:
        """All tokens in id order."""
        return tuple(self._itos)

    @property
    def eos_id(self) -> int | None:
        """Id of ``<eos>``, or None when the vocabulary has none."""
        return self._stoi.get(EOS)

    @property
    def unk_id(self) -> int | None:
        """Id of ``<unk>``, or None when the vocabulary has none (unknown tokens are errors)."""
        return self._stoi.get(UNK)

    def id(self, word: str) -> int:
        """Id of ``word``; ``<unk>``'s id for an unknown word when the vocabulary has ``<unk>``."""
        found = self._stoi.get(word, self.unk_id)
        if found is None:
            raise CorpusError(
                f"token {word!r} is not in the vocabulary ({len(self)} tokens) and the "
                f"vocabulary has no {UNK!r} to map it to"
            )
        return found

    def word(self, index: int) -> str:
        """Token with id ``index``."""
        if not 0 <= int(index) < len(self):
            raise CorpusError(f"token id {index} is out of range; expected 0 <= id < {len(self)}")
        return self._itos[int(index)]

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Ids of ``tokens`` (wrap in ``torch.tensor`` for a model)."""
        return [self.id(word) for word in tokens]

    def decode(self, ids: Iterable[int] | torch.Tensor | np.ndarray) -> list[str]:
        """Tokens of ``ids`` (a list, 1-D tensor or array); join them yourself for text."""
        if isinstance(ids, torch.Tensor | np.ndarray):
            ids = ids.reshape(-1).tolist()
        return [self.word(i) for i in ids]

    def to_json(self) -> str:
        """JSON text ``{"format": ..., "version": 1, "words": [...]}`` in id order."""
        return json.dumps({"format": VOCAB_FORMAT, "version": 1, "words": self._itos})

    @classmethod
    def from_json(cls, text: str, *, source: str = "vocabulary JSON") -> Vocab:
        """Inverse of :meth:`to_json`; ``source`` names the origin in error messages."""
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as err:
            raise CorpusError(f"{source}: not valid JSON ({err})") from None
        if not isinstance(payload, dict) or payload.get("format") != VOCAB_FORMAT:
            raise CorpusError(f"{source}: expected a JSON object with format {VOCAB_FORMAT!r}")
        if not isinstance(payload.get("words"), list):
            raise CorpusError(f"{source}: expected key 'words' holding a list of tokens")
        return cls(payload["words"])

    def save(self, path: str | os.PathLike) -> None:
        """Write the vocabulary as JSON (UTF-8) to ``path``, atomically."""
        write_text_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocab:
        """Read a vocabulary written by :meth:`save`."""
        path = Path(path)
        if not path.is_file():
            raise CorpusError(f"vocabulary file {path} does not exist")
        return cls.from_json(decode_utf8(path, path.read_bytes()), source=str(path))


# ---- the corpus ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors field-wise is ambiguous
class Corpus:
    """Three token-id streams (1-D int64 tensors) sharing one vocabulary built from train.

    ``lines[split]`` is the number of lines of each file (= its number of ``<eos>``);
    ``oov[split]`` counts valid/test tokens absent from train that were mapped to ``<unk>``.
    """

    directory: Path
    mode: str
    vocab: Vocab
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    lines: dict[str, int]
    oov: dict[str, int]

    def split(self, name: str) -> torch.Tensor:
        """The id stream of split ``name`` (one of :data:`SPLITS`)."""
        check_split_name(name)
        return getattr(self, name)

    def path(self, name: str) -> Path:
        """The file split ``name`` was read from."""
        check_split_name(name)
        return self.directory / f"{name}.txt"

    def batchify(self, name: str, batch_size: int) -> torch.Tensor:
        """:func:`batchify` of split ``name``; errors name its file."""
        return batchify(self.split(name), batch_size, name=str(self.path(name)))


def load_corpus(
    directory: str | os.PathLike,
    *,
    mode: str = "word",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> Corpus:
    """Read ``directory/{train,valid,test}.txt`` into a :class:`Corpus`.

    Args:
        directory: the corpus folder.
        mode: ``"word"`` or ``"char"`` (see the module docstring).
        cache_dir: where token ids are cached; default :func:`default_cache_dir`.
        use_cache: False reads and tokenises afresh and writes no cache.
    """
    directory = check_directory(directory)
    check_mode(mode)
    raw = {split: _read_split_bytes(directory, split) for split in SPLITS}
    key = _cache_key(raw, mode)
    cache_file = _cache_file(directory, mode, key, cache_dir)
    if use_cache:
        cached = _read_cache(cache_file, key)
        if cached is not None:
            return _corpus_from_arrays(directory, mode, *cached)
    vocab, ids, lines, oov = _build(directory, raw, mode)
    if use_cache:
        _write_cache(cache_file, key, vocab, ids, lines, oov)
    return _corpus_from_arrays(directory, mode, vocab, ids, lines, oov)


def _build(
    directory: Path, raw: dict[str, bytes], mode: str
) -> tuple[Vocab, dict[str, np.ndarray], dict[str, int], dict[str, int]]:
    """Decode, tokenise and encode the three splits; the vocabulary comes from train."""
    vocab, ids, lines, oov = None, {}, {}, {}
    for split in SPLITS:
        path = directory / f"{split}.txt"
        text = decode_utf8(path, raw[split])
        tokens, lines[split] = tokenize(text, mode)
        if len(tokens) == lines[split]:  # only <eos>: no words (characters) at all
            raise empty_split_error(path, split, len(raw[split]), lines[split], mode)
        if vocab is None:
            vocab = Vocab.from_tokens(tokens)
        ids[split], oov[split] = _encode_stream(tokens, vocab, path, text, mode)
    return vocab, ids, lines, oov


def empty_split_error(
    path: Path, split: str, n_bytes: int, n_lines: int, mode: str
) -> CorpusError:
    """The error for a split file without a single word (character)."""
    what = "0 bytes" if n_bytes == 0 else f"{n_lines} line(s), all blank"
    unit = "word" if mode == "word" else "character"
    return CorpusError(
        f"{path} is empty ({what}); expected the {split} split as text with at least one "
        f"{unit}, one sentence or paragraph per line"
    )


def _corpus_from_arrays(
    directory: Path,
    mode: str,
    vocab: Vocab,
    ids: dict[str, np.ndarray],
    lines: dict[str, int],
    oov: dict[str, int],
) -> Corpus:
    """Wrap int32 id arrays as int64 tensors (what embeddings and NLL losses index with)."""
    streams = {split: torch.from_numpy(ids[split].astype(np.int64)) for split in SPLITS}
    return Corpus(directory, mode, vocab, **streams, lines=dict(lines), oov=dict(oov))


# ---- reading and tokenising ---------------------------------------------------------------


def check_directory(directory: str | os.PathLike) -> Path:
    problem = corpus_dir_problem(directory)  # missing, or a file: each says which
    if problem:
        raise CorpusError(problem)
    return Path(directory).expanduser()


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise CorpusError(f"mode {mode!r} is not known; expected one of {', '.join(MODES)}")


def check_split_name(name: str) -> None:
    if name not in SPLITS:
        raise CorpusError(f"split {name!r} is not known; expected one of {', '.join(SPLITS)}")


def _read_split_bytes(directory: Path, split: str) -> bytes:
    """The raw bytes of ``directory/<split>.txt``; a missing file lists what the folder holds."""
    path = directory / f"{split}.txt"
    if not path.is_file():
        present = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
        shards = (directory / split).is_dir()  # the 1B-Word layout: data.streaming reads it
        raise CorpusError(
            f"missing split file {path}; a corpus directory needs train.txt, valid.txt and "
            f"test.txt (PTB / WikiText-2 layout); {directory} holds: "
            f"{', '.join(present) if present else 'nothing'}"
            + (f" (a shard folder {split}/ is read with data.memmap = true)" if shards else "")
        )
    try:
        return path.read_bytes()
    except OSError as error:  # permissions, an I/O error of the disk
        raise CorpusError(
            f"cannot read split file {path}: {error.strerror or error}; expected a readable "
            "text file (check its permissions)"
        ) from None


def decode_utf8(path: Path, data: bytes) -> str:
    """UTF-8 text of ``data``; an invalid byte, a byte-order mark or a NUL byte is reported
    with its offset and line (each would otherwise be swallowed into a word)."""
    if data.startswith(codecs.BOM_UTF8):
        raise CorpusError(
            f"{path} starts with a UTF-8 byte-order mark (bytes ef bb bf), which would become "
            f"part of its first word; remove it (e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' {path})"
        )
    nul = data.find(b"\0")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        raise CorpusError(
            f"{path} holds a NUL byte at byte offset {nul} (line {line}); a corpus is plain "
            f"text: is this a binary or truncated file?"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        offset = err.start
        line = data.count(b"\n", 0, offset) + 1
        raise CorpusError(
            f"{path} is not valid UTF-8: byte 0x{data[offset]:02x} at byte offset {offset} "
            f"(line {line}): {err.reason}; re-encode the file as UTF-8 "
            f"(e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _split_lines(text: str) -> list[str]:
    """Lines split on ``\\n`` only; a final line without ``\\n`` still counts."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # text ended with "\n" (or was empty): no line after it
    return lines


def tokenize(text: str, mode: str) -> tuple[list[str], int]:
    """``(tokens, number of lines)`` of ``text``: the line's tokens then ``<eos>``, per line."""
    lines = _split_lines(text)
    if mode == "word":
        # One C-level split instead of a Python loop per line: "\n" becomes a separate <eos>.
        return "\n".join(lines + [""]).replace("\n", f" {EOS} ").split(), len(lines)
    # char: normalise whitespace; "\n" stands for <eos> and cannot occur inside a line.
    chars = list("".join(" ".join(line.split()) + "\n" for line in lines))
    return [EOS if c == "\n" else c for c in chars], len(lines)


def _encode_stream(
    tokens: list[str], vocab: Vocab, path: Path, text: str, mode: str
) -> tuple[np.ndarray, int]:
    """``(int32 ids, number of tokens sent to <unk>)``; an unknown token without ``<unk>``
    is an error naming the file, line and token."""
    stoi, unk = vocab._stoi, vocab.unk_id
    if unk is None:
        try:
            ids = np.fromiter(map(stoi.__getitem__, tokens), dtype=np.int32, count=len(tokens))
        except KeyError as err:
            raise _unknown_token_error(path, text, err.args[0], mode, vocab) from None
        return ids, 0
    ids = np.fromiter(map(stoi.get, tokens, repeat(unk)), dtype=np.int32, count=len(tokens))
    # Tokens that became <unk> minus those that were literally <unk> in the file.
    return ids, int(np.count_nonzero(ids == unk)) - tokens.count(UNK)


def _unknown_token_error(path: Path, text: str, token: str, mode: str, vocab: Vocab) -> CorpusError:
    """The error for ``token`` missing from a vocabulary without ``<unk>``, with its line."""
    kind = "word" if mode == "word" else "character"
    return CorpusError(
        f"{path} line {_first_line_with(text, token, mode)}: {kind} {token!r} does not occur in "
        f"train.txt, and the vocabulary ({len(vocab)} tokens) has no {UNK!r} to map it to; "
        f"add {UNK!r} to train.txt or replace the {kind} in {path.name}"
    )


def _first_line_with(text: str, token: str, mode: str) -> int | str:
    """1-based number of the first line of ``text`` holding ``token`` ("?" if none does)."""
    for number, line in enumerate(_split_lines(text), start=1):
        if (token in line.split()) if mode == "word" else (token in line):
            return number
    return "?"  # unreachable for a token taken from text; keeps the message sane regardless


# ---- the on-disk cache --------------------------------------------------------------------


def default_cache_dir(directory: str | os.PathLike | None = None) -> Path:
    """The user's cache: ``$HIGHRANK_CACHE_DIR``, else ``$XDG_CACHE_HOME/highrank``, else
    ``~/.cache/highrank``. Never the corpus folder itself: corpora are often shared, read-only
    data (``directory`` is accepted for backwards compatibility and ignored)."""
    if os.environ.get("HIGHRANK_CACHE_DIR"):
        return Path(os.environ["HIGHRANK_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "highrank"
    return Path.home() / ".cache" / "highrank"


def _cache_key(raw: dict[str, bytes], mode: str) -> str:
    """sha256 over the format version, the mode and each split's name and content hash."""
    digest = hashlib.sha256(f"highrank-corpus v{CACHE_VERSION} mode={mode}".encode())
    for split in SPLITS:
        digest.update(f"|{split}:{len(raw[split])}:".encode())
        digest.update(hashlib.sha256(raw[split]).digest())
    return digest.hexdigest()


def _cache_file(directory: Path, mode: str, key: str, cache_dir: str | os.PathLike | None) -> Path:
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir(directory)
    # The folder name keeps files readable in the shared ~/.cache; the full key is stored inside.
    return folder / f"{directory.resolve().name}-{mode}-{key[:16]}.npz"


def _text_array(text: str) -> np.ndarray:
    """A str as a uint8 array, so the cache needs no pickling (np.load allow_pickle=False)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def _write_cache(
    path: Path,
    key: str,
    vocab: Vocab,
    ids: dict[str, np.ndarray],
    lines: dict[str, int],
    oov: dict[str, int],
) -> None:
    """Store ids, vocabulary and counts atomically; failure to write only warns."""
    meta = json.dumps({"version": CACHE_VERSION, "lines": lines, "oov": oov})
    arrays = {"key": _text_array(key), "vocab": _text_array(vocab.to_json())}
    arrays |= {"meta": _text_array(meta), **ids}
    try:
        with atomic_file(path) as handle:
            np.savez(handle, **arrays)
    except OSError as err:
        warnings.warn(
            f"could not write the token cache {path} ({err}); continuing without", stacklevel=3
        )


def _read_cache(
    path: Path, key: str
) -> tuple[Vocab, dict[str, np.ndarray], dict[str, int], dict[str, int]] | None:
    """The cached ``(vocab, ids, lines, oov)``, or None when absent, stale or corrupted."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as archive:
            if bytes(archive["key"]).decode() != key:
                return None
            vocab = Vocab.from_json(bytes(archive["vocab"]).decode("utf-8"))
            meta = json.loads(bytes(archive["meta"]).decode("utf-8"))
            ids = {split: archive[split] for split in SPLITS}
        _check_cached(vocab, ids, meta)
    except Exception:  # any failure (truncated zip, bad CRC, bad JSON, ...) means: rebuild
        return None
    return vocab, ids, meta["lines"], meta["oov"]


def _check_cached(vocab: Vocab, ids: dict[str, np.ndarray], meta: dict) -> None:
    """Raise if the cached arrays cannot be what :func:`_build` wrote."""
    if meta["version"] != CACHE_VERSION:
        raise ValueError("cache format version differs")
    for split in SPLITS:
        stream = ids[split]
        if stream.ndim != 1 or stream.dtype != np.int32 or stream.size == 0:
            raise ValueError(f"cached {split} is not a non-empty 1-D int32 array")
        if stream.min() < 0 or stream.max() >= len(vocab):
            raise ValueError(f"cached {split} holds ids outside the vocabulary")
        if not isinstance(meta["lines"][split], int) or not isinstance(meta["oov"][split], int):
            raise ValueError("cached counts are not integers")


# ---- batching -----------------------------------------------------------------------------


def batchify(
    ids: torch.Tensor | np.ndarray | Sequence[int], batch_size: int, *, name: str = "token stream"
) -> torch.Tensor:
    """Lay a 1-D id stream out as ``batch_size`` contiguous columns, time-major ``(T, B)``.

    The stream is trimmed to a multiple of B; column b holds tokens ``b*T .. (b+1)*T - 1``, so
    reading down a column reads the text in order. Each column needs at least 2 tokens (an input
    and its target), so a stream shorter than ``2 * batch_size`` is an error naming ``name``.
    """
    stream = torch.as_tensor(ids)
    if stream.dim() != 1 or stream.dtype.is_floating_point or stream.dtype == torch.bool:
        raise CorpusError(
            f"{name}: expected a 1-D integer stream of token ids; got "
            f"shape {tuple(stream.shape)}, dtype {stream.dtype}"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise CorpusError(f"batch_size must be a positive int; got {batch_size!r}")
    rows = stream.numel() // batch_size
    if rows < 2:
        raise CorpusError(
            f"{name} is shorter than one batch: {stream.numel()} tokens, but batch_size "
            f"{batch_size} needs at least {2 * batch_size} (2 per column: an input and its "
            "target); use a smaller batch size or a longer file"
        )
    # (B, T) row-major chunks, transposed so that time is dim 0.
    return stream[: rows * batch_size].view(batch_size, rows).t().contiguous()


def get_batch(source: torch.Tensor, i: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, target)`` rows ``i .. i+L-1`` and ``i+1 .. i+L`` of a ``(T, B)`` batch.

    ``L = min(seq_len, T - 1 - i)``, so the last segment may be shorter. Both are views of
    ``source`` with shape ``(L, B)``; ``target[t, b]`` is the token after ``input[t, b]``.
    """
    if source.dim() != 2:
        raise CorpusError(
            f"get_batch expects a (T, B) tensor from batchify; got shape {tuple(source.shape)}"
        )
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise CorpusError(f"seq_len must be a positive int; got {seq_len!r}")
    rows = source.size(0)
    if not 0 <= i < rows - 1:
        raise CorpusError(
            f"batch position i={i} is out of range for a batch of {rows} rows; expected "
            f"0 <= i <= {rows - 2} (the last row has no target)"
        )
    length = min(seq_len, rows - 1 - i)
    return source[i : i + length], source[i + 1 : i + 1 + length]


def iter_batches(source: torch.Tensor, seq_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """All consecutive :func:`get_batch` segments of ``source`` (fixed ``seq_len``, evaluation)."""
    for i in range(0, source.size(0) - 1, seq_len):
        yield get_batch(source, i, seq_len)


# ---- statistics ---------------------------------------------------------------------------


def corpus_stats(
    directory: str | os.PathLike,
    *,
    mode: str = "word",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    corpus=None,
) -> dict:
    """Per-split lines, tokens (``<eos>`` included) and OOV counts, and the vocabulary size.
    ``corpus``: ``directory``'s corpus already opened (a memory-mapped one, whose split is a
    folder of shards: :func:`highrank.data.streaming.load_stream_corpus`).

    Returns ``{"directory", "mode", "vocab_size", "splits": {split: {"file", "lines",
    "tokens", "oov"}}}`` (plain ints and strings, ready for JSON).
    """
    if corpus is None:
        corpus = load_corpus(directory, mode=mode, cache_dir=cache_dir, use_cache=use_cache)
    splits = {
        split: {
            "file": str(corpus.path(split)),
            "lines": corpus.lines[split],
            "tokens": _token_count(corpus, split),
            "oov": corpus.oov[split],
        }
        for split in SPLITS
    }
    return {
        "directory": str(corpus.directory),
        "mode": mode,
        "vocab_size": len(corpus.vocab),
        "splits": splits,
    }


def _token_count(corpus, split: str) -> int:
    # a memory-mapped corpus counts its ids without reading them (its split() would)
    ids = getattr(corpus, "ids", None)
    return int(len(ids[split]) if ids is not None else corpus.split(split).numel())


def format_stats(stats: dict) -> str:
    """A plain-text table of :func:`corpus_stats`' result."""
    rows = [("split", "lines", "tokens (+eos)", "oov -> <unk>")]
    for split, row in stats["splits"].items():
        rows.append((split, f"{row['lines']:,}", f"{row['tokens']:,}", f"{row['oov']:,}"))
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    # First column (split name) left-aligned, the numbers right-aligned.
    table = ["  ".join(_align_row(row, widths)) for row in rows]
    header = f"{stats['directory']} ({stats['mode']}-level)"
    footer = f"vocabulary: {stats['vocab_size']:,} tokens (train types, <eos> included)"
    return "\n".join([header, *table, footer])


def _align_row(row: tuple[str, ...], widths: list[int]) -> list[str]:
    return [row[0].ljust(widths[0])] + [
        cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True)
    ]
