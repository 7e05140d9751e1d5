"""The one switch between the heads' fast paths and their reference paths.

Every head computes its distribution by its paper's equations (the *reference path*, written
in its own file). Where a kernel of this package computes the same thing faster (an in-place
inference path, a fused chunked loss), the head takes it by default. Inside
``reference_paths()`` every head takes its reference path instead:

    from highrank.heads.kernels import reference_paths

    with reference_paths():
        general = head.log_prob(hidden)  # no in-place normalisation, mixing or assembly
        loss = head.loss(hidden, target)  # the generic chunked loss: autograd chunk by chunk

The setting is process-wide (every head, every thread) and read when a head runs, so tests
and benchmarks compare the two paths on one head object. Nested blocks restore what was
before them; ``reference_paths(False)`` turns the fast paths back on inside one. The
class-level switches this replaced (``fused_loss``, ``in_place_normalisation``,
``in_place_mixing``, ``in_place_assembly``) are refused when set, on a head class or object.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_reference = False


@contextlib.contextmanager
def reference_paths(enabled: bool = True) -> Iterator[None]:
    """Within the block, every head takes its reference path (``enabled=False``: its fast
    paths); the setting before the block is restored after it."""
    global _reference
    previous, _reference = _reference, bool(enabled)
    try:
        yield
    finally:
        _reference = previous


def fast_paths() -> bool:
    """Are the kernels on (outside ``reference_paths()``)?"""
    return not _reference


# The class-level switches that chose a head's execution path before ``reference_paths()``
# replaced them. Setting one now would change nothing, silently: it is refused instead.
REMOVED_SWITCHES = (
    "in_place_normalisation",
    "in_place_mixing",
    "in_place_assembly",
    "fused_loss",
)


def refuse_removed_switch(name: str) -> None:
    """Raise if ``name`` is one of :data:`REMOVED_SWITCHES`, saying what replaced it."""
    if name in REMOVED_SWITCHES:
        raise AttributeError(
            f"the head switch {name!r} was removed: it no longer chooses a path. Every head "
            "takes its fast paths by default; for the reference path (no fused loss, no "
            "in-place inference) run inside `with highrank.heads.kernels.reference_paths():`"
        )
