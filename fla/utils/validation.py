"""Input checks shared by every public entry point.

Each check runs before any kernel launches and raises ``ValueError`` (wrong shape,
layout, range or device) or ``TypeError`` (wrong type or dtype) with a message that names
the argument, what was expected and what was given. A bad call therefore leaves the CUDA
context healthy: the next good call works.

Shapes are checked against a layout string of dimension letters that are bound on first
use and compared afterwards, so one helper checks every tensor of every family::

    dims = Dims()
    check_shape("q", q, "B T H K", dims)
    check_shape("v", v, "B T H V", dims)        # B, T, H must agree with q
    check_shape("initial_state", h0, "N H K V", dims)
"""
from __future__ import annotations

import functools
import weakref
from typing import Iterable, Sequence

import torch

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256

__all__ = [
    "Dims", "FLOAT_DTYPES", "INDEX_DTYPES", "MAX_HEAD_DIM", "check_tensor", "check_dtype",
    "check_shape", "check_same_device", "check_head_dim", "check_time_major",
    "check_cu_seqlens", "read_offsets", "check_positive_length", "token_layout", "check_scale",
    "check_sequences", "time_major",
]


class Dims(dict):
    """Dimension letter -> size, bound by :func:`check_shape`; ``source`` remembers which
    argument fixed each letter so that a mismatch can name both arguments."""

    def __init__(self, **fixed: int):
        super().__init__(**fixed)
        self.source: dict[str, str] = {letter: "the caller" for letter in fixed}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(_dtype_name(d) for d in dtypes)


