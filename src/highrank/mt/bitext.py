"""Parallel text for translation: reading aligned files, and batches bounded by tokens.

A parallel corpus is a folder of ``{train,valid,test}.<lang>`` files, one sentence per line,
line ``i`` of ``<split>.<src_lang>`` translated by line ``i`` of ``<split>.<tgt_lang>``
(Multi30k's layout: ``train.en``/``train.de``; the two languages come from the config keys
``data.src_lang`` and ``data.tgt_lang``). Reading checks, with one error line each naming the
file: a missing file (the path expected and what the folder holds), invalid UTF-8 (byte offset
and line), line counts that differ (both files, and the first line where one of them ends) and
empty lines. Each line is stripped of leading and trailing whitespace (``\\r`` included); a
line that is then empty is an error naming its file and line (``empty="error"``, the default)
or, with ``empty="skip"``, drops the pair on both sides; the dropped line numbers are kept.

Batching follows fairseq's ``--max-tokens`` (Ott et al. 2019, "fairseq: A Fast, Extensible
Toolkit for Sequence Modeling"): pairs are sorted by length so that a batch holds pairs of
about equal length and padding stays small, then cut greedily so that
``batch size * longest sequence in the batch <= max_tokens``, counting the longer of the two
padded sides. The sort key is that cost's own length, ``max(source, target)``, then target,
then source; fairseq's order (target, then source) is ``sort_key="target"``. On Multi30k the
former needs fewer batches and less padding (benchmarks/results/mt-data: 119 vs 128 batches
per epoch at ``max_tokens`` 4,096).

In training, ties in length are broken by a seeded permutation and the batch order is
shuffled, both drawn from ``numpy.random.default_rng([seed, epoch])``: the batches of an epoch
are a pure function of (data, max_tokens, seed, epoch), so a run resumes at any batch index
without saving a sampler state.

Every sentence gets ``<eos>``: the source is ``x_1 .. x_m <eos>``, the decoder input
``<bos> y_1 .. y_n`` and the decoder target ``y_1 .. y_n <eos>`` (fairseq's convention), padded
with ``<pad>`` on the right. Tensors are batch-first ``(B, T)`` by default, as the Transformer
blocks of ``models/backbones/transformer.py`` take them; ``batch_first=False`` gives time-major
``(T, B)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from highrank.data import CorpusError, decode_utf8

SPLITS = ("train", "valid", "test")
EMPTY_POLICIES = ("error", "skip")
SORT_KEYS = ("longest", "target")


# ---- reading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BitextSplit:
    """The aligned sentences of one split.

    ``line_numbers[i]`` is the 1-based line of pair ``i`` in both files; ``skipped`` lists the
    lines dropped because one side was empty (only with ``empty="skip"``).
    """

    name: str
    src_path: Path
    tgt_path: Path
    src: tuple[str, ...]
    tgt: tuple[str, ...]
    line_numbers: tuple[int, ...]
    skipped: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.src)


@dataclass(frozen=True)
class Bitext:
    """A parallel corpus: the folder, the two languages and the splits that were read."""

    directory: Path
    src_lang: str
    tgt_lang: str
    splits: dict[str, BitextSplit]

    def split(self, name: str) -> BitextSplit:
        if name not in self.splits:
            raise CorpusError(
                f"split {name!r} was not read; this corpus holds {', '.join(self.splits)}"
            )
        return self.splits[name]


def bitext_paths(directory: str | os.PathLike, split: str, src_lang: str, tgt_lang: str):
    """``(directory/<split>.<src_lang>, directory/<split>.<tgt_lang>)``."""
    directory = Path(directory).expanduser()
    return directory / f"{split}.{src_lang}", directory / f"{split}.{tgt_lang}"


def load_bitext(
    directory: str | os.PathLike,
    src_lang: str,
    tgt_lang: str,
    *,
    splits: Sequence[str] = SPLITS,
    empty: str = "error",
) -> Bitext:
    """Read ``directory/<split>.<src_lang>`` and ``.<tgt_lang>`` for each of ``splits``."""
    directory = Path(directory).expanduser()
    _check_directory(directory, src_lang, tgt_lang)
    _check_languages(src_lang, tgt_lang)
    read = {s: read_bitext_split(directory, s, src_lang, tgt_lang, empty=empty) for s in splits}
    return Bitext(directory, src_lang, tgt_lang, read)


def read_bitext_split(
    directory: str | os.PathLike, split: str, src_lang: str, tgt_lang: str, *, empty="error"
) -> BitextSplit:
    """One split's aligned lines; see the module docstring for the checks."""
    if split not in SPLITS:
        raise CorpusError(f"split {split!r} is not known; expected one of {', '.join(SPLITS)}")
    if empty not in EMPTY_POLICIES:
        raise CorpusError(f"empty={empty!r} is not known; expected one of {EMPTY_POLICIES}")
    _check_languages(src_lang, tgt_lang)
    _check_directory(directory, src_lang, tgt_lang)
    src_path, tgt_path = bitext_paths(directory, split, src_lang, tgt_lang)
    src, tgt = _read_lines(src_path, src_lang, tgt_lang), _read_lines(tgt_path, src_lang, tgt_lang)
    _check_same_length(src_path, src, tgt_path, tgt)
    kept, skipped = [], []
    for number, (a, b) in enumerate(zip(src, tgt, strict=True), start=1):
        if a and b:
            kept.append(number)
        elif empty == "skip":
            skipped.append(number)
        else:
            raise _empty_line_error(src_path if not a else tgt_path, number)
    if not kept:
        raise CorpusError(
            f"{src_path} and {tgt_path} hold no sentence pair ({len(src):,} lines, "
            f"{len(skipped):,} skipped as empty); expected the {split} split, one sentence per line"
        )
    return BitextSplit(
        split,
        src_path,
        tgt_path,
        tuple(src[n - 1] for n in kept),
        tuple(tgt[n - 1] for n in kept),
        tuple(kept),
        tuple(skipped),
    )


