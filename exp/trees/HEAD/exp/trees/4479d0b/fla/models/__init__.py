"""Hugging Face models: ``{DeltaNet, GatedDeltaNet, GLA, RetNet, RWKV6, RWKV7, Mamba2,
Transformer}{Config, Model, ForCausalLM}``, registered with transformers' AutoConfig /
AutoModel / AutoModelForCausalLM on import (``import fla`` imports this package), and the
generation :class:`Cache`, and :func:`decode` (decoding with the step replayed from a
CUDA graph).

Importing this package is light: the configs are registered with ``AutoConfig`` here,
while the model classes, which import transformers' modeling stack (and Triton), are
created and registered with ``AutoModel`` / ``AutoModelForCausalLM`` when a config of
their architecture is first built or one of their names is first imported (see
:mod:`fla.models.config`). Layers and kernels are imported when a model is built.
"""
from transformers import AutoConfig

from fla.models.config import FLAConfig, model_classes
from fla.models.delta_net import DeltaNetConfig
from fla.models.gated_deltanet import GatedDeltaNetConfig
from fla.models.generation import decode, graph_capturable
from fla.models.gla import GLAConfig
from fla.models.mamba2 import Mamba2Config
from fla.models.retnet import RetNetConfig
from fla.models.rwkv6 import RWKV6Config
from fla.models.rwkv7 import RWKV7Config
from fla.models.transformer import TransformerConfig
from fla.models.utils import Cache

CONFIGS = (DeltaNetConfig, GatedDeltaNetConfig, GLAConfig, RetNetConfig, RWKV6Config,
           RWKV7Config, Mamba2Config, TransformerConfig)
_BY_NAME = {f"{config.__name__.removesuffix('Config')}{kind}": (config, i)
            for config in CONFIGS for i, kind in enumerate(("Model", "ForCausalLM"))}

# exist_ok: transformers ships its own 'mamba2' model type; this library's config takes
# the name while fla is imported (as the reference library does).
for _config in CONFIGS:
    AutoConfig.register(_config.model_type, _config, exist_ok=True)


def __getattr__(name: str):
    if name in _BY_NAME:
        config, i = _BY_NAME[name]
        return model_classes(config)[i]
    if name == "MODELS":  # {config: (Model, ForCausalLM)} of every architecture
        return {config: model_classes(config) for config in CONFIGS}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Cache", "CONFIGS", "FLAConfig", "MODELS", "decode", "graph_capturable"] + [
    name for config in CONFIGS for name in
    (config.__name__, *(n for n in _BY_NAME if _BY_NAME[n][0] is config))]
