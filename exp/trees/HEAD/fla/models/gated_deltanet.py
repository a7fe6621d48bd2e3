"""Gated DeltaNet models: the config (mixer settings) and :class:`fla.layers.GatedDeltaNet`
as mixer."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fla.models.config import FLAConfig, lazy_model_class

if TYPE_CHECKING:  # the layers (and their kernels) are imported when a model is built
    from fla.layers.gated_deltanet import GatedDeltaNet


class GatedDeltaNetConfig(FLAConfig):
    """Mixer settings as :class:`fla.layers.GatedDeltaNet` (``attn_mode`` is its
    ``mode``); the rest as :class:`fla.models.base.FLAConfig`."""

    model_type = "gated_deltanet"

    def __init__(self, attn_mode: str = "chunk", hidden_size: int = 2048, expand_v: float = 2,
                 head_dim: int = 256, num_heads: int = 6, num_v_heads: int | None = None,
                 use_gate: bool = True, use_short_conv: bool = True, conv_size: int = 4,
                 allow_neg_eigval: bool = False, **kwargs):
        self.attn_mode = attn_mode
        self.expand_v, self.head_dim = expand_v, head_dim
        self.num_heads, self.num_v_heads = num_heads, num_v_heads
        self.use_gate, self.use_short_conv, self.conv_size = use_gate, use_short_conv, conv_size
        self.allow_neg_eigval = allow_neg_eigval
        super().__init__(hidden_size=hidden_size, **kwargs)

    def build_mixer(self, layer_idx: int) -> GatedDeltaNet:
        from fla.layers.gated_deltanet import GatedDeltaNet

        return GatedDeltaNet(hidden_size=self.hidden_size, expand_v=self.expand_v,
                             head_dim=self.head_dim, num_heads=self.num_heads,
                             num_v_heads=self.num_v_heads, mode=self.attn_mode,
                             use_gate=self.use_gate, use_short_conv=self.use_short_conv,
                             conv_size=self.conv_size, allow_neg_eigval=self.allow_neg_eigval,
                             norm_eps=self.norm_eps, layer_idx=layer_idx)


def __getattr__(name: str):
    """``GatedDeltaNetModel`` and ``GatedDeltaNetForCausalLM``: the shared model classes bound to
    :class:`GatedDeltaNetConfig` (see :func:`fla.models.config.model_classes`)."""
    return lazy_model_class(GatedDeltaNetConfig, name)
