"""LM-head spectral saturation: the singular values of the output matrix and the anisotropy
of the hidden states it is applied to, per checkpoint.

Godey, de la Clergerie & Sagot (2024), "Why do small language models underperform? Studying
LM saturation via the softmax bottleneck", track the singular-value spectrum of the LM head
of small Pythia models across training checkpoints: as small models saturate, the head's
spectrum degenerates (a few directions carry most of it) and the last hidden states become
anisotropic (they point the same way). This module measures both, for every checkpoint of a
run (a curve over training) or for a Hugging Face causal LM.

**Which matrix.** Every highrank head decodes with one matrix, ``E = head.weight`` (V x
d_embed; the input embedding when tied), and the spectrum is E's:

* softmax and the pointwise family (SigSoftmax, GSS, PLIF, MLP-softmax): logits ``f(E g' + b)``;
* MoS: each of the K components' logits is ``E h_k + b``: the mixture applies the one shared
  E to K context vectors (its high rank comes from mixing K softmaxes, not from K decoders);
* MoC: ``E (sum_k pi_k h_k) + b``;
* Mixtape: component logits ``l_{k,x} = h_k . w_x`` with ``w_x`` row x of E, mixed per token
  by the gates; the gate vectors ``v_x`` (S x gate_dim) only set the mixing weights.

A Hugging Face model's matrix is its ``lm_head`` weight (V x d), or the E of the highrank
head attached to it (``integrations.hf``). A projection g -> g' before E
(a softmax with d_in != d_embed) is not folded in: the spectrum is the decoder's own.

**What is reported** for the singular values ``s_1 >= ... >= s_r`` (r = min(V, d)):

* ``press_rank`` and the epsilon-effective ranks of :mod:`~highrank.analysis.rank` (smallest
  k holding a ``1 - epsilon`` share of ``sum s_i^2``), and the entropy effective rank of Roy
  & Vetterli (2007), ``exp(H(q))`` with ``q_i = s_i / sum_j s_j``;
* ``top_mass[k]``: the share of the spectrum's **energy** ``sum s_i^2`` (the squared
  Frobenius norm) in the top k directions, ``sum_{i<=k} s_i^2 / sum_i s_i^2``; energy rather
  than ``sum s_i``, so that it agrees with the epsilon-effective ranks;
* ``anisotropy``: the mean cosine similarity over all ordered pairs ``i != j`` of ``n``
  distinct contexts' hidden states (the head's input: ``g`` of a run, the lm_head's input of
  a causal LM). Computed exactly, in float64, by the mean-vector identity: with unit vectors
  ``u_i = h_i / |h_i|``, ``sum_{i != j} u_i . u_j = |sum_i u_i|^2 - n``, so the mean is
  ``(|sum_i u_i|^2 - n) / (n (n - 1))`` in O(n d). Identical states give 1, orthogonal ones
  0; zero vectors (no direction) are left out and counted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from highrank.analysis.contexts import load_run_split
from highrank.analysis.head_inputs import (
    highrank_head,
    iter_causal_lm_head_inputs,
    iter_run_head_inputs,
    output_layer,
)
from highrank.analysis.hf_contexts import hf_tag, load_text_contexts
from highrank.analysis.rank import (
    EFFECTIVE_RANK_EPSILONS,
    effective_rank,
    press_rank_from_singular_values,
    singular_values,
)
from highrank.runs.checkpoint import CHECKPOINT_DIR, CheckpointError, read_run
from highrank.util.progress import progress_note

DEFAULT_TOP_K = (1, 10, 100)
DEFAULT_MAX_CONTEXTS = 4096
MATRIX = "the decoder E = head.weight (V x d_embed) that every component of the head applies"
HF_MATRIX = "the lm_head weight (V x d)"


class SaturationError(ValueError):
    """A matrix, set of hidden states or run the saturation cannot be measured on."""


# ---- the spectrum of a matrix ----------------------------------------------------------------


def entropy_effective_rank(values: np.ndarray) -> float:
    """Roy & Vetterli's effective rank ``exp(-sum q_i log q_i)``, ``q_i = s_i / sum s``."""
    values = np.asarray(values, dtype=np.float64)
    total = values.sum()
    if total <= 0:
        return 0.0
    q = values[values > 0] / total
    return float(np.exp(-(q * np.log(q)).sum()))


