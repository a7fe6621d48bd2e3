"""Helpers shared by the tests: error measure, fresh random inputs, varlen splits.

Inputs are drawn fresh on every run (never zeros, never a fixed seed): a fast path must
compute the same function on any valid input. Each test prints its seed (see the
``seed`` fixture) so that a failure can be replayed with ``torch.Generator().manual_seed``.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from fla.utils.triton_facts import INTERPRETER_BF16_CAST_TRUNCATES, is_interpreter

# Relative-error bounds of the quality bar, by the dtype the fast path computed in.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 5e-3,
             torch.bfloat16: 5e-3}


def fresh_seed() -> int:
    """A fresh random seed; ``FLA_TEST_SEED=N`` replays a printed one instead."""
    replay = os.environ.get("FLA_TEST_SEED")
    if replay:
        return int(replay)
    return int.from_bytes(os.urandom(4), "little")


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_device(device) -> str:
    """Where the float64 reference loop runs: on the GPU when the fast path does (a step
    loop of small float64 kernels takes well under a second there, minutes on the CPU at
    real shapes), else on the CPU."""
    return "cuda" if torch.device(device).type == "cuda" else "cpu"


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or inf anywhere in ``out`` gives inf."""
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref.detach().to(torch.float64).cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference {tuple(ref64.shape)}")
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / denom if denom > 0 else num


