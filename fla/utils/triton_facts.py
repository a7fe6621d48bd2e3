"""Every fact about the installed Triton release, in one place.

Kernels and launchers import these names instead of testing versions themselves, so a
new Triton release is handled by editing this file alone.

Facts we rely on (and why they matter):

* Block pointers (the block-pointer constructor and its advance call) are gone in
  Triton 3.9. No kernel of ours uses them: tiles are addressed with plain pointer
  arithmetic, which compiles on every release from 3.3 on.
* The CPU interpreter (``TRITON_INTERPRET=1``) computes ``tl.dot`` on bf16 operands
  wrongly on some releases; tests run the interpreter in fp32/fp16 and bf16 on the GPU.
* The interpreter casts fp32 to bf16 by truncation, the GPU to the nearest value: a bf16
  result computed in the interpreter can be one ulp (2^-7 relative) off, not half of one.
* ``triton.autotune`` with several configs fails in the interpreter without a GPU
  driver; our tuning layer (``fla.utils.tuning``) never calls it.
* Some releases have no direct bf16 -> fp16 conversion; kernels cast through fp32.
* The interpreter of Triton 3.3 to 3.6 holds scalar kernel arguments as one-element
  arrays and turns them into loop bounds with ``int()``, which NumPy 2 refuses ("only
  0-dimensional arrays can be converted"): interpreter runs there need NumPy < 2 (the
  kernels' fp32 interpreter tests pass on 3.3.1, 3.4.0, 3.5.1 with NumPy 1.26.4, and on
  3.7.1, 3.8.0, 3.9.0 with NumPy 2.4). Compiled kernels are unaffected.
"""
from __future__ import annotations

import functools
import os
import re

import triton
import triton.language as tl

MIN_TRITON = (3, 3)


def _parse_version(text: str) -> tuple[int, int, int]:
    # Only the leading digits of each piece count: "1rc1" is 1 and "0a0" is 0 (gathering
    # every digit would read "3.10.1rc1" as 3.10.11).
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = re.match(r"\d*", piece).group(0)
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


TRITON_VERSION: tuple[int, int, int] = _parse_version(triton.__version__)
TRITON_VERSION_STRING: str = triton.__version__

HAS_TENSOR_DESCRIPTOR: bool = hasattr(tl, "make_tensor_descriptor")

# The narrowest tile side our kernels give ``tl.dot``. Triton accepts 16, but Triton 3.6
# on H100 miscompiled a [64, 64] x [64, 16] fp16 product (compute-sanitizer: an
# out-of-bounds shared-memory read, then an illegal address); 32 with masked columns
# costs nothing at real head sizes (>= 64). It is the floor of the column tiles that
# ``tile_width`` gives the state passes (the intra-chunk kernels' fixed 16 x 16 blocks are
# another matter); the segment combine's thin-grid tile goes under it, its fp32 dots
# checked by compute-sanitizer (fla.ops.common.chunk_state_combine.COMBINE_THIN_TILE).
MIN_DOT_TILE = 32

# Triton 3.3.1 aborted compiling the vector-gate state pass with its output fused
# (chunk_gk_fwd_h_kernel, STORE_O) at 8 warps while it held S [BK, BV]:
# "chooseStMatrixLayoutLeadingOffset: Each chunk is filled in with a single warp"
# (offline sm_90 compile, every BV and stage count; the transposed pass on its gated
# operands builds and runs right there, chunk_gk_fwd._h_max_warps), and so the state
# passes at K = 256 (chunk_gated_delta_rule_fwd_h_kernel and
# chunk_gated_delta_rule_bwd_dhu_kernel, 8 warps, BV = 32 and 64) and the WY backward at
# 8 warps (prepare_wy_repr_bwd_kernel, K = 128 and 256, every tile), and the fused
# forward pass's K = 256 output pass at 8 warps (chunk_gated_delta_rule_fwd_inter_kernel,
# 2026-11-27: ConvertTritonGPUToLLVM fails). On the GPU (H100
# config sweeps) also fwd_h with W at K = 128 and bwd_dhu at K = 64 and 128. 3.6 and 3.9
# compile and run all of them. 3.4.0 and 3.5.1 build them offline (sm_90, 2026-11-26) and,
# with this fact forced on, passed every GPU config sweep that holds these kernels: the
# backward stages' at K = 128 and 256, the forward stages' at 128 and 256, the fused
# forward pass's at 64, 128 and 256 and GLA's at 128 (3.5.1 on an H200, 3.4.0 on an
# H100, 2026-11-27), and GLA's at 256 (3.4.0; on 3.5.1 one tile of it failed, the one
# TRANSPOSED_GK_128X128_OK below governs). 3.3 alone keeps the rule.
WIDE_STMATRIX_8_WARPS_OK: bool = TRITON_VERSION >= (3, 4)

