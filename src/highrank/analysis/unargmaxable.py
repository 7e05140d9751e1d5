"""Unargmaxable tokens of a softmax-family output layer (Grivas, Bogoychev & Lopez, ACL 2022,
"Low-Rank Softmax Can Have Unargmaxable Classes in Theory but Rarely in Practice").

A layer with weights W (V x d), rows w_i, and bias b scores token i by z_i = w_i . h + b_i.
Token i is **argmaxable** when some hidden state h in the domain D makes it the strict argmax:

    (w_i - w_j) . h + (b_i - b_j) > 0   for every j != i.

Otherwise no hidden state ever makes the model predict it greedily. Without a bias, i is
argmaxable on D = R^d exactly when w_i is a vertex of the convex hull of the rows; a row
strictly inside the hull (or on a face) can at best tie.

**The domain.** ``radius=R`` (default 100, the bound of Grivas et al.'s code): the box
``|h_k| <= R``, hidden states of bounded size, as a trained model produces (an LSTM's output
lies in ``[-1, 1]^d``, so R = 1 is exact for AWD-LSTM runs without a projection).
``radius=None``: all of R^d ("unbounded": is there *any* hidden state?); the LP is then
homogenised (below), which changes nothing about the answer.

**How, per token, cheapest first** (every "argmaxable" comes with a witness h, checked):

1. *Duplicates*: a row equal to another row with a bias at least as large can never win
   (it ties or loses); such tokens are settled without search.
2. *Candidate witness*: h = Σ^{-1} (w_i - μ) (μ, Σ the mean and covariance of the rows, a
   little ridge added), scaled so that max_k |h_k| = R. In whitened coordinates this is the
   point itself, which wins for a vertex of a roughly isotropic cloud; plain h = w_i fails
   for 90% of SmolLM2's tokens, whose embeddings share a common direction (measured).
3. *Braid reflection* (Grivas et al.'s approximate algorithm): while some j beats i at h,
   reflect h across the hyperplane (w_i - w_j) . h + b_i - b_j = 0 (then back into the box).
4. *Linear program* (SciPy's HiGHS, ``scipy.optimize.linprog(method="highs")``), the
   Chebyshev-centre form of Grivas et al.: maximise r over (h, s, r) subject to

       (w_j - w_i) . h / n_j + (b_j - b_i) s / n_j + r <= 0,   n_j = ||w_j - w_i||,

   with s = 1 and h in the box, so that r is the radius of the largest ball around h in
   which i still wins (a distance in hidden-state units). On R^d the problem is homogenised
   instead: h in the unit cube and s in [0, 1] (h / s is then a witness, and s = 0 means i
   wins far out along h, where the bias no longer counts), which keeps the LP bounded and
   well scaled (free h with a capped r took HiGHS 270 s per SmolLM2 token; measured).
   Token i is argmaxable iff r* > 0. Solved with **cutting planes**:
   start from the 256 strongest competitors at the last candidate point, add the 256 most
   violated constraints of all V - 1 after each solve, stop when the solution's h is a
   verified witness or when r* <= ``LP_RADIUS_TOLERANCE`` (1e-6): a subset of constraints is
   a relaxation, so its optimum bounds the full one from above, and r* <= 1e-6 on a subset
   proves that the region of i holds no ball of radius 1e-6 (HiGHS's feasibility tolerance
   is 1e-7; Grivas et al. demand a radius of at least 1e-8). Such tokens are reported
   unargmaxable: at best they win inside a sliver no float32 logit can resolve.

**Witnesses are verified, so no step ever calls an unargmaxable token argmaxable.** The
margin z_i - max_{j != i} z_j at h is computed in float32 and accepted only if it exceeds
twice the rounding bound of a float32 dot product of length d + 3, γ_{d+3} (max_j ||w_j||
||h|| + max |b|) (Higham, *Accuracy and Stability of Numerical Algorithms*, Eq. 3.5, valid
for any summation order); rows within the bound are recomputed in float64 and judged against
the float64 bound; h must also lie in the box. A token is *undecided* when the LP ends with
neither verdict (r* > 1e-6 but no verified witness, or a solver failure); the report counts
them.

Measured on SmolLM2-135M-Instruct (the Q4_1 .gguf, V = 49,152, d = 576, no bias, box 100):
49,085 tokens have a candidate witness, 50 more a reflected one, 2 an LP witness, and the 15
unargmaxable tokens are exactly the rows shared by several tokens (4 groups of 2, 2, 4 and 7
tokens, among them 11 special tokens such as ``<file_sep>``): they can only tie.

**Heads other than softmax.**

* SigSoftmax, GSS, LMS-PLIF: log p = log_softmax(f(z)) with f strictly increasing, and a
  strictly increasing f keeps the order of the logits, so argmax_x f(z_x) = argmax_x z_x for
  every h: **exactly softmax's argmax set** of the same W, b.
* MoC: one softmax over the mixed context Σ_k π_k tanh(...), which lies in [-1, 1]^d: tokens
  unargmaxable in the box R = 1 are unargmaxable for MoC.
* MoS: p = Σ_k π_k softmax(W h_k + b). If i is unargmaxable for softmax on R^d, Motzkin's
  transposition theorem gives λ >= 0, Σ λ_j = 1, with w_i = Σ_j λ_j w_j and
  b_i <= Σ_j λ_j b_j. Then z_i <= Σ_j λ_j z_j in every component, so
  p_k(i) <= Π_j p_k(j)^λ_j <= Σ_j λ_j p_k(j) (weighted AM-GM), and mixing,
  p(i) <= Σ_j λ_j p(j) <= max_j p(j): **MoS cannot make such a token the strict argmax**
  either. Its tokens unargmaxable on R^d (``radius=None``) are unargmaxable for MoS.
* Mixtape: each frequent token x mixes its own context, z_x = w_x . (Σ_k π_{x,k} h_k) + b_x,
  so W and b do not decide it: a token strictly inside the hull *can* be Mixtape's argmax
  (tests/analysis/test_unargmaxable.py finds such a head and input by
  :func:`search_argmax_input`). No analysis from W, b is offered for it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from highrank.causal_lm import load_causal_lm
from highrank.models import load_run

DEFAULT_RADIUS = 100.0
DEFAULT_PATIENCE = 10  # braid reflections per token before the LP
LP_RADIUS_TOLERANCE = 1e-6  # r* at or below this: unargmaxable (module docstring, step 4)
LP_FIRST_ROWS = 256  # constraints of the first LP of a token: its strongest competitors
LP_ADDED_ROWS = 256  # most violated constraints added after each LP solve
LP_MAX_ROUNDS = 60
LP_FEASIBILITY = 1e-9  # a normalised constraint violated by more than this is added
UNBOUNDED_SCALE = 100.0  # size of candidate witnesses when the domain is all of R^d
BLOCK_TOKENS = 1024  # candidate points scored at once: (1024, V) float32 logits

# Per-token outcome codes of ArgmaxReport.status.
CANDIDATE, REFLECTION, LP_WITNESS, DUPLICATE, LP_BOUND, UNDECIDED = range(6)
STATUS_NAMES = ("candidate", "reflection", "lp-witness", "duplicate", "lp-bound", "undecided")
ARGMAXABLE_CODES = (CANDIDATE, REFLECTION, LP_WITNESS)
UNARGMAXABLE_CODES = (DUPLICATE, LP_BOUND)


@dataclass
class ArgmaxReport:
    """The outcome for every token of a layer.

    Attributes:
        status: ``(V,)`` int8, a code of :data:`STATUS_NAMES` per token: argmaxable by a
            verified witness (candidate, reflection, lp-witness), unargmaxable (duplicate,
            lp-bound), or undecided.
        radius: the box half-width R, or None for all of R^d.
        lp_radius: token -> the LP's optimal radius r* (last solve), for tokens that reached it.
        seconds: time of each step.
        witnesses: ``(V, d)`` float64 witnesses (NaN rows where none), when asked for.
    """

    status: np.ndarray
    radius: float | None
    lp_radius: dict[int, float] = field(default_factory=dict)
    lp_rounds: dict[int, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    witnesses: np.ndarray | None = None

    @property
    def argmaxable(self) -> np.ndarray:
        """``(V,)`` bool: a verified witness exists."""
        return np.isin(self.status, ARGMAXABLE_CODES)

    @property
    def unargmaxable(self) -> np.ndarray:
        """Sorted ids of the tokens proved unargmaxable (duplicates and LP bounds)."""
        return np.flatnonzero(np.isin(self.status, UNARGMAXABLE_CODES))

    @property
    def undecided(self) -> np.ndarray:
        return np.flatnonzero(self.status == UNDECIDED)

    def counts(self) -> dict[str, int]:
        return {name: int(np.sum(self.status == code)) for code, name in enumerate(STATUS_NAMES)}


class UnargmaxableError(ValueError):
    """A layer (or head, or model) this analysis cannot take."""


# ---- the layer ---------------------------------------------------------------------------------


class _Layer:
    """W and b as float32 (torch, for the bulk scoring) and float64 (numpy, for exact checks),
    with the norms the rounding bounds need."""

    def __init__(self, weight, bias) -> None:
        w64 = _as_float64(weight, "weight")
        if w64.ndim != 2 or w64.shape[0] < 2 or w64.shape[1] < 1:
            raise UnargmaxableError(f"weight must be (V, d) with V >= 2; got shape {w64.shape}")
        b64 = np.zeros(w64.shape[0]) if bias is None else _as_float64(bias, "bias")
        if b64.shape != (w64.shape[0],):
            raise UnargmaxableError(
                f"bias must have shape ({w64.shape[0]},) to match weight {w64.shape}; got "
                f"{b64.shape}"
            )
        self.w64, self.b64 = w64, b64
        self.w32 = torch.from_numpy(w64.astype(np.float32))
        self.b32 = torch.from_numpy(b64.astype(np.float32))
        self.vocab_size, self.dim = w64.shape
        self.max_row_norm = float(np.linalg.norm(w64, axis=1).max())
        self.max_abs_bias = float(np.abs(b64).max())


def _as_float64(values, name: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().double().numpy()
    array = np.asarray(values, dtype=np.float64)
    if not np.isfinite(array).all():
        raise UnargmaxableError(f"{name} holds NaN or infinite entries")
    return array


# ---- verified witnesses ------------------------------------------------------------------------


def _gamma(n: int, unit_roundoff: float) -> float:
    """Higham's γ_n = n u / (1 - n u): the relative error bound of an n-term dot product."""
    return n * unit_roundoff / (1.0 - n * unit_roundoff)


