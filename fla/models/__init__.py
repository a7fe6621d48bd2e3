"""Hugging Face models: ``{DeltaNet, GatedDeltaNet, GLA, RetNet, Mamba2, Transformer}{Config,
Model, ForCausalLM}``, registered with transformers' AutoConfig / AutoModel /
AutoModelForCausalLM on import (``import fla`` imports this package), and the
generation :class:`Cache`."""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from fla.models.base import FLAConfig
from fla.models.delta_net import DeltaNetConfig, DeltaNetForCausalLM, DeltaNetModel
from fla.models.gated_deltanet import (
    GatedDeltaNetConfig,
    GatedDeltaNetForCausalLM,
    GatedDeltaNetModel,
)
from fla.models.gla import GLAConfig, GLAForCausalLM, GLAModel
from fla.models.mamba2 import Mamba2Config, Mamba2ForCausalLM, Mamba2Model
from fla.models.retnet import RetNetConfig, RetNetForCausalLM, RetNetModel
from fla.models.rwkv6 import RWKV6Config, RWKV6ForCausalLM, RWKV6Model
from fla.models.rwkv7 import RWKV7Config, RWKV7ForCausalLM, RWKV7Model
from fla.models.transformer import TransformerConfig, TransformerForCausalLM, TransformerModel
from fla.models.utils import Cache

MODELS = {
    DeltaNetConfig: (DeltaNetModel, DeltaNetForCausalLM),
    GatedDeltaNetConfig: (GatedDeltaNetModel, GatedDeltaNetForCausalLM),
    GLAConfig: (GLAModel, GLAForCausalLM),
    RetNetConfig: (RetNetModel, RetNetForCausalLM),
    RWKV6Config: (RWKV6Model, RWKV6ForCausalLM),
    RWKV7Config: (RWKV7Model, RWKV7ForCausalLM),
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


def _register_gate_up_merge() -> None:
    """transformers 5 loads checkpoints without ``load_state_dict``, so GatedMLP's hook
    that merges separate ``gate_proj`` / ``up_proj`` weights (the reference library's
    checkpoints) never runs there: declare the merge as a weight conversion instead.
    transformers 4.x loads through ``load_state_dict`` and the hook does it."""
    try:
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        from transformers.core_model_loading import Concatenate, WeightConverter
    except ImportError:
        return
    for config, classes in MODELS.items():
        if not config.use_mlp or config.build_mlp is not FLAConfig.build_mlp:
            continue  # no GatedMLP in the blocks
        for cls in classes:
            register_checkpoint_conversion_mapping(cls.__name__, [WeightConverter(
                source_patterns=[r"\.mlp\.gate_proj\.weight", r"\.mlp\.up_proj\.weight"],
                target_patterns=r"\.mlp\.gate_up_proj\.weight",
                operations=[Concatenate(dim=0)])], overwrite=True)


_register()
_register_gate_up_merge()

__all__ = ["Cache", "MODELS"] + [cls.__name__ for config, pair in MODELS.items()
                                 for cls in (config, *pair)]
