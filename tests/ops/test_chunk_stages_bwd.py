"""The backward chunk stages of the gated delta rule against float64 autograd.

Each stage is checked against ``torch.autograd.grad`` through a float64 PyTorch version of
the forward it differentiates, written here from ALGORITHMS.md §1 (independently of the
kernels and of ``fla.ops.common.chunk_torch``). The end-to-end test composes the four
stages into the full chunked backward and compares it with autograd through the plain
per-token recurrence loop

    S_t = e^{g_t} S_{t-1};  S_t += β_t k_t (v_t − S_tᵀ k_t);  o_t = scale S_tᵀ q_t.

Interpreter cases are small (T ≤ 160, H ≤ 2, K, V ≤ 32); bf16 at real sizes is GPU-only.
"""
from __future__ import annotations

import pytest
import torch

import fla.ops.common.chunk_delta_h_bwd as dhu_module
import fla.ops.common.chunk_o_bwd as o_bwd_module
import fla.ops.gated_delta_rule.wy_fast_bwd as wy_bwd_module
from fla.ops.common.chunk_delta_h_bwd import chunk_gated_delta_rule_bwd_dhu, scaled_dh_buffer
from fla.ops.common.chunk_o_bwd import chunk_bwd_dqkwg, chunk_bwd_dv_local
from fla.ops.gated_delta_rule.wy_fast_bwd import prepare_wy_repr_bwd
from fla.ops.utils.index import prepare_chunk_indices
from fla.utils.tuning import TunedKernel
from tests.helpers import (
    TOLERANCE,
    assert_rel_close,
    cu_seqlens_of,
    generator,
    l2_normalized,
    log_gate,
    packed_or_batch,
    randn,
    rel_error,
    uneven_lengths,
    unit_interval,
)

BT = 64
F64 = torch.float64
# (module, name) of each stage's tuned kernel: the launchers look the name up at call time.
STAGE_KERNELS = [
    (o_bwd_module, "chunk_bwd_dv_local_kernel"),
    (dhu_module, "chunk_gated_delta_rule_bwd_dhu_kernel"),
    (o_bwd_module, "chunk_bwd_dqkwg_kernel"),
    (wy_bwd_module, "prepare_wy_repr_bwd_kernel"),
]


