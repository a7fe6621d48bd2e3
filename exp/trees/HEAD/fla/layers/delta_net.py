"""DeltaNet (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length"): q, k, v projections through short convolutions, L2-normalised q and k,
a sigmoid write strength β per head, the delta rule, a per-head output RMSNorm (gated by
a projection of x with ``use_gate``) and the output projection."""
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
from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule

__all__ = ["DeltaNet"]


class DeltaNet(nn.Module):
    """DeltaNet token mixer.

    Args:
        hidden_size: model width d.
        expand_k, expand_v: key / value widths as multiples of d (split over the heads).
        num_heads: H.
        mode: ``'chunk'`` (training, prefill) or ``'fused_recurrent'``; single-token
            steps always run the recurrent kernel.
        use_beta: learn β = sigmoid(b_proj(x)) (else β = 1); ``allow_neg_eigval``
            doubles it (β ∈ (0, 2)).
        use_gate: output gate ``RMSNorm(o) ⊙ swish(g_proj(x))`` instead of ``RMSNorm(o)``.
        use_short_conv, conv_size, conv_bias: the causal depthwise convolutions (SiLU) on
            q, k and v.
        qk_activation: ``'silu'``, ``'relu'``, ``'elu'`` or ``'identity'`` on q, k when
            there are no short convolutions (which already apply SiLU).
        qk_norm: ``'l2'`` (unit q, k) or ``'sum'`` (divide by the sum).
        layer_idx: this layer's index in the cache.

    ``forward(hidden_states [B, T, d], attention_mask=None, past_key_values=None,
    use_cache=False, output_attentions=False, cu_seqlens=None)`` returns
    ``(o [B, T, d], None, past_key_values)``.
    """

    def __init__(self, hidden_size: int = 1024, expand_k: float = 1.0, expand_v: float = 1.0,
                 num_heads: int = 4, mode: str = "chunk", use_beta: bool = True,
                 use_gate: bool = False, use_short_conv: bool = True, conv_size: int = 4,
                 conv_bias: bool = False, allow_neg_eigval: bool = False,
                 qk_activation: str = "silu", qk_norm: str = "l2", norm_eps: float = 1e-5,
                 layer_idx: int | None = None, **kwargs):
        super().__init__()
        self.hidden_size = hidden_size
        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        check_heads(hidden_size, num_heads, self.key_dim, self.value_dim)
        if qk_activation not in ("silu", "relu", "elu", "identity"):
            raise ValueError(f"qk_activation: expected 'silu', 'relu', 'elu' or 'identity', "
                             f"got {qk_activation!r}")
        if qk_norm not in ("l2", "sum"):
            raise ValueError(f"qk_norm: expected 'l2' or 'sum', got {qk_norm!r}")
        self.mode = check_mode(mode)
        self.num_heads = num_heads
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.use_beta, self.use_gate = use_beta, use_gate
        self.use_short_conv, self.conv_size = use_short_conv, conv_size
        self.allow_neg_eigval = allow_neg_eigval
        self.qk_activation, self.qk_norm = qk_activation, qk_norm
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_beta:
            self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if use_short_conv:
            self.q_conv1d, self.k_conv1d, self.v_conv1d = qkv_short_convs(
                self.key_dim, self.value_dim, conv_size, conv_bias)
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_norm = output_norm(self.head_v_dim, use_gate, norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _activate(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_short_conv or self.qk_activation == "identity":
            return x
        return {"silu": F.silu, "relu": F.relu, "elu": lambda t: F.elu(t) + 1}[
            self.qk_activation](x)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, output_attentions: bool = False,
                cu_seqlens: torch.Tensor | None = None, **kwargs):
        mode, mask, state = begin_forward(self, hidden_states, attention_mask, past_key_values,
                                          cu_seqlens)
        B, T, _ = hidden_states.shape

        # As in GatedDeltaNet: in chunk mode q and k are normalised as they leave the
        # fused projection (read in place there) rather than by the op.
        qk_normed = self.qk_norm == "l2" and mode == "chunk" and self.use_short_conv
        q, k, v, conv_state = project_qkv(self, hidden_states, state, use_cache, mask,
                                          cu_seqlens, qk_l2norm=qk_normed)
        q = self._activate(q).view(B, T, self.num_heads, self.head_k_dim)
        k = self._activate(k).view(B, T, self.num_heads, self.head_k_dim)
        v = v.view(B, T, self.num_heads, self.head_v_dim)
        if self.qk_norm == "sum":
            q = q / q.sum(-1, keepdim=True)
            k = k / k.sum(-1, keepdim=True)
        if self.use_beta:
            beta = self.b_proj(hidden_states).sigmoid()
            if self.allow_neg_eigval:
                beta = beta * 2
        else:
            beta = hidden_states.new_ones(B, T, self.num_heads)
        # Padding: no write (β = 0, k = v = 0) keeps the state exactly.
        k, v, beta = mask_tokens(k, mask), mask_tokens(v, mask), mask_tokens(beta, mask)

        op = chunk_delta_rule if mode == "chunk" else fused_recurrent_delta_rule
        o, recurrent_state = op(
            q, k, v, beta=beta, initial_state=cache_entry(state, "recurrent_state"),
            output_final_state=use_cache, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=self.qk_norm == "l2" and not qk_normed)
        update_cache(past_key_values, self.layer_idx, use_cache, T,
                     recurrent_state=recurrent_state, conv_state=conv_state)
        return gated_output(self, o, hidden_states, self.use_gate), None, past_key_values
