"""GLA models: the config (mixer settings) and :class:`fla.layers.GatedLinearAttention`
as mixer."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fla.models.config import FLAConfig, lazy_model_class

if TYPE_CHECKING:  # the layers (and their kernels) are imported when a model is built
    from fla.layers.gla import GatedLinearAttention


class GLAConfig(FLAConfig):
    """Mixer settings as :class:`fla.layers.GatedLinearAttention` (``attn_mode`` is its
    ``mode``); the rest as :class:`fla.models.base.FLAConfig`."""

    model_type = "gla"

    def __init__(self, attn_mode: str = "chunk", hidden_size: int = 2048,
                 expand_k: float = 0.5, expand_v: float = 1.0, num_heads: int = 4,
                 use_short_conv: bool = False, conv_size: int = 4, use_output_gate: bool = True,
                 gate_fn: str = "swish", gate_low_rank_dim: int = 16,
                 gate_logit_normalizer: float = 16, clamp_min: float | None = None, **kwargs):
        self.attn_mode = attn_mode
        self.expand_k, self.expand_v, self.num_heads = expand_k, expand_v, num_heads
        self.use_short_conv, self.conv_size = use_short_conv, conv_size
        self.use_output_gate, self.gate_fn = use_output_gate, gate_fn
        self.gate_low_rank_dim = gate_low_rank_dim
        self.gate_logit_normalizer, self.clamp_min = gate_logit_normalizer, clamp_min
        super().__init__(hidden_size=hidden_size, **kwargs)

    def build_mixer(self, layer_idx: int) -> GatedLinearAttention:
        from fla.layers.gla import GatedLinearAttention

        return GatedLinearAttention(
            hidden_size=self.hidden_size, expand_k=self.expand_k, expand_v=self.expand_v,
            num_heads=self.num_heads, mode=self.attn_mode, use_short_conv=self.use_short_conv,
            conv_size=self.conv_size, use_output_gate=self.use_output_gate,
            gate_fn=self.gate_fn, gate_low_rank_dim=self.gate_low_rank_dim,
            gate_logit_normalizer=self.gate_logit_normalizer, clamp_min=self.clamp_min,
            norm_eps=self.norm_eps, layer_idx=layer_idx)


def __getattr__(name: str):
    """``GLAModel`` and ``GLAForCausalLM``: the shared model classes bound to
    :class:`GLAConfig` (see :func:`fla.models.config.model_classes`)."""
    return lazy_model_class(GLAConfig, name)
