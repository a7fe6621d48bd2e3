"""Host-side index helpers for packed (variable-length) batches.

Packed sequences are described by ``cu_seqlens`` (``[N + 1]`` offsets, 0 first, total
length last). Chunked kernels run one program per chunk of ``chunk_size`` tokens of one
sequence; the helpers here turn the offsets into that list of chunks once per call, on
the host, so that no kernel needs a search and no launcher reads the device twice.

Every helper takes ``cu_seqlens`` either as a tensor or as the host list that
:func:`fla.utils.validation.check_cu_seqlens` returns. Passing the tensor together with
that list (``cu_seqlens_cpu=``) builds the result on the tensor's device without a
device-to-host read. Results computed from a tensor are cached (a few entries, keyed by
the tensor's identity and version), so the stages of one forward/backward pass share
them: treat the returned tensors as read-only.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from fla.utils.validation import read_offsets

__all__ = [
    "chunk_counts",
    "prepare_lens",
    "prepare_chunk_indices",
    "prepare_chunk_offsets",
    "prepare_token_chunk_positions",
    "varlen_chunk_indices",
    "varlen_chunk_offsets",
]

_CACHE_SIZE = 16
_cache: list[tuple] = []  # (weakref to cu_seqlens, version, what, chunk_size, device, value)
_cache_lock = threading.Lock()


def _host_offsets(cu_seqlens, cu_seqlens_cpu=None) -> list[int]:
    """The offsets as a Python list; reads the device only when no host copy is given."""
    if cu_seqlens_cpu is not None:
        source = cu_seqlens_cpu
    else:
        source = cu_seqlens
    if isinstance(source, torch.Tensor):
        return read_offsets(source)
    return [int(x) for x in source]


def _check_chunk_size(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
    return chunk_size


def _cached(what: str, cu_seqlens, chunk_size: int, build: Callable[[], torch.Tensor]
            ) -> torch.Tensor:
    """``build()`` memoised on (the tensor ``cu_seqlens`` itself, its version, ...).

    Only tensors are cached: a list carries no identity that outlives the call. Entries
    whose tensor died are dropped; the cache keeps the last ``_CACHE_SIZE`` results.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        return build()
    version = cu_seqlens._version
    with _cache_lock:
        for entry in _cache:
            ref, ver, w, cs, value = entry
            if ref() is cu_seqlens and ver == version and w == what and cs == chunk_size:
                return value
    value = build()
    with _cache_lock:
        _cache[:] = [e for e in _cache if e[0]() is not None][-(_CACHE_SIZE - 1):]
        _cache.append((weakref.ref(cu_seqlens), version, what, chunk_size, value))
    return value


def _target_device(cu_seqlens) -> torch.device:
    return cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")


