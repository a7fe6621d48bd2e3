"""One decoding step of Mamba2's SSD (ALGORITHMS.md §2, "Decoding"), updating the state in place.

Per batch entry b, head h (group g = h // (H // G)), channel p and state index n::

    dt        = softplus?(dt[b, h, p] + dt_bias[h, p])
    state     = state[b, h, p, n] · exp(dt · A[h, p, n]) + dt · x[b, h, p] · B[b, g, n]
    y[b, h, p] = Σ_n state · C[b, g, n] + D[h, p] · x[b, h, p]
    y         = y · silu(z[b, h, p])

One Triton kernel does the whole step: a program owns a ``[BP, N]`` tile of one (b, h)
state, reads it once, writes it once, and produces its BP outputs. Nothing else moves
more than a few hundred bytes, so the kernel is bound by the bandwidth of the state
(read + write), the figure it should be judged by: on an H100 (Triton 3.6, CUDA graphs)
it moves the state at 95-98% of a device-to-device copy at P = 64, N = 128 for b·H from
2048 to 8192 (fp32 and bf16 states). Called eagerly, the host side (checks, the launch
of a kernel with ~50 arguments) costs about 0.1-0.2 ms a call, more than the kernel at
small batches: decode loops should be captured in a CUDA graph.

Mamba passes the per-head parameters broadcast to the per-channel shapes with zero
strides (``A[:, None, None].expand(H, P, N)``, ``dt[:, :, None].expand(b, H, P)``, ...).
The kernel takes every tensor with its strides, so such views are read as they are (no
copy), and a state that is a strided view of a larger cache is updated where it lives.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# tl.sum is tl.reduce with this combine function; calling tl.reduce directly is one numpy
# sum in the interpreter instead of a traced @jit call (same code on the GPU).
from triton.language.standard import _sum_combine

from fla.ops.utils.elementwise import softplus
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import decode_op
from fla.utils.grid import cdiv, next_power_of_2
from fla.utils.tuning import Config, tuned
from fla.utils.validation import (
    INDEX_DTYPES,
    Dims,
    check_head_dim,
    check_positive_length,
    check_same_device,
    check_shape,
    check_tensor,
)

__all__ = ["selective_state_update", "selective_state_update_kernel"]


# ----------------------------------------------------------------------- tile choice
def _block_n(N: int) -> int:
    # One tile spans all of N: y's sum over n then completes inside one program.
    return next_power_of_2(N)


def _default_config(args) -> Config:
    """About 2048 state elements a program, 32 a thread: BP = 2048 / BN clipped to
    [1, next_power_of_2(P)], one warp per 1024 elements. Measured on an H100 (Triton 3.6,
    CUDA graphs, Mamba2's expanded layout, % of a device copy of the state):
    P=64, N=128 -> BP=16 on 2 warps, 95-98% at b·H = 2048-8192 in fp32 and bf16 states
    (the best config within 1-2%; 1 warp lost up to 4%, BP=64 on 1 warp fell to 30%);
    N=16 -> BP=64 (all of P) on 1 warp, 90% fp32 / 75% bf16, the best measured (BP=16
    gave 65% / 32%: too little work a program). Small batches (state under 10 MB) run
    in 2-4 us, launch-bound, whatever the config."""
    BN = args["BN"]
    BP = max(1, min(next_power_of_2(args["P"]), 2048 // BN))
    return Config(BP=BP, num_warps=max(1, min(8, BP * BN // 1024)), num_stages=1)


def _config_space(args) -> list[Config]:
    BN, Pp = args["BN"], next_power_of_2(args["P"])
    space = []
    for BP in (1, 2, 4, 8, 16, 32, 64, 128):
        if BP > Pp or BP * BN > 16384:
            continue
        for warps in (1, 2, 4, 8):
            if BP * BN // (32 * warps) < 2:  # under 2 elements a thread: idle lanes
                continue
            space.append(Config(BP=BP, num_warps=warps, num_stages=1))
    return space


# ------------------------------------------------------------------------- kernel
@tuned(key=["P", "N", "state", "x", "A_PER_HEAD"], default=_default_config,
       space=_config_space, restore=["state"])
@triton.jit
def selective_state_update_kernel(
    state, x, dt, dt_bias, A, B, C, D, z, y, state_batch_indices,
    stride_s_b, stride_s_h, stride_s_p, stride_s_n,
    stride_x_b, stride_x_h, stride_x_p,
    stride_dt_b, stride_dt_h, stride_dt_p,
    stride_dtb_h, stride_dtb_p,
    stride_a_h, stride_a_p, stride_a_n,
    stride_b_b, stride_b_g, stride_b_n,
    stride_c_b, stride_c_g, stride_c_n,
    stride_d_h, stride_d_p,
    stride_z_b, stride_z_h, stride_z_p,
    n_state_rows,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr,
    A_PER_HEAD: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_INDICES: tl.constexpr,
):
    """One program per (P tile, batch entry · head); see the module docstring."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    # Every base offset in int64: a decode cache of many sequences passes 2^31 elements.
    i_b64 = i_b.to(tl.int64)
    i_h64 = i_h.to(tl.int64)

    if HAS_INDICES:
        row = tl.load(state_batch_indices + i_b).to(tl.int64)
        # Rows outside the state are padding (e.g. -1 for unused CUDA-graph slots): the
        # state is left untouched and y is 0. Clamping keeps the address formed valid.
        valid = (row >= 0) & (row < n_state_rows)
        row = tl.where(valid, row, 0)
        # The row's validity enters the masks as a channel bound (P, or 0 for padding):
        # the interpreter mishandles a scalar boolean combined with a vector mask.
        p_end = valid.to(tl.int32) * P
    else:
        row = i_b64
        p_end = P

    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    m_live = o_p < p_end  # channels whose state row exists
    m_s = m_live[:, None] & m_n[None, :]

    p_s = (state + row * stride_s_b + i_h64 * stride_s_h
           + o_p[:, None] * stride_s_p + o_n[None, :] * stride_s_n)
    b_s = tl.load(p_s, mask=m_s, other=0.).to(tl.float32)

    b_x = tl.load(x + i_b64 * stride_x_b + i_h64 * stride_x_h + o_p * stride_x_p,
                  mask=m_p, other=0.).to(tl.float32)
    b_dt = tl.load(dt + i_b64 * stride_dt_b + i_h64 * stride_dt_h + o_p * stride_dt_p,
                   mask=m_p, other=0.).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(dt_bias + i_h64 * stride_dtb_h + o_p * stride_dtb_p,
                        mask=m_p, other=0.).to(tl.float32)
    if DT_SOFTPLUS:
        b_dt = softplus(b_dt)

    if A_PER_HEAD:
        # One A per head (Mamba2): one exp per channel instead of one per state element.
        b_A = tl.load(A + i_h64 * stride_a_h).to(tl.float32)
        b_dA = tl.exp(b_dt * b_A)[:, None]
    else:
        b_A = tl.load(A + i_h64 * stride_a_h + o_p[:, None] * stride_a_p
                      + o_n[None, :] * stride_a_n,
                      mask=m_p[:, None] & m_n[None, :], other=0.).to(tl.float32)
        b_dA = tl.exp(b_dt[:, None] * b_A)

    b_B = tl.load(B + i_b64 * stride_b_b + i_g * stride_b_g + o_n * stride_b_n,
                  mask=m_n, other=0.).to(tl.float32)
    b_C = tl.load(C + i_b64 * stride_c_b + i_g * stride_c_g + o_n * stride_c_n,
                  mask=m_n, other=0.).to(tl.float32)

    b_s = b_s * b_dA + (b_dt * b_x)[:, None] * b_B[None, :]
    tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=m_s)

    # y from the float32 state, before it is rounded to the state's dtype.
    b_y = tl.reduce(b_s * b_C[None, :], 1, _sum_combine)
    if HAS_D:
        b_y += b_x * tl.load(D + i_h64 * stride_d_h + o_p * stride_d_p,
                             mask=m_p, other=0.).to(tl.float32)
    if HAS_Z:
        b_z = tl.load(z + i_b64 * stride_z_b + i_h64 * stride_z_h + o_p * stride_z_p,
                      mask=m_p, other=0.).to(tl.float32)
        b_y = b_y * b_z * tl.sigmoid(b_z)
    b_y = tl.where(m_live, b_y, 0.)
    tl.store(y + (i_b64 * H + i_h64) * P + o_p, b_y.to(y.dtype.element_ty), mask=m_p)


