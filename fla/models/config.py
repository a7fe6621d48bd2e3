"""The config base of every model (:class:`FLAConfig`) and the binding of each
architecture's config to its ``Model`` / ``ForCausalLM`` classes.

This module is light on purpose: it imports transformers' configuration code only.
``import fla`` registers every config with ``AutoConfig`` from here; the model classes
(transformers' modeling stack, seconds to import and Triton with it) are created, and
registered with ``AutoModel`` / ``AutoModelForCausalLM``, the first time a config of
their architecture is built (every Auto lookup of a model starts from a config instance)
or one of their names is imported.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from transformers import PretrainedConfig

if TYPE_CHECKING:
    from fla.layers.attn import Attention

__all__ = ["FLAConfig", "model_classes"]

ATTN_KEYS = ("layers", "num_heads", "num_kv_heads", "head_dim", "qkv_bias", "qk_norm",
             "window_size", "rope_theta")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


class FLAConfig(PretrainedConfig):
    """Fields shared by every architecture (names as in Flash Linear Attention's configs).

    Hooks an architecture overrides: :meth:`build_mixer` (always), :meth:`build_mlp`
    (the block's feed-forward; default the gated MLP, none when ``use_mlp`` is False) and
    :meth:`build_norm` (the blocks' and the final norm; default RMSNorm).

    Args:
        vocab_size, hidden_size, num_hidden_layers: the usual.
        hidden_ratio, intermediate_size, hidden_act, fuse_swiglu: the gated MLP of each
            block (see :class:`fla.modules.GatedMLP`).
        norm_eps: the RMSNorms' epsilon.
        attn: None, or a dict turning layers into softmax attention: ``layers`` (indices),
            ``num_heads``, and optionally ``num_kv_heads``, ``head_dim``, ``qkv_bias``,
            ``qk_norm``, ``window_size``, ``rope_theta``.
        fuse_cross_entropy: the loss through :class:`fla.modules.FusedCrossEntropyLoss`;
        fuse_linear_cross_entropy: the head and the loss fused
            (:class:`fla.modules.FusedLinearCrossEntropyLoss`; no logits are returned).
        initializer_range: std of the normal init of projections and embeddings.
    """

    use_mlp = True  # blocks carry a gated MLP (Mamba2's do not)

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 2048,
                 num_hidden_layers: int = 24, hidden_ratio: float | None = 4,
                 intermediate_size: int | None = None, hidden_act: str = "swish",
                 max_position_embeddings: int = 2048, norm_eps: float = 1e-6,
                 attn: dict | None = None, use_cache: bool = True,
                 pad_token_id: int | None = None, bos_token_id: int | None = 1,
                 eos_token_id: int | None = 2, tie_word_embeddings: bool = False,
                 initializer_range: float = 0.02, fuse_norm: bool = True,
                 fuse_swiglu: bool = True, fuse_cross_entropy: bool = True,
                 fuse_linear_cross_entropy: bool = False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.norm_eps = norm_eps
        self.attn = None if attn is None else dict(attn)
        self.use_cache = use_cache
        self.initializer_range = initializer_range
        self.fuse_norm = fuse_norm
        self.fuse_swiglu = fuse_swiglu
        self.fuse_cross_entropy = fuse_cross_entropy
        self.fuse_linear_cross_entropy = fuse_linear_cross_entropy
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, tie_word_embeddings=tie_word_embeddings,
                         **kwargs)
        self.check()
        if type(self).model_type:
            model_classes(type(self))  # an Auto lookup of the model may follow

    # ------------------------------------------------------------------ architecture
    def build_mixer(self, layer_idx: int) -> nn.Module:
        """The architecture's token mixer for layer ``layer_idx`` (subclasses)."""
        raise NotImplementedError(f"{type(self).__name__} does not define build_mixer")

    def build_mlp(self, layer_idx: int) -> nn.Module:
        """The block's feed-forward (used when ``use_mlp``): ``mlp(x, attention_mask=,
        past_key_values=, use_cache=, cu_seqlens=, shared_state=) -> y``; stateless ones
        ignore the keywords, RWKV's channel mixes keep a token-shift state in the cache."""
        from fla.modules import GatedMLP

        return GatedMLP(self.hidden_size, self.hidden_ratio, self.intermediate_size,
                        self.hidden_act, fuse_swiglu=self.fuse_swiglu)

    def build_norm(self) -> nn.Module:
        """The pre-norms of each block and the final norm (with ``residual`` and
        ``prenorm`` arguments, as :class:`fla.modules.RMSNorm`)."""
        from fla.modules import RMSNorm

        return RMSNorm(self.hidden_size, eps=self.norm_eps)

    def build_embedding_norm(self) -> nn.Module | None:
        """A norm of the token embeddings before the first block (RWKV's ``ln0``), or None
        (the default: the first block's own pre-norm is the first norm)."""
        return None

    def is_attention_layer(self, layer_idx: int) -> bool:
        return self.attn is not None and layer_idx in self.attn["layers"]

    def build_attention(self, layer_idx: int) -> Attention:
        from fla.layers.attn import Attention

        attn = self.attn
        return Attention(hidden_size=self.hidden_size, num_heads=attn["num_heads"],
                         num_kv_heads=attn.get("num_kv_heads"), head_dim=attn.get("head_dim"),
                         qkv_bias=attn.get("qkv_bias", False), qk_norm=attn.get("qk_norm", False),
                         window_size=attn.get("window_size"),
                         rope_theta=attn.get("rope_theta", 10000.0),
                         max_position_embeddings=self.max_position_embeddings,
                         norm_eps=self.norm_eps, layer_idx=layer_idx)

    # ----------------------------------------------------------------------- checks
    def check(self) -> None:
        """Raise ``ValueError`` at construction for a config no model could be built
        from: the mixers (and attention layers) are built once on the meta device, so
        their own checks (e.g. hidden size not divisible by heads) apply here."""
        _positive_int("vocab_size", self.vocab_size)
        _positive_int("hidden_size", self.hidden_size)
        _positive_int("num_hidden_layers", self.num_hidden_layers)
        if self.attn is not None:
            unknown = set(self.attn) - set(ATTN_KEYS)
            if unknown:
                raise ValueError(f"attn: unknown keys {sorted(unknown)}; expected some of "
                                 f"{list(ATTN_KEYS)}")
            if "layers" not in self.attn or "num_heads" not in self.attn:
                raise ValueError("attn: expected at least 'layers' (indices) and 'num_heads'")
            layers = self.attn["layers"]
            if not isinstance(layers, (list, tuple)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and
                    0 <= i < self.num_hidden_layers for i in layers):
                raise ValueError(f"attn['layers']: expected a list of layer indices in "
                                 f"[0, num_hidden_layers = {self.num_hidden_layers}), got "
                                 f"{layers!r}")
            self.attn["layers"] = sorted(set(layers))
        with torch.device("meta"):
            kinds = {self.is_attention_layer(i): i for i in range(self.num_hidden_layers)}
            for is_attn, i in kinds.items():
                self.build_attention(i) if is_attn else self.build_mixer(i)
            if self.use_mlp:
                self.build_mlp(0)
            self.build_norm()


_MODEL_CLASSES: dict[type, tuple[type, type]] = {}


class RWKVConfig(FLAConfig):
    """The RWKV configs' common part: LayerNorms (with a bias when ``norm_bias``) where the
    other architectures use RMSNorms, and with ``norm_first`` one more LayerNorm on the
    embeddings before the first block (RWKV's ``ln0``)."""

    def __init__(self, norm_bias: bool = True, norm_first: bool = True, **kwargs):
        self.norm_bias, self.norm_first = norm_bias, norm_first
        super().__init__(**kwargs)

    def build_norm(self) -> nn.Module:
        from fla.modules import LayerNorm

        return LayerNorm(self.hidden_size, bias=self.norm_bias, eps=self.norm_eps)

    def build_embedding_norm(self) -> nn.Module | None:
        return self.build_norm() if self.norm_first else None


def model_classes(config_class: type[FLAConfig]) -> tuple[type, type]:
    """``({Arch}Model, {Arch}ForCausalLM)`` of an architecture's config class, created on
    the first call and registered then with transformers' ``AutoModel`` and
    ``AutoModelForCausalLM``. They live in the config's module under those names
    (``fla.models.rwkv7.RWKV7ForCausalLM``), which looks them up here on first access."""
    classes = _MODEL_CLASSES.get(config_class)
    if classes is not None:
        return classes
    from transformers import AutoModel, AutoModelForCausalLM

    from fla.models.base import FLAForCausalLM, FLAModel

    name = config_class.__name__.removesuffix("Config")
    module = config_class.__module__
    model = type(f"{name}Model", (FLAModel,), {
        "config_class": config_class, "__module__": module,
        "__doc__": f"{name} backbone ({config_class.__name__}): input_ids ``[B, T]`` (or "
                   f"inputs_embeds ``[B, T, hidden_size]``) to hidden states ``[B, T, "
                   f"hidden_size]``, with the recurrent cache. " + FLAModel.__doc__})
    causal_lm = type(f"{name}ForCausalLM", (FLAForCausalLM,), {
        "config_class": config_class, "model_class": model, "__module__": module,
        "__doc__": f"{name} language model ({config_class.__name__}): input_ids ``[B, T]`` "
                   f"to logits ``[B, T, vocab_size]`` and the loss against ``labels [B, "
                   f"T]``. " + FLAForCausalLM.__doc__})
    for cls in (model, causal_lm):
        cls.__qualname__ = cls.__name__
        setattr(sys.modules[module], cls.__name__, cls)
    # exist_ok: transformers ships its own 'mamba2' model type; this library's classes
    # take the name while fla is imported (as the reference library does).
    AutoModel.register(config_class, model, exist_ok=True)
    AutoModelForCausalLM.register(config_class, causal_lm, exist_ok=True)
    if config_class.use_mlp and config_class.build_mlp is FLAConfig.build_mlp:
        _register_gate_up_merge(model, causal_lm)
    _MODEL_CLASSES[config_class] = (model, causal_lm)
    return model, causal_lm


def lazy_model_class(config_class: type[FLAConfig], name: str) -> type:
    """Module ``__getattr__`` of an architecture file: its model class ``name``."""
    arch = config_class.__name__.removesuffix("Config")
    if name not in (f"{arch}Model", f"{arch}ForCausalLM"):
        raise AttributeError(f"module {config_class.__module__!r} has no attribute {name!r}")
    for cls in model_classes(config_class):
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {config_class.__module__!r} has no attribute {name!r}")


def _register_gate_up_merge(*classes: type) -> None:
    """transformers 5 loads checkpoints without ``load_state_dict``, so GatedMLP's hook
    that merges separate ``gate_proj`` / ``up_proj`` weights (the reference library's
    checkpoints) never runs there: declare the merge as a weight conversion instead.
    transformers 4.x loads through ``load_state_dict`` and the hook does it."""
    try:
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        from transformers.core_model_loading import Concatenate, WeightConverter
    except ImportError:
        return
    for cls in classes:
        register_checkpoint_conversion_mapping(cls.__name__, [WeightConverter(
            source_patterns=[r"\.mlp\.gate_proj\.weight", r"\.mlp\.up_proj\.weight"],
            target_patterns=r"\.mlp\.gate_up_proj\.weight",
            operations=[Concatenate(dim=0)])], overwrite=True)
