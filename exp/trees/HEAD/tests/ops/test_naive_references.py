"""The float64 reference loops (``naive.py`` of every family) against hand computations
and against each other.

Each family is first checked against an independent closed form (parallel/attention form
or explicit matrices), so a wrong loop cannot pass by agreeing with another wrong loop;
then the reductions between families (ALGORITHMS.md), varlen, state continuation, grouped
heads, qk-normalisation and gradient flow. Both sides are float64: tolerance 1e-10.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fla.ops.delta_rule import naive_recurrent_delta_rule
from fla.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
from fla.ops.generalized_delta_rule import naive_recurrent_dplr_delta_rule
from fla.ops.gla import naive_recurrent_gla
from fla.ops.mamba2 import naive_ssd, ssd_as_simple_gla
from fla.ops.retention import naive_recurrent_retention, retention_log_decay
from fla.ops.rwkv6 import naive_recurrent_rwkv6
from fla.ops.rwkv7 import naive_recurrent_rwkv7
from fla.ops.simple_gla import naive_recurrent_simple_gla
from tests.helpers import (
    assert_rel_close,
    cu_seqlens_of,
    generator,
    l2_normalized,
    log_gate,
    randn,
    uneven_lengths,
    unit_interval,
)

TOL = 1e-10
F64 = torch.float64


def _qkv64(gen, B, T, H, K, V):
    return (randn((B, T, H, K), gen, F64), randn((B, T, H, K), gen, F64),
            randn((B, T, H, V), gen, F64))


def _causal(T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()


def _pairwise_decay(G: torch.Tensor) -> torch.Tensor:
    """``[B, T, H]`` cumulative log decay -> ``[B, H, T, S]`` exp(G_t − G_s), 0 for s > t."""
    diff = G.transpose(1, 2)[..., :, None] - G.transpose(1, 2)[..., None, :]
    return torch.where(_causal(G.shape[1]), diff, torch.full_like(diff, -math.inf)).exp()


# ---------------------------------------------------------------------------------------
# 1. Every family against an independent hand computation
# ---------------------------------------------------------------------------------------

def test_gated_delta_rule_matches_matrix_form(seed):
    """S_t = exp(g_t)(I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ, per (batch, value head),
    with grouped value heads (HV = 2H)."""
    gen = generator(seed)
    B, T, H, HV, K, V = 2, 5, 2, 4, 3, 4
    q, k = randn((B, T, H, K), gen, F64), l2_normalized((B, T, H, K), gen, F64)
    v = randn((B, T, HV, V), gen, F64)
    g, beta = log_gate((B, T, HV), gen, dtype=F64), unit_interval((B, T, HV), gen, F64)
    h0 = randn((B, HV, K, V), gen, F64)
    scale = 0.7
    o, ht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                             output_final_state=True)
    o_ref, ht_ref = torch.zeros_like(o), torch.zeros_like(ht)
    eye = torch.eye(K, dtype=F64)
    for b in range(B):
        for j in range(HV):
            h = j // (HV // H)
            S = h0[b, j]
            for t in range(T):
                kt, bt = k[b, t, h], beta[b, t, j]
                S = g[b, t, j].exp() * (eye - bt * torch.outer(kt, kt)) @ S \
                    + bt * torch.outer(kt, v[b, t, j])
                o_ref[b, t, j] = scale * S.T @ q[b, t, h]
            ht_ref[b, j] = S
    assert_rel_close("o", o, o_ref, TOL)
    assert_rel_close("final_state", ht, ht_ref, TOL)


def test_delta_rule_two_steps_closed_form(seed):
    """From a zero state: o_1 = scale·β_1(q_1·k_1)v_1, S_1 = β_1 k_1 v_1ᵀ and
    S_2 = S_1 + β_2 k_2 (v_2 − S_1ᵀk_2)ᵀ."""
    gen = generator(seed)
    B, H, K, V = 2, 3, 4, 5
    q, k, v = _qkv64(gen, B, 2, H, K, V)
    beta = unit_interval((B, 2, H), gen, F64)
    o, ht = naive_recurrent_delta_rule(q, k, v, beta, output_final_state=True)
    scale = K ** -0.5
    S1 = beta[:, 0, :, None, None] * k[:, 0, :, :, None] * v[:, 0, :, None, :]
    o1 = scale * beta[:, 0, :, None] * (q[:, 0] * k[:, 0]).sum(-1, keepdim=True) * v[:, 0]
    err = v[:, 1] - (S1 * k[:, 1, :, :, None]).sum(-2)
    S2 = S1 + beta[:, 1, :, None, None] * k[:, 1, :, :, None] * err[:, :, None, :]
    o2 = scale * (S2 * q[:, 1, :, :, None]).sum(-2)
    assert_rel_close("o_1", o[:, 0], o1, TOL)
    assert_rel_close("o_2", o[:, 1], o2, TOL)
    assert_rel_close("final_state", ht, S2, TOL)


def test_simple_gla_matches_attention_form(seed):
    """o_t = scale·[Σ_{s≤t} exp(G_t − G_s)(q_t·k_s) v_s + exp(G_t) S₀ᵀq_t],
    G = cumsum(g + γ)."""
    gen = generator(seed)
    B, T, H, K, V = 2, 7, 3, 4, 5
    q, k, v = _qkv64(gen, B, T, H, K, V)
    g, gamma = log_gate((B, T, H), gen, dtype=F64), log_gate((H,), gen, dtype=F64)
    h0 = randn((B, H, K, V), gen, F64)
    o, ht = naive_recurrent_simple_gla(q, k, v, g, gamma, initial_state=h0, output_final_state=True)
    G = (g + gamma).cumsum(1)
    scale = K ** -0.5
    attn = torch.einsum('bthk,bshk->bhts', q, k) * _pairwise_decay(G)
    o_ref = scale * (torch.einsum('bhts,bshv->bthv', attn, v)
                     + G.exp()[..., None] * torch.einsum('bhkv,bthk->bthv', h0, q))
    wT = (G[:, -1:] - G).exp()                                   # [B, T, H]
    ht_ref = G[:, -1].exp()[..., None, None] * h0 + torch.einsum('bth,bthk,bthv->bhkv', wT, k, v)
    assert_rel_close("o", o, o_ref, TOL)
    assert_rel_close("final_state", ht, ht_ref, TOL)


def test_retention_matches_powers_of_gamma(seed):
    """o_t = scale·[Σ_{s≤t} γ_h^(t−s)(q_t·k_s) v_s + γ_h^(t+1) S₀ᵀq_t],
    γ_h = 1 − 2^(−5−h)."""
    gen = generator(seed)
    B, T, H, K, V = 2, 6, 3, 4, 3
    q, k, v = _qkv64(gen, B, T, H, K, V)
    h0 = randn((B, H, K, V), gen, F64)
    o, ht = naive_recurrent_retention(q, k, v, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = torch.zeros_like(o), torch.zeros_like(ht)
    scale = K ** -0.5
    for h in range(H):
        gamma = 1.0 - 2.0 ** (-5 - h)
        for t in range(T):
            S = gamma ** (t + 1) * h0[:, h]
            for s in range(t + 1):
                S = S + gamma ** (t - s) * k[:, s, h, :, None] * v[:, s, h, None, :]
            o_ref[:, t, h] = scale * (S * q[:, t, h, :, None]).sum(-2)
        ht_ref[:, h] = S
    assert_rel_close("o", o, o_ref, TOL)
    assert_rel_close("final_state", ht, ht_ref, TOL)
    assert_rel_close("log decay", retention_log_decay(H).exp(),
                     torch.tensor([1 - 2.0 ** (-5 - h) for h in range(H)], dtype=F64), 1e-15)


def _gla_state_from_sum(k, v, Gk, Gv, h0, t):
    """S_t = diag(e^{Gk_t}) S₀ diag(e^{Gv_t})
            + Σ_{s≤t} (e^{Gk_t − Gk_s}⊙k_s) ⊗ (e^{Gv_t − Gv_s}⊙v_s);
    Gk/Gv with a leading zero row so that index t+1 is 'after token t'."""
    S = Gk[:, t + 1, :, :, None].exp() * h0 * Gv[:, t + 1, :, None, :].exp()
    for s in range(t + 1):
        ks = (Gk[:, t + 1] - Gk[:, s + 1]).exp() * k[:, s]
        vs = (Gv[:, t + 1] - Gv[:, s + 1]).exp() * v[:, s]
        S = S + ks[..., :, None] * vs[..., None, :]
    return S


def _cumsum0(g):
    """cumsum over time with a zero prepended: [B, T+1, ...]."""
    return torch.cat([torch.zeros_like(g[:, :1]), g.cumsum(1)], dim=1)


def test_gla_matches_sum_form(seed):
    gen = generator(seed)
    B, T, H, K, V = 2, 6, 2, 4, 3
    q, k, v = _qkv64(gen, B, T, H, K, V)
    gk, gv = log_gate((B, T, H, K), gen, dtype=F64), log_gate((B, T, H, V), gen, dtype=F64)
    h0 = randn((B, H, K, V), gen, F64)
    o, ht = naive_recurrent_gla(q, k, v, gk, gv, scale=0.3, initial_state=h0,
                                output_final_state=True)
    Gk, Gv = _cumsum0(gk), _cumsum0(gv)
    o_ref = torch.stack([0.3 * (_gla_state_from_sum(k, v, Gk, Gv, h0, t)
                                * q[:, t, :, :, None]).sum(-2) for t in range(T)], dim=1)
    assert_rel_close("o", o, o_ref, TOL)
    assert_rel_close("final_state", ht, _gla_state_from_sum(k, v, Gk, Gv, h0, T - 1), TOL)


def test_rwkv6_matches_sum_form(seed):
    """o_t = scale·(S_{t-1}ᵀ r_t + (Σ r_t u k_t) v_t), S_{t-1} written as a sum."""
    gen = generator(seed)
    B, T, H, K, V = 2, 6, 2, 4, 3
    r, k, v = _qkv64(gen, B, T, H, K, V)
    w, u = log_gate((B, T, H, K), gen, dtype=F64), randn((H, K), gen, F64)
    h0 = randn((B, H, K, V), gen, F64)
    o, ht = naive_recurrent_rwkv6(r, k, v, w, u, initial_state=h0, output_final_state=True)
    W, Gv = _cumsum0(w), torch.zeros(B, T + 1, H, V, dtype=F64)
    scale = K ** -0.5
    outs = []
    for t in range(T):
        S_prev = h0 if t == 0 else _gla_state_from_sum(k, v, W, Gv, h0, t - 1)
        bonus = (r[:, t] * u * k[:, t]).sum(-1, keepdim=True) * v[:, t]
        outs.append(scale * ((S_prev * r[:, t, :, :, None]).sum(-2) + bonus))
    assert_rel_close("o", o, torch.stack(outs, 1), TOL)
    assert_rel_close("final_state", ht, _gla_state_from_sum(k, v, W, Gv, h0, T - 1), TOL)


def _dplr_inputs(gen, B, T, H, K, V, dtype=F64, requires_grad=False):
    """RWKV7-like inputs: a = −κ̂, b = κ̂ ⊙ gate (κ̂ unit norm), gk = w ∈ (−e^{−0.5}, 0)."""
    kappa = l2_normalized((B, T, H, K), gen, F64)
    gate = unit_interval((B, T, H, K), gen, F64)
    w = -math.exp(-0.5) * unit_interval((B, T, H, K), gen, F64)
    x = dict(q=randn((B, T, H, K), gen, F64), k=randn((B, T, H, K), gen, F64),
             v=randn((B, T, H, V), gen, F64), a=-kappa, b=kappa * gate, gk=w)
    return {n: t.to(dtype).requires_grad_(requires_grad) for n, t in x.items()}


def test_dplr_and_rwkv7_match_matrix_form(seed):
    """S_t = (diag(e^{gk_t}) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ with explicit K×K matrices."""
    gen = generator(seed)
    B, T, H, K, V = 2, 5, 2, 4, 3
    x = _dplr_inputs(gen, B, T, H, K, V)
    h0 = randn((B, H, K, V), gen, F64)
    o, ht = naive_recurrent_dplr_delta_rule(**x, initial_state=h0, output_final_state=True)
    o7, ht7 = naive_recurrent_rwkv7(x["q"], x["gk"], x["k"], x["v"], x["a"], x["b"],
                                    initial_state=h0, output_final_state=True)
    o_ref, o7_ref, ht_ref = torch.zeros_like(o), torch.zeros_like(o), torch.zeros_like(ht)
    for b in range(B):
        for h in range(H):
            S = h0[b, h]
            for t in range(T):
                M = (torch.diag(x["gk"][b, t, h].exp())
                     + torch.outer(x["b"][b, t, h], x["a"][b, t, h]))
                S = M @ S + torch.outer(x["k"][b, t, h], x["v"][b, t, h])
                o_ref[b, t, h] = K ** -0.5 * S.T @ x["q"][b, t, h]
                o7_ref[b, t, h] = S.T @ x["q"][b, t, h]       # RWKV7: scale 1.0
            ht_ref[b, h] = S
    assert_rel_close("dplr o", o, o_ref, TOL)
    assert_rel_close("dplr final_state", ht, ht_ref, TOL)
    assert_rel_close("rwkv7 o", o7, o7_ref, TOL)
    assert_rel_close("rwkv7 final_state", ht7, ht_ref, TOL)


def _ssd_inputs(gen, B, T, H, G, P, N, dtype=F64, requires_grad=False, D_per_channel=False):
    x = dict(x=randn((B, T, H, P), gen, F64), dt=randn((B, T, H), gen, F64),
             A=log_gate((H,), gen, low=-1.5, high=-0.2, dtype=F64),
             B=randn((B, T, G, N), gen, F64), C=randn((B, T, G, N), gen, F64),
             D=randn((H, P) if D_per_channel else (H,), gen, F64),
             z=randn((B, T, H, P), gen, F64), dt_bias=randn((H,), gen, F64, scale=0.5))
    return {n: t.to(dtype).requires_grad_(requires_grad) for n, t in x.items()}


@pytest.mark.parametrize("D_per_channel", [False, True])
def test_ssd_matches_quadratic_form(seed, D_per_channel):
    """y_t = Σ_{s≤t} exp(Σ_{s<r≤t} dt_r A)·dt_s (C_t·B_s) x_s + exp(Σ_{r≤t} dt_r A) h₀C_t
          + D x_t, gated by silu(z); dt = clamp(softplus(dt + dt_bias)).
    (Dao & Gu 2024: the SSD matrix.)"""
    gen = generator(seed)
    B, T, H, G, P, N = 2, 7, 4, 2, 3, 5
    x = _ssd_inputs(gen, B, T, H, G, P, N, D_per_channel=D_per_channel)
    h0 = randn((B, H, P, N), gen, F64)
    limit = (0.2, 1.5)
    y, ht = naive_ssd(**x, dt_softplus=True, dt_limit=limit, initial_states=h0,
                      return_final_states=True)
    dt = torch.log1p(torch.exp(x["dt"] + x["dt_bias"])).clamp(*limit)
    Bh, Ch = x["B"].repeat_interleave(H // G, 2), x["C"].repeat_interleave(H // G, 2)
    cum = (dt * x["A"]).cumsum(1)                                          # [B, T, H]
    M = (torch.einsum('bthn,bshn->bhts', Ch, Bh) * _pairwise_decay(cum)
         * dt.transpose(1, 2)[:, :, None, :])
    D = x["D"][:, None] if x["D"].dim() == 1 else x["D"]
    y_ref = (torch.einsum('bhts,bshp->bthp', M, x["x"])
             + cum.exp()[..., None] * torch.einsum('bhpn,bthn->bthp', h0, Ch) + D * x["x"])
    y_ref = y_ref * x["z"] * torch.sigmoid(x["z"])
    wT = (cum[:, -1:] - cum).exp() * dt
    ht_ref = (cum[:, -1].exp()[..., None, None] * h0
              + torch.einsum('bth,bthp,bthn->bhpn', wT, x["x"], Bh))
    assert_rel_close("y", y, y_ref, TOL)
    assert_rel_close("final_states", ht, ht_ref, TOL)


# ---------------------------------------------------------------------------------------
# 2. Reductions between families
# ---------------------------------------------------------------------------------------

def test_gated_delta_rule_without_gate_is_delta_rule(seed):
    gen = generator(seed)
    B, T, H, K, V = 2, 37, 3, 8, 6
    q, v = randn((B, T, H, K), gen, F64), randn((B, T, H, V), gen, F64)
    k = l2_normalized((B, T, H, K), gen, F64)
    beta, h0 = unit_interval((B, T, H), gen, F64), randn((B, H, K, V), gen, F64)
    o, ht = naive_recurrent_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)
    for g in (torch.zeros(B, T, H, dtype=F64), None):
        o_g, ht_g = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                     output_final_state=True)
        assert_rel_close("o", o_g, o, TOL)
        assert_rel_close("final_state", ht_g, ht, TOL)
    # beta=None means beta = 1
    o1, _ = naive_recurrent_delta_rule(q, k, v, initial_state=h0)
    o2, _ = naive_recurrent_delta_rule(q, k, v, torch.ones(B, T, H, dtype=F64), initial_state=h0)
    assert_rel_close("beta=None", o1, o2, TOL)


def test_gla_with_scalar_gate_is_simple_gla(seed):
    gen = generator(seed)
    B, T, H, K, V = 2, 45, 3, 8, 6
    q, k, v = _qkv64(gen, B, T, H, K, V)
    g, h0 = log_gate((B, T, H), gen, dtype=F64), randn((B, H, K, V), gen, F64)
    o, ht = naive_recurrent_gla(q, k, v, gk=g[..., None].expand(B, T, H, K), initial_state=h0,
                                output_final_state=True)
    o_s, ht_s = naive_recurrent_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    assert_rel_close("o", o, o_s, TOL)
    assert_rel_close("final_state", ht, ht_s, TOL)
    # a scalar gate on the V side decays the state the same way
    o_v, _ = naive_recurrent_gla(q, k, v, gv=g[..., None].expand(B, T, H, V), initial_state=h0)
    assert_rel_close("o (gv)", o_v, o_s, TOL)


def test_retention_is_simple_gla_with_g_gamma(seed):
    gen = generator(seed)
    B, T, H, K, V = 2, 53, 4, 8, 6
    q, k, v = _qkv64(gen, B, T, H, K, V)
    h0 = randn((B, H, K, V), gen, F64)
    o, ht = naive_recurrent_retention(q, k, v, scale=0.5, initial_state=h0, output_final_state=True)
    o_s, ht_s = naive_recurrent_simple_gla(q, k, v, g_gamma=retention_log_decay(H), scale=0.5,
                                           initial_state=h0, output_final_state=True)
    assert_rel_close("o", o, o_s, TOL)
    assert_rel_close("final_state", ht, ht_s, TOL)


def test_simple_gla_g_gamma_is_broadcast_g(seed):
    gen = generator(seed)
    B, T, H, K, V = 2, 41, 3, 8, 6
    q, k, v = _qkv64(gen, B, T, H, K, V)
    g, gamma = log_gate((B, T, H), gen, dtype=F64), log_gate((H,), gen, dtype=F64)
    h0 = randn((B, H, K, V), gen, F64)
    o, ht = naive_recurrent_simple_gla(q, k, v, g_gamma=gamma, initial_state=h0,
                                       output_final_state=True)
    o_b, ht_b = naive_recurrent_simple_gla(q, k, v, g=gamma.expand(B, T, H), initial_state=h0,
                                           output_final_state=True)
    assert_rel_close("o", o, o_b, TOL)
    assert_rel_close("final_state", ht, ht_b, TOL)
    o_both, _ = naive_recurrent_simple_gla(q, k, v, g=g, g_gamma=gamma, initial_state=h0)
    o_sum, _ = naive_recurrent_simple_gla(q, k, v, g=g + gamma, initial_state=h0)
    assert_rel_close("o (g + g_gamma)", o_both, o_sum, TOL)


@pytest.mark.parametrize("gated", [True, False])
def test_dplr_reduces_to_gated_delta_rule(seed, gated):
    """a = −β·exp(g)·k, b = k, gk = g (broadcast over K), v ← β·v: the gated delta rule."""
    gen = generator(seed)
    B, T, H, K, V = 2, 39, 3, 8, 6
    q, v = randn((B, T, H, K), gen, F64), randn((B, T, H, V), gen, F64)
    k = l2_normalized((B, T, H, K), gen, F64)
    beta, h0 = unit_interval((B, T, H), gen, F64), randn((B, H, K, V), gen, F64)
    g = log_gate((B, T, H), gen, dtype=F64) if gated else torch.zeros(B, T, H, dtype=F64)
    o, ht = naive_recurrent_dplr_delta_rule(
        q, k, beta[..., None] * v, a=-(beta * g.exp())[..., None] * k, b=k,
        gk=g[..., None].expand(B, T, H, K), initial_state=h0, output_final_state=True)
    if gated:
        o_ref, ht_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                         output_final_state=True)
    else:
        o_ref, ht_ref = naive_recurrent_delta_rule(q, k, v, beta, initial_state=h0,
                                                   output_final_state=True)
    assert_rel_close("o", o, o_ref, TOL)
    assert_rel_close("final_state", ht, ht_ref, TOL)


def test_rwkv7_is_dplr_with_unit_scale(seed):
    gen = generator(seed)
    B, T, H, K, V = 2, 43, 3, 8, 6
    x = _dplr_inputs(gen, B, T, H, K, V)
    h0 = randn((B, H, K, V), gen, F64)
    o, ht = naive_recurrent_rwkv7(r=x["q"], w=x["gk"], k=x["k"], v=x["v"], a=x["a"], b=x["b"],
                                  initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_recurrent_dplr_delta_rule(**x, scale=1.0, initial_state=h0,
                                                    output_final_state=True)
    assert_rel_close("o", o, o_ref, TOL)
    assert_rel_close("final_state", ht, ht_ref, TOL)


def test_rwkv6_with_constant_decay_is_gla(seed):
    """w_t = w0 and u = exp(−w0): RWKV6 is GLA with q = r ⊙ exp(−w0), gk = w."""
    gen = generator(seed)
    B, T, H, K, V = 2, 47, 3, 8, 6
    r, k, v = _qkv64(gen, B, T, H, K, V)
    w0, h0 = log_gate((H, K), gen, dtype=F64), randn((B, H, K, V), gen, F64)
    w = w0.expand(B, T, H, K)
    o, ht = naive_recurrent_rwkv6(r, k, v, w, u=(-w0).exp(), initial_state=h0,
                                  output_final_state=True)
    o_ref, ht_ref = naive_recurrent_gla(r * (-w0).exp(), k, v, gk=w, initial_state=h0,
                                        output_final_state=True)
    assert_rel_close("o", o, o_ref, TOL)
    assert_rel_close("final_state", ht, ht_ref, TOL)


@pytest.mark.parametrize("varlen", [False, True])
def test_ssd_loop_equals_simple_gla_mapping(seed, varlen):
    gen = generator(seed)
    H, G, P, N = 4, 2, 5, 6
    lengths = uneven_lengths(3, gen, high=90) if varlen else [61]
    B, T = (1, sum(lengths)) if varlen else (2, lengths[0])
    cu = cu_seqlens_of(lengths) if varlen else None
    for D_per_channel in (False, True):
        x = _ssd_inputs(gen, B, T, H, G, P, N, D_per_channel=D_per_channel)
        h0 = randn((len(lengths) if varlen else B, H, P, N), gen, F64)
        kw = dict(dt_softplus=True, initial_states=h0, cu_seqlens=cu, return_final_states=True)
        y, ht = naive_ssd(**x, **kw)
        y_ref, ht_ref = ssd_as_simple_gla(**x, **kw)
        assert_rel_close("y", y, y_ref, TOL)
        assert_rel_close("final_states", ht, ht_ref, TOL)
    # without optional inputs, without softplus, with a finite dt_limit
    x = _ssd_inputs(gen, B, T, H, G, P, N)
    args = (x["x"], x["dt"].abs(), x["A"], x["B"], x["C"])
    y, y_ref = naive_ssd(*args, dt_limit=(0.1, 0.8), cu_seqlens=cu), ssd_as_simple_gla(
        *args, dt_limit=(0.1, 0.8), cu_seqlens=cu)
    assert_rel_close("y (bare)", y, y_ref, TOL)


# ---------------------------------------------------------------------------------------
# 3. Varlen and state continuation, for every family
# ---------------------------------------------------------------------------------------
# Each family: make(gen, B, T, dtype, requires_grad) -> (time-major inputs, static inputs,
# state shape) and run(inputs, initial_state, cu_seqlens) -> (o, final_state).

Hq, K_, V_ = 2, 5, 4


def _gdn_make(gen, B, T, dtype=F64, rg=False):
    HV = 2 * Hq
    x = dict(q=randn((B, T, Hq, K_), gen, dtype), k=l2_normalized((B, T, Hq, K_), gen, dtype),
             v=randn((B, T, HV, V_), gen, dtype), g=log_gate((B, T, HV), gen, dtype=dtype),
             beta=unit_interval((B, T, HV), gen, dtype))
    return {n: t.requires_grad_(rg) for n, t in x.items()}, {}, (HV, K_, V_)


def _delta_make(gen, B, T, dtype=F64, rg=False):
    x = dict(q=randn((B, T, Hq, K_), gen, dtype), k=randn((B, T, Hq, K_), gen, dtype),
             v=randn((B, T, Hq, V_), gen, dtype), beta=unit_interval((B, T, Hq), gen, dtype))
    return {n: t.requires_grad_(rg) for n, t in x.items()}, {}, (Hq, K_, V_)


def _qkv(gen, B, T, dtype, rg, H=Hq):
    return {n: randn((B, T, H, V_ if n == "v" else K_), gen, dtype, requires_grad=rg)
            for n in ("q", "k", "v")}


def _simple_gla_make(gen, B, T, dtype=F64, rg=False):
    x = _qkv(gen, B, T, dtype, rg)
    x["g"] = log_gate((B, T, Hq), gen, dtype=dtype, requires_grad=rg)
    return x, {"g_gamma": log_gate((Hq,), gen, dtype=dtype, requires_grad=rg)}, (Hq, K_, V_)


def _retention_make(gen, B, T, dtype=F64, rg=False):
    return _qkv(gen, B, T, dtype, rg), {}, (Hq, K_, V_)


def _gla_make(gen, B, T, dtype=F64, rg=False):
    x = _qkv(gen, B, T, dtype, rg)
    x["gk"] = log_gate((B, T, Hq, K_), gen, dtype=dtype, requires_grad=rg)
    x["gv"] = log_gate((B, T, Hq, V_), gen, dtype=dtype, requires_grad=rg)
    return x, {}, (Hq, K_, V_)


def _rwkv6_make(gen, B, T, dtype=F64, rg=False):
    x = _qkv(gen, B, T, dtype, rg)
    x = dict(r=x["q"], k=x["k"], v=x["v"],
             w=log_gate((B, T, Hq, K_), gen, dtype=dtype, requires_grad=rg))
    return x, {"u": randn((Hq, K_), gen, dtype, requires_grad=rg)}, (Hq, K_, V_)


def _dplr_make(gen, B, T, dtype=F64, rg=False):
    return _dplr_inputs(gen, B, T, Hq, K_, V_, dtype, rg), {}, (Hq, K_, V_)


def _ssd_make(gen, B, T, dtype=F64, rg=False):
    x = _ssd_inputs(gen, B, T, 4, 2, V_, K_, dtype, rg)
    static = {n: x.pop(n) for n in ("A", "D", "dt_bias")}
    return x, static, (4, V_, K_)


def _ssd_run(fn):
    def run(x, h0, cu):
        return fn(**x, dt_softplus=True, dt_limit=(0.01, 5.0), initial_states=h0, cu_seqlens=cu,
                  return_final_states=True)
    return run


def _std_run(fn, **extra):
    def run(x, h0, cu):
        return fn(**x, **extra, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    return run


def _rwkv7_run(x, h0, cu):
    return naive_recurrent_rwkv7(x["q"], x["gk"], x["k"], x["v"], x["a"], x["b"],
                                 initial_state=h0, output_final_state=True, cu_seqlens=cu)


FAMILIES = {
    "gated_delta_rule": (_gdn_make, _std_run(naive_recurrent_gated_delta_rule)),
    "gated_delta_rule_l2norm": (_gdn_make, _std_run(naive_recurrent_gated_delta_rule,
                                                    use_qk_l2norm=True)),
    "delta_rule": (_delta_make, _std_run(naive_recurrent_delta_rule)),
    "simple_gla": (_simple_gla_make, _std_run(naive_recurrent_simple_gla)),
    "retention": (_retention_make, _std_run(naive_recurrent_retention)),
    "gla": (_gla_make, _std_run(naive_recurrent_gla)),
    "rwkv6": (_rwkv6_make, _std_run(naive_recurrent_rwkv6)),
    "dplr_delta_rule": (_dplr_make, _std_run(naive_recurrent_dplr_delta_rule)),
    "rwkv7": (_dplr_make, _rwkv7_run),
    "ssd": (_ssd_make, _ssd_run(naive_ssd)),
    "ssd_as_simple_gla": (_ssd_make, _ssd_run(ssd_as_simple_gla)),
}


def _run(name, time_inputs, static, h0, cu=None):
    return FAMILIES[name][1]({**time_inputs, **static}, h0, cu)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_varlen_equals_separate_sequences(seed, name):
    gen = generator(seed)
    make = FAMILIES[name][0]
    lengths = uneven_lengths(3, gen, high=100)
    x, static, state_shape = make(gen, 1, sum(lengths))
    h0 = randn((len(lengths), *state_shape), gen, F64)
    o, ht = _run(name, x, static, h0, cu_seqlens_of(lengths))
    assert o.dtype == F64 and ht.dtype == F64 and ht.shape == h0.shape
    bos = 0
    for n, L in enumerate(lengths):
        part = {key: t[:, bos:bos + L] for key, t in x.items()}
        o_n, ht_n = _run(name, part, static, h0[n:n + 1])
        assert_rel_close(f"o of sequence {n}", o[:, bos:bos + L], o_n, TOL)
        assert_rel_close(f"final_state of sequence {n}", ht[n:n + 1], ht_n, TOL)
        bos += L


@pytest.mark.parametrize("name", list(FAMILIES))
def test_initial_state_continuation(seed, name):
    gen = generator(seed)
    make = FAMILIES[name][0]
    T1, T2 = uneven_lengths(2, gen, high=80)
    x, static, state_shape = make(gen, 2, T1 + T2)
    h0 = randn((2, *state_shape), gen, F64)
    o, ht = _run(name, x, static, h0)
    o1, ht1 = _run(name, {key: t[:, :T1] for key, t in x.items()}, static, h0)
    o2, ht2 = _run(name, {key: t[:, T1:] for key, t in x.items()}, static, ht1)
    assert_rel_close("o", torch.cat([o1, o2], dim=1), o, TOL)
    assert_rel_close("final_state", ht2, ht, TOL)


# ---------------------------------------------------------------------------------------
# 4, 5. Grouped value heads and qk normalisation (gated delta rule)
# ---------------------------------------------------------------------------------------

def test_grouped_value_heads_equal_repeated_qk(seed):
    gen = generator(seed)
    B, T, H, HV, K, V = 2, 33, 2, 4, 6, 5
    q, k = randn((B, T, H, K), gen, F64), l2_normalized((B, T, H, K), gen, F64)
    v, g = randn((B, T, HV, V), gen, F64), log_gate((B, T, HV), gen, dtype=F64)
    beta, h0 = unit_interval((B, T, HV), gen, F64), randn((B, HV, K, V), gen, F64)
    o, ht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                             output_final_state=True)
    o_ref, ht_ref = naive_recurrent_gated_delta_rule(
        q.repeat_interleave(HV // H, 2), k.repeat_interleave(HV // H, 2), v, g, beta,
        initial_state=h0, output_final_state=True)
    assert_rel_close("o", o, o_ref, TOL)
    assert_rel_close("final_state", ht, ht_ref, TOL)


@pytest.mark.parametrize("fn", [naive_recurrent_gated_delta_rule, naive_recurrent_delta_rule])
def test_qk_l2norm_equals_normalising_first(seed, fn):
    gen = generator(seed)
    B, T, H, K, V = 2, 29, 3, 6, 5
    q, k, v = _qkv64(gen, B, T, H, K, V)
    beta, h0 = unit_interval((B, T, H), gen, F64), randn((B, H, K, V), gen, F64)
    kw = dict(beta=beta, initial_state=h0, output_final_state=True)
    o, ht = fn(q, k, v, use_qk_l2norm=True, **kw)
    o_ref, ht_ref = fn(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, **kw)
    assert_rel_close("o", o, o_ref, TOL)
    assert_rel_close("final_state", ht, ht_ref, TOL)


# ---------------------------------------------------------------------------------------
# 6. Gradients flow; dtype and argument conventions
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_gradients_are_finite(seed, name, varlen):
    gen = generator(seed)
    make = FAMILIES[name][0]
    lengths = uneven_lengths(2, gen, high=20) if varlen else [13, 13]
    B, T = (1, sum(lengths)) if varlen else (2, lengths[0])
    x, static, state_shape = make(gen, B, T, torch.float32, True)
    h0 = randn((2, *state_shape), gen, torch.float32, requires_grad=True)
    o, ht = _run(name, x, static, h0, cu_seqlens_of(lengths) if varlen else None)
    loss = (o * randn(o.shape, gen, F64)).sum() + (ht * randn(ht.shape, gen, F64)).sum()
    loss.backward()
    for key, t in {**x, **static, "initial_state": h0}.items():
        assert t.grad is not None, f"{key}: no gradient"
        assert t.grad.dtype == torch.float32
        assert torch.isfinite(t.grad).all(), f"{key}: non-finite gradient"
        assert t.grad.abs().sum() > 0, f"{key}: zero gradient"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gradients_match_finite_differences(seed, name):
    """Autograd through the loop is the true derivative (nothing detached, no in-place)."""
    gen = generator(seed)
    make = FAMILIES[name][0]
    x, static, state_shape = make(gen, 1, 5, F64, True)
    h0 = randn((2, *state_shape), gen, F64, requires_grad=True)
    names = [*x, *static]
    cu = cu_seqlens_of([2, 3])

    def f(*tensors):
        inputs = dict(zip(names, tensors[:-1]))
        return FAMILIES[name][1](inputs, tensors[-1], cu)

    assert torch.autograd.gradcheck(f, (*x.values(), *static.values(), h0))


def test_float64_outputs_and_optional_final_state(seed):
    gen = generator(seed)
    x, _, _ = _delta_make(gen, 2, 11, torch.float32)
    o, ht = naive_recurrent_delta_rule(**x)
    assert o.dtype == F64 and ht is None
    o, ht = naive_recurrent_delta_rule(**x, output_final_state=True)
    assert ht.dtype == F64 and ht.shape == (2, Hq, K_, V_)
    x, static, _ = _ssd_make(gen, 2, 11)
    y = naive_ssd(**x, **static)
    assert isinstance(y, torch.Tensor) and y.dtype == F64


def test_varlen_needs_a_single_row(seed):
    gen = generator(seed)
    x, _, _ = _delta_make(gen, 2, 10)
    with pytest.raises(ValueError, match="cu_seqlens"):
        naive_recurrent_delta_rule(**x, cu_seqlens=cu_seqlens_of([4, 6]))
