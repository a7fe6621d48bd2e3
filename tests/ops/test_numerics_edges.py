"""Numerics at the edges, for every chunked family against its float64 loop
(``fla/ops/*/naive.py``): gated delta rule, delta rule, simple GLA, retention, GLA,
RWKV6, RWKV7, the DPLR delta rule and Mamba2's SSD.

1. Gates at both ends of their range (Triton kernels; interpreted on CPU; fp32, plus fp16
   where an op documents its edge for every dtype): log decay exactly 0 (no decay: the
   state only accumulates), very negative log decays (−20 to −40 a step, or the
   documented limit where an op states one), per-channel mixes of the two in one head,
   β exactly 0 and exactly 1, T with a long partial last chunk; output, final state and
   every gradient within 1e-4 (fp32) of the float64 loop, nothing NaN/inf.
2. fp16 inputs with values up to 1e3 (interpreted on CPU): one input scaled so that its
   largest entry is 1e3, chosen so that the true outputs and gradients stay within half
   of fp16's range (asserted on the float64 reference: the premise of the test);
   everything finite and within 5e-3 of the float64 loop, i.e. no intermediate of a
   kernel overflows where the result itself is representable.
2b. bf16 in the interpreter with the GPU's dot and cast arithmetic emulated
   (tests/interpreter_bf16.py), the families that hold 5e-3 there: everything within
   5e-3 of the float64 loop.
3. Long sequences (GPU): T = 65536 in bf16 at the ranges real models use. Forward with
   the final state and backward of a random projection; everything finite; the output
   (all of it, and four 256-token windows spread over T, the last one included) and the
   final state within 5e-3 of the float64 loop, which runs on the GPU without autograd.

NaN propagation is tested in tests/test_bad_inputs.py.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from fla.ops.delta_rule import chunk_delta_rule, naive_recurrent_delta_rule
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
from fla.ops.generalized_delta_rule import (
    chunk_dplr_delta_rule,
    naive_recurrent_dplr_delta_rule,
)
from fla.ops.gla import chunk_gla, naive_recurrent_gla
from fla.ops.mamba2 import mamba_chunk_scan_combined, naive_ssd
from fla.ops.mamba2.naive import prepare_ssd, skip_and_gate
from fla.ops.retention import chunk_retention, naive_recurrent_retention
from fla.ops.rwkv6 import chunk_rwkv6, naive_recurrent_rwkv6
from fla.ops.rwkv7 import chunk_rwkv7, naive_recurrent_rwkv7
from fla.ops.simple_gla import chunk_simple_gla, naive_recurrent_simple_gla
from tests.helpers import (
    TOLERANCE,
    assert_rel_close,
    assert_sum_close,
    generator,
    log_gate,
    odd_length,
    output_grad,
    randn,
    reference_device,
    unit_interval,
)
from tests.interpreter_bf16 import AVAILABLE as GPU_BF16_EMULATED
from tests.interpreter_bf16 import gpu_bf16
from tests.ops.gated_delta_cases import run

F64 = torch.float64
FP16_MAX = torch.finfo(torch.float16).max   # 65504
RWKV7_W_MIN = -math.exp(-0.5)               # RWKV7's documented w ∈ (−e^{−0.5}, 0)
# chunk_gla: "down to −5 a step is safe in every dtype" (RWKV6 runs GLA's stages);
# chunk_dplr_delta_rule: "stable down to about −5 per step".
DOCUMENTED_GK_MIN = -5.0


# ------------------------------------------------------------------------------ families
def _gla_ref(g=None, **kw):
    return naive_recurrent_gla(gk=g, **kw)


def _mamba_chunk(output_final_state, **kw):
    return mamba_chunk_scan_combined(chunk_size=64, return_final_states=output_final_state,
                                     **kw)


def _mamba_ref(output_final_state, **kw):
    return naive_ssd(return_final_states=output_final_state, **kw)


class Family(NamedTuple):
    op: Callable            # the chunked op, called as op(**leaves, output_final_state=True)
    ref: Callable           # its float64 loop, same call
    fp32: tuple             # leaves kept in float32 whatever the tested dtype
    out: str = "v"          # the input whose shape the output has
    state: str = "initial_state"


FAMILIES = {
    "gated_delta_rule": Family(chunk_gated_delta_rule, naive_recurrent_gated_delta_rule,
                               ("g", "initial_state")),
    "delta_rule": Family(chunk_delta_rule, naive_recurrent_delta_rule, ("initial_state",)),
    "simple_gla": Family(chunk_simple_gla, naive_recurrent_simple_gla,
                         ("g", "g_gamma", "initial_state")),
    "retention": Family(chunk_retention, naive_recurrent_retention, ("initial_state",)),
    "gla": Family(chunk_gla, _gla_ref, ("g", "initial_state")),
    "rwkv6": Family(chunk_rwkv6, naive_recurrent_rwkv6, ("w", "initial_state")),
    "rwkv7": Family(chunk_rwkv7, naive_recurrent_rwkv7, ("w", "initial_state")),
    "dplr": Family(chunk_dplr_delta_rule, naive_recurrent_dplr_delta_rule,
                   ("gk", "initial_state")),
    # A, D, dt_bias: Mamba2's float32 per-head parameters (dD sums x·dy over every token).
    "mamba2": Family(_mamba_chunk, _mamba_ref, ("A", "D", "dt_bias", "initial_states"),
                     out="x", state="initial_states"),
}


def leaves_of(family: str, inputs: dict, dtype, device, reference: bool = False) -> dict:
    """One run's leaves: inputs rounded to ``dtype`` (gates and states to float32, what
    the layers pass); for the reference the same rounded values in float64."""
    fp32 = FAMILIES[family].fp32
    out = {}
    for name, x in inputs.items():
        if x is None:
            out[name] = None
            continue
        x = x.to(torch.float32 if name in fp32 else dtype)
        if reference:
            x = x.to(F64)
        out[name] = x.to(device).detach().requires_grad_()
    return out


def assert_finite(name: str, x: torch.Tensor) -> None:
    bad = ~torch.isfinite(x)
    assert not bad.any(), f"{name}: {int(bad.sum())} of {x.numel()} entries NaN/inf"


def compare(family: str, inputs: dict, dtype, device, gen, *, tol=None,
            fp16_premise: bool = False, **options):
    """The chunked op and the float64 loop on the same rounded inputs: forward with the
    final state, backward of <o, do> + <final_state, dht>; the output, the final state
    and every gradient finite and within ``tol`` (default: the dtype's bound)."""
    fam = FAMILIES[family]
    do = output_grad(inputs[fam.out].shape, gen, dtype)
    dht = randn(inputs[fam.state].shape, gen, F64)
    ref_leaves = leaves_of(family, inputs, dtype, reference_device(device), reference=True)
    o_ref, ht_ref, g_ref = run(fam.ref, ref_leaves, do, dht, **options)
    leaves = leaves_of(family, inputs, dtype, device)
    if fp16_premise:
        # The test's premise: the true output and the true gradients of the 16-bit
        # leaves are representable in fp16, with a 2x margin.
        big = {"o": o_ref, **{f"d{n}": g_ref[n] for n, x in leaves.items()
                              if x is not None and x.dtype == dtype}}
        for name, x in big.items():
            assert x.abs().max() < FP16_MAX / 2, \
                f"test premise: the true {name} reaches {x.abs().max():.3g}"
    o, ht, grads = run(fam.op, leaves, do, dht, **options)
    tol = TOLERANCE[dtype] if tol is None else tol
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert ht.dtype == torch.float32 and ht.shape == ht_ref.shape
    assert_finite("o", o)
    assert_finite("final_state", ht)
    for name, leaf in leaves.items():
        if leaf is not None:
            assert grads[name] is not None, f"no gradient for {name}"
            assert grads[name].dtype == leaf.dtype, name
            assert_finite(f"d{name}", grads[name])
    assert_rel_close("o", o, o_ref, tol)
    assert_rel_close("final_state", ht, ht_ref, tol)
    summed = SUMMED_OVER_TOKENS.get(family, {})
    for name, leaf in leaves.items():
        if leaf is not None:
            if name in summed:
                terms = summed_terms(fam, ref_leaves, summed[name], g_ref, do, dht, options)
                # They are this gradient's terms: their sum is the reference gradient.
                torch.testing.assert_close(terms.sum(dim=tuple(range(terms.dim() - 1))),
                                           g_ref[name].to(terms), rtol=1e-9, atol=1e-9)
                assert_sum_close(f"d{name}", grads[name], g_ref[name], terms, tol)
            else:
                assert_rel_close(f"d{name}", grads[name], g_ref[name], tol)


def mamba2_decay_terms(ref_leaves, do, dht, options):
    """The per-token terms of Mamba2's dA_h = Σ_{b,t} dt ∂L/∂(dt A_h): the float64 loop run
    as simple GLA (q = C, k = B, v = dt·x, g = dt·A; :func:`ssd_as_simple_gla`'s steps)
    with the log decay g as its own leaf. ``[B, T, H]``."""
    x = {n: t.detach() for n, t in ref_leaves.items() if t is not None}
    xs, dt, A, B, C = prepare_ssd(x["x"], x["dt"], x["A"], x["B"], x["C"], x.get("dt_bias"),
                                  options.get("dt_softplus", False),
                                  options.get("dt_limit", (0.0, float("inf"))))
    g = (dt * A).requires_grad_()
    h0 = x["initial_states"].transpose(-1, -2) if "initial_states" in x else None
    y, final = naive_recurrent_simple_gla(C, B, dt[..., None] * xs, g=g, scale=1.0,
                                          initial_state=h0, output_final_state=True)
    y = skip_and_gate(y, xs, x.get("D"), x.get("z"))
    loss = (y * do.to(y)).sum() + (final.transpose(-1, -2) * dht.to(y)).sum()
    return dt * torch.autograd.grad(loss, g)[0]


# Per-head parameters whose gradient is a sum over every token: of another leaf's
# gradient (named; dt_bias is added to dt: d dt_bias[h] = Σ_{b,t} d dt[b, t, h]), or of
# terms computed by a function of (reference leaves, do, dht, options). The terms
# cancel, so the sum's relative error can exceed the terms' (9.7e-3 seen for Mamba2's
# dt_bias with fp16 inputs up to 1e3, where d dt itself was within bounds; 5.3e-3 for
# its dA, whose terms summed to 0.62 and 72 with sizes 713 and 1460; 1.7e-4 for simple
# GLA's g_gamma in fp32): it is bounded by the size of the terms instead.
SUMMED_OVER_TOKENS = {"mamba2": {"dt_bias": "dt", "A": mamba2_decay_terms},
                      "simple_gla": {"g_gamma": "g"}}


def summed_terms(fam, ref_leaves, terms_name, g_ref, do, dht, options):
    """The per-token terms whose sum over tokens is a per-head gradient: from a function
    (see SUMMED_OVER_TOKENS), or the reference gradient of the per-token leaf
    ``terms_name``; when the call has no such leaf (simple GLA with g_gamma alone), the
    reference runs again with it as a zero leaf (the same maths)."""
    if callable(terms_name):
        return terms_name(ref_leaves, do, dht, options)
    if ref_leaves.get(terms_name) is not None:
        return g_ref[terms_name]
    like = ref_leaves[fam.out]
    again = {n: None if x is None else x.detach().clone().requires_grad_()
             for n, x in ref_leaves.items()}
    again[terms_name] = torch.zeros(like.shape[:3], dtype=F64,
                                    device=like.device).requires_grad_()
    return run(fam.ref, again, do, dht, **options)[2][terms_name]


# ------------------------------------------------------------------------ input pieces
def unit_rows(shape, gen) -> torch.Tensor:
    """float64 rows of unit L2 norm over the last dimension."""
    return F.normalize(torch.randn(shape, generator=gen, dtype=F64), dim=-1)


def uniform(shape, gen, low, high) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=gen, dtype=F64)