def assert_rel_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = rel_error(out, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def assert_sum_close(name, out, ref, ref_terms, tol):
    """Per head h (the last dim of ``ref_terms``): |out − ref|_h ≤ tol · (‖ref‖ +
    Σ_tokens |terms_h|), the usual relative bound widened by the size of the terms that
    cancel in the sum. (A head whose true gradient is ~0, such as one decaying by e^−30
    a step, keeps the fp32 rounding of its kernel's intermediates, bounded by ‖ref‖.)"""
    ref = ref.double().cpu()
    scale = ref_terms.abs().sum(dim=tuple(range(ref_terms.dim() - 1))).cpu() + ref.norm()
    err = (out.double().cpu() - ref).abs()
    assert (err <= tol * scale).all(), \
        f"{name}: error {err.tolist()} > {tol} * {scale.tolist()} (‖ref‖ + the terms' size)"


def bf16_cast_truncates(out: torch.Tensor) -> bool:
    """Whether a Triton kernel wrote the bf16 ``out`` by truncating fp32 (round toward
    zero): in the CPU interpreter, while ``INTERPRETER_BF16_CAST_TRUNCATES`` holds; the
    GPU rounds to nearest."""
    return (out.dtype == torch.bfloat16 and INTERPRETER_BF16_CAST_TRUNCATES
            and is_interpreter() and out.device.type == "cpu")


def assert_rounded_once(name: str, out: torch.Tensor, ref: torch.Tensor, slack=0.0) -> None:
    """Each element of a 16-bit ``out`` that a kernel computed in fp32 and rounded once is
    the float64 ``ref`` rounded once to ``out``'s dtype, up to ``slack`` (a number or a
    tensor like ``ref``: what the fp32 arithmetic may lose before the rounding): within
    half an ulp of ``ref`` ± slack, or, for bf16 in the interpreter, which truncates
    (:func:`bf16_cast_truncates`), up to one ulp toward zero from it.

    A relative norm bound of 5e-3 would not do for bf16: one element rounded is up to
    3.9e-3 off, truncated 7.8e-3, and even over 154 truncated elements the norm reached
    4.2e-3."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    ref = ref.detach().double().cpu()
    slack = torch.as_tensor(slack, dtype=torch.float64).cpu()
    info = torch.finfo(out.dtype)
    # |ref| + slack = m * 2^e, m in [0.5, 1): the ulp of the binade the fp32 value may reach
    # is eps * 2^(e-1); no less than the subnormal spacing (and that at ref = 0).
    _, exponent = torch.frexp(ref.abs() + slack)
    ulp = (info.eps * torch.exp2(exponent.double() - 1)).clamp_min(info.tiny * info.eps)
    if bf16_cast_truncates(out):
        low, high = ref - slack - ulp * (ref > 0), ref + slack + ulp * (ref < 0)
    else:
        low, high = ref - slack - ulp / 2, ref + slack + ulp / 2
    got = out.detach().double().cpu()
    bad = ~((got >= low) & (got <= high))  # NaN fails
    rounding = "truncated" if bf16_cast_truncates(out) else "rounded to nearest"
    assert not bad.any(), (f"{name}: {int(bad.sum())} elements not the reference {rounding} "
                           f"to {out.dtype} (+ slack), e.g. {got[bad][0].item()!r} for "
                           f"{ref[bad][0].item()!r}")


def uneven_lengths(n: int, gen: torch.Generator, low: int = 1, high: int = 150,
                   chunk: int = 64) -> list[int]:
    """``n`` random sequence lengths in [low, high], none a multiple of ``chunk`` (and,
    when ``n >= 2`` and the range allows, one shorter and one longer than a chunk)."""
    lengths = []
    for _ in range(n):
        while True:
            L = int(torch.randint(low, high + 1, (1,), generator=gen))
            if L % chunk:
                break
        lengths.append(L)
    if n >= 2 and low < chunk < high:
        lengths[0] = max(low, min(lengths[0], chunk - 1))
        if high > chunk + 1:
            lengths[-1] = max(lengths[-1], chunk + 1 + (lengths[-1] % chunk == 0))
    return lengths


def cu_seqlens_of(lengths: list[int], device="cpu") -> torch.Tensor:
    offsets = [0]
    for L in lengths:
        offsets.append(offsets[-1] + L)
    return torch.tensor(offsets, dtype=torch.int64, device=device)


def packed_or_batch(lengths: list[int], varlen: bool, device="cpu"):
    """``(B, T, N, cu_seqlens)`` for sequences of these lengths packed into one row
    (``varlen``), or for a batch of len(lengths) rows of the first length (cu_seqlens and
    N None)."""
    if varlen:
        return 1, sum(lengths), len(lengths), cu_seqlens_of(lengths, device)
    return len(lengths), lengths[0], None, None


def odd_length(gen: torch.Generator, low: int = 1, high: int = 200, chunk: int = 64) -> int:
    """A random sequence length that is not a multiple of ``chunk``."""
    return uneven_lengths(1, gen, low, high, chunk)[0]


def randn(shape, gen: torch.Generator, dtype=torch.float32, device="cpu", scale: float = 1.0,
          requires_grad: bool = False) -> torch.Tensor:
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)
    return x.requires_grad_(requires_grad)


def output_grad(shape, gen: torch.Generator, dtype) -> torch.Tensor:
    """A float64 upstream gradient for an op whose output has ``dtype``, rounded to that
    dtype first: autograd hands the op exactly this rounded tensor, so the float64
    reference must get it too. (With the unrounded one, fp16's 2.4e-4 rounding of the
    incoming gradient alone showed up as a 1e-2 error in a scalar gate's gradient, a sum
    over tokens that cancels ~100-fold.)"""
    return randn(shape, gen, dtype).double()


def log_gate(shape, gen: torch.Generator, low: float = -1.0, high: float = -1e-3,
             dtype=torch.float32, device="cpu", requires_grad: bool = False) -> torch.Tensor:
    """Log decays uniform in [low, high] (both < 0): never exactly zero."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    x = (low + (high - low) * u).to(dtype).to(device)
    return x.requires_grad_(requires_grad)


def unit_interval(shape, gen: torch.Generator, dtype=torch.float32, device="cpu",
                  requires_grad: bool = False) -> torch.Tensor:
    """Values in (0, 1), e.g. the delta rule's beta."""
    x = torch.sigmoid(torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype).to(device)
    return x.requires_grad_(requires_grad)


def l2_normalized(shape, gen: torch.Generator, dtype=torch.float32, device="cpu",
                  requires_grad: bool = False) -> torch.Tensor:
    x = F.normalize(torch.randn(shape, generator=gen, dtype=torch.float64), dim=-1)
    return x.to(dtype).to(device).requires_grad_(requires_grad)


def counted_segment_combines(monkeypatch) -> list[bool]:
    """Force the chunk passes to split sequences into one-chunk segments and count the
    segment combines that launch (True each; compile ahead's recording of a first call
    on a GPU launches nothing and appends False): the forward pass's and, where it split,
    the reverse pass's (the vector gate's forward too)."""
    from fla.ops.common import chunk_delta_h_bwd, chunk_fwd_inter, chunk_gk_fwd, chunk_segments
    from fla.utils.compile_ahead import recording

    combines: list[bool] = []
    combine = chunk_fwd_inter.combine_segment_states

    def counted(*args, **kwargs):
        combines.append(recording() is None)
        return combine(*args, **kwargs)

    monkeypatch.setattr(chunk_segments, "segment_chunks_for", lambda *args: 1)
    monkeypatch.setattr(chunk_fwd_inter, "combine_segment_states", counted)
    monkeypatch.setattr(chunk_delta_h_bwd, "combine_segment_states", counted)
    monkeypatch.setattr(chunk_gk_fwd, "combine_segment_states", counted)
    return combines


def recorded_steps(monkeypatch, *ops) -> list[str]:
    """The names of the given stage ops (``fla.utils.custom_ops.StageOp``) in the order
    their steps run from here on: proof that a call took the Triton steps and not a
    PyTorch fallback."""
    calls: list[str] = []
    for op in ops:
        monkeypatch.setattr(op, "step", lambda *a, real=op.step, name=op.name:
                            calls.append(name) or real(*a))
    return calls
