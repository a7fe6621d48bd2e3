"""Delta rule (DeltaNet): the gated delta rule with g ≡ 0, ALGORITHMS.md §1."""
from fla.ops.delta_rule.chunk import chunk_delta_rule
from fla.ops.delta_rule.fused_recurrent import fused_recurrent_delta_rule
from fla.ops.delta_rule.naive import naive_recurrent_delta_rule

__all__ = ["chunk_delta_rule", "fused_recurrent_delta_rule", "naive_recurrent_delta_rule"]
