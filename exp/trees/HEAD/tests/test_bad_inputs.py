"""Bad calls of every public op and module: each is refused before any kernel runs.

The cases are a table: one :class:`Case` per bad call, naming the exception type and
pieces of the message (the argument, the expected value, the value given). Adding a
case is one line in ``CASES``. Each case builds its tensors on the device it is given,
so the same table runs on CPU here and on CUDA in :func:`test_gpu_bad_calls_leave_cuda_usable`.

"Before any kernel": every bad call runs under :func:`no_kernel_launches`, which makes
any Triton launch (compiled or interpreted) raise, so a check that only fires inside a
kernel (or a kernel launched before the check) fails the test.

Decisions recorded here (and in fla/utils/validation.py):

* T = 0, an empty batch (B = 0) and zero heads or groups are refused with a ValueError
  naming the size, by every token-mixing op, chunk stage, rotary and the short
  convolution (no kernel handles an empty grid, and "empty output plus the initial
  state" would hide an upstream bug more often than serve a use); so are losses over
  zero rows (a mean of nothing). Row-wise modules (norms, l2_norm, GatedMLP) map zero
  rows to zero rows, as torch.nn's norms and Linear do.
* Non-contiguous inputs (transposed views, strided slices, batch-strided slices of a
  larger buffer) are accepted and give the contiguous call's result (see ``STRIDED``):
  the ops copy them to contiguous tensors or pass their strides to the kernels.
* Positive log-gates are not refused: checking values costs a device synchronisation
  per call, and g > 0 is a well-defined (growing) recurrence.
* NaN in an input reaches the outputs that depend on it, on the PyTorch path and the
  Triton path; the chunked forms spread a NaN in k, v, g or beta also to the earlier
  tokens of its chunk (see the NaN section).
* Forward outputs and gradients are bitwise identical across identical calls: no kernel
  accumulates with atomics and a kernel's launch configuration is fixed per process.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import pytest
import torch

import fla.modules as M
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from fla.ops.generalized_delta_rule import (
    chunk_dplr_delta_rule,
    fused_recurrent_dplr_delta_rule,
)
from fla.ops.gla import chunk_gla, fused_recurrent_gla
from fla.ops.mamba2 import mamba_chunk_scan_combined, selective_state_update
from fla.ops.retention import chunk_retention, fused_recurrent_retention
from fla.ops.rwkv6 import chunk_rwkv6, fused_recurrent_rwkv6
from fla.ops.rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7
from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
from fla.ops.utils import chunk_local_cumsum, solve_tril

F32, F64 = torch.float32, torch.float64


# ------------------------------------------------------------------------ the guard
class KernelLaunched(BaseException):
    """Not an ``Exception``: the tuning layer catches those (a config that fails to build
    moves on to the next), and the guard must not be swallowed."""


@contextlib.contextmanager
def no_kernel_launches():
    """Any Triton kernel launch inside the block raises :class:`KernelLaunched`.

    Patched at Triton's own launch entry points, below our tuning layer, so a kernel
    launched without ``@tuned`` is caught too. Under ``TRITON_INTERPRET=1``
    ``triton.jit`` builds ``InterpretedFunction``s, which do not derive from
    ``JITFunction``: both classes are patched.
    """
    from triton.runtime import interpreter, jit

    def refuse(self, *args, **kwargs):
        name = getattr(getattr(self, "fn", None), "__name__", repr(self))
        raise KernelLaunched(f"a Triton kernel was launched before the input check: {name}")

    saved = [(cls, cls.run) for cls in (jit.JITFunction, interpreter.InterpretedFunction)]
    try:
        for cls, _ in saved:
            cls.run = refuse
        yield
    finally:
        for cls, run in saved:
            cls.run = run


def test_the_guard_catches_a_launch(device):
    """The guard itself works: a good call that launches a kernel is stopped."""
    x = torch.randn(4, 32, device=device)
    with no_kernel_launches(), pytest.raises(KernelLaunched, match="l2norm"):
        M.l2_norm(x)


# ------------------------------------------------------------------------ builders
def t(d, *shape, dtype=F32):
    return torch.randn(shape, dtype=dtype, device=d)


def idx(d, values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=d)


def other(d) -> str:
    """A device other than ``d``: the CPU next to a GPU, a meta device next to the CPU
    (checks read only shapes, dtypes and devices, so a meta tensor is enough)."""
    return "meta" if str(d) == "cpu" else "cpu"


# Sizes of the token-mixing ops: T > H and K, V >= 16 so that the [B, H, T, D] guard stays
# quiet on good calls.
B, T, H, K, V = 2, 8, 2, 16, 16


def qkv(d, b=B, tt=T, h=H, k=K, v=V, dtype=F32):
    return t(d, b, tt, h, k, dtype=dtype), t(d, b, tt, h, k, dtype=dtype), \
        t(d, b, tt, h, v, dtype=dtype)


def gate(d, b=B, tt=T, h=H):
    return -torch.rand(b, tt, h, device=d)


def beta_(d, b=B, tt=T, h=H):
    return torch.rand(b, tt, h, device=d)


def gdr(d, *, q=None, k=None, v=None, g=None, beta=None, fn=chunk_gated_delta_rule, **kw):
    """A gated-delta-rule call with good defaults; keyword arguments replace one input."""
    q0, k0, v0 = qkv(d)
    return fn(q=q0 if q is None else q, k=k0 if k is None else k, v=v0 if v is None else v,
              g=gate(d) if g is None else g, beta=beta_(d) if beta is None else beta, **kw)


def packed(d, tt=T):
    """Good packed-sequence inputs: B = 1, T tokens."""
    q, k, v = qkv(d, b=1, tt=tt)
    return dict(q=q, k=k, v=v, g=gate(d, b=1, tt=tt), beta=beta_(d, b=1, tt=tt))


def sgla(d, fn=chunk_simple_gla, **kw):
    q, k, v = qkv(d)
    args = dict(q=q, k=k, v=v, g=gate(d))
    args.update(kw)
    return fn(**args)


def F_normalize(x):
    """Unit rows along the last dim: RWKV7-like a = −κ̂, b = κ̂·a keep the state bounded."""
    return torch.nn.functional.normalize(x, dim=-1)


def key_gate(d, b=B, tt=T, h=H, k=K):
    """A per-key-channel log decay [B, T, H, K] (GLA's gk, RWKV6's and RWKV7's w)."""
    return -torch.rand(b, tt, h, k, device=d)


def gla(d, fn=chunk_gla, g=None, **kw):
    """The gate goes by position: ``g`` in chunk_gla, ``gk`` in fused_recurrent_gla."""
    q, k, v = qkv(d)
    args = dict(q=q, k=k, v=v)
    args.update(kw)
    return fn(args.pop("q"), args.pop("k"), args.pop("v"), key_gate(d) if g is None else g,
              **args)


def rwkv6(d, fn=chunk_rwkv6, **kw):
    r, k, v = qkv(d)
    args = dict(r=r, k=k, v=v, w=key_gate(d), u=t(d, H, K))
    args.update(kw)
    return fn(**args)


def dplr(d, fn=chunk_dplr_delta_rule, **kw):
    q, k, v = qkv(d)
    args = dict(q=q, k=k, v=v, a=t(d, B, T, H, K), b=t(d, B, T, H, K), gk=key_gate(d))
    args.update(kw)
    return fn(**args)


def rwkv7(d, fn=chunk_rwkv7, **kw):
    r, k, v = qkv(d)
    args = dict(r=r, w=key_gate(d), k=k, v=v, a=t(d, B, T, H, K), b=t(d, B, T, H, K))
    args.update(kw)
    return fn(**args)


def layer(d, name, x=None, **kw):
    """A small token-mixing layer of ``fla.layers`` (width 64) on ``x`` (default good)."""
    import fla.layers as L

    sizes = {"GatedDeltaNet": dict(num_heads=4, head_dim=16),
             "GatedLinearAttention": dict(num_heads=4), "RWKV7Attention": dict(head_dim=16),
             "Mamba2": dict(head_dim=16, state_size=16), "Attention": dict(num_heads=4)}
    module = getattr(L, name)(hidden_size=64, **sizes[name]).to(d)
    return module(t(d, B, T, 64) if x is None else x, **kw)


def model(d, input_ids=None, **kw):
    """A tiny GatedDeltaNet causal LM (vocab 100) on ``input_ids`` (default good)."""
    from transformers import AutoModelForCausalLM

    from fla.models import GatedDeltaNetConfig

    config = GatedDeltaNetConfig(hidden_size=64, num_heads=4, head_dim=16,
                                 num_hidden_layers=1, vocab_size=100)
    net = AutoModelForCausalLM.from_config(config).to(d).eval()
    ids = idx(d, [[5, 6, 7, 8]] * B) if input_ids is None else input_ids
    return net(input_ids=ids, **kw)


# Mamba2: b, T, H heads of P channels, G groups of N state entries.
MB, MT, MH, MP, MG, MN = 2, 8, 4, 8, 2, 16


def ssd(d, **kw):
    args = dict(x=t(d, MB, MT, MH, MP), dt=torch.rand(MB, MT, MH, device=d),
                A=-torch.rand(MH, device=d), B=t(d, MB, MT, MG, MN), C=t(d, MB, MT, MG, MN),
                chunk_size=64)
    args.update(kw)
    return mamba_chunk_scan_combined(**args)


def ssu(d, **kw):
    args = dict(state=t(d, MB, MH, MP, MN), x=t(d, MB, MH, MP), dt=torch.rand(MB, MH, device=d),
                A=-torch.rand(MH, device=d), B=t(d, MB, MG, MN), C=t(d, MB, MG, MN))
    args.update(kw)
    return selective_state_update(**args)


def fwd_h(d, **kw):
    args = dict(k=t(d, B, T, H, K), w=t(d, B, T, H, K), u=t(d, B, T, H, V), g=gate(d))
    args.update(kw)
    return chunk_gated_delta_rule_fwd_h(**args)


def rotary(d, q=None, k=None, dim=K, **kw):
    q0, k0, _ = qkv(d)
    return M.RotaryEmbedding(dim)(q0 if q is None else q, k0 if k is None else k, **kw)


def conv(d, x=None, D=32, W=4, **kw):
    layer = M.ShortConvolution(D, W).to(d)
    return layer(t(d, B, T, D) if x is None else x, **kw)


def ce(d, logits=None, target=None):
    return M.FusedCrossEntropyLoss()(t(d, 6, 50) if logits is None else logits,
                                     idx(d, [1, 2, 3, 4, 5, 6]) if target is None else target)


def flce(d, x=None, target=None, weight=None, bias=None):
    return M.FusedLinearCrossEntropyLoss()(
        t(d, 6, 32) if x is None else x,
        idx(d, [1, 2, 3, 4, 5, 6]) if target is None else target,
        t(d, 50, 32) if weight is None else weight, bias)


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One bad call: ``call(device)`` must raise ``error`` with every one of ``needles``
    in its message (the argument, what was expected, what was given). ``<other>`` in a
    needle stands for :func:`other` of the device the case runs on."""

    name: str
    call: Callable[[str], object]
    error: type[Exception]
    needles: Sequence[str]

    def __str__(self) -> str:
        return self.name


_cg = chunk_gated_delta_rule
_fr = fused_recurrent_gated_delta_rule

CASES: list[Case] = [
    # ---- gated delta rule (chunk and fused recurrent share the checks; both are called)
    Case("gdr/q_rank3", lambda d: gdr(d, q=t(d, B, T, H * K)), ValueError,
         ["q:", "4-D", "[B, T, H, K]", "3-D", f"({B}, {T}, {H * K})"]),
    Case("gdr/bhtd_passed_as_bthd", lambda d: gdr(
        d, q=t(d, 1, 4, 64, K), k=t(d, 1, 4, 64, K), v=t(d, 1, 4, 64, V),
        g=gate(d, 1, 4, 64), beta=beta_(d, 1, 4, 64)), ValueError,
         ["q:", "(1, 4, 64, 16)", "T = 4", "H = 64", "head_first=True"]),
    Case("gdr/k_transposed_vs_q", lambda d: gdr(d, k=t(d, B, H, T, K)), ValueError,
         ["k:", "[B, T, H, K]", f"({B}, {H}, {T}, {K})", f"T is {H} here but {T} in q"]),
    Case("gdr/v_batch_mismatch", lambda d: gdr(d, v=t(d, B + 1, T, H, V)), ValueError,
         ["v:", f"B is {B + 1} here but {B} in q"]),
    Case("gdr/v_time_mismatch", lambda d: gdr(d, fn=_fr, v=t(d, B, T + 1, H, V)), ValueError,
         ["v:", f"T is {T + 1} here but {T} in q"]),
    Case("gdr/v_heads_not_multiple", lambda d: gdr(d, v=t(d, B, T, 3, V), g=gate(d, h=3),
                                                   beta=beta_(d, h=3)), ValueError,
         ["v:", "multiple", f"H = {H}", "HV = 3"]),
    Case("gdr/g_wrong_rank", lambda d: gdr(d, g=gate(d)[..., None]), ValueError,
         ["g:", "3-D", "[B, T, HV]", "4-D", f"({B}, {T}, {H}, 1)"]),
    Case("gdr/g_heads_mismatch", lambda d: gdr(d, fn=_fr, g=gate(d, h=H + 1)), ValueError,
         ["g:", f"HV is {H + 1} here but {H} in v"]),
    Case("gdr/beta_time_mismatch", lambda d: gdr(d, beta=beta_(d, tt=T - 1)), ValueError,
         ["beta:", f"T is {T - 1} here but {T} in q"]),
    Case("gdr/q_int", lambda d: gdr(d, q=torch.ones(B, T, H, K, dtype=torch.int32, device=d)),
         TypeError, ["q:", "float32, float16, bfloat16", "got int32"]),
    Case("gdr/v_float64", lambda d: gdr(d, fn=_fr, v=t(d, B, T, H, V, dtype=F64)), TypeError,
         ["v:", "float32, float16, bfloat16", "got float64"]),
    Case("gdr/k_float32_q_float16", lambda d: gdr(d, q=t(d, B, T, H, K).half()), TypeError,
         ["k:", "the dtype of q (float16)", "got float32"]),
    Case("sgla/q_bfloat16_k_float32", lambda d: sgla(d, q=t(d, B, T, H, K).bfloat16()),
         TypeError, ["k:", "the dtype of q (bfloat16)", "got float32"]),
    Case("gdr/head_first_not_bool", lambda d: gdr(d, head_first="yes"), TypeError,
         ["head_first:", "bool", "str"]),
    Case("gdr/g_int", lambda d: gdr(d, g=torch.zeros(B, T, H, dtype=torch.int64, device=d)),
         TypeError, ["g:", "float32", "got int64"]),
    Case("gdr/head_dim_K_over_limit", lambda d: gdr(d, q=t(d, B, T, H, 512),
                                                    k=t(d, B, T, H, 512)), ValueError,
         ["q:", "K = 512", "K <= 256"]),
    Case("gdr/head_dim_V_over_limit", lambda d: gdr(d, fn=_fr, v=t(d, B, T, H, 320)), ValueError,
         ["v:", "V = 320", "V <= 256"]),
    Case("gdr/cu_seqlens_not_from_0", lambda d: _cg(**packed(d), cu_seqlens=idx(d, [1, 4, T])),
         ValueError, ["cu_seqlens:", "first offset to be 0", "got 1"]),
    Case("gdr/cu_seqlens_not_increasing",
         lambda d: _fr(**packed(d), cu_seqlens=idx(d, [0, 5, 3, T])), ValueError,
         ["cu_seqlens:", "strictly increasing", "5 then 3"]),
    Case("gdr/cu_seqlens_repeated_offset",
         lambda d: _cg(**packed(d), cu_seqlens=idx(d, [0, 3, 3, T])), ValueError,
         ["cu_seqlens:", "strictly increasing", "3 then 3"]),
    Case("gdr/cu_seqlens_not_ending_at_T",
         lambda d: _cg(**packed(d), cu_seqlens=idx(d, [0, 3, T - 1])), ValueError,
         ["cu_seqlens:", f"T = {T}", f"got {T - 1}"]),
    Case("gdr/cu_seqlens_with_batch_2", lambda d: gdr(d, cu_seqlens=idx(d, [0, 3, T])),
         ValueError, ["cu_seqlens:", "B == 1", f"B = {B}"]),
    Case("gdr/cu_seqlens_float", lambda d: _cg(**packed(d), cu_seqlens=idx(d, [0, 3, T], F32)),
         TypeError, ["cu_seqlens:", "int32, int64", "got float32"]),
    Case("gdr/cu_seqlens_2d", lambda d: _cg(**packed(d), cu_seqlens=idx(d, [[0, 3, T]])),
         ValueError, ["cu_seqlens:", "1-D", "(1, 3)"]),
    Case("gdr/initial_state_wrong_N", lambda d: gdr(d, initial_state=t(d, B + 1, H, K, V)),
         ValueError, ["initial_state:", "[N, HV, K, V]", f"N is {B + 1} here but {B}"]),
    Case("gdr/initial_state_N_vs_cu_seqlens", lambda d: _fr(
        **packed(d), cu_seqlens=idx(d, [0, 3, 5, T]), initial_state=t(d, 2, H, K, V)),
         ValueError, ["initial_state:", "N is 2 here but 3", "cu_seqlens"]),
    Case("gdr/initial_state_K_V_swapped", lambda d: gdr(
        d, q=t(d, B, T, H, 32), k=t(d, B, T, H, 32), initial_state=t(d, B, H, V, 32)),
         ValueError, ["initial_state:", "[N, HV, K, V]", "K is 16 here but 32 in q"]),
    Case("gdr/initial_state_float64", lambda d: gdr(d, initial_state=t(d, B, H, K, V, dtype=F64)),
         TypeError, ["initial_state:", "float32", "got float64"]),
    Case("gdr/k_on_other_device", lambda d: gdr(d, k=t(other(d), B, T, H, K)), ValueError,
         ["k:", "expected device", "got <other>"]),
    Case("gdr/initial_state_on_other_device",
         lambda d: gdr(d, fn=_fr, initial_state=t(other(d), B, H, K, V)), ValueError,
         ["initial_state:", "expected device", "got <other>"]),
    Case("gdr/T_0", lambda d: gdr(d, q=t(d, B, 0, H, K), k=t(d, B, 0, H, K), v=t(d, B, 0, H, V),
                                  g=gate(d, tt=0), beta=beta_(d, tt=0)), ValueError,
         ["sequence length", "T >= 1", "T = 0"]),
    Case("gdr/empty_batch", lambda d: gdr(d, fn=_fr, q=t(d, 0, T, H, K), k=t(d, 0, T, H, K),
                                          v=t(d, 0, T, H, V), g=gate(d, b=0), beta=beta_(d, b=0)),
         ValueError, ["batch size", "B >= 1", "B = 0"]),
    Case("gdr/zero_heads", lambda d: gdr(d, q=t(d, B, T, 0, K), k=t(d, B, T, 0, K),
                                         v=t(d, B, T, 0, V), g=gate(d, h=0), beta=beta_(d, h=0)),
         ValueError, ["q:", "number of heads H >= 1", "H = 0"]),
    Case("gdr/scale_nan", lambda d: gdr(d, scale=float("nan")), ValueError,
         ["scale:", "finite", "nan"]),
    Case("gdr/q_not_a_tensor", lambda d: gdr(d, q=[[1.0]]), TypeError,
         ["q:", "torch.Tensor", "list"]),
    # ---- delta rule (wrappers of the gated delta rule)
    Case("delta/beta_wrong_shape", lambda d: chunk_delta_rule(*qkv(d), beta=beta_(d)[..., :1]),
         ValueError, ["beta:", f"HV is 1 here but {H} in v"]),
    Case("delta/initial_state_bool", lambda d: fused_recurrent_delta_rule(
        *qkv(d), beta=beta_(d), initial_state=torch.ones(B, H, K, V, dtype=torch.bool, device=d)),
         TypeError, ["initial_state:", "float32", "got bool"]),
    # ---- simple GLA and retention
    Case("sgla/g_gamma_wrong_shape", lambda d: sgla(d, g=None, g_gamma=-torch.rand(H, 1, device=d)),
         ValueError, ["g_gamma:", f"[{H}]", f"[{H}, 1]"]),
    Case("sgla/g_gamma_other_device", lambda d: sgla(d, g_gamma=-torch.rand(H, device=other(d))),
         ValueError, ["g_gamma:", "expected device", "got <other>"]),
    Case("sgla/g_int", lambda d: sgla(d, fn=fused_recurrent_simple_gla,
                                      g=torch.zeros(B, T, H, dtype=torch.int32, device=d)),
         TypeError, ["g:", "float32", "got int32"]),
    Case("sgla/cu_seqlens_past_T", lambda d: fused_recurrent_simple_gla(
        *qkv(d, b=1), g=gate(d, b=1), cu_seqlens=idx(d, [0, 4, T + 3])), ValueError,
         ["cu_seqlens:", f"T = {T}", f"got {T + 3}"]),
    Case("sgla/initial_state_rank3", lambda d: sgla(d, initial_state=t(d, B, H, K)), ValueError,
         ["initial_state:", "4-D", "[N, HV, K, V]", "3-D"]),
    Case("sgla/T_0", lambda d: chunk_simple_gla(*qkv(d, tt=0), g=gate(d, tt=0)), ValueError,
         ["q:", "sequence length T >= 1", "T = 0"]),
    Case("retention/q_rank5", lambda d: chunk_retention(t(d, B, T, H, K, 1), *qkv(d)[1:]),
         ValueError, ["q:", "4-D", "5-D"]),
    Case("retention/v_int", lambda d: fused_recurrent_retention(
        *qkv(d)[:2], torch.ones(B, T, H, V, dtype=torch.int64, device=d)), TypeError,
         ["v:", "float32", "got int64"]),
    Case("retention/v_rank3", lambda d: chunk_retention(*qkv(d)[:2], t(d, B, T, H * V)),
         ValueError, ["v:", "4-D", "3-D", f"({B}, {T}, {H * V})"]),
    Case("retention/T_0", lambda d: chunk_retention(*qkv(d, tt=0)), ValueError,
         ["T >= 1", "T = 0"]),
    # ---- Mamba2 chunked scan
    Case("ssd/x_rank3", lambda d: ssd(d, x=t(d, MB, MT, MH * MP)), ValueError,
         ["x:", "4-D", "[b, T, H, P]", "3-D"]),
    Case("ssd/dt_heads_mismatch", lambda d: ssd(d, dt=torch.rand(MB, MT, MH + 1, device=d)),
         ValueError, ["dt:", f"H is {MH + 1} here but {MH} in x"]),
    Case("ssd/A_per_channel", lambda d: ssd(d, A=-torch.rand(MH, MP, device=d)), ValueError,
         ["A:", "1-D", "[H]", "2-D"]),
    Case("ssd/groups_not_dividing_heads", lambda d: ssd(d, B=t(d, MB, MT, 3, MN),
                                                       C=t(d, MB, MT, 3, MN)), ValueError,
         ["B:", "G = 3", f"H = {MH}"]),
    Case("ssd/C_state_size_mismatch", lambda d: ssd(d, C=t(d, MB, MT, MG, MN + 1)), ValueError,
         ["C:", f"N is {MN + 1} here but {MN} in B"]),
    Case("ssd/D_wrong_shape", lambda d: ssd(d, D=t(d, MH + 1)), ValueError,
         ["D:", f"H is {MH + 1} here but {MH} in x"]),
    Case("ssd/z_wrong_shape", lambda d: ssd(d, z=t(d, MB, MT, MH, MP + 1)), ValueError,
         ["z:", f"P is {MP + 1} here but {MP} in x"]),
    Case("ssd/chunk_size_0", lambda d: ssd(d, chunk_size=0), ValueError,
         ["chunk_size:", "positive", "got 0"]),
    Case("ssd/initial_states_transposed", lambda d: ssd(
        d, initial_states=t(d, MB, MH, MN, MP)), ValueError,
         ["initial_states:", "[Ns, H, P, N]", f"P is {MN} here but {MP} in x"]),
    Case("ssd/seq_idx_with_batch_2", lambda d: ssd(
        d, seq_idx=torch.zeros(MB, MT, dtype=torch.int32, device=d)), ValueError,
         ["seq_idx:", "b == 1", f"b = {MB}"]),
    Case("ssd/seq_idx_decreasing", lambda d: ssd(
        d, x=t(d, 1, MT, MH, MP), dt=torch.rand(1, MT, MH, device=d), B=t(d, 1, MT, MG, MN),
        C=t(d, 1, MT, MG, MN), seq_idx=idx(d, [[0, 0, 1, 1, 0, 2, 2, 2]])), ValueError,
         ["seq_idx:", "non-decreasing", "1 then 0"]),
    Case("ssd/dt_limit_reversed", lambda d: ssd(d, dt_limit=(1.0, 0.5)), ValueError,
         ["dt_limit:", "low <= high", "low = 1.0", "high = 0.5"]),
    Case("ssd/x_float64", lambda d: ssd(d, x=t(d, MB, MT, MH, MP, dtype=F64)), TypeError,
         ["x:", "float32", "got float64"]),
    Case("ssd/T_0", lambda d: ssd(d, x=t(d, MB, 0, MH, MP), dt=torch.rand(MB, 0, MH, device=d),
                                  B=t(d, MB, 0, MG, MN), C=t(d, MB, 0, MG, MN)), ValueError,
         ["sequence length", "T >= 1", "T = 0"]),
    Case("ssd/empty_batch", lambda d: ssd(d, x=t(d, 0, MT, MH, MP),
                                          dt=torch.rand(0, MT, MH, device=d),
                                          B=t(d, 0, MT, MG, MN), C=t(d, 0, MT, MG, MN)), ValueError,
         ["batch size", "b >= 1", "b = 0"]),
    Case("ssd/zero_groups", lambda d: ssd(d, B=t(d, MB, MT, 0, MN), C=t(d, MB, MT, 0, MN)),
         ValueError, ["B:", "number of groups G >= 1", "G = 0"]),
    Case("ssd/dt_bias_other_device", lambda d: ssd(d, dt_bias=t(other(d), MH)), ValueError,
         ["dt_bias:", "expected device", "got <other>"]),
    # ---- Mamba2 decoding step
    Case("ssu/state_rank5", lambda d: ssu(d, state=t(d, MB, MH, MP, MN, 1)), ValueError,
         ["state:", "4-D", "5-D"]),
    Case("ssu/x_heads_mismatch", lambda d: ssu(d, x=t(d, MB, MH + 1, MP)), ValueError,
         ["dt:", f"H is {MH} here but {MH + 1} in x"]),
    Case("ssu/dt_rank1", lambda d: ssu(d, dt=torch.rand(MB, device=d)), ValueError,
         ["dt:", "[b, H, P] or [b, H]", "1-D"]),
    Case("ssu/state_N_vs_B", lambda d: ssu(d, state=t(d, MB, MH, MP, MN * 2)), ValueError,
         ["state:", f"N is {2 * MN} here but {MN} in B"]),
    Case("ssu/indices_float", lambda d: ssu(d, state_batch_indices=idx(d, [0.0, 1.0], F32)),
         TypeError, ["state_batch_indices:", "int32, int64", "got float32"]),
    Case("ssu/state_int", lambda d: ssu(
        d, state=torch.zeros(MB, MH, MP, MN, dtype=torch.int32, device=d)), TypeError,
         ["state:", "float32", "got int32"]),
    Case("ssu/empty_batch", lambda d: ssu(d, state=t(d, 0, MH, MP, MN), x=t(d, 0, MH, MP),
                                          dt=torch.rand(0, MH, device=d), B=t(d, 0, MG, MN),
                                          C=t(d, 0, MG, MN)), ValueError,
         ["batch size", "b >= 1", "b = 0"]),
    # ---- public chunk stages and utilities
    Case("ssu/zero_groups", lambda d: ssu(d, B=t(d, MB, 0, MN), C=t(d, MB, 0, MN)),
         ValueError, ["B:", "number of groups G >= 1", "G = 0"]),
    Case("ssu/zero_heads", lambda d: ssu(d, state=t(d, MB, 0, MP, MN), x=t(d, MB, 0, MP),
                                         dt=torch.rand(MB, 0, device=d), A=t(d, 0)), ValueError,
         ["x:", "number of heads H >= 1", "H = 0"]),
    Case("fwd_h/u_dtype_differs_from_k", lambda d: fwd_h(
        d, u=t(d, B, T, H, V).to(torch.bfloat16)), TypeError, ["u:", "float32", "bfloat16"]),
    Case("fwd_h/chunk_size_48", lambda d: fwd_h(d, chunk_size=48), ValueError,
         ["chunk_size", "48"]),
    Case("fwd_h/initial_state_wrong_H", lambda d: fwd_h(d, initial_state=t(d, B, H + 1, K, V)),
         ValueError, ["initial_state:", f"H is {H + 1} here but {H} in k"]),
    Case("fwd_h/g_rank5", lambda d: fwd_h(d, g=t(d, B, T, H, K, 1)), ValueError,
         ["g:", "5-D", f"({B}, {T}, {H}, {K}, 1)"]),
    Case("kkt/beta_wrong_T", lambda d: chunk_scaled_dot_kkt_fwd(
        t(d, B, T, H, K), beta=beta_(d, tt=T + 2)), ValueError,
         ["beta:", f"T is {T + 2} here but {T} in k"]),
    Case("kkt/output_dtype_int", lambda d: chunk_scaled_dot_kkt_fwd(
        t(d, B, T, H, K), output_dtype=torch.int32), TypeError, ["output_dtype", "int32"]),
    Case("kkt/empty_batch", lambda d: chunk_scaled_dot_kkt_fwd(t(d, 0, T, H, K)), ValueError,
         ["k:", "batch size B >= 1", "B = 0"]),
    Case("cumsum/chunk_size_3", lambda d: chunk_local_cumsum(gate(d), 3), ValueError,
         ["chunk_size:", "power of two", "3"]),
    Case("cumsum/g_rank2", lambda d: chunk_local_cumsum(t(d, B, T), 64), ValueError,
         ["g:", "[B, T, H]", "(2, 8)"]),
    Case("cumsum/T_0", lambda d: chunk_local_cumsum(gate(d, tt=0), 64), ValueError,
         ["g:", "sequence length T >= 1", "T = 0"]),
    Case("cumsum/cu_seqlens_with_batch_2", lambda d: chunk_local_cumsum(
        gate(d), 64, cu_seqlens=idx(d, [0, 3, T])), ValueError, ["cu_seqlens:", "B = 2"]),
    Case("solve_tril/chunk_48", lambda d: solve_tril(t(d, B, T, H, 48)), ValueError,
         ["A:", "BT", "48"]),
    Case("solve_tril/rank3", lambda d: solve_tril(t(d, B, T, 16)), ValueError,
         ["A:", "4-D", "3-D"]),
    Case("solve_tril/float64", lambda d: solve_tril(t(d, B, T, H, 16, dtype=F64)), TypeError,
         ["A:", "float32", "got float64"]),
    # ---- modules
    Case("rmsnorm/hidden_size_mismatch", lambda d: M.RMSNorm(32).to(d)(t(d, 4, 48)), ValueError,
         ["x:", "hidden_size = 32", "48"]),
    Case("rmsnorm/x_int", lambda d: M.RMSNorm(32).to(d)(torch.ones(4, 32, dtype=torch.int64,
                                                                    device=d)),
         TypeError, ["x:", "float32", "got int64"]),
    Case("layernorm/residual_wrong_shape", lambda d: M.LayerNorm(32).to(d)(
        t(d, 4, 32), residual=t(d, 5, 32)), ValueError, ["residual:", "(4, 32)", "(5, 32)"]),
    Case("groupnorm/groups_not_dividing", lambda d: M.GroupNorm(3, 32), ValueError,
         ["num_groups:", "3", "32"]),
    Case("normgate/g_wrong_shape", lambda d: M.FusedRMSNormGated(32).to(d)(
        t(d, 4, 32), t(d, 4, 16)), ValueError, ["g:", "(4, 32)", "(4, 16)"]),
    Case("rotary/dim_over_head_dim", lambda d: rotary(d, dim=2 * K), ValueError,
         ["dim", f"{2 * K}", f"{K}"]),
    Case("rotary/k_head_dim_differs", lambda d: rotary(d, k=t(d, B, T, H, 2 * K)), ValueError,
         ["k:", f"{2 * K}", f"{K}"]),
    Case("rotary/negative_offset", lambda d: rotary(d, seqlen_offset=-1), ValueError,
         ["seqlen_offset:", ">= 0", "-1"]),
    Case("rotary/T_0", lambda d: rotary(d, q=t(d, B, 0, H, K), k=t(d, B, 0, H, K)), ValueError,
         ["T >= 1", "T = 0"]),
    Case("rotary/zero_heads", lambda d: rotary(d, k=t(d, B, T, 0, K)), ValueError,
         ["k:", "number of heads HK >= 1", "HK = 0"]),
    Case("rotary/cu_seqlens_not_ending_at_T", lambda d: rotary(
        d, q=t(d, 1, T, H, K), k=t(d, 1, T, H, K), cu_seqlens=idx(d, [0, 2, 5])), ValueError,
         ["cu_seqlens:", f"T = {T}", "got 5"]),
    Case("rotary/cu_seqlens_with_batch_2", lambda d: rotary(d, cu_seqlens=idx(d, [0, 3, T])),
         ValueError, ["cu_seqlens:", "B == 1", f"B = {B}"]),
    Case("rotary/offsets_wrong_shape", lambda d: rotary(d, seqlen_offset=idx(d, [1, 2, 3])),
         ValueError, ["seqlen_offset:", f"[B] = [{B}]", "(3,)"]),
    Case("rotary/q_float64", lambda d: rotary(d, q=t(d, B, T, H, K, dtype=F64)), TypeError,
         ["q:", "float32", "got float64"]),
    Case("conv/cu_seqlens_float", lambda d: conv(d, x=t(d, 1, T, 32),
                                                 cu_seqlens=idx(d, [0, 3, T], F32)), TypeError,
         ["cu_seqlens:", "int32, int64", "got float32"]),
    Case("conv/channels_mismatch", lambda d: conv(d, x=t(d, B, T, 48)), ValueError,
         ["x:", "hidden_size = 32", f"({B}, {T}, 48)"]),
    Case("conv/x_rank2", lambda d: conv(d, x=t(d, T, 32)), ValueError, ["x:", "3-D", "2-D"]),
    Case("conv/cache_wrong_width", lambda d: conv(d, cache=t(d, B, 32, 3)), ValueError,
         ["cache:", "[N, D, W]", "[2, 32, 4]", "(2, 32, 3)"]),
    Case("conv/empty_batch", lambda d: conv(d, x=t(d, 0, T, 32)), ValueError,
         ["B >= 1", "B = 0"]),
    Case("conv/T_0", lambda d: conv(d, x=t(d, B, 0, 32)), ValueError, ["x:", "T >= 1", "T = 0"]),
    Case("l2norm/x_int", lambda d: M.l2_norm(torch.ones(4, 32, dtype=torch.int32, device=d)),
         TypeError, ["x:", "float32", "got int32"]),
    Case("l2norm/output_dtype_float64", lambda d: M.l2_norm(t(d, 4, 32), output_dtype=F64),
         TypeError, ["output_dtype", "float64"]),
    Case("mlp/hidden_size_mismatch", lambda d: M.GatedMLP(32, intermediate_size=64).to(d)(
        t(d, 4, 48)), ValueError, ["x:", "hidden_size = 32", "(4, 48)"]),
    Case("mlp/x_bf16_weights_fp32", lambda d: M.GatedMLP(32, intermediate_size=64).to(d)(
        t(d, 4, 32).bfloat16()), TypeError, ["x:", "float32", "got bfloat16"]),
    Case("mlp/x_int", lambda d: M.GatedMLP(32, intermediate_size=64).to(d)(
        torch.ones(4, 32, dtype=torch.int64, device=d)), TypeError,
         ["x:", "floating", "got int64"]),
    Case("ce/token_id_ge_vocab", lambda d: ce(d, target=idx(d, [1, 2, 3, 50, 5, 6])), ValueError,
         ["target:", "[0, 50)", "max 50"]),
    Case("ce/token_id_negative", lambda d: ce(d, target=idx(d, [1, 2, -3, 4, 5, 6])), ValueError,
         ["target:", "[0, 50)", "min -3"]),
    Case("ce/logits_float64", lambda d: ce(d, logits=t(d, 6, 50, dtype=F64)), TypeError,
         ["logits:", "float32", "got float64"]),
    Case("ce/target_float", lambda d: ce(d, target=t(d, 6)), TypeError,
         ["target:", "integer dtype", "float32"]),
    Case("ce/target_wrong_rows", lambda d: ce(d, target=idx(d, [1, 2, 3])), ValueError,
         ["target:", "(6,)", "(3,)"]),
    Case("ce/logits_on_other_device", lambda d: ce(d, logits=t(other(d), 6, 50)), ValueError,
         ["expected device"]),
    Case("flce/weight_hidden_mismatch", lambda d: flce(d, weight=t(d, 50, 48)), ValueError,
         ["weight:", "H = 32", "(50, 48)"]),
    Case("flce/token_id_ge_vocab", lambda d: flce(d, target=idx(d, [1, 2, 3, 4, 5, 77])),
         ValueError, ["target:", "[0, 50)", "max 77"]),
    Case("flce/bias_wrong_shape", lambda d: flce(d, bias=t(d, 49)), ValueError,
         ["bias:", "(50,)", "49"]),
    Case("flce/empty_rows", lambda d: flce(d, x=t(d, 0, 32), target=idx(d, [])), ValueError,
         ["x:", "at least one row", "N = 0"]),
    # ---- GLA and RWKV6 (per-key-channel gates; the chunk and recurrent forms share checks)
    Case("gla/g_scalar_per_head", lambda d: gla(d, g=gate(d)), ValueError,
         ["g:", "4-D", "[B, T, H, K]", f"({B}, {T}, {H})"]),
    Case("gla/g_key_width_mismatch", lambda d: gla(d, fn=fused_recurrent_gla,
                                                   g=key_gate(d, k=K + 1)), ValueError,
         ["gk:", f"K is {K + 1} here but {K} in q"]),
    Case("gla/k_time_mismatch", lambda d: gla(d, k=t(d, B, T + 1, H, K)), ValueError,
         ["k:", f"T is {T + 1} here but {T} in q"]),
    Case("gla/initial_state_wrong_V", lambda d: gla(d, initial_state=t(d, B, H, K, V + 1)),
         ValueError, ["initial_state:", "[N, H, K, V]", f"V is {V + 1} here but {V} in v"]),
    Case("gla/T_0", lambda d: gla(d, q=t(d, B, 0, H, K), k=t(d, B, 0, H, K),
                                  v=t(d, B, 0, H, V), g=key_gate(d, tt=0)), ValueError,
         ["T >= 1", "T = 0"]),
    Case("gla/head_dim_over_limit", lambda d: gla(
        d, q=t(d, B, T, H, 320), k=t(d, B, T, H, 320), g=key_gate(d, k=320)), ValueError,
         ["K = 320", "K <= 256"]),
    Case("gla/cu_seqlens_with_batch_2", lambda d: gla(d, cu_seqlens=idx(d, [0, 3, T])),
         ValueError, ["cu_seqlens:", "B == 1", f"B = {B}"]),
    Case("rwkv6/u_wrong_width", lambda d: rwkv6(d, u=t(d, H, K + 1)), ValueError,
         ["u:", "[H, K]", f"K is {K + 1} here but {K} in r"]),
    Case("rwkv6/u_with_batch_dim", lambda d: rwkv6(d, fn=fused_recurrent_rwkv6,
                                                   u=t(d, 1, H, K)), ValueError,
         ["u:", "2-D", "[H, K]", f"(1, {H}, {K})"]),
    Case("rwkv6/w_float64", lambda d: rwkv6(d, w=key_gate(d).double()), TypeError,
         ["w:", "float32, float16, bfloat16", "got float64"]),
    # ---- DPLR and RWKV7 (messages name the caller's arguments: r and w for RWKV7)
    Case("dplr/a_wrong_width", lambda d: dplr(d, a=t(d, B, T, H, K + 1)), ValueError,
         ["a:", f"K is {K + 1} here but {K} in q"]),
    Case("dplr/gk_scalar_per_head", lambda d: dplr(d, fn=fused_recurrent_dplr_delta_rule,
                                                   gk=gate(d)), ValueError,
         ["gk:", "4-D", "[B, T, H, K]", f"({B}, {T}, {H})"]),
    Case("dplr/cu_seqlens_not_increasing", lambda d: dplr(
        d, q=t(d, 1, T, H, K), k=t(d, 1, T, H, K), v=t(d, 1, T, H, V), a=t(d, 1, T, H, K),
        b=t(d, 1, T, H, K), gk=key_gate(d, b=1), cu_seqlens=idx(d, [0, 5, 3, T])), ValueError,
         ["cu_seqlens:", "strictly increasing", "5 then 3"]),
    Case("rwkv7/w_int", lambda d: rwkv7(d, w=torch.zeros(B, T, H, K, dtype=torch.int32,
                                                         device=d)), TypeError,
         ["w:", "float32, float16, bfloat16", "got int32"]),
    Case("rwkv7/initial_state_wrong_N", lambda d: rwkv7(d, fn=fused_recurrent_rwkv7,
                                                        initial_state=t(d, B + 1, H, K, V)),
         ValueError, ["initial_state:", f"N is {B + 1} here but {B} in r"]),
    # ---- layers (fla.layers): the common forward checks, then the op's
    Case("layer/gated_deltanet_width_mismatch", lambda d: layer(
        d, "GatedDeltaNet", x=t(d, B, T, 48)), ValueError,
         ["hidden_states:", "hidden_size = 64", f"({B}, {T}, 48)"]),
    Case("layer/gla_2d_input", lambda d: layer(d, "GatedLinearAttention", x=t(d, T, 64)),
         ValueError, ["hidden_states:", "[B, T, 64]"]),
    Case("layer/mask_shorter_than_T", lambda d: layer(
        d, "GatedDeltaNet", attention_mask=torch.ones(B, T - 3, device=d)), ValueError,
         ["attention_mask:", f"[{B}, L >= {T}]", f"({B}, {T - 3})"]),
    Case("layer/rwkv7_mask_and_cu_seqlens", lambda d: layer(
        d, "RWKV7Attention", x=t(d, 1, T, 64), attention_mask=torch.ones(1, T, device=d),
        cu_seqlens=idx(d, [0, 3, T])), ValueError, ["attention_mask and cu_seqlens"]),
    Case("layer/mamba2_unknown_mode", lambda d: __import__("fla.layers", fromlist=["Mamba2"])
         .Mamba2(hidden_size=64, head_dim=16, mode="parallel"), ValueError,
         ["mode:", "'chunk', 'fused_recurrent'", "'parallel'"]),
    # ---- models (fla.models): token ids, labels, masks, the cache, configs
    Case("model/token_id_ge_vocab", lambda d: model(d, input_ids=idx(d, [[1, 2, 100]])),
         ValueError, ["input_ids:", "vocab_size = 100", "maximum is 100"]),
    Case("model/token_id_negative", lambda d: model(d, input_ids=idx(d, [[1, -2, 3]])),
         ValueError, ["input_ids:", "vocab_size = 100", "minimum is -2"]),
    Case("model/float_token_ids", lambda d: model(d, input_ids=t(d, 1, 3)), TypeError,
         ["input_ids:", "integer tensor", "float32"]),
    Case("model/labels_wrong_shape", lambda d: model(d, labels=idx(d, [[1, 2]] * B)),
         ValueError, ["labels:", f"({B}, 4)", f"({B}, 2)"]),
    Case("model/label_id_ge_vocab", lambda d: model(d, labels=idx(d, [[1, 2, 3, 250]] * B)),
         ValueError, ["labels:", "vocab_size = 100", "maximum is 250"]),
    Case("model/mask_batch_mismatch", lambda d: model(
        d, attention_mask=torch.ones(B + 1, 4, device=d)), ValueError,
         ["attention_mask:", f"[{B}, L >= 4]", f"({B + 1}, 4)"]),
    Case("model/cache_not_a_cache", lambda d: model(d, past_key_values={}), TypeError,
         ["past_key_values:", "fla.models.utils.Cache", "dict"]),
    Case("model/config_heads_not_dividing", lambda d: __import__(
        "fla.models", fromlist=["GatedDeltaNetConfig"]).GatedDeltaNetConfig(
        hidden_size=64, num_heads=5, head_dim=16, num_v_heads=7), ValueError,
         ["num_v_heads:", "multiple of num_heads = 5", "got 7"]),
]


def test_the_cases_are_many_and_distinct():
    names = [case.name for case in CASES]
    assert len(names) == len(set(names)), "two cases share a name"
    assert len(CASES) >= 45


def _expect_refusal(case: Case, device) -> None:
    with no_kernel_launches():
        with pytest.raises(case.error) as info:
            case.call(device)
    message = str(info.value)
    needles = [n.replace("<other>", other(device)) for n in case.needles]
    missing = [n for n in needles if n not in message]
    assert not missing, f"{case.name}: message {message!r} lacks {missing}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_call_is_refused_before_any_kernel(case):
    _expect_refusal(case, "cpu")


# ----------------------------------------------------------------------- good calls
# One good call per family, the counterpart of the bad ones: on the GPU they run after
# every bad call, in the same process, and must succeed.
GOOD: dict[str, Callable[[str], object]] = {
    "chunk_gated_delta_rule": lambda d: gdr(d, output_final_state=True),
    "fused_recurrent_gated_delta_rule": lambda d: gdr(d, fn=_fr, output_final_state=True),
    "chunk_gated_delta_rule/varlen": lambda d: _cg(**packed(d), cu_seqlens=idx(d, [0, 3, T])),
    "chunk_delta_rule": lambda d: chunk_delta_rule(*qkv(d), beta=beta_(d)),
    "chunk_simple_gla": lambda d: sgla(d, g_gamma=-torch.rand(H, device=d)),
    "fused_recurrent_retention": lambda d: fused_recurrent_retention(*qkv(d)),
    "mamba_chunk_scan_combined": lambda d: ssd(d, D=t(d, MH), z=t(d, MB, MT, MH, MP)),
    "selective_state_update": lambda d: ssu(d, dt_softplus=True),
    "chunk_gated_delta_rule_fwd_h": lambda d: fwd_h(d),
    "chunk_scaled_dot_kkt_fwd": lambda d: chunk_scaled_dot_kkt_fwd(t(d, B, T, H, K),
                                                                   beta=beta_(d)),
    "chunk_local_cumsum": lambda d: chunk_local_cumsum(gate(d), 64),
    "solve_tril": lambda d: solve_tril(torch.tril(t(d, B, T, H, 16) * 0.1, -1)),
    "RMSNorm": lambda d: M.RMSNorm(32).to(d)(t(d, 4, 32)),
    "FusedRMSNormGated": lambda d: M.FusedRMSNormGated(32).to(d)(t(d, 4, 32), t(d, 4, 32)),
    "RotaryEmbedding": lambda d: rotary(d),
    "ShortConvolution": lambda d: conv(d),
    "l2_norm": lambda d: M.l2_norm(t(d, 4, 32)),
    "GatedMLP": lambda d: M.GatedMLP(32, intermediate_size=64).to(d)(t(d, 4, 32)),
    "FusedCrossEntropyLoss": lambda d: ce(d),
    "FusedLinearCrossEntropyLoss": lambda d: flce(d),
    "chunk_gla": lambda d: gla(d, output_final_state=True),
    "fused_recurrent_rwkv6": lambda d: rwkv6(d, fn=fused_recurrent_rwkv6),
    "chunk_rwkv7": lambda d: rwkv7(d, a=-F_normalize(t(d, B, T, H, K)),
                                   b=F_normalize(t(d, B, T, H, K)) * 0.5),
    "GatedDeltaNet layer": lambda d: layer(d, "GatedDeltaNet")[0],
    "GatedDeltaNet model": lambda d: model(d).logits,
}


def _finite(out) -> bool:
    tensors = [x for x in (out if isinstance(out, tuple) else (out,)) if x is not None]
    return all(bool(torch.isfinite(x).all()) for x in tensors)


@pytest.mark.interpret
@pytest.mark.parametrize("name", list(GOOD))
def test_good_call_runs(name, device):
    """The good calls are good (else the GPU test below would fail for the wrong reason)."""
    assert _finite(GOOD[name](device))


@pytest.mark.gpu
def test_gpu_bad_calls_leave_cuda_usable():
    """Every bad call with CUDA tensors, then a good call of every family, in one
    process: the bad calls are refused on the host, so the context stays healthy.

    Run on a GPU machine: ``python -m pytest -q tests/test_bad_inputs.py -m gpu``.
    """
    for case in CASES:
        _expect_refusal(case, "cuda")
    torch.cuda.synchronize()
    for name, call in GOOD.items():
        assert _finite(call("cuda")), name
    torch.cuda.synchronize()


# ----------------------------------------------------------------- empty row batches
# Row-wise modules (each token on its own) accept zero rows and return an empty result,
# as torch.nn's norms and Linear do; the token-mixing ops refuse T = 0 and B = 0 (cases
# above), and so do the losses (a mean over no rows).
EMPTY_ROWS = {
    "RMSNorm": lambda d: M.RMSNorm(32).to(d)(t(d, 0, 32)),
    "LayerNorm": lambda d: M.LayerNorm(32).to(d)(t(d, 2, 0, 32)),
    "FusedRMSNormGated": lambda d: M.FusedRMSNormGated(32).to(d)(t(d, 0, 32), t(d, 0, 32)),
    "l2_norm": lambda d: M.l2_norm(t(d, 0, 32)),
    "GatedMLP": lambda d: M.GatedMLP(32, intermediate_size=64).to(d)(t(d, 0, 32)),
}


@pytest.mark.parametrize("name", list(EMPTY_ROWS))
def test_row_wise_modules_map_zero_rows_to_zero_rows(name, device):
    out = EMPTY_ROWS[name](device)
    assert out.numel() == 0 and out.shape[-1] == 32


# -------------------------------------------------------------------- non-contiguous
def transposed_view(x: torch.Tensor) -> torch.Tensor:
    """Same values, last two axes swapped in memory: a non-contiguous view."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def _padding(x: torch.Tensor) -> torch.Tensor:
    """What the unused half of a strided buffer holds: NaN (a kernel that ignores the
    stride reads NaN); for class ids, 0 (a valid id, read at the wrong place)."""
    return torch.full_like(x, float("nan") if x.is_floating_point() else 0)


def strided_slice(x: torch.Tensor) -> torch.Tensor:
    """Same values, every other element of a padded buffer."""
    pad = _padding(x)
    return torch.stack([x, pad], dim=-1)[..., 0]


def batch_stride_view(x: torch.Tensor) -> torch.Tensor:
    """Same values, the first axis strided over a NaN-padded buffer (a slice of a
    larger cache, e.g. ``buffer[::2]``)."""
    pad = _padding(x)
    return torch.stack([x, pad], dim=1).flatten(0, 1)[::2]


@dataclass(frozen=True)
class Strided:
    """``run(**make(d))`` must give the same result when any of ``args`` is replaced by a
    non-contiguous view of the same values (or be refused naming the argument)."""

    name: str
    make: Callable[[str], dict]
    run: Callable[..., object]
    args: Sequence[str]

    def __str__(self) -> str:
        return self.name


def _ssu_run(**kw):
    state = kw.pop("state")
    y = selective_state_update(state, **kw)
    return y, state


STRIDED = [
    Strided("chunk_gated_delta_rule", lambda d: dict(zip("qkv", qkv(d)), g=gate(d), beta=beta_(d),
                                                     initial_state=t(d, B, H, K, V)),
            lambda **kw: _cg(**kw, output_final_state=True), ["q", "v", "g", "initial_state"]),
    Strided("fused_recurrent_gated_delta_rule",
            lambda d: dict(zip("qkv", qkv(d)), g=gate(d), beta=beta_(d)),
            lambda **kw: _fr(**kw, output_final_state=True), ["k", "beta"]),
    Strided("chunk_simple_gla", lambda d: dict(zip("qkv", qkv(d)), g=gate(d)),
            lambda **kw: chunk_simple_gla(**kw, output_final_state=True), ["k", "g"]),
    Strided("mamba_chunk_scan_combined",
            lambda d: dict(x=t(d, MB, MT, MH, MP), dt=torch.rand(MB, MT, MH, device=d),
                           A=-torch.rand(MH, device=d), B=t(d, MB, MT, MG, MN),
                           C=t(d, MB, MT, MG, MN), z=t(d, MB, MT, MH, MP)),
            lambda **kw: mamba_chunk_scan_combined(**kw, chunk_size=64), ["x", "C", "z"]),
    Strided("selective_state_update",
            lambda d: dict(state=t(d, MB, MH, MP, MN), x=t(d, MB, MH, MP),
                           dt=torch.rand(MB, MH, device=d), A=-torch.rand(MH, device=d),
                           B=t(d, MB, MG, MN), C=t(d, MB, MG, MN)),
            _ssu_run, ["state", "x", "B"]),
    Strided("chunk_local_cumsum", lambda d: dict(g=gate(d)),
            lambda **kw: chunk_local_cumsum(**kw, chunk_size=64), ["g"]),
    Strided("solve_tril", lambda d: dict(A=torch.tril(t(d, B, T, H, 16) * 0.1, -1)),
            lambda **kw: solve_tril(**kw), ["A"]),
    Strided("RMSNorm", lambda d: dict(x=t(d, 4, 6, 32)),
            lambda **kw: M.rms_norm(kw["x"], torch.ones(32, device=kw["x"].device), None),
            ["x"]),
    Strided("FusedRMSNormGated", lambda d: dict(x=t(d, 6, 32), g=t(d, 6, 32)),
            lambda **kw: M.rms_norm_gated(kw["x"], kw["g"], torch.ones(32, device=kw["x"].device),
                                          None), ["x", "g"]),
    Strided("RotaryEmbedding", lambda d: dict(zip("qk", qkv(d)[:2])),
            lambda **kw: M.RotaryEmbedding(K)(**kw), ["q", "k"]),
    Strided("ShortConvolution", lambda d: dict(x=t(d, B, T, 32)),
            lambda **kw: torch.manual_seed(0) and M.ShortConvolution(32, 4).to(
                kw["x"].device)(**kw)[0], ["x"]),
    Strided("l2_norm", lambda d: dict(x=t(d, 6, 32)), lambda **kw: M.l2_norm(**kw), ["x"]),
    Strided("FusedCrossEntropyLoss",
            lambda d: dict(logits=t(d, 6, 50), target=idx(d, [1, 2, 3, 4, 5, 6])),
            lambda **kw: M.cross_entropy_loss(**kw, reduction="none"), ["logits", "target"]),
    Strided("FusedLinearCrossEntropyLoss",
            lambda d: dict(x=t(d, 6, 32), target=idx(d, [1, 2, 3, 4, 5, 6]), weight=t(d, 50, 32)),
            lambda **kw: M.fused_linear_cross_entropy(**kw, reduction="none"), ["x", "weight"]),
]
VIEWS = {"transposed": transposed_view, "strided": strided_slice, "batch_stride": batch_stride_view}


def _as_tuple(out):
    return tuple(x for x in (out if isinstance(out, tuple) else (out,)) if x is not None)


@pytest.mark.interpret
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("case", STRIDED, ids=str)
def test_non_contiguous_inputs_give_the_contiguous_result(case, view, device):
    inputs = case.make(device)
    expected = _as_tuple(case.run(**{n: x.clone() for n, x in inputs.items()}))
    for arg in case.args:
        x = inputs[arg]
        if view == "transposed" and (x.dim() < 2 or 1 in x.shape[-2:]):
            continue
        bad = VIEWS[view](x)
        assert not bad.is_contiguous() and torch.equal(bad, x)
        args = {n: (bad if n == arg else y.clone()) for n, y in inputs.items()}
        try:
            got = _as_tuple(case.run(**args))
        except (ValueError, TypeError) as error:  # refused: must say which argument
            assert str(error).startswith(arg) and "contiguous" in str(error), str(error)
            continue
        assert len(got) == len(expected)
        for i, (a, b) in enumerate(zip(got, expected)):
            # Not bitwise: PyTorch's CPU elementwise ops (Mamba2's z gate) take a scalar
            # loop on strided tensors and a vector loop on contiguous ones, an ulp apart.
            # A stride read wrongly gives NaN (the padding) or values off by O(1).
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True,
                                       msg=lambda m: f"{case.name}, {view} {arg}, out {i}: {m}")


