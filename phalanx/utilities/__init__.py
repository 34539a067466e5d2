"""Small helpers shared across phalanx, and the rank-zero helpers Lightning users import from its ``utilities``."""

from phalanx.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn

__all__ = ["rank_zero_debug", "rank_zero_info", "rank_zero_only", "rank_zero_warn"]