# ---------------------------------------------------------------------- validation
# Accepted layouts of each argument, with heads (Mamba2, 4-D state) and without (Mamba1,
# 3-D state); an argument with alternatives is read by its number of dimensions.
_LAYOUTS = {
    True: {
        "x": ["b H P"], "dt": ["b H P", "b H"], "A": ["H P N", "H"],
        "B": ["b G N"], "C": ["b G N"], "D": ["H P", "H"], "z": ["b H P"],
        "dt_bias": ["H P", "H"],
    },
    False: {
        "x": ["b P"], "dt": ["b P"], "A": ["P N"], "B": ["b N"], "C": ["b N"],
        "D": ["P"], "z": ["b P"], "dt_bias": ["P"],
    },
}


def _check_layout(name: str, t: torch.Tensor, layouts: list[str], dims: Dims) -> None:
    for layout in layouts:
        if len(layout.split()) == t.dim():
            check_shape(name, t, layout, dims)
            return
    if len(layouts) == 1:
        check_shape(name, t, layouts[0], dims)  # raises with the expected shape
    shapes = " or ".join("[" + ", ".join(l.split()) + "]" for l in layouts)
    raise ValueError(f"{name}: expected shape {shapes}, got {t.dim()}-D with shape "
                     f"{tuple(t.shape)}")


