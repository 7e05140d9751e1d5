"""Expected pairwise KL divergence between a model's next-token distributions.

Yang et al. (2018), "Breaking the Softmax Bottleneck", report E_{c,c'}[KL(P(.|c) || P(.|c'))]
over pairs of contexts of the Penn Treebank test set (Softmax 4.763, MoC 4.864, MoS 5.284): a
model whose log-probability matrix has higher rank can make its distributions differ more
from context to context. The paper does not say how the pairs were chosen; this module's
protocol is:

1. **Contexts.** The contexts of the split as :func:`~highrank.analysis.contexts.iter_contexts`
   reads them with ``batch_size=1``, in stream order: context ``i`` ends at token ``i`` and
   predicts token ``i + 1``, for ``i = 0 .. n - 1`` with ``n = N - 1`` for a split of ``N``
   tokens, or the first ``n = max_contexts`` contexts when that is smaller. A matrix written
   by :mod:`~highrank.analysis.logprob_matrix` with ``batch_size=1`` has the same rows.
2. **Pairs.** ``S`` ordered pairs ``(i, j)``, drawn independently and uniformly from the
   ``n (n - 1)`` ordered pairs with ``i != j`` (with replacement: a pair may repeat), by
   :func:`sample_pairs`::

       rng = numpy.random.default_rng(seed)
       i  = rng.integers(0, n, size=S)          # uniform over 0 .. n-1
       j_ = rng.integers(0, n - 1, size=S)      # uniform over the n-1 other contexts ...
       j  = j_ + (j_ >= i)                      # ... skipping i

3. **Divergence.** For each pair, in float64 from the head's float32 log-probabilities
   (:func:`kl_divergence`)::

       KL(p_i || p_j) = sum_w p_i(w) (log p_i(w) - log p_j(w)),   p_i = exp(log p_i)

   A word with ``p_i(w) = 0`` adds 0 (``0 log 0 = 0``); a word with ``p_i(w) > 0`` and
   ``p_j(w) = 0`` makes the divergence ``inf``. Nothing is renormalised or smoothed.
4. **Report.** ``mean`` over the ``S`` pairs, ``std`` the sample standard deviation
   (``ddof=1``), ``stderr = std / sqrt(S)`` the standard error of the mean, ``pairs = S``,
   ``distinct_contexts`` the pairs touch and ``infinite_pairs``; with ``n`` and the seed.

Memory. The pairs are drawn first; the contexts are then streamed once, in order, and only the
rows of contexts that take part in some pair are computed (the head runs on those hidden
states only) and kept. A pair is scored as soon as its later context arrives, and a row is
dropped once every pair it belongs to is scored, so the rows held at once are those seen whose
partner is still to come: at most ``min(2S, n)`` and, for pairs spread over a long stream,
about ``S / 2`` (PTB, ``S = 10,000``, ``V = 10,000``: ~200 MB of float32). A matrix on disk is
read through a memory map, only at the rows the pairs need, in the same order.

    highrank analyze kl runs/ptb-softmax runs/ptb-mos --split test --pairs 10000 --seed 0

A Hugging Face causal LM is measured the same way on the contexts of a text
(:mod:`highrank.analysis.hf_contexts`: windows of W tokens, row ``i`` the context ending at
token ``i``), steps 2-4 unchanged: :func:`analyze_kl` takes either kind of
:class:`~highrank.analysis.rows.RowSource`::

    highrank analyze kl --hf SmolLM2-135M-Instruct.Q4_1.gguf --text test.txt --out kl/
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from highrank.analysis.contexts import RunSplit
from highrank.analysis.logprob_matrix import matrix_record, npy_layout
from highrank.analysis.rows import RowSource, RunRows, TextRows
from highrank.models import LanguageModel
from highrank.runs.run_dir import RunDir

DEFAULT_PAIRS = 10_000
DEFAULT_BPTT = 70  # segment length of the context stream (the state is carried across)
CHUNK_ELEMENTS = 2**21  # pairs scored at once: about this many float64 entries per temporary

# A block of rows: (context indices (b,) ascending, rows (b, V) of log-probabilities).
RowBlock = tuple[np.ndarray, np.ndarray]
# Given the sorted distinct context indices the pairs need, blocks holding (at least) them.
RowsOf = Callable[[np.ndarray], Iterable[RowBlock]]

PROTOCOL = {
    "contexts": "the first n contexts of the split in stream order (iter_contexts, batch_size 1)",
    "pairs": "S ordered pairs (i, j), i != j, uniform with replacement: "
    "rng = numpy.random.default_rng(seed); i = rng.integers(0, n, S); "
    "j_ = rng.integers(0, n - 1, S); j = j_ + (j_ >= i)",
    "kl": "sum_w p_i(w) (log p_i(w) - log p_j(w)) in float64 from float32 log-probs; "
    "p_i(w) = 0 adds 0, p_j(w) = 0 < p_i(w) gives inf",
    "std": "sample standard deviation over pairs (ddof=1)",
    "stderr": "standard error of the mean: std / sqrt(S)",
}


class KLError(ValueError):
    """Input that the pairwise KL cannot be computed from (too few contexts, a bad matrix)."""


# ---- the divergence --------------------------------------------------------------------------


def kl_divergence(log_p: np.ndarray | torch.Tensor, log_q: np.ndarray | torch.Tensor) -> np.ndarray:
    """``KL(p || q) = sum_w p(w) (log p(w) - log q(w))`` of each row, in float64.

    ``log_p`` and ``log_q`` are ``(..., V)`` log-probabilities of one shape. Terms with
    ``p(w) = 0`` are 0; ``q(w) = 0`` where ``p(w) > 0`` gives ``inf``. Returns ``(...,)``.
    """
    log_p, log_q = _float64(log_p), _float64(log_q)
    if log_p.shape != log_q.shape:
        raise ValueError(f"log_p and log_q must have one shape; got {log_p.shape}, {log_q.shape}")
    p = np.exp(log_p)
    # -inf - -inf (p = q = 0) and 0 * inf are NaN in the branch that np.where discards.
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0.0, p * (log_p - log_q), 0.0)
    return terms.sum(axis=-1)


def _float64(values: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)


# ---- the pairs -------------------------------------------------------------------------------


def sample_pairs(n_contexts: int, n_pairs: int, seed: int) -> np.ndarray:
    """``(n_pairs, 2)`` int64 ordered pairs ``(i, j)``, ``i != j``, uniform over the
    ``n (n - 1)`` such pairs of ``n_contexts`` contexts, with replacement (module step 2)."""
    if not isinstance(n_contexts, int | np.integer) or n_contexts < 2:
        raise KLError(f"pairs of distinct contexts need n_contexts >= 2; got {n_contexts!r}")
    if not isinstance(n_pairs, int | np.integer) or n_pairs < 1:
        raise KLError(f"n_pairs must be a positive int; got {n_pairs!r}")
    rng = np.random.default_rng(seed)
    first = rng.integers(0, n_contexts, size=n_pairs)  # (S,)
    other = rng.integers(0, n_contexts - 1, size=n_pairs)  # (S,) among the n - 1 others
    second = other + (other >= first)
    return np.stack([first, second], axis=1).astype(np.int64)


# ---- streaming the rows once -----------------------------------------------------------------


def pair_kl_values(blocks: Iterable[RowBlock], pairs: np.ndarray) -> tuple[np.ndarray, int]:
    """``(KL of each pair (S,), most rows held at once)`` from row ``blocks`` in ascending
    context order, keeping only rows some pending pair still needs (see "Memory" above).

    Blocks may skip contexts no pair needs; each needed context must appear once.
    """
    pairs = np.asarray(pairs, dtype=np.int64)  # (S, 2)
    if pairs.ndim != 2 or pairs.shape[1] != 2 or len(pairs) == 0:
        raise ValueError(f"pairs must have shape (S, 2) with S >= 1; got {pairs.shape}")
    finish = pairs.max(axis=1)  # (S,) a pair is scored when its later context arrives
    by_finish = np.argsort(finish, kind="stable")
    release = np.full(int(finish.max()) + 1, -1)  # a row can go once its last pair is scored
    np.maximum.at(release, pairs[:, 0], finish)
    np.maximum.at(release, pairs[:, 1], finish)
    needed = np.flatnonzero(release >= 0)
    by_release = needed[np.argsort(release[needed], kind="stable")]
    values = np.full(len(pairs), np.nan)
    kept: dict[int, np.ndarray] = {}
    scored = released = peak = 0
    last = -1
    for indices, rows in blocks:
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) == 0:
            continue
        if indices[0] <= last or np.any(np.diff(indices) <= 0):
            raise ValueError(f"row blocks must come in ascending context order; got {indices}")
        last = int(indices[-1])
        for offset in np.flatnonzero(_isin(indices, release)):
            kept[int(indices[offset])] = np.array(rows[offset], dtype=np.float32)  # a copy
        peak = max(peak, len(kept))
        stop = int(np.searchsorted(finish[by_finish], last, side="right"))
        _score(pairs, by_finish[scored:stop], kept, values)
        scored = stop
        while released < len(by_release) and release[by_release[released]] <= last:
            kept.pop(int(by_release[released]), None)
            released += 1
    if scored < len(pairs):
        missing = sorted({int(i) for i in pairs[by_finish[scored:]].ravel()} - set(kept))
        raise KLError(
            f"the rows ended at context {last}, but the pairs need contexts up to "
            f"{int(finish.max())} (missing e.g. {missing[:5]}); the source has fewer rows "
            "than n_contexts"
        )
    return values, peak


def _isin(indices: np.ndarray, release: np.ndarray) -> np.ndarray:
    """Mask of ``indices`` that some pair needs (``release >= 0``)."""
    inside = indices < len(release)
    mask = np.zeros(len(indices), dtype=bool)
    mask[inside] = release[indices[inside]] >= 0
    return mask


def _score(pairs: np.ndarray, which: np.ndarray, kept: dict, values: np.ndarray) -> None:
    """``values[which] = KL`` of those pairs, a chunk of pairs at a time."""
    if len(which) == 0:
        return
    absent = sorted({int(i) for i in pairs[which].ravel()} - kept.keys())
    if absent:
        raise KLError(f"the row source skipped context(s) {absent[:5]}, which the pairs need")
    chunk = max(1, CHUNK_ELEMENTS // len(kept[int(pairs[which[0], 0])]))
    for start in range(0, len(which), chunk):
        part = which[start : start + chunk]
        log_p = np.stack([kept[int(i)] for i in pairs[part, 0]])  # (c, V)
        log_q = np.stack([kept[int(j)] for j in pairs[part, 1]])  # (c, V)
        values[part] = kl_divergence(log_p, log_q)


# ---- row sources: a matrix (in memory or on disk) and a model ---------------------------------


def matrix_row_blocks(
    matrix: np.ndarray | torch.Tensor, needed: np.ndarray, block_rows: int = 1024
) -> Iterator[RowBlock]:
    """Rows ``needed`` (sorted) of ``matrix``, ``block_rows`` at a time; a memory-mapped
    ``.npy`` is read at those rows only."""
    if isinstance(matrix, torch.Tensor):
        matrix = matrix.detach().cpu().numpy()
    for start in range(0, len(needed), block_rows):
        indices = needed[start : start + block_rows]
        yield indices, np.asarray(matrix[indices])


# ---- the expectation -------------------------------------------------------------------------


def summarize(values: np.ndarray) -> dict[str, Any]:
    """Mean, sample std (``ddof=1``), standard error and counts of per-pair divergences."""
    values = np.asarray(values, dtype=np.float64)
    count = len(values)
    finite = bool(np.isfinite(values).all())
    std = float(np.std(values, ddof=1)) if count > 1 and finite else math.nan
    return {
        "mean": float(np.mean(values)),
        "std": std,
        "stderr": std / math.sqrt(count) if count > 1 else math.nan,
        "pairs": count,
        "infinite_pairs": int(np.isinf(values).sum()),
    }


def expected_pairwise_kl(
    source: RowsOf, n_contexts: int, *, n_pairs: int = DEFAULT_PAIRS, seed: int = 0
) -> dict[str, Any]:
    """The module's protocol over ``n_contexts`` contexts whose rows ``source`` streams:
    summary numbers plus the sampling parameters."""
    pairs = sample_pairs(n_contexts, n_pairs, seed)
    needed = np.unique(pairs)  # sorted distinct contexts
    values, peak = pair_kl_values(source(needed), pairs)
    return {
        **summarize(values),
        "n_contexts": n_contexts,
        "seed": seed,
        "distinct_contexts": len(needed),
        "peak_rows_held": peak,
    }


def matrix_pairwise_kl(
    matrix: np.ndarray | torch.Tensor | str | os.PathLike,
    *,
    n_pairs: int = DEFAULT_PAIRS,
    seed: int = 0,
    max_contexts: int | None = None,
) -> dict[str, Any]:
    """:func:`expected_pairwise_kl` over the rows of a log-prob ``matrix (n, V)``: an array,
    a tensor, or the path of a ``.npy`` (memory-mapped; only the needed rows are read)."""
    if isinstance(matrix, str | os.PathLike):
        matrix = open_matrix(matrix)
    if matrix.ndim != 2:
        raise KLError(f"a log-prob matrix is 2-D (contexts, vocabulary); got {matrix.shape}")
    n_contexts = _cap(matrix.shape[0], max_contexts)
    return expected_pairwise_kl(
        lambda needed: matrix_row_blocks(matrix, needed), n_contexts, n_pairs=n_pairs, seed=seed
    )


def open_matrix(path: str | os.PathLike) -> np.ndarray:
    """The ``.npy`` at ``path`` memory-mapped read-only, its layout checked first."""
    try:
        shape, _, _ = npy_layout(path)
    except (FileNotFoundError, ValueError) as error:
        raise KLError(str(error)) from None
    if len(shape) != 2:
        raise KLError(f"{path} holds an array of shape {shape}; expected (contexts, vocabulary)")
    return np.load(path, mmap_mode="r")


def analyze_kl(
    source: RowSource,
    *,
    n_pairs: int = DEFAULT_PAIRS,
    seed: int = 0,
    max_contexts: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """The expected pairwise KL of any :class:`~highrank.analysis.rows.RowSource` (a run's
    split, a causal LM on a text), as a record: the source, the summary numbers, the
    protocol. The contexts are streamed once; only the rows some pair needs are computed."""
    source.load(progress=progress)
    result = analyze_kl_numbers(source, n_pairs, seed, max_contexts, progress)
    described = source.describe(max_contexts)
    return {
        **described,
        "rows_from": "model",
        **({} if "max_contexts" in described else {"max_contexts": max_contexts}),
        **result,
        "protocol": {**PROTOCOL, "contexts": source.contexts_protocol()},
        "numpy": np.__version__,
    }


def model_pairwise_kl(
    model: LanguageModel,
    ids: torch.Tensor,
    *,
    n_pairs: int = DEFAULT_PAIRS,
    seed: int = 0,
    max_contexts: int | None = None,
    bptt: int = DEFAULT_BPTT,
    progress: bool = False,
    name: str = "token stream",
) -> dict[str, Any]:
    """:func:`expected_pairwise_kl` of a highrank ``model`` on the stream ``ids`` (the
    summary numbers only): :func:`analyze_kl` without a run directory."""
    source = RunRows.of_model(model, ids, bptt=bptt, name=name)
    return analyze_kl_numbers(source, n_pairs, seed, max_contexts, progress)


def run_pairwise_kl(
    run_split: RunSplit,
    *,
    n_pairs: int = DEFAULT_PAIRS,
    seed: int = 0,
    max_contexts: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """:func:`analyze_kl` of a run split already loaded (:func:`load_run_split`)."""
    return analyze_kl(
        RunRows.of(run_split),
        n_pairs=n_pairs,
        seed=seed,
        max_contexts=max_contexts,
        progress=progress,
    )


def causal_lm_pairwise_kl(
    model: Any,
    ids: torch.Tensor,
    *,
    window: int,
    bos_token_id: int | None = None,
    n_pairs: int = DEFAULT_PAIRS,
    seed: int = 0,
    max_contexts: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """:func:`expected_pairwise_kl` of a Hugging Face causal LM in memory on the text ``ids``,
    read in windows of ``window`` tokens (the summary numbers only)."""
    source = TextRows.of_model(model, ids, window=window, bos_token_id=bos_token_id)
    return analyze_kl_numbers(source, n_pairs, seed, max_contexts, progress)


def analyze_kl_numbers(
    source: RowSource, n_pairs: int, seed: int, max_contexts: int | None, progress: bool
) -> dict[str, Any]:
    """The summary numbers of :func:`analyze_kl` (no description of the source)."""
    n_contexts = _cap(source.n_contexts(), max_contexts)

    def rows_of(needed: np.ndarray) -> Iterator[RowBlock]:
        for positions, _, rows in source.iter_rows(needed=needed, progress=progress):
            yield positions, rows.numpy()

    return expected_pairwise_kl(rows_of, n_contexts, n_pairs=n_pairs, seed=seed)


def analyze_kl_matrix(
    run_dir: str | os.PathLike,
    path: str | os.PathLike,
    *,
    split: str = "test",
    which: str = "best",
    n_pairs: int = DEFAULT_PAIRS,
    seed: int = 0,
    max_contexts: int | None = None,
) -> dict[str, Any]:
    """The KL record of ``run_dir`` from the log-prob matrix ``.npy`` at ``path`` (rows read
    through a memory map), after checking the matrix is the run's log-probabilities of
    ``split`` in stream order (``batch_size`` 1) and has the run's vocabulary."""
    run = RunDir.open(run_dir)
    vocab_size = len(run.load_vocab())
    matrix = open_matrix(path)
    side = _side_record(path)
    expected = {"kind": "log_prob", "batch_size": 1, "split": split, "which": which}
    for key, value in expected.items():
        if key in side and side[key] != value:
            raise KLError(
                f"{path}: its record says {key}={side[key]!r}; the KL protocol needs "
                f"{key}={value!r} (rewrite the matrix, or change --split / --which)"
            )
    if matrix.shape[1] != vocab_size:
        raise KLError(
            f"{path} has {matrix.shape[1]} columns but run {run_dir} has a vocabulary of "
            f"{vocab_size}; is it the matrix of another run?"
        )
    return {
        "run_dir": str(run_dir),
        "head": run.load_config().head.name,
        "split": split,
        "source": side.get("source"),
        "rows_from": str(path),
        "max_contexts": max_contexts,
        **matrix_pairwise_kl(matrix, n_pairs=n_pairs, seed=seed, max_contexts=max_contexts),
        "protocol": PROTOCOL,
        "numpy": np.__version__,
    }


def _side_record(path: str | os.PathLike) -> dict[str, Any]:
    """The matrix's ``NAME.json`` written beside it, or ``{}`` when there is none."""
    if not Path(path).with_suffix(".json").is_file():
        return {}
    try:
        return matrix_record(path)
    except ValueError as error:
        raise KLError(str(error)) from None


def _cap(n: int, max_contexts: int | None) -> int:
    if max_contexts is not None and max_contexts < 1:
        raise KLError(f"max_contexts must be a positive int or None; got {max_contexts!r}")
    return n if max_contexts is None else min(n, max_contexts)
