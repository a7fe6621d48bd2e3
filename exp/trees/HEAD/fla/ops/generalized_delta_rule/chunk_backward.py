"""The backward of the Triton chunked DPLR delta rule: the stages in order (see
:mod:`fla.ops.generalized_delta_rule.chunk_function`)."""
from __future__ import annotations

import torch

from fla.ops.common.chunk_dplr_bwd_dhu import chunk_dplr_bwd_dhu
from fla.ops.common.chunk_dplr_bwd_intra import chunk_dplr_bwd_intra
from fla.ops.common.chunk_dplr_bwd_local import chunk_dplr_bwd_local
from fla.ops.common.chunk_dplr_fwd_intra import CHUNK_SIZE


def chunk_dplr_bwd(q, k, v, a, b, gk, initial_state, Aqk, Aqb, Aak, Ai, h, u, ht, do, dht,
                   scale, cu_seqlens, chunk_indices, offsets, N):
    """``(dq, dk, dv, da, db, dgk, dh0)`` in the dtypes of the inputs."""
    dh, dz, dv, dh0 = chunk_dplr_bwd_dhu(
        q, k, a, b, gk, Aqk, Aqb, Aak, Ai, do, dht, scale, v.dtype, cu_seqlens, offsets, N,
        need_dh0=initial_state is not None, NT_total=h.shape[0], chunk_size=CHUNK_SIZE)
    grads, off, dA = chunk_dplr_bwd_local(q, k, v, a, b, gk, h, dh, u, dz, do, scale,
                                          cu_seqlens, chunk_indices, offsets, CHUNK_SIZE)
    out = tuple(torch.empty_like(x) for x in (q, k, a, b, gk))
    dq, dk, da, db, dgk = chunk_dplr_bwd_intra(q, k, a, b, gk, dA, grads, off, out,
                                               cu_seqlens, chunk_indices, offsets, CHUNK_SIZE)
    if dh0 is not None:
        dh0 = dh0.to(initial_state.dtype)
    return dq, dk, dv, da, db, dgk, dh0
