"""RWKV6 "Finch" (Peng et al. 2024, "Eagle and Finch: RWKV with Matrix-Valued States and
Dynamic Recurrence"): time mixing and channel mixing.

Time mixing. Token shift with data-dependent interpolation (ddlerp): with
``Δ = x_{t-1} − x_t``,

    lora_□(x)  = λ_□ + tanh(x A) B_□                    (A shared by r, w, k, v, g)
    x_□        = x_t + Δ ⊙ lora_□(x_t + Δ ⊙ μ_x)
    r, k, v, g = W_r x_r, W_k x_k, W_v x_v, W_g x_g
    w_t        = −exp(d + tanh(x_w A_d) B_d)            (log decay, per key channel)
    o_t        = W_o (silu(g) ⊙ GroupNorm_H(wkv_t))
    wkv_t      = S_{t-1}ᵀ r_t + (Σ_i r_i u_i k_i) v_t,   S_t = diag(exp(w_t)) S_{t-1} + k_t v_tᵀ

(:func:`fla.ops.rwkv6.chunk_rwkv6` with scale 1). Channel mixing:
``σ(W_r' x_r) ⊙ W_v' relu(W_k' x_k)²`` with static lerps ``x_□ = x_t + Δ ⊙ μ_□``.

The token-shift state (the last token's input) lives in the cache's ``conv_state`` slot
(time mix) and ``ffn_state`` slot (channel mix) of the layer.
"""
from __future__ import annotations

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
from fla.ops.rwkv6 import chunk_rwkv6, fused_recurrent_rwkv6

__all__ = ["RWKV6Attention", "RWKV6FeedForward"]


