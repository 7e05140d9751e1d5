"""Moved to ``highrank.heads.kernels.chunking``; kept so that old imports work."""

from highrank.heads.kernels.chunking import (
    checkpointed_nll,
    chunk_masks,
    chunk_slices,
    gradient_in_forward_nll,
)

__all__ = ["checkpointed_nll", "chunk_masks", "chunk_slices", "gradient_in_forward_nll"]
