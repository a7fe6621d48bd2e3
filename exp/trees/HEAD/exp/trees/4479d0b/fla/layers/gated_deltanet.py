"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks"): DeltaNet's
delta rule with a data-dependent decay ``g = −exp(A_log) · softplus(a_proj(x) + dt_bias)``
(Mamba2's parameterisation), short convolutions on q, k, v, L2-normalised q and k, and the
output ``RMSNorm(o) ⊙ swish(g_proj(x))`` per head."""
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
    init_time_step_bias,
    mask_tokens,
    output_norm,
    project_qkv,
    qkv_short_convs,
    update_cache,
)
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from fla.ops.gated_delta_rule.gate import gated_delta_rule_gate

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer.

    Args:
        hidden_size: model width d.
        head_dim: K, the q/k width of a head; values are ``V = head_dim · expand_v`` wide.
        num_heads: H, the q/k heads; ``num_v_heads`` (default H, a multiple of H) value
            heads share them in groups (each with its own β and decay).
        mode: ``'chunk'`` or ``'fused_recurrent'`` (single-token steps always recurrent).
        use_gate: ``RMSNorm(o) ⊙ swish(g_proj(x))`` (else ``RMSNorm(o)``).
        use_short_conv, conv_size, conv_bias: SiLU short convolutions on q, k, v.
        allow_neg_eigval: β ∈ (0, 2) instead of (0, 1).
        layer_idx: this layer's index in the cache.

    ``forward`` as :class:`fla.layers.DeltaNet`.
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256,
                 num_heads: int = 6, num_v_heads: int | None = None, mode: str = "chunk",
                 use_gate: bool = True, use_short_conv: bool = True, conv_size: int = 4,
                 conv_bias: bool = False, allow_neg_eigval: bool = False,
                 norm_eps: float = 1e-5, layer_idx: int | None = None, **kwargs):
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim: expected a positive int, got {head_dim!r}")
        if isinstance(num_v_heads, bool) or not isinstance(num_v_heads, int) or \
                num_v_heads < 1 or num_v_heads % num_heads:
            raise ValueError(f"num_v_heads: expected a positive multiple of num_heads = "
                             f"{num_heads}, got {num_v_heads!r}")
        self.hidden_size = hidden_size
        self.mode = check_mode(mode)
        self.num_heads, self.num_v_heads = num_heads, num_v_heads
        self.head_k_dim = head_dim
        self.head_v_dim = int(head_dim * expand_v)
        self.key_dim = num_heads * self.head_k_dim
        self.value_dim = num_v_heads * self.head_v_dim
        check_heads(hidden_size, num_heads, self.key_dim, self.value_dim)
        self.use_gate, self.use_short_conv = use_gate, use_short_conv
        self.conv_size, self.allow_neg_eigval = conv_size, allow_neg_eigval
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        # Decay rates A ~ U(0, 16) and time steps log-uniform in [1e-3, 0.1] (Mamba2).
        self.A_log = nn.Parameter(torch.log(torch.rand(num_v_heads) * 16 + 1e-4))
        self.dt_bias = nn.Parameter(init_time_step_bias(num_v_heads))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        if use_short_conv:
            self.q_conv1d, self.k_conv1d, self.v_conv1d = qkv_short_convs(
                self.key_dim, self.value_dim, conv_size, conv_bias)
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_norm = output_norm(self.head_v_dim, use_gate, norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, output_attentions: bool = False,
                cu_seqlens: torch.Tensor | None = None, **kwargs):
        mode, mask, state = begin_forward(self, hidden_states, attention_mask, past_key_values,
                                          cu_seqlens)
        B, T, _ = hidden_states.shape

        # a and b (packed [a | b]) and the output gate read the same input as q, k, v:
        # projected together (one autograd node, input gradients summed in the GEMMs).
        gates = [(self.a_proj, self.b_proj)] + ([(self.g_proj,)] if self.use_gate else [])
        # The chunk op would L2-normalise q and k in separate launches anyway; done as they
        # leave the fused projection, they are read in place there (the recurrent kernel
        # normalises inside itself, so that mode keeps it).
        qk_normed = mode == "chunk" and self.use_short_conv
        q, k, v, conv_state, ab, *gate = project_qkv(self, hidden_states, state, use_cache,
                                                     mask, cu_seqlens, extra=gates,
                                                     qk_l2norm=qk_normed)
        if not self.use_short_conv:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q = q.view(B, T, self.num_heads, self.head_k_dim)
        k = k.view(B, T, self.num_heads, self.head_k_dim)
        v = v.view(B, T, self.num_v_heads, self.head_v_dim)
        # g = −exp(A_log)·softplus(a + dt_bias) in float32 (its chunk sums are the
        # exponents of every decay) and β = σ(b) in one kernel each way instead of ~25
        # small elementwise launches.
        g, beta = gated_delta_rule_gate(ab, self.A_log, self.dt_bias,
                                        beta_scale=2.0 if self.allow_neg_eigval else 1.0)
        # Padding: no write and no decay (β = 0, g = 0, k = v = 0) keeps the state exactly.
        k, v = mask_tokens(k, mask), mask_tokens(v, mask)
        beta, g = mask_tokens(beta, mask), mask_tokens(g, mask)

        op = chunk_gated_delta_rule if mode == "chunk" else fused_recurrent_gated_delta_rule
        o, recurrent_state = op(
            q, k, v, g=g, beta=beta,
            initial_state=cache_entry(state, "recurrent_state"),
            output_final_state=use_cache, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=not qk_normed)
        update_cache(past_key_values, self.layer_idx, use_cache, T,
                     recurrent_state=recurrent_state, conv_state=conv_state)
        return (gated_output(self, o, hidden_states, self.use_gate, *gate), None,
                past_key_values)
