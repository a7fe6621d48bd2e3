"""Mamba2 models: the config (mixer settings) and :class:`fla.layers.Mamba2` as mixer;
blocks are ``x + mixer(norm(x))`` without an MLP, as in Mamba2."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fla.models.config import FLAConfig, lazy_model_class

if TYPE_CHECKING:  # the layers (and their kernels) are imported when a model is built
    from fla.layers.mamba2 import Mamba2


class Mamba2Config(FLAConfig):
    """Mixer settings as :class:`fla.layers.Mamba2` (``attn_mode`` is its ``mode``); the
    rest as :class:`fla.models.base.FLAConfig` (no MLP: ``hidden_ratio`` and friends are
    unused)."""

    model_type = "mamba2"
    use_mlp = False

    def __init__(self, attn_mode: str = "chunk", hidden_size: int = 2048,
                 num_heads: int | None = None, head_dim: int = 64, state_size: int = 128,
                 expand: int = 2, n_groups: int = 1, conv_kernel: int = 4,
                 use_conv_bias: bool = True, use_bias: bool = False, chunk_size: int = 256,
                 time_step_min: float = 0.001, time_step_max: float = 0.1,
                 time_step_floor: float = 1e-4,
                 time_step_limit: tuple[float, float] = (0.0, float("inf")),
                 norm_eps: float = 1e-5, **kwargs):
        self.attn_mode = attn_mode
        if num_heads is None:
            num_heads = int(expand * hidden_size) // head_dim
        self.num_heads, self.head_dim, self.state_size = num_heads, head_dim, state_size
        self.expand, self.n_groups = expand, n_groups
        self.conv_kernel, self.use_conv_bias, self.use_bias = conv_kernel, use_conv_bias, use_bias
        self.chunk_size = chunk_size
        self.time_step_min, self.time_step_max = time_step_min, time_step_max
        self.time_step_floor = time_step_floor
        self.time_step_limit = tuple(time_step_limit)
        super().__init__(hidden_size=hidden_size, norm_eps=norm_eps, **kwargs)

    def build_mixer(self, layer_idx: int) -> Mamba2:
        from fla.layers.mamba2 import Mamba2

        return Mamba2(hidden_size=self.hidden_size, num_heads=self.num_heads,
                      head_dim=self.head_dim, state_size=self.state_size, expand=self.expand,
                      n_groups=self.n_groups, conv_kernel=self.conv_kernel,
                      use_conv_bias=self.use_conv_bias, use_bias=self.use_bias,
                      norm_eps=self.norm_eps, chunk_size=self.chunk_size,
                      time_step_min=self.time_step_min, time_step_max=self.time_step_max,
                      time_step_floor=self.time_step_floor,
                      time_step_limit=self.time_step_limit, mode=self.attn_mode,
                      layer_idx=layer_idx)


def __getattr__(name: str):
    """``Mamba2Model`` and ``Mamba2ForCausalLM``: the shared model classes bound to
    :class:`Mamba2Config` (see :func:`fla.models.config.model_classes`)."""
    return lazy_model_class(Mamba2Config, name)