def check_tensor(name: str, x: object, *, dtypes: Sequence[torch.dtype] | None = FLOAT_DTYPES,
                 ndim: int | None = None) -> torch.Tensor:
    """``x`` is a tensor of one of ``dtypes`` (None: any) with ``ndim`` dims (None: any)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None:
        check_dtype(name, x, dtypes)
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got {x.dim()}-D with shape "
                         f"{tuple(x.shape)}")
    return x


def check_dtype(name: str, x: torch.Tensor, dtypes: Sequence[torch.dtype], *,
                what: str | None = None) -> None:
    """``x.dtype`` is one of ``dtypes``; ``what`` names the rule in the message (e.g.
    "the dtype of q" for a tensor that must match another)."""
    if x.dtype not in dtypes:
        expected = f"dtype in ({_names(dtypes)})" if what is None else \
            f"{what} ({_names(dtypes)})"
        raise TypeError(f"{name}: expected {expected}, got {_dtype_name(x.dtype)}")


def token_layout(letters: str, head_first: bool) -> str:
    """``"B T H K"`` as given (time-major) or with T and H swapped for ``head_first``."""
    if not head_first:
        return letters
    parts = letters.split()
    if len(parts) >= 3 and parts[1] == "T":
        parts[1], parts[2] = parts[2], parts[1]
    return " ".join(parts)


@functools.lru_cache(maxsize=256)
def _parse_layout(layout: str) -> tuple[tuple[str, int | None], ...]:
    """``"B T H K"`` -> ``(("B", None), ...)``; a digit is a fixed size: ``("64", 64)``."""
    return tuple((letter, int(letter) if letter.isdigit() else None)
                 for letter in layout.split())


def _shape_error(name: str, x: torch.Tensor, layout: str, dims: Dims) -> ValueError:
    """The message for ``x`` not matching ``layout`` (built only when it does not)."""
    letters = layout.split()
    pretty = "[" + ", ".join(letters) + "]"
    if x.dim() != len(letters):
        return ValueError(f"{name}: expected a {len(letters)}-D tensor of shape {pretty}, "
                          f"got {x.dim()}-D with shape {tuple(x.shape)}")
    for axis, (letter, size) in enumerate(zip(letters, x.shape)):
        if letter.isdigit():
            if size != int(letter):
                return ValueError(f"{name}: expected size {letter} at dim {axis} of "
                                  f"{pretty}, got shape {tuple(x.shape)}")
        elif dims.get(letter, size) != size:
            expected = ", ".join(str(dims.get(l, l)) for l in letters)
            return ValueError(
                f"{name}: expected shape {pretty} = [{expected}], got {tuple(x.shape)}: "
                f"{letter} is {size} here but {dims[letter]} in {dims.source[letter]}")
    return ValueError(f"{name}: shape {tuple(x.shape)} does not match {pretty}")


def check_shape(name: str, x: torch.Tensor, layout: str, dims: Dims) -> None:
    """Check ``x.shape`` against ``layout`` (letters separated by spaces; a digit is a
    fixed size) and bind new letters in ``dims``.

    Every public call checks several tensors, so the success path does no string work:
    the layout is parsed once, and the message is built only for a mismatch."""
    parsed = _parse_layout(layout)
    shape = x.shape
    if len(shape) != len(parsed):
        raise _shape_error(name, x, layout, dims)
    for (letter, fixed), size in zip(parsed, shape):
        if fixed is not None:
            if size != fixed:
                raise _shape_error(name, x, layout, dims)
        elif letter not in dims:
            dims[letter] = int(size)
            dims.source[letter] = name
        elif dims[letter] != size:
            raise _shape_error(name, x, layout, dims)


# What each dimension letter counts, for the messages of check_positive_length.
_DIM_NAMES = {"B": "batch size", "b": "batch size", "T": "sequence length",
              "H": "number of heads", "HV": "number of value heads", "HK": "number of heads",
              "G": "number of groups", "N": "number of sequences", "S": "gate width"}


def check_positive_length(dims: Dims, letters: str = "B T H HV") -> None:
    """Empty batches, empty sequences and zero heads are refused: no kernel handles a
    0-size grid, and a head count of 0 would reach a division (HV // H) first. Letters
    not bound in ``dims`` are skipped."""
    for letter in letters.split():
        if letter in dims and dims[letter] <= 0:
            what = _DIM_NAMES.get(letter, "size")
            raise ValueError(f"{dims.source.get(letter, 'input')}: expected "
                             f"{what} {letter} >= 1, got {letter} = {dims[letter]}")


def check_head_dim(name: str, size: int, letter: str = "K", limit: int = MAX_HEAD_DIM) -> None:
    """ValueError unless head dimension ``letter`` of ``name`` is in ``[1, limit]``."""
    if size > limit:
        raise ValueError(f"{name}: head dimension {letter} = {size} is over the limit; "
                         f"expected {letter} <= {limit}")
    if size < 1:
        raise ValueError(f"{name}: expected head dimension {letter} >= 1, got {size}")


def check_time_major(name: str, x: torch.Tensor, head_first: bool, *, head_dims: Sequence[int] = ()
                     ) -> None:
    """Refuse the likely ``[B, H, T, D]`` / ``[B, T, H, D]`` mix-up.

    Read in the layout the caller declared, a tensor whose head count exceeds both its
    sequence length and its head width is almost surely transposed: real models have at
    most a few hundred heads, each at least 16 wide, while a transposed ``[B, H, T, D]``
    puts the (long) sequence where the heads should be. Short multi-token calls with
    many narrow heads are the rare legitimate case this refuses; they can pass
    ``head_first=True`` tensors instead.
    """
    if x.dim() < 3:
        return
    t_axis, h_axis = (2, 1) if head_first else (1, 2)
    T, H = x.shape[t_axis], x.shape[h_axis]
    widest = max([x.shape[-1], *head_dims]) if x.dim() >= 4 else max([1, *head_dims])
    if T < H and H > widest:
        declared = "[B, H, T, ...]" if head_first else "[B, T, H, ...]"
        other = "[B, T, H, ...]" if head_first else "[B, H, T, ...]"
        fix = "head_first=False" if head_first else "head_first=True (or x.transpose(1, 2))"
        raise ValueError(
            f"{name}: shape {tuple(x.shape)} read as {declared} gives T = {T} tokens and "
            f"H = {H} heads (more heads than tokens and than the head width {widest}); "
            f"this looks like a {other} tensor. Expected {declared}; pass {fix}")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors (None skipped) live on one device; returns it."""
    device = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name}: expected device {device} (the device of {first}), got "
                             f"{t.device}")
    if device is None:
        raise ValueError("no tensor given")
    return device


# id(cu_seqlens) -> (weak reference, version counter, values on the host). One training
# step passes the same cu_seqlens to a dozen kernel stages: reading it once, not once per
# stage, saves a device synchronisation each time. (Not a WeakKeyDictionary: it compares
# keys with ==, which tensors answer elementwise.)
_HOST_OFFSETS: dict[int, tuple[weakref.ref, int, list[int]]] = {}