def _validate(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices):
    """Every check before anything runs; returns whether the call has heads (4-D state)."""
    check_tensor("state", state)
    if state.dim() not in (3, 4):
        raise ValueError(f"state: expected a 4-D tensor [b, H, P, N] (or 3-D [b, P, N] "
                         f"without heads), got {state.dim()}-D with shape "
                         f"{tuple(state.shape)}")
    heads = state.dim() == 4
    layouts = _LAYOUTS[heads]
    dims = Dims()
    # B first: the state size N and the groups are bound by B, as users think of them.
    named = {"x": x, "B": B, "C": C, "dt": dt, "A": A, "D": D, "z": z, "dt_bias": dt_bias}
    for name, t in named.items():
        if t is None:
            if name in ("x", "B", "C", "dt", "A"):
                raise TypeError(f"{name}: expected a torch.Tensor, got None")
            continue
        check_tensor(name, t)
        _check_layout(name, t, layouts[name], dims)
    check_positive_length(dims, "b H G")
    # With indices the state may hold more (or fewer) rows than the batch; without, one
    # row per batch entry.
    state_layout = ("S" if state_batch_indices is not None else "b") + (
        " H P N" if heads else " P N")
    check_shape("state", state, state_layout, dims)
    check_head_dim("state", dims["N"], "N")
    check_head_dim("state", dims["P"], "P", limit=1 << 30)
    if heads and dims["H"] % dims["G"]:
        raise ValueError(f"B: the groups G = {dims['G']} must divide the heads H = "
                         f"{dims['H']}")
    if state_batch_indices is not None:
        check_tensor("state_batch_indices", state_batch_indices, dtypes=INDEX_DTYPES)
        check_shape("state_batch_indices", state_batch_indices, "b", dims)
    if not isinstance(dt_softplus, bool):
        raise TypeError(f"dt_softplus: expected a bool, got {type(dt_softplus).__name__}")
    check_same_device(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                      state_batch_indices=state_batch_indices)
    return heads


