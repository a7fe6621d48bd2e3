"""Gated delta rule (Gated DeltaNet), ALGORITHMS.md §1."""
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

__all__ = ["naive_recurrent_gated_delta_rule"]