def read_offsets(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as a host list, read from the device once per tensor and version."""
    key, version = id(cu_seqlens), cu_seqlens._version
    cached = _HOST_OFFSETS.get(key)
    if cached is not None and cached[0]() is cu_seqlens and cached[1] == version:
        return list(cached[2])
    values = cu_seqlens.tolist()
    try:
        ref = weakref.ref(cu_seqlens, lambda _, key=key: _HOST_OFFSETS.pop(key, None))
    except TypeError:  # no weak references to this object: just don't cache
        return values
    _HOST_OFFSETS[key] = (ref, version, values)
    return list(values)


def check_cu_seqlens(cu_seqlens: torch.Tensor | None, *, T: int, B: int,
                     name: str = "cu_seqlens") -> list[int] | None:
    """Validate packed-sequence boundaries; returns them as a host list (None if None).

    Rules: 1-D int32/int64, at least two entries, starts at 0, strictly increasing, ends
    at T, and the batch holds a single packed row (B == 1). The values are read on the
    host once per tensor (cached while the tensor is unchanged); callers reuse the
    returned list (chunk indices, sequence count).
    """
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D torch.Tensor of int32/int64, got "
                        f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected dtype in ({_names(INDEX_DTYPES)}), got "
                        f"{_dtype_name(cu_seqlens.dtype)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name}: expected a 1-D tensor of N + 1 >= 2 offsets, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"{name}: packed sequences need the batch size B == 1 (all sequences "
                         f"concatenated along T), got B = {B}")
    values = read_offsets(cu_seqlens)
    if values[0] != 0:
        raise ValueError(f"{name}: expected the first offset to be 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            raise ValueError(f"{name}: expected strictly increasing offsets, got "
                             f"{values[i - 1]} then {values[i]} at positions {i - 1}, {i}")
    if values[-1] != T:
        raise ValueError(f"{name}: expected the last offset to equal the packed length "
                         f"T = {T}, got {values[-1]}")
    return values


def check_scale(scale: float | None, default: float) -> float:
    """``None`` -> ``default``; otherwise a finite Python number."""
    if scale is None:
        return default
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale: expected a number, got a tensor of shape "
                             f"{tuple(scale.shape)}")
        scale = float(scale)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    if scale != scale or scale in (float("inf"), float("-inf")):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return float(scale)


def check_sequences(cu_seqlens, initial_state, dims: Dims, *, device: torch.device,
                    batch_name: str, state_layout: str = "N H K V"):
    """The packed-sequence rules every op shares: ``cu_seqlens`` against ``dims``' T and B
    (:func:`check_cu_seqlens`), then ``initial_state`` against ``state_layout`` with N = B,
    or the number of sequences under ``cu_seqlens`` (``batch_name`` names the tensor that
    fixed B in the messages).

    Returns ``(offsets or None, N, cu_seqlens on device)``; offsets is the host copy of
    cu_seqlens, read here once.
    """
    offsets = check_cu_seqlens(cu_seqlens, T=dims["T"], B=dims["B"])
    N = len(offsets) - 1 if offsets is not None else dims["B"]
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=FLOAT_DTYPES)
        dims["N"] = N
        dims.source["N"] = ("cu_seqlens (N sequences)" if offsets is not None
                            else f"{batch_name} (N = B)")
        check_shape("initial_state", initial_state, state_layout, dims)
    if cu_seqlens is not None and cu_seqlens.device != device:
        cu_seqlens = cu_seqlens.to(device)
    return offsets, N, cu_seqlens


def contiguous_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t.contiguous()`` (no copy when it already is), None stays None."""
    return None if t is None else t.contiguous()


def time_major(x: torch.Tensor | None, head_first: bool) -> torch.Tensor | None:
    """``x`` as a contiguous ``[B, T, ...]`` tensor (``head_first``: given as
    ``[B, H, T, ...]``); None stays None. Kernels index with plain strides: a
    non-contiguous view is copied, never read as if it were contiguous."""
    if x is None:
        return None
    if head_first:
        x = x.transpose(1, 2)
    return x.contiguous()
