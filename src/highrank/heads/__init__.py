"""Output heads: every layer maps hidden states to a normalised next-token distribution.

``HEADS`` maps a short name to each class; ``build_head(name, d_in=..., vocab_size=..., **knobs)``
builds one and rejects unknown names and knobs with the valid choices listed.
"""

from __future__ import annotations

import inspect

from highrank.heads.base import OutputHead
from highrank.heads.gss import GeneralizedSigSoftmax
from highrank.heads.mixtape import Mixtape
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
}


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
]
