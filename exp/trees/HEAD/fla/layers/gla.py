"""Gated linear attention (Yang et al. 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training"): a data-dependent decay per key channel from a low-rank
projection, ``gk = logsigmoid(W₂ W₁ x + b) / gate_logit_normalizer``, optional short
convolutions, and the output ``RMSNorm(o) ⊙ swish(g_proj(x))`` per head."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fla.layers.utils import (
    begin_forward,
    cache_entry,
    check_heads,
    check_mode,
    gated_output,
    mask_tokens,
    output_norm,
    project_qkv,
    qkv_short_convs,
    update_cache,
)
from fla.ops.gla import chunk_gla, fused_recurrent_gla

__all__ = ["GatedLinearAttention"]


class GatedLinearAttention(nn.Module):
    """GLA token mixer.

    Args:
        hidden_size: model width d.
        expand_k, expand_v: key / value widths as multiples of d (default 0.5 and 1).
        num_heads: H.
        mode: ``'chunk'`` or ``'fused_recurrent'`` (single-token steps always recurrent).
        use_short_conv, conv_size, conv_bias: optional SiLU short convolutions on q, k, v.
        use_output_gate, gate_fn: ``RMSNorm(o) ⊙ act(g_proj(x))`` with act ``'swish'``
            or ``'sigmoid'`` (else ``RMSNorm(o)``).
        gate_low_rank_dim: rank of the gate projection.
        gate_logit_normalizer: divides ``logsigmoid`` (a slower decay per step).
        clamp_min: lower bound of the log gate (None: none).
        layer_idx: this layer's index in the cache.

    ``forward`` as :class:`fla.layers.DeltaNet`.
    """

    def __init__(self, hidden_size: int = 1024, expand_k: float = 0.5, expand_v: float = 1.0,
                 num_heads: int = 4, mode: str = "chunk", use_short_conv: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, use_output_gate: bool = True,
                 gate_fn: str = "swish", gate_low_rank_dim: int = 16,
                 gate_logit_normalizer: float = 16, clamp_min: float | None = None,
                 norm_eps: float = 1e-5, layer_idx: int | None = None, **kwargs):
        super().__init__()
        self.hidden_size = hidden_size
        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        check_heads(hidden_size, num_heads, self.key_dim, self.value_dim)
        if gate_fn not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"gate_fn: expected 'swish' or 'sigmoid', got {gate_fn!r}")
        if not gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer: expected > 0, got {gate_logit_normalizer}")
        self.mode = check_mode(mode)
        self.num_heads = num_heads
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.use_short_conv, self.use_output_gate = use_short_conv, use_output_gate
        self.gate_logit_normalizer, self.clamp_min = gate_logit_normalizer, clamp_min
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, self.key_dim, bias=True))
        if use_short_conv:
            self.q_conv1d, self.k_conv1d, self.v_conv1d = qkv_short_convs(
                self.key_dim, self.value_dim, conv_size, conv_bias)
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_norm = output_norm(self.head_v_dim, use_output_gate, norm_eps,
                                  "sigmoid" if gate_fn == "sigmoid" else "swish")
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, output_attentions: bool = False,
                cu_seqlens: torch.Tensor | None = None, **kwargs):
        mode, mask, state = begin_forward(self, hidden_states, attention_mask, past_key_values,
                                          cu_seqlens)
        B, T, _ = hidden_states.shape

        q, k, v, conv_state = project_qkv(self, hidden_states, state, use_cache, mask,
                                          cu_seqlens)
        q = q.view(B, T, self.num_heads, self.head_k_dim)
        k = k.view(B, T, self.num_heads, self.head_k_dim)
        v = v.view(B, T, self.num_heads, self.head_v_dim)
        # The log gate in float32 (its chunk sums are the exponents of every decay).
        gk = F.logsigmoid(self.gk_proj(hidden_states).float()) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            gk = gk.clamp(min=self.clamp_min)
        gk = gk.view(B, T, self.num_heads, self.head_k_dim)
        # Padding: no write and no decay (k = v = 0, gk = 0) keeps the state exactly.
        k, v, gk = mask_tokens(k, mask), mask_tokens(v, mask), mask_tokens(gk, mask)

        h0 = cache_entry(state, "recurrent_state")
        if mode == "chunk":
            o, recurrent_state = chunk_gla(q, k, v, g=gk, initial_state=h0,
                                           output_final_state=use_cache, cu_seqlens=cu_seqlens)
        else:
            o, recurrent_state = fused_recurrent_gla(q, k, v, gk=gk, initial_state=h0,
                                                     output_final_state=use_cache,
                                                     cu_seqlens=cu_seqlens)
        update_cache(past_key_values, self.layer_idx, use_cache, T,
                     recurrent_state=recurrent_state, conv_state=conv_state)
        return gated_output(self, o, hidden_states, self.use_output_gate), None, past_key_values
