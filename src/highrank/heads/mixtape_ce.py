"""Moved to ``highrank.heads.kernels.mixtape_ce``; kept so that old imports work."""

from highrank.heads.kernels.mixtape_ce import mixtape_cross_entropy_sum

__all__ = ["mixtape_cross_entropy_sum"]