class RWKV6Attention(nn.Module):
    """RWKV6 time mixing (see the module docstring).

    Args:
        hidden_size: model width d.
        expand_k, expand_v: key (r, k, w) / value (v, g) widths as multiples of d.
        num_heads: H.
        mode: ``'chunk'`` or ``'fused_recurrent'`` (single-token steps always recurrent).
        gate_fn: activation of the output gate (``'swish'``, as in the paper).
        proj_low_rank_dim: rank of the shared ddlerp LoRA (32 in the paper).
        gate_low_rank_dim: rank of the decay LoRA (64 in the paper).
        elementwise_affine, norm_eps: the per-head GroupNorm of the output.
        layer_idx: this layer's index in the cache.

    ``forward`` as :class:`fla.layers.DeltaNet`.
    """

    def __init__(self, hidden_size: int = 1024, expand_k: float = 0.5, expand_v: float = 1.0,
                 num_heads: int = 4, mode: str = "chunk", gate_fn: str = "swish",
                 proj_low_rank_dim: int = 32, gate_low_rank_dim: int = 64,
                 elementwise_affine: bool = True, norm_eps: float = 1e-5,
                 layer_idx: int | None = None, **kwargs):
        super().__init__()
        self.hidden_size = hidden_size
        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        check_heads(hidden_size, num_heads, self.key_dim, self.value_dim)
        if gate_fn not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"gate_fn: expected 'swish' or 'sigmoid', got {gate_fn!r}")
        for name, value in (("proj_low_rank_dim", proj_low_rank_dim),
                            ("gate_low_rank_dim", gate_low_rank_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.mode = check_mode(mode)
        self.num_heads = num_heads
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.gate_fn = F.sigmoid if gate_fn == "sigmoid" else F.silu
        self.proj_low_rank_dim = proj_low_rank_dim
        self.layer_idx = layer_idx
        D, R = hidden_size, proj_low_rank_dim

        # ddlerp: μ_x, then the shared A, one B_□ and λ_□ per target (r, w, k, v, g).
        ramp = channel_ramp(D)
        self.x_maa = nn.Parameter(1 - ramp ** 0.5)
        self.maa = nn.Parameter(torch.stack([1 - ramp ** p for p in (0.5, 0.7, 0.7, 0.5, 0.5)]))
        self.maa_a = nn.Linear(D, 5 * R, bias=False)
        self.maa_b = nn.Parameter(torch.empty(5, R, D).uniform_(-0.01, 0.01))
        # Decay: d ramps from −6 to −1 over the key channels (slow to fast), plus a LoRA.
        self.decay = nn.Parameter(-6 + 5 * channel_ramp(self.key_dim) ** 0.85)
        self.decay_a = nn.Linear(D, gate_low_rank_dim, bias=False)
        self.decay_b = nn.Linear(gate_low_rank_dim, self.key_dim, bias=False)
        # Bonus of the current token, u [H, K].
        k_ramp = channel_ramp(self.head_k_dim)
        u = 0.5 * (1 - k_ramp) + ((torch.arange(self.head_k_dim) + 1) % 3 - 1) * 0.1
        self.bonus = nn.Parameter(u.repeat(num_heads, 1))

        self.r_proj = nn.Linear(D, self.key_dim, bias=False)
        self.k_proj = nn.Linear(D, self.key_dim, bias=False)
        self.v_proj = nn.Linear(D, self.value_dim, bias=False)
        self.g_proj = nn.Linear(D, self.value_dim, bias=False)
        self.g_norm = GroupNorm(num_heads, self.value_dim, elementwise_affine=elementwise_affine,
                                bias=True, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, D, bias=False)
        for p in (self.x_maa, self.maa, self.decay, self.bonus):
            p._no_weight_decay = True

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, output_attentions: bool = False,
                cu_seqlens: torch.Tensor | None = None, **kwargs):
        mode, mask, state = begin_forward(self, hidden_states, attention_mask, past_key_values,
                                          cu_seqlens)
        B, T, D = hidden_states.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim

        x = hidden_states
        x_prev, new_shift = token_shift(x, cache_entry(state, "conv_state"),
                                        mask, cu_seqlens)
        delta = x_prev - x
        lora = torch.tanh(self.maa_a(x + delta * self.x_maa))
        lora = torch.einsum("btir,ird->btid", lora.view(B, T, 5, -1), self.maa_b) + self.maa
        xr, xw, xk, xv, xg = (x.unsqueeze(2) + delta.unsqueeze(2) * lora).unbind(2)

        r = self.r_proj(xr).view(B, T, H, K)
        k = self.k_proj(xk).view(B, T, H, K)
        v = self.v_proj(xv).view(B, T, H, V)
        g = self.g_proj(xg)
        # The log decay in float32 (its chunk sums are the exponents of every decay).
        w = -torch.exp(self.decay.float() + self.decay_b(torch.tanh(self.decay_a(xw))).float())
        w = w.view(B, T, H, K)
        # Padding: no write and no decay (k = v = 0, w = 0) keeps the state exactly.
        k, v, w = mask_tokens(k, mask), mask_tokens(v, mask), mask_tokens(w, mask)

        op = chunk_rwkv6 if mode == "chunk" else fused_recurrent_rwkv6
        o, recurrent_state = op(r, k, v, w, self.bonus, scale=1.0,
                                initial_state=cache_entry(state, "recurrent_state"),
                                output_final_state=use_cache, cu_seqlens=cu_seqlens)
        update_cache(past_key_values, self.layer_idx, use_cache, T,
                     recurrent_state=recurrent_state, conv_state=new_shift)
        o = self.g_norm(o.reshape(B, T, self.value_dim)) * self.gate_fn(g)
        return self.o_proj(o), None, past_key_values


class RWKV6FeedForward(nn.Module):
    """RWKV6 channel mixing: ``σ(W_r x_r) ⊙ W_v relu(W_k x_k)²`` with token-shift lerps
    ``x_□ = x_t + (x_{t-1} − x_t) ⊙ μ_□``; the shift state in the cache's ``ffn_state``.

    Args:
        hidden_size: d. hidden_ratio / intermediate_size: the inner width (default
            ``3.5 d`` rounded down to a multiple of 32, as in the paper).
        layer_idx: the block's index in the cache.

    ``forward(x, attention_mask=None, past_key_values=None, use_cache=False,
    cu_seqlens=None) -> y`` (the block's MLP call).
    """

    def __init__(self, hidden_size: int, hidden_ratio: float | None = 3.5,
                 intermediate_size: int | None = None, layer_idx: int | None = None,
                 **kwargs):
        super().__init__()
        if intermediate_size is None:
            intermediate_size = int(hidden_size * (3.5 if hidden_ratio is None else hidden_ratio))
            intermediate_size = max(32 * (intermediate_size // 32), 1)
        if intermediate_size < 1:
            raise ValueError(f"intermediate_size: expected >= 1, got {intermediate_size}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.layer_idx = layer_idx
        ramp = channel_ramp(hidden_size)
        self.x_maa_k = nn.Parameter(1 - ramp ** 0.5)
        self.x_maa_r = nn.Parameter(1 - ramp ** 0.5)
        self.x_maa_k._no_weight_decay = self.x_maa_r._no_weight_decay = True
        self.key = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.value = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.receptance = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False,
                cu_seqlens: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        mask = token_mask(attention_mask, x.shape[1])
        state = cached_state(past_key_values, self.layer_idx)
        x_prev, new_shift = token_shift(x, cache_entry(state, "ffn_state"),
                                        mask, cu_seqlens)
        update_cache(past_key_values, self.layer_idx, use_cache, 0, ffn_state=new_shift)
        delta = x_prev - x
        k = F.relu(self.key(x + delta * self.x_maa_k)).square()
        return torch.sigmoid(self.receptance(x + delta * self.x_maa_r)) * self.value(k)
