"""Forward chunk stages of the gated delta rule (ALGORITHMS.md §1) against float64.

Each stage's reference is written here from the chunk equations, in float64, one chunk
at a time (independently of ``fla.ops.common.chunk_torch``), and fed the very inputs
(cast to the tested dtype and back) that the stage under test gets, so a comparison
measures the stage alone. The end-to-end test chains the stages (γ, A, Tinv by
``torch.linalg`` in float64, W/U, state pass, output) and compares with the plain
per-token recurrence loop below.

Interpreter tests keep T ≤ 160, H ≤ 2, K, V ≤ 48: the CPU interpreter is slow.
"""
from __future__ import annotations

import pytest
import torch

from fla.ops.common.chunk_delta_h import (
    chunk_gated_delta_rule_fwd_h,
    chunk_gated_delta_rule_fwd_h_kernel,
    row_blocks,
)
from fla.ops.common.chunk_o import chunk_fwd_o, chunk_fwd_o_kernel
from fla.ops.common.chunk_torch import chunk_fwd_o_torch
from fla.ops.common.chunk_scaled_dot_kkt import (
    chunk_scaled_dot_kkt_fwd,
    chunk_scaled_dot_kkt_fwd_kernel,
)
from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd, recompute_w_u_fwd_kernel
from tests.helpers import (
    TOLERANCE,
    assert_rel_close,
    cu_seqlens_of,
    generator,
    l2_normalized,
    log_gate,
    randn,
    uneven_lengths,
    unit_interval,
)
from fla.utils.tuning import Config
from tests.ops.config_sweep import force_config, sweep_configs

HAS_CUDA = torch.cuda.is_available()
F64 = torch.float64
DTYPES = [
    torch.float32,
    torch.float16,
    # bf16 tl.dot is wrong in the interpreter: GPU only.
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")),
]


def tol(dtype: torch.dtype) -> float:
    # A 16-bit stage rounds its operands for tl.dot and its outputs: two roundings of
    # the 16-bit type on top of the inputs' own (bf16 has 3 fewer mantissa bits than fp16).
    return {torch.bfloat16: 1e-2}.get(dtype, TOLERANCE[dtype])


# --------------------------------------------------------------------- float64 references
def chunk_spans(B: int, T: int, offsets: list[int] | None, BT: int):
    """Every chunk as (batch row, sequence index, first token, end token)."""
    seqs = ([(b, b, 0, T) for b in range(B)] if offsets is None else
            [(0, n, s, e) for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:]))])
    for b, n, s, e in seqs:
        for start in range(s, e, BT):
            yield b, n, start, min(start + BT, e)


def ref_cumsum(g, offsets, BT):
    out = torch.zeros(g.shape, dtype=F64, device=g.device)
    for b, _, s, e in chunk_spans(g.shape[0], g.shape[1], offsets, BT):
        out[b, s:e] = g[b, s:e].to(F64).cumsum(0)
    return out


def gate_matrix(gc, strict: bool):
    """[C, H] cumulative gates -> [H, C, C] Γ_ij = exp(γ_i − γ_j), causal-masked."""
    gh = gc.T
    Gamma = torch.exp(gh[:, :, None] - gh[:, None, :])
    return Gamma.tril(-1 if strict else 0)


def ref_kkt(k, beta, gc, offsets, BT):
    B, T, H, _ = k.shape
    A = torch.zeros(B, T, H, BT, dtype=F64, device=k.device)
    for b, _, s, e in chunk_spans(B, T, offsets, BT):
        kk = k[b, s:e].to(F64)
        M = torch.einsum("ihk,jhk->hij", kk, kk)
        if beta is not None:
            M = M * beta[b, s:e].to(F64).T[:, :, None]
        M = M * gate_matrix(gc[b, s:e].to(F64), True) if gc is not None else M.tril(-1)
        A[b, s:e, :, :e - s] = M.permute(1, 0, 2)
    return A


def ref_tinv(A, offsets, BT):
    """(I + A)⁻¹ of each chunk by torch.linalg, float64; zero past the chunk's end."""
    B, T, H, _ = A.shape
    out = torch.zeros(B, T, H, BT, dtype=F64, device=A.device)
    for b, _, s, e in chunk_spans(B, T, offsets, BT):
        C = e - s
        M = A[b, s:e, :, :C].to(F64).permute(1, 0, 2)
        eye = torch.eye(C, dtype=F64, device=A.device)
        out[b, s:e, :, :C] = torch.linalg.inv(eye + M).permute(1, 0, 2)
    return out