def top_mass(values: np.ndarray, ks: Iterable[int]) -> dict[str, float]:
    """``{k: sum_{i<=k} s_i^2 / sum_i s_i^2}`` for each k (values descending; k past the
    number of values gives 1)."""
    energy = np.square(np.asarray(values, dtype=np.float64))
    total = energy.sum()
    cumulative = np.cumsum(energy)
    out = {}
    for k in ks:
        if not isinstance(k, int) or k < 1:
            raise SaturationError(f"top-k sizes must be positive ints; got {k!r}")
        out[str(k)] = float(cumulative[min(k, energy.size) - 1] / total) if total > 0 else 0.0
    return out


def spectrum_record(
    matrix: np.ndarray | torch.Tensor,
    *,
    top_k: Sequence[int] = DEFAULT_TOP_K,
    epsilons: Iterable[float] = EFFECTIVE_RANK_EPSILONS,
) -> dict[str, Any]:
    """Singular values (descending, in the matrix's own dtype), Press and effective ranks and
    the top-k energy shares of a 2-D float ``matrix``."""
    if isinstance(matrix, torch.Tensor):
        matrix = matrix.detach().cpu()
        matrix = matrix.float() if matrix.dtype not in (torch.float32, torch.float64) else matrix
        matrix = matrix.numpy()
    if matrix.ndim != 2 or min(matrix.shape) == 0:
        raise SaturationError(f"expected a non-empty 2-D output matrix (V x d); got {matrix.shape}")
    values = singular_values(matrix)
    return {
        "shape": list(matrix.shape),
        "dtype": str(matrix.dtype),
        "s_max": float(values[0]),
        "s_min": float(values[-1]),
        "press_rank": press_rank_from_singular_values(values, matrix.shape, matrix.dtype),
        "effective_rank": {str(eps): effective_rank(values, eps) for eps in epsilons},
        "entropy_effective_rank": entropy_effective_rank(values),
        "top_mass": top_mass(values, top_k),
        "top_mass_of": "sum of s_i^2 (energy)",
        "singular_values": values.astype(np.float64),
    }


# ---- anisotropy of hidden states -------------------------------------------------------------