# ---------------------------------------------------------------------------------------
# Chunk bookkeeping and float64 references (one chunk at a time, [L, H, ...] slices)
# ---------------------------------------------------------------------------------------
def chunk_layout(B: int, T: int, offsets: list[int] | None):
    """Sequences as ``(n, b, [(start, end, global_chunk), ...])`` and the chunk count per
    batch row of ``dh`` (``NT``): global chunk = b·NT + c, or the packed index under varlen."""
    if offsets is None:
        ranges = [(b, 0, T) for b in range(B)]
        NT = -(-T // BT)
    else:
        ranges = [(0, bos, eos) for bos, eos in zip(offsets[:-1], offsets[1:])]
        NT = sum(-(-(eos - bos) // BT) for _, bos, eos in ranges)
    seqs = []
    counter = 0
    for n, (b, bos, eos) in enumerate(ranges):
        chunks = []
        for i, s in enumerate(range(bos, eos, BT)):
            gc = b * NT + i if offsets is None else counter
            counter += 1
            chunks.append((s, min(s + BT, eos), gc))
        seqs.append((n, b, chunks))
    return seqs, NT


def chunkwise(fn, seqs, B: int, *tensors):
    """Apply ``fn(*slices) -> [L, ...]`` to every chunk and reassemble ``[B, T, ...]``."""
    rows = [[] for _ in range(B)]
    for _, b, chunks in seqs:
        for s, e, _ in chunks:
            rows[b].append(fn(*[t[b, s:e] for t in tensors]))
    return torch.stack([torch.cat(r, dim=0) for r in rows], dim=0)


def local_cumsum(g, seqs, reverse=False):
    """Chunk-local (reverse) cumulative sum over time of ``[B, T, H]``."""
    def fn(x):
        return x.flip(0).cumsum(0).flip(0) if reverse else x.cumsum(0)
    return chunkwise(fn, seqs, g.shape[0], g)


def decay(gam, strict: bool):
    """``[L, H]`` -> ``[H, L, L]`` Γ_ij = exp(γ_i − γ_j) on the (strictly) lower triangle."""
    L = gam.shape[0]
    mask = torch.ones(L, L, dtype=torch.bool, device=gam.device).tril(-1 if strict else 0)
    diff = gam.T[:, :, None] - gam.T[:, None, :]
    return torch.where(mask, torch.exp(torch.where(mask, diff, torch.zeros_like(diff))),
                       torch.zeros_like(diff))


def o_intra(qc, kc, vnc, gamc):
    """(Q Kᵀ ⊙ Γ ⊙ causal_incl_diag) Vn of one chunk (no scale)."""
    s = torch.einsum("ihk,jhk->hij", qc, kc) * decay(gamc, strict=False)
    return torch.einsum("hij,jhv->ihv", s, vnc)


def wy_chunk(kc, vc, bc, gamc):
    """W, U and Tinv of one chunk."""
    L, H = bc.shape
    A = torch.einsum("ihk,jhk->hij", kc, kc) * bc.T[:, :, None] * decay(gamc, strict=True)
    eye = torch.eye(L, dtype=A.dtype, device=A.device).expand(H, L, L)
    Tinv = torch.linalg.inv(eye + A)
    kb = kc * (bc * torch.exp(gamc))[..., None]
    W = torch.einsum("hij,jhk->ihk", Tinv, kb)
    U = torch.einsum("hij,jhv->ihv", Tinv, vc * bc[..., None])
    return W, U, Tinv


def state_pass(q, k, w, u, gam, h0, scale, seqs, NT, perturb=None):
    """Forward state pass + output in float64.

    Returns o ``[B, T, H, V]``, final states ``[N, H, K, V]``, entering states h
    ``[B, NT, H, K, V]`` and Vn ``[B, T, H, V]``. ``perturb`` (``[B·NT, H, K, V]``, zeros) is
    added to each chunk's leaving state so that its gradient is dh."""
    B, T, H, K = k.shape
    V = u.shape[-1]
    o_rows = [[] for _ in range(B)]
    vn_rows = [[] for _ in range(B)]
    hs = [torch.zeros(H, K, V, dtype=F64, device=k.device)] * (B * NT)
    finals = []
    for n, b, chunks in seqs:
        S = h0[n] if h0 is not None else torch.zeros(H, K, V, dtype=F64, device=k.device)
        for s, e, gc in chunks:
            qc, kc, wc, uc, gc_ = q[b, s:e], k[b, s:e], w[b, s:e], u[b, s:e], gam[b, s:e]
            hs[gc] = S
            vn = uc - torch.einsum("ihk,hkv->ihv", wc, S)
            o = scale * (torch.einsum("ihk,hkv->ihv", qc * torch.exp(gc_)[..., None], S)
                         + o_intra(qc, kc, vn, gc_))
            g_last = gc_[-1]
            S = (torch.exp(g_last)[:, None, None] * S
                 + torch.einsum("ihk,ihv->hkv", kc * torch.exp(g_last - gc_)[..., None], vn))
            if perturb is not None:
                S = S + perturb[gc]
            o_rows[b].append(o)
            vn_rows[b].append(vn)
        finals.append(S)
    o = torch.stack([torch.cat(r, 0) for r in o_rows])
    vn = torch.stack([torch.cat(r, 0) for r in vn_rows])
    h = torch.stack(hs).reshape(B, NT, H, K, V)
    return o, torch.stack(finals), h, vn


def recurrence(q, k, v, g, beta, h0, scale, seqs):
    """The per-token float64 loop of ALGORITHMS.md §1; returns (o, final states)."""
    B, T, H, K = k.shape
    rows = [[] for _ in range(B)]
    finals = []
    for n, b, chunks in seqs:
        bos, eos = chunks[0][0], chunks[-1][1]
        S = h0[n]
        for t in range(bos, eos):
            S = torch.exp(g[b, t])[:, None, None] * S
            kS = torch.einsum("hk,hkv->hv", k[b, t], S)
            S = S + torch.einsum("hk,hv->hkv", beta[b, t][:, None] * k[b, t], v[b, t] - kS)
            rows[b].append(scale * torch.einsum("hk,hkv->hv", q[b, t], S))
        finals.append(S)
    return torch.stack([torch.stack(r, 0) for r in rows]), torch.stack(finals)


# ---------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------
CASES = [
    pytest.param(dict(B=2, T=100, H=2, K=32, V=32), id="B2-T100-K32-V32"),
    pytest.param(dict(B=1, T=150, H=1, K=16, V=32), id="B1-T150-K16-V32"),
    pytest.param(dict(varlen=3, H=2, K=32, V=16), id="varlen3-K32-V16"),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]


def make_shape(case, gen):
    if case.get("varlen"):
        lengths = uneven_lengths(case["varlen"], gen, low=1, high=150)
        cu = cu_seqlens_of(lengths)
        return 1, int(cu[-1]), cu, cu.tolist()
    return case["B"], case["T"], None, None


def to_dev(x, device):
    return None if x is None else x.to(device)


def rounded64(x):
    """The value a kernel sees, as a float64 tensor on the same device."""
    return x.detach().to(F64)


# ---------------------------------------------------------------------------------------
# Stage tests
# ---------------------------------------------------------------------------------------
@pytest.mark.interpret
@pytest.mark.parametrize("use_g", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_dv_local(case, dtype, use_g, device, seed):
    gen = generator(seed)
    B, T, cu, offsets = make_shape(case, gen)
    H, K, V = case["H"], case["K"], case["V"]
    seqs, _ = chunk_layout(B, T, offsets)
    scale = K ** -0.5
    q = randn((B, T, H, K), gen, dtype)
    k = l2_normalized((B, T, H, K), gen, dtype)
    do = randn((B, T, H, V), gen, dtype)
    g = log_gate((B, T, H), gen) if use_g else None
    gam = local_cumsum(g.to(F64), seqs) if use_g else torch.zeros(B, T, H, dtype=F64)

    vn = torch.zeros(B, T, H, V, dtype=F64, requires_grad=True)
    o = scale * chunkwise(o_intra, seqs, B, rounded64(q), rounded64(k), vn, gam)
    (ref,) = torch.autograd.grad(o, vn, rounded64(do))

    dv = chunk_bwd_dv_local(to_dev(q, device), to_dev(k, device), to_dev(do, device),
                            g=to_dev(gam.float(), device) if use_g else None, scale=scale,
                            cu_seqlens=to_dev(cu, device))
    assert dv.dtype == dtype and dv.shape == (B, T, H, V)
    assert_rel_close("dv_local", dv, ref, TOLERANCE[dtype])


@pytest.mark.interpret
@pytest.mark.parametrize("use_g", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_bwd_dhu(case, dtype, use_g, device, seed):
    gen = generator(seed)
    B, T, cu, offsets = make_shape(case, gen)
    H, K, V = case["H"], case["K"], case["V"]
    seqs, NT = chunk_layout(B, T, offsets)
    N = len(seqs)
    scale = K ** -0.5
    q = randn((B, T, H, K), gen, dtype)
    k = l2_normalized((B, T, H, K), gen, dtype)
    w = randn((B, T, H, K), gen, dtype, scale=0.3)
    u = randn((B, T, H, V), gen, dtype)
    do = randn((B, T, H, V), gen, dtype)
    g = log_gate((B, T, H), gen) if use_g else None
    gam = local_cumsum(g.to(F64), seqs) if use_g else torch.zeros(B, T, H, dtype=F64)
    h0 = randn((N, H, K, V), gen, torch.float32)
    dht = randn((N, H, K, V), gen, torch.float32)

    q64, k64, w64, do64 = (rounded64(x) for x in (q, k, w, do))
    u64 = rounded64(u).requires_grad_()
    h064 = rounded64(h0).requires_grad_()
    perturb = torch.zeros(B * NT, H, K, V, dtype=F64, requires_grad=True)
    o, final, _, _ = state_pass(q64, k64, w64, u64, gam, h064, scale, seqs, NT, perturb)
    loss = (o * do64).sum() + (final * rounded64(dht)).sum()
    ref_dv2, ref_dh, ref_dh0 = torch.autograd.grad(loss, (u64, perturb, h064))
    # The intra-chunk dVn the stage receives (stage 1's output, in the input dtype).
    vn0 = torch.zeros(B, T, H, V, dtype=F64, requires_grad=True)
    (dv_local,) = torch.autograd.grad(
        scale * chunkwise(o_intra, seqs, B, q64, k64, vn0, gam), vn0, do64)

    dh, dh0, dv2 = chunk_gated_delta_rule_bwd_dhu(
        to_dev(q, device), to_dev(k, device), to_dev(w, device),
        to_dev(gam.float(), device) if use_g else None, to_dev(h0, device),
        to_dev(dht, device), to_dev(do, device), to_dev(dv_local.to(dtype), device),
        scale=scale, cu_seqlens=to_dev(cu, device))
    assert dh.shape == (B, NT, H, K, V) and dh0.shape == (N, H, K, V)
    assert dh0.dtype == torch.float32 and dv2.dtype == dtype
    tol = TOLERANCE[dtype]
    assert_rel_close("dh", dh, ref_dh.reshape(B, NT, H, K, V), tol)
    assert_rel_close("dh0", dh0, ref_dh0, tol)
    assert_rel_close("dv2", dv2, ref_dv2, tol)


@pytest.mark.interpret
@pytest.mark.parametrize("use_w", [True, False], ids=["delta", "no-delta"])
@pytest.mark.parametrize("use_g", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "batch"])
def test_bwd_dhu_split_into_segments_equals_the_whole_walk(varlen, use_g, use_w, device,
                                                            seed):
    """The reverse pass cut into segments of 1 and 2 chunks (the segments' transitions,
    the combine from dht, each segment from its leaving gradient) gives the whole walk's
    dh, dh0 and dVn: with W (the augmented [M | X] transitions) and without (a scalar M),
    with and without decay, packed and batched, from a final-state gradient."""
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=70, high=300)
    B, T, N, cu = packed_or_batch(lengths, varlen)
    offsets = None if cu is None else cu.tolist()
    H, K, V = 2, 32, 16
    q, k, w = (randn((B, T, H, K), gen) for _ in range(3))
    do, dv = (randn((B, T, H, V), gen) for _ in range(2))
    seqs, _ = chunk_layout(B, T, offsets)
    gam = local_cumsum(log_gate((B, T, H), gen).to(F64), seqs).float() if use_g else None
    N = N or B
    h0, dht = (randn((N, H, K, V), gen, torch.float32) for _ in range(2))
    args = [to_dev(x, device) for x in (q, k, w if use_w else None, gam, h0, dht, do, dv)]
    whole = chunk_gated_delta_rule_bwd_dhu(*args, scale=0.5, cu_seqlens=to_dev(cu, device))
    for chunks in (1, 2):
        split = chunk_gated_delta_rule_bwd_dhu(*args, scale=0.5,
                                               cu_seqlens=to_dev(cu, device),
                                               segment_chunks=chunks, offsets=offsets)
        for name, a, b in zip(("dh", "dh0", "dv2"), split, whole):
            assert_rel_close(f"{name} ({chunks}-chunk segments)", a, b.double(), 1e-5)


@pytest.mark.interpret
@pytest.mark.parametrize("segment_chunks", [0, 1], ids=["whole", "split"])
def test_bwd_dhu_stores_dh_as_scaled_fp16(segment_chunks, device, seed):
    """With ``dh_scale`` dh comes back in fp16, each chunk's block (per program: all K
    rows, a tile of columns) divided by a power of two that puts its largest |value| in
    (2^13, 2^14]: every block keeps ~11 significant bits whatever its size. dh ·
    dh_scale equals the unscaled pass's fp32 dh to fp16's rounding, over blocks of very
    different sizes (a steep and a weak decay), and a sequence whose gradients are all
    zero keeps zeros (its blocks' factor stays finite)."""
    gen = generator(seed)
    lengths = [150, 130]
    B, T, N, cu = packed_or_batch(lengths, True)
    offsets = cu.tolist()
    H, K, V = 2, 32, 32
    seqs, _ = chunk_layout(B, T, offsets)
    q, k, w = (randn((B, T, H, K), gen) for _ in range(3))
    do, dv = (randn((B, T, H, V), gen) for _ in range(2))
    do[:, 150:], dv[:, 150:] = 0, 0                  # the second sequence: dh ≡ 0
    gam = local_cumsum(log_gate((B, T, H), gen).to(F64), seqs).float()
    gam[..., 1] *= 8                                  # head 1: steep decays, small blocks
    args = [to_dev(x, device) for x in (q, k, w, gam, None, None, do, dv)]
    common = dict(scale=0.5, cu_seqlens=to_dev(cu, device), offsets=offsets,
                  segment_chunks=segment_chunks)
    dh_ref, _, dv2_ref = chunk_gated_delta_rule_bwd_dhu(*args, **common)
    NT = dh_ref.shape[1]
    dh_scale = torch.empty(B, NT, H, V, dtype=torch.float32, device=device)
    dh, _, dv2 = chunk_gated_delta_rule_bwd_dhu(*args, dh_scale=dh_scale, **common)
    assert dh.dtype == torch.float16 and torch.isfinite(dh_scale).all()
    assert torch.equal(dv2, dv2_ref)
    exponent = torch.log2(dh_scale)
    assert torch.equal(exponent, exponent.round()), "the factors are powers of two"
    restored = dh.double() * dh_scale.double()[:, :, :, None, :]
    assert_rel_close("dh", restored, dh_ref.double(), 2.0 ** -11)
    zero_chunks = slice(-(-150 // BT), NT)
    assert (dh[:, zero_chunks] == 0).all()
    # Per chunk and head (V = 32: one column tile a program), over the first sequence's
    # chunks but its last (whose leaving gradient is the absent dht: zeros).
    peak = dh.double().abs().amax(dim=(3, 4))
    live = peak[:, : -(-150 // BT) - 1]
    assert ((live > 2.0 ** 13) & (live <= 2.0 ** 14)).all()


@pytest.mark.interpret
def test_bwd_dhu_split_refuses_what_it_cannot_address(device):
    """A split reverse pass needs the host offsets of packed sequences and has no vector
    gate form: both are refused before any launch. (On the kernel's device: a CPU tensor
    without the interpreter is refused first, for that.)"""
    q = k = do = torch.zeros(1, 128, 1, 16, device=device)
    cu = torch.tensor([0, 64, 128], device=device)
    with pytest.raises(ValueError, match="offsets"):
        chunk_gated_delta_rule_bwd_dhu(q, k, None, None, None, None, do, do, cu_seqlens=cu,
                                       segment_chunks=1)
    with pytest.raises(ValueError, match="vector gate"):
        chunk_gated_delta_rule_bwd_dhu(q, k, None, torch.zeros(1, 128, 1, 16, device=device),
                                       None, None, do, None,
                                       Aqk=torch.zeros(1, 128, 1, 64, device=device),
                                       segment_chunks=1)


@pytest.mark.interpret
def test_bwd_dhu_without_states(device, seed):
    """No initial state and no final-state gradient: dh0 is None, dS starts at 0."""
    gen = generator(seed)
    B, T, H, K, V = 1, 90, 2, 32, 32
    seqs, NT = chunk_layout(B, T, None)
    scale = 0.7
    q, k, w = (randn((B, T, H, K), gen) for _ in range(3))
    u, do = (randn((B, T, H, V), gen) for _ in range(2))
    gam = local_cumsum(log_gate((B, T, H), gen).to(F64), seqs)
    q64, k64, w64, do64 = (rounded64(x) for x in (q, k, w, do))
    u64 = rounded64(u).requires_grad_()
    perturb = torch.zeros(B * NT, H, K, V, dtype=F64, requires_grad=True)
    o, _, _, _ = state_pass(q64, k64, w64, u64, gam, None, scale, seqs, NT, perturb)
    ref_dv2, ref_dh = torch.autograd.grad((o * do64).sum(), (u64, perturb))
    vn0 = torch.zeros(B, T, H, V, dtype=F64, requires_grad=True)
    (dv_local,) = torch.autograd.grad(
        scale * chunkwise(o_intra, seqs, B, q64, k64, vn0, gam), vn0, do64)
    dh, dh0, dv2 = chunk_gated_delta_rule_bwd_dhu(
        q.to(device), k.to(device), w.to(device), gam.float().to(device), None, None,
        do.to(device), dv_local.float().to(device), scale=scale)
    assert dh0 is None
    assert_rel_close("dh", dh, ref_dh.reshape(B, NT, H, K, V), 1e-4)
    assert_rel_close("dv2", dv2, ref_dv2, 1e-4)


@pytest.mark.interpret
@pytest.mark.parametrize("use_g", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_bwd_dqkwg(case, dtype, use_g, device, seed):
    gen = generator(seed)
    B, T, cu, offsets = make_shape(case, gen)
    H, K, V = case["H"], case["K"], case["V"]
    seqs, NT = chunk_layout(B, T, offsets)
    scale = K ** -0.5
    q = randn((B, T, H, K), gen, dtype)
    k = l2_normalized((B, T, H, K), gen, dtype)
    w = randn((B, T, H, K), gen, dtype, scale=0.3)
    vn, dv2, do = (randn((B, T, H, V), gen, dtype) for _ in range(3))
    h, dh = (randn((B, NT, H, K, V), gen, dtype) for _ in range(2))
    g = log_gate((B, T, H), gen) if use_g else None
    gam = local_cumsum(g.to(F64), seqs) if use_g else torch.zeros(B, T, H, dtype=F64)

    q64, k64, w64 = (rounded64(x).requires_grad_() for x in (q, k, w))
    gam64 = gam.clone().float().to(F64).requires_grad_()
    vn64, dv264, do64 = (rounded64(x) for x in (vn, dv2, do))
    h64 = rounded64(h).reshape(B * NT, H, K, V)
    dh64 = rounded64(dh).reshape(B * NT, H, K, V)
    # With the states and Vn held fixed, the stage's gradients are those of
    # Σ_c ⟨O_c, dO_c⟩ + ⟨S'_c, dS'_c⟩ + ⟨−W_c S_c, dVn_c⟩.
    loss = 0.
    for _, b, chunks in seqs:
        for s, e, gc in chunks:
            qc, kc, wc, gc_ = q64[b, s:e], k64[b, s:e], w64[b, s:e], gam64[b, s:e]
            S, dS = h64[gc], dh64[gc]
            o = scale * (torch.einsum("ihk,hkv->ihv", qc * torch.exp(gc_)[..., None], S)
                         + o_intra(qc, kc, vn64[b, s:e], gc_))
            g_last = gc_[-1]
            S_out = (torch.exp(g_last)[:, None, None] * S
                     + torch.einsum("ihk,ihv->hkv", kc * torch.exp(g_last - gc_)[..., None],
                                    vn64[b, s:e]))
            loss = loss + (o * do64[b, s:e]).sum() + (S_out * dS).sum()
            loss = loss - (torch.einsum("ihk,hkv->ihv", wc, S) * dv264[b, s:e]).sum()
    ref = torch.autograd.grad(loss, (q64, k64, w64, gam64))

    dq, dk, dw, dg = chunk_bwd_dqkwg(
        to_dev(q, device), to_dev(k, device), to_dev(vn, device), to_dev(w, device),
        to_dev(gam.float(), device) if use_g else None, to_dev(h, device),
        to_dev(dv2, device), to_dev(do, device), to_dev(dh, device), scale=scale,
        cu_seqlens=to_dev(cu, device))
    tol = TOLERANCE[dtype]
    assert_rel_close("dq", dq, ref[0], tol)
    assert_rel_close("dk", dk, ref[1], tol)
    assert_rel_close("dw", dw, ref[2], tol)
    if use_g:
        assert dg.dtype == torch.float32
        assert_rel_close("dg", dg, ref[3], tol)
    else:
        assert dg is None


def wy_inputs(case, dtype, use_g, gen):
    B, T, cu, offsets = make_shape(case, gen)
    H, K, V = case["H"], case["K"], case["V"]
    seqs, _ = chunk_layout(B, T, offsets)
    k = l2_normalized((B, T, H, K), gen, dtype)
    v = randn((B, T, H, V), gen, dtype)
    beta = unit_interval((B, T, H), gen, dtype)
    g = log_gate((B, T, H), gen) if use_g else None
    gam = local_cumsum(g.to(F64), seqs) if use_g else torch.zeros(B, T, H, dtype=F64)
    return B, T, cu, seqs, k, v, beta, gam


def tinv_table(Tinvs, B, T, H, seqs, fill=float("nan")):
    """Per-chunk Tinv ``[H, L, L]`` -> ``[B, T, H, BT]`` (row t: t's row of its chunk's
    block). Entries above the diagonal and past a partial chunk hold ``fill``: the stage must
    read only the lower triangle."""
    A = torch.full((B, T, H, BT), fill, dtype=F64, device=Tinvs[0].device)
    i = 0
    for _, b, chunks in seqs:
        for s, e, _ in chunks:
            L = e - s
            block = Tinvs[i].permute(1, 0, 2)                      # [L, H, L]
            lower = torch.ones(L, L, dtype=torch.bool, device=A.device).tril()[:, None, :]
            A[b, s:e, :, :L] = torch.where(lower, block, torch.full_like(block, fill))
            i += 1
    return A


@pytest.mark.interpret
@pytest.mark.parametrize("use_g", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_wy_repr_bwd(case, dtype, use_g, device, seed):
    gen = generator(seed)
    B, T, cu, seqs, k, v, beta, gam = wy_inputs(case, dtype, use_g, gen)
    H, K, V = case["H"], case["K"], case["V"]
    dw = randn((B, T, H, K), gen, dtype)
    du = randn((B, T, H, V), gen, dtype)

    k64, v64, b64 = (rounded64(x).requires_grad_() for x in (k, v, beta))
    gam64 = gam.float().to(F64).requires_grad_()
    Ws, Us, Tinvs = [], [], []
    for _, b, chunks in seqs:
        for s, e, _ in chunks:
            W, U, Tinv = wy_chunk(k64[b, s:e], v64[b, s:e], b64[b, s:e], gam64[b, s:e])
            Ws.append((b, s, e, W)), Us.append(U), Tinvs.append(Tinv.detach())
    loss = sum((W * rounded64(dw)[b, s:e]).sum() + (U * rounded64(du)[b, s:e]).sum()
               for (b, s, e, W), U in zip(Ws, Us))
    ref = torch.autograd.grad(loss, (k64, v64, b64, gam64))
    A = tinv_table(Tinvs, B, T, H, seqs).to(dtype)

    dk, dv, dbeta, dg = prepare_wy_repr_bwd(
        to_dev(k, device), to_dev(v, device), to_dev(beta, device), to_dev(A, device),
        to_dev(dw, device), to_dev(du, device),
        g=to_dev(gam.float(), device) if use_g else None, cu_seqlens=to_dev(cu, device))
    tol = TOLERANCE[dtype]
    assert_rel_close("dk", dk, ref[0], tol)
    assert_rel_close("dv", dv, ref[1], tol)
    assert_rel_close("dbeta", dbeta, ref[2], tol)
    if use_g:
        assert_rel_close("dg", dg, ref[3], tol)
    else:
        assert dg is None


def wy_accumulation_problem(dtype, device, gen):
    """The varlen case's WY-stage inputs in ``dtype`` (a gate; random Ai, dW, dU): the
    stage as a call taking extra keywords, and fp32 partials of dk and dγ to add."""
    case = CASES[-1].values[0]                    # varlen
    B, T, cu, _, k, v, beta, gam = wy_inputs(case, dtype, True, gen)
    H, K, V = case["H"], case["K"], case["V"]
    inputs = [to_dev(x, device) for x in (k, v, beta)] + [
        randn((B, T, H, BT), gen, dtype, device), randn((B, T, H, K), gen, dtype, device),
        randn((B, T, H, V), gen, dtype, device)]
    kw = dict(g=to_dev(gam.float(), device), cu_seqlens=to_dev(cu, device))
    dk_old = randn((B, T, H, K), gen, torch.float32, device)
    dg_old = randn((B, T, H), gen, torch.float32, device)
    return (lambda **extra: prepare_wy_repr_bwd(*inputs, **kw, **extra)), dk_old, dg_old


@pytest.mark.interpret
def test_wy_repr_bwd_adds_into_given_buffers(device, seed):
    """dk_acc / dg_acc in fp32 inputs: the WY part is added into them in place (the result
    is them, equal to the separate part plus their old value); a buffer the kernel would
    address wrongly is refused."""
    wy, dk_old, dg_old = wy_accumulation_problem(torch.float32, device, generator(seed))
    dk_wy, dv, dbeta, dg_wy = wy()
    dk_acc, dg_acc = dk_old.clone(), dg_old.clone()
    dk, dv2, dbeta2, dg = wy(dk_acc=dk_acc, dg_acc=dg_acc)
    assert dk is dk_acc and dg is dg_acc
    assert_rel_close("dk", dk, dk_wy.double() + dk_old.double(), 1e-6)
    assert_rel_close("dg", dg, dg_wy.double() + dg_old.double(), 1e-6)
    assert torch.equal(dv, dv2) and torch.equal(dbeta, dbeta2)
    with pytest.raises(ValueError, match="dk_acc and dg_acc"):
        wy(dk_acc=dk_old.clone())
    with pytest.raises(ValueError, match="dk_acc: expected a contiguous"):
        wy(dk_acc=dk_old.half(), dg_acc=dg_old)
    with pytest.raises(ValueError, match="dg_acc: expected a contiguous"):
        wy(dk_acc=dk_old.clone(), dg_acc=dg_old[..., :1].expand_as(dg_old))


@pytest.mark.interpret
def test_wy_repr_bwd_adds_a_float32_partial_into_a_new_16_bit_dk(device, seed):
    """16-bit inputs: an fp32 dk_acc (dqkwg's partial, as the op passes it) is added as it
    is read and the sum rounded once into a new dk in k's dtype, the partial untouched; a
    dk_acc in k's dtype is still added in place."""
    wy, dk_old, dg_old = wy_accumulation_problem(torch.float16, device, generator(seed))
    dk_wy, _, _, dg_wy = wy()
    dk_acc = dk_old.clone()
    dk, _, _, dg = wy(dk_acc=dk_acc, dg_acc=dg_old.clone())
    assert dk is not dk_acc and dk.dtype == torch.float16 and torch.equal(dk_acc, dk_old)
    # dk_wy is itself rounded to fp16: the sum agrees to a few fp16 roundings.
    assert_rel_close("dk", dk, dk_wy.double() + dk_old.double(), 2e-3)
    assert_rel_close("dg", dg, dg_wy.double() + dg_old.double(), 1e-6)
    dk_acc16 = dk_old.half()
    dk16, _, _, _ = wy(dk_acc=dk_acc16, dg_acc=dg_old.clone())
    assert dk16 is dk_acc16
    assert_rel_close("dk", dk16, dk_wy.double() + dk_old.half().double(), 2e-3)


# ---------------------------------------------------------------------------------------
# End to end: the four stages compose into the gradient of the recurrence
# ---------------------------------------------------------------------------------------
def chunked_backward(q, k, v, g, beta, h0, do, dht, scale, cu, seqs, NT, device,
                     segment_chunks=0):
    """Float64 forward of the stages this file does not own, then the four backward
    kernels in the inputs' dtype (the reverse pass split into segments of
    ``segment_chunks`` chunks when nonzero); returns (dq, dk, dv, dg, dbeta, dh0) and o."""
    dtype = q.dtype
    B, T, H, K = k.shape
    V = v.shape[-1]
    q64, k64, v64, b64 = (rounded64(x) for x in (q, k, v, beta))
    gam = local_cumsum(g.to(F64), seqs)
    gam32 = gam.float()
    gam = gam32.to(F64)                    # the kernels see fp32 γ: so does the forward
    Tinvs = []
    w_rows, u_rows = [[] for _ in range(B)], [[] for _ in range(B)]
    for _, b, chunks in seqs:
        for s, e, _ in chunks:
            W, U, Tinv = wy_chunk(k64[b, s:e], v64[b, s:e], b64[b, s:e], gam[b, s:e])
            w_rows[b].append(W), u_rows[b].append(U), Tinvs.append(Tinv)
    w64 = torch.stack([torch.cat(r, 0) for r in w_rows])
    u64 = torch.stack([torch.cat(r, 0) for r in u_rows])
    w = w64.to(dtype)
    o, _, h, vn = state_pass(q64, k64, w64, u64, gam, rounded64(h0), scale, seqs, NT)
    A = tinv_table(Tinvs, B, T, H, seqs).to(torch.float32 if dtype == torch.float32 else dtype)

    # Varlen: the chunk table is built once and handed to every stage, as the caller does.
    ci = None if cu is None else prepare_chunk_indices(cu, BT)
    dev = {name: to_dev(x, device) for name, x in dict(
        q=q, k=k, v=v, beta=beta, g=gam32, h0=h0, do=do, dht=dht, w=w, vn=vn.to(dtype),
        h=h.to(dtype), A=A, cu=cu, ci=ci).items()}
    varlen = dict(cu_seqlens=dev["cu"], chunk_indices=dev["ci"])
    dv_local = chunk_bwd_dv_local(dev["q"], dev["k"], dev["do"], g=dev["g"], scale=scale,
                                  **varlen)
    # As the op does: in bf16 dh stored as scaled fp16 and dk's partial in fp32 (fp16: in
    # fp16); the WY part added to dqkwg's dk and dγ as it reads them.
    dh_scale = scaled_dh_buffer(dev["k"], dev["g"], dev["h"])
    dh, dh0, dv2 = chunk_gated_delta_rule_bwd_dhu(
        dev["q"], dev["k"], dev["w"], dev["g"], dev["h0"], dev["dht"], dev["do"], dv_local,
        scale=scale, segment_chunks=segment_chunks,
        offsets=None if cu is None else cu.tolist(), dh_scale=dh_scale, **varlen)
    dq, dk, dw, dg = chunk_bwd_dqkwg(
        dev["q"], dev["k"], dev["vn"], dev["w"], dev["g"], dev["h"], dv2, dev["do"], dh,
        scale=scale, dk_dtype=None if dtype == torch.float16 else torch.float32,
        dh_scale=dh_scale, **varlen)
    dk, dv, dbeta, dg = prepare_wy_repr_bwd(
        dev["k"], dev["v"], dev["beta"], dev["A"], dw, dv2, g=dev["g"], dk_acc=dk,
        dg_acc=dg, **varlen)
    dg = local_cumsum(dg.to(F64), seqs, reverse=True)
    return (dq, dk, dv, dg, dbeta, dh0), o


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def end_to_end_problem(B, T, H, K, V, offsets, dtype, seed, device):
    """Random inputs of one call (on ``device``) and the float64 loop's gradients of
    ⟨o, dO⟩ + ⟨final_state, dht⟩ w.r.t. q, k, v, g, beta, initial_state. The float64
    references run on ``device`` too: on the GPU that keeps T = 1000 cases quick."""
    gen = generator(seed)
    seqs, NT = chunk_layout(B, T, offsets)
    N = len(seqs)
    scale = K ** -0.5
    q = randn((B, T, H, K), gen, dtype, device)
    k = l2_normalized((B, T, H, K), gen, dtype, device)
    v = randn((B, T, H, V), gen, dtype, device)
    g = log_gate((B, T, H), gen, low=-0.5, device=device)
    beta = unit_interval((B, T, H), gen, dtype, device)
    h0 = randn((N, H, K, V), gen, torch.float32, device)
    do = randn((B, T, H, V), gen, dtype, device)
    dht = randn((N, H, K, V), gen, torch.float32, device)

    leaves = [rounded64(x).requires_grad_() for x in (q, k, v, g, beta, h0)]
    o_ref, final_ref = recurrence(*leaves, scale, seqs)
    loss = (o_ref * rounded64(do)).sum() + (final_ref * rounded64(dht)).sum()
    ref = dict(zip(GRAD_NAMES, torch.autograd.grad(loss, leaves)))
    inputs = (q, k, v, g, beta, h0, do, dht, scale)
    return inputs, seqs, NT, o_ref.detach(), ref


def check_end_to_end(B, T, H, K, V, cu, offsets, dtype, device, seed, tol,
                     segment_chunks=0):
    inputs, seqs, NT, o_ref, ref = end_to_end_problem(B, T, H, K, V, offsets, dtype, seed,
                                                      device)
    grads, o_chunk = chunked_backward(*inputs, cu, seqs, NT, device, segment_chunks)
    # The float64 chunk forward used above is itself checked against the loop.
    assert_rel_close("o (chunked float64 forward)", o_chunk, o_ref, 1e-6)
    for name, out in zip(GRAD_NAMES, grads):
        assert_rel_close(name, out, ref[name], tol)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [
    pytest.param((2, 100, 2, 32, 32), id="B2-T100-K32-V32"),
    pytest.param((1, 150, 1, 32, 16), id="B1-T150-K32-V16"),
])
def test_end_to_end_matches_recurrence(shape, dtype, device, seed):
    B, T, H, K, V = shape
    check_end_to_end(B, T, H, K, V, None, None, dtype, device, seed, TOLERANCE[dtype])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("segment_chunks", [0, 1], ids=["whole", "split"])
def test_end_to_end_varlen_matches_recurrence(segment_chunks, dtype, device, seed):
    """Packed uneven sequences; ``split``: the reverse pass in one-chunk segments."""
    gen = generator(seed ^ 0x5EED)
    lengths = uneven_lengths(3, gen, low=1, high=150)
    cu = cu_seqlens_of(lengths)
    T = int(cu[-1])
    check_end_to_end(1, T, 2, 16, 32, cu, cu.tolist(), dtype, device, seed, TOLERANCE[dtype],
                     segment_chunks)


@pytest.mark.interpret
def test_end_to_end_wide_heads(device, seed):
    """K = 200, V = 80: several K tiles (dS in four register tiles, the last one partial;
    dq/dk/dw/dγ split over four K programs) and a partial V tile.

    fp16, not fp32: on the GPU an fp32 ``ieee`` tl.dot is lowered to plain FMAs, and the
    reverse state pass at K = 200 then spent over 100 s in LLVM (Triton 3.6, H100)."""
    gen = generator(seed ^ 0xD1)
    lengths = uneven_lengths(2, gen, low=1, high=100)
    cu = cu_seqlens_of(lengths)
    check_end_to_end(1, int(cu[-1]), 1, 200, 80, cu, cu.tolist(), torch.float16, device,
                     seed, TOLERANCE[torch.float16])


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 256])
def test_end_to_end_bf16_gpu(D, device, seed):
    check_end_to_end(2, 1000, 2, D, D, None, None, torch.bfloat16, device, seed,
                     TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 256])
def test_end_to_end_bf16_varlen_gpu(D, device, seed):
    gen = generator(seed ^ 0x5EED)
    lengths = uneven_lengths(3, gen, low=200, high=700)
    cu = cu_seqlens_of(lengths)
    check_end_to_end(1, int(cu[-1]), 2, D, D, cu, cu.tolist(), torch.bfloat16, device, seed,
                     TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("D, split", [(128, False), (256, False), (128, True)],
                         ids=["128", "256", "128-split"])
def test_every_tuning_config_gpu(D, split, device, seed, monkeypatch, tmp_path):
    """Each config of each stage's tuning space compiles on this GPU/Triton and gives the
    loop's gradients (bf16, varlen): a config the space offers must never be wrong. With
    ``split`` the reverse pass runs in one-chunk segments (its transition and split
    variants take each config)."""
    monkeypatch.setenv("FLA_CACHE_DIR", str(tmp_path))   # no tuned config from disk
    monkeypatch.delenv("FLA_TUNE", raising=False)
    gen = generator(seed ^ 0xC0F)
    cu = cu_seqlens_of(uneven_lengths(2, gen, low=30, high=200))
    offsets = cu.tolist()
    inputs, seqs, NT, _, ref = end_to_end_problem(1, offsets[-1], 2, D, D, offsets,
                                                  torch.bfloat16, seed, device)
    failures = []
    # Split, only the reverse pass has new variants.
    for module, name in [STAGE_KERNELS[1]] if split else STAGE_KERNELS:
        original = getattr(module, name)
        for config in original.space({"K": D, "V": D}):
            forced = TunedKernel(original.kernel, key=original.key,
                                 default=lambda args, c=config: c, name=f"sweep.{name}")
            monkeypatch.setattr(module, name, forced)
            try:
                grads, _ = chunked_backward(*inputs, cu, seqs, NT, device,
                                            segment_chunks=1 if split else 0)
                errors = {n: rel_error(out, ref[n]) for n, out in zip(GRAD_NAMES, grads)}
                bad = {n: e for n, e in errors.items() if not e <= TOLERANCE[torch.bfloat16]}
                if bad:
                    failures.append(f"{name} {config}: {bad}")
            except Exception as error:  # noqa: BLE001 - report every failing config
                failures.append(f"{name} {config}: {type(error).__name__}: {str(error)[:300]}")
        monkeypatch.setattr(module, name, original)
    assert not failures, "\n".join(failures)