def ref_wu(k, v, beta, Tinv, gc, offsets, BT):
    B, T, H, K = k.shape
    w = torch.zeros(B, T, H, K, dtype=F64, device=k.device)
    u = torch.zeros(*v.shape, dtype=F64, device=k.device)
    for b, _, s, e in chunk_spans(B, T, offsets, BT):
        Ti = Tinv[b, s:e, :, :e - s].to(F64).permute(1, 0, 2)          # [H, C, C]
        bb = beta[b, s:e].to(F64)[..., None]
        decay = torch.exp(gc[b, s:e].to(F64))[..., None] if gc is not None else 1.0
        w[b, s:e] = torch.einsum("hij,jhk->ihk", Ti, bb * k[b, s:e].to(F64) * decay)
        u[b, s:e] = torch.einsum("hij,jhv->ihv", Ti, bb * v[b, s:e].to(F64))
    return w, u


def ref_fwd_h(k, w, u, gc, h0, offsets, BT):
    B, T, H, K = k.shape
    V = u.shape[-1]
    spans = list(chunk_spans(B, T, offsets, BT))
    N = B if offsets is None else len(offsets) - 1
    NT = len(spans) if offsets is not None else len(spans) // B
    h = torch.zeros(B, NT, H, K, V, dtype=F64, device=k.device)
    v_new = torch.zeros(*u.shape, dtype=F64, device=k.device)
    S = [h0[n].to(F64) if h0 is not None else
         torch.zeros(H, K, V, dtype=F64, device=k.device) for n in range(N)]
    for i, (b, n, s, e) in enumerate(spans):
        idx = i if offsets is not None else i % NT
        h[b, idx] = S[n]
        kk, ww, uu = (x[b, s:e].to(F64) for x in (k, w, u))
        vn = uu - torch.einsum("thk,hkv->thv", ww, S[n])
        v_new[b, s:e] = vn
        if gc is not None:
            gg = gc[b, s:e].to(F64)                                     # [C, H]
            g_last = gg[-1]
            S[n] = (torch.exp(g_last)[:, None, None] * S[n]
                    + torch.einsum("thk,thv->hkv", kk * torch.exp(g_last - gg)[..., None], vn))
        else:
            S[n] = S[n] + torch.einsum("thk,thv->hkv", kk, vn)
    return h, v_new, torch.stack(S)


def ref_fwd_o(q, k, vn, h, gc, scale, offsets, BT, with_scores=False):
    """o (float64), and with ``with_scores`` also the causal gated scores ``[B, T, H, BT]``
    (row t: token t's scores against its chunk's tokens)."""
    B, T, H, _ = q.shape
    o = torch.zeros(*vn.shape, dtype=F64, device=q.device)
    A = torch.zeros(B, T, H, BT, dtype=F64, device=q.device)
    spans = list(chunk_spans(B, T, offsets, BT))
    NT = len(spans) if offsets is not None else len(spans) // B
    for i, (b, _, s, e) in enumerate(spans):
        idx = i if offsets is not None else i % NT
        qq, kk, vv = (x[b, s:e].to(F64) for x in (q, k, vn))
        S = h[b, idx].to(F64)
        scores = torch.einsum("ihk,jhk->hij", qq, kk)
        if gc is not None:
            gg = gc[b, s:e].to(F64)
            inter = torch.einsum("ihk,hkv->ihv", qq * torch.exp(gg)[..., None], S)
            scores = scores * gate_matrix(gg, False)
        else:
            inter = torch.einsum("ihk,hkv->ihv", qq, S)
            scores = scores.tril()
        o[b, s:e] = scale * (inter + torch.einsum("hij,jhv->ihv", scores, vv))
        A[b, s:e, :, :e - s] = scores.permute(1, 0, 2)
    return (o, A) if with_scores else o


