"""Per-chunk inverse of a unit lower-triangular matrix: the T⁻¹ of the UT/WY transform.

For each chunk of BT tokens and each head, ``A`` holds a strictly lower-triangular
BT x BT block (row = token of the chunk, column = position inside the chunk) and

    Ai = (I + A)⁻¹                                   (ALGORITHMS.md §1, "Tinv")

is returned in the same layout: lower triangular with a unit diagonal and exact zeros
above it.

Kernel: one program per (chunk, head). The 16 x 16 diagonal blocks D_i = (I + A_ii)⁻¹
are found by forward substitution (rows in order, each a vector-matrix product with the
rows before it); the blocks below the diagonal follow from block forward substitution

    X_ii = D_i,    X_ij = −D_i Σ_{j ≤ k < i} A_ik X_kj      (i > j)

i.e. for two blocks [[A11, 0], [A21, A22]]⁻¹ = [[D1, 0], [−D2 A21 D1, D2]], with
``tl.dot`` on 16 x 16 tiles in float32 ("ieee": tf32 would cost three digits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils.cumsum import check_chunk_indices
from fla.ops.utils.index import (
    locate_chunk,
    prepare_chunk_indices,
    prepare_token_chunk_positions,
)
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import stage_op, use_op
from fla.utils.grid import cdiv
from fla.utils.triton_facts import dot_precision
from fla.utils.tuning import Config, tuned
from fla.utils.validation import (
    FLOAT_DTYPES,
    Dims,
    check_cu_seqlens,
    check_positive_length,
    check_same_device,
    check_shape,
    check_tensor,
)

__all__ = ["solve_tril", "solve_tril_fwd", "CHUNK_SIZES", "unit_lower_inverse_blocks",
           "stack_blocks_4", "unstack_blocks_4", "merge_block_inverse_64",
           "store_block_inverse_64"]

# Chunk sizes with a kernel: multiples of the 16 x 16 block (tl.dot needs >= 16 per
# side), up to 64 = four blocks, where the 16 block products are all written out.
CHUNK_SIZES = (16, 32, 64)


@triton.jit
def unit_lower_inverse_blocks(b_A):
    """(I + A_b)⁻¹ for each 16 x 16 block of a ``[NB, 16, 16]`` fp32 register tensor; only
    the strictly lower triangle of each block is read.

    Forward substitution, X = (I + A)⁻¹ row by row: X_i = e_i − Σ_{k<i} A_ik X_k reads only
    rows < i of X (already final). X is built transposed (column i of Xᵀ at step i): row
    i of A then comes out of its reduction along the axis that Xᵀ's product reduces
    across, and that product's result along the axis Xᵀ's column is written on, so no
    step moves data between layouts (the untransposed form converted one vector a step:
    on an H200, bf16, 1x8192x96x128, the WY kernel took 0.295 ms with it and 0.178
    without). The NB blocks take their steps together (15 whatever NB). Substitution
    rather than a product of powers of A: the powers grow like binomial coefficients and
    their rounding would swamp the result.
    """
    o_i = tl.arange(0, 16)
    rows = o_i[None, :, None]
    cols = o_i[None, None, :]
    eye = (rows == cols).to(tl.float32)
    b_A = tl.where(rows > cols, b_A, 0.)
    b_Xt = eye + tl.zeros_like(b_A)  # Xᵀ: X_0 = e_0, rows of X past i still e_i
    for i in range(1, 16):
        b_a = tl.sum(tl.where(rows == i, b_A, 0.), 1)       # [NB, 16 (k)]: row i of A
        b_s = tl.sum(b_a[:, None, :] * b_Xt, 2)             # [NB, 16 (j)]: Σ_k A_ik X_kj
        b_Xt = tl.where(cols == i, eye - b_s[:, :, None], b_Xt)
    return tl.permute(b_Xt, (0, 2, 1))


@triton.jit
def stack_blocks_4(b_1, b_2, b_3, b_4):
    """Four [16, 16] tiles as one [4, 16, 16] tensor, in that order."""
    b_x = tl.join(tl.join(b_1, b_2), tl.join(b_3, b_4))      # [16, 16, 2 (1|2, 3|4), 2]
    return tl.reshape(tl.permute(b_x, (3, 2, 0, 1)), (4, 16, 16))


@triton.jit
def unstack_blocks_4(b_x):
    """The inverse of :func:`stack_blocks_4`: [4, 16, 16] -> four [16, 16] tiles."""
    b_x = tl.permute(tl.reshape(b_x, (2, 2, 16, 16)), (2, 3, 1, 0))
    b_12, b_34 = tl.split(b_x)
    b_1, b_2 = tl.split(b_12)
    b_3, b_4 = tl.split(b_34)
    return b_1, b_2, b_3, b_4


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _dot_acc(a, b, acc, PRECISION: tl.constexpr):
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def merge_block_inverse_32(b_D1, b_D2, b_A21, PRECISION: tl.constexpr):
    """The off-diagonal block of (I + A)⁻¹ for A = [[A11, 0], [A21, A22]] in 16 x 16
    blocks, given D_i = (I + A_ii)⁻¹: X21 = −D2 A21 D1."""
    return -_dot(b_D2, _dot(b_A21, b_D1, PRECISION), PRECISION)


@triton.jit
def merge_block_inverse_64(b_D1, b_D2, b_D3, b_D4, b_A21, b_A31, b_A32, b_A41, b_A42, b_A43,
                           PRECISION: tl.constexpr):
    """The six off-diagonal 16 x 16 blocks X_ij (i > j) of (I + A)⁻¹ for a 64 x 64 unit
    lower-triangular I + A, given the diagonal inverses D_i = (I + A_ii)⁻¹ and the blocks
    A_ij, by block forward substitution: X_ij = −D_i Σ_{j ≤ k < i} A_ik X_kj (X_jj = D_j).
    Returns (X21, X31, X32, X41, X42, X43)."""
    b_X21 = merge_block_inverse_32(b_D1, b_D2, b_A21, PRECISION)
    b_X32 = -_dot(b_D3, _dot(b_A32, b_D2, PRECISION), PRECISION)
    b_X31 = -_dot(b_D3, _dot_acc(b_A32, b_X21, _dot(b_A31, b_D1, PRECISION), PRECISION),
                  PRECISION)
    b_X43 = -_dot(b_D4, _dot(b_A43, b_D3, PRECISION), PRECISION)
    b_X42 = -_dot(b_D4, _dot_acc(b_A43, b_X32, _dot(b_A42, b_D2, PRECISION), PRECISION),
                  PRECISION)
    b_S41 = _dot_acc(b_A42, b_X21, _dot(b_A41, b_D1, PRECISION), PRECISION)
    b_X41 = -_dot(b_D4, _dot_acc(b_A43, b_X31, b_S41, PRECISION), PRECISION)
    return b_X21, b_X31, b_X32, b_X41, b_X42, b_X43


@triton.jit
def _load_block(A, stride, row_first, col_first, L):
    """The 16 x 16 block of A at (row_first, col_first) as fp32; rows at or past ``L``
    (outside the sequence) read as zero rows."""
    o_i = tl.arange(0, 16)
    rows = row_first + o_i
    return tl.load(A + rows[:, None] * stride + (col_first + o_i)[None, :],
                   mask=(rows < L)[:, None], other=0).to(tl.float32)


@triton.jit
def store_block_16(Ai, stride, row_first, col_first, L, b_X):
    """Store a 16 x 16 block at (row_first, col_first) of a chunk's BT x BT matrix whose
    row r is at ``Ai + r * stride``; rows at or past ``L`` are not written."""
    o_i = tl.arange(0, 16)
    rows = row_first + o_i
    tl.store(Ai + rows[:, None] * stride + (col_first + o_i)[None, :],
             b_X.to(Ai.dtype.element_ty), mask=(rows < L)[:, None])


@triton.jit
def store_block_inverse_64(Ai, stride, L, b_D1, b_D2, b_D3, b_D4, b_X21, b_X31, b_X32, b_X41,
                           b_X42, b_X43):
    """Write a 64 x 64 block-lower-triangular inverse, zeros above the diagonal blocks."""
    b_zero = tl.zeros([16, 16], dtype=tl.float32)
    store_block_16(Ai, stride, 0, 0, L, b_D1)
    store_block_16(Ai, stride, 16, 0, L, b_X21)
    store_block_16(Ai, stride, 16, 16, L, b_D2)
    store_block_16(Ai, stride, 32, 0, L, b_X31)
    store_block_16(Ai, stride, 32, 16, L, b_X32)
    store_block_16(Ai, stride, 32, 32, L, b_D3)
    store_block_16(Ai, stride, 48, 0, L, b_X41)
    store_block_16(Ai, stride, 48, 16, L, b_X42)
    store_block_16(Ai, stride, 48, 32, L, b_X43)
    store_block_16(Ai, stride, 48, 48, L, b_D4)
    for j in tl.static_range(1, 4):
        store_block_16(Ai, stride, 0, j * 16, L, b_zero)
    for j in tl.static_range(2, 4):
        store_block_16(Ai, stride, 16, j * 16, L, b_zero)
    store_block_16(Ai, stride, 32, 48, L, b_zero)


@triton.jit
def _invert_diagonal_blocks(A, stride, L, NB: tl.constexpr):
    """(I + A_dd)⁻¹ of the NB 16 x 16 diagonal blocks of a chunk, as [NB, 16, 16]."""
    o_b = tl.arange(0, NB)[:, None, None]
    o_i = tl.arange(0, 16)
    rows = o_b * 16 + o_i[None, :, None]
    b_A = tl.load(A + rows * stride + o_b * 16 + o_i[None, None, :], mask=rows < L, other=0)
    return unit_lower_inverse_blocks(b_A.to(tl.float32))


def _default_config(args) -> Config:
    # One warp: every step works on 16 x 16 tiles (8 values a thread), and the small dots
    # of the block merge move data between layouts, which costs a block-wide barrier per
    # move with more warps (so did each substitution step until 2026-11-28). Measured on
    # H100 before that change (B=4, T=8192, H=32, fp32): BT=64 346 us at 1 warp, 555 at
    # 2, 856 at 4; BT=16 90 / 272 / 330 us. Many small programs keep the SMs busy.
    return Config(num_warps=1, num_stages=2)


def _config_space(args) -> list[Config]:
    return [Config(num_warps=w, num_stages=s) for w in (1, 2, 4) for s in (2, 3)]


@tuned(key=["A", "Ai", "BT"], default=_default_config, space=_config_space)
@triton.jit(do_not_specialize=["T", "H"])
def solve_tril_kernel(
    A,
    Ai,
    cu_seqlens,
    chunk_indices,
    T,
    H,
    BT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid ``(NT, B * H)``; ``A``/``Ai`` are ``[B, T, H, BT]`` contiguous."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_c, bos, seq_len = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    # Valid rows of this chunk; the last chunk of a sequence may be partial.
    L = seq_len - i_c * BT
    # int64: B * T * H * BT may exceed 2^31.
    offset = ((bos + i_c * BT) * H + i_h) * BT
    A += offset
    Ai += offset
    stride = H * BT

    if BT == 16:
        b_D1 = tl.reshape(_invert_diagonal_blocks(A, stride, L, 1), (16, 16))
        store_block_16(Ai, stride, 0, 0, L, b_D1)
    if BT == 32:
        b_D1, b_D2 = tl.split(tl.permute(_invert_diagonal_blocks(A, stride, L, 2), (1, 2, 0)))
        b_X21 = merge_block_inverse_32(b_D1, b_D2, _load_block(A, stride, 16, 0, L), PRECISION)
        store_block_16(Ai, stride, 0, 0, L, b_D1)
        store_block_16(Ai, stride, 0, 16, L, tl.zeros([16, 16], dtype=tl.float32))
        store_block_16(Ai, stride, 16, 0, L, b_X21)
        store_block_16(Ai, stride, 16, 16, L, b_D2)
    if BT == 64:
        b_D1, b_D2, b_D3, b_D4 = unstack_blocks_4(_invert_diagonal_blocks(A, stride, L, 4))
        b_X21, b_X31, b_X32, b_X41, b_X42, b_X43 = merge_block_inverse_64(
            b_D1, b_D2, b_D3, b_D4, _load_block(A, stride, 16, 0, L),
            _load_block(A, stride, 32, 0, L), _load_block(A, stride, 32, 16, L),
            _load_block(A, stride, 48, 0, L), _load_block(A, stride, 48, 16, L),
            _load_block(A, stride, 48, 32, L), PRECISION)
        store_block_inverse_64(Ai, stride, L, b_D1, b_D2, b_D3, b_D4, b_X21, b_X31, b_X32,
                               b_X41, b_X42, b_X43)


def _solve_tril_triton(A, cu_seqlens, offsets, output_dtype, chunk_indices):
    A = A.contiguous()
    B, T, H, BT = A.shape
    Ai = torch.empty(A.shape, dtype=output_dtype, device=A.device)
    if cu_seqlens is not None:
        if chunk_indices is None:
            chunk_indices = prepare_chunk_indices(cu_seqlens, BT, cu_seqlens_cpu=offsets)
        NT = chunk_indices.shape[0]
    else:
        NT = cdiv(T, BT)
    solve_tril_kernel[(NT, B * H)](
        A, Ai, cu_seqlens, chunk_indices, T, H=H, BT=BT, IS_VARLEN=cu_seqlens is not None,
        PRECISION=dot_precision(torch.float32))
    return Ai


def _solve_tril_torch(A, offsets, output_dtype):
    B, T, H, BT = A.shape
    if offsets is None:
        offsets = list(range(0, B * T + 1, T))
    chunk, position, NT = prepare_token_chunk_positions(offsets, BT, A.device)
    tiles = A.new_zeros(NT, BT, H, BT, dtype=torch.float32)
    tiles[chunk, position] = A.reshape(B * T, H, BT).to(torch.float32)
    # [NT, H, BT, BT]; padded rows stay zero, i.e. identity rows of I + A.
    lower = torch.tril(tiles.transpose(1, 2), diagonal=-1)
    eye = torch.eye(BT, dtype=torch.float32, device=A.device)
    inverse = torch.linalg.solve_triangular(lower + eye, eye.expand_as(lower), upper=False,
                                            unitriangular=True)
    return inverse.transpose(1, 2)[chunk, position].reshape(A.shape).to(output_dtype)


def solve_tril_fwd(A, cu_seqlens=None, output_dtype=torch.float32, chunk_indices=None,
                   offsets=None):
    """:func:`solve_tril` without input checks (for stages that validated already).

    ``offsets`` is the host copy of ``cu_seqlens`` when the caller has it.
    """
    output_dtype = output_dtype or A.dtype
    if select_backend(A) is Backend.TORCH:
        if cu_seqlens is not None and offsets is None:
            offsets = cu_seqlens.tolist()
        return _solve_tril_torch(A, offsets, output_dtype)
    return _solve_tril_triton(A, cu_seqlens, offsets, output_dtype, chunk_indices)


def solve_tril(A: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
               output_dtype: torch.dtype | None = torch.float32,
               chunk_indices: torch.Tensor | None = None) -> torch.Tensor:
    """``(I + A)⁻¹`` for every chunk of ``BT`` tokens and every head.

    Args:
        A: ``[B, T, H, BT]`` with ``BT`` in (16, 32, 64) the chunk size; row ``t`` holds
            the row of token ``t`` in its chunk's BT x BT matrix (columns = positions in
            the chunk). Only the strictly lower triangle of the valid rows/columns is
            read; fp32, fp16 or bf16.
        cu_seqlens: ``LongTensor [N + 1]`` packed-sequence offsets (then ``B == 1``);
            chunks restart at every sequence start.
        output_dtype: dtype of the result (default float32; None: ``A``'s dtype). The
            inverse is computed in float32 whatever the dtypes.
        chunk_indices: optional ``prepare_chunk_indices(cu_seqlens, BT)``.
    Returns:
        ``Ai [B, T, H, BT]`` in ``output_dtype``: per chunk, ``(I + A)⁻¹``, lower
        triangular with a unit diagonal; zeros above the diagonal and in the columns
        past the end of a partial chunk.
    """
    if cu_seqlens is None and use_op((A,)):
        return _solve_tril_op(A, output_dtype)
    check_tensor("A", A, ndim=4)
    dims = Dims()
    check_shape("A", A, "B T H BT", dims)
    check_positive_length(dims, "B T H")
    if dims["BT"] not in CHUNK_SIZES:
        raise ValueError(f"A: expected the chunk size BT = A.shape[-1] in {CHUNK_SIZES}, got "
                         f"shape {tuple(A.shape)}")
    if output_dtype is not None and output_dtype not in FLOAT_DTYPES:
        raise TypeError(f"output_dtype: expected None or one of float32, float16, bfloat16, "
                        f"got {output_dtype}")
    offsets = check_cu_seqlens(cu_seqlens, T=dims["T"], B=dims["B"])
    if cu_seqlens is not None:
        check_same_device(A=A, cu_seqlens=cu_seqlens)
    check_chunk_indices(chunk_indices, cu_seqlens, A.device)
    return solve_tril_fwd(A, cu_seqlens, output_dtype, chunk_indices, offsets)


# The function as the custom op fla::solve_tril for traced calls (packed sequences read
# offsets on the host: those stay eager); the op's step is the function.
_solve_tril_op = stage_op(
    "solve_tril", lambda A, output_dtype: solve_tril(A, None, output_dtype),
    schema="(Tensor A, ScalarType? output_dtype) -> Tensor", ahead=False)
