"""Chunk-local cumulative sums of log gates (the γ of ALGORITHMS.md §1).

    γ_t = scale · Σ_{s ≤ t, s in t's chunk} g_s            (reverse=False)
    γ_t = scale · Σ_{s ≥ t, s in t's chunk} g_s            (reverse=True)

Chunks are ``chunk_size`` consecutive tokens counted from the start of each sequence
(from every ``cu_seqlens`` boundary in a packed batch); the last chunk of a sequence
may be partial. Its gradient is the same sum in the other direction
(:func:`chunk_local_cumsum_bwd`). The kernel runs behind the custom op
``fla::chunk_local_cumsum``, so that ``torch.compile`` traces through it.

A backward stage that splits K over programs leaves ∂L/∂γ as one partial sum per K tile
(``[P, B, T, H]``); ``chunk_local_cumsum_fwd(..., sum_parts=True)`` adds the P parts as it
loads them, so they need no summing pass of their own before the reverse sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils.index import prepare_chunk_indices, prepare_token_chunk_positions
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import outside_graph, stage_op
from fla.utils.grid import cdiv, next_power_of_2
from fla.utils.tuning import Config, tuned
from fla.utils.validation import (
    FLOAT_DTYPES,
    Dims,
    check_cu_seqlens,
    check_positive_length,
    check_same_device,
    check_scale,
    check_shape,
    check_tensor,
    token_layout,
)

__all__ = ["chunk_local_cumsum", "chunk_local_cumsum_fwd", "chunk_local_cumsum_bwd"]

# Largest chunk we accept: a chunk is one tile column of the kernel (BT rows), and a
# program holds BT x BS values in registers.
MAX_CHUNK_SIZE = 4096
# Values per program: enough to keep the loads wide, few enough that a BT x BS fp32
# tile stays in registers at 4 warps (32 per thread). On an H200, [4, 8192, 32, 128] bf16
# gates (time-major, BT=64) ran at 3.7 TB/s (copy: 4.1) with 64 x 64 tiles at 4 warps.
_TILE_ELEMENTS = 4096


def _default_config(args) -> Config:
    BT, S = args["BT"], args["S"]
    BS = max(1, min(next_power_of_2(S), _TILE_ELEMENTS // BT))
    warps = 2 if BT * BS <= 1024 else 4
    return Config(BS=BS, num_warps=warps, num_stages=2)


def _config_space(args) -> list[Config]:
    BT, S = args["BT"], args["S"]
    widest = next_power_of_2(S)
    widths = sorted({min(widest, bs) for bs in (16, 32, 64)})
    # No loop in the kernel: stages change nothing, so only the tile and warps vary.
    return [Config(BS=bs, num_warps=w, num_stages=2)
            for bs in widths if BT * bs <= 2 * _TILE_ELEMENTS for w in (2, 4, 8)]


@tuned(key=["g", "o", "S", "BT", "HEAD_FIRST", "P"], default=_default_config,
       space=_config_space)
@triton.jit(do_not_specialize=["T", "part_stride"])
def chunk_local_cumsum_kernel(
    g,
    o,
    scale,
    cu_seqlens,
    chunk_indices,
    T,
    part_stride,
    H: tl.constexpr,
    S: tl.constexpr,
    P: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    REVERSE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HEAD_FIRST: tl.constexpr,
):
    """One program: a BT x BS tile (one chunk, BS gate channels) of one (batch, head).

    ``g``/``o`` are ``[B, T, H, S]`` (``HEAD_FIRST``: ``[B, H, T, S]``), contiguous.
    The launcher views scalar gates as a single channel or folds time-major heads into
    the channels, so one kernel serves scalar and vector gates. With P > 1, ``g`` holds P
    such tensors ``part_stride`` elements apart, summed (in fp32) before the cumsum.
    """
    i_t, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        tok0 = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - tok0).to(tl.int32)
    else:
        i_c = i_t
        tok0 = tl.zeros([], dtype=tl.int64)
        seq_len = T
    # int64: B * T * H * S may exceed 2^31.
    if HEAD_FIRST:
        base = ((i_b.to(tl.int64) * H + i_h) * T + tok0) * S
        stride_t = S
    else:
        base = ((i_b.to(tl.int64) * T + tok0) * H + i_h) * S
        stride_t = H * S

    base += (i_c * BT).to(tl.int64) * stride_t
    o_t = tl.arange(0, BT)
    o_s = i_s * BS + tl.arange(0, BS)
    mask = (i_c * BT + o_t < seq_len)[:, None] & (o_s < S)[None, :]
    offsets = base + o_t[:, None] * stride_t + o_s[None, :]
    # Rows past the sequence end load as 0: they sit after the valid rows, so neither
    # the prefix nor the suffix sums of valid rows see them.
    b_g = tl.load(g + offsets, mask=mask, other=0).to(tl.float32)
    for i_p in tl.static_range(1, P):
        b_g += tl.load(g + i_p * part_stride + offsets, mask=mask, other=0).to(tl.float32)
    b_o = tl.cumsum(b_g, axis=0, reverse=REVERSE)
    if HAS_SCALE:
        b_o = b_o * scale
    tl.store(o + offsets, b_o.to(o.dtype.element_ty), mask=mask)


def _check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if chunk_size < 1 or chunk_size & (chunk_size - 1) or chunk_size > MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size: expected a power of two in [1, {MAX_CHUNK_SIZE}], "
                         f"got {chunk_size}")
    return chunk_size


def _check_output_dtype(output_dtype) -> None:
    if output_dtype is not None and output_dtype not in FLOAT_DTYPES:
        raise TypeError(f"output_dtype: expected None or one of float32, float16, bfloat16, "
                        f"got {output_dtype}")


def check_chunk_indices(chunk_indices, cu_seqlens, device) -> None:
    """Shape/dtype rules of a caller-supplied ``chunk_indices`` (values are not read)."""
    if chunk_indices is None:
        return
    if cu_seqlens is None:
        raise ValueError("chunk_indices: given without cu_seqlens; it describes the chunks "
                         "of a packed batch and needs cu_seqlens as well")
    if not isinstance(chunk_indices, torch.Tensor):
        raise TypeError(f"chunk_indices: expected a torch.Tensor, got "
                        f"{type(chunk_indices).__name__}")
    if chunk_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"chunk_indices: expected dtype in (int32, int64), got "
                        f"{str(chunk_indices.dtype).replace('torch.', '')}")
    if chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
        raise ValueError(f"chunk_indices: expected shape [NT, 2], got "
                         f"{tuple(chunk_indices.shape)}")
    if chunk_indices.device != device:
        raise ValueError(f"chunk_indices: expected device {device}, got {chunk_indices.device}")


def _cumsum_triton(g, chunk_size, reverse, scale, cu_seqlens, head_first, output_dtype,
                   chunk_indices, sum_parts=False):
    """The launch, on chunk_indices built beforehand under varlen (a host read of the
    offsets: never inside the op). ``sum_parts``: g is ``[P, *shape]``, summed over P."""
    g = g.contiguous()
    P = g.shape[0] if sum_parts else 1
    shape = g.shape[1:] if sum_parts else g.shape
    B = shape[0]
    T = shape[2] if head_first else shape[1]
    H = shape[1] if head_first else shape[2]
    S = shape[3] if len(shape) == 4 else 1
    o = torch.empty(shape, dtype=output_dtype, device=g.device)
    if not head_first:
        # Time-major: heads and channels of one token are contiguous, one wide axis.
        H, S = 1, H * S
    NT = cdiv(T, chunk_size) if cu_seqlens is None else chunk_indices.shape[0]
    chunk_local_cumsum_kernel[lambda meta: (NT, cdiv(S, meta["BS"]), B * H)](
        g=g, o=o, scale=1.0 if scale is None else float(scale), cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, T=T, part_stride=o.numel() if P > 1 else 0, H=H, S=S,
        P=P, BT=chunk_size, REVERSE=bool(reverse),
        HAS_SCALE=scale is not None, IS_VARLEN=cu_seqlens is not None,
        HEAD_FIRST=bool(head_first))
    return o


# Packed sequences' offsets are read on the host (validated, then the chunk list that
# sizes the grid is built from them, once per tensor: both cached). Under torch.compile
# these calls run eagerly, a graph break before the op, so that the graph holds no guard
# on the offsets' values: a compiled caller would recompile for every batch.
_host_offsets = outside_graph(check_cu_seqlens)
_chunk_list = outside_graph(prepare_chunk_indices)


# The kernel as the custom op fla::chunk_local_cumsum (one node under torch.compile; its
# fake is the launcher with the launch skipped). Its gradient is the same op summing the
# other way, in the input's dtype.
_cumsum_op = stage_op(
    "chunk_local_cumsum", _cumsum_triton, label="chunk_local_cumsum",
    schema="(Tensor g, int chunk_size, bool reverse, float? scale, Tensor? cu_seqlens, "
           "bool head_first, ScalarType output_dtype, Tensor? chunk_indices, "
           "bool sum_parts=False) -> Tensor",
           ahead=False)


def _setup_context(ctx, inputs, output):
    g, chunk_size, reverse, scale, cu_seqlens, head_first, _, chunk_indices, *rest = inputs
    ctx.save_for_backward(cu_seqlens, chunk_indices)
    ctx.args = (chunk_size, reverse, scale, head_first, g.dtype)
    ctx.parts = g.shape[0] if rest and rest[0] else None


def _backward_formula(ctx, do):
    cu_seqlens, chunk_indices = ctx.saved_tensors
    chunk_size, reverse, scale, head_first, g_dtype = ctx.args
    dg = _cumsum_op(do, chunk_size, not reverse, scale, cu_seqlens, head_first, g_dtype,
                    chunk_indices)
    if ctx.parts is not None:
        # Every part enters the sum alike.
        dg = dg.unsqueeze(0).expand(ctx.parts, *dg.shape)
    return dg, None, None, None, None, None, None, None, None


_cumsum_op.register_autograd(_backward_formula, setup_context=_setup_context)


def _cumsum_torch(g, chunk_size, reverse, scale, offsets, head_first, output_dtype):
    x = g.transpose(1, 2) if head_first else g
    B, T = x.shape[:2]
    if offsets is None:
        offsets = list(range(0, B * T + 1, T))
    flat = x.reshape(B * T, -1).to(torch.float32)
    chunk, position, NT = prepare_token_chunk_positions(offsets, chunk_size, g.device)
    tiles = flat.new_zeros(NT, chunk_size, flat.shape[1])
    tiles[chunk, position] = flat
    if reverse:
        tiles = tiles.flip(1).cumsum(1).flip(1)
    else:
        tiles = tiles.cumsum(1)
    out = tiles[chunk, position]
    if scale is not None:
        out = out * scale
    out = out.reshape(x.shape).to(output_dtype)
    return out.transpose(1, 2).contiguous() if head_first else out


def chunk_local_cumsum_fwd(g, chunk_size, reverse=False, scale=None, cu_seqlens=None,
                           head_first=False, output_dtype=torch.float32, chunk_indices=None,
                           offsets=None, sum_parts=False):
    """:func:`chunk_local_cumsum` without input checks (for stages that validated already).

    ``offsets`` is the host copy of ``cu_seqlens`` when the caller has it. ``sum_parts``:
    ``g`` is ``[P, *gate shape]``, P partial sums (one per K tile of a backward stage)
    whose total is cumsummed; the result has the gate's shape.
    """
    output_dtype = output_dtype or g.dtype
    if select_backend(g) is Backend.TORCH:
        if sum_parts:
            g = g.sum(0, dtype=torch.float32)
        if cu_seqlens is not None and offsets is None:
            offsets = cu_seqlens.tolist()
        return _cumsum_torch(g, chunk_size, reverse, scale, offsets, head_first, output_dtype)
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = _chunk_list(cu_seqlens, chunk_size, cu_seqlens_cpu=offsets)
    return _cumsum_op(g, chunk_size, reverse, scale, cu_seqlens, head_first, output_dtype,
                      chunk_indices, bool(sum_parts))


def chunk_local_cumsum_bwd(do, chunk_size, reverse=False, scale=None, cu_seqlens=None,
                           head_first=False, output_dtype=None, chunk_indices=None,
                           offsets=None):
    """Gradient of :func:`chunk_local_cumsum` with the same ``reverse``/``scale``.

    ``dg_t = scale · Σ_{s in t's chunk, s ≥ t} do_s`` for a forward prefix sum (and the
    prefix sum for a forward suffix sum): the cumsum in the other direction.
    ``output_dtype=None`` keeps ``do``'s dtype.
    """
    return chunk_local_cumsum_fwd(do, chunk_size, reverse=not reverse, scale=scale,
                                  cu_seqlens=cu_seqlens, head_first=head_first,
                                  output_dtype=output_dtype, chunk_indices=chunk_indices,
                                  offsets=offsets)


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int, reverse: bool = False,
                       scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
                       head_first: bool = False, output_dtype: torch.dtype | None = torch.float32,
                       chunk_indices: torch.Tensor | None = None) -> torch.Tensor:
    """Cumulative sum of ``g`` inside each chunk of ``chunk_size`` tokens.

    ``o_t = scale · Σ_{s ≤ t} g_s`` over the tokens ``s`` of ``t``'s chunk
    (``reverse=True``: ``s ≥ t``, a suffix sum). Chunks restart at every sequence start.

    Args:
        g: scalar gates ``[B, T, H]`` or vector gates ``[B, T, H, S]``
            (``head_first=True``: ``[B, H, T]`` / ``[B, H, T, S]``); fp32, fp16 or bf16.
        chunk_size: tokens per chunk, a power of two.
        reverse: suffix sums instead of prefix sums.
        scale: optional factor applied to the sums.
        cu_seqlens: ``LongTensor [N + 1]`` packed-sequence offsets (then ``B == 1``).
        head_first: the layout of ``g`` (and of the result).
        output_dtype: dtype of the result (default float32; None: ``g``'s dtype). Sums are
            accumulated in float32 whatever the dtypes.
        chunk_indices: optional ``prepare_chunk_indices(cu_seqlens, chunk_size)``,
            precomputed by a caller that launches several stages.
    Returns:
        a tensor shaped like ``g`` in ``output_dtype``. Differentiable in ``g``.
    """
    check_tensor("g", g)
    if g.dim() not in (3, 4):
        raise ValueError(f"g: expected scalar gates [B, T, H] or vector gates [B, T, H, S] "
                         f"(head_first: [B, H, T(, S)]), got shape {tuple(g.shape)}")
    dims = Dims()
    check_shape("g", g, token_layout("B T H" if g.dim() == 3 else "B T H S", head_first), dims)
    check_positive_length(dims, "B T H S" if g.dim() == 4 else "B T H")
    chunk_size = _check_chunk_size(chunk_size)
    scale = check_scale(scale, None)
    _check_output_dtype(output_dtype)
    offsets = None if cu_seqlens is None else _host_offsets(cu_seqlens, T=dims["T"],
                                                             B=dims["B"])
    if cu_seqlens is not None:
        check_same_device(g=g, cu_seqlens=cu_seqlens)
    check_chunk_indices(chunk_indices, cu_seqlens, g.device)
    return chunk_local_cumsum_fwd(g, chunk_size, bool(reverse), scale, cu_seqlens,
                                  bool(head_first), output_dtype, chunk_indices, offsets)