# ------------------------------------------------------------------ NaN propagation
# A NaN in q at one position (sequence 0, token NAN_T, head 0) reaches exactly the output
# of that token and head: o there is all NaN, every other output and the final state stay
# finite. A NaN in the log gate g at that position reaches the outputs of that head from
# that token on and its final state. No path may crash on NaN or return a finite value
# where the maths has a NaN. Both CPU paths run: the PyTorch one (FLA_BACKEND=torch) and
# the Triton kernels (interpreted here, compiled on a GPU).
#
# The chunked forms spread a NaN in k, v, g or beta a little further than the maths: to
# the earlier tokens of its 64-token chunk too, in that head. Inside a chunk the causal
# mask is a zero entry of a matrix product (intra-chunk attention times V, the
# triangular solve of the delta rule), and 0 · NaN = NaN. Other heads, other sequences
# and earlier chunks stay finite. A NaN in q does not spread (q is only ever a left
# operand, one row per token).
NAN_T = 3
CHUNKED = {"chunk_gated_delta_rule", "chunk_simple_gla"}


def _nan_at(x: torch.Tensor, where) -> torch.Tensor:
    x = x.clone()
    x[where] = float("nan")
    return x


def _recurrent_inputs(d):
    q, k, v = qkv(d)
    return dict(q=q, k=torch.nn.functional.normalize(k, dim=-1), v=v, g=gate(d), beta=beta_(d))


