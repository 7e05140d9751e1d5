"""A seeded synthetic corpus with Zipfian word frequencies, for scale tests of corpus loading.

Words are drawn i.i.d. by rank ``r = 1 .. types`` with ``P(r) = r^-s / H(types, s)`` (Zipf's
law; ``s = 1`` is about what English text shows, and what One Billion Word's ~800K types do
over their most frequent ranks) and written as ``w<r - 1>`` (``w0`` most frequent). Sentence
lengths are ``1 + Poisson(mean - 1)`` words, one sentence per line. Token counts include one
``<eos>`` per line, as :func:`highrank.data.corpus_stats` counts them, and are exact.

The layout is a corpus folder (:mod:`highrank.data`): ``valid.txt``, ``test.txt`` and either
``train.txt`` or, with ``shards``, a folder ``train/`` of ``part-00000.txt`` ... (the 1B-Word
layout, :mod:`highrank.data.streaming`). ``zipf.json`` (written last) records the settings and
counts. Each split has its own generator, seeded with ``(seed, split index)``, so the same
settings give the same bytes. Text is generated and written a block at a time: memory does not
grow with the corpus.

Like Penn Treebank and WikiText-2 the corpus has a closed vocabulary: a valid or test word
that train never drew is written ``<unk>``, and train ends with one line ``<unk>`` (its last 2
tokens: the counts stay exact) so that the vocabulary has it; any corpus loader then reads it
without ``data.max_vocab``.

``highrank data zipf OUT --tokens N`` calls :func:`write_zipf_corpus`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 1 << 20  # tokens generated per block
MARKER = "zipf.json"
UNK_LINE = b"<unk>\n"  # train's last line: <unk> in the vocabulary (module docstring)


def zipf_probabilities(types: int, exponent: float = 1.0) -> np.ndarray:
    """``P(r) ∝ r^-exponent`` for ranks ``1 .. types`` (float64, summing to 1)."""
    weights = np.arange(1, types + 1, dtype=np.float64) ** -float(exponent)
    return weights / weights.sum()


def sentence_lengths(rng: np.random.Generator, tokens: int, mean: float) -> np.ndarray:
    """Words per sentence (each sentence also has an ``<eos>``) adding up to exactly
    ``tokens`` tokens: ``1 + Poisson(mean - 1)`` words, the last sentence cut to fit (a
    single remaining token is a blank line)."""
    lengths, total = [], 0
    while total < tokens:
        drawn = 1 + rng.poisson(mean - 1, size=max(16, int((tokens - total) / mean) + 16))
        ends = total + np.cumsum(drawn + 1)
        fits = int(np.searchsorted(ends, tokens, side="right"))
        lengths.append(drawn[:fits])
        total = int(ends[fits - 1]) if fits else total
        if fits < drawn.size and total < tokens:  # the last sentence: what is left, minus <eos>
            lengths.append(np.array([tokens - total - 1]))
            total = tokens
    return np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)


def piece_table(types: int) -> list[bytes]:
    """Entry ``2 r`` is ``b"w<r> "``, entry ``2 r + 1`` ``b"w<r>\\n"`` (the word ends a line)."""
    names = [f"w{rank}".encode() for rank in range(types)]
    return [piece for name in names for piece in (name + b" ", name + b"\n")]


def zipf_text(
    rng: np.random.Generator,
    tokens: int,
    cdf: np.ndarray,
    mean: float,
    table: list[bytes],
    seen: np.ndarray | None = None,
) -> Iterator[bytes]:
    """UTF-8 text of ``tokens`` tokens (``<eos>`` included) in blocks of whole lines; ``cdf``
    the cumulative rank probabilities, ``table`` the :func:`piece_table` of as many types;
    ``seen`` (bool per rank), when given, is marked with every rank drawn."""
    lengths = sentence_lengths(rng, tokens, mean)
    for start in range(0, lengths.size, max(1, int(BLOCK_TOKENS / mean))):
        block = lengths[start : start + max(1, int(BLOCK_TOKENS / mean))]
        words = int(block.sum())
        ranks = np.searchsorted(cdf, rng.random(words), side="right").clip(max=cdf.size - 1)
        if seen is not None:
            seen[ranks] = True
        line_end = np.zeros(words, dtype=np.int64)
        line_end[np.cumsum(block[block > 0]) - 1] = 1
        pieces = (2 * ranks + line_end).tolist()
        text = b"".join(map(table.__getitem__, pieces))
        blank = np.flatnonzero(block == 0)
        if blank.size:  # blank lines (only a cut last sentence can be one): rebuild by line
            text = _with_blank_lines(text, block)
        yield text


def _with_blank_lines(text: bytes, block: np.ndarray) -> bytes:
    lines = iter(text.split(b"\n")[:-1])
    return b"".join((next(lines) if n else b"") + b"\n" for n in block)


def write_zipf_corpus(
    folder: str | os.PathLike,
    *,
    train_tokens: int,
    valid_tokens: int | None = None,
    test_tokens: int | None = None,
    types: int = 100_000,
    exponent: float = 1.0,
    mean_sentence: float = 25.0,
    shards: int = 0,
    seed: int = 0,
) -> dict:
    """Write the corpus (see the module docstring) into the new or empty ``folder``.

    ``valid_tokens`` / ``test_tokens`` default (None) to ``train_tokens / 100`` (at least
    1,000); given, each is at least 2 (a word and its ``<eos>``: both corpus loaders refuse a
    split without a word, so 0 is an error, not the default). ``shards`` > 0 writes train as
    that many shard files. Returns what ``zipf.json`` holds.
    """
    folder = Path(folder)
    _check_settings(train_tokens, types, exponent, mean_sentence, shards)
    _check_held_out(valid_tokens=valid_tokens, test_tokens=test_tokens)
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} is not empty; expected a new or empty folder for the corpus")
    held_out = max(1_000, train_tokens // 100)
    sizes = {
        "train": train_tokens,
        "valid": held_out if valid_tokens is None else valid_tokens,
        "test": held_out if test_tokens is None else test_tokens,
    }
    cdf = np.cumsum(zipf_probabilities(types, exponent))
    table = piece_table(types)
    seen = np.zeros(types, dtype=bool)  # ranks train drew: the vocabulary
    files: dict[str, list[str]] = {}
    for index, (split, tokens) in enumerate(sizes.items()):
        if split != "train":
            table = _closed_table(table, seen)
        rng = np.random.Generator(np.random.PCG64([seed, index]))
        parts = _shard_sizes(tokens, shards) if split == "train" and shards else [tokens]
        if split == "train":
            parts[-1] -= 2  # its last line: <unk> and its <eos>
        paths = (
            [folder / split / f"part-{i:05d}.txt" for i in range(len(parts))]
            if split == "train" and shards
            else [folder / f"{split}.txt"]
        )
        for path, part in zip(paths, parts, strict=True):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as handle:
                marks = seen if split == "train" else None
                for text in zipf_text(rng, part, cdf, mean_sentence, table, marks):
                    handle.write(text)
        if split == "train":
            with open(paths[-1], "ab") as handle:
                handle.write(UNK_LINE)
        files[split] = [str(p.relative_to(folder)) for p in paths]
    info = {
        "generator": "highrank.data.zipf",
        "seed": seed,
        "types": types,
        "exponent": exponent,
        "mean_sentence": mean_sentence,
        "tokens": sizes,
        "files": files,
        "bytes": sum(p.stat().st_size for p in folder.rglob("*.txt")),
    }
    (folder / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _closed_table(table: list[bytes], seen: np.ndarray) -> list[bytes]:
    """The piece table with every rank train never drew written as ``<unk>``."""
    unk = (b"<unk> ", b"<unk>\n")
    return [piece if seen[i // 2] else unk[i % 2] for i, piece in enumerate(table)]


def _shard_sizes(tokens: int, shards: int) -> list[int]:
    """``shards`` sizes adding up to ``tokens``, the first ones one token longer."""
    base, extra = divmod(tokens, shards)
    return [base + (i < extra) for i in range(shards)]


def _check_settings(tokens: int, types: int, exponent: float, mean: float, shards: int) -> None:
    for name, value, ok, expected in (
        ("tokens", tokens, tokens >= 4, "an int >= 4 (a word, <eos>, and train's <unk> line)"),
        ("types", types, types >= 1, "an int >= 1"),
        ("exponent", exponent, exponent > 0, "a number > 0"),
        ("mean sentence length", mean, mean >= 1, "a number >= 1 (words per sentence)"),
        ("shards", shards, 0 <= shards <= tokens, "an int in [0, tokens]"),
    ):
        if not ok:
            raise ValueError(f"{name} = {value!r}; expected {expected}")


def _check_held_out(**sizes: int | None) -> None:
    """Each given held-out size is an int >= 2: a split needs a word besides its ``<eos>``."""
    for name, value in sizes.items():
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 2
        if value is not None and not ok:
            raise ValueError(
                f"{name} = {value!r}; expected an int >= 2 (a word and its <eos>: the corpus "
                f"loaders refuse a split without words) or None for max(1000, train_tokens // 100)"
            )


__all__ = [
    "piece_table",
    "sentence_lengths",
    "write_zipf_corpus",
    "zipf_probabilities",
    "zipf_text",
]