class CosineTally:
    """Running ``sum_i u_i`` (float64) of unit hidden states for the mean pairwise cosine."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.n = 0
        self.zero = 0

    def add(self, hidden: torch.Tensor) -> None:
        """Add ``(b, d)`` hidden states (zero rows are counted and left out)."""
        hidden = hidden.detach().double().reshape(-1, hidden.shape[-1])  # (b, d)
        norms = hidden.norm(dim=1)
        keep = norms > 0
        self.zero += int((~keep).sum())
        units = hidden[keep] / norms[keep, None]  # (b', d)
        part = units.sum(dim=0)
        self.total = part if self.total is None else self.total + part
        self.n += int(keep.sum())

    def result(self) -> dict[str, Any]:
        if self.n < 2:
            raise SaturationError(
                f"anisotropy needs at least 2 nonzero hidden states; got {self.n}"
            )
        squared = float(self.total @ self.total)
        mean = (squared - self.n) / (self.n * (self.n - 1))
        return {
            "mean_cosine": mean,
            "n_contexts": self.n,
            "zero_states_skipped": self.zero,
            "hidden_size": int(self.total.numel()),
            "method": "exact, mean-vector identity (|sum u_i|^2 - n) / (n (n - 1)), float64",
        }


def anisotropy(hidden: torch.Tensor | np.ndarray) -> dict[str, Any]:
    """Mean cosine similarity over ordered pairs of distinct rows of ``hidden (n, d)``."""
    tally = CosineTally()
    tally.add(torch.as_tensor(hidden))
    return tally.result()


def anisotropy_of_blocks(blocks: Iterator[tuple[torch.Tensor, Any]]) -> dict[str, Any]:
    """:func:`anisotropy` over ``(hidden (b, d), ...)`` blocks, never holding them all."""
    return context_statistics(blocks, None)["anisotropy"]


# ---- saturated tanh units of the head's contexts ---------------------------------------------

# |tanh(a)| above this: a unit in tanh's flat tails, where its gradient 1 - tanh(a)^2 < 0.0975.
TANH_SATURATED = 0.95


class TanhTally:
    """How many of a head's context-forming tanh units (``OutputHead.tanh_context_inputs``)
    are saturated, and their mean |tanh(a)|, over blocks of head inputs; nothing (None) for a
    head without such units."""

    def __init__(self, head) -> None:
        self.head = head
        self.values = 0
        self.saturated = 0
        self.total_abs = 0.0
        self.units = None

    @torch.no_grad()
    def add(self, g: torch.Tensor) -> None:
        rows = g.reshape(-1, g.shape[-1]).to(self.head.weight.dtype)
        pre = self.head.tanh_context_inputs(rows)  # (b, units), or None
        if pre is None:
            return
        magnitude = torch.tanh(pre.double()).abs()
        self.units = pre.shape[-1]
        self.values += magnitude.numel()
        self.saturated += int((magnitude > TANH_SATURATED).sum())
        self.total_abs += float(magnitude.sum())

    def result(self) -> dict[str, Any] | None:
        if not self.values:
            return None
        return {
            "share_saturated": self.saturated / self.values,
            "mean_abs": self.total_abs / self.values,
            "units": self.units,
            "threshold": TANH_SATURATED,
        }


def context_statistics(blocks: Iterator[tuple[torch.Tensor, Any]], head) -> dict[str, Any]:
    """In one pass over ``(head inputs (b, d), ...)`` blocks: their ``anisotropy`` and, for a
    ``head`` whose contexts are formed by tanh units, ``tanh_contexts`` (the share of those
    units with |tanh(a)| > 0.95 and their mean |tanh(a)|; None for other heads or no head)."""
    cosines = CosineTally()
    tanh = None if head is None else TanhTally(head)
    for hidden, *_ in blocks:
        cosines.add(hidden)
        if tanh is not None:
            tanh.add(hidden)
    saturated = None if tanh is None else tanh.result()
    return {"anisotropy": cosines.result(), "tanh_contexts": saturated}


# ---- runs: every checkpoint ------------------------------------------------------------------


def run_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Every ``.pt`` file in ``RUN_DIR/checkpoints`` (last.pt, last.prev.pt, best.pt, ...)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    files = sorted(folder.glob("*.pt")) if folder.is_dir() else []
    if not files:
        raise CheckpointError(f"{folder} holds no checkpoint (.pt); expected a trained run")
    return files


def checkpoint_step(payload: dict[str, Any]) -> int | None:
    """The optimiser step a checkpoint was saved at, when it says."""
    progress = (payload.get("training") or {}).get("progress") or {}
    step = progress.get("step")
    return int(step) if isinstance(step, int) else None


def analyze_saturation_run(
    run_dir: str | os.PathLike,
    *,
    split: str = "test",
    checkpoints: Sequence[str | os.PathLike] | None = None,
    data_dir: str | os.PathLike | None = None,
    max_contexts: int | None = DEFAULT_MAX_CONTEXTS,
    top_k: Sequence[int] = DEFAULT_TOP_K,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> dict[str, Any]:
    """The saturation of every checkpoint of ``run_dir`` (or of ``checkpoints``: .pt paths),
    ordered by training step (a curve): the spectrum of E and the anisotropy of the head's
    inputs over the first ``max_contexts`` contexts of ``split``."""
    files = [Path(c) for c in checkpoints] if checkpoints else run_checkpoints(run_dir)
    points = []
    for path in files:
        began = time.perf_counter()
        step = checkpoint_step(read_run(run_dir, str(path)).payload)
        loaded = load_run_split(run_dir, split, which=str(path), data_dir=data_dir, device=device)
        head = loaded.model.head
        if progress:
            progress_note(f"{run_dir}: {path.name} (step {step}), {type(head).__name__}")
        point = {
            "checkpoint": path.name,
            "step": step,
            "head": loaded.config.head.name,
            "matrix": MATRIX,
            **spectrum_record(head.weight, top_k=top_k),
        }
        blocks = iter_run_head_inputs(loaded, max_contexts=max_contexts, progress=progress)
        point.update(context_statistics(blocks, head))
        point["seconds"] = round(time.perf_counter() - began, 2)
        points.append(point)
    points.sort(key=lambda p: (p["step"] is None, p["step"] or 0, p["checkpoint"]))
    return {
        "kind": "saturation",
        "run_dir": str(run_dir),
        "split": split,
        "source": loaded.source,
        "max_contexts": max_contexts,
        "definitions": _definitions(),
        "checkpoints": points,
    }


# ---- a causal LM on a text -------------------------------------------------------------------


def analyze_saturation_hf(
    model_path: str | os.PathLike,
    text_path: str | os.PathLike,
    *,
    window: int | None = None,
    bos: bool = False,
    max_contexts: int | None = DEFAULT_MAX_CONTEXTS,
    top_k: Sequence[int] = DEFAULT_TOP_K,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> dict[str, Any]:
    """The saturation of a Hugging Face causal LM: the spectrum of its lm_head weight and the
    anisotropy of the lm_head's inputs over the first ``max_contexts`` contexts of the text."""
    began = time.perf_counter()
    loaded = load_text_contexts(
        model_path, text_path, window=window, bos=bos, device=device, progress=progress
    )
    load_seconds = time.perf_counter() - began
    layer = output_layer(loaded.model, loaded.name)
    own = highrank_head(loaded.model) is not None
    point = {
        "checkpoint": loaded.name,
        "step": None,
        "head": loaded.model.config.head_name if own else "lm_head",
        "matrix": MATRIX if own else HF_MATRIX,
    }
    point.update(spectrum_record(layer.weight, top_k=top_k))
    started = time.perf_counter()
    blocks = iter_causal_lm_head_inputs(loaded, max_contexts=max_contexts, progress=progress)
    point.update(context_statistics(blocks, highrank_head(loaded.model)))
    point["seconds"] = round(time.perf_counter() - started, 2)
    return {
        "kind": "saturation",
        "tag": hf_tag(model_path, text_path, window=window, bos=bos, max_contexts=max_contexts),
        **loaded.record(max_contexts),
        "load_seconds": round(load_seconds, 2),
        "threads": torch.get_num_threads(),
        "definitions": _definitions(),
        "checkpoints": [point],
    }