NAN_OPS = {
    "chunk_gated_delta_rule": lambda **kw: _cg(**kw, output_final_state=True),
    "fused_recurrent_gated_delta_rule": lambda **kw: _fr(**kw, output_final_state=True),
    "chunk_simple_gla": lambda beta, **kw: chunk_simple_gla(**kw, output_final_state=True),
    "fused_recurrent_simple_gla": lambda beta, **kw: fused_recurrent_simple_gla(
        **kw, output_final_state=True),
}


@pytest.fixture(params=["torch", "triton"])
def path(request, monkeypatch, device):
    """The device and backend of a numerics test: the PyTorch path on CPU tensors, or
    the Triton kernels (on the GPU if there is one, else interpreted)."""
    if request.param == "torch":
        monkeypatch.setenv("FLA_BACKEND", "torch")
        return "cpu"
    return device


@pytest.mark.interpret
@pytest.mark.parametrize("op", list(NAN_OPS))
def test_nan_in_q_reaches_only_its_output(op, path):
    inputs = _recurrent_inputs(path)
    inputs["q"] = _nan_at(inputs["q"], (0, NAN_T, 0, 5))
    o, final = NAN_OPS[op](**inputs)
    assert torch.isnan(o[0, NAN_T, 0]).all(), "the output of the NaN query is not NaN"
    rest = torch.ones_like(o, dtype=torch.bool)
    rest[0, NAN_T, 0] = False
    assert torch.isfinite(o[rest]).all(), "the NaN spread to outputs that do not read it"
    assert torch.isfinite(final).all(), "q does not enter the state, yet it is not finite"


