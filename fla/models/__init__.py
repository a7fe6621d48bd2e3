"""Hugging Face models: ``{DeltaNet, GatedDeltaNet, GLA, RetNet, Mamba2, Transformer}{Config,
Model, ForCausalLM}``, registered with transformers' AutoConfig / AutoModel /
AutoModelForCausalLM on import (``import fla`` imports this package), and the
generation :class:`Cache`."""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from fla.models.delta_net import DeltaNetConfig, DeltaNetForCausalLM, DeltaNetModel
from fla.models.gated_deltanet import (
    GatedDeltaNetConfig,
    GatedDeltaNetForCausalLM,
    GatedDeltaNetModel,
)
from fla.models.gla import GLAConfig, GLAForCausalLM, GLAModel
from fla.models.mamba2 import Mamba2Config, Mamba2ForCausalLM, Mamba2Model
from fla.models.retnet import RetNetConfig, RetNetForCausalLM, RetNetModel
from fla.models.transformer import TransformerConfig, TransformerForCausalLM, TransformerModel
from fla.models.utils import Cache

MODELS = {
    DeltaNetConfig: (DeltaNetModel, DeltaNetForCausalLM),
    GatedDeltaNetConfig: (GatedDeltaNetModel, GatedDeltaNetForCausalLM),
    GLAConfig: (GLAModel, GLAForCausalLM),
    RetNetConfig: (RetNetModel, RetNetForCausalLM),
    Mamba2Config: (Mamba2Model, Mamba2ForCausalLM),
    TransformerConfig: (TransformerModel, TransformerForCausalLM),
}


def _register() -> None:
    # exist_ok: transformers ships its own 'mamba2' model type; this library's classes
    # take the name while fla is imported (as the reference library does).
    for config, (model, causal_lm) in MODELS.items():
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModel.register(config, model, exist_ok=True)
        AutoModelForCausalLM.register(config, causal_lm, exist_ok=True)


_register()

__all__ = ["Cache", "MODELS"] + [cls.__name__ for config, pair in MODELS.items()
                                 for cls in (config, *pair)]
