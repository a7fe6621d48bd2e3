"""The registry of side-by-side benchmark cases.

A case is one op at one shape: where the op lives in the ``fla`` API (the same module
path and name in ours and in the reference library), how to build its inputs (bf16 on
the device, never zeros, the same values in both processes), which modes it is timed in
(``fwd``; ``fwdbwd`` = forward then backward of a fixed random grad_output), and how much
work one call does (FLOPs and/or bytes), from which the runner derives TFLOP/s and GB/s.

The shapes are the ones the issues name (``issues show 3`` .. ``7``). Case names are
``<op>/<shape joined by x>``, e.g. ``chunk_gated_delta_rule/1x8192x96x128``.

Work conventions (the same numbers for both libraries, so rates compare like times):

* FLOPs count the useful matrix products of the chunked algorithm with a chunk of
  ``C = 64`` tokens (full C x C tiles, the causal half included, as the kernels compute
  them); element-wise work is ignored. A backward is counted as twice its forward, so
  ``fwdbwd = 3 x fwd`` (the usual convention) unless a case says otherwise.
* Bytes are the compulsory traffic: every input read once and every output written
  once (``fwd = in + out``). For ``fwdbwd`` the backward reads the inputs and the output
  gradient and writes one gradient per input: ``fwdbwd = 3 * in + 2 * out``.
"""
from __future__ import annotations

import fnmatch
import importlib
import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16
FP32 = torch.float32
C = 64  # chunk length used for counting FLOPs (not a parameter of any call)

MODES = ("fwd", "fwdbwd")

# Families whose reference backward goes through its gated ``chunk_bwd_dqkwg``, which
# flash-linear-attention 0.6.0 refuses on Hopper with Triton 3.4-3.7.0 (see
# shared/gpu/REFERENCE.md): the runner patches the check out and labels these results.
REF_GATED_BWD_FAMILIES = ("gated_delta_rule", "simple_gla")


class MissingOp(Exception):
    """The op's module or name does not exist in the ``fla`` being measured."""


@dataclass
class Prepared:
    """One case's inputs, built on the device, ready to call."""

    forward: Callable[[], Any]           # one forward call of the op
    leaves: list                         # tensors/parameters that receive gradients
    notes: list = field(default_factory=list)  # facts found while calling (compat fallbacks)

    def grad_target(self, out: Any) -> torch.Tensor:
        """The output the backward starts from: the first tensor of the result."""
        return first_tensor(out)


@dataclass(frozen=True)
class Case:
    name: str                    # unique id: "<op>/<shape>"
    op: str                      # function or class name, e.g. "chunk_gated_delta_rule"
    family: str                  # op family, e.g. "gated_delta_rule"
    module: str                  # import path, e.g. "fla.ops.gated_delta_rule"
    function: str                # attribute of ``module`` (a function or a class)
    shape: tuple                 # sizes, named by ``dims``
    dims: str                    # letters of ``shape``, e.g. "B,T,H,D"
    build: Callable[["Case", Any, str, bool], Prepared]  # (case, fn, device, grad)
    work: Callable[["Case", str], dict]  # (case, mode) -> {"flops", "bytes", "state_bytes"}
    modes: tuple = MODES
    issue: int = 0               # the issue that names this case
    default: bool = False        # part of the modest default run of scripts/gpu_run.sh
    baseline: bool = False       # plain PyTorch, timed in the "ours" process only
    baseline_for: str | None = None  # the case a baseline gives context to
    ref_gated_bwd: bool = False  # the reference's Hopper check must be patched out
    est_ref_cold_s: float = 60.0  # rough first-call cost in the reference (orders runs)
    params: tuple = ()           # extra fixed arguments as (name, value) pairs
    note: str = ""

    @property
    def path(self) -> str:
        return f"{self.module}.{self.function}"

    @property
    def shape_str(self) -> str:
        return "x".join(str(s) for s in self.shape)

    @property
    def seed(self) -> int:
        # The same inputs in both processes: a seed derived from the name alone.
        return zlib.crc32(self.name.encode()) & 0x7FFFFFFF

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    def resolve(self) -> Any:
        """Import the op from whichever ``fla`` is importable; MissingOp if absent.

        An ImportError or NotImplementedError raised while importing counts as absent.
        """
        try:
            module = importlib.import_module(self.module)
        except (ImportError, NotImplementedError) as exc:
            raise MissingOp(f"cannot import {self.module}: {type(exc).__name__}: {exc}") from exc
        try:
            return getattr(module, self.function)
        except AttributeError as exc:
            raise MissingOp(f"{self.module} has no {self.function}") from exc

    def prepare(self, fn: Any, device: str, grad: bool) -> Prepared:
        return self.build(self, fn, device, grad)

    def work_for(self, mode: str) -> dict:
        return {k: float(v) for k, v in self.work(self, mode).items() if v is not None}

    def with_shape(self, shape: Sequence[int]) -> "Case":
        return replace(self, shape=tuple(shape))

    def tiny(self) -> "Case":
        """The same case at a small shape (smoke tests on CPU / the interpreter)."""
        return self.with_shape(_tiny_shape(self.dims, self.shape))


