"""The output layer's hidden size, recovered from its log-probability matrix alone.

Finlayson, Ren & Swayamdipta (2024), "Logits of API-Protected LLMs Leak Proprietary
Information", and Carlini et al. (2024), "Stealing Part of a Production Language Model"
(Sec. 4): the outputs of a softmax layer with hidden size d span a subspace of dimension about
d, so the singular values of a matrix of many outputs fall off a cliff there; the largest
multiplicative gap s_k / s_(k+1) of the spectrum marks it.

**Which spectrum.** The raw log-probability matrix ``A (contexts x V)`` with
``A[c] = log_softmax(W h_c + b)``, exactly as :mod:`~highrank.analysis.logprob_matrix` writes
it and :mod:`~highrank.analysis.rank` takes its singular values. Row c is
``W h_c + b - lse_c 1``, so the rows lie in span(columns of W, b, 1): rank(A) <= d + 2 with a
bias and d + 1 without (Yang et al., 2018, Sec. 2), and generically equal. The centred-log-ratio
(clr) rows ``A[c] - mean(A[c])`` that Finlayson et al. use remove exactly the direction 1 and
have rank d + 1 / d; they are not used here because (1) the answer only moves by one, (2) a
bias cannot be told from one more hidden unit with a constant value in either spectrum, and (3)
the clr spectrum cannot be had from the singular values that rank records already store, nor
from :func:`~highrank.analysis.rank.streamed_singular_values`, which this module reuses for
matrices on disk. So the knee k of the raw spectrum gives **d = k - 2 with a bias, k - 1
without**, and which of the two is not identifiable from the outputs.

**The knee.** With ``s`` the singular values (descending):

1. ``floor``: the level below which the computed values are rounding noise of the SVD itself
   (in memory, a float64 SVD: ``eps64 * max(m, n) * s_max``, NumPy's ``matrix_rank``
   tolerance; on disk, the Gram matrix's :func:`~highrank.analysis.rank.gram_resolution`).
   Values below it are raised to it, so gaps among noise values count as 1 and cannot win.
2. ``knee = argmax_{k >= 2} c_k / c_(k+1)`` of the floored values c; ``gap`` is that ratio.
   k = 1 is excluded: s_1 carries the mean log-probability level (every entry is about
   -log V), so s_1 / s_2 is large for every model and says nothing about d (measured on
   random MoS and Mixtape heads with d = 8: s_1 / s_2 = 41-240, above every other gap; on
   SmolLM2: 14.9); a model whose matrix has rank 1 ignores its context.
3. A **low-rank knee** exists when ``gap >= min_gap`` (default 100: two orders of magnitude)
   *and* every value after the knee lies at or below the Press threshold of the matrix's own
   dtype (:func:`~highrank.analysis.rank.press_threshold`): the tail is numerically zero.
   Otherwise the record says **no knee**: either the largest gap is small (a smoothly
   decaying spectrum: MoS, Mixtape without gate sharing, SigSoftmax/GSS at their usual
   scales) or values above the Press threshold follow it (a gap inside a high-rank
   spectrum). Only a low-rank knee gives a ``hidden_size``. Mixtape *with* gate sharing has
   an exact knee, but at up to d + 2 + S (S frequent tokens with their own gates; measured
   39 for d = 8, S = 30), far from d + 2: the record says where, and
   :func:`matches_hidden_size` tells it from a softmax's.

Measured on SmolLM2-135M (hidden size 576, no bias), 4,096 WikiText-2 test contexts: a knee
at 577 = d + 1, gap 710x (s_577 = 6.8e-4 s_max against the Gram resolution 9.5e-7 s_max),
the next largest gap 1.7x.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from highrank.analysis.logprob_matrix import npy_layout
from highrank.analysis.output import read_json
from highrank.analysis.rank import (
    analyze_rank,
    gram_resolution,
    press_threshold,
    singular_values,
    streamed_singular_values,
)
from highrank.analysis.rows import RowSource

DEFAULT_MIN_GAP = 100.0
SPECTRUM = "singular values of the raw log-probability matrix (rows not centred)"
TOP_GAPS = 5  # the largest gaps kept in a record, for a reader to judge the knee


class HiddenSizeError(ValueError):
    """A spectrum, matrix or record the hidden size cannot be estimated from."""


# ---- the knee of a spectrum ------------------------------------------------------------------


def spectrum_knee(
    values: np.ndarray,
    *,
    shape: tuple[int, int],
    dtype: np.dtype | torch.dtype | str,
    floor: float,
    min_gap: float = DEFAULT_MIN_GAP,
) -> dict[str, Any]:
    """The knee of singular ``values`` (descending) of a ``shape`` matrix stored as ``dtype``,
    by the module's rule; ``floor`` is the level below which the values are rounding noise.

    Returns a record: ``knee``, ``gap``, ``low_rank_knee``, ``hidden_size`` (``with_bias`` /
    ``without_bias``, or None without a low-rank knee), ``press_rank`` and the numbers behind
    them, and a one-line ``verdict``.
    """
    values = np.asarray(values, dtype=np.float64)
    _check_values(values, min_gap)
    dtype = np.dtype(str(dtype).removeprefix("torch."))
    s_max = float(values[0])
    tau = press_threshold(tuple(shape), s_max, dtype)
    floored = np.maximum(values, floor)
    ratios = floored[:-1] / floored[1:]  # ratios[k - 1] = c_k / c_(k+1)
    knee = 2 + int(np.argmax(ratios[1:]))
    gap = float(ratios[knee - 1])
    tail_above = int(np.count_nonzero(values[knee:] > tau))
    low_rank = gap >= min_gap and tail_above == 0
    largest = np.argsort(ratios[1:], kind="stable")[::-1][:TOP_GAPS] + 2
    return {
        "spectrum": SPECTRUM,
        "shape": [int(n) for n in shape],
        "dtype": str(dtype),
        "n_values": int(values.size),
        "knee": knee,
        "gap": gap,
        "low_rank_knee": bool(low_rank),
        "hidden_size": {"with_bias": knee - 2, "without_bias": knee - 1} if low_rank else None,
        "values_above_press_after_knee": tail_above,
        "press_rank": int(np.count_nonzero(values > tau)),
        "press_threshold": tau,
        "floor": float(floor),
        "min_gap": float(min_gap),
        "level_gap": float(ratios[0]),  # s_1 / s_2, excluded from the search (module note)
        "top_gaps": [[int(k), float(ratios[k - 1])] for k in largest],
        "s_max": s_max,
        "verdict": _verdict(knee, gap, low_rank, tail_above, min_gap),
    }


def _check_values(values: np.ndarray, min_gap: float) -> None:
    if values.ndim != 1 or values.size < 3:
        raise HiddenSizeError(
            f"the knee needs at least 3 singular values (a matrix of at least 3 x 3); got "
            f"{values.size}"
        )
    if not np.isfinite(values).all() or (values < 0).any():
        raise HiddenSizeError("singular values must be finite and >= 0")
    if np.any(np.diff(values) > 0):
        raise HiddenSizeError("singular values must be in descending order")
    if values[0] == 0:
        raise HiddenSizeError("the matrix is zero: it has no spectrum to find a knee in")
    if not min_gap > 1:
        raise HiddenSizeError(f"min_gap must be a number > 1; got {min_gap!r}")


def _verdict(knee: int, gap: float, low_rank: bool, tail_above: int, min_gap: float) -> str:
    if low_rank:
        return (
            f"knee at {knee} (gap {gap:.3g}x, the rest numerically zero): a softmax layer of "
            f"hidden size {knee - 2} with a bias, or {knee - 1} without"
        )
    if gap < min_gap:
        return f"no knee: the largest gap, {gap:.3g}x after value {knee}, is below {min_gap:g}x"
    return (
        f"no knee: the largest gap ({gap:.3g}x after value {knee}) is followed by {tail_above} "
        "values above the Press threshold (a high-rank spectrum)"
    )


def matches_hidden_size(result: dict[str, Any], d: int) -> bool:
    """Whether ``result`` found the knee a softmax layer of hidden size ``d`` has: a
    low-rank knee at d + 1 (no bias) or d + 2 (bias)."""
    return bool(result["low_rank_knee"]) and result["knee"] in (d + 1, d + 2)


# ---- sources: a matrix in memory, a .npy on disk, a rank record -------------------------------


def estimate_hidden_size(
    matrix: np.ndarray | torch.Tensor, *, min_gap: float = DEFAULT_MIN_GAP
) -> dict[str, Any]:
    """The knee of a log-prob ``matrix (contexts, V)`` in memory; its singular values are
    computed in float64 whatever its dtype (so a float32 matrix's rounding noise lies far
    above the SVD's own), and its Press threshold uses its own dtype."""
    if isinstance(matrix, torch.Tensor):
        matrix = matrix.detach().cpu().numpy()
    matrix = np.asarray(matrix)
    if matrix.ndim != 2 or matrix.dtype not in (np.float32, np.float64):
        raise HiddenSizeError(
            f"expected a 2-D float32 or float64 matrix (contexts, vocabulary); got "
            f"{matrix.dtype} of shape {matrix.shape}"
        )
    if not np.isfinite(matrix).all():
        raise HiddenSizeError("the matrix holds NaN or infinite entries")
    values = singular_values(matrix.astype(np.float64))
    floor = float(values[0]) * max(matrix.shape) * np.finfo(np.float64).eps
    return spectrum_knee(
        values, shape=matrix.shape, dtype=matrix.dtype, floor=floor, min_gap=min_gap
    )


def estimate_hidden_size_file(
    path: str | os.PathLike, *, min_gap: float = DEFAULT_MIN_GAP, **gram_options
) -> dict[str, Any]:
    """The knee of the log-prob matrix in the ``.npy`` at ``path``. A float32 matrix is
    streamed through :func:`~highrank.analysis.rank.streamed_singular_values` (its
    ``gram_options``: block_rows, backend, device, state_dir, progress), never held whole; a
    float64 one is read into memory (:func:`estimate_hidden_size`)."""
    try:
        shape, dtype, _ = npy_layout(path)
    except (FileNotFoundError, ValueError) as error:
        raise HiddenSizeError(str(error)) from None
    if len(shape) != 2:
        raise HiddenSizeError(f"{path} holds an array of shape {shape}; expected a 2-D matrix")
    if dtype == np.float64:
        return {**estimate_hidden_size(np.load(path), min_gap=min_gap), "source": str(path)}
    values = streamed_singular_values(path, **gram_options)
    floor = gram_resolution(min(shape), float(values[0]))
    result = spectrum_knee(values, shape=shape, dtype=dtype, floor=floor, min_gap=min_gap)
    return {**result, "source": str(path)}


def estimate_from_rank_record(
    path: str | os.PathLike, *, min_gap: float = DEFAULT_MIN_GAP
) -> dict[str, Any]:
    """The knee of the singular values a rank record (``highrank analyze rank``) saved: its
    ``singular_values_file`` (beside the record, or in ``RUN_DIR/analysis``) or an inline
    ``singular_values`` list; floor = its ``resolution`` (Gram) or, without one, the
    ``matrix_rank`` tolerance of its own dtype."""
    path = Path(path)
    record = read_json(path)
    for key in ("shape", "dtype"):
        if key not in record:
            raise HiddenSizeError(f"{path} has no {key!r}: is it a rank record?")
    values = _record_values(record, path)
    shape = tuple(record["shape"])
    if "resolution" in record:
        floor = float(record["resolution"])
    else:
        floor = float(values[0]) * max(shape) * np.finfo(np.dtype(record["dtype"])).eps
    result = spectrum_knee(values, shape=shape, dtype=record["dtype"], floor=floor, min_gap=min_gap)
    return {**_head_caveat(result, record.get("head")), "source": str(path),
            "head": record.get("head")}


# highrank's heads whose log-prob matrix is not a softmax layer's (MoC's is: its mixed context
# feeds one softmax). A Hugging Face model's own lm_head, named by its class, is a softmax layer.
NOT_SOFTMAX_HEADS = ("mos", "mixtape", "sigsoftmax", "gss", "plif", "mfs", "cpr")


def _head_caveat(result: dict[str, Any], head: str | None) -> dict[str, Any]:
    """A knee in the matrix of a head that is not a softmax layer is not read as a hidden size
    (``hidden_size`` None, the verdict says why): Mixtape with gate sharing has one at up to
    d + 2 + S."""
    if head not in NOT_SOFTMAX_HEADS or not result["low_rank_knee"]:
        return result
    caveat = (f"; but the head is {head}, not a softmax layer: its knee is not read as a hidden "
              "size (Mixtape with gate sharing has one at up to d + 2 + S, S the tokens with "
              "their own gates)")
    return {**result, "hidden_size": None, "verdict": result["verdict"] + caveat}


def _record_values(record: dict[str, Any], path: Path) -> np.ndarray:
    if "singular_values" in record:
        return np.asarray(record["singular_values"], dtype=np.float64)
    if "singular_values_file" not in record:
        raise HiddenSizeError(
            f"{path} has neither 'singular_values' nor 'singular_values_file': is it a rank record?"
        )
    name = record["singular_values_file"]
    places = [path.parent / name]
    if "run_dir" in record:
        places.append(Path(record["run_dir"]) / "analysis" / name)
    for place in places:
        if place.is_file():
            return np.load(place)
    raise HiddenSizeError(
        f"{path} names singular values {name!r}, found in none of {', '.join(map(str, places))}"
    )


# ---- runs: the rank machinery, then the knee -------------------------------------------------


def analyze_hidden_size(
    source: RowSource,
    *,
    min_gap: float = DEFAULT_MIN_GAP,
    max_contexts: int | None = None,
    out: str | os.PathLike | None = None,
    **rank_options: Any,
) -> dict[str, Any]:
    """The knee of the log-prob matrix of a :class:`~highrank.analysis.rows.RowSource`: its
    rank record (:func:`~highrank.analysis.rank.analyze_rank`, in the source's folder: ``out``
    for a causal LM) is reused when it is current (a run's, computed from the present
    checkpoint file with the same split, contexts and corpus) and computed (and kept)
    otherwise; ``rank_options`` as :func:`~highrank.analysis.rank.analyze_rank` takes them.
    A run's record adds the head's configured ``d_embed`` and whether the knee matches it
    (:func:`matches_hidden_size`)."""
    # a run's config first: a folder that is no run gets the clear error of RunDir.open
    d_embed = source.configured_d_embed() if source.kind == "run" else None
    source.check()
    tag = source.tag(max_contexts=max_contexts, batch_size=rank_options.get("batch_size", 1),
                     bptt=rank_options.get("bptt"))
    rank_path = source.folder(out) / f"rank-{tag}.json"
    settings = source.matrix_settings(
        kind="log_prob",
        batch_size=rank_options.get("batch_size", 1),
        bptt=rank_options.get("bptt"),
        max_contexts=max_contexts,
    )
    if not (rank_path.is_file() and source.record_matches(read_json(rank_path), settings)):
        analyze_rank(source, max_contexts=max_contexts, out=out, **rank_options)
    result = estimate_from_rank_record(rank_path, min_gap=min_gap)
    if source.kind != "run":
        return {**result, "model": str(Path(source.name).resolve()), "hf_tag": tag}
    return {
        **result,
        "run_dir": source.name,
        "tag": tag,
        "head_d_embed": d_embed,
        "matches_d_embed": matches_hidden_size(result, d_embed),
    }


def analyze_run(run_dir: str | os.PathLike, *, min_gap: float = DEFAULT_MIN_GAP, **rank_options):
    """:func:`analyze_hidden_size` of a trained run (``split``, ``which``, ``data_dir`` pick
    its rows; the other ``rank_options`` as :func:`~highrank.analysis.rank.analyze_rank`)."""
    source = RowSource.from_run(
        run_dir,
        rank_options.pop("split", "test"),
        which=rank_options.pop("which", "best"),
        data_dir=rank_options.pop("data_dir", None),
        device=rank_options.get("device", "cpu"),
    )
    return analyze_hidden_size(source, min_gap=min_gap, **rank_options)
