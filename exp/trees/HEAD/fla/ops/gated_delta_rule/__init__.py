"""Gated delta rule (Gated DeltaNet), ALGORITHMS.md §1: chunked (training, prefill) and
fused recurrent (decoding) forms, and the float64 reference loop."""
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
           "naive_recurrent_gated_delta_rule"]
