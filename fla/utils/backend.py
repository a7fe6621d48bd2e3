"""Which implementation runs a call: the Triton kernels or the PyTorch path.

* CUDA tensors -> Triton kernels.
* CPU tensors  -> the PyTorch path (autograd through plain tensor ops).
* CPU tensors with ``TRITON_INTERPRET=1`` -> the Triton kernels, interpreted on the CPU.
  This is how CI, which has no GPU, tests the kernels themselves.

``FLA_BACKEND=torch`` forces the PyTorch path everywhere (useful to bisect a wrong
result between a kernel and the maths); ``FLA_BACKEND=triton`` forces the kernels (on
CPU tensors that only works in the interpreter).
"""
from __future__ import annotations

import enum
import os

import torch

from fla.utils.triton_facts import is_interpreter


class Backend(str, enum.Enum):
    """Where an op runs: the Triton kernels (CUDA tensors, or any under
    ``TRITON_INTERPRET=1``) or the PyTorch path (CPU tensors); ``FLA_BACKEND`` forces one."""
    TRITON = "triton"
    TORCH = "torch"


def forced_backend() -> Backend | None:
    value = os.environ.get("FLA_BACKEND", "").strip().lower()
    if not value:
        return None
    try:
        return Backend(value)
    except ValueError:
        raise ValueError(
            f"FLA_BACKEND: expected one of 'triton', 'torch' or unset, got {value!r}"
        ) from None


def select_backend(*tensors: torch.Tensor | None) -> Backend:
    """The backend for a call on ``tensors`` (``None`` entries are ignored).

    Raises ``ValueError`` when ``FLA_BACKEND=triton`` asks for kernels on CPU tensors
    outside the interpreter: nothing could run them.
    """
    # Runs at every call of every op and module: one environment read when unset, a
    # plain loop (no generator).
    forced = forced_backend() if os.environ.get("FLA_BACKEND") else None
    if forced is Backend.TORCH:
        return Backend.TORCH
    for t in tensors:
        if t is not None and t.is_cuda:
            return Backend.TRITON
    if is_interpreter():
        return Backend.TRITON
    if forced is Backend.TRITON:
        raise ValueError(
            "FLA_BACKEND=triton: the inputs are CPU tensors and TRITON_INTERPRET is not "
            "set, so no Triton kernel can run; set TRITON_INTERPRET=1 or move the inputs "
            "to a CUDA device"
        )
    return Backend.TORCH


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Shorthand for ``select_backend(*tensors) is Backend.TRITON``."""
    return select_backend(*tensors) is Backend.TRITON