def first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor):
                return item
    raise TypeError(f"the op returned no tensor: {type(out).__name__}")


def _tiny_shape(dims: str, shape: tuple) -> tuple:
    small = {"B": 2, "T": 128, "H": 2, "D": 32, "N": 64, "P": 16, "S": 16, "HID": 64,
             "V": 512}
    out = []
    for letter, size in zip(dims.split(","), shape):
        out.append(min(size, small.get(letter, size)))
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Input helpers. A generator seeded from the case name gives both processes the same values.

def _gen(case: Case, device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(case.seed)


def _randn(gen, shape, device, dtype=BF16, scale=1.0) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, device=device, dtype=FP32)
    return (x * scale).to(dtype)


def _leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return x.detach().contiguous().requires_grad_(grad)


def _l2(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x.float(), dim=-1).to(x.dtype)


def _log_decay(gen, shape, device, dtype=FP32) -> torch.Tensor:
    # logsigmoid(randn): strictly negative log decays, mostly in [-3, -0.05].
    return F.logsigmoid(torch.randn(shape, generator=gen, device=device, dtype=FP32)).to(dtype)


def _unit(gen, shape, device, dtype=BF16) -> torch.Tensor:
    return torch.sigmoid(torch.randn(shape, generator=gen, device=device, dtype=FP32)).to(dtype)


def _nbytes(shape: Sequence[int], dtype_bytes: int) -> float:
    n = 1
    for s in shape:
        n *= s
    return float(n * dtype_bytes)


def io_bytes(mode: str, inputs: float, outputs: float) -> float:
    """Compulsory traffic: fwd = in + out; fwd+bwd = 3 in + 2 out (see module doc)."""
    return inputs + outputs if mode == "fwd" else 3 * inputs + 2 * outputs


def _times(mode: str, fwd: float, fwdbwd_factor: float = 3.0) -> float:
    return fwd if mode == "fwd" else fwdbwd_factor * fwd


# ---------------------------------------------------------------------------------------
# Builders: (case, fn, device, grad) -> Prepared. Every call uses keyword arguments only.

def _build_gated_delta_rule(case, fn, device, grad):
    # Gated DeltaNet as its layer feeds the op: q, k l2-normalised, g = log decay in fp32
    # (the layer computes it in fp32), beta in (0, 1) in the activation dtype.
    B, T, H, D = case.shape
    gen = _gen(case, device)
    q = _leaf(_l2(_randn(gen, (B, T, H, D), device)), grad)
    k = _leaf(_l2(_randn(gen, (B, T, H, D), device)), grad)
    v = _leaf(_randn(gen, (B, T, H, D), device), grad)
    g = _leaf(_log_decay(gen, (B, T, H), device), grad)
    beta = _leaf(_unit(gen, (B, T, H), device), grad)
    return Prepared(lambda: fn(q=q, k=k, v=v, g=g, beta=beta), [q, k, v, g, beta])


def _build_delta_rule(case, fn, device, grad):
    B, T, H, D = case.shape
    gen = _gen(case, device)
    q = _leaf(_l2(_randn(gen, (B, T, H, D), device)), grad)
    k = _leaf(_l2(_randn(gen, (B, T, H, D), device)), grad)
    v = _leaf(_randn(gen, (B, T, H, D), device), grad)
    beta = _leaf(_unit(gen, (B, T, H), device), grad)
    return Prepared(lambda: fn(q=q, k=k, v=v, beta=beta), [q, k, v, beta])


