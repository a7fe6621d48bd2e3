"""RWKV7 (Goose) models: :class:`fla.layers.RWKV7Attention` as mixer (the first layer's
values reach the later ones through the model's per-forward shared state), the RWKV7
channel mix (:class:`fla.layers.RWKV7FeedForward`) as the blocks' feed-forward and
LayerNorms."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fla.models.config import RWKVConfig, lazy_model_class

if TYPE_CHECKING:  # the layers (and their kernels) are imported when a model is built
    from fla.layers.rwkv7 import RWKV7Attention, RWKV7FeedForward


class RWKV7Config(RWKVConfig):
    """Mixer settings as :class:`fla.layers.RWKV7Attention` (``attn_mode`` is its
    ``mode``); ``hidden_ratio`` / ``intermediate_size`` size the channel mix (4 d);
    ``norm_bias`` / ``norm_eps`` the LayerNorms; ``norm_first``: a LayerNorm of the
    embeddings before the first block (RWKV's ``ln0``); the rest as
    :class:`fla.models.base.FLAConfig`."""

    model_type = "rwkv7"

    def __init__(self, attn_mode: str = "chunk", hidden_size: int = 2048,
                 head_dim: int | None = 64, num_heads: int | None = None,
                 value_dim: int | None = None, decay_low_rank_dim: int = 64,
                 gate_low_rank_dim: int = 128, a_low_rank_dim: int = 64,
                 v_low_rank_dim: int = 16, hidden_ratio: float | None = 4,
                 intermediate_size: int | None = None, hidden_act: str = "sqrelu",
                 norm_bias: bool = True, norm_eps: float = 1e-5,
                 norm_first: bool = True, **kwargs):
        self.attn_mode = attn_mode
        self.head_dim, self.num_heads, self.value_dim = head_dim, num_heads, value_dim
        self.decay_low_rank_dim, self.gate_low_rank_dim = decay_low_rank_dim, gate_low_rank_dim
        self.a_low_rank_dim, self.v_low_rank_dim = a_low_rank_dim, v_low_rank_dim
        super().__init__(hidden_size=hidden_size, hidden_ratio=hidden_ratio,
                         intermediate_size=intermediate_size, hidden_act=hidden_act,
                         norm_eps=norm_eps, norm_bias=norm_bias, norm_first=norm_first,
                         **kwargs)

    def build_mixer(self, layer_idx: int) -> RWKV7Attention:
        from fla.layers.rwkv7 import RWKV7Attention

        return RWKV7Attention(
            hidden_size=self.hidden_size, head_dim=self.head_dim, num_heads=self.num_heads,
            value_dim=self.value_dim, mode=self.attn_mode,
            decay_low_rank_dim=self.decay_low_rank_dim, a_low_rank_dim=self.a_low_rank_dim,
            v_low_rank_dim=self.v_low_rank_dim, gate_low_rank_dim=self.gate_low_rank_dim,
            norm_eps=self.norm_eps, layer_idx=layer_idx)

    def build_mlp(self, layer_idx: int) -> RWKV7FeedForward:
        from fla.layers.rwkv7 import RWKV7FeedForward

        return RWKV7FeedForward(self.hidden_size, self.hidden_ratio, self.intermediate_size,
                                layer_idx=layer_idx)


def __getattr__(name: str):
    """``RWKV7Model`` and ``RWKV7ForCausalLM``: the shared model classes bound to
    :class:`RWKV7Config` (see :func:`fla.models.config.model_classes`)."""
    return lazy_model_class(RWKV7Config, name)
