"""RWKV6 (Finch) models: :class:`fla.layers.RWKV6Attention` as mixer, the RWKV6 channel
mix (:class:`fla.layers.RWKV6FeedForward`) as the blocks' feed-forward and LayerNorms."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fla.models.config import RWKVConfig, lazy_model_class

if TYPE_CHECKING:  # the layers (and their kernels) are imported when a model is built
    from fla.layers.rwkv6 import RWKV6Attention, RWKV6FeedForward


class RWKV6Config(RWKVConfig):
    """Mixer settings as :class:`fla.layers.RWKV6Attention` (``attn_mode`` is its
    ``mode``); ``hidden_ratio`` / ``intermediate_size`` size the channel mix (3.5 d);
    ``norm_bias`` / ``norm_eps`` the LayerNorms; ``norm_first``: a LayerNorm of the
    embeddings before the first block (RWKV's ``ln0``); the rest as
    :class:`fla.models.base.FLAConfig`."""

    model_type = "rwkv6"

    def __init__(self, attn_mode: str = "chunk", hidden_size: int = 2048,
                 expand_k: float = 0.5, expand_v: float = 1.0, hidden_ratio: float | None = 3.5,
                 intermediate_size: int | None = None, num_heads: int = 4,
                 proj_low_rank_dim: int = 32, gate_low_rank_dim: int = 64,
                 hidden_act: str = "sqrelu", norm_bias: bool = True, norm_eps: float = 1e-5,
                 norm_first: bool = True,
                 **kwargs):
        self.attn_mode = attn_mode
        self.expand_k, self.expand_v, self.num_heads = expand_k, expand_v, num_heads
        self.proj_low_rank_dim, self.gate_low_rank_dim = proj_low_rank_dim, gate_low_rank_dim
        super().__init__(hidden_size=hidden_size, hidden_ratio=hidden_ratio,
                         intermediate_size=intermediate_size, hidden_act=hidden_act,
                         norm_eps=norm_eps, norm_bias=norm_bias, norm_first=norm_first,
                         **kwargs)

    def build_mixer(self, layer_idx: int) -> RWKV6Attention:
        from fla.layers.rwkv6 import RWKV6Attention

        return RWKV6Attention(
            hidden_size=self.hidden_size, expand_k=self.expand_k, expand_v=self.expand_v,
            num_heads=self.num_heads, mode=self.attn_mode,
            proj_low_rank_dim=self.proj_low_rank_dim, gate_low_rank_dim=self.gate_low_rank_dim,
            norm_eps=self.norm_eps, layer_idx=layer_idx)

    def build_mlp(self, layer_idx: int) -> RWKV6FeedForward:
        from fla.layers.rwkv6 import RWKV6FeedForward

        return RWKV6FeedForward(self.hidden_size, self.hidden_ratio, self.intermediate_size,
                                layer_idx=layer_idx)


def __getattr__(name: str):
    """``RWKV6Model`` and ``RWKV6ForCausalLM``: the shared model classes bound to
    :class:`RWKV6Config` (see :func:`fla.models.config.model_classes`)."""
    return lazy_model_class(RWKV6Config, name)
