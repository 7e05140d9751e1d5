"""Word similarity of a language model's input and output embeddings.

The wordvectors.org evaluation (Faruqui & Dyer, 2014, "Community Evaluation and Exchange of
Word Vectors at wordvectors.org"): for every word pair of a benchmark, the cosine similarity
of the two words' embedding rows; the score is Spearman's rank correlation between those
cosines and the human ratings. It is computed for both embeddings of a model,

    input  ``model.backbone.embedding.weight``   (V, d_embed)
    output ``model.head.weight``                  (V, d_embed): the decoder's word vectors,

which are one tensor when the weights are tied (the record says ``"tied": true``; the two
columns are then equal by construction).

Benchmark files (``data/word-sim`` of mfaruqui/eval-word-vectors) hold one pair per line,
``word1<TAB>word2<TAB>score``. Reading policy:

* Fields are split on any whitespace, so CRLF line endings (WS-353-ALL, MTurk-771, VERB-143,
  SimVerb-3500) lose their ``\\r``; a missing final newline (MTurk-287, SimVerb-3500) is
  harmless; blank lines are skipped. Any other line that is not two words and a finite
  number is an error naming the file and the line.
* A pair listed twice (same words in the same order after lower-casing: WS-353-ALL lists
  ``money cash`` with 9.15 and 9.08) is one pair whose human score is the mean of its
  ratings, so no pair weighs double in the rank correlation; the record counts the merged
  lines. A reversed pair (``bank money`` and ``money bank``) was rated as a separate item by
  the annotators and stays two pairs, as in every published evaluation.
* Lower-casing: pairs are identified by their lower-cased words (benchmark files are
  lower-case apart from 18 proper nouns of WS-353 such as ``Jerusalem``). A word is looked up
  lower-cased first (PTB's vocabulary is lower-case) and, if the vocabulary lacks that, as
  written in the file (``Jerusalem`` in a cased WikiText-2 vocabulary).
* A pair with a word out of the vocabulary is skipped and counted; such a word is never sent
  to ``<unk>``. Spearman needs at least :data:`MIN_PAIRS` pairs in the vocabulary and cosines
  that are not all equal; otherwise it is reported as null.

    highrank analyze similarity runs/ptb-mos --data-dir ../shared/data/word-sim
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from highrank.models import load_run

MIN_PAIRS = 3  # Spearman of fewer pairs is meaningless (two points always give +-1)
DEFAULT_DATA_DIR = Path("..") / "shared" / "data" / "word-sim"  # relative to the cwd
EMBEDDINGS = {"input": "model.backbone.embedding.weight", "output": "model.head.weight"}


class WordSimError(ValueError):
    """A benchmark file or folder that cannot be read as word-similarity data."""


@dataclass(frozen=True)
class Benchmark:
    """A word-similarity benchmark: unique pairs and their (mean) human scores.

    Attributes:
        name: the file name without ``.txt`` (``EN-WS-353-ALL``).
        path: the file it was read from.
        pairs: ``(word1, word2)`` as first written in the file, one per unique pair.
        scores: float64 human score of each pair (the mean over duplicated lines).
        lines: pair lines in the file.
        duplicates: lines merged into an earlier line's pair.
    """

    name: str
    path: Path
    pairs: tuple[tuple[str, str], ...]
    scores: np.ndarray
    lines: int
    duplicates: int


# ---- reading benchmark files ---------------------------------------------------------------


def parse_line(text: str, path: str | Path, number: int) -> tuple[str, str, float] | None:
    """``(word1, word2, score)`` of one benchmark line, None for a blank line; a malformed
    line is a :class:`WordSimError` naming ``path`` and line ``number`` (1-based)."""
    fields = text.split()
    if not fields:
        return None
    where = f"{path}, line {number}"
    if len(fields) != 3:
        raise WordSimError(
            f"{where}: expected 'word1<TAB>word2<TAB>score' (3 fields); "
            f"got {len(fields)} field(s): {text.strip()!r}"
        )
    try:
        score = float(fields[2])
    except ValueError:
        raise WordSimError(f"{where}: the score {fields[2]!r} is not a number") from None
    if not math.isfinite(score):
        raise WordSimError(f"{where}: the score {fields[2]!r} is not a finite number")
    return fields[0], fields[1], score


def read_benchmark(path: str | Path) -> Benchmark:
    """Read a benchmark file; duplicated pairs are merged (mean score), see the module notes."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WordSimError(f"benchmark file {path} does not exist") from None
    except UnicodeDecodeError as error:
        raise WordSimError(f"{path} is not UTF-8 text ({error.reason})") from None
    ratings: dict[tuple[str, str], list[float]] = {}  # insertion order = first appearance
    written: dict[tuple[str, str], tuple[str, str]] = {}
    for number, line in enumerate(text.splitlines(), start=1):  # \n, \r\n, no final newline
        parsed = parse_line(line, path, number)
        if parsed is None:
            continue
        first, second, score = parsed
        key = (first.lower(), second.lower())
        ratings.setdefault(key, []).append(score)
        written.setdefault(key, (first, second))
    if not ratings:
        raise WordSimError(f"{path} holds no word pairs; expected 'word1<TAB>word2<TAB>score'")
    lines = sum(len(scores) for scores in ratings.values())
    return Benchmark(
        name=path.name.removesuffix(".txt"),
        path=path,
        pairs=tuple(written[key] for key in ratings),
        scores=np.array([np.mean(scores) for scores in ratings.values()], dtype=np.float64),
        lines=lines,
        duplicates=lines - len(ratings),
    )