def _build_simple_gla(case, fn, device, grad):
    # Per-token, per-head scalar log decay g [B, T, H] in fp32.
    B, T, H, D = case.shape
    gen = _gen(case, device)
    q = _leaf(_randn(gen, (B, T, H, D), device), grad)
    k = _leaf(_randn(gen, (B, T, H, D), device), grad)
    v = _leaf(_randn(gen, (B, T, H, D), device), grad)
    g = _leaf(_log_decay(gen, (B, T, H), device), grad)
    return Prepared(lambda: fn(q=q, k=k, v=v, g=g), [q, k, v, g])


def _build_gla(case, fn, device, grad):
    # Per-channel log decay g [B, T, H, K] in the activation dtype (as the GLA layer makes it).
    B, T, H, D = case.shape
    gen = _gen(case, device)
    q = _leaf(_randn(gen, (B, T, H, D), device), grad)
    k = _leaf(_randn(gen, (B, T, H, D), device), grad)
    v = _leaf(_randn(gen, (B, T, H, D), device), grad)
    g = _leaf(_log_decay(gen, (B, T, H, D), device, BF16), grad)
    return Prepared(lambda: fn(q=q, k=k, v=v, g=g), [q, k, v, g])


def _build_rwkv6(case, fn, device, grad):
    B, T, H, D = case.shape
    gen = _gen(case, device)
    r = _leaf(_randn(gen, (B, T, H, D), device), grad)
    k = _leaf(_randn(gen, (B, T, H, D), device), grad)
    v = _leaf(_randn(gen, (B, T, H, D), device), grad)
    w = _leaf(_log_decay(gen, (B, T, H, D), device, BF16), grad)
    u = _leaf(_randn(gen, (H, D), device, scale=0.5), grad)
    return Prepared(lambda: fn(r=r, k=k, v=v, w=w, u=u), [r, k, v, w, u])


def _build_rwkv7(case, fn, device, grad):
    # RWKV7's ranges: log decay w in (-e^-0.5, 0); a = -kk, b = kk * sigmoid(.) with kk a
    # unit vector (the layer's kappa-hat); scale stays at the op's default 1.0, so r and k
    # are scaled by K^-1/2 to keep magnitudes as in a trained model.
    B, T, H, D = case.shape
    gen = _gen(case, device)
    r = _leaf(_randn(gen, (B, T, H, D), device, scale=D ** -0.5), grad)
    w = _leaf((-math.exp(-0.5) * _unit(gen, (B, T, H, D), device, FP32)).to(BF16), grad)
    k = _leaf(_randn(gen, (B, T, H, D), device, scale=D ** -0.5), grad)
    v = _leaf(_randn(gen, (B, T, H, D), device), grad)
    kk = _l2(_randn(gen, (B, T, H, D), device)).float()
    a = _leaf((-kk).to(BF16), grad)
    b = _leaf((kk * _unit(gen, (B, T, H, D), device, FP32)).to(BF16), grad)
    return Prepared(lambda: fn(r=r, w=w, k=k, v=v, a=a, b=b), [r, w, k, v, a, b])


class _KeywordCall:
    """Calls ``fn(**kwargs)``; if ``fn`` rejects one of ``optional`` as an unexpected
    keyword (a TypeError before any work), drops it, notes it, and calls again."""

    def __init__(self, fn, kwargs: dict, optional: Sequence[str], notes: list):
        self.fn, self.kwargs, self.optional, self.notes = fn, dict(kwargs), optional, notes

    def __call__(self):
        while True:
            try:
                return self.fn(**self.kwargs)
            except TypeError as exc:
                dropped = [n for n in self.optional if n in self.kwargs and f"'{n}'" in str(exc)
                           and "unexpected keyword" in str(exc)]
                if not dropped:
                    raise
                for name in dropped:
                    value = self.kwargs.pop(name)
                    self.notes.append(f"this fla does not accept {name}={value!r}: "
                                      f"called without it")


