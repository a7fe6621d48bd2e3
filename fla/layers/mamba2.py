"""Mamba2 (Dao & Gu 2024, "Transformers are SSMs"): one input projection to the gate z,
the SSM input x with its B and C, and the time steps dt; a SiLU short convolution over
[x, B, C]; the SSD recurrence (simple GLA with q = C, k = B, v = dt·x, g = dt·A) plus the
D skip; ``RMSNorm(y ⊙ silu(z))`` per group; the output projection."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fla.layers.utils import (
    begin_forward,
    cache_entry,
    check_mode,
    init_time_step_bias,
    mask_tokens,
    short_conv,
    update_cache,
)
from fla.modules import GroupNorm, ShortConvolution
from fla.ops.mamba2 import mamba_chunk_scan_combined, selective_state_update
from fla.ops.mamba2.chunk import ssd_as_simple_gla
from fla.utils.custom_ops import needs_backward

__all__ = ["Mamba2"]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


class Mamba2(nn.Module):
    """Mamba2's mixer.

    Args:
        hidden_size: model width d.
        num_heads, head_dim: H heads of P channels; ``H · P`` must equal the inner width
            ``expand · d`` (default H = expand · d / head_dim).
        state_size: N, the state entries per channel (B and C are N wide).
        n_groups: G groups of heads sharing B and C (G divides H).
        conv_kernel, use_conv_bias: the short convolution over [x, B, C].
        use_bias: biases in the input and output projections.
        chunk_size: Mamba's argument, passed through (the kernels pick their own chunk).
        time_step_min / max / floor: the log-uniform init of ``softplus(dt_bias)``.
        time_step_limit: ``(low, high)`` clamp of dt.
        mode: ``'chunk'`` or ``'fused_recurrent'`` (single-token steps always recurrent).
        layer_idx: this layer's index in the cache.

    Cache: ``recurrent_state [N_seq, H, P, N]`` float32 (Mamba's layout) and the conv cache.
    ``forward`` as :class:`fla.layers.DeltaNet`.
    """

    def __init__(self, hidden_size: int = 2048, num_heads: int | None = None,
                 head_dim: int = 64, state_size: int = 128, expand: int = 2, n_groups: int = 1,
                 conv_kernel: int = 4, use_conv_bias: bool = True, use_bias: bool = False,
                 norm_eps: float = 1e-5, chunk_size: int = 256,
                 time_step_min: float = 0.001, time_step_max: float = 0.1,
                 time_step_floor: float = 1e-4,
                 time_step_limit: tuple[float, float] = (0.0, float("inf")),
                 mode: str = "chunk", layer_idx: int | None = None, **kwargs):
        super().__init__()
        _positive_int("hidden_size", hidden_size)
        _positive_int("head_dim", head_dim)
        _positive_int("state_size", state_size)
        _positive_int("n_groups", n_groups)
        self.intermediate_size = int(expand * hidden_size)
        if num_heads is None:
            num_heads = self.intermediate_size // head_dim
        _positive_int("num_heads", num_heads)
        if num_heads * head_dim != self.intermediate_size:
            raise ValueError(f"num_heads · head_dim = {num_heads} · {head_dim} must equal the "
                             f"inner width expand · hidden_size = {self.intermediate_size}")
        if num_heads % n_groups:
            raise ValueError(f"n_groups = {n_groups} must divide num_heads = {num_heads}")
        if len(time_step_limit) != 2 or not time_step_limit[0] <= time_step_limit[1]:
            raise ValueError(f"time_step_limit: expected (low, high) with low <= high, got "
                             f"{time_step_limit!r}")
        self.hidden_size = hidden_size
        self.num_heads, self.head_dim = num_heads, head_dim
        self.state_size, self.n_groups = state_size, n_groups
        self.chunk_size = chunk_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.mode = check_mode(mode)
        self.layer_idx = layer_idx
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size

        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads,
                                 bias=use_bias)
        self.conv1d = ShortConvolution(self.conv_dim, conv_kernel, bias=use_conv_bias,
                                       activation="silu")
        self.dt_bias = nn.Parameter(init_time_step_bias(num_heads, time_step_min,
                                                        time_step_max, time_step_floor))
        # A = −(1..H): one decay rate per head (Mamba2's init), stored as log(−A).
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(num_heads))
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
        self.norm = GroupNorm(n_groups, self.intermediate_size, eps=norm_eps, is_rms_norm=True)
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, output_attentions: bool = False,
                cu_seqlens: torch.Tensor | None = None, **kwargs):
        mode, mask, state = begin_forward(self, hidden_states, attention_mask, past_key_values,
                                          cu_seqlens)
        b, T, _ = hidden_states.shape
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.state_size
        I = self.intermediate_size

        z, xBC, dt = self.in_proj(hidden_states).split([I, self.conv_dim, H], dim=-1)
        xBC, conv_state = short_conv(self.conv1d, xBC,
                                     cache_entry(state, "conv_state"),
                                     use_cache, mask, cu_seqlens)
        x, Bm, Cm = xBC.split([I, G * N, G * N], dim=-1)
        x, z = x.reshape(b, T, H, P), z.reshape(b, T, H, P)
        Bm, Cm = Bm.reshape(b, T, G, N), Cm.reshape(b, T, G, N)
        A = -self.A_log.float().exp()
        h0 = cache_entry(state, "recurrent_state")

        # The z gate (y · silu(z), Mamba2's norm_before_gate=False) is applied with the D
        # skip in one kernel of each path, not by PyTorch over float32 copies of y and z
        # (at 4x4096 tokens of H·P = 2048, ~0.4 ms of a 1.4 ms forward on an H200).
        if mode == "chunk" and mask is None:
            # No padding: the op forms the time steps (bias, softplus, clamp) in one kernel.
            out = mamba_chunk_scan_combined(
                x, dt, A, Bm, Cm, self.chunk_size, D=self.D, z=z, dt_bias=self.dt_bias,
                initial_states=h0, cu_seqlens=cu_seqlens, dt_softplus=True,
                dt_limit=self.time_step_limit, return_final_states=use_cache)
            y, final = out if use_cache else (out, None)
        else:
            # Time steps formed here so that padding gets dt = 0: no decay and no write,
            # the state passes a padded position unchanged.
            dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.time_step_limit)
            dt = mask_tokens(dt, mask)
            if mode == "chunk":
                out = mamba_chunk_scan_combined(
                    x, dt, A, Bm, Cm, self.chunk_size, D=self.D, z=z, initial_states=h0,
                    cu_seqlens=cu_seqlens, return_final_states=use_cache)
                y, final = out if use_cache else (out, None)
            elif T == 1 and cu_seqlens is None and not needs_backward(*self.parameters()):
                # The kernel updates the state in place: a copy unless it is to be stored.
                y, final = self._step(x, dt, A, Bm, Cm, z, h0 if h0 is None or use_cache
                                      else h0.clone())
            else:
                y, final = self._recurrent(x, dt, A, Bm, Cm, z, h0, use_cache, cu_seqlens)
        update_cache(past_key_values, self.layer_idx, use_cache, T,
                     recurrent_state=final, conv_state=conv_state)
        # RMSNorm per group of the gated output.
        return self.out_proj(self.norm(y.reshape(b, T, I))), None, past_key_values

    def _step(self, x, dt, A, Bm, Cm, z, h0):
        """One decoding step with the in-place state update kernel; returns (y, state)."""
        b, _, H, P = x.shape
        if h0 is None:
            h0 = x.new_zeros(b, H, P, self.state_size, dtype=torch.float32)
        y = selective_state_update(h0, x[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], D=self.D,
                                   z=z[:, 0])
        return y[:, None], h0

    def _recurrent(self, x, dt, A, Bm, Cm, z, h0, use_cache, cu_seqlens):
        """SSD token by token (differentiable): the op's simple-GLA mapping, recurrent."""
        y, final = ssd_as_simple_gla(x, dt, A, Bm, Cm, D=self.D, initial_states=h0,
                                     cu_seqlens=cu_seqlens, output_final_state=use_cache,
                                     recurrent=True, z=z)
        return y.to(x.dtype), final