def prepare_lens(cu_seqlens: torch.Tensor | Sequence[int]) -> torch.Tensor | list[int]:
    """Sequence lengths ``cu_seqlens[1:] - cu_seqlens[:-1]``.

    Args:
        cu_seqlens: ``[N + 1]`` offsets, a tensor or a host list.
    Returns:
        ``[N]`` lengths: a tensor (same device and dtype) for a tensor, a list for a list.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens[1:] - cu_seqlens[:-1]
    values = [int(x) for x in cu_seqlens]
    return [b - a for a, b in zip(values[:-1], values[1:])]


def chunk_counts(offsets: Sequence[int], chunk_size: int) -> list[int]:
    """Chunks of each packed sequence, from the host token offsets ``[N + 1]``."""
    return [-(-(b - a) // chunk_size) for a, b in zip(offsets[:-1], offsets[1:])]


def prepare_chunk_offsets(cu_seqlens: torch.Tensor | Sequence[int], chunk_size: int,
                          cu_seqlens_cpu: torch.Tensor | Sequence[int] | None = None
                          ) -> torch.Tensor:
    """Cumulative chunk counts: entry ``n`` is the index of sequence ``n``'s first chunk.

    Args:
        cu_seqlens: ``[N + 1]`` offsets, a tensor or a host list.
        chunk_size: tokens per chunk; the last chunk of a sequence may be partial.
        cu_seqlens_cpu: optional host copy of ``cu_seqlens`` (list or CPU tensor), used
            instead of reading the device.
    Returns:
        ``LongTensor [N + 1]`` on ``cu_seqlens``' device (CPU for a list), starting at 0
        and ending at the total number of chunks ``NT``.
    """
    chunk_size = _check_chunk_size(chunk_size)

    def build() -> torch.Tensor:
        counts = chunk_counts(_host_offsets(cu_seqlens, cu_seqlens_cpu), chunk_size)
        out = [0]
        for c in counts:
            out.append(out[-1] + c)
        return torch.tensor(out, dtype=torch.int64).to(_target_device(cu_seqlens))

    return _cached("chunk_offsets", cu_seqlens, chunk_size, build)


def prepare_chunk_indices(cu_seqlens: torch.Tensor | Sequence[int], chunk_size: int,
                          cu_seqlens_cpu: torch.Tensor | Sequence[int] | None = None
                          ) -> torch.Tensor:
    """The chunks of a packed batch, in order: ``(sequence index, chunk index in it)``.

    For sequences of lengths ``L_n``, sequence ``n`` contributes ``ceil(L_n / chunk_size)``
    rows ``(n, 0), (n, 1), ...``. Chunked kernels launch one program per row.

    Args:
        cu_seqlens: ``[N + 1]`` offsets, a tensor or a host list.
        chunk_size: tokens per chunk.
        cu_seqlens_cpu: optional host copy of ``cu_seqlens`` (list or CPU tensor), used
            instead of reading the device.
    Returns:
        ``LongTensor [NT, 2]`` on ``cu_seqlens``' device (CPU for a list), contiguous.
    """
    chunk_size = _check_chunk_size(chunk_size)

    def build() -> torch.Tensor:
        counts = torch.tensor(
            chunk_counts(_host_offsets(cu_seqlens, cu_seqlens_cpu), chunk_size),
            dtype=torch.int64)
        seq = torch.repeat_interleave(torch.arange(counts.numel(), dtype=torch.int64), counts)
        first = torch.cumsum(counts, 0) - counts
        chunk = torch.arange(seq.numel(), dtype=torch.int64) - first[seq]
        return torch.stack([seq, chunk], dim=1).to(_target_device(cu_seqlens))

    return _cached("chunk_indices", cu_seqlens, chunk_size, build)


def prepare_token_chunk_positions(offsets: Sequence[int], chunk_size: int,
                                  device: torch.device | str = "cpu"
                                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each token of a packed row sits in the chunk grid (PyTorch paths).

    Args:
        offsets: host list of ``N + 1`` sequence offsets over a row of ``T`` tokens (for
            ``B`` unpacked sequences of length ``T`` flattened: ``0, T, 2T, ..., BT``).
        chunk_size: tokens per chunk.
    Returns:
        ``(chunk, position, NT)``: ``LongTensor [T]`` global chunk index of each token,
        ``LongTensor [T]`` its row inside that chunk, and the number of chunks ``NT``.
    """
    chunk_size = _check_chunk_size(chunk_size)
    offsets = [int(x) for x in offsets]
    # Every size comes from the host offsets (no tensor read, no data-dependent shape:
    # torch.compile traces this with fullgraph=True); the tensors are built at the end.
    counts = [-(-(e - s) // chunk_size) for s, e in zip(offsets[:-1], offsets[1:])]
    first_chunk = [0]
    for c in counts[:-1]:
        first_chunk.append(first_chunk[-1] + c)
    tokens = torch.arange(offsets[-1], dtype=torch.int64, device=device)
    # The sequence of each token: how many sequence ends lie at or before it.
    seq = torch.searchsorted(torch.tensor(offsets[1:], dtype=torch.int64, device=device),
                             tokens, right=True)
    local = tokens - torch.tensor(offsets[:-1], dtype=torch.int64, device=device)[seq]
    chunk = torch.tensor(first_chunk, dtype=torch.int64, device=device)[seq] + \
        local // chunk_size
    return chunk, local % chunk_size, sum(counts)


def varlen_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int,
                         chunk_indices: torch.Tensor | None = None,
                         offsets: list[int] | None = None) -> torch.Tensor:
    """``[NT, 2]`` rows (sequence index, chunk index within the sequence) for a launcher,
    on ``cu_seqlens``' device. A caller's ``chunk_indices`` is checked (dtype, shape) and
    reused; otherwise :func:`prepare_chunk_indices` builds it from the host offsets (read
    once per tensor) and caches it for the other stages of the same pass."""
    offsets = read_offsets(cu_seqlens) if offsets is None else offsets
    if chunk_indices is None:
        return prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=offsets)
    total = sum(-(-(e - s) // chunk_size) for s, e in zip(offsets[:-1], offsets[1:]))
    if not isinstance(chunk_indices, torch.Tensor) or chunk_indices.dtype not in (
            torch.int32, torch.int64):
        raise TypeError("chunk_indices: expected an int32/int64 tensor, got "
                        f"{getattr(chunk_indices, 'dtype', type(chunk_indices).__name__)}")
    if tuple(chunk_indices.shape) != (total, 2):
        raise ValueError(f"chunk_indices: expected shape [NT, 2] = [{total}, 2] for "
                         f"chunk_size {chunk_size}, got {tuple(chunk_indices.shape)}")
    return chunk_indices.to(cu_seqlens.device).contiguous()


def varlen_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int,
                         offsets: list[int] | None = None) -> torch.Tensor:
    """``[N + 1]``: index of each sequence's first chunk among all chunks (the total
    last), on ``cu_seqlens``' device, without a device read when ``offsets`` is given."""
    offsets = read_offsets(cu_seqlens) if offsets is None else offsets
    return prepare_chunk_offsets(cu_seqlens, chunk_size, cu_seqlens_cpu=offsets)


@triton.jit
def runtime_zero(T):
    """Inside a kernel: 0 from a runtime length ``T`` (never negative), in a form the
    compiler cannot fold (a ``T`` that Triton specialised to a constant folds anyway; it
    still compiles). The chunk loop of ``segment_of_program``'s callers (the passes of
    ``chunk_fwd_inter``, ``chunk_gk_fwd`` and ``chunk_delta_h_bwd``) starts here: from a
    constant 0 ptxas allocated the K = 128 forward passes' registers otherwise on sm_90
    and they spilled more (Triton 3.6, bf16: 144-184 B of stack against 8-96 B). Measured
    on an H200 in alternating processes: simple GLA's forward at 1x8192x96x128 0.596 ->
    0.552 ms, the delta rule's 1.065 -> 0.990; its K = 256 forward 1.4% slower."""
    return tl.cast(T < 0, tl.int32)


@triton.jit
def locate_sequence(i_n, T, cu_seqlens, IS_VARLEN: tl.constexpr):
    """Inside a kernel: sequence ``i_n``'s first token, an int64 row of the packed token
    axis, and its length (int32): from ``cu_seqlens`` under varlen, else the n-th of the
    B rows of length T."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
    return bos, T


@triton.jit
def first_chunk_row(i_n, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Inside a kernel: the row of sequence n's first chunk in a per-chunk tensor ``[B,
    NT, ...]`` (``[1, NT_total, ...]`` from ``chunk_offsets`` with packed sequences),
    int64; T is the sequence's length."""
    if IS_VARLEN:
        row = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        row = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return row


@triton.jit
def locate_sequence_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN: tl.constexpr):
    """Inside a kernel with one program per chunk: map the grid's chunk index ``i_t`` and
    batch index ``i_b`` to (the sequence's index n, the chunk's index within it, the
    sequence's first token as an int64 row of the ``[B·T]`` token axis, its length).

    Under varlen ``i_t`` indexes the rows of ``chunk_indices`` (sequence, chunk in
    sequence) and the batch is the single packed row; otherwise sequences are the B rows
    of length T and n = ``i_b``.
    """
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
    else:
        i_n = i_b
    bos, T = locate_sequence(i_n, T, cu_seqlens, IS_VARLEN)
    return i_n, i_t, bos, T


@triton.jit
def locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN: tl.constexpr):
    """:func:`locate_sequence_chunk` without the sequence index: ``(i_t, bos, T)``."""
    _, i_t, bos, T = locate_sequence_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    return i_t, bos, T
