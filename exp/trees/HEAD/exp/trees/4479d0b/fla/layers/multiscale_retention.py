"""Multi-scale retention (Sun et al. 2023, "Retentive Network"): per head h a fixed decay
``γ_h = 1 − 2^(−5−h)``, rotary q and k, and the output ``RMSNorm(o) ⊙ swish(g_proj(x))``
per head (the paper's GroupNorm and swish gate)."""
from __future__ import annotations

import torch
import torch.nn as nn

from fla.layers.utils import (
    begin_forward,
    cache_entry,
    check_heads,
    check_mode,
    gated_output,
    mask_tokens,
    output_norm,
    position_offsets,
    project_qkv,
    qkv_short_convs,
    seen_tokens,
    update_cache,
)
from fla.modules import RotaryEmbedding
from fla.ops.retention import retention_log_decay
from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

__all__ = ["MultiScaleRetention"]


class MultiScaleRetention(nn.Module):
    """RetNet's token mixer.

    Args:
        hidden_size: model width d.
        expand_k, expand_v: key / value widths as multiples of d (default 1 and 2).
        num_heads: H (head h decays by ``1 − 2^(−5−h)``).
        mode: ``'chunk'`` or ``'fused_recurrent'`` (single-token steps always recurrent).
        use_short_conv, conv_size, conv_bias: optional SiLU short convolutions on q, k, v.
        use_output_gate: ``RMSNorm(o) ⊙ act(g_proj(x))`` (else ``RMSNorm(o)``).
        gate_fn: the gate's activation, ``'swish'`` or ``'sigmoid'``.
        rope_theta: rotary base (the rotary is as wide as a key head).
        layer_idx: this layer's index in the cache.

    ``forward`` as :class:`fla.layers.DeltaNet`.
    """

    def __init__(self, hidden_size: int = 1024, expand_k: float = 1.0, expand_v: float = 2.0,
                 num_heads: int = 8, mode: str = "chunk", use_short_conv: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, use_output_gate: bool = True,
                 gate_fn: str = "swish", norm_eps: float = 1e-5, rope_theta: float = 10000.0,
                 layer_idx: int | None = None, **kwargs):
        super().__init__()
        self.hidden_size = hidden_size
        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        check_heads(hidden_size, num_heads, self.key_dim, self.value_dim)
        if gate_fn not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"gate_fn: expected 'swish' or 'sigmoid', got {gate_fn!r}")
        self.mode = check_mode(mode)
        self.num_heads = num_heads
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        if self.head_k_dim % 2:
            raise ValueError(f"the key head width key_dim / num_heads = {self.head_k_dim} "
                             f"must be even (rotary turns channel pairs)")
        self.use_short_conv, self.use_output_gate = use_short_conv, use_output_gate
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_short_conv:
            self.q_conv1d, self.k_conv1d, self.v_conv1d = qkv_short_convs(
                self.key_dim, self.value_dim, conv_size, conv_bias)
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_norm = output_norm(self.head_v_dim, use_output_gate, norm_eps,
                                  "sigmoid" if gate_fn == "sigmoid" else "swish")
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.rotary = RotaryEmbedding(dim=self.head_k_dim, base=rope_theta)

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
        offset = position_offsets(attention_mask, seen_tokens(past_key_values, self.layer_idx))
        q, k = self.rotary(q, k, seqlen_offset=offset, cu_seqlens=cu_seqlens)

        log_decay = retention_log_decay(self.num_heads).to(hidden_states.device, torch.float32)
        if mask is None:
            gates = {"g_gamma": log_decay}
        else:
            # Padding: no write and no decay, so per-token gates replace the constant.
            k, v = mask_tokens(k, mask), mask_tokens(v, mask)
            gates = {"g": mask_tokens(log_decay.expand(B, T, -1), mask)}
        op = chunk_simple_gla if mode == "chunk" else fused_recurrent_simple_gla
        o, recurrent_state = op(
            q, k, v, **gates, initial_state=cache_entry(state, "recurrent_state"),
            output_final_state=use_cache, cu_seqlens=cu_seqlens)
        update_cache(past_key_values, self.layer_idx, use_cache, T,
                     recurrent_state=recurrent_state, conv_state=conv_state)
        return gated_output(self, o, hidden_states, self.use_output_gate), None, past_key_values
