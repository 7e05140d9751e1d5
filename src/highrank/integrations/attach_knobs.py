"""The head knobs a user gives when attaching a head to a transformers model (``attach_head``,
``highrank retrofit --knob``): the head's own knobs, less those the wrapper wires itself.
Kept apart from ``hf.py`` so that a command checks them before it imports transformers."""

from __future__ import annotations

import json

from highrank.heads import HEADS, head_knobs

# Knobs the model wires itself; a user value would contradict the base model or the layout.
WIRED_KNOBS = ("tied_weight", "dropout_time_dim", "time_dim")


def attach_knobs(name: str) -> dict[str, object]:
    """The knobs of head ``name`` a user may set, with their defaults."""
    return {k: v for k, v in head_knobs(name).items() if k not in WIRED_KNOBS}


def check_attach_knobs(name: str, knobs: dict) -> None:
    """``name`` a head, ``knobs`` among its settable knobs and JSON values (they go to the
    saved model's config.json); TypeError or ValueError naming the valid ones otherwise."""
    if name not in HEADS:
        raise ValueError(f"unknown head {name!r}; choose one of: {', '.join(HEADS)}")
    valid = attach_knobs(name)
    wired = sorted(set(knobs) & set(WIRED_KNOBS))
    if wired:
        raise TypeError(
            f"{', '.join(wired)} is set by attach_head (tying follows the base model; hidden "
            f"states are batch-first); valid knobs of {name!r}: {', '.join(valid) or 'none'}"
        )
    unknown = sorted(set(knobs) - set(valid))
    if unknown:
        raise TypeError(
            f"head {name!r} has no knob(s) {', '.join(unknown)}; valid knobs: "
            + (", ".join(f"{k}={v!r}" for k, v in valid.items()) or "none")
        )
    try:
        json.dumps(knobs)
    except TypeError as error:
        message = f"head knobs must be JSON values (they go to config.json): {error}"
        raise TypeError(message) from None
