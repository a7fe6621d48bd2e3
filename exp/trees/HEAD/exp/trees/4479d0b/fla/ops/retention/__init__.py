"""Retention (RetNet): simple GLA with the fixed decay log(1 − 2^(−5−h)) for head h."""
from fla.ops.retention.naive import naive_recurrent_retention, retention_log_decay
from fla.ops.retention.retention import chunk_retention, fused_recurrent_retention

__all__ = ["chunk_retention", "fused_recurrent_retention", "naive_recurrent_retention",
           "retention_log_decay"]
