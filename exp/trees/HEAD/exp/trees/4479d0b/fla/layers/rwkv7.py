"""RWKV-7 "Goose" (Peng et al. 2025, "RWKV-7 Goose with Expressive Dynamic State
Evolution"): time mixing and channel mixing.

Time mixing. Token-shift lerps ``x_□ = x_t + (x_{t-1} − x_t) ⊙ μ_□`` for □ ∈ {r, w, k, v,
a, g}, then

    r, k, v  = W_r x_r, W_k x_k, W_v x_v
    w_t      = −e^{−0.5} σ(w₀ + tanh(x_w A_w) B_w)        (log decay ∈ (−e^{−0.5}, 0))
    a_t      = σ(a₀ + x_a A_a B_a)                          (in-context learning rate)
    v_t      ← v_t + (v¹_t − v_t) ⊙ σ(v₀ + x_v A_v B_v)    (value residual to the first layer's v¹)
    g_t      = σ(x_g A_g) B_g                               (output gate)
    κ̂_t      = normalize_head(k_t ⊙ ξ)                       (ξ = ``k_k``)
    k̃_t      = k_t ⊙ (1 + (a_t − 1) ⊙ α)                    (α = ``k_a``)
    S_t      = diag(e^{w_t}) S_{t-1} − (κ̂_t ⊙ a_t)(κ̂_tᵀ S_{t-1}) + k̃_t v_tᵀ     (S: K × V)
    o_t      = W_o (g_t ⊙ (GroupNorm_H(S_tᵀ r_t) + (Σ_i r_i ρ_i k̃_i) v_t))

(:func:`fla.ops.rwkv7.chunk_rwkv7` with ``a = −κ̂``, ``b = κ̂ ⊙ a_t``, scale 1; ρ =
``r_k`` per head). The first layer's values travel through the model's per-forward
``shared_state['v_first']`` (the first RWKV7 layer of a model writes them, the later
ones mix them in). Channel mixing: ``W_v relu(W_k x_k)²`` with ``x_k`` a token-shift lerp.

The token-shift state (the last token's input) lives in the cache's ``conv_state`` slot
(time mix) and ``ffn_state`` slot (channel mix) of the layer.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fla.layers.utils import (
    begin_forward,
    cache_entry,
    cached_state,
    channel_ramp,
    check_heads,
    check_mode,
    mask_tokens,
    token_mask,
    token_shift,
    update_cache,
)
from fla.modules import GroupNorm
from fla.ops.rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7

__all__ = ["RWKV7Attention", "RWKV7FeedForward"]

_DECAY_SCALE = math.exp(-0.5)  # w ∈ (−e^{−0.5}, 0): the largest decay per step is e^{−e^{−0.5}}


class _LoRA(nn.Module):
    """``act(x A) B`` (rank ``rank``); the bias λ of each LoRA is a separate parameter of
    the layer, so that the models' weight init (zero Linear biases) leaves it alone."""

    def __init__(self, d_in: int, rank: int, d_out: int, activation=None):
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"low-rank dim: expected a positive int, got {rank!r}")
        self.a = nn.Linear(d_in, rank, bias=False)
        self.b = nn.Linear(rank, d_out, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h if self.activation is None else self.activation(h))


