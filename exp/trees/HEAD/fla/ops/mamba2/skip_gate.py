"""Mamba2's output epilogue in one kernel: the D skip and the z gate.

From the scan's output ``o``, its input ``x`` and the gate ``z`` (all ``[b, T, H, P]``)
and the skip ``D`` (``[H]`` or ``[H, P]``)::

    y = (o + D ⊙ x) ⊙ silu(z)            (float32 math, rounded once to x's dtype)

and backward, with s = o + D ⊙ x and σ = σ(z) (silu(z) = z σ, silu' = σ (1 + z (1 − σ)))::

    do = dy ⊙ silu(z)
    dx = do ⊙ D                  (the skip's part; autograd adds the scan's)
    dz = dy ⊙ s ⊙ σ (1 + z (1 − σ))
    dD = Σ_tokens do ⊙ x         (summed over P too when D is [H])

In PyTorch that is ~8 elementwise kernels forward over float32 copies of the operands
(at 4x4096x32x64 bf16 ~1.5 GB moved, most of the op's forward) and more backward; here
each direction is one launch reading each operand once (plus the sum of dD's
per-program partials). Behind the custom ops ``fla::mamba2_skip_gate_fwd`` / ``_bwd``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fla.ops.utils.elementwise import one_stage_default, one_stage_space, row_tile
from fla.ops.utils.partial_sums import sum_partials
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import present, stage_op
from fla.utils.grid import cdiv, next_power_of_2
from fla.utils.tuning import tuned

__all__ = ["skip_and_gate", "skip_gate_fwd_kernel", "skip_gate_bwd_kernel"]

# A program's tile: BR tokens x BC channels (channels = H·P, contiguous per token), 4096
# values (32 fp32 registers a thread at 4 warps for each live operand).
_TILE = 4096


def _tile(C: int, width: int) -> tuple[int, int]:
    """(BR, BC): up to ``width`` channels of a token in one tile, the rest of the tile in
    rows. Fixed by the launcher (not tuned): the backward's dD partials then have one
    shape. The forward reads 512 channels a row; the backward 128 (256 contiguous bytes
    in 16 bits), so that its dD partials are one fp32 row per 32 tokens: 4 MB at 4x4096
    tokens x 2048 channels, where 8-row tiles left 16 MB, whose sum took 36 µs on H100."""
    BC = min(next_power_of_2(C), width)
    return _TILE // BC, BC


@tuned(key=["o", "x", "z", "C", "HAS_D", "HAS_Z"], default=one_stage_default,
       space=one_stage_space)
@triton.jit(do_not_specialize=["R"])
def skip_gate_fwd_kernel(o, x, D, z, y, R, C: tl.constexpr, BR: tl.constexpr,
                         BC: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    """Grid ``(cdiv(R, BR), cdiv(C, BC))`` over ``[R, C]`` rows of tokens: ``y`` from
    ``o``, ``x``, ``z`` (``[R, C]``) and ``D`` (``[C]`` float32)."""
    _, _, o_c, m_c, m, p = row_tile(tl.program_id(0), tl.program_id(1), R, C, BR, BC)
    b_y = tl.load(o + p, mask=m, other=0.).to(tl.float32)
    if HAS_D:
        b_D = tl.load(D + o_c, mask=m_c, other=0.)
        b_y += tl.load(x + p, mask=m, other=0.).to(tl.float32) * b_D[None, :]
    if HAS_Z:
        b_z = tl.load(z + p, mask=m, other=0.).to(tl.float32)
        b_y *= b_z * tl.sigmoid(b_z)
    tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)


@tuned(key=["o", "x", "z", "C", "HAS_D", "HAS_Z"], default=one_stage_default,
       space=one_stage_space)
@triton.jit(do_not_specialize=["R"])
def skip_gate_bwd_kernel(o, x, D, z, dy, do, dx, dz, dD_part, R, C: tl.constexpr,
                         BR: tl.constexpr, BC: tl.constexpr, HAS_D: tl.constexpr,
                         HAS_Z: tl.constexpr):
    """Same grid: ``do`` and ``dz`` (with z; without it do is dy), ``dx`` (with D) and
    this program's partial sum of dD over its BR rows (row ``program_id(0)`` of
    ``dD_part [cdiv(R, BR), C]``)."""
    i_r = tl.program_id(0)
    _, _, o_c, m_c, m, p = row_tile(i_r, tl.program_id(1), R, C, BR, BC)
    b_dy = tl.load(dy + p, mask=m, other=0.).to(tl.float32)
    if HAS_D:
        b_D = tl.load(D + o_c, mask=m_c, other=0.)
        b_x = tl.load(x + p, mask=m, other=0.).to(tl.float32)
    if HAS_Z:
        b_z = tl.load(z + p, mask=m, other=0.).to(tl.float32)
        b_sig = tl.sigmoid(b_z)
        b_s = tl.load(o + p, mask=m, other=0.).to(tl.float32)
        if HAS_D:
            b_s += b_x * b_D[None, :]
        tl.store(dz + p, (b_dy * b_s * b_sig * (1. + b_z * (1. - b_sig))).to(
            dz.dtype.element_ty), mask=m)
        b_do = b_dy * b_z * b_sig
        tl.store(do + p, b_do.to(do.dtype.element_ty), mask=m)
    else:
        b_do = b_dy     # do is dy itself (the launcher's): no copy written
    if HAS_D:
        tl.store(dx + p, (b_do * b_D[None, :]).to(dx.dtype.element_ty), mask=m)
        # Masked rows and columns loaded as 0: they add nothing to the sum.
        tl.store(dD_part + i_r * C + o_c, tl.sum(b_do * b_x, 0), mask=m_c)


def _channels_D(D: torch.Tensor | None, H: int, P: int) -> torch.Tensor | None:
    # D per channel (h, p) as float32 [H·P]: [H] repeated over P.
    if D is None:
        return None
    return D.float().reshape(H, -1).expand(H, P).contiguous().reshape(H * P)


def _skip_gate_fwd(o: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None,
                   z: torch.Tensor | None) -> torch.Tensor:
    """``y [b, T, H, P]`` in x's dtype; o, x, z contiguous."""
    H, P = x.shape[-2:]
    C = H * P
    R = x.numel() // C
    y = torch.empty_like(x)
    BR, BC = _tile(C, 512)
    skip_gate_fwd_kernel[(cdiv(R, BR), cdiv(C, BC))](
        o=o, x=x, D=_channels_D(D, H, P), z=z, y=y, R=R, C=C, BR=BR, BC=BC,
        HAS_D=D is not None, HAS_Z=z is not None)
    return y


