"""Retention (RetNet): simple GLA with the fixed decay log(1 − 2^(−5−h)) for head h."""
from fla.ops.retention.naive import naive_recurrent_retention, retention_log_decay

__all__ = ["naive_recurrent_retention", "retention_log_decay"]
