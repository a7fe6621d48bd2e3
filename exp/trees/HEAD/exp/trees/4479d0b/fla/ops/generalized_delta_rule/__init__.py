"""Generalized (diagonal plus low-rank) delta rule, ALGORITHMS.md §4: chunked (training,
prefill) and fused recurrent (decoding) forms, and the float64 reference loop."""
from fla.ops.generalized_delta_rule.chunk import chunk_dplr_delta_rule
from fla.ops.generalized_delta_rule.fused_recurrent import fused_recurrent_dplr_delta_rule
from fla.ops.generalized_delta_rule.naive import naive_recurrent_dplr_delta_rule

__all__ = ["chunk_dplr_delta_rule", "fused_recurrent_dplr_delta_rule",
           "naive_recurrent_dplr_delta_rule"]
