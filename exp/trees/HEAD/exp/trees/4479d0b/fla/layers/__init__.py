"""Token-mixing layers: projections, short convolutions, the recurrence (``fla.ops``) and
the output gate/norm of each architecture's paper.

Every layer: ``forward(hidden_states [B, T, d], attention_mask=None, past_key_values=None,
use_cache=False, output_attentions=False, cu_seqlens=None) -> (o, attentions,
past_key_values)``; a ``mode`` ('chunk' / 'fused_recurrent') where both kernels exist,
the recurrent one taken automatically for single-token steps; the layer's state in
``past_key_values[layer_idx]`` (see :class:`fla.models.utils.Cache`).
"""
from fla.layers.attn import Attention
from fla.layers.delta_net import DeltaNet
from fla.layers.gated_deltanet import GatedDeltaNet
from fla.layers.gla import GatedLinearAttention
from fla.layers.mamba2 import Mamba2
from fla.layers.multiscale_retention import MultiScaleRetention
from fla.layers.rwkv6 import RWKV6Attention, RWKV6FeedForward
from fla.layers.rwkv7 import RWKV7Attention, RWKV7FeedForward

__all__ = ["Attention", "DeltaNet", "GatedDeltaNet", "GatedLinearAttention", "Mamba2",
           "MultiScaleRetention", "RWKV6Attention", "RWKV6FeedForward", "RWKV7Attention",
           "RWKV7FeedForward"]
