"""Moved to ``highrank.heads.kernels.mixture_ce``; kept so that old imports work."""

from highrank.heads.kernels.mixture_ce import mixture_cross_entropy_sum

__all__ = ["mixture_cross_entropy_sum"]