def _check_directory(directory: str | os.PathLike, src_lang: str, tgt_lang: str) -> None:
    if not Path(directory).expanduser().is_dir():
        raise CorpusError(
            f"parallel corpus directory {directory} does not exist or is not a directory; "
            f"expected a folder holding {{train,valid,test}}.{src_lang} and .{tgt_lang}"
        )


def _check_languages(src_lang: str, tgt_lang: str) -> None:
    for key, lang in (("data.src_lang", src_lang), ("data.tgt_lang", tgt_lang)):
        if not isinstance(lang, str) or not lang or any(c in lang for c in "/\\. \t\n"):
            raise CorpusError(
                f"{key} = {lang!r}; expected a language suffix such as 'en' or 'de' (the file "
                "extension of the split files, without a dot)"
            )
    if src_lang == tgt_lang:
        raise CorpusError(
            f"data.src_lang and data.tgt_lang are both {src_lang!r}; expected two languages"
        )


def _read_lines(path: Path, src_lang: str, tgt_lang: str) -> list[str]:
    """The stripped lines of ``path`` (split on ``\\n``; a last line without one counts)."""
    if not path.is_file():
        folder = path.parent
        present = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
        holds = ", ".join(present) if present else "nothing"
        raise CorpusError(
            f"missing file {path}: a parallel corpus folder needs "
            f"{{train,valid,test}}.{src_lang} and {{train,valid,test}}.{tgt_lang} "
            f"(data.src_lang, data.tgt_lang); {folder} holds: {holds}"
        )
    lines = decode_utf8(path, path.read_bytes()).split("\n")
    if lines[-1] == "":
        lines.pop()  # the text ended with "\n": no line after it
    return [line.strip() for line in lines]


def _check_same_length(src_path: Path, src: list[str], tgt_path: Path, tgt: list[str]) -> None:
    if len(src) == len(tgt):
        return
    (short, n_short), (long, n_long) = sorted(
        [(src_path, len(src)), (tgt_path, len(tgt))], key=lambda pair: pair[1]
    )
    raise CorpusError(
        f"{src_path} has {len(src):,} lines but {tgt_path} has {len(tgt):,}: {short} ends after "
        f"line {n_short:,}, so line {n_short + 1:,} of {long} has no counterpart; expected "
        "the two files aligned line by line"
    )