@pytest.mark.interpret
@pytest.mark.parametrize("op", list(NAN_OPS))
def test_nan_in_g_reaches_the_later_outputs_and_the_state(op, path):
    inputs = _recurrent_inputs(path)
    inputs["g"] = _nan_at(inputs["g"], (0, NAN_T, 0))
    o, final = NAN_OPS[op](**inputs)
    assert torch.isnan(o[0, NAN_T:, 0]).all(dim=-1).all(), "an output after the NaN is finite"
    assert torch.isnan(final[0, 0]).all(), "the final state of the NaN's head is finite"
    if op not in CHUNKED:
        assert torch.isfinite(o[0, :NAN_T]).all(), "the NaN reached earlier tokens"
    assert torch.isfinite(o[1]).all() and torch.isfinite(o[0, :, 1]).all(), \
        "the NaN reached another sequence or head"
    assert torch.isfinite(final[1]).all() and torch.isfinite(final[0, 1]).all()


@pytest.mark.interpret
def test_nan_in_mamba2_inputs(path):
    """A NaN in C (the query) reaches the outputs of that token's group only; a NaN in
    x reaches that head and channel's outputs from the token on (and, the scan being
    chunked, the earlier tokens of the chunk); a NaN in one entry of the decoding state
    stays in that entry and reaches that row's output."""
    d = path
    x, dt, A = t(d, MB, MT, MH, MP), torch.rand(MB, MT, MH, device=d), -torch.rand(MH, device=d)
    Bm, C = t(d, MB, MT, MG, MN), t(d, MB, MT, MG, MN)
    heads = MH // MG  # heads 0 .. heads-1 read group 0
    y = mamba_chunk_scan_combined(x, dt, A, Bm, _nan_at(C, (0, NAN_T, 0, 2)), 64)
    assert torch.isnan(y[0, NAN_T, :heads]).all()
    rest = torch.ones_like(y, dtype=torch.bool)
    rest[0, NAN_T, :heads] = False
    assert torch.isfinite(y[rest]).all()

    y, final = mamba_chunk_scan_combined(_nan_at(x, (0, NAN_T, 1, 0)), dt, A, Bm, C, 64,
                                         return_final_states=True)
    assert torch.isnan(y[0, NAN_T:, 1, 0]).all()
    rest = torch.ones_like(y, dtype=torch.bool)
    rest[0, :, 1, 0] = False
    assert torch.isfinite(y[rest]).all()
    assert torch.isnan(final[0, 1, 0]).all()
    rest = torch.ones_like(final, dtype=torch.bool)
    rest[0, 1, 0] = False
    assert torch.isfinite(final[rest]).all()

    state = t(d, MB, MH, MP, MN)
    state[1, 2, 3, 4] = float("nan")
    y = selective_state_update(state, t(d, MB, MH, MP), torch.rand(MB, MH, device=d),
                               -torch.rand(MH, device=d), t(d, MB, MG, MN), t(d, MB, MG, MN))
    assert torch.isnan(y[1, 2, 3]) and torch.isnan(state[1, 2, 3, 4])
    assert int(torch.isfinite(state).sum()) == state.numel() - 1  # the update is per element
    rest = torch.ones_like(y, dtype=torch.bool)
    rest[1, 2, 3] = False
    assert torch.isfinite(y[rest]).all()