def _skip_gate_bwd(o, x, D, z, dy):
    """``(do, dx, dz, dD)``: do in dy's dtype, dx (the skip's part) in x's, dz in z's, dD
    shaped and typed like D; the ones whose input is absent are None. ``o`` is read only
    with z (the gate's gradient needs o + D x), and may be None without it."""
    H, P = x.shape[-2:]
    C = H * P
    R = x.numel() // C
    BR, BC = _tile(C, 128)
    programs = cdiv(R, BR)
    dy = dy.contiguous()
    # Without the gate do = dy: the same tensor, not a copy of it.
    do = torch.empty_like(dy) if z is not None else dy
    dx = None if D is None else torch.empty_like(x)
    dz = None if z is None else torch.empty_like(z)
    # One row of partials per row block, every row written by every launch.
    dD_part = None if D is None else torch.empty(programs, C, dtype=torch.float32,
                                                 device=x.device)
    skip_gate_bwd_kernel[(programs, cdiv(C, BC))](
        o=o, x=x, D=_channels_D(D, H, P), z=z, dy=dy, do=do, dx=dx, dz=dz,
        dD_part=dD_part, R=R, C=C, BR=BR, BC=BC, HAS_D=D is not None, HAS_Z=z is not None)
    dD = None
    if D is not None:
        # [H, P] partials reduced over the row blocks, then over P for a per-head D.
        like = torch.empty(H, P, dtype=torch.float32, device=x.device)
        dD = sum_partials(dD_part.view(programs, H, P), like)
        dD = (dD if D.dim() == 2 else dD.sum(-1)).to(D.dtype)
    return do, dx, dz, dD


_fwd_op = stage_op(
    "mamba2_skip_gate_fwd", _skip_gate_fwd, label="mamba2_skip_gate.fwd", ahead=False,
    schema="(Tensor o, Tensor x, Tensor? D, Tensor? z) -> Tensor")
_bwd_op = stage_op(
    "mamba2_skip_gate_bwd", _skip_gate_bwd, label="mamba2_skip_gate.bwd", ahead=False,
    schema="(Tensor? o, Tensor x, Tensor? D, Tensor? z, Tensor dy) "
           "-> (Tensor, Tensor, Tensor, Tensor)")


def _setup_context(ctx, inputs, output):
    o, x, D, z = inputs
    # o only with the gate: without it the backward never reads o, and keeping it would
    # hold the scan's output (the size of x) until the backward.
    ctx.save_for_backward(o if z is not None else None, x, D, z)
    ctx.present = (D is not None, z is not None)
    ctx.o_dtype = o.dtype


def _backward(ctx, dy):
    o, x, D, z = ctx.saved_tensors
    do, dx, dz, dD = _bwd_op(o, x, D, z, dy)
    has_D, has_z = ctx.present
    return (do.to(ctx.o_dtype), present(dx, has_D), present(dD, has_D), present(dz, has_z))


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _skip_gate_torch(o, x, D, z):
    acc = torch.promote_types(x.dtype, torch.float32)     # float64 stays float64
    y = o.to(acc)
    if D is not None:
        y = y + x.to(acc) * (D.to(acc)[:, None] if D.dim() == 1 else D.to(acc))
    if z is not None:
        y = y * F.silu(z.to(acc))
    return y.to(x.dtype)


def skip_and_gate(o: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None = None,
                  z: torch.Tensor | None = None) -> torch.Tensor:
    """Mamba2's ``y = (o + D ⊙ x) ⊙ silu(z)``, differentiable in every input.

    Args:
        o: ``[b, T, H, P]``, the SSD scan's output.
        x: ``[b, T, H, P]``, the scan's input (its dtype is the result's).
        D: ``[H]`` or ``[H, P]`` skip, or None (no skip).
        z: ``[b, T, H, P]`` gate, or None (no gate).

    Returns:
        ``y [b, T, H, P]`` in x's dtype, computed in float32 and rounded once (float64
        inputs in PyTorch). With neither D nor z, ``o`` in x's dtype.

    Shapes are the caller's (``mamba_chunk_scan_combined`` checked them).
    """
    if D is None and z is None:
        return o.to(x.dtype)
    if x.dtype == torch.float64 or x.numel() == 0 or select_backend(x) is Backend.TORCH:
        return _skip_gate_torch(o, x, D, z)
    return _fwd_op(o.contiguous(), x.contiguous(), None if D is None else D.contiguous(),
                   None if z is None else z.contiguous())