def _empty_line_error(path: Path, number: int) -> CorpusError:
    return CorpusError(
        f"{path} line {number:,} is empty; expected one sentence per line on both sides "
        "(empty='skip' drops such pairs)"
    )


# ---- token ids ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecialIds:
    """The ids a batch needs besides the text: padding, begin and end of sentence."""

    pad: int
    bos: int
    eos: int

    def __post_init__(self) -> None:
        ids = (self.pad, self.bos, self.eos)
        if len(set(ids)) != 3 or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise CorpusError(f"special ids {self}: expected three distinct ints")
        if min(ids) < 0:
            raise CorpusError(f"special ids {self}: expected non-negative ids")


@dataclass(frozen=True, eq=False)
class EncodedPairs:
    """Token ids of a split's pairs, without ``<bos>``/``<eos>``: one int64 array per side.

    ``ids[i]`` is pair ``i``'s ids and ``offsets`` cut a concatenated array (CSR-like, so a
    split is two arrays rather than tens of thousands of small ones).
    """

    src_ids: np.ndarray
    src_offsets: np.ndarray
    tgt_ids: np.ndarray
    tgt_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    def src(self, i: int) -> np.ndarray:
        return self.src_ids[self.src_offsets[i] : self.src_offsets[i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        return self.tgt_ids[self.tgt_offsets[i] : self.tgt_offsets[i + 1]]

    @property
    def src_lengths(self) -> np.ndarray:
        """Ids per source sentence, ``<eos>`` not counted."""
        return np.diff(self.src_offsets)

    @property
    def tgt_lengths(self) -> np.ndarray:
        return np.diff(self.tgt_offsets)


Encoder = Callable[[list[str]], list[list[int]]]


def encode_pairs(split: BitextSplit, encode_src: Encoder, encode_tgt: Encoder) -> EncodedPairs:
    """Ids of every pair of ``split``; ``encode_*`` map a list of lines to lists of ids
    (e.g. ``highrank.mt.subwords.SubwordVocab.encode_lines``)."""
    src, tgt = encode_src(list(split.src)), encode_tgt(list(split.tgt))
    for side, ids, path in (("source", src, split.src_path), ("target", tgt, split.tgt_path)):
        if len(ids) != len(split):
            raise CorpusError(f"the {side} encoder returned {len(ids)} lines for {len(split)}")
        for i, row in enumerate(ids):
            if len(row) == 0:
                raise CorpusError(
                    f"{path} line {split.line_numbers[i]:,} encodes to no tokens; expected "
                    "at least one (is the line only characters the vocabulary drops?)"
                )
    return EncodedPairs(*_concatenate(src), *_concatenate(tgt))


def _concatenate(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    flat = np.fromiter((i for r in rows for i in r), dtype=np.int64, count=int(offsets[-1]))
    return flat, offsets


# ---- batches ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PairBatch:
    """Padded tensors of one batch (``B`` pairs; ``S``/``T`` the longest source/target + 1).

    ``src`` ``(B, S)`` = ``x <eos> <pad>..``; ``tgt_in`` ``(B, T)`` = ``<bos> y <pad>..``;
    ``tgt_out`` ``(B, T)`` = ``y <eos> <pad>..``; time-major ``(S, B)``, ``(T, B)`` when
    ``batch_first`` is False. ``src_lengths``/``tgt_lengths`` ``(B,)`` count ``<eos>``;
    ``index`` ``(B,)`` gives each row's pair number in the split (to restore file order).
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    src_lengths: torch.Tensor
    tgt_lengths: torch.Tensor
    index: torch.Tensor
    pad_id: int
    batch_first: bool = True

    @property
    def src_padding(self) -> torch.Tensor:
        """``(B, S)`` bool, True at padded source positions (batch-first in either layout, as
        attention's key-padding masks are)."""
        src = self.src if self.batch_first else self.src.t()
        return src == self.pad_id

    @property
    def tgt_padding(self) -> torch.Tensor:
        """``(B, T)`` bool, True at padded target positions."""
        tgt = self.tgt_out if self.batch_first else self.tgt_out.t()
        return tgt == self.pad_id

    @property
    def n_target_tokens(self) -> int:
        """Predicted tokens (``<eos>`` included, padding not): the loss normaliser."""
        return int(self.tgt_lengths.sum())

    def __len__(self) -> int:
        return int(self.index.numel())


def plan_batches(
    src_lengths: np.ndarray,
    tgt_lengths: np.ndarray,
    max_tokens: int,
    *,
    shuffle: bool,
    seed: int = 0,
    epoch: int = 0,
    max_sentences: int | None = None,
    sort_key: str = "longest",
) -> list[np.ndarray]:
    """Pair indices of each batch, in the order the batches are to be used.

    Lengths count the tokens a sequence has in the batch (``<eos>`` or ``<bos>`` included).
    A batch of ``n`` pairs costs ``n * max(longest source, longest target)`` padded tokens,
    at most ``max_tokens`` (and ``n <= max_sentences`` when given). ``sort_key``:
    ``"longest"`` (the longer side, then target, then source) or ``"target"`` (fairseq).
    """
    src_lengths, tgt_lengths = np.asarray(src_lengths), np.asarray(tgt_lengths)
    _check_plan_args(src_lengths, tgt_lengths, max_tokens, max_sentences)
    if sort_key not in SORT_KEYS:
        raise CorpusError(f"sort_key={sort_key!r} is not known; expected one of {SORT_KEYS}")
    rng = np.random.default_rng([seed, epoch]) if shuffle else None
    order = rng.permutation(len(src_lengths)) if rng is not None else np.arange(len(src_lengths))
    longest = np.maximum(src_lengths, tgt_lengths)
    # lexsort is stable and sorts by the last key first; ties keep the (shuffled) order.
    keys = (src_lengths[order], tgt_lengths[order])
    if sort_key == "longest":
        keys += (longest[order],)
    order = order[np.lexsort(keys)]
    longest = longest[order]
    batches = _cut(order, longest, max_tokens, max_sentences or len(order))
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def _cut(
    order: np.ndarray, longest: np.ndarray, max_tokens: int, max_sentences: int
) -> list[np.ndarray]:
    """Greedy cut of sorted pairs: extend a batch while ``n * max length`` stays in budget."""
    batches, start, widest = [], 0, 0
    for position, length in enumerate(longest.tolist()):
        width = max(widest, length)
        n = position - start + 1
        if n > max_sentences or n * width > max_tokens:
            batches.append(order[start:position])
            start, width = position, length
        widest = width
    batches.append(order[start:])
    return batches


def _check_plan_args(src_lengths, tgt_lengths, max_tokens, max_sentences) -> None:
    if src_lengths.shape != tgt_lengths.shape or src_lengths.ndim != 1 or src_lengths.size == 0:
        raise CorpusError(
            f"expected two non-empty 1-D length arrays of one size; got shapes "
            f"{src_lengths.shape} and {tgt_lengths.shape}"
        )
    for key, value in (("max_tokens", max_tokens), ("max_sentences", max_sentences)):
        if value is None and key == "max_sentences":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CorpusError(f"{key} must be a positive int; got {value!r}")
    longest = np.maximum(src_lengths, tgt_lengths)
    if longest.max() > max_tokens:
        i = int(longest.argmax())
        raise CorpusError(
            f"pair {i} has {int(src_lengths[i])} source and {int(tgt_lengths[i])} target tokens "
            f"(<eos> included), more than max_tokens={max_tokens} allows in a batch of one; "
            "raise max_tokens or drop long pairs (max_len)"
        )


class TokenBatches(Sequence[PairBatch]):
    """The batches of one split for one epoch, by index: ``batches[i]`` is batch ``i``.

    Deterministic given (pairs, max_tokens, shuffle, seed, epoch): resuming an epoch at batch
    ``k`` is ``batches.iter_from(k)`` on a freshly built object, no sampler state saved.

    Args:
        pairs: the split's ids (:func:`encode_pairs`).
        max_tokens: bound on ``batch size * longest padded sequence`` (either side).
        special: the ``<pad>``, ``<bos>`` and ``<eos>`` ids.
        shuffle: True for training (seeded tie order and batch order); False keeps batches in
            length order (evaluation, translation).
        max_len: drop pairs with more than ``max_len`` tokens on either side (``<eos>``
            counted), e.g. the model's position limit; their indices are in ``dropped``.
        batch_first: ``(B, T)`` tensors (default) or time-major ``(T, B)``.
        sort_key: the length order of :func:`plan_batches`.
    """

    def __init__(
        self,
        pairs: EncodedPairs,
        *,
        max_tokens: int,
        special: SpecialIds,
        shuffle: bool,
        seed: int = 0,
        epoch: int = 0,
        max_sentences: int | None = None,
        max_len: int | None = None,
        batch_first: bool = True,
        sort_key: str = "longest",
    ) -> None:
        self.pairs, self.special, self.batch_first = pairs, special, batch_first
        src_len, tgt_len = pairs.src_lengths + 1, pairs.tgt_lengths + 1  # <eos> / <bos>
        keep = np.arange(len(pairs))
        if max_len is not None:
            if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
                raise CorpusError(f"max_len must be an int >= 2; got {max_len!r}")
            too_long = (src_len > max_len) | (tgt_len > max_len)
            keep = np.flatnonzero(~too_long)
            if keep.size == 0:
                raise CorpusError(f"every pair is longer than max_len={max_len} tokens")
        self.dropped = np.setdiff1d(np.arange(len(pairs)), keep)
        plan = plan_batches(
            src_len[keep],
            tgt_len[keep],
            max_tokens,
            shuffle=shuffle,
            seed=seed,
            epoch=epoch,
            max_sentences=max_sentences,
            sort_key=sort_key,
        )
        self.plan: list[np.ndarray] = [keep[b] for b in plan]  # pair indices in the split

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"batch {i} is out of range; this epoch has {len(self)} batches")
        return collate(self.pairs, self.plan[i], self.special, batch_first=self.batch_first)

    def iter_from(self, start: int) -> Iterator[PairBatch]:
        """Batches ``start, start + 1, ..`` (resume an epoch after ``start`` batches)."""
        if not 0 <= start <= len(self):
            raise IndexError(f"cannot resume at batch {start}; this epoch has {len(self)}")
        for i in range(start, len(self)):
            yield self[i]

    def padding_stats(self) -> dict[str, int]:
        """Real and padded token counts per side over the epoch (``<eos>``/``<bos>`` real)."""
        stats = {"src_real": 0, "src_padded": 0, "tgt_real": 0, "tgt_padded": 0}
        src_len, tgt_len = self.pairs.src_lengths + 1, self.pairs.tgt_lengths + 1
        for batch in self.plan:
            stats["src_real"] += int(src_len[batch].sum())
            stats["src_padded"] += len(batch) * int(src_len[batch].max())
            stats["tgt_real"] += int(tgt_len[batch].sum())
            stats["tgt_padded"] += len(batch) * int(tgt_len[batch].max())
        return stats


def collate(
    pairs: EncodedPairs, indices: np.ndarray, special: SpecialIds, *, batch_first: bool = True
) -> PairBatch:
    """The :class:`PairBatch` of pairs ``indices`` (rows in that order)."""
    srcs = [np.append(pairs.src(i), special.eos) for i in indices]
    tgts = [pairs.tgt(i) for i in indices]
    src = _pad([torch.from_numpy(s) for s in srcs], special.pad)
    tgt_in = _pad([torch.from_numpy(np.insert(t, 0, special.bos)) for t in tgts], special.pad)
    tgt_out = _pad([torch.from_numpy(np.append(t, special.eos)) for t in tgts], special.pad)
    if not batch_first:
        src, tgt_in, tgt_out = (x.t().contiguous() for x in (src, tgt_in, tgt_out))  # (T, B)
    return PairBatch(
        src=src,
        tgt_in=tgt_in,
        tgt_out=tgt_out,
        src_lengths=torch.tensor([len(s) for s in srcs], dtype=torch.long),
        tgt_lengths=torch.tensor([len(t) + 1 for t in tgts], dtype=torch.long),
        index=torch.as_tensor(np.asarray(indices, dtype=np.int64)),
        pad_id=special.pad,
        batch_first=batch_first,
    )


def _pad(rows: list[torch.Tensor], pad_id: int) -> torch.Tensor:
    """``(B, longest)`` int64, rows left-aligned, padded on the right with ``pad_id``."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_id).long()
