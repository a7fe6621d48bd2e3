"""Rotary position embedding (RoPE) on ``[B, T, H, D]`` queries and keys.

The first ``dim = 2R`` channels of every head are rotated in R planes; plane ``j`` of
the token at position ``p`` turns by ``θ = p · base^(−2j/dim)``::

    y₁ = x₁ cos θ − x₂ sin θ
    y₂ = x₂ cos θ + x₁ sin θ

where (x₁, x₂) of plane j are channels (j, j + R) in the rotate-half (GPT-NeoX) layout
and channels (2j, 2j + 1) in the interleaved (GPT-J) layout. Channels past ``dim`` pass
through. The rotation is orthogonal, so the backward is the same kernel turning by −θ.

cos θ and sin θ are computed in float32 and read from tables ``[L, R]`` indexed by the
position; the tensors keep their dtype and the arithmetic is float32.

Under ``torch.compile`` the kernel launch sits behind the custom op ``fla::rotary_apply``
(with a fake implementation and its autograd formula) so that dynamo traces through it
instead of breaking the graph at the Triton call.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import triton
import triton.language as tl

from fla.ops.utils.index import locate_sequence_chunk, varlen_chunk_indices
from fla.utils.backend import Backend, select_backend
from fla.utils.grid import cdiv, next_power_of_2
from fla.utils.tuning import Config, tuned
from fla.utils.validation import (
    INDEX_DTYPES,
    Dims,
    check_cu_seqlens,
    check_positive_length,
    check_same_device,
    check_shape,
    check_tensor,
    check_time_major,
)

__all__ = ["RotaryEmbedding", "rotary_embedding", "rotary_embedding_kernel"]

# Tokens per program. Fixed (not tuned) because varlen launches precompute the chunk list
# for it on the host; decoding (T = 1) wastes only masked lanes.
ROTARY_BT = 32


def _default(args) -> Config:
    # Measured on an H100 (q, k of [4, 4096, 32 | 8, 128] bf16, Triton 3.6): BT = 32 with
    # one head a program on 4 warps was the fastest of (BT, HB, warps) in
    # {32, 64} × {1, 4, 8} × {4, 8}; HB > 1 reads the cos/sin tiles once for HB heads
    # but holds them in registers across the loop (205 instead of 140 registers).
    return Config(HB=1, num_warps=4 if ROTARY_BT * args["D"] >= 4096 else 2, num_stages=1)


def _space(args) -> list[Config]:
    return [Config(HB=hb, num_warps=w, num_stages=1) for hb in (1, 2, 4, 8, 16)
            for w in (2, 4, 8)]


@tuned(key=["D", "R", "x", "INTERLEAVED"], default=_default, space=_space)
@triton.jit(do_not_specialize=["B", "T", "H", "offset", "L", "sx_t", "sx_h"])
def rotary_embedding_kernel(
    x, y, cos, sin, offsets, cu_seqlens, chunk_indices,
    B, T, H, offset, L, sx_t, sx_h,
    D: tl.constexpr, R: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr,
    HB: tl.constexpr, INTERLEAVED: tl.constexpr, PER_TOKEN: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, IS_VARLEN: tl.constexpr, CONJUGATE: tl.constexpr,
):
    """One program per (chunk of BT tokens, batch row, group of HB heads): y = rotation of
    x by ±θ. The grid is flat with the heads varying fastest, so that programs running
    together cover whole token rows (on an H100 the chunk-major order took 1.8× as long)
    and share their cos/sin rows in L2.

    Table row of a token: its global token index when PER_TOKEN (tables built for exactly
    these tokens), else its position ``t + offset (+ offsets[sequence])`` with t counted
    from the start of its sequence. Rows outside [0, L) read cos = 1, sin = 0.
    """
    NG = tl.cdiv(H, HB)
    i_p = tl.program_id(0)
    i_t, i_bg = i_p // (B * NG), i_p % (B * NG)
    i_b, i_g = i_bg // NG, i_bg % NG
    i_n, i_t, bos, T = locate_sequence_chunk(i_t, i_b, T, cu_seqlens, chunk_indices,
                                             IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    # Global token rows in int64: B·T·H·D may pass 2³¹ elements.
    tok = bos + o_t

    if PER_TOKEN:
        row = tok
    else:
        row = (o_t + offset).to(tl.int64)
        if HAS_OFFSETS:
            row += tl.load(offsets + i_n).to(tl.int64)
    m_row = m_t & (row >= 0) & (row < L)

    o_r = tl.arange(0, BR)
    m_r = o_r < R
    m_cs = m_row[:, None] & m_r[None, :]
    p_cs = row[:, None] * R + o_r[None, :]
    b_cos = tl.load(cos + p_cs, mask=m_cs, other=1.).to(tl.float32)
    b_sin = tl.load(sin + p_cs, mask=m_cs, other=0.).to(tl.float32)
    if CONJUGATE:
        b_sin = -b_sin

    if INTERLEAVED:
        c1 = 2 * o_r
        c2 = 2 * o_r + 1
    else:
        c1 = o_r
        c2 = o_r + R
    for j in range(HB):
        i_h = i_g * HB + j
        # The head test as a vector: the interpreter refuses a tensor & a scalar bool.
        m_th = m_t & ((o_t * 0 + i_h) < H)
        m_x = m_th[:, None] & m_r[None, :]
        x_row = x + tok[:, None] * sx_t + i_h * sx_h
        y_row = y + (tok[:, None] * H + i_h) * D
        b_x1 = tl.load(x_row + c1[None, :], mask=m_x, other=0.).to(tl.float32)
        b_x2 = tl.load(x_row + c2[None, :], mask=m_x, other=0.).to(tl.float32)
        b_y1 = b_x1 * b_cos - b_x2 * b_sin
        b_y2 = b_x2 * b_cos + b_x1 * b_sin
        tl.store(y_row + c1[None, :], b_y1.to(y.dtype.element_ty), mask=m_x)
        tl.store(y_row + c2[None, :], b_y2.to(y.dtype.element_ty), mask=m_x)
        if BP > 0:
            # Channels past the rotary dim are copied unchanged.
            o_p = 2 * R + tl.arange(0, BP)
            m_p = m_th[:, None] & (o_p < D)[None, :]
            b_p = tl.load(x_row + o_p[None, :], mask=m_p, other=0.)
            tl.store(y_row + o_p[None, :], b_p, mask=m_p)


def _rotary_apply_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         offsets: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                         offset: int, interleaved: bool, per_token: bool,
                         conjugate: bool) -> torch.Tensor:
    B, T, H, D = x.shape
    L, R = cos.shape
    # Token and head strides are free; the channels must be unit-stride and B, T must
    # flatten into one token axis (a slice of a fused projection qualifies).
    if x.stride(-1) != 1 or (B > 1 and x.stride(0) != T * x.stride(1)):
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
    if cu_seqlens is not None:
        host = check_cu_seqlens(cu_seqlens, T=T, B=B)
        cu_seqlens = cu_seqlens.to(x.device)
        chunk_indices = varlen_chunk_indices(cu_seqlens, ROTARY_BT, offsets=host)
        NT = chunk_indices.shape[0]
    else:
        chunk_indices = None
        NT = cdiv(T, ROTARY_BT)
    # One flat axis (up to 2³¹ − 1 programs): axes 1 and 2 stop at 65535.
    rotary_embedding_kernel[lambda meta: (NT * B * cdiv(H, meta["HB"]),)](
        x=x, y=y, cos=cos, sin=sin, offsets=offsets, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, B=1 if cu_seqlens is not None else B, T=T, H=H,
        offset=offset, L=L,
        sx_t=x.stride(1), sx_h=x.stride(2), D=D, R=R, BT=ROTARY_BT,
        BR=next_power_of_2(R),
        BP=0 if 2 * R == D else next_power_of_2(D - 2 * R),
        INTERLEAVED=interleaved, PER_TOKEN=per_token, HAS_OFFSETS=offsets is not None,
        IS_VARLEN=cu_seqlens is not None, CONJUGATE=conjugate,
    )
    return y


# ------------------------------------------------------------------- the custom op
@torch.library.custom_op("fla::rotary_apply", mutates_args=())
def rotary_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 offsets: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                 offset: int, interleaved: bool, per_token: bool,
                 conjugate: bool) -> torch.Tensor:
    """The Triton kernel as an op that ``torch.compile`` sees as one opaque node.

    Args:
        x: ``[B, T, H, D]``; cos, sin: ``[L, R]`` float32 with 2R ≤ D.
        offsets: ``[B]`` (or ``[N]`` with ``cu_seqlens``) int position offsets, or None.
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (B == 1), or None.
        offset: a position offset shared by every sequence.
        per_token: the tables hold one row per token (row = global token index) instead
            of one row per position.
        conjugate: rotate by −θ (the backward).
    Returns:
        ``[B, T, H, D]`` in x's dtype.
    """
    return _rotary_apply_triton(x, cos, sin, offsets, cu_seqlens, offset, interleaved,
                                per_token, conjugate)


@rotary_apply.register_fake
def _(x, cos, sin, offsets, cu_seqlens, offset, interleaved, per_token, conjugate):
    return x.new_empty(x.shape)


def _rotary_apply_setup(ctx, inputs, output):
    _, cos, sin, offsets, cu_seqlens, offset, interleaved, per_token, conjugate = inputs
    ctx.save_for_backward(cos, sin, offsets, cu_seqlens)
    ctx.args = (offset, interleaved, per_token, conjugate)


def _rotary_apply_backward(ctx, dy):
    cos, sin, offsets, cu_seqlens = ctx.saved_tensors
    offset, interleaved, per_token, conjugate = ctx.args
    # The Jacobian of a rotation is the rotation; its transpose turns the other way.
    dx = rotary_apply(dy, cos, sin, offsets, cu_seqlens, offset, interleaved, per_token,
                      not conjugate)
    return dx, None, None, None, None, None, None, None, None


rotary_apply.register_autograd(_rotary_apply_backward, setup_context=_rotary_apply_setup)


# ---------------------------------------------------------------------- torch path
def _local_positions(B: int, T: int, cu_seqlens: Optional[torch.Tensor],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local, seq)``: ``LongTensor [B·T]`` position of each token inside its sequence
    and the index of that sequence (b, or n under varlen). Built on the device without a
    host read, so that it traces under ``torch.compile``."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        local = t.repeat(B)
        seq = torch.arange(B, device=device).repeat_interleave(T)
        return local, seq
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)
    seq = torch.searchsorted(bounds, t, right=True) - 1
    return t - bounds[seq], seq


def _rotary_apply_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        offsets: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                        offset: int, interleaved: bool, per_token: bool) -> torch.Tensor:
    B, T, H, D = x.shape
    L, R = cos.shape
    if per_token:
        rows = torch.arange(B * T, device=x.device)
    else:
        local, seq = _local_positions(B, T, cu_seqlens, x.device)
        rows = local + offset
        if offsets is not None:
            rows = rows + offsets.to(x.device, torch.int64)[seq]
    valid = ((rows >= 0) & (rows < L))[:, None]
    safe = rows.clamp(0, L - 1)
    c = torch.where(valid, cos[safe].float(), 1.0).view(B, T, 1, R)
    s = torch.where(valid, sin[safe].float(), 0.0).view(B, T, 1, R)
    acc = torch.promote_types(x.dtype, torch.float32)
    rot = x[..., :2 * R].to(acc)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :R], rot[..., R:]
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    if interleaved:
        out = torch.stack((y1, y2), dim=-1).flatten(-2)
    else:
        out = torch.cat((y1, y2), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., 2 * R:]), dim=-1)


def _apply(x, cos, sin, offsets, cu_seqlens, offset, interleaved, per_token):
    if select_backend(x) is Backend.TORCH:
        return _rotary_apply_torch(x, cos, sin, offsets, cu_seqlens, offset, interleaved,
                                   per_token)
    return rotary_apply(x, cos, sin, offsets, cu_seqlens, offset, interleaved, per_token,
                        False)


# ------------------------------------------------------------------------- checks
def _check_cu_seqlens(cu_seqlens, B: int, T: int) -> list[int] | None:
    """The host offsets (None without cu_seqlens, or while compiling)."""
    if cu_seqlens is None:
        return None
    if torch.compiler.is_compiling():
        # Reading the offsets on the host would break the graph: check what the shape
        # tells here; the values are checked inside the op, before the kernel.
        if cu_seqlens.dtype not in INDEX_DTYPES or cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens: expected a 1-D int32/int64 tensor, got "
                             f"{cu_seqlens.dtype} with shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need the batch size B == 1 "
                             f"(all sequences concatenated along T), got B = {B}")
        return None
    return check_cu_seqlens(cu_seqlens, T=T, B=B)


def _check_offsets(name: str, value, B: int, cu_seqlens) -> Optional[torch.Tensor]:
    """An int offset passes through; a tensor must be int with one entry per sequence."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        raise TypeError(f"{name}: expected an int or an integer tensor, got "
                        f"{type(value).__name__}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}: expected a position offset >= 0, got {value}")
        return None
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected an int32/int64 tensor, got {value.dtype}")
    if cu_seqlens is None:
        expected, what = (B,), f"[B] = [{B}] (one offset per batch row)"
    else:
        expected = (cu_seqlens.shape[0] - 1,)
        what = f"[N] = [{expected[0]}] (one offset per packed sequence)"
    if tuple(value.shape) != expected:
        raise ValueError(f"{name}: expected shape {what}, got {tuple(value.shape)}")
    return value