@pytest.mark.interpret
def test_nan_in_module_inputs(path):
    """Row-wise modules: a NaN in one row gives NaN in that row only; the loss of a row
    with a NaN logit is NaN (and so is the mean)."""
    d = path
    x = _nan_at(t(d, 4, 32), (2, 7))
    for name, y in [("rms_norm", M.rms_norm(x, torch.ones(32, device=d), None)),
                    ("l2_norm", M.l2_norm(x)),
                    ("rotary", M.RotaryEmbedding(K)(*[_nan_at(z, (0, NAN_T, 0, 1))
                                                      for z in qkv(d)[:2]])[0])]:
        bad = (2,) if name != "rotary" else (0, NAN_T, 0)
        assert torch.isnan(y[bad]).any(), name
        rest = torch.ones_like(y, dtype=torch.bool)
        rest[bad] = False
        assert torch.isfinite(y[rest]).all(), name
    loss = M.cross_entropy_loss(_nan_at(t(d, 6, 50), (4, 9)), idx(d, [1, 2, 3, 4, 5, 6]),
                                reduction="none")
    assert torch.isnan(loss[4]) and torch.isfinite(loss[[0, 1, 2, 3, 5]]).all()
    y = M.ShortConvolution(32, 4).to(d)(_nan_at(t(d, B, T, 32), (0, NAN_T, 5)))[0]
    assert torch.isnan(y[0, NAN_T:NAN_T + 4, 5]).all()  # the W = 4 taps that read it
    assert torch.isfinite(y[0, :NAN_T]).all() and torch.isfinite(y[1]).all()