def _build_fwd_h(case, fn, device, grad):
    # The field call of issue 3: k, w, u = randn bf16; g fp32 chunk-local cumulative log
    # decay (cumsum within each chunk of 64, what chunk_local_cumsum returns), called as
    # chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, head_first=False, chunk_size=64).
    B, T, H, D = case.shape
    chunk = case.param("chunk_size", 64)
    gen = _gen(case, device)
    k = _randn(gen, (B, T, H, D), device)
    w = _randn(gen, (B, T, H, D), device)
    u = _randn(gen, (B, T, H, D), device)
    step = _log_decay(gen, (B, T, H), device)
    pad = (-T) % chunk
    padded = F.pad(step, (0, 0, 0, pad)) if pad else step
    g = padded.view(B, -1, chunk, H).cumsum(2).view(B, T + pad, H)[:, :T].contiguous()
    prepared = Prepared(forward=None, leaves=[])
    prepared.forward = _KeywordCall(
        fn, dict(k=k, w=w, u=u, g=g, head_first=False, chunk_size=chunk),
        optional=("head_first",), notes=prepared.notes)
    return prepared


def _build_decode(case, fn, device, grad):
    # One decoding step: T = 1, fp32 state in and out (the state traffic dominates).
    B, T, H, D = case.shape
    gen = _gen(case, device)
    q = _l2(_randn(gen, (B, T, H, D), device))
    k = _l2(_randn(gen, (B, T, H, D), device))
    v = _randn(gen, (B, T, H, D), device)
    g = _log_decay(gen, (B, T, H), device)
    beta = _unit(gen, (B, T, H), device)
    h0 = _randn(gen, (B, H, D, D), device, dtype=FP32, scale=0.1)
    return Prepared(lambda: fn(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0,
                               output_final_state=True), [])


def _build_rms_norm(case, fn, device, grad):
    N, D = case.shape
    gen = _gen(case, device)
    norm = fn(D).to(device=device, dtype=BF16)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(D, generator=gen, device=device))
    norm.weight.requires_grad_(grad)
    x = _leaf(_randn(gen, (N, D), device), grad)
    return Prepared(lambda: norm(x), [x, norm.weight])


def _build_rms_norm_torch(case, fn, device, grad):
    N, D = case.shape
    gen = _gen(case, device)
    weight = _leaf((1.0 + 0.1 * _randn(gen, (D,), device, dtype=FP32)).to(BF16), grad)
    x = _leaf(_randn(gen, (N, D), device), grad)
    return Prepared(lambda: fn(x, (D,), weight, 1e-5), [x, weight])


def _build_flce(case, fn, device, grad):
    # x [N, HID] bf16, lm-head weight [V, HID] bf16, targets in [0, V). Called like the
    # reference's module: loss = FusedLinearCrossEntropyLoss()(x, target, weight).
    N, HID, V = case.shape
    gen = _gen(case, device)
    crit = fn()
    x = _leaf(_randn(gen, (N, HID), device), grad)
    weight = _leaf(_randn(gen, (V, HID), device, scale=HID ** -0.5), grad)
    target = torch.randint(0, V, (N,), generator=gen, device=device)
    return Prepared(lambda: crit(x, target, weight), [x, weight])


def _build_flce_torch(case, fn, device, grad):
    N, HID, V = case.shape
    gen = _gen(case, device)
    x = _leaf(_randn(gen, (N, HID), device), grad)
    weight = _leaf(_randn(gen, (V, HID), device, scale=HID ** -0.5), grad)
    target = torch.randint(0, V, (N,), generator=gen, device=device)
    return Prepared(lambda: fn(F.linear(x, weight).float(), target), [x, weight])


def _build_sdpa(case, fn, device, grad):
    B, T, H, D = case.shape
    gen = _gen(case, device)
    q, k, v = (_leaf(_randn(gen, (B, H, T, D), device), grad) for _ in range(3))
    return Prepared(lambda: fn(q, k, v, is_causal=True), [q, k, v])