class RWKV7Attention(nn.Module):
    """RWKV7 time mixing (see the module docstring).

    Args:
        hidden_size: model width d (the key width too).
        head_dim: K = V per head (64 in the paper); ``num_heads`` defaults to
            ``hidden_size // head_dim`` (give one of them).
        value_dim: width of v (default d).
        mode: ``'chunk'`` or ``'fused_recurrent'`` (single-token steps always recurrent).
        decay_low_rank_dim, a_low_rank_dim, v_low_rank_dim, gate_low_rank_dim: ranks of
            the LoRAs of w, a, the value residual and the gate.
        elementwise_affine, norm_eps: the per-head GroupNorm of the output.
        layer_idx: this layer's index in the cache; layer 0 has no value residual.

    ``forward`` as :class:`fla.layers.DeltaNet`, plus ``shared_state`` (a dict for one
    forward of the model: ``'v_first'`` is read, or written when absent).
    """

    def __init__(self, hidden_size: int = 1024, head_dim: int | None = 64,
                 num_heads: int | None = None, value_dim: int | None = None,
                 mode: str = "chunk", decay_low_rank_dim: int = 64, a_low_rank_dim: int = 64,
                 v_low_rank_dim: int = 16, gate_low_rank_dim: int = 128,
                 elementwise_affine: bool = True, norm_eps: float = 1e-5,
                 layer_idx: int | None = None, **kwargs):
        super().__init__()
        if num_heads is None:
            if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1 \
                    or hidden_size % head_dim:
                raise ValueError(f"head_dim: expected a positive divisor of hidden_size = "
                                 f"{hidden_size}, got {head_dim!r}")
            num_heads = hidden_size // head_dim
        self.hidden_size = hidden_size
        self.key_dim = hidden_size
        self.value_dim = hidden_size if value_dim is None else value_dim
        check_heads(hidden_size, num_heads, self.key_dim, self.value_dim)
        self.mode = check_mode(mode)
        self.num_heads = num_heads
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.layer_idx = layer_idx
        D, K = hidden_size, self.key_dim

        ramp = channel_ramp(D)
        # Lerp weights of r, w, k, v, a, g.
        self.x_maa = nn.Parameter(torch.stack([1 - ramp ** p for p in
                                               (0.2, 0.9, 0.7, 0.7, 0.9, 0.2)]))
        # Decay bias: σ(w₀) from slow (≈ σ(−5)) to fast (≈ σ(2)) over the key channels.
        self.w0 = nn.Parameter(-5 + 7 * channel_ramp(K) ** 0.85)
        self.w_lora = _LoRA(D, decay_low_rank_dim, K, torch.tanh)
        self.a0 = nn.Parameter(torch.zeros(K))
        self.a_lora = _LoRA(D, a_low_rank_dim, K)
        self.value_residual = layer_idx != 0
        if self.value_residual:
            self.v0 = nn.Parameter(torch.ones(self.value_dim))
            self.v_lora = _LoRA(D, v_low_rank_dim, self.value_dim)
        self.g_lora = _LoRA(D, gate_low_rank_dim, self.value_dim, torch.sigmoid)
        self.k_k = nn.Parameter(torch.full((K,), 0.85))
        self.k_a = nn.Parameter(torch.ones(K))
        self.r_k = nn.Parameter(torch.full((num_heads, self.head_k_dim), -0.04))

        self.r_proj = nn.Linear(D, K, bias=False)
        self.k_proj = nn.Linear(D, K, bias=False)
        self.v_proj = nn.Linear(D, self.value_dim, bias=False)
        self.g_norm = GroupNorm(num_heads, self.value_dim, elementwise_affine=elementwise_affine,
                                bias=True, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, D, bias=False)
        for name, p in self.named_parameters(recurse=False):
            p._no_weight_decay = True

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, output_attentions: bool = False,
                cu_seqlens: torch.Tensor | None = None, shared_state: dict | None = None,
                **kwargs):
        mode, mask, state = begin_forward(self, hidden_states, attention_mask, past_key_values,
                                          cu_seqlens)
        B, T, D = hidden_states.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim

        x = hidden_states
        x_prev, new_shift = token_shift(x, cache_entry(state, "conv_state"),
                                        mask, cu_seqlens)
        xr, xw, xk, xv, xa, xg = (x.unsqueeze(2) + (x_prev - x).unsqueeze(2)
                                  * self.x_maa).unbind(2)

        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        # The log decay in float32 (its chunk sums are the exponents of every decay).
        w = -_DECAY_SCALE * torch.sigmoid(self.w0.float() + self.w_lora(xw).float())
        a = torch.sigmoid(self.a0 + self.a_lora(xa))
        g = self.g_lora(xg)
        v_first = None if shared_state is None else shared_state.get("v_first")
        if v_first is None:
            if shared_state is not None:
                shared_state["v_first"] = v
        elif self.value_residual:
            v = v + (v_first - v) * torch.sigmoid(self.v0 + self.v_lora(xv))
        kk = F.normalize((k * self.k_k).view(B, T, H, K), dim=-1)
        k = (k * (1 + (a - 1) * self.k_a)).view(B, T, H, K)
        r, v = r.view(B, T, H, K), v.view(B, T, H, V)
        a, w = a.view(B, T, H, K), w.view(B, T, H, K)
        # Padding: no write, no decay, no rank-one correction (k = v = w = b = 0) keeps
        # the state exactly.
        k, v, w = mask_tokens(k, mask), mask_tokens(v, mask), mask_tokens(w, mask)
        b = mask_tokens(kk * a, mask)

        op = chunk_rwkv7 if mode == "chunk" else fused_recurrent_rwkv7
        o, recurrent_state = op(r, w, k, v, -kk, b, scale=1.0,
                                initial_state=cache_entry(state, "recurrent_state"),
                                output_final_state=use_cache, cu_seqlens=cu_seqlens)
        update_cache(past_key_values, self.layer_idx, use_cache, T,
                     recurrent_state=recurrent_state, conv_state=new_shift)
        o = self.g_norm(o.reshape(B, T, self.value_dim))
        bonus = (r * k * self.r_k).sum(-1, keepdim=True) * v
        o = (o + bonus.reshape(B, T, self.value_dim)) * g
        return self.o_proj(o), None, past_key_values


class RWKV7FeedForward(nn.Module):
    """RWKV7 channel mixing: ``W_v relu(W_k x_k)²`` with the token-shift lerp
    ``x_k = x_t + (x_{t-1} − x_t) ⊙ μ_k``; the shift state in the cache's ``ffn_state``.

    Args:
        hidden_size: d. hidden_ratio / intermediate_size: the inner width (default 4 d).
        layer_idx: the block's index in the cache.
    """

    def __init__(self, hidden_size: int, hidden_ratio: float | None = 4,
                 intermediate_size: int | None = None, layer_idx: int | None = None,
                 **kwargs):
        super().__init__()
        if intermediate_size is None:
            intermediate_size = int(hidden_size * (4 if hidden_ratio is None else hidden_ratio))
        if intermediate_size < 1:
            raise ValueError(f"intermediate_size: expected >= 1, got {intermediate_size}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.layer_idx = layer_idx
        self.x_maa_k = nn.Parameter(1 - channel_ramp(hidden_size) ** 0.5)
        self.x_maa_k._no_weight_decay = True
        self.key = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.value = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False,
                cu_seqlens: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        mask = token_mask(attention_mask, x.shape[1])
        state = cached_state(past_key_values, self.layer_idx)
        x_prev, new_shift = token_shift(x, cache_entry(state, "ffn_state"),
                                        mask, cu_seqlens)
        update_cache(past_key_values, self.layer_idx, use_cache, 0, ffn_state=new_shift)
        k = F.relu(self.key(x + (x_prev - x) * self.x_maa_k)).square()
        return self.value(k)
