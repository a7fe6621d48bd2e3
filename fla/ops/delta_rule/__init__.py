"""Delta rule (DeltaNet): the gated delta rule with g ≡ 0, ALGORITHMS.md §1."""
from fla.ops.delta_rule.naive import naive_recurrent_delta_rule

__all__ = ["naive_recurrent_delta_rule"]
