"""Generalized (diagonal plus low-rank) delta rule, ALGORITHMS.md §4."""
from fla.ops.generalized_delta_rule.naive import naive_recurrent_dplr_delta_rule

__all__ = ["naive_recurrent_dplr_delta_rule"]
