"""Softmax attention for hybrid models: rotary q and k (as wide as a head), grouped
key/value heads, an optional sliding window, scaled-dot-product attention (PyTorch SDPA),
and keys/values in the cache (only the last ``window_size`` with a window)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fla.layers.utils import cached_state, check_layer_inputs, position_offsets, seen_tokens
from fla.modules import RMSNorm, RotaryEmbedding

__all__ = ["Attention"]


def attention_mask_4d(T: int, L: int, device, attention_mask: torch.Tensor | None = None,
                      window_size: int | None = None,
                      cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``[B or 1, 1, T, L]`` bool, True where query i (the last T of L key positions)
    may attend key j: causal, within the window (i − j < window_size), key not padding,
    same packed sequence. The diagonal is always allowed, so a padded query's row is
    never empty (its output is discarded anyway; an empty row would give NaN)."""
    i = torch.arange(L - T, L, device=device)[:, None]
    j = torch.arange(L, device=device)[None, :]
    allowed = j <= i
    if window_size is not None:
        allowed = allowed & (i - j < window_size)
    allowed = allowed[None]
    if cu_seqlens is not None:
        seq = torch.bucketize(torch.arange(L, device=device), cu_seqlens.to(device)[1:],
                              right=True)
        allowed = allowed & (seq[L - T:, None] == seq[None, :])[None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, -L:].bool()[:, None, :]
    allowed = allowed | (i == j)[None]
    return allowed[:, None]


class Attention(nn.Module):
    """Multi-head softmax attention.

    Args:
        hidden_size: model width d.
        num_heads: H query heads of width ``head_dim`` (default d / H).
        num_kv_heads: key/value heads (default H; must divide H).
        qkv_bias: biases on the q, k, v projections.
        qk_norm: RMSNorm on each q and k head before the rotary.
        window_size: attend only the last ``window_size`` positions (self included).
        rope_theta: rotary base; the rotary turns all ``head_dim`` channels of a head.
        max_position_embeddings: accepted for configs; positions are not limited.
        layer_idx: this layer's index in the cache.

    ``forward(hidden_states [B, T, d], attention_mask=None, past_key_values=None,
    use_cache=False, output_attentions=False, cu_seqlens=None)`` returns
    ``(o, None, past_key_values)`` (SDPA does not return attention weights).
    """

    def __init__(self, hidden_size: int = 2048, num_heads: int = 32,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 qkv_bias: bool = False, qk_norm: bool = False, window_size: int | None = None,
                 rope_theta: float = 10000.0, max_position_embeddings: int | None = None,
                 norm_eps: float = 1e-5, layer_idx: int | None = None, **kwargs):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"attention {name}: expected a positive int, got {value!r}")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"attention: hidden_size = {hidden_size} is not divisible by "
                                 f"num_heads = {num_heads}")
            head_dim = hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"attention: num_kv_heads = {num_kv_heads} must divide "
                             f"num_heads = {num_heads}")
        if head_dim % 2:
            raise ValueError(f"attention: head_dim = {head_dim} must be even (rotary)")
        if window_size is not None and (isinstance(window_size, bool) or
                                        not isinstance(window_size, int) or window_size < 1):
            raise ValueError(f"attention window_size: expected a positive int or None, got "
                             f"{window_size!r}")
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.qk_norm, self.window_size = qk_norm, window_size
        self.max_position_embeddings = max_position_embeddings
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps)
        self.rotary = RotaryEmbedding(dim=head_dim, base=rope_theta)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, output_attentions: bool = False,
                cu_seqlens: torch.Tensor | None = None, **kwargs):
        check_layer_inputs(hidden_states, self.hidden_size, attention_mask, cu_seqlens)
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        seen = seen_tokens(past_key_values, self.layer_idx)
        q, k = self.rotary(q, k, seqlen_offset=position_offsets(attention_mask, seen),
                           cu_seqlens=cu_seqlens)

        state = cached_state(past_key_values, self.layer_idx)
        if past_key_values is not None and use_cache:
            k, v = past_key_values.update(self.layer_idx, attn_state=(k, v), offset=T,
                                          window_size=self.window_size)["attn_state"]
        elif state is not None and state["attn_state"] is not None:
            k = torch.cat([state["attn_state"][0], k], dim=1)
            v = torch.cat([state["attn_state"][1], v], dim=1)
        L = k.shape[1]
        if attention_mask is not None and attention_mask.shape[-1] < L:
            raise ValueError(f"attention_mask: covers {attention_mask.shape[-1]} positions, "
                             f"but the queries attend {L} (cached and new); pass the mask of "
                             f"every position seen so far")
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if attention_mask is None and cu_seqlens is None and L == T and (
                self.window_size is None or self.window_size >= T):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = attention_mask_4d(T, L, q.device, attention_mask, self.window_size, cu_seqlens)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o = o.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(o), None, past_key_values