# ---------------------------------------------------------------------- determinism
# The same inputs give bitwise-identical outputs and gradients across calls. No kernel
# accumulates with atomics, and the launch configuration of a kernel is fixed per
# process (the tuning layer's default, or its cached choice), so the order of every
# floating-point sum is fixed.
DETERMINISM = {
    "chunk_gated_delta_rule": (lambda d: _recurrent_inputs(d), NAN_OPS["chunk_gated_delta_rule"]),
    "fused_recurrent_gated_delta_rule": (lambda d: _recurrent_inputs(d),
                                         NAN_OPS["fused_recurrent_gated_delta_rule"]),
    "chunk_simple_gla": (lambda d: dict(zip("qkv", qkv(d)), g=gate(d), beta=None),
                         NAN_OPS["chunk_simple_gla"]),
    "mamba_chunk_scan_combined": (
        lambda d: dict(x=t(d, MB, MT, MH, MP), dt=torch.rand(MB, MT, MH, device=d),
                       A=-torch.rand(MH, device=d), B=t(d, MB, MT, MG, MN),
                       C=t(d, MB, MT, MG, MN), D=t(d, MH), z=t(d, MB, MT, MH, MP)),
        lambda **kw: mamba_chunk_scan_combined(**kw, chunk_size=64, return_final_states=True)),
    "ShortConvolution": (lambda d: dict(x=t(d, B, T, 32)),
                         lambda x: torch.manual_seed(0) and M.ShortConvolution(32, 4).to(
                             x.device)(x, output_final_state=True)),
    "rms_norm": (lambda d: dict(x=t(d, 6, 32), weight=t(d, 32)),
                 lambda x, weight: M.rms_norm(x, weight, None)),
    "cross_entropy_loss": (lambda d: dict(logits=t(d, 6, 50)),
                           lambda logits: M.cross_entropy_loss(
                               logits, idx(logits.device, [1, 2, 3, 4, 5, 6]))),
}


def _forward_backward(run, inputs):
    leaves = {n: (x.clone().requires_grad_(x.is_floating_point()) if x is not None else None)
              for n, x in inputs.items()}
    out = _as_tuple(run(**leaves))
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel(), device=o.device).view_as(o)).sum()
               for o in out if o.requires_grad)
    loss.backward()
    grads = tuple(x.grad for x in leaves.values() if x is not None and x.grad is not None)
    return tuple(o.detach() for o in out), grads


@pytest.mark.interpret
@pytest.mark.parametrize("name", list(DETERMINISM))
def test_forward_and_backward_are_bitwise_deterministic(name, path):
    make, run = DETERMINISM[name]
    inputs = make(path)
    out1, grads1 = _forward_backward(run, inputs)
    out2, grads2 = _forward_backward(run, inputs)
    assert grads1, "nothing was differentiated"
    for a, b in zip(out1 + grads1, out2 + grads2):
        assert torch.equal(a, b), f"{name}: two identical calls differ"