def _check_tables(cos, sin, D: int) -> int:
    check_tensor("cos", cos, ndim=2)
    check_tensor("sin", sin, ndim=2)
    if cos.shape != sin.shape:
        raise ValueError(f"sin: expected the shape of cos {tuple(cos.shape)}, got "
                         f"{tuple(sin.shape)}")
    L, R = cos.shape
    if 2 * R > D:
        raise ValueError(f"cos: [L, R] = {tuple(cos.shape)} rotates 2R = {2 * R} channels, "
                         f"wider than the head dim {D} of x")
    if L < 1 or R < 1:
        raise ValueError(f"cos: expected a non-empty [L, R] table, got {tuple(cos.shape)}")
    return L


# ---------------------------------------------------------------------- functional
def rotary_embedding(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the first 2R channels of every head of ``x`` by the angles in the tables.

    Args:
        x: ``[B, T, H, D]`` fp32/fp16/bf16.
        cos, sin: ``[L, R]`` tables of cos θ and sin θ by position (2R ≤ D), read in
            float32.
        interleaved: pairs are channels (2j, 2j+1) (GPT-J) instead of (j, j+R) (NeoX).
        seqlen_offsets: position of the first token: an int, or an int tensor ``[B]``
            (``[N]`` with ``cu_seqlens``). Token t of a sequence sits at offset + t.
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (B == 1); positions restart at 0
            at every sequence start.

    Returns:
        ``[B, T, H, D]`` in x's dtype: ``y₁ = x₁ cos − x₂ sin, y₂ = x₂ cos + x₁ sin`` on
        the rotated channels, x elsewhere. Differentiable in x.

    An int offset is checked against L; positions from a tensor of offsets are not (that
    would read the device): any outside [0, L) are left unrotated.
    """
    check_tensor("x", x, ndim=4)
    B, T, H, D = x.shape
    dims = Dims()
    check_shape("x", x, "B T H D", dims)
    check_positive_length(dims)
    check_time_major("x", x, False)
    L = _check_tables(cos, sin, D)
    check_same_device(x=x, cos=cos, sin=sin)
    host = _check_cu_seqlens(cu_seqlens, B, T)
    offsets = _check_offsets("seqlen_offsets", seqlen_offsets, B, cu_seqlens)
    offset = 0 if offsets is not None else int(seqlen_offsets)
    if offsets is None:
        longest = T if host is None else max(b - a for a, b in zip(host[:-1], host[1:]))
        if offset + longest > L:
            raise ValueError(f"cos: the tables hold L = {L} positions, but positions up to "
                             f"seqlen_offsets + T - 1 = {offset + longest - 1} are needed")
    return _apply(x, cos.float(), sin.float(), offsets, cu_seqlens, offset, interleaved,
                  False)


# -------------------------------------------------------------------------- module
class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to queries and keys.

    Args:
        dim: rotated channels of each head (even, at most the head dim D; the others
            pass through). The *head* width, not the model width.
        base: θ_j = p · base^(−2j/dim).
        interleaved: GPT-J pairs (2j, 2j+1) instead of GPT-NeoX halves (j, j + dim/2).

    The cos/sin tables are float32, cached per device (not buffers: ``model.to(bf16)``
    must not round them) and grown to the next power of two of the needed length.
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be an even int >= 2 (channels "
                             f"rotated in pairs), got dim={dim}")
        if not base > 0:
            raise ValueError(f"RotaryEmbedding: base must be > 0, got {base}")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}"

    def inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        """``[dim / 2]`` float32: base^(−2j/dim)."""
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        return 1.0 / (self.base ** exponent)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        return freqs.cos(), freqs.sin()

    def cos_sin(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``[L, dim / 2]`` float32 tables with L ≥ length, cached per device."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # "cuda" and "cuda:0" must share one entry.
            device = torch.device("cuda", torch.cuda.current_device())
        cached = self._tables.get(device)
        if cached is None or cached[0].shape[0] < length:
            # A power of two: decoding one token at a time regrows log(T) times, not T.
            size = next_power_of_2(max(int(length), 16))
            cached = self._angles(torch.arange(size, device=device))
            self._tables[device] = cached
        return cached

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        seqlen_offset: int | torch.Tensor = 0,
        max_seqlen: int | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k by their token positions.

        Args:
            q: ``[B, T, H, D]``; k: ``[B, T, HK, D]`` (head counts may differ).
            seqlen_offset: position of the first token (decoding: the cached length), an
                int or an int tensor ``[B]`` (``[N]`` with ``cu_seqlens``).
            max_seqlen: grow the cached tables to at least this many positions.
            cu_seqlens: ``[N + 1]`` packed-sequence offsets (B == 1); positions restart
                at every sequence start.

        Returns:
            ``(q_rot, k_rot)``, shapes and dtypes of q and k.
        """
        check_tensor("q", q, ndim=4)
        check_tensor("k", k, ndim=4)
        dims = Dims()
        check_shape("q", q, "B T H D", dims)
        D = dims["D"]
        if self.dim > D:
            raise ValueError(
                f"RotaryEmbedding(dim={self.dim}) is wider than the head dim {D} of q: dim "
                f"is the rotated width of one head (e.g. hidden_size // num_heads), not "
                f"the model width")
        if k.shape[-1] != D:
            raise ValueError(f"k: head dim {k.shape[-1]} differs from the head dim {D} of "
                             f"q; rotary needs q and k of one head width")
        check_shape("k", k, "B T HK D", dims)
        check_positive_length(dims, "B T H HK")
        check_time_major("q", q, False)
        check_time_major("k", k, False)
        check_same_device(q=q, k=k)
        B, T = dims["B"], dims["T"]
        _check_cu_seqlens(cu_seqlens, B, T)
        offsets = _check_offsets("seqlen_offset", seqlen_offset, B, cu_seqlens)
        if max_seqlen is not None and (isinstance(max_seqlen, bool)
                                       or not isinstance(max_seqlen, int)):
            raise TypeError(f"max_seqlen: expected an int or None, got "
                            f"{type(max_seqlen).__name__}")

        if offsets is None:
            # T bounds every sequence's length, packed or not.
            needed = max(T + int(seqlen_offset), max_seqlen or 0)
            cos, sin = self.cos_sin(needed, q.device)
            args = (None, cu_seqlens, int(seqlen_offset), self.interleaved, False)
        else:
            # Per-row offsets: tables for exactly these tokens' positions. No host read of
            # the largest offset (a device sync, and a graph break under torch.compile),
            # and any position — even a negative one of a left-padded row — is exact.
            if max_seqlen is not None:
                self.cos_sin(max_seqlen, q.device)
            local, seq = _local_positions(B, T, cu_seqlens, q.device)
            cos, sin = self._angles(local + offsets.to(q.device, torch.int64)[seq])
            args = (None, cu_seqlens, 0, self.interleaved, True)
        return _apply(q, cos, sin, *args), _apply(k, cos, sin, *args)
