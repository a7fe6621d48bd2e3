"""DeltaNet models: the config (mixer settings) and :class:`fla.layers.DeltaNet` as mixer."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fla.models.config import FLAConfig, lazy_model_class

if TYPE_CHECKING:  # the layers (and their kernels) are imported when a model is built
    from fla.layers.delta_net import DeltaNet


class DeltaNetConfig(FLAConfig):
    """Mixer settings as :class:`fla.layers.DeltaNet` (``attn_mode`` is its ``mode``);
    the rest as :class:`fla.models.base.FLAConfig`."""

    model_type = "delta_net"

    def __init__(self, attn_mode: str = "chunk", hidden_size: int = 2048,
                 expand_k: float = 1.0, expand_v: float = 1.0, num_heads: int = 16,
                 use_gate: bool = False, use_short_conv: bool = True, conv_size: int = 4,
                 use_beta: bool = True, allow_neg_eigval: bool = False,
                 qk_norm: str = "l2", qk_activation: str = "silu", **kwargs):
        self.attn_mode = attn_mode
        self.expand_k, self.expand_v, self.num_heads = expand_k, expand_v, num_heads
        self.use_gate, self.use_short_conv, self.conv_size = use_gate, use_short_conv, conv_size
        self.use_beta, self.allow_neg_eigval = use_beta, allow_neg_eigval
        self.qk_norm, self.qk_activation = qk_norm, qk_activation
        super().__init__(hidden_size=hidden_size, **kwargs)

    def build_mixer(self, layer_idx: int) -> DeltaNet:
        from fla.layers.delta_net import DeltaNet

        return DeltaNet(hidden_size=self.hidden_size, expand_k=self.expand_k,
                        expand_v=self.expand_v, num_heads=self.num_heads, mode=self.attn_mode,
                        use_beta=self.use_beta, use_gate=self.use_gate,
                        use_short_conv=self.use_short_conv, conv_size=self.conv_size,
                        allow_neg_eigval=self.allow_neg_eigval, qk_activation=self.qk_activation,
                        qk_norm=self.qk_norm, norm_eps=self.norm_eps, layer_idx=layer_idx)


def __getattr__(name: str):
    """``DeltaNetModel`` and ``DeltaNetForCausalLM``: the shared model classes bound to
    :class:`DeltaNetConfig` (see :func:`fla.models.config.model_classes`)."""
    return lazy_model_class(DeltaNetConfig, name)