def _build_mamba2(case, fn, device, grad):
    # Mamba2 (SSD) as its layer calls it: x [B, T, H, P], dt [B, T, H] raw (softplus with
    # dt_bias in the op), A = -exp(.) [H] fp32, B/C [B, T, G, N], D [H] fp32.
    Bsz, T, H, P, N = case.shape
    G, chunk = case.param("G", 1), case.param("chunk_size", 256)
    gen = _gen(case, device)
    x = _leaf(_randn(gen, (Bsz, T, H, P), device), grad)
    dt = _leaf(_randn(gen, (Bsz, T, H), device, scale=0.5), grad)
    A = _leaf(-torch.exp(_randn(gen, (H,), device, dtype=FP32, scale=0.5)), grad)
    Bm = _leaf(_randn(gen, (Bsz, T, G, N), device), grad)
    Cm = _leaf(_randn(gen, (Bsz, T, G, N), device), grad)
    D = _leaf(_randn(gen, (H,), device, dtype=FP32), grad)
    dt_bias = _leaf(_randn(gen, (H,), device, dtype=FP32, scale=0.5) - 2.0, grad)
    return Prepared(lambda: fn(x=x, dt=dt, A=A, B=Bm, C=Cm, chunk_size=chunk, D=D,
                               dt_bias=dt_bias, dt_softplus=True),
                    [x, dt, A, Bm, Cm, D, dt_bias])


