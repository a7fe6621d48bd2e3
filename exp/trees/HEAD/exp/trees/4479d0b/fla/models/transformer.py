"""Transformer models (the softmax baseline): every layer is :class:`fla.layers.Attention`
(rotary, optional sliding window, grouped key/value heads)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fla.models.config import FLAConfig, lazy_model_class

if TYPE_CHECKING:  # the layers (and their kernels) are imported when a model is built
    from fla.layers.attn import Attention


class TransformerConfig(FLAConfig):
    """Attention settings (``num_heads``, ``num_kv_heads``, ``qkv_bias``, ``qk_norm``,
    ``window_size``, ``rope_theta``); the rest as :class:`fla.models.base.FLAConfig`."""

    model_type = "transformer"

    def __init__(self, hidden_size: int = 2048, num_heads: int = 32,
                 num_kv_heads: int | None = None, qkv_bias: bool = False,
                 qk_norm: bool = False, window_size: int | None = None,
                 rope_theta: float = 10000.0, **kwargs):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.qkv_bias, self.qk_norm = qkv_bias, qk_norm
        self.window_size, self.rope_theta = window_size, rope_theta
        super().__init__(hidden_size=hidden_size, **kwargs)

    def build_mixer(self, layer_idx: int) -> Attention:
        from fla.layers.attn import Attention

        return Attention(hidden_size=self.hidden_size, num_heads=self.num_heads,
                         num_kv_heads=self.num_kv_heads, qkv_bias=self.qkv_bias,
                         qk_norm=self.qk_norm, window_size=self.window_size,
                         rope_theta=self.rope_theta,
                         max_position_embeddings=self.max_position_embeddings,
                         norm_eps=self.norm_eps, layer_idx=layer_idx)


def __getattr__(name: str):
    """``TransformerModel`` and ``TransformerForCausalLM``: the shared model classes bound to
    :class:`TransformerConfig` (see :func:`fla.models.config.model_classes`)."""
    return lazy_model_class(TransformerConfig, name)
