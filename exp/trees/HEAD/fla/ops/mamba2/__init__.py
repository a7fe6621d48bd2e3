"""Mamba2 (SSD): simple GLA with q = C, k = B, v = dt·x, g = dt·A, ALGORITHMS.md §2.

* :func:`mamba_chunk_scan_combined`: whole sequences (training, prefill), differentiable.
* :func:`selective_state_update`: one decoding step, the state updated in place.
* :func:`naive_ssd`, :func:`ssd_as_simple_gla`: float64 reference loops.
"""
from fla.ops.mamba2.chunk import mamba_chunk_scan_combined, seq_idx_to_cu_seqlens
from fla.ops.mamba2.naive import naive_ssd, ssd_as_simple_gla
from fla.ops.mamba2.selective_state_update import selective_state_update

__all__ = ["mamba_chunk_scan_combined", "naive_ssd", "selective_state_update",
           "seq_idx_to_cu_seqlens", "ssd_as_simple_gla"]