def _definitions() -> dict[str, str]:
    return {
        "effective_rank": "smallest k with sum_{i<=k} s_i^2 >= (1 - epsilon) sum s_i^2",
        "entropy_effective_rank": "exp(H(q)), q_i = s_i / sum s_j (Roy & Vetterli 2007)",
        "top_mass": "sum_{i<=k} s_i^2 / sum_i s_i^2",
        "anisotropy": "mean cosine similarity over ordered pairs of distinct contexts' head "
        "inputs, exact (mean-vector identity)",
        "tanh_contexts": "heads whose context vectors are formed by tanh units (MoS, MoC, "
        "Mixtape, mlp_softmax): the share of those units with |tanh(a)| > 0.95, and their mean "
        "|tanh(a)|; null for other heads",
    }


def curve_rows(record: dict[str, Any], top_k: Sequence[int] | None = None) -> list[list[Any]]:
    """One table row per checkpoint: name, step, ranks, top-k shares, anisotropy."""
    rows = []
    for point in record["checkpoints"]:
        ks = list(point["top_mass"]) if top_k is None else [str(k) for k in top_k]
        effective = point["effective_rank"]
        rows.append(
            [
                point["checkpoint"],
                point["step"],
                "x".join(str(n) for n in point["shape"]),
                point["press_rank"],
                effective.get("0.001"),
                round(point["entropy_effective_rank"], 1),
                *[round(point["top_mass"][k], 4) for k in ks],
                round(point["anisotropy"]["mean_cosine"], 4),
                point["anisotropy"]["n_contexts"],
                *([_tanh_share(point)] if _has_tanh(record) else []),
            ]
        )
    return rows


def _has_tanh(record: dict[str, Any]) -> bool:
    return any(point.get("tanh_contexts") for point in record["checkpoints"])


def _tanh_share(point: dict[str, Any]) -> float | None:
    share = (point.get("tanh_contexts") or {}).get("share_saturated")
    return None if share is None else round(share, 4)


def curve_headers(record: dict[str, Any]) -> list[str]:
    ks = list(record["checkpoints"][0]["top_mass"])
    return [
        "checkpoint",
        "step",
        "matrix",
        "Press rank",
        "eff. rank 1e-3",
        "entropy rank",
        *[f"top-{k} energy" for k in ks],
        "anisotropy",
        "contexts",
        *(["tanh units saturated"] if _has_tanh(record) else []),
    ]
