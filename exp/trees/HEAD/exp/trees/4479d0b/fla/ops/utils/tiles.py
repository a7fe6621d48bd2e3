"""Small rules shared by the chunk-stage launchers: chunk size, tile widths, devices."""
from __future__ import annotations

import torch

from fla.utils.grid import next_power_of_2
from fla.utils.triton_facts import MIN_DOT_TILE, is_interpreter


def check_chunk_size(chunk_size) -> int:
    """Chunk sizes are powers of two in [16, 256]: ``tl.arange`` needs a power of two and
    ``tl.dot`` operands at least 16 wide; beyond 256 the BT×BT tiles leave the registers."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if chunk_size < 16 or chunk_size > 256 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two in [16, 256], got {chunk_size}")
    return chunk_size


def tile_width(size: int, cap: int) -> int:
    """Power-of-two tile width for a dimension of ``size``: at most ``cap``, at least
    :data:`~fla.utils.triton_facts.MIN_DOT_TILE`; loads mask the columns past ``size``."""
    return max(MIN_DOT_TILE, min(cap, next_power_of_2(size)))


def state_row_heights(K: int) -> tuple[int, ...]:
    """Row heights a sequential chunk pass may hold its K x BV fp32 state at, as up to four
    [BK, BV] register tiles: 64 (K's width below it), and above K = 64 also 128, which
    halves the dots a chunk at K = 128 (one 128-deep K S or Q S instead of two 64-deep
    ones chained through their accumulator, one Kᵀ Vn update tile instead of two) for
    the same registers."""
    return tuple(sorted({tile_width(K, 64), tile_width(K, 128)}))


def check_buffer(name: str, t: torch.Tensor, shape, dtype: torch.dtype, device) -> None:
    """A tensor a caller hands a stage to read or write in place (an output buffer, an
    accumulator, saved states) must be contiguous, of ``shape``, ``dtype`` and on
    ``device``: the kernels address it by offsets computed from ``shape``, so anything
    else would put values in the wrong place, silently."""
    if (tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != torch.device(device)
            or not t.is_contiguous()):
        raise ValueError(f"{name}: expected a contiguous {dtype} tensor of shape "
                         f"{list(shape)} on {device}, got {t.dtype} {list(t.shape)} on "
                         f"{t.device}{'' if t.is_contiguous() else ' (not contiguous)'}")


def check_kernel_device(*tensors: torch.Tensor | None) -> None:
    """Stages that exist only as Triton kernels (the backward ones: the PyTorch path
    differentiates its forward instead) need CUDA tensors, or the interpreter."""
    if is_interpreter():
        return
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise ValueError("chunk backward stages run Triton kernels: expected CUDA tensors "
                             f"(or TRITON_INTERPRET=1 for CPU tensors), got a tensor on {t.device}")


def sixteen_bit(args, name: str = "k") -> bool:
    """Whether a tuning default's operand ``args[name]`` is a 16-bit tensor (absent: the
    usual bf16 is assumed). fp32 operands take twice the shared memory a pipeline stage,
    so the deeper pipelines measured for bf16 do not fit them."""
    t = args.get(name)
    return not isinstance(t, torch.Tensor) or t.element_size() == 2
