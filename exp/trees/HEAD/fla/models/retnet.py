"""RetNet models: the config (mixer settings) and :class:`fla.layers.MultiScaleRetention`
as mixer."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fla.models.config import FLAConfig, lazy_model_class

if TYPE_CHECKING:  # the layers (and their kernels) are imported when a model is built
    from fla.layers.multiscale_retention import MultiScaleRetention


class RetNetConfig(FLAConfig):
    """Mixer settings as :class:`fla.layers.MultiScaleRetention` (``attn_mode`` is its
    ``mode``); the rest as :class:`fla.models.base.FLAConfig`."""

    model_type = "retnet"

    def __init__(self, attn_mode: str = "chunk", hidden_size: int = 2048,
                 expand_k: float = 1.0, expand_v: float = 2.0, num_heads: int = 8,
                 use_short_conv: bool = False, conv_size: int = 4, use_output_gate: bool = True,
                 gate_fn: str = "swish", rope_theta: float = 10000.0, **kwargs):
        self.attn_mode = attn_mode
        self.expand_k, self.expand_v, self.num_heads = expand_k, expand_v, num_heads
        self.use_short_conv, self.conv_size = use_short_conv, conv_size
        self.use_output_gate, self.gate_fn, self.rope_theta = use_output_gate, gate_fn, rope_theta
        super().__init__(hidden_size=hidden_size, **kwargs)

    def build_mixer(self, layer_idx: int) -> MultiScaleRetention:
        from fla.layers.multiscale_retention import MultiScaleRetention

        return MultiScaleRetention(
            hidden_size=self.hidden_size, expand_k=self.expand_k, expand_v=self.expand_v,
            num_heads=self.num_heads, mode=self.attn_mode, use_short_conv=self.use_short_conv,
            conv_size=self.conv_size, use_output_gate=self.use_output_gate,
            gate_fn=self.gate_fn, norm_eps=self.norm_eps, rope_theta=self.rope_theta,
            layer_idx=layer_idx)


def __getattr__(name: str):
    """``RetNetModel`` and ``RetNetForCausalLM``: the shared model classes bound to
    :class:`RetNetConfig` (see :func:`fla.models.config.model_classes`)."""
    return lazy_model_class(RetNetConfig, name)
