"""Penn Treebank as characters, exactly as Mikolov's ``ptb.char.{train,valid,test}.txt``.

Mikolov's ``simple-examples`` (the RNNLM toolkit data) ships a character-level copy of the
word-level PTB (``ptb.{train,valid,test}.txt``). highrank uses it for the inverse experiment of
the softmax-bottleneck line (Yang et al. 2018, Table 12, ran it on text8: with a vocabulary this
small, MoS should not help). Its format, read from the files themselves (``datasets/ptb_char/``
of youngjoo-epfl/gconvRNN; the same git blobs as ``data/`` of arthurdehgan/IFT6135_assignment_2):

* every word is written as its characters, each a symbol;
* ``_`` is the symbol between two words (a line's leading and trailing spaces are dropped);
* ``<unk>`` is **not** a symbol: it is spelled out as the five characters ``< u n k >``
  (``N``, PTB's number token, likewise stays the character ``N``);
* one line per word-level line; the end of a line is the ``<eos>`` symbol of a language model;
* in the file, symbols are separated by single spaces with the newline counted as a symbol:
  ``"c o n s u m e r s _ m a y \\n < u n k > _ ... \\n "`` (so every line but the first
  starts with a space, and the file ends with ``"\\n "``).

:func:`ptb_char_text` rebuilds those bytes from the word-level files: its output for
``ptb.valid.txt`` and ``ptb.test.txt`` is byte-identical to the published ``ptb.char.valid.txt``
and ``ptb.char.test.txt`` (git blobs ``940c7ea5`` and ``4e866a85``; tests/data/test_chars.py checks
it when the data is present). Read with whitespace tokenisation and one ``<eos>`` per line,
PTB characters are 5,017,482 / 393,042 / 442,423 symbols with 50 types (49 characters incl. ``_``
plus ``<eos>``).

Reading the published files themselves with ``data.mode = "word"`` gives the same stream plus
one extra final ``<eos>``: the file's last ``" "`` reads as one more, blank, line.

The trainer needs no converted files: ``data.mode = "char"`` (``highrank.data``) reads the
word-level folder and yields the same symbol stream, with the literal space ``" "`` standing
for ``_`` (:func:`char_symbols` and that mode agree token for token up to that renaming).

Bits per character: the NLL of a character model in nats divided by ln 2, per predicted symbol,
``<eos>`` included (it stands for the newline character): :func:`bits_per_char`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from highrank.data.corpus import SPLITS, CorpusError, decode_utf8
from highrank.util.atomic import write_text_atomic

WORD_BOUNDARY = "_"  # Mikolov's symbol between two words


def char_symbols(line: str) -> list[str]:
    """The symbols of one word-level line: each word's characters, ``_`` between words.

    ``<unk>`` and every other word are spelled character by character, as in ptb.char.
    A blank line has no symbols (a language model still appends its ``<eos>``).
    """
    symbols: list[str] = []
    for position, word in enumerate(line.split()):
        if position:
            symbols.append(WORD_BOUNDARY)
        symbols.extend(word)
    return symbols


def _lines(text: str) -> list[str]:
    """Lines split on ``\\n``; a final line without ``\\n`` still counts."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def ptb_char_text(word_text: str, *, source: str = "text") -> str:
    """Mikolov's ptb.char file content for a word-level PTB split's text.

    Raises :class:`~highrank.data.CorpusError` (naming ``source`` and the line) when a word
    holds ``_`` itself: the word boundary would then be ambiguous.
    """
    lines = _lines(word_text)
    for number, line in enumerate(lines, start=1):
        if WORD_BOUNDARY in line:
            raise CorpusError(
                f"{source} line {number}: holds {WORD_BOUNDARY!r}, which ptb.char reserves for "
                "the word boundary; expected word-level text without it"
            )
    if not lines:
        return ""
    # The newline is a symbol like any other: " ".join over all symbols, one trailing space.
    return " \n ".join(" ".join(char_symbols(line)) for line in lines) + " \n "


def write_ptb_char(
    word_dir: str | os.PathLike, out_dir: str | os.PathLike, *, prefix: str = "ptb.char."
) -> dict[str, Path]:
    """Write ``out_dir/<prefix><split>.txt`` from ``word_dir/<split>.txt`` for each split.

    Returns the written paths by split. ``out_dir`` must not be ``word_dir`` with an empty
    prefix (it would overwrite the word-level files).
    """
    word_dir, out_dir = Path(word_dir).expanduser(), Path(out_dir).expanduser()
    if not prefix and out_dir.resolve() == word_dir.resolve():
        raise CorpusError(
            f"out_dir {out_dir} is word_dir and prefix is empty; refusing to overwrite the "
            "word-level files"
        )
    written = {}
    for split in SPLITS:
        path = word_dir / f"{split}.txt"
        if not path.is_file():
            raise CorpusError(f"missing split file {path}; expected the word-level {split} split")
        text = decode_utf8(path, path.read_bytes())
        written[split] = out_dir / f"{prefix}{split}.txt"
        write_text_atomic(written[split], ptb_char_text(text, source=str(path)))
    return written


def bits_per_char(total_nll_nats: float, n_symbols: int) -> float:
    """Bits per character: ``total NLL (nats) / (n_symbols * ln 2)``.

    ``n_symbols`` counts every predicted symbol, ``<eos>`` included. For a mean NLL per
    symbol in nats (a cross-entropy loss), pass ``n_symbols=1``.
    """
    if isinstance(n_symbols, bool) or not isinstance(n_symbols, int) or n_symbols < 1:
        raise ValueError(f"n_symbols must be a positive int; got {n_symbols!r}")
    if not math.isfinite(total_nll_nats) or total_nll_nats < 0:
        raise ValueError(
            f"total_nll_nats must be a finite non-negative number; got {total_nll_nats!r}"
        )
    return total_nll_nats / (n_symbols * math.log(2))