# -------------------------------------------------------------------------- paths
def _per_channel(t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``t`` broadcast to ``shape`` by appending unit dims and expanding: a view with zero
    strides, never a copy."""
    if t is None:
        return None
    while t.dim() < len(shape):
        t = t.unsqueeze(-1)
    return t.expand(shape)


def _torch_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices):
    """The PyTorch path (CPU without the interpreter): the same step in float32 ops."""
    b, H, P = x.shape
    N, G = state.shape[-1], B.shape[1]
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if G != H:
        B, C = B.repeat_interleave(H // G, dim=1), C.repeat_interleave(H // G, dim=1)
    if state_batch_indices is None:
        rows = torch.arange(b, device=x.device)
    else:
        rows = state_batch_indices.long()
    valid = (rows >= 0) & (rows < state.shape[0])
    s = torch.zeros(b, H, P, N, dtype=torch.float32, device=x.device)
    s[valid] = state[rows[valid]].float()
    s = (s * torch.exp(dt[..., None] * A.float())
         + (dt * x.float())[..., None] * B.float()[:, :, None, :])
    state[rows[valid]] = s[valid].to(state.dtype)
    y = (s * C.float()[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    y = torch.where(valid[:, None, None], y, 0.)
    return y.to(x.dtype)


def _triton_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices):
    """The kernel launch: returns y ``[b, H, P]`` in x's dtype and updates ``state`` in
    place. Arguments as :func:`selective_state_update` after its per-channel views."""
    b, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    y = torch.empty(b, H, P, dtype=x.dtype, device=x.device)
    a_per_head = ((P == 1 or A.stride(1) == 0) and (N == 1 or A.stride(2) == 0))
    # Unused optional tensors are passed as None with zero strides; their constexpr flag
    # keeps the kernel from touching them.
    zero2, zero3 = (0, 0), (0, 0, 0)
    BN = _block_n(N)
    selective_state_update_kernel[lambda meta: (cdiv(P, meta["BP"]), b * H)](
        state, x, dt, dt_bias, A, B, C, D, z, y, state_batch_indices,
        *state.stride(), *x.stride(), *dt.stride(),
        *(dt_bias.stride() if dt_bias is not None else zero2),
        *A.stride(), *B.stride(), *C.stride(),
        *(D.stride() if D is not None else zero2),
        *(z.stride() if z is not None else zero3),
        state.shape[0],
        H=H, G=G, P=P, N=N, BN=BN,
        A_PER_HEAD=a_per_head, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        HAS_D=D is not None, HAS_Z=z is not None,
        HAS_INDICES=state_batch_indices is not None,
    )
    return y


# The step as the custom op fla::selective_state_update, writing the state in place (see
# fla.utils.custom_ops.decode_op): one node under torch.compile, capturable in a CUDA graph.
_step = decode_op(
    "selective_state_update", _triton_step, mutates="state",
    label="mamba2.selective_state_update",
    schema="(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, "
           "Tensor? z, Tensor? dt_bias, bool dt_softplus, Tensor? state_batch_indices) "
           "-> Tensor")


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, state_batch_indices=None):
    """One SSD decoding step: ``state`` is updated in place and ``y`` returned.

    With heads (Mamba2); ``b`` batch entries, ``H`` heads of ``P`` channels, ``G`` groups
    (dividing H) of ``N`` state entries::

        dt    = softplus?(dt + dt_bias)                 # float32
        state = state · exp(dt · A) + (dt · x) ⊗ B      # per (b, h): [P, N]
        y     = state · C + D · x
        y     = y · silu(z)

    Args:
        state: ``[S, H, P, N]`` any float dtype, updated in place (computed in float32,
            stored back in its dtype); may be a strided view. S = b unless
            ``state_batch_indices`` is given.
        x: ``[b, H, P]``.
        dt: ``[b, H, P]`` or ``[b, H]`` (raw time step; Mamba2 passes ``[b, H]``
            expanded to ``[b, H, P]`` with a zero stride: both are read without a copy).
        A: ``[H, P, N]`` or ``[H]`` (negative; a zero-stride ``[H, P, N]`` expansion of a
            per-head A is recognised and read once per head).
        B, C: ``[b, G, N]``.
        D: ``[H, P]`` or ``[H]`` (optional skip).
        z: ``[b, H, P]`` (optional gate).
        dt_bias: ``[H, P]`` or ``[H]`` (optional).
        dt_softplus: apply softplus to ``dt + dt_bias``.
        state_batch_indices: ``[b]`` int32/int64, the state row each batch entry updates
            (a decode cache indexed by slot). Rows outside ``[0, S)`` (e.g. -1) mark
            padding entries: their state is left alone and their y is 0. Two entries
            must not name the same row.

        Without heads (Mamba1; ``state`` 3-D): state ``[b, P, N]``, x, dt, z ``[b, P]``,
        A ``[P, N]``, B, C ``[b, N]``, D, dt_bias ``[P]``; y is ``[b, P]``.

    Returns:
        y: ``[b, H, P]`` (``[b, P]`` without heads) in x's dtype.

    Raises ``TypeError`` / ``ValueError`` naming the argument before anything runs.
    """
    heads = _validate(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)
    if not heads:
        # Without heads the step is the one-head case: views with a unit head axis.
        y = selective_state_update(
            state.unsqueeze(1), x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0),
            B.unsqueeze(1), C.unsqueeze(1), None if D is None else D.unsqueeze(0),
            None if z is None else z.unsqueeze(1),
            None if dt_bias is None else dt_bias.unsqueeze(0), dt_softplus,
            state_batch_indices)
        return y.squeeze(1)

    b, H, P = x.shape
    N = B.shape[2]
    # Per-head parameters become zero-stride views of the per-channel shapes.
    dt = _per_channel(dt, (b, H, P))
    A = _per_channel(A, (H, P, N))
    D = _per_channel(D, (H, P))
    dt_bias = _per_channel(dt_bias, (H, P))

    if select_backend(state, x) is Backend.TORCH:
        return _torch_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                           state_batch_indices)

    args = (state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)
    return _step(*args)