def benchmark_paths(data_dir: str | Path, names: Sequence[str] | None = None) -> list[Path]:
    """The ``*.txt`` files of ``data_dir`` sorted by name, or those ``names`` picks (file
    names with or without ``.txt``, in the order given)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise WordSimError(f"word-similarity folder {data_dir} does not exist")
    available = {p.name.removesuffix(".txt"): p for p in sorted(data_dir.glob("*.txt"))}
    if not available:
        raise WordSimError(f"{data_dir} holds no benchmark files (*.txt)")
    if names is None:
        return list(available.values())
    unknown = [name for name in names if name.removesuffix(".txt") not in available]
    if unknown or not names:
        raise WordSimError(
            f"--benchmarks: {', '.join(map(repr, unknown))} not in {data_dir}; "
            f"expected some of {', '.join(available)}"
        )
    return [available[name.removesuffix(".txt")] for name in names]


# ---- scoring ---------------------------------------------------------------------------------


def lookup(word: str, vocab) -> int | None:
    """Id of ``word`` lower-cased, else as written; None when out of the vocabulary (never
    ``<unk>``'s id)."""
    for form in (word.lower(), word):
        if form in vocab:
            return vocab.id(form)
    return None


def pair_ids(benchmark: Benchmark, vocab) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """``(ids_a, ids_b, kept, oov_words)``: ids of the pairs in the vocabulary, a boolean
    mask over ``benchmark.pairs`` of those kept, and the sorted distinct lower-cased words
    that are out of the vocabulary."""
    ids_a, ids_b, kept, oov = [], [], [], set()
    for first, second in benchmark.pairs:
        a, b = lookup(first, vocab), lookup(second, vocab)
        oov.update(word.lower() for word, i in ((first, a), (second, b)) if i is None)
        kept.append(a is not None and b is not None)
        if kept[-1]:
            ids_a.append(a)
            ids_b.append(b)
    ids = np.array(ids_a, dtype=np.int64), np.array(ids_b, dtype=np.int64)
    return *ids, np.array(kept, dtype=bool), sorted(oov)


def cosine_similarities(matrix: torch.Tensor, ids_a: np.ndarray, ids_b: np.ndarray) -> np.ndarray:
    """Cosine of rows ``ids_a[i]`` and ``ids_b[i]`` of ``matrix (V, d)``, in float64; a zero
    row has cosine 0 with every row (torch's norm clamp)."""
    weight = matrix.detach().to("cpu", torch.float64)
    a = weight[torch.as_tensor(ids_a, dtype=torch.long)]  # (P, d)
    b = weight[torch.as_tensor(ids_b, dtype=torch.long)]  # (P, d)
    return torch.nn.functional.cosine_similarity(a, b, dim=1).numpy()


def spearman(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Spearman's rank correlation of ``x`` and ``y`` (average ranks for ties; SciPy's
    ``spearmanr``); NaN for fewer than :data:`MIN_PAIRS` values or a constant input."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"spearman needs two 1-D arrays of one length; got {x.shape}, {y.shape}")
    if x.size < MIN_PAIRS or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        return float(stats.spearmanr(x, y).statistic)


def model_embeddings(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], bool]:
    """``({"input": E_in, "output": E_out}, tied)`` of a :class:`LanguageModel`: the
    ``(V, d)`` tensors named in :data:`EMBEDDINGS` and whether they are one tensor."""
    matrices = {"input": model.backbone.embedding.weight, "output": model.head.weight}
    return matrices, matrices["input"] is matrices["output"]


def evaluate_benchmark(
    benchmark: Benchmark, vocab, embeddings: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """Pair counts and one Spearman correlation per embedding (NaN when undefined)."""
    ids_a, ids_b, kept, oov = pair_ids(benchmark, vocab)
    human = benchmark.scores[kept]
    return {
        "file": str(benchmark.path),
        "lines": benchmark.lines,
        "duplicates_merged": benchmark.duplicates,
        "pairs": len(benchmark.pairs),
        "pairs_used": int(kept.sum()),
        "oov_skipped": int((~kept).sum()),
        "oov_words": oov,
        "spearman": {
            name: spearman(cosine_similarities(matrix, ids_a, ids_b), human)
            for name, matrix in embeddings.items()
        },
    }


def similarity_record(model: torch.nn.Module, vocab, benchmarks: Sequence[Benchmark]) -> dict:
    """Every benchmark scored on both embeddings of ``model``, with how they were read."""
    embeddings, tied = model_embeddings(model)
    return {
        "embeddings": EMBEDDINGS,
        "tied": tied,
        "shapes": {name: list(matrix.shape) for name, matrix in embeddings.items()},
        "vocab_size": len(vocab),
        "lowercase": "pairs matched lower-cased; words looked up lower-cased, then as written",
        "duplicates": "a pair listed twice is one pair with the mean score",
        "benchmarks": {b.name: evaluate_benchmark(b, vocab, embeddings) for b in benchmarks},
    }


def analyze_similarity(
    run_dir: str | os.PathLike,
    benchmarks: Sequence[Benchmark | str | os.PathLike],
    *,
    which: str = "best",
) -> dict[str, Any]:
    """The record of a trained run (checkpoint ``which``) on word-similarity ``benchmarks``
    (read :class:`Benchmark` s or their files): :func:`similarity_record` of its input and
    output embeddings."""
    benchmarks = [b if isinstance(b, Benchmark) else read_benchmark(b) for b in benchmarks]
    model, _, vocab = load_run(run_dir, which)
    record = {"run_dir": str(run_dir), "checkpoint": which}
    return record | similarity_record(model, vocab, benchmarks)
