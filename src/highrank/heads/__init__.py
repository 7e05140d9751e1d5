"""Output heads: every layer maps hidden states to a normalised next-token distribution.

``HEADS`` maps a short name to each class; ``build_head(name, d_in=..., vocab_size=..., **knobs)``
builds one and rejects unknown names and knobs with the valid choices listed.
``PAPER_HEADS`` are the seven heads of the papers that read hidden states alone (the demo and
the sweeps run them on rows); ``mfs`` and ``cpr`` (Multi-Facet Softmax, Softmax-CPR) also read
other layers and the context's tokens (``heads/sequence.py``, ``OutputHead.reads``);
``mlp_softmax`` is the rank-bounded capacity control of the warm-start study.
``base_init_knobs`` gives the knobs with which a head can start exactly at a trained softmax
(``OutputHead.start_at_base``).
"""

from __future__ import annotations

import inspect

from highrank.heads.base import OutputHead
from highrank.heads.cpr import SoftmaxCPR
from highrank.heads.gss import GeneralizedSigSoftmax
from highrank.heads.mfs import MultiFacetSoftmax
from highrank.heads.mixtape import Mixtape
from highrank.heads.mlp_softmax import MLPSoftmax
from highrank.heads.moc import MixtureOfContexts
from highrank.heads.mos import MixtureOfSoftmaxes
from highrank.heads.plif import PiecewiseLinearSoftmax
from highrank.heads.sigsoftmax import SigSoftmax
from highrank.heads.softmax import Softmax

HEADS: dict[str, type[OutputHead]] = {
    "softmax": Softmax,
    "moc": MixtureOfContexts,
    "mos": MixtureOfSoftmaxes,
    "mixtape": Mixtape,
    "sigsoftmax": SigSoftmax,
    "gss": GeneralizedSigSoftmax,
    "plif": PiecewiseLinearSoftmax,
    "mlp_softmax": MLPSoftmax,
    "mfs": MultiFacetSoftmax,
    "cpr": SoftmaxCPR,
}
PAPER_HEADS: tuple[str, ...] = tuple(
    name for name in HEADS if name != "mlp_softmax" and HEADS[name].reads == ("hidden",)
)
INITS = ("paper", "base")


def base_init_knobs(name: str, knobs: dict) -> dict:
    """``knobs`` plus those head ``name`` needs to start at a softmax (``init="base"``); a
    ValueError in one line when it cannot, or when ``knobs`` contradict them."""
    head_class = _head_class(name)
    if head_class.BASE_INIT_KNOBS is None:
        raise ValueError(f"head {name!r} cannot start at the base model: {head_class.NO_BASE_INIT}")
    clashing = {
        k: knobs[k] for k, v in head_class.BASE_INIT_KNOBS.items() if k in knobs and knobs[k] != v
    }
    if clashing:
        needed = ", ".join(f"{k}={head_class.BASE_INIT_KNOBS[k]!r}" for k in clashing)
        raise ValueError(
            f"head {name!r} starts at the base model only with {needed}; got "
            + ", ".join(f"{k}={v!r}" for k, v in clashing.items())
            + " (use init='paper' to keep them)"
        )
    return {**knobs, **head_class.BASE_INIT_KNOBS}


def check_init(init: object) -> str:
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(map(repr, INITS))}; got {init!r}")
    return init


def head_knobs(name: str) -> dict[str, object]:
    """The keyword knobs of head ``name`` with their defaults (d_in and vocab_size excluded)."""
    signature = inspect.signature(_head_class(name).__init__)
    return {
        p.name: p.default
        for p in signature.parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def build_head(name: str, *, d_in: int, vocab_size: int, **knobs) -> OutputHead:
    """Build the head registered as ``name``; unknown knobs are an error naming the valid ones.

    Note for optimisers: with ``tied_weight`` the head's parameters include the embedding's
    weight, so deduplicate by identity when combining them with the encoder's parameters.
    """
    valid = head_knobs(name)
    unknown = sorted(set(knobs) - set(valid))
    if unknown:
        raise TypeError(
            f"head {name!r} has no knob(s) {', '.join(unknown)}; valid knobs: "
            + ", ".join(f"{k}={v!r}" for k, v in valid.items())
        )
    return _head_class(name)(d_in, vocab_size, **knobs)


def _head_class(name: str) -> type[OutputHead]:
    if name not in HEADS:
        raise ValueError(f"unknown head {name!r}; choose one of: {', '.join(HEADS)}")
    return HEADS[name]


__all__ = [
    "HEADS",
    "INITS",
    "PAPER_HEADS",
    "base_init_knobs",
    "check_init",
    "MLPSoftmax",
    "OutputHead",
    "build_head",
    "head_knobs",
    "Softmax",
    "MixtureOfContexts",
    "MixtureOfSoftmaxes",
    "Mixtape",
    "SigSoftmax",
    "GeneralizedSigSoftmax",
    "PiecewiseLinearSoftmax",
    "MultiFacetSoftmax",
    "SoftmaxCPR",
]