# Triton 3.5.1 (H200, 2026-11-27, GLA's config sweep at K = V = 256) computes the
# transposed vector-gate state pass (chunk_gk_fwd_h_kernel) at 128 rows x 128 columns
# with 8 warps 2.2-2.6e-2 off the float64 loop, beyond the 2e-2 every other config of the
# space met there; 3.3.1, 3.4.0, 3.6.0, 3.7.0, 3.8.0 and 3.9.0 (H100) pass the same sweep
# with it (GLA's and RWKV6's on 3.7.0 and 3.8.0). On 3.5 the
# space leaves that tile out.
TRANSPOSED_GK_128X128_OK: bool = not ((3, 5) <= TRITON_VERSION < (3, 6))

# Triton 3.9.0 on H100 computes non-finite dv in chunk_bwd_dv_local_kernel at K = 256
# with 4 warps (BK = 64 at 2 and 3 stages, BK = 32 at 3; 2 and 8 warps correct at every
# tile), the staged backward's bf16 test at 2 x 1000 x 2 x 256 and each config forced in
# turn (2026-11-26). 3.6 passes its whole space there, 3.3.1 the 4-warp default, 3.7.0
# and 3.8.0 every config of it at K = 256 with the 4-warp ones forced in (H100,
# 2026-11-27): 3.9 alone computes them wrong.
FOUR_WARP_WIDE_DV_LOCAL_OK: bool = TRITON_VERSION < (3, 9)


def warp_choices(stmatrix_prone: bool) -> tuple[int, ...]:
    """Warp counts for a tuning space: 2, 4 and 8, less 8 for a kernel that this Triton
    aborts at 8 warps (``stmatrix_prone``: one of those the fact above names)."""
    return (2, 4) if stmatrix_prone and not WIDE_STMATRIX_8_WARPS_OK else (2, 4, 8)

# In the interpreter a bf16 ``tl.dot`` returns garbage (seen on 3.6-3.9): tests skip it,
# or run inside tests/interpreter_bf16.py's ``gpu_bf16``, which does as the GPU does.
INTERPRETER_BF16_DOT_IS_WRONG: bool = True

# The interpreter's fp32 -> bf16 cast drops the low mantissa bits (round toward zero; seen
# on 3.3.1 and 3.9.0); compiled kernels round to nearest even. fp16 casts round in both.
INTERPRETER_BF16_CAST_TRUNCATES: bool = True


def is_interpreter() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels run on the CPU, in Python."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# See the module docstring: the interpreter before 3.7 cannot run with NumPy 2.
INTERPRETER_NEEDS_NUMPY_1: bool = TRITON_VERSION < (3, 7)


def interpreter_setup_problem() -> str | None:
    """Why the interpreter cannot run kernels with this Triton and NumPy, or None: the
    tuning layer adds it to its error when no config could be built."""
    if not (is_interpreter() and INTERPRETER_NEEDS_NUMPY_1):
        return None
    import numpy

    if int(numpy.__version__.split(".")[0]) < 2:
        return None
    return (f"Triton {TRITON_VERSION_STRING}'s interpreter (TRITON_INTERPRET=1) needs NumPy "
            f"< 2, found {numpy.__version__}: install 'numpy<2' or Triton >= 3.7")


@functools.lru_cache(maxsize=None)
def device_name(index: int = 0) -> str:
    """The GPU's marketing name (``"NVIDIA H100 80GB HBM3"``), or ``"cpu"``."""
    import torch

    if is_interpreter() or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=None)