def _build_mamba2_layer(case, cls, device, grad):
    # The Mamba2 mixer layer (in_proj, short conv, SSD, gated RMS norm, out_proj) with the
    # op case's SSD sizes: width d = H·P / 2 (expand 2). Both libraries name it
    # fla.layers.Mamba2 with these arguments; without mamba_ssm installed the reference's
    # layer runs its PyTorch SSD (``torch_forward``). Parameters in bf16 as a bf16 model
    # holds them; gradients for the input and every parameter.
    Bsz, T, H, P, N = case.shape
    G, chunk = case.param("G", 1), case.param("chunk_size", 256)
    torch.manual_seed(case.seed)
    layer = cls(hidden_size=H * P // 2, num_heads=H, head_dim=P, state_size=N, expand=2,
                n_groups=G, chunk_size=chunk).to(device=device, dtype=BF16)
    layer.requires_grad_(grad)
    x = _leaf(_randn(_gen(case, device), (Bsz, T, H * P // 2), device), grad)
    return Prepared(lambda: layer(x), [x, *layer.parameters()] if grad else [x])


# ---------------------------------------------------------------------------------------
# Work counts: (case, mode) -> {"flops": ..., "bytes": ..., "state_bytes": ...}.

def _qkv_io(B, T, H, D, n_in_tokens_tensors=3, gate_bytes=0.0, head_in_bytes=0.0):
    """Inputs: n token tensors [B,T,H,D] bf16 + gates; output o [B,T,H,D] bf16."""
    tok = _nbytes((B, T, H, D), 2)
    return n_in_tokens_tensors * tok + gate_bytes + head_in_bytes, tok


def _work_gated_delta_rule(case, mode):
    # Per token and head (C = 64, K = V = D): kkt 2CK, w = A(beta k) 2CK, u = A(beta v)
    # 2CV, triangular solve ~C^2, state pass w.S 2KV + k^T v_new 2KV, output q k^T 2CK +
    # q.S 2KV + A.v_new 2CV  =>  6CK + 4CV + C^2 + 6KV.
    B, T, H, D = case.shape
    K = V = D
    fwd = B * T * H * (6 * C * K + 4 * C * V + C * C + 6 * K * V)
    beta = _nbytes((B, T, H), 2)
    gates = beta + (_nbytes((B, T, H), 4) if case.family == "gated_delta_rule" else 0.0)
    inp, out = _qkv_io(B, T, H, D, 3, gates)
    return {"flops": _times(mode, fwd), "bytes": io_bytes(mode, inp, out)}


def _work_linear_attention(case, mode):
    # simple GLA / GLA / RWKV6, per token and head: intra-chunk q k^T 2CK and A.v 2CV,
    # inter-chunk q.S 2KV, state update k^T v 2KV  =>  2C(K + V) + 4KV.
    B, T, H, D = case.shape
    K = V = D
    fwd = B * T * H * (2 * C * (K + V) + 4 * K * V)
    if case.family == "simple_gla":
        gates = _nbytes((B, T, H), 4)
    else:  # per-channel bf16 gate [B, T, H, K] (+ RWKV6's u [H, K], negligible)
        gates = _nbytes((B, T, H, D), 2) + (_nbytes((H, D), 2) if case.family == "rwkv6" else 0)
    inp, out = _qkv_io(B, T, H, D, 3, gates)
    return {"flops": _times(mode, fwd), "bytes": io_bytes(mode, inp, out)}


def _work_rwkv7(case, mode):
    # Diagonal-plus-low-rank (RWKV7), per token and head: intra-chunk A_qk, A_qb, A_ak,
    # A_ab 8CK; solve ~C^2; w, u 2CK + 2CV; state pass w.S 2KV, k^T v + b^T v_new 4KV;
    # output q.S 2KV + A_qk v 2CV + A_qb v_new 2CV  =>  10CK + 6CV + C^2 + 8KV.
    B, T, H, D = case.shape
    K = V = D
    fwd = B * T * H * (10 * C * K + 6 * C * V + C * C + 8 * K * V)
    inp, out = _qkv_io(B, T, H, D, 6)  # r, w, k, v, a, b
    return {"flops": _times(mode, fwd), "bytes": io_bytes(mode, inp, out)}


def _work_fwd_h(case, mode):
    # State pass only, per token and head: v_new = u - w.S (2KV) and S += k^T v_new (2KV).
    # Bytes: read k, w, u (bf16) and g (fp32); write h [B, NT, H, K, V] and v_new (bf16).
    B, T, H, D = case.shape
    K = V = D
    chunk = case.param("chunk_size", 64)
    NT = -(-T // chunk)
    inp = 3 * _nbytes((B, T, H, D), 2) + _nbytes((B, T, H), 4)
    out = _nbytes((B, NT, H, K, V), 2) + _nbytes((B, T, H, V), 2)
    return {"flops": B * T * H * 4 * K * V, "bytes": inp + out}


def _work_decode(case, mode):
    # One step per (b, h): decay S (KV), k^T S (2KV), rank-1 update (2KV), q.S (2KV).
    # Bytes: fp32 state read + written (state_bytes) + q, k, v, o bf16 + g fp32, beta bf16.
    B, T, H, D = case.shape
    state = 2 * _nbytes((B, H, D, D), 4)
    small = 4 * _nbytes((B, T, H, D), 2) + _nbytes((B, T, H), 4) + _nbytes((B, T, H), 2)
    return {"flops": B * T * H * 7 * D * D, "bytes": state + small, "state_bytes": state}


def _work_rms_norm(case, mode):
    # Memory bound: fwd reads x, writes y; bwd reads x, dy, writes dx (weight negligible).
    N, D = case.shape
    x = _nbytes((N, D), 2)
    return {"bytes": 2 * x if mode == "fwd" else 5 * x}


def _work_flce(case, mode):
    # logits x W^T: 2 N HID V; backward dx and dW: 4 N HID V.
    N, HID, V = case.shape
    return {"flops": _times(mode, 2.0 * N * HID * V)}


def _work_sdpa(case, mode):
    # Causal attention, FlashAttention's convention: fwd 4 B H T^2 D / 2, bwd 2.5 x fwd.
    B, T, H, D = case.shape
    fwd = 2.0 * B * H * T * T * D
    return {"flops": _times(mode, fwd, 3.5), "bytes": io_bytes(mode, 3 * _nbytes((B, T, H, D), 2),
                                                               _nbytes((B, T, H, D), 2))}


def _work_mamba2(case, mode):
    # SSD with chunk L: per token C.B^T 2LN per group; per head (L o CB).x 2LP, chunk
    # states B^T x 2NP, state output C.S 2NP.
    Bsz, T, H, P, N = case.shape
    G, L = case.param("G", 1), case.param("chunk_size", 256)
    fwd = Bsz * T * (G * 2 * L * N + H * (2 * L * P + 4 * N * P))
    inp = _nbytes((Bsz, T, H, P), 2) + _nbytes((Bsz, T, H), 2) + 2 * _nbytes((Bsz, T, G, N), 2)
    out = _nbytes((Bsz, T, H, P), 2)
    return {"flops": _times(mode, fwd), "bytes": io_bytes(mode, inp, out)}


def _work_mamba2_layer(case, mode):
    # The SSD's count plus the two projections (d -> 2·H·P + 2GN + H and H·P -> d).
    Bsz, T, H, P, N = case.shape
    G, d = case.param("G", 1), H * P // 2
    ssd = _work_mamba2(case, mode)
    proj = 2 * Bsz * T * (d * (2 * H * P + 2 * G * N + H) + H * P * d)
    x_bytes = _nbytes((Bsz, T, d), 2)
    return {"flops": ssd["flops"] + _times(mode, proj),
            "bytes": io_bytes(mode, x_bytes, x_bytes)}


# ---------------------------------------------------------------------------------------
# The registry.

GDN_SHAPES = [(1, 8192, 96, 128), (2, 16384, 16, 128), (4, 2048, 16, 128),
              (4, 4096, 64, 128), (8, 1024, 8, 64), (8, 2048, 32, 256)]
GDN_SERVING_SHAPE = (1, 65536, 8, 128)  # low parallelism: one program per head idles SMs


def _case(op, family, module, shape, build, work, *, dims="B,T,H,D", function=None,
          **kw) -> Case:
    name = f"{op}/{'x'.join(str(s) for s in shape)}"
    return Case(name=name, op=op, family=family, module=module, function=function or op,
                shape=tuple(shape), dims=dims, build=build, work=work, **kw)


def _registry() -> list[Case]:
    cases: list[Case] = []
    # Issue 3: gated delta rule (and the delta rule, its g = None special case).
    for shape in GDN_SHAPES + [GDN_SERVING_SHAPE]:
        cases.append(_case("chunk_gated_delta_rule", "gated_delta_rule",
                           "fla.ops.gated_delta_rule", shape, _build_gated_delta_rule,
                           _work_gated_delta_rule, issue=3, ref_gated_bwd=True,
                           default=shape == (1, 8192, 96, 128), est_ref_cold_s=120))
    cases.append(_case("chunk_delta_rule", "delta_rule", "fla.ops.delta_rule",
                       (4, 4096, 16, 128), _build_delta_rule, _work_gated_delta_rule,
                       issue=3, default=True, est_ref_cold_s=100))
    cases.append(_case("chunk_gated_delta_rule_fwd_h", "gated_delta_rule",
                       "fla.ops.common.chunk_delta_h", (1, 8192, 36, 256), _build_fwd_h,
                       _work_fwd_h, modes=("fwd",), issue=3, default=True, est_ref_cold_s=30,
                       params=(("chunk_size", 64),),
                       note="the field call: head_first=False, chunk_size=64"))
    cases.append(_case("fused_recurrent_gated_delta_rule", "gated_delta_rule",
                       "fla.ops.gated_delta_rule", (256, 1, 32, 128), _build_decode,
                       _work_decode, modes=("fwd",), issue=3, default=True,
                       est_ref_cold_s=15, note="decode step, fp32 state in and out"))
    # Issue 4: scalar-gate family.
    for shape in GDN_SHAPES:
        cases.append(_case("chunk_simple_gla", "simple_gla", "fla.ops.simple_gla", shape,
                           _build_simple_gla, _work_linear_attention, issue=4,
                           ref_gated_bwd=True, default=shape == (1, 8192, 96, 128),
                           est_ref_cold_s=80))
    cases.append(_case("mamba_chunk_scan_combined", "mamba2", "fla.ops.mamba2",
                       (4, 4096, 32, 64, 128), _build_mamba2, _work_mamba2,
                       dims="B,T,H,P,N", issue=4, default=True, est_ref_cold_s=5,
                       params=(("G", 1), ("chunk_size", 256)), note="G=1, chunk 256"))
    # The issue's Mamba2 comparison "with the reference library's Mamba2 layer path": the
    # whole mixer layer at the op's sizes (d = 1024), and at one sequence.
    for shape in ((4, 4096, 32, 64, 128), (1, 4096, 32, 64, 128)):
        cases.append(_case("Mamba2", "mamba2", "fla.layers", shape, _build_mamba2_layer,
                           _work_mamba2_layer, dims="B,T,H,P,N", issue=4,
                           est_ref_cold_s=10, params=(("G", 1), ("chunk_size", 256)),
                           note="the mixer layer, d = H·P/2; the reference's PyTorch SSD"))
    # Issue 5: vector-gate family.
    for shape in GDN_SHAPES:
        cases.append(_case("chunk_gla", "gla", "fla.ops.gla", shape, _build_gla,
                           _work_linear_attention, issue=5,
                           default=shape == (1, 8192, 96, 128), est_ref_cold_s=150))
    cases.append(_case("chunk_rwkv6", "rwkv6", "fla.ops.rwkv6", (4, 4096, 16, 128),
                       _build_rwkv6, _work_linear_attention, issue=5, default=True,
                       est_ref_cold_s=150))
    # Issue 6: generalized delta rule / RWKV7.
    # (4, 4096, 16, 128): the head size 128 the issue names, as many channels a token;
    # (4, 4096, 8, 256): the largest head size the ops take, for its tuning spaces.
    for shape, default in (((4, 4096, 32, 64), True), ((8, 4096, 64, 64), False),
                           ((4, 4096, 16, 128), False), ((4, 4096, 8, 256), False)):
        cases.append(_case("chunk_rwkv7", "rwkv7", "fla.ops.rwkv7", shape, _build_rwkv7,
                           _work_rwkv7, issue=6, default=default, est_ref_cold_s=400))
    # Issue 7: fused modules, with plain PyTorch alongside.
    cases.append(_case("RMSNorm", "norm", "fla.modules", (16384, 4096), _build_rms_norm,
                       _work_rms_norm, dims="N,D", issue=7, default=True, est_ref_cold_s=10))
    cases.append(_case("rms_norm_torch", "norm", "torch.nn.functional", (16384, 4096),
                       _build_rms_norm_torch, _work_rms_norm, dims="N,D",
                       function="rms_norm", issue=7, baseline=True,
                       baseline_for="RMSNorm/16384x4096", est_ref_cold_s=0))
    cases.append(_case("FusedLinearCrossEntropyLoss", "loss", "fla.modules",
                       (16384, 4096, 128256), _build_flce, _work_flce, dims="N,HID,V",
                       issue=7, est_ref_cold_s=20,
                       note="the reference computes the gradients inside its forward"))
    cases.append(_case("linear_cross_entropy_torch", "loss", "torch.nn.functional",
                       (16384, 4096, 128256), _build_flce_torch, _work_flce,
                       dims="N,HID,V", function="cross_entropy", issue=7, baseline=True,
                       baseline_for="FusedLinearCrossEntropyLoss/16384x4096x128256",
                       est_ref_cold_s=0, note="unfused: logits materialised, fp32 loss"))
    # Context for the gated delta rule's (1, 8192, 96, 128): causal softmax attention.
    cases.append(_case("sdpa_causal_torch", "attention", "torch.nn.functional",
                       (1, 8192, 96, 128), _build_sdpa, _work_sdpa,
                       function="scaled_dot_product_attention", issue=3, baseline=True,
                       baseline_for="chunk_gated_delta_rule/1x8192x96x128", est_ref_cold_s=0))
    return cases


CASES: list[Case] = _registry()
BY_NAME: dict[str, Case] = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"


def default_cases() -> list[Case]:
    """The modest default run: one representative shape per family (cheapest reference
    cold start first, so that a run cut short still covers the most families), then the
    baselines whose case is in the run."""
    primary = sorted((c for c in CASES if c.default), key=lambda c: c.est_ref_cold_s)
    names = {c.name for c in primary}
    return primary + [c for c in CASES if c.baseline and c.baseline_for in names]


def select(selectors: Sequence[str]) -> list[Case]:
    """Cases named by ``selectors``: ``all``, ``default``, a case name, an op or family
    name (every shape of it), or a glob over case names. Commas also separate selectors.
    Order: as given, duplicates dropped. Unknown selectors raise ValueError."""
    words = [w for s in selectors for w in s.replace(",", " ").split() if w]
    chosen: list[Case] = []
    for word in words or ["default"]:
        if word == "all":
            found = list(CASES)
        elif word == "default":
            found = default_cases()
        elif word in BY_NAME:
            found = [BY_NAME[word]]
        else:
            found = [c for c in CASES if word in (c.op, c.family)]
            if not found and any(ch in word for ch in "*?["):
                found = [c for c in CASES if fnmatch.fnmatchcase(c.name, word)]
        if not found:
            ops = sorted({c.op for c in CASES})
            raise ValueError(f"unknown benchmark case {word!r}; use all, default, a case "
                             f"name, a glob, or one of the ops {ops}")
        chosen.extend(found)
    seen: set[str] = set()
    return [c for c in chosen if not (c.name in seen or seen.add(c.name))]