def verify_witnesses(
    layer: _Layer, tokens: np.ndarray, points: np.ndarray, radius: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(verified (n,) bool, margins (n,))``: whether ``points[k]`` makes ``tokens[k]`` the
    strict argmax of ``W h + b`` in exact arithmetic, and inside the box (module docstring).
    Margins are z_i - max_{j != i} z_j as computed (float32, or float64 where rechecked)."""
    points = np.asarray(points, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    verified = np.zeros(len(tokens), dtype=bool)
    margins = np.full(len(tokens), -np.inf)
    for start in range(0, len(tokens), BLOCK_TOKENS):
        part = slice(start, start + BLOCK_TOKENS)
        verified[part], margins[part] = _verify_block(layer, tokens[part], points[part])
    if radius is not None:  # the judged h is the float32 one (see _verify_block)
        verified &= np.abs(points.astype(np.float32)).max(axis=1) <= radius
    return verified, margins


def _verify_block(layer: _Layer, tokens: np.ndarray, points: np.ndarray):
    margin32 = _margins32(layer, tokens, torch.from_numpy(points.astype(np.float32)))
    # Each float32 logit is within `bound` of the exact value for the float32-rounded h; the
    # h that is judged is the float32 one (points rounded), so it is also the witness.
    h32 = points.astype(np.float32).astype(np.float64)
    bound32 = _gamma(layer.dim + 3, 2.0**-24) * _scale(layer, h32)
    verified = margin32 > 2.001 * bound32
    margins = margin32.copy()
    unsure = np.flatnonzero(np.abs(margin32) <= 2.001 * bound32)
    for k in unsure:  # few: recompute in float64 and judge against the float64 bound
        margin64 = _margin64(layer, int(tokens[k]), h32[k])
        bound64 = _gamma(layer.dim + 3, 2.0**-53) * _scale(layer, h32[k : k + 1])[0]
        verified[k], margins[k] = margin64 > 2.001 * bound64, margin64
    return verified, margins


def _scale(layer: _Layer, points: np.ndarray) -> np.ndarray:
    """``max_j ||w_j|| ||h|| + max |b|`` per point: what the rounding error is relative to."""
    return layer.max_row_norm * np.linalg.norm(points, axis=1) + layer.max_abs_bias


def _margins32(layer: _Layer, tokens: np.ndarray, points: torch.Tensor) -> np.ndarray:
    """z_i - max_{j != i} z_j of each (token, point), float32: ``(n,)``."""
    rows = torch.arange(len(tokens))
    index = torch.from_numpy(tokens)
    with torch.no_grad():
        logits = torch.addmm(layer.b32, points, layer.w32.t())  # (n, V)
        own = logits[rows, index].clone()
        logits[rows, index] = -torch.inf
        best_other = logits.max(dim=1).values
    return (own - best_other).double().numpy()


def _margin64(layer: _Layer, token: int, point: np.ndarray) -> float:
    logits = layer.w64 @ point + layer.b64  # (V,)
    own = logits[token]
    logits[token] = -np.inf
    return float(own - logits.max())


# ---- steps 1-3: duplicates, candidate witnesses, braid reflections ------------------------


def duplicate_losers(layer: _Layer) -> np.ndarray:
    """Ids whose row equals another row with a bias at least as large (module step 1)."""
    rows = np.ascontiguousarray(layer.w64 + 0.0)  # + 0.0 turns -0.0 into 0.0
    keys = rows.view(np.dtype((np.void, rows.dtype.itemsize * layer.dim))).ravel()
    _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    losers = []
    for group in np.flatnonzero(counts > 1):
        members = np.flatnonzero(inverse == group)
        best = layer.b64[members].max()
        winners = members[layer.b64[members] == best]
        losers.extend(members if len(winners) > 1 else members[members != winners[0]])
    return np.array(sorted(losers), dtype=np.int64)


def candidate_points(layer: _Layer, tokens: np.ndarray, scale: float) -> np.ndarray:
    """``(n, d)`` whitened candidates Σ^{-1}(w_i - μ), scaled to max-abs ``scale`` (step 2);
    Σ is factorised once, the tokens solved for all at once."""
    from scipy.linalg import cho_factor, cho_solve

    mean = layer.w64.mean(axis=0)
    centred = layer.w64 - mean  # (V, d)
    covariance = centred.T @ centred / layer.vocab_size
    ridge = 1e-6 * max(np.trace(covariance) / layer.dim, np.finfo(np.float64).tiny)
    covariance[np.diag_indices_from(covariance)] += ridge
    points = cho_solve(cho_factor(covariance), centred[tokens].T).T  # (n, d)
    return _fit(points, scale)


def _fit(points: np.ndarray, scale: float) -> np.ndarray:
    """Each row scaled to max-abs ``scale`` (a zero row stays zero)."""
    size = np.abs(points).max(axis=1, keepdims=True)
    return points * np.where(size > 0, scale / np.where(size > 0, size, 1.0), 1.0)


def reflect(layer: _Layer, tokens: np.ndarray, points: np.ndarray) -> np.ndarray:
    """One braid reflection of each point across the hyperplane between its token i and the
    token j that currently scores highest: h - 2 ((w_i - w_j).h + b_i - b_j) / n^2 (w_i - w_j)
    (Grivas et al.'s ``swap``); a point where i already wins is returned unchanged."""
    with torch.no_grad():
        logits = torch.addmm(layer.b32, torch.from_numpy(points.astype(np.float32)), layer.w32.t())
        logits[torch.arange(len(tokens)), torch.from_numpy(tokens)] = -torch.inf
        rival = logits.argmax(dim=1).numpy()  # (n,) the best other token
    normal = layer.w64[tokens] - layer.w64[rival]  # (n, d)
    offset = layer.b64[tokens] - layer.b64[rival]
    side = np.einsum("nd,nd->n", normal, points) + offset  # < 0 where the rival wins
    norm2 = np.einsum("nd,nd->n", normal, normal)
    step = np.where((side < 0) & (norm2 > 0), 2.0 * side / np.where(norm2 > 0, norm2, 1.0), 0.0)
    return points - step[:, None] * normal


def precheck(
    layer: _Layer,
    tokens: np.ndarray,
    radius: float | None,
    *,
    patience: int = DEFAULT_PATIENCE,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps 2-3 for ``tokens``: ``(found (n,) bool, how (n,) status codes, points (n, d))``;
    ``points[k]`` is a verified witness where ``found[k]``, else the last point tried."""
    scale = UNBOUNDED_SCALE if radius is None else radius
    points = candidate_points(layer, tokens, scale)  # (n, d)
    found = np.zeros(len(tokens), dtype=bool)
    bar = tqdm(total=len(tokens), desc="candidate witnesses", unit="tok", disable=not progress)
    with bar:
        for start in range(0, len(tokens), BLOCK_TOKENS):
            part = slice(start, start + BLOCK_TOKENS)
            found[part], _ = verify_witnesses(layer, tokens[part], points[part], radius)
            bar.update(len(points[part]))
    how = np.where(found, CANDIDATE, UNDECIDED).astype(np.int8)
    for _ in range(patience):
        left = np.flatnonzero(~found)
        if len(left) == 0:
            break
        moved = reflect(layer, tokens[left], points[left])
        if radius is not None:  # back into the box, along the ray to the origin
            over = np.abs(moved).max(axis=1) > radius
            moved[over] = _fit(moved[over], radius)
        points[left] = moved
        ok, _ = verify_witnesses(layer, tokens[left], moved, radius)
        found[left[ok]] = True
        how[left[ok]] = REFLECTION
    return found, how, points


# ---- step 4: the Chebyshev-centre LP with cutting planes ------------------------------------


@dataclass
class LPOutcome:
    status: int  # LP_WITNESS, LP_BOUND or UNDECIDED
    radius: float  # r* of the last solve (nan if none)
    rounds: int
    point: np.ndarray  # the last LP solution's h
    message: str = ""


def lp_token(
    layer: _Layer,
    token: int,
    start: np.ndarray,
    radius: float | None,
    *,
    skip: np.ndarray | None = None,
) -> LPOutcome:
    """Step 4 for one token, from the point ``start`` (its strongest competitors there seed
    the constraint set). ``skip``: tokens with the same row and a lower bias (their
    constraints hold everywhere, and a zero row cannot be normalised)."""
    from scipy.optimize import linprog

    w_i, b_i = layer.w64[token], layer.b64[token]
    others = np.ones(layer.vocab_size, dtype=bool)
    others[token] = False
    if skip is not None:
        others[skip] = False
    norms = np.linalg.norm(layer.w64 - w_i, axis=1)  # (V,) n_j = ||w_j - w_i||
    others &= norms > 0
    candidates = np.flatnonzero(others)
    if len(candidates) == 0:  # every other row equals w_i with a lower bias: always wins
        return _settle(layer, token, np.zeros(layer.dim), radius, np.inf, 0)
    scores = (layer.w64 @ start + layer.b64)[candidates]
    active = candidates[np.argsort(scores)[::-1][:LP_FIRST_ROWS]]
    # Variables (h, s, r); s multiplies the bias: s = 1 in a box, s in [0, 1] with h in the
    # unit cube for R^d (the homogenised problem, module step 4).
    box = (-radius, radius) if radius is not None else (-1.0, 1.0)
    bounds = [box] * layer.dim + [(1.0, 1.0) if radius is not None else (0.0, 1.0), (None, None)]
    objective = np.zeros(layer.dim + 2)
    objective[-1] = -1.0  # maximise r
    point, best = start, math.nan
    for round_ in range(1, LP_MAX_ROUNDS + 1):
        scale = norms[active, None]
        matrix = np.hstack(
            [
                (layer.w64[active] - w_i) / scale,
                (layer.b64[active, None] - b_i) / scale,
                np.ones((len(active), 1)),
            ]
        )
        result = linprog(
            objective, A_ub=matrix, b_ub=np.zeros(len(active)), bounds=bounds, method="highs"
        )
        if result.status != 0:
            return LPOutcome(UNDECIDED, best, round_, point, f"HiGHS: {result.message}")
        # HiGHS may overshoot a bound by its tolerance (1e-7): back into the box.
        h, weight_of_bias = np.clip(result.x[:-2], *box), float(np.clip(result.x[-2], 0, 1))
        best = float(result.x[-1])
        point = h
        if best <= LP_RADIUS_TOLERANCE:
            return LPOutcome(LP_BOUND, best, round_, point)
        for candidate in _lp_witnesses(h, weight_of_bias, radius):
            ok, _ = verify_witnesses(layer, np.array([token]), candidate[None, :], radius)
            if ok[0]:
                return LPOutcome(LP_WITNESS, best, round_, candidate)
        # Normalised violation of every constraint: ((z_j + s b_j) - (z_i + s b_i)) / n_j + r.
        logits = layer.w64 @ h + weight_of_bias * layer.b64  # (V,)
        violation = (logits[candidates] - logits[token]) / norms[candidates] + best
        violated = np.flatnonzero(violation > LP_FEASIBILITY)
        violated = violated[np.argsort(violation[violated])[::-1][:LP_ADDED_ROWS]]
        new = np.setdiff1d(candidates[violated], active)
        if len(new) == 0:  # the LP optimum satisfies every constraint, yet h is no witness
            return LPOutcome(UNDECIDED, best, round_, point, "optimum found but not verified")
        active = np.concatenate([active, new])
    return LPOutcome(UNDECIDED, best, LP_MAX_ROUNDS, point, "too many cutting-plane rounds")


def _lp_witnesses(h: np.ndarray, s: float, radius: float | None) -> list[np.ndarray]:
    """Hidden states to verify from an LP solution: h itself in a box; on R^d, h / s (the
    homogenised solution's point) and, where s is (near) 0 (i wins only far out, where the
    bias no longer matters), h scaled by 10^2 .. 10^8."""
    if radius is not None:
        return [h]
    scaled = [h * 10.0**k for k in range(2, 9, 2)]
    return ([h / s] if s > 0 else []) + scaled


def _settle(layer, token, point, radius, r, rounds) -> LPOutcome:
    ok, _ = verify_witnesses(layer, np.array([token]), point[None, :], radius)
    return LPOutcome(LP_WITNESS if ok[0] else UNDECIDED, r, rounds, point)


# ---- the whole analysis ------------------------------------------------------------------------


def find_unargmaxable(
    weight: np.ndarray | torch.Tensor,
    bias: np.ndarray | torch.Tensor | None = None,
    *,
    radius: float | None = DEFAULT_RADIUS,
    patience: int = DEFAULT_PATIENCE,
    keep_witnesses: bool = False,
    progress: bool = False,
) -> ArgmaxReport:
    """Every token of the layer ``W (V, d)``, ``b (V,)`` (None: no bias) classified as the
    module docstring says, on the box ``|h_k| <= radius`` (None: all of R^d)."""
    if radius is not None and not (isinstance(radius, int | float) and 0 < radius < math.inf):
        raise UnargmaxableError(f"radius must be a positive finite number or None; got {radius!r}")
    layer = _Layer(weight, bias)
    status = np.full(layer.vocab_size, UNDECIDED, dtype=np.int8)
    seconds: dict[str, float] = {}
    began = time.perf_counter()
    losers = duplicate_losers(layer)
    status[losers] = DUPLICATE
    seconds["duplicates"] = time.perf_counter() - began

    began = time.perf_counter()
    tokens = np.flatnonzero(status == UNDECIDED)
    found, how, points = precheck(layer, tokens, radius, patience=patience, progress=progress)
    status[tokens] = how
    seconds["precheck"] = time.perf_counter() - began
    witnesses = np.full((layer.vocab_size, layer.dim), np.nan) if keep_witnesses else None
    if witnesses is not None:
        witnesses[tokens[found]] = points[found].astype(np.float32)  # the verified h

    began = time.perf_counter()
    report = ArgmaxReport(status, radius, seconds=seconds, witnesses=witnesses)
    rest = np.flatnonzero(~found)
    for k in tqdm(rest, desc="linear programs", unit="tok", disable=not progress):
        token = int(tokens[k])
        outcome = lp_token(layer, token, points[k], radius, skip=_twins(layer, token))
        status[token] = outcome.status
        report.lp_radius[token], report.lp_rounds[token] = outcome.radius, outcome.rounds
        if witnesses is not None and outcome.status == LP_WITNESS:
            witnesses[token] = outcome.point.astype(np.float32)
    seconds["lp"] = time.perf_counter() - began
    return report


def _twins(layer: _Layer, token: int) -> np.ndarray:
    """Tokens whose row equals ``token``'s (only duplicates' leaders have any)."""
    same = np.flatnonzero((layer.w64 == layer.w64[token]).all(axis=1))
    return same[same != token]


# ---- search through any head: is token i its argmax for some input? ---------------------------


def search_argmax_input(
    head: torch.nn.Module,
    token: int,
    *,
    d_in: int,
    train_head: bool = False,
    steps: int = 2000,
    restarts: int = 8,
    lr: float = 0.05,
    seed: int = 0,
) -> tuple[torch.Tensor | None, float]:
    """Look for an input g (and, with ``train_head``, parameters of ``head`` other than its
    decoder ``weight`` and ``bias``, which stay fixed) that makes ``token`` the strict argmax
    of ``head.log_prob(g)``: Adam on the margin log p_i - max_{j != i} log p_j from
    ``restarts`` random starts. Returns ``(g, margin)``: g (float64) where the margin,
    recomputed in float64 with the head in eval mode, is > 0, else ``(None, best margin)``.

    A search, not a proof: a failure shows nothing by itself (for softmax and MoS the module
    docstring proves it), a success is an exact example. The head is left in float64 eval
    mode, with ``train_head`` holding the parameters of the last start (the example's when
    one is found)."""
    generator = torch.Generator().manual_seed(seed)
    best = -math.inf
    original = {name: p.detach().clone() for name, p in head.named_parameters()}
    for _ in range(restarts):
        with torch.no_grad():
            for name, parameter in head.named_parameters():
                parameter.copy_(original[name])
        g = torch.randn(1, d_in, generator=generator, dtype=torch.float64, requires_grad=True)
        trained = [p for n, p in head.named_parameters() if n not in ("weight", "bias")]
        optimizer = torch.optim.Adam([g, *trained] if train_head else [g], lr=lr)
        head.double().eval()
        for _ in range(steps):
            margin = _head_margin(head, g, token)
            if margin.item() > 0:
                break
            optimizer.zero_grad()
            (-margin).backward()
            optimizer.step()
        with torch.no_grad():
            final = _head_margin(head, g, token).item()
        if final > 0:
            return g.detach(), final
        best = max(best, final)
    return None, best


def _head_margin(head: torch.nn.Module, g: torch.Tensor, token: int) -> torch.Tensor:
    log_p = head.log_prob(g)[0]  # (V,)
    others = torch.cat([log_p[:token], log_p[token + 1 :]])
    return log_p[token] - others.max()


# ---- what is analysed for a head -----------------------------------------------------------------

# head name -> (domain override or None for the user's, what the result means)
HEAD_SCOPE: dict[str, tuple[str, str]] = {
    "softmax": ("as asked", "exact: softmax's argmax set"),
    "sigsoftmax": ("as asked", "exact: a strictly increasing f keeps softmax's argmax set"),
    "gss": ("as asked", "exact: a strictly increasing f keeps softmax's argmax set"),
    "plif": ("as asked", "exact: a strictly increasing f keeps softmax's argmax set"),
    "moc": (
        "box 1",
        "the mixed context lies in [-1, 1]^d: tokens unargmaxable in that box are "
        "unargmaxable for MoC (argmaxable ones are not checked to be reachable)",
    ),
    "mos": (
        "unbounded",
        "tokens unargmaxable for softmax on R^d are unargmaxable for MoS too (module "
        "docstring); argmaxable ones are not checked for MoS",
    ),
}


def head_layer(head: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor, str, str]:
    """``(W, b, domain, meaning)`` of a highrank head ``name`` (see :data:`HEAD_SCOPE`); the
    hidden state h is the input of the decoder W (after a projection, when there is one)."""
    if name == "mixtape":
        raise UnargmaxableError(
            "Mixtape gives every frequent token its own mixed context, so its decoder W and "
            "bias b do not decide which tokens can be the argmax; nothing to analyse from W, b "
            "(search a given token with search_argmax_input)"
        )
    if name not in HEAD_SCOPE:
        raise UnargmaxableError(
            f"no unargmaxable analysis for head {name!r}; heads: {', '.join(HEAD_SCOPE)}"
        )
    domain, meaning = HEAD_SCOPE[name]
    return head.weight.detach(), head.bias.detach(), domain, meaning


# ---- records -----------------------------------------------------------------------------------


def report_record(report: ArgmaxReport, *, names=None, limit: int = 200) -> dict[str, Any]:
    """The JSON-ready record of a report; ``names(ids) -> list[str]`` spells tokens."""
    unargmaxable = report.unargmaxable
    shown = unargmaxable[:limit]
    return {
        "vocab_size": int(len(report.status)),
        "domain": _domain_text(report.radius),
        "radius": report.radius,
        "argmaxable": int(report.argmaxable.sum()),
        "unargmaxable": int(len(unargmaxable)),
        "undecided": int(len(report.undecided)),
        "by_step": report.counts(),
        "unargmaxable_ids": unargmaxable.tolist(),
        "unargmaxable_tokens": names(shown) if names is not None else None,
        "undecided_ids": report.undecided.tolist(),
        "lp_tokens": len(report.lp_radius),
        "lp_radius": {str(k): v for k, v in report.lp_radius.items()},
        "lp_rounds": {str(k): v for k, v in report.lp_rounds.items()},
        "lp_radius_tolerance": LP_RADIUS_TOLERANCE,
        "seconds": {k: round(v, 2) for k, v in report.seconds.items()},
        "threads": torch.get_num_threads(),
    }


def _domain_text(radius: float | None) -> str:
    return "all of R^d" if radius is None else f"box |h_k| <= {radius:g}"


# ---- a run's head, a causal LM's output layer --------------------------------------------------


def _analyse(weight, bias, radius, patience, progress, *, domain="as asked", names=None):
    if domain == "box 1":
        radius = 1.0
    elif domain == "unbounded":
        radius = None
    report = find_unargmaxable(weight, bias, radius=radius, patience=patience, progress=progress)
    return report_record(report, names=names)


def analyze_unargmaxable_run(
    run_dir: str | os.PathLike,
    *,
    which: str = "best",
    radius: float | None = DEFAULT_RADIUS,
    patience: int = DEFAULT_PATIENCE,
    progress: bool = False,
) -> dict[str, Any]:
    """The record of :func:`find_unargmaxable` on the output layer of a trained run's head
    (:func:`head_layer` says what is analysed; ``radius`` None: all of R^d)."""
    model, config, vocab = load_run(run_dir, which)
    weight, bias, domain, meaning = head_layer(model.head, config.head.name)
    record = _analyse(
        weight,
        bias,
        radius,
        patience,
        progress,
        domain=domain,
        names=lambda ids: [vocab.words[i] for i in ids],
    )
    return {"run_dir": str(run_dir), "head": config.head.name, "analysed": meaning, **record}


def analyze_unargmaxable_hf(
    model_path: str | os.PathLike,
    *,
    radius: float | None = DEFAULT_RADIUS,
    patience: int = DEFAULT_PATIENCE,
    progress: bool = False,
) -> dict[str, Any]:
    """The record of :func:`find_unargmaxable` on the output layer of a Hugging Face causal
    LM (a model folder or a ``.gguf`` file): its ``lm_head`` weight and bias, or the highrank
    head attached to it (:mod:`highrank.integrations.hf`)."""
    began = time.perf_counter()
    model, tokenizer = load_causal_lm(model_path, progress=progress)
    load_seconds = time.perf_counter() - began
    head = getattr(model, "head", None)
    if head is not None and hasattr(head, "log_prob"):  # a highrank head attached to the model
        name = model.config.head_name
        weight, bias, domain, meaning = head_layer(head, name)
    else:
        linear = model.get_output_embeddings()
        if linear is None or not hasattr(linear, "weight"):
            raise UnargmaxableError(f"{model_path}: the model has no output embedding (lm_head)")
        weight, bias, domain, meaning = (
            linear.weight.detach(),
            linear.bias,
            "as asked",
            ("exact: the lm_head softmax's argmax set"),
        )
        name = "lm_head"
    record = _analyse(
        weight,
        None if bias is None else bias.detach(),
        radius,
        patience,
        progress,
        domain=domain,
        names=lambda ids: [tokenizer.decode([int(i)]) for i in ids],
    )
    return {
        "model": str(Path(model_path).resolve()),
        "head": name,
        "hidden_size": int(weight.shape[1]),
        "bias": bias is not None,
        "analysed": meaning,
        **record,
        "load_seconds": round(load_seconds, 2),
    }


def radius_tag(radius: float | None) -> str:
    return "unbounded" if radius is None else f"box{radius:g}"