def recurrence_loop(q, k, v, g, beta, scale, h0, offsets):
    """The gated delta rule token by token (float64): S ← e^{g_t} S;
    S ← S + β k (v − Sᵀk)ᵀ; o = scale Sᵀq. Returns (o, final states)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.to(F64) for x in (q, k, v, g, beta))
    seqs = ([(b, b, 0, T) for b in range(B)] if offsets is None else
            [(0, n, s, e) for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:]))])
    o = torch.zeros(B, T, H, V, dtype=F64, device=q.device)
    finals = []
    for b, n, s, e in seqs:
        S = h0[n].to(F64).clone() if h0 is not None else torch.zeros(
            H, K, V, dtype=F64, device=q.device)
        for t in range(s, e):
            S = S * torch.exp(g[b, t])[:, None, None]
            err = v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t])
            S = S + beta[b, t][:, None, None] * k[b, t][:, :, None] * err[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    return o, torch.stack(finals)


# --------------------------------------------------------------------------- inputs
def make_problem(gen, device, B, T, H, K, V, dtype, lengths=None, BT=64, gate_low=-0.5):
    """Random inputs in ``dtype`` (gates, β, h0 in fp32) plus the float64 chain of every
    stage computed from them."""
    offsets = None
    if lengths is not None:
        B, T = 1, sum(lengths)
        offsets = [0]
        for L in lengths:
            offsets.append(offsets[-1] + L)
    N = B if offsets is None else len(offsets) - 1
    p = dict(
        q=randn((B, T, H, K), gen, dtype, device),
        k=l2_normalized((B, T, H, K), gen, dtype, device),
        v=randn((B, T, H, V), gen, dtype, device),
        g=log_gate((B, T, H), gen, low=gate_low, device=device),
        beta=unit_interval((B, T, H), gen, device=device),
        h0=randn((N, H, K, V), gen, torch.float32, device, scale=0.5),
        offsets=offsets, BT=BT, scale=K ** -0.5,
        cu_seqlens=None if offsets is None else cu_seqlens_of(lengths, device),
    )
    p["gc"] = ref_cumsum(p["g"], offsets, BT)
    p["A"] = ref_kkt(p["k"], p["beta"], p["gc"], offsets, BT)
    p["Tinv"] = ref_tinv(p["A"], offsets, BT)
    p["w"], p["u"] = ref_wu(p["k"], p["v"], p["beta"], p["Tinv"], p["gc"], offsets, BT)
    p["h"], p["v_new"], p["ht"] = ref_fwd_h(p["k"], p["w"], p["u"], p["gc"], p["h0"],
                                            offsets, BT)
    return p


CASES = {
    "T100": dict(B=2, T=100, H=2, K=32, V=32),
    "T130_K_ne_V": dict(B=1, T=130, H=2, K=32, V=48),
    "varlen": dict(B=1, T=0, H=2, K=32, V=32, lengths=3),
}


def problem(case, gen, device, dtype, **extra):
    spec = dict(CASES[case])
    n = spec.pop("lengths", None)
    lengths = uneven_lengths(n, gen, low=1, high=110) if n else None
    return make_problem(gen, device, dtype=dtype, lengths=lengths, **spec, **extra)


def f32(x):
    return x.to(torch.float32)


# --------------------------------------------------------------------------- stage tests
@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gated", [True, False])
def test_scaled_dot_kkt(device, seed, dtype, case, gated):
    p = problem(case, generator(seed), device, dtype)
    gc = f32(p["gc"]) if gated else None
    A = chunk_scaled_dot_kkt_fwd(p["k"], beta=p["beta"], g=gc, cu_seqlens=p["cu_seqlens"],
                                 chunk_size=p["BT"])
    assert A.dtype == torch.float32 and A.shape == (*p["k"].shape[:3], p["BT"])
    ref = ref_kkt(p["k"], p["beta"], gc, p["offsets"], p["BT"])
    # Inputs are exact in 16 bits and products accumulate in fp32: fp32-level error.
    assert_rel_close("A", A, ref, 1e-4 if dtype != torch.bfloat16 else 1e-3)


@pytest.mark.interpret
def test_scaled_dot_kkt_no_beta_output_dtype(device, seed):
    p = problem("T100", generator(seed), device, torch.float16)
    A = chunk_scaled_dot_kkt_fwd(p["k"], g=f32(p["gc"]), output_dtype=torch.float16)
    assert A.dtype == torch.float16
    assert_rel_close("A", A, ref_kkt(p["k"], None, f32(p["gc"]), None, 64), 2e-3)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gated", [True, False])
def test_recompute_w_u(device, seed, dtype, case, gated):
    p = problem(case, generator(seed), device, dtype)
    gc = f32(p["gc"]) if gated else None
    Tinv = ref_tinv(ref_kkt(p["k"], p["beta"], gc, p["offsets"], p["BT"]), p["offsets"],
                    p["BT"])
    Tinv = f32(Tinv)
    # Columns past a partial chunk's end belong to no token: the stage must ignore them.
    for b, _, s, e in chunk_spans(p["k"].shape[0], p["k"].shape[1], p["offsets"], p["BT"]):
        Tinv[b, s:e, :, e - s:] = float("nan")
    w, u = recompute_w_u_fwd(p["k"], p["v"], p["beta"], Tinv, g=gc,
                             cu_seqlens=p["cu_seqlens"])
    assert w.dtype == dtype and u.dtype == dtype
    ref_w, ref_u = ref_wu(p["k"], p["v"], p["beta"], torch.nan_to_num(Tinv), gc,
                          p["offsets"], p["BT"])
    assert_rel_close("w", w, ref_w, tol(dtype))
    assert_rel_close("u", u, ref_u, tol(dtype))
    # W alone (the delta rule's backward): the same W, no U.
    w_only, none = recompute_w_u_fwd(p["k"], p["v"], p["beta"], Tinv, g=gc,
                                     cu_seqlens=p["cu_seqlens"], with_u=False)
    assert none is None
    assert_rel_close("w (with_u=False)", w_only, ref_w, tol(dtype))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gated", [True, False])
def test_fwd_h(device, seed, dtype, case, gated):
    p = problem(case, generator(seed), device, dtype)
    gc = f32(p["gc"]) if gated else None
    k, w, u = p["k"], p["w"].to(dtype), p["u"].to(dtype)
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(
        k=k, w=w, u=u, g=gc, initial_state=p["h0"], output_final_state=True,
        chunk_size=p["BT"], cu_seqlens=p["cu_seqlens"])
    ref_h, ref_v, ref_ht = ref_fwd_h(k, w, u, gc, p["h0"], p["offsets"], p["BT"])
    assert h.dtype == dtype and v_new.dtype == dtype and ht.dtype == torch.float32
    assert_rel_close("h", h, ref_h, tol(dtype))
    assert_rel_close("v_new", v_new, ref_v, tol(dtype))
    assert_rel_close("final_state", ht, ref_ht, tol(dtype))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("varlen", [False, True])
def test_fwd_h_without_w_in_row_blocks(device, seed, monkeypatch, dtype, varlen):
    """Without W the state's rows evolve independently and the pass may split them over
    programs (KH < K): each row block gives the float64 states, h0 / ht and packed
    sequences included, and Vn = U written once."""
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=110) if varlen else None
    p = make_problem(gen, device, B=2, T=150, H=2, K=128, V=48, dtype=dtype,
                     lengths=lengths)
    k, v, gc = p["k"], p["v"], f32(p["gc"])
    ref_h, _, ref_ht = ref_fwd_h(k, torch.zeros_like(k), v, gc, p["h0"], p["offsets"], 64)
    assert row_blocks({"K": 128, "w": None}) == (128, 64)
    assert row_blocks({"K": 128, "w": k}) == (128,)
    for KH, BV in [(128, 32), (64, 32), (64, 64)]:
        with monkeypatch.context() as m:
            force_config(m, chunk_gated_delta_rule_fwd_h_kernel,
                         Config(BV=BV, KH=KH, num_warps=4, num_stages=2))
            h, v_new, ht = chunk_gated_delta_rule_fwd_h(
                k, None, v, gc, p["h0"], True, cu_seqlens=p["cu_seqlens"])
        assert_rel_close(f"h (KH {KH}, BV {BV})", h, ref_h, tol(dtype))
        assert_rel_close(f"final_state (KH {KH}, BV {BV})", ht, ref_ht, tol(dtype))
        assert torch.equal(v_new, v), f"v_new (KH {KH}, BV {BV})"


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fwd_h_options(device, seed, dtype):
    """No initial state, no final state, no v_new; and head_first inputs."""
    p = problem("T130_K_ne_V", generator(seed), device, dtype)
    gc = f32(p["gc"])
    k, w, u = p["k"], p["w"].to(dtype), p["u"].to(dtype)
    ref_h, ref_v, _ = ref_fwd_h(k, w, u, gc, None, None, 64)
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(k, w, u, gc, save_new_value=False)
    assert v_new is None and ht is None
    assert_rel_close("h", h, ref_h, tol(dtype))

    hf = [x.transpose(1, 2).contiguous() for x in (k, w, u, gc)]
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(*hf, initial_state=None,
                                                output_final_state=True, head_first=True)
    assert h.shape == (1, 2, 3, 32, 48) and v_new.shape == (1, 2, 130, 48)
    assert_rel_close("h (head_first)", h.transpose(1, 2), ref_h, tol(dtype))
    assert_rel_close("v_new (head_first)", v_new.transpose(1, 2), ref_v, tol(dtype))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gated", [True, False])
def test_fwd_o(device, seed, dtype, case, gated):
    p = problem(case, generator(seed), device, dtype)
    gc = f32(p["gc"]) if gated else None
    v_new, h = p["v_new"].to(dtype), p["h"].to(dtype)
    o = chunk_fwd_o(p["q"], p["k"], v_new, h, g=gc, scale=p["scale"],
                    cu_seqlens=p["cu_seqlens"], chunk_size=p["BT"])
    assert o.dtype == dtype
    ref, ref_scores = ref_fwd_o(p["q"], p["k"], v_new, h, gc, p["scale"], p["offsets"],
                                p["BT"], with_scores=True)
    assert_rel_close("o", o, ref, tol(dtype))
    # Asked for, the scores come out beside the same output (kernel and PyTorch path).
    for path in ("kernel", "torch"):
        scores = torch.full((*p["q"].shape[:3], p["BT"]), float("nan"), dtype=dtype,
                            device=device)
        if path == "kernel":
            o_s = chunk_fwd_o(p["q"], p["k"], v_new, h, g=gc, scale=p["scale"],
                              cu_seqlens=p["cu_seqlens"], chunk_size=p["BT"],
                              scores_out=scores)
            assert torch.equal(o_s, o)
        else:
            o_s = chunk_fwd_o_torch(p["q"], p["k"], v_new, h, gc, p["scale"], p["offsets"],
                                    p["BT"], scores_out=scores)
            assert_rel_close("o (torch)", o_s, ref, tol(dtype))
        assert_rel_close(f"scores ({path})", scores, ref_scores, tol(dtype))
    with pytest.raises(ValueError, match="scores_out"):
        chunk_fwd_o(p["q"], p["k"], v_new, h, g=gc, cu_seqlens=p["cu_seqlens"],
                    chunk_size=p["BT"], scores_out=torch.empty(1, device=device, dtype=dtype))


# ------------------------------------------------------------------------- end to end
def run_stages(p, q, k, v, beta, g, h0, BT):
    """The forward chain as the chunk mode composes it; Tinv in float64 by torch.linalg
    (solve_tril is another module's, tested there)."""
    gc = f32(ref_cumsum(g, p["offsets"], BT))
    A = chunk_scaled_dot_kkt_fwd(k, beta=beta, g=gc, cu_seqlens=p["cu_seqlens"],
                                 chunk_size=BT)
    Tinv = f32(ref_tinv(A, p["offsets"], BT))
    w, u = recompute_w_u_fwd(k, v, beta, Tinv, g=gc, cu_seqlens=p["cu_seqlens"])
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(
        k=k, w=w, u=u, g=gc, initial_state=h0, output_final_state=True, chunk_size=BT,
        cu_seqlens=p["cu_seqlens"])
    o = chunk_fwd_o(q, k, v_new, h, g=gc, scale=p["scale"], cu_seqlens=p["cu_seqlens"],
                    chunk_size=BT)
    return o, ht


@pytest.mark.interpret
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["T130_K_ne_V", "varlen"])
def test_end_to_end_matches_recurrence(device, seed, monkeypatch, backend, dtype, case):
    if backend == "torch":
        monkeypatch.setenv("FLA_BACKEND", "torch")
    p = problem(case, generator(seed), device, dtype)
    o, ht = run_stages(p, p["q"], p["k"], p["v"], p["beta"], p["g"], p["h0"], p["BT"])
    ref_o, ref_ht = recurrence_loop(p["q"], p["k"], p["v"], p["g"], p["beta"], p["scale"],
                                    p["h0"], p["offsets"])
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert_rel_close("o", o, ref_o, tol(dtype))
    assert_rel_close("final_state", ht, ref_ht, tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_path_stages(seed, monkeypatch, dtype):
    """FLA_BACKEND=torch: each stage of the PyTorch path against its float64 reference."""
    monkeypatch.setenv("FLA_BACKEND", "torch")
    p = problem("varlen", generator(seed), "cpu", dtype)
    gc, off, BT = f32(p["gc"]), p["offsets"], p["BT"]
    A = chunk_scaled_dot_kkt_fwd(p["k"], p["beta"], gc, cu_seqlens=p["cu_seqlens"])
    assert_rel_close("A", A, ref_kkt(p["k"], p["beta"], gc, off, BT), 1e-5)
    Tinv = f32(p["Tinv"])
    w, u = recompute_w_u_fwd(p["k"], p["v"], p["beta"], Tinv, gc, cu_seqlens=p["cu_seqlens"])
    ref_w, ref_u = ref_wu(p["k"], p["v"], p["beta"], Tinv, gc, off, BT)
    assert_rel_close("w", w, ref_w, tol(dtype))
    assert_rel_close("u", u, ref_u, tol(dtype))
    w16, u16 = p["w"].to(dtype), p["u"].to(dtype)
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(p["k"], w16, u16, gc, p["h0"], True,
                                                cu_seqlens=p["cu_seqlens"])
    ref_h, ref_v, ref_ht = ref_fwd_h(p["k"], w16, u16, gc, p["h0"], off, BT)
    assert_rel_close("h", h, ref_h, tol(dtype))
    assert_rel_close("v_new", v_new, ref_v, tol(dtype))
    assert_rel_close("final_state", ht, ref_ht, tol(dtype))
    o = chunk_fwd_o(p["q"], p["k"], v_new, h, gc, cu_seqlens=p["cu_seqlens"])
    ref = ref_fwd_o(p["q"], p["k"], v_new, h, gc, p["scale"], off, BT)
    assert_rel_close("o", o, ref, tol(dtype))


# ------------------------------------------------------------------------- input checks
def test_bad_inputs_are_refused():
    k = torch.randn(1, 70, 2, 32)
    w = torch.randn(1, 70, 2, 32)
    u = torch.randn(1, 70, 2, 16)
    with pytest.raises(ValueError, match="w"):
        chunk_gated_delta_rule_fwd_h(k, w[:, :, :1], u)
    with pytest.raises(TypeError, match="u"):
        chunk_gated_delta_rule_fwd_h(k, w, u.half())
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule_fwd_h(k, w, u, initial_state=torch.zeros(2, 2, 32, 16))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_scaled_dot_kkt_fwd(k, chunk_size=48)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_scaled_dot_kkt_fwd(k, cu_seqlens=torch.tensor([0, 30, 60]))
    with pytest.raises(ValueError, match="chunk_indices"):
        chunk_scaled_dot_kkt_fwd(k, cu_seqlens=torch.tensor([0, 30, 70]),
                                 chunk_indices=torch.zeros(5, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="beta"):
        chunk_scaled_dot_kkt_fwd(k, beta=torch.rand(1, 70, 3))
    with pytest.raises(ValueError, match="h"):
        chunk_fwd_o(k, k, u, torch.zeros(1, 1, 2, 32, 16))
    with pytest.raises(ValueError, match="A"):
        recompute_w_u_fwd(k, u, torch.rand(1, 70, 2), torch.zeros(1, 70, 2, 48))


# ------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_field_call_issue_3(seed):
    """The exact call of the field report (issue 3) runs; checked against the PyTorch
    path in fp32 on the same (bf16) inputs.

    These inputs are not WY factors (w, u are raw Gaussians and g grows as often as it
    decays), so the state grows by orders of magnitude per chunk and overflows fp32 after
    some chunks in any implementation: the chunks are compared while the fp32 reference
    is finite. A well-scaled problem of the same shape is then compared in full."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, w, u = (torch.randn(1, 8192, 36, 256, dtype=torch.bfloat16, device="cuda",
                           generator=gen) for _ in range(3))
    g = torch.randn(1, 8192, 36, dtype=torch.float32, device="cuda", generator=gen)
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, head_first=False,
                                                chunk_size=64)
    torch.cuda.synchronize()
    assert h.shape == (1, 128, 36, 256, 256) and h.dtype == torch.bfloat16
    assert v_new.shape == (1, 8192, 36, 256) and ht is None
    from fla.ops.common.chunk_torch import chunk_gated_delta_rule_fwd_h_torch
    ref_h, ref_v, _ = chunk_gated_delta_rule_fwd_h_torch(f32(k), f32(w), f32(u), g)
    finite = [n for n in range(128) if torch.isfinite(ref_h[0, n]).all()
              and ref_h[0, n].abs().max() < 1e30]
    first_bad = next(n for n in range(129) if n == 128 or n not in finite)
    assert first_bad >= 2, "the reference overflowed at once: nothing to compare"
    for n in range(first_bad):
        assert_rel_close(f"h[chunk {n}]", h[0, n], ref_h[0, n], 2e-2)
    del h, v_new, ref_h, ref_v

    # Same shape, well-scaled: keys unit-norm, w of a contracting update, decaying gates.
    k = (torch.nn.functional.normalize(f32(k), dim=-1)).to(torch.bfloat16)
    w = (f32(w) * 0.02).to(torch.bfloat16)
    g = -torch.rand(1, 128, 64, 36, device="cuda", generator=gen).mul(0.05)
    g = g.cumsum(2).reshape(1, 8192, 36)
    h0 = torch.randn(1, 36, 256, 256, device="cuda", generator=gen)
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=h0,
                                                output_final_state=True)
    ref_h, ref_v, ref_ht = chunk_gated_delta_rule_fwd_h_torch(f32(k), f32(w), f32(u), g,
                                                              h0, True)
    assert_rel_close("h", h, ref_h, 1e-2)
    assert_rel_close("v_new", v_new, ref_v, 1e-2)
    assert_rel_close("final_state", ht, ref_ht, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 256])
def test_every_tuning_config(seed, monkeypatch, D):
    """Every config of each stage's tuning space compiles and is correct at K = V = D in
    bf16 (the issue: an LLVM layout assertion at num_warps 8 on D = 256 elsewhere)."""
    p = make_problem(generator(seed), "cuda", B=2, T=200, H=2, K=D, V=D,
                     dtype=torch.bfloat16)
    bf = torch.bfloat16
    gc = f32(p["gc"])
    q, k, v, beta = p["q"], p["k"], p["v"], p["beta"]
    w, u, h, vn, Tinv = (p[n].to(bf) for n in ("w", "u", "h", "v_new", "Tinv"))
    stages = [
        ("kkt", chunk_scaled_dot_kkt_fwd_kernel,
         lambda: (chunk_scaled_dot_kkt_fwd(k, beta, gc),),
         (ref_kkt(k, beta, gc, None, 64),), 1e-3),
        ("w_u", recompute_w_u_fwd_kernel,
         lambda: recompute_w_u_fwd(k, v, beta, f32(Tinv), gc),
         ref_wu(k, v, beta, f32(Tinv), gc, None, 64), 1e-2),
        ("fwd_h", chunk_gated_delta_rule_fwd_h_kernel,
         lambda: chunk_gated_delta_rule_fwd_h(k, w, u, gc, p["h0"], True),
         ref_fwd_h(k, w, u, gc, p["h0"], None, 64), 1e-2),
        ("fwd_h without W", chunk_gated_delta_rule_fwd_h_kernel,
         lambda: chunk_gated_delta_rule_fwd_h(k, None, v, gc, p["h0"], True),
         ref_fwd_h(k, torch.zeros_like(k), v, gc, p["h0"], None, 64), 1e-2),
        ("fwd_o", chunk_fwd_o_kernel,
         lambda: (chunk_fwd_o(q, k, vn, h, gc),),
         (ref_fwd_o(q, k, vn, h, gc, p["scale"], None, 64),), 1e-2),
    ]
    # 8: the smallest of these spaces on any release (fwd_h at K = 256 on Triton < 3.6,
    # where 8 warps are out of it).
    failures = sweep_configs(monkeypatch, stages, min_configs=8)
    assert not failures, "\n".join(failures)