def device_capability(index: int = 0) -> tuple[int, int]:
    """CUDA compute capability, ``(0, 0)`` without a GPU."""
    import torch

    if is_interpreter() or not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def multiprocessor_count(index: int = 0) -> int:
    """Streaming multiprocessors of the GPU (132 on an H100 SXM); 1 without a GPU, so that
    launch heuristics in the interpreter take their small-grid branch."""
    import torch

    if is_interpreter() or not torch.cuda.is_available():
        return 1
    return _sm_count(index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    # Asked at every launch of a persistent kernel: the properties lookup is host time.
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def is_hopper(index: int = 0) -> bool:
    """Whether CUDA device ``index`` is a Hopper GPU (compute capability 9.x)."""
    return device_capability(index)[0] == 9


def supported() -> bool:
    """Whether the installed Triton is within the range this library is tested on."""
    return TRITON_VERSION[:2] >= MIN_TRITON


def compiled_kernel_count(kernel) -> int:
    """How many binaries Triton has compiled for a ``@triton.jit`` function so far.

    Used by tests that assert a new sequence length or ``cu_seqlens`` causes no
    recompilation. The per-device cache is ``device_caches[device][0]`` on Triton
    3.3-3.9 (the tuple grew a member in 3.5; its first element stayed the kernel
    cache); older code kept ``cache[device]``. In the interpreter nothing is compiled
    and the count is 0.
    """
    # Unwrap launch wrappers down to the object that holds the caches: a TunedKernel keeps
    # the jit function in ``.kernel``, triton's Autotuner/Heuristics in ``.fn`` (possibly
    # nested). Stopping one level short would count 0 and make "no recompilation"
    # assertions pass vacuously.
    for _ in range(8):
        if hasattr(kernel, "device_caches") or isinstance(getattr(kernel, "cache", None), dict):
            break
        inner = getattr(kernel, "kernel", None)
        if inner is None:
            inner = getattr(kernel, "fn", None)
        if inner is None or inner is kernel:
            break
        kernel = inner
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    legacy = getattr(kernel, "cache", None)
    if isinstance(legacy, dict):
        return sum(len(per_device) for per_device in legacy.values())
    return 0


def dot_precision(dtype) -> str:
    """``input_precision`` for ``tl.dot`` on operands of ``dtype``.

    fp32 operands must keep the fp32 accuracy contract (1e-4 relative): Triton's default
    for them, tf32, gives about 3e-4. On the GPU "tf32x3" (three tf32 products, about
    1e-6) keeps the tensor cores; "ieee" lowers to scalar FMAs whose LLVM compile took
    over 100 s for a K = 200 kernel on Triton 3.6. The interpreter computes in numpy and
    takes "ieee". 16-bit operands are exact products either way; "tf32" is the value
    every release accepts for them.
    """
    import torch

    if dtype != torch.float32:
        return "tf32"
    return "ieee" if is_interpreter() else "tf32x3"


def fp32_dot_precision(input_dtype) -> str:
    """``input_precision`` for ``tl.dot`` on fp32 operands formed from inputs of
    ``input_dtype``, where a gradient cancels (a gate's ∂L/∂γ = q⊙dq − k⊙dk summed over
    tokens) and 16-bit operands lose too much: measured on the H100, GLA's dg with bf16
    dot operands missed the 5e-3 bound by up to 1.5x. 16-bit inputs: "tf32" (8x finer
    than bf16); fp32 inputs: :func:`dot_precision` (their 1e-4 contract)."""
    import torch

    if input_dtype == torch.float32 or is_interpreter():
        return dot_precision(torch.float32)
    return "tf32"


def launch_hook_holder():
    """Where this Triton release keeps its launch hooks: ``knobs.runtime`` (3.4+) or the
    ``CompiledKernel`` class (3.3). Used by :mod:`fla.utils.direct_launch`."""
    try:
        from triton import knobs
        return knobs.runtime
    except ImportError:
        from triton.compiler.compiler import CompiledKernel
        return CompiledKernel


def runtime_switches_reader():
    """A function returning the runtime switches Triton folds into its cache key at each
    call: ``knobs.runtime.debug``, the compilation instrumentation mode (sanitizers),
    fpsan's cast mode and the stage-inspection hook on 3.4+ (whichever exist),
    ``TRITON_DEBUG`` on 3.3. Keyed, so that turning one on mid-run compiles anew, as it
    would through Triton."""
    try:
        from triton import knobs
    except ImportError:
        return lambda: (os.environ.get("TRITON_DEBUG"),)
    runtime, compilation = knobs.runtime, knobs.compilation
    names = [(runtime, "debug"), (compilation, "instrumentation_mode"),
             (compilation, "fpsan_homomorphic_casts"), (runtime, "add_stages_inspection_hook")]
    env = {f"_h{i}": holder for i, (holder, _) in enumerate(names)}
    reads = "".join(f"_h{i}.{name}, " for i, (holder, name) in enumerate(names)
                    if hasattr(holder, name))
    # Written out as one expression: it runs at every launch.
    return eval(f"lambda: ({reads})", env)  # noqa: S307 - names from the list above