def pick(gen, shape, *options) -> torch.Tensor:
    """Each entry drawn from one of ``options`` (float64 tensors of ``shape``), uniformly."""
    which = torch.randint(0, len(options), shape, generator=gen)
    out = options[0].clone()
    for i, x in enumerate(options[1:], 1):
        out = torch.where(which == i, x, out)
    return out


def steep_token_gate(shape, gen, low=-40.0, high=-20.0) -> torch.Tensor:
    """Per-token scalar log decays: a third exactly 0 (no decay), a third in [−1, 0), a
    third in [low, high] (the state forgotten in one step). The O(1) gates keep the gate
    gradient a meaningful number to compare (at −20 it is ~e^{−20} of the others)."""
    return pick(gen, shape, torch.zeros(shape, dtype=F64),
                log_gate(shape, gen, low=-1.0, dtype=F64), uniform(shape, gen, low, high))


def channel_edge_gate(B, T, H, K, gen, low) -> torch.Tensor:
    """Per-channel log decays [B, T, H, K] with both ends of [low, 0] in every head: a
    random quarter of each head's channels never decays (exactly 0 at every token),
    another quarter decays by ``low`` at every token, and the rest pick per token among
    exactly 0, exactly ``low`` and uniform in (low, 0)."""
    shape = (B, T, H, K)
    per_token = pick(gen, shape, torch.zeros(shape, dtype=F64),
                     torch.full(shape, low, dtype=F64), uniform(shape, gen, low, 0.0))
    rank = torch.rand((H, K), generator=gen).argsort(-1).argsort(-1)
    g = torch.where(rank < K // 4, torch.zeros(shape, dtype=F64), per_token)
    return torch.where((rank >= K // 4) & (rank < K // 2), torch.full(shape, low, dtype=F64), g)


def beta_edge(shape, gen, kind) -> torch.Tensor:
    """β exactly 0 everywhere (nothing is written), exactly 1 everywhere (the old value
    along k is replaced outright), or each token one of 0, 1 and a value in (0, 1)."""
    if kind == "zero":
        return torch.zeros(shape, dtype=F64)
    if kind == "one":
        return torch.ones(shape, dtype=F64)
    return pick(gen, shape, torch.zeros(shape, dtype=F64), torch.ones(shape, dtype=F64),
                unit_interval(shape, gen, F64))


# ------------------------------------ 1. gates at their edges (fp32; fp16 where documented)
B_, H_, K_, V_ = 2, 2, 32, 32


def edge_length(gen) -> int:
    """T in [97, 127]: a full chunk, then a partial one of 33 to 63 tokens, so that the
    padded rows of the last chunk share 16-row blocks with valid rows that, with steep
    gates, already have a chunk-local cumulative gate far below −88 (where exp
    overflows fp32)."""
    return odd_length(gen, 97, 127)


@pytest.mark.interpret
@pytest.mark.parametrize("beta", ["zero", "one", "mixed"])
@pytest.mark.parametrize("gate", ["none", "zero", "steep"])
def test_delta_rules_at_gate_and_beta_edges(gate, beta, device, seed):
    """Gated delta rule / delta rule (fp32, l2-normalised q and k, T = 64 + 33..63): g
    absent (chunk_delta_rule), g exactly 0 at every token (the gate path with no
    decay), or per token 0, O(1) and −20..−40 mixed (Gated DeltaNet's
    −exp(A_log)·softplus(·) reaches such values); β exactly 0 (the state is only
    decayed: dk = dv = 0), exactly 1, or mixed with the two. Output, final state and
    every gradient within 1e-4 of the float64 loop, nothing NaN/inf."""
    gen = generator(seed)
    T = edge_length(gen)
    inputs = {
        "q": unit_rows((B_, T, H_, K_), gen),
        "k": unit_rows((B_, T, H_, K_), gen),
        "v": randn((B_, T, H_, V_), gen, F64),
        "beta": beta_edge((B_, T, H_), gen, beta),
        "initial_state": randn((B_, H_, K_, V_), gen, F64, scale=0.5),
    }
    if gate == "none":
        compare("delta_rule", inputs, torch.float32, device, gen)
        return
    inputs["g"] = (torch.zeros((B_, T, H_), dtype=F64) if gate == "zero"
                   else steep_token_gate((B_, T, H_), gen))
    compare("gated_delta_rule", inputs, torch.float32, device, gen)


SIMPLE_GLA_EDGES = ["g_zero", "g_steep", "gamma_zero_and_steep"]


@pytest.mark.interpret
@pytest.mark.parametrize("case", SIMPLE_GLA_EDGES)
def test_simple_gla_at_gate_edges(case, device, seed):
    """Simple GLA (fp32): g exactly 0 at every token (no decay: the state is the plain
    sum of k vᵀ); g per token 0, O(1) and −20..−40 mixed; or no g and a per-head g_gamma
    of exactly 0 for one head and −30 (forget everything every step) for the other.
    Output, final state and every gradient (dg_gamma included) within 1e-4 of float64."""
    gen = generator(seed)
    T = edge_length(gen)
    inputs = {
        "q": randn((B_, T, H_, K_), gen, F64),
        "k": randn((B_, T, H_, K_), gen, F64, scale=K_ ** -0.5),
        "v": randn((B_, T, H_, V_), gen, F64),
        "g": None, "g_gamma": None,
        "initial_state": randn((B_, H_, K_, V_), gen, F64, scale=0.5),
    }
    if case == "g_zero":
        inputs["g"] = torch.zeros((B_, T, H_), dtype=F64)
    elif case == "g_steep":
        inputs["g"] = steep_token_gate((B_, T, H_), gen)
    else:
        inputs["g_gamma"] = torch.tensor([0.0, -30.0], dtype=F64)[torch.randperm(2, generator=gen)]
    compare("simple_gla", inputs, torch.float32, device, gen)


@pytest.mark.interpret
def test_retention_with_decays_next_to_one(device, seed):
    """Retention with 20 heads: head h decays by 1 − 2^(−5−h), so the last heads' log
    decays are −1e-6 .. −6e-8, next to no decay at all (and the first head's −0.03).
    Output, final state and every gradient within 1e-4 of float64."""
    gen = generator(seed)
    T, H = edge_length(gen), 20
    inputs = {
        "q": randn((1, T, H, 16), gen, F64),
        "k": randn((1, T, H, 16), gen, F64, scale=0.25),
        "v": randn((1, T, H, 16), gen, F64),
        "initial_state": randn((1, H, 16, 16), gen, F64, scale=0.5),
    }
    compare("retention", inputs, torch.float32, device, gen)


VECTOR_GATE_EDGES = {
    # chunk_gla's docstring: "down to −5 a step is safe in every dtype" (the stages'
    # exponents then span −320 inside one 64-token chunk).
    "documented_-5_fp32": (DOCUMENTED_GK_MIN, torch.float32),
    "documented_-5_fp16": (DOCUMENTED_GK_MIN, torch.float16),
    # Past the documented limit, in fp32: no exponent the stages form is positive, so
    # nothing should overflow however steep the gate.
    "steep_-40_fp32": (-40.0, torch.float32),
}


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(VECTOR_GATE_EDGES))
@pytest.mark.parametrize("family", ["gla", "rwkv6"])
def test_vector_gates_mixing_no_decay_and_steep_decay(family, case, device, seed):
    """GLA and RWKV6: in every head a quarter of the key channels never decays (log gate
    exactly 0), a quarter decays by ``low`` at every token, and the rest switch per token
    between 0, ``low`` and values in between; ``low`` = −5 (the documented limit, fp32
    and fp16) and −40 (fp32). Output, final state and every gradient within the dtype's
    bound (1e-4 fp32, 5e-3 fp16) of float64, nothing NaN/inf."""
    low, dtype = VECTOR_GATE_EDGES[case]
    gen = generator(seed)
    T = edge_length(gen)
    g = channel_edge_gate(B_, T, H_, K_, gen, low)
    q, k, v = (randn((B_, T, H_, K_), gen, F64), randn((B_, T, H_, K_), gen, F64, K_ ** -0.5),
               randn((B_, T, H_, V_), gen, F64))
    h0 = randn((B_, H_, K_, V_), gen, F64, scale=0.5)
    if family == "gla":
        inputs = {"q": q, "k": k, "v": v, "g": g, "initial_state": h0}
    else:
        inputs = {"r": q, "k": k, "v": v, "w": g, "u": randn((H_, K_), gen, F64, scale=0.5),
                  "initial_state": h0}
    compare(family, inputs, dtype, device, gen)


def dplr_edge_inputs(gen, T, w_low, names):
    """RWKV7-shaped DPLR inputs (a = −κ̂, b = κ̂ ⊙ a_gate, κ̂ unit rows) at the edges: the
    log decay per channel as :func:`channel_edge_gate` with ``w_low``, the in-context
    learning rate a_gate per entry exactly 0, exactly 1 (with w = 0 the transition is the
    projection I − κ̂κ̂ᵀ) or in (0, 1)."""
    shape = (B_, T, H_, K_)
    kk = unit_rows(shape, gen)
    a_gate = pick(gen, shape, torch.zeros(shape, dtype=F64), torch.ones(shape, dtype=F64),
                  unit_interval(shape, gen, F64))
    q, w = names
    return {q: randn(shape, gen, F64), w: channel_edge_gate(B_, T, H_, K_, gen, w_low),
            "k": randn(shape, gen, F64, scale=K_ ** -0.5), "v": randn((B_, T, H_, V_), gen, F64),
            "a": -kk, "b": kk * a_gate,
            "initial_state": randn((B_, H_, K_, V_), gen, F64, scale=0.5)}


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=lambda d: str(d)[6:])
def test_rwkv7_at_the_ends_of_its_documented_decay_range(dtype, device, seed):
    """RWKV7: w at both ends of the range chunk_rwkv7 documents, w ∈ (−e^{−0.5}, 0),
    taken closed: channels with w exactly 0 (what padding passes) and exactly −e^{−0.5}
    (the sigmoid's limit), mixed per channel and per token; a_gate exactly 0 and 1 mixed
    in. In fp32 and in fp16 (the intra-chunk stage documents its largest factor, e^{4.9}
    inside a 16-token sub-block, as finite in fp16 at this edge). Output, final state
    and every gradient within the dtype's bound of float64, nothing NaN/inf."""
    gen = generator(seed)
    inputs = dplr_edge_inputs(gen, edge_length(gen), RWKV7_W_MIN, ("r", "w"))
    compare("rwkv7", inputs, dtype, device, gen)


@pytest.mark.interpret
def test_dplr_at_its_documented_decay_limit(device, seed):
    """chunk_dplr_delta_rule (fp32) with log decays mixing exactly 0 and −5 per step per
    channel (its docstring: "stable down to about −5 per step"; inside a 16-token
    sub-block the stages then form factors up to e^{40}); a_gate exactly 0 and 1 mixed
    in. Output, final state and every gradient within 1e-4 of float64."""
    gen = generator(seed)
    inputs = dplr_edge_inputs(gen, edge_length(gen), DOCUMENTED_GK_MIN, ("q", "gk"))
    compare("dplr", inputs, torch.float32, device, gen)


@pytest.mark.interpret
@pytest.mark.parametrize("case", ["A_zero", "large_dtA"])
def test_mamba2_at_decay_edges(case, device, seed):
    """Mamba2 (fp32, raw dt, D and z): ``A_zero``: A = 0 in every head (dt·A = 0, no
    decay: the state is the plain sum of dt·x ⊗ B); ``large_dtA``: one head with A = 0
    and one with A = −40 and dt in [0.5, 1.5] (dt·A from −60 to −20: the state is
    forgotten at every step), with a third of the tokens at dt exactly 0 (no write, no
    decay). y, the final states and every gradient within 1e-4 of float64."""
    gen = generator(seed)
    b, T, H, P, N = 2, edge_length(gen), 2, 16, 32
    dt = uniform((b, T, H), gen, 0.5, 1.5)
    if case == "A_zero":
        A = torch.zeros(H, dtype=F64)
    else:
        A = torch.tensor([0.0, -40.0], dtype=F64)[torch.randperm(2, generator=gen)]
        dt = pick(gen, (b, T, H), dt, dt, torch.zeros((b, T, H), dtype=F64))
    inputs = {
        "x": randn((b, T, H, P), gen, F64), "dt": dt, "A": A,
        "B": randn((b, T, 1, N), gen, F64), "C": randn((b, T, 1, N), gen, F64),
        "D": randn((H,), gen, F64), "z": randn((b, T, H, P), gen, F64),
        "initial_states": randn((b, H, P, N), gen, F64, scale=0.5),
    }
    compare("mamba2", inputs, torch.float32, device, gen)


# ------------------------------------------------------ 2. fp16 inputs up to 1e3 in size
LARGE = 1e3
# Which input is made large, per family. Queries and keys (Mamba2's C and B) are rows of
# unit norm (|q·k| ≤ 1); values, gates and states have the usual sizes. One tensor scaled
# to a largest entry of 1e3 then leaves the true outputs and the true gradients of the
# 16-bit leaves at 1e3..2e4 (the largest: RWKV7's dk and dr with r or k large, its scale
# being 1, not K^-1/2), inside half of fp16's 65504 (asserted on the float64 reference
# before the op runs). One at a time: q and v both at 1e3 would make o itself ~1e6. The
# delta rules never get a large k: the transition I − β k kᵀ needs ‖k‖ ≈ 1 (with
# ‖k‖ = 30 and β = 1 it has the eigenvalue −899, and the true state itself overflows
# within a few tokens); RWKV7's a and b are κ̂, unit rows by construction.
LARGE_INPUTS = {
    "gated_delta_rule": ("v", "q"),
    "delta_rule": ("v", "q"),
    "simple_gla": ("v", "q", "k"),
    "retention": ("v", "q", "k"),
    "gla": ("v", "q", "k"),
    "rwkv6": ("v", "r", "k"),
    "rwkv7": ("v", "r", "k"),
    "mamba2": ("x", "B", "C"),
}
# Inputs that write into the state: when one is large, so is the initial state (else
# it would be negligible next to what the tokens write).
WRITES_STATE = ("k", "v", "x", "B")


def base_inputs(family, gen, B, T, H, K, V):
    """float64 inputs at the sizes described above (gates in the ranges layers use)."""
    if family == "mamba2":
        return {
            "x": randn((B, T, H, V), gen, F64),
            "dt": randn((B, T, H), gen, F64, scale=0.5) - 2.0,   # softplus: dt ≈ 0.13
            "A": uniform((H,), gen, -4.0, -0.5),
            "B": unit_rows((B, T, 1, K), gen), "C": unit_rows((B, T, 1, K), gen),
            "D": randn((H,), gen, F64), "z": randn((B, T, H, V), gen, F64),
            "dt_bias": randn((H,), gen, F64, scale=0.3),
            "initial_states": randn((B, H, V, K), gen, F64, scale=0.5),
        }
    x = {"q": unit_rows((B, T, H, K), gen), "k": unit_rows((B, T, H, K), gen),
         "v": randn((B, T, H, V), gen, F64),
         "initial_state": randn((B, H, K, V), gen, F64, scale=0.5)}
    if family in ("gated_delta_rule", "delta_rule"):
        x["beta"] = unit_interval((B, T, H), gen, F64)
        if family == "gated_delta_rule":
            x["g"] = log_gate((B, T, H), gen, low=-1.0, dtype=F64)
    elif family == "simple_gla":
        x["g"] = log_gate((B, T, H), gen, low=-1.0, dtype=F64)
    elif family == "gla":
        x["g"] = log_sigmoid_gate((B, T, H, K), gen)
    elif family == "rwkv6":
        x["r"] = x.pop("q")
        x["w"] = log_sigmoid_gate((B, T, H, K), gen)
        x["u"] = randn((H, K), gen, F64, scale=0.5)
    elif family == "rwkv7":
        x["r"] = x.pop("q")
        kk = unit_rows((B, T, H, K), gen)
        x["w"] = uniform((B, T, H, K), gen, RWKV7_W_MIN, -1e-4)
        x["a"], x["b"] = -kk, kk * unit_interval((B, T, H, K), gen, F64)
    return x


def log_sigmoid_gate(shape, gen, low=-5.0):
    """GLA/RWKV6's gates: log σ(3x), x ~ N(0, 1), clamped at −5 (as in test_gla)."""
    return F.logsigmoid(3 * torch.randn(shape, generator=gen, dtype=F64)).clamp(min=low)


@pytest.mark.interpret
@pytest.mark.parametrize("family,large", [(f, n) for f, names in LARGE_INPUTS.items()
                                          for n in names])
def test_fp16_inputs_up_to_1e3(family, large, device, seed):
    """fp16 inputs with one tensor scaled so that its largest entry is exactly 1e3 (the
    rest, and the premise that the true results fit fp16 with a 2x margin, as described
    at LARGE_INPUTS); T not a multiple of 64. Output, final state and every gradient
    finite and within 5e-3 of the float64 loop: no kernel overflows fp16 in an
    intermediate step when the result itself is representable."""
    gen = generator(seed)
    B, T, H, K, V = 2, odd_length(gen, 65, 140), 2, 32, 32
    inputs = base_inputs(family, gen, B, T, H, K, V)
    factor = LARGE / inputs[large].abs().max()
    inputs[large] = inputs[large] * factor
    if large in WRITES_STATE:
        state = FAMILIES[family].state
        inputs[state] = inputs[state] * factor
    options = {"dt_softplus": True} if family == "mamba2" else {}
    compare(family, inputs, torch.float16, device, gen, fp16_premise=True, **options)


# --------------------------------------- 2b. bf16 in the interpreter, the GPU's arithmetic
# The families whose every tensor stays within 5e-3 at these inputs with bf16 as the GPU
# computes it (tests/interpreter_bf16.py), most with room: the largest errors over 8-22
# seeds were 2.5e-3 (retention), 2.8e-3 (GLA), 3.2e-3 (RWKV6), 4.1e-3 (RWKV7's da, db),
# 3.9e-3 (Mamba2's dt, B and C); with the 16-bit backward's two-term states pass and fp32
# dk partial (benchmarks/NOTES.md, 2026-11-28 19:15- and 21:52-), 3.96e-3 (the delta
# rule's dk over 12 seeds), and with the scaled fp16 dh too, 4.56e-3 (the gated delta
# rule's dβ over 40 seeds; dg 3.8e-3) and 3.4e-3 (simple GLA's dg over 110). Before
# them, at these inputs (unit-norm queries, log decays down to −1), simple GLA's dg
# reached 5.3-5.8e-3 and the gated delta rule's 7.8e-3 (the rounding of the stored dh,
# as the operand of dk's state term, led: dγ = q·dq − k·dk cancels), and the delta
# rule's dk 4.8e-3.
BF16_FAMILIES = ("retention", "gla", "rwkv6", "rwkv7", "mamba2", "delta_rule",
                 "gated_delta_rule", "simple_gla")


@pytest.mark.interpret
@pytest.mark.skipif(not GPU_BF16_EMULATED, reason="this Triton's interpreter differs")
@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_bf16_with_the_gpus_rounding(family, device, seed):
    """bf16 inputs through the Triton kernels in the interpreter with the GPU's bf16 dots,
    tf32 dots and rounding: output, final state and every gradient within 5e-3 of the
    float64 loop (base sizes, T not a multiple of 64, K = 64: full-width tiles)."""
    if device != "cpu":
        pytest.skip("the interpreter's test; bf16 on the GPU runs in the families' files")
    gen = generator(seed)
    B, T, H, K, V = 2, odd_length(gen, 65, 140), 2, 64, 32
    options = {"dt_softplus": True} if family == "mamba2" else {}
    with gpu_bf16():
        compare(family, base_inputs(family, gen, B, T, H, K, V), torch.bfloat16, device,
                gen, **options)


# ------------------------------------------------------------- 3. T = 65536 in bf16 (GPU)
LONG_T, WINDOW = 65536, 256


def long_inputs(family, gen, T):
    """float64 inputs, B = 1, H = 2, K = V = 64 (Mamba2: P = 64, N = 128, one group), in
    the ranges of each family's existing GPU tests (whose factories these are): unit-norm
    keys and (here) queries for the delta rules, log decays in [−0.5, 0) for the scalar
    gates, log σ(3x) clamped at −5 for GLA/RWKV6, RWKV7's w ∈ (−e^{−0.5}, 0) with
    a = −κ̂, b = κ̂ ⊙ σ(·), Mamba2's softplus time steps around 0.13."""
    from tests.ops.dplr_cases import make_inputs as dplr_inputs
    from tests.ops.gated_delta_cases import make_inputs as gated_delta_inputs
    from tests.ops.test_gla import make_inputs as gla_inputs
    from tests.ops.test_mamba2 import make_inputs as mamba2_inputs
    from tests.ops.test_rwkv6 import make_inputs as rwkv6_inputs
    from tests.ops.test_simple_gla import make_inputs as simple_gla_inputs

    H, K, V = 2, 64, 64
    if family in ("gated_delta_rule", "delta_rule"):
        x = gated_delta_inputs(gen, B=1, T=T, H=H, HV=H, K=K, V=V,
                               gate=family == "gated_delta_rule")
        x["q"] = F.normalize(x["q"], dim=-1)
        if family == "delta_rule":
            x.pop("g")
        return x
    if family in ("simple_gla", "retention"):
        x = simple_gla_inputs(gen, B=1, T=T, H=H, HV=H, K=K, V=V, gate=family == "simple_gla")
        x.pop("g_gamma")
        if family == "retention":
            x.pop("g")
        return x
    if family == "gla":
        return gla_inputs(gen, B=1, T=T, H=H, K=K, V=V)
    if family == "rwkv6":
        return rwkv6_inputs(gen, B=1, T=T, H=H, K=K, V=V)
    if family in ("rwkv7", "dplr"):
        x = dplr_inputs(gen, B=1, T=T, H=H, K=K, V=V)
        if family == "rwkv7":
            x["r"], x["w"] = x.pop("q"), x.pop("gk")
        return x
    return mamba2_inputs(gen, b=1, T=T, H=H, G=1, P=64, N=128)


def window_starts(T, gen, width=WINDOW):
    """Four windows: the first tokens, one at random in each middle third, the last."""
    third = T // 3
    return [0, int(torch.randint(third, 2 * third - width, (1,), generator=gen)),
            int(torch.randint(2 * third, T - 2 * width, (1,), generator=gen)), T - width]


def check_long_sequence(family, gen, device, T=LONG_T, dtype=torch.bfloat16, tol=5e-3):
    """The long-sequence check of :func:`test_long_sequence_bf16` on ``device``."""
    fam = FAMILIES[family]
    inputs = long_inputs(family, gen, T)
    options = {"dt_softplus": True} if family == "mamba2" else {}
    do = output_grad(inputs[fam.out].shape, gen, dtype)
    dht = randn(inputs[fam.state].shape, gen, F64)

    leaves = leaves_of(family, inputs, dtype, device)
    o, ht, grads = run(fam.op, leaves, do, dht, **options)
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert_finite("o", o)
    assert_finite("final_state", ht)
    for name, leaf in leaves.items():
        if leaf is not None:
            assert grads[name] is not None, f"no gradient for {name}"
            assert_finite(f"d{name}", grads[name])
    del grads, leaves

    ref_leaves = {n: None if x is None else x.detach() for n, x in
                  leaves_of(family, inputs, dtype, reference_device(device),
                            reference=True).items()}
    with torch.no_grad():
        o_ref, ht_ref = fam.ref(**ref_leaves, output_final_state=True, **options)
    assert_rel_close("final_state", ht, ht_ref, tol)
    assert_rel_close("o", o, o_ref, tol)
    for start in window_starts(T, gen):
        assert_rel_close(f"o[{start}:{start + WINDOW}]", o[:, start:start + WINDOW],
                         o_ref[:, start:start + WINDOW], tol)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_long_sequence_bf16(family, seed):
    """T = 65536 in bf16 (gates, states and Mamba2's per-head parameters in float32):
    forward with the final state and backward of <o, do> + <final_state, dht> (random
    do, dht); o, the final state and every gradient finite. The float64 loop then runs
    on the GPU without autograd on the same rounded inputs (a 65536-step Python loop
    vectorised over batch and heads: seconds): the whole output, each of four 256-token
    windows (first, two in the middle, last: an error confined to a few chunks is not
    diluted by 65536 tokens) and the final state within 5e-3."""
    check_long_sequence(family, generator(seed), "cuda")
