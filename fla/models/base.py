"""The shared base of every model: the block (norm → mixer → residual, norm → MLP →
residual), the model (embeddings, blocks, final norm), the causal-LM head with its loss,
input checks and generation. The config base, :class:`FLAConfig`, is in
:mod:`fla.models.config`.

An architecture is a config subclass that names its ``model_type``, holds its mixer's
settings and builds the mixer (:meth:`FLAConfig.build_mixer`); its ``Model`` and
``ForCausalLM`` classes are these two classes bound to that config
(:func:`fla.models.config.model_classes`). Layers listed in the config's ``attn`` entry
become softmax :class:`fla.layers.Attention` (hybrid models).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import transformers
from transformers import PreTrainedModel
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from fla.models.config import FLAConfig
from fla.modules.layernorm import _Norm
from fla.models.utils import Cache

# The layers and the losses are imported where a model is built or run, not here; the
# norms' module is imported above (every block's forward calls it).

__all__ = ["FLAConfig", "FLABlock", "FLAPreTrainedModel", "FLAModel", "FLAForCausalLM"]

# transformers 5 names tied weights as {target: source}; 4.x lists the targets.
_TRANSFORMERS_V5 = int(transformers.__version__.split(".")[0]) >= 5


def _norm_for_mixer(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
    """``(norm(s), s)`` with ``s = x + residual`` (x itself without a residual): the
    block's pre-norm, adding the residual in its kernel. Under autocast the normed output
    comes in the autocast dtype: the residual stream is float32, and autocast would cast
    it again for every Linear that reads it (four to six in a mixer) and sum their input
    gradients in float32; our norms write the autocast dtype directly (``output_dtype``),
    another norm module's output is cast once."""
    device = x.device.type
    dtype = (torch.get_autocast_dtype(device) if x.is_floating_point()
             and torch.is_autocast_enabled(device) else None)
    if isinstance(norm, _Norm):
        if residual is None:
            return norm(x, output_dtype=dtype), x
        return norm(x, residual, prenorm=True, output_dtype=dtype)
    s = x if residual is None else x + residual
    y = norm(s)
    return (y if dtype is None else y.to(dtype)), s


def _norm_sum(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``norm(x + residual)`` in the residual stream's dtype (the model's final norm)."""
    if residual is None:
        return norm(x)
    if isinstance(norm, _Norm):
        return norm(x, residual, output_dtype=residual.dtype)
    return norm(x + residual)


class FLABlock(nn.Module):
    """``s = x + mixer(norm(x))``, then ``s + mlp(norm(s))``.

    The residual additions are deferred: a block takes ``(hidden_states, residual)``, whose
    sum is its input (``residual=None``: hidden_states alone), and returns the pair whose
    sum is its output, so that each sum is formed inside the next norm's kernel (this
    block's MLP norm, the next block's pre-norm, the model's final norm) instead of by a
    separate add forward and its gradient sums backward.

    ``shared_state``: a dict that lives for one forward of the model and is handed to
    every mixer and MLP, which may read and write it (RWKV7 puts layer 0's values there
    for the value residual of the later layers). Mixers that do not use it ignore it."""

    def __init__(self, config: FLAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = config.build_norm()
        self.attn = (config.build_attention(layer_idx) if config.is_attention_layer(layer_idx)
                     else config.build_mixer(layer_idx))
        if config.use_mlp:
            self.mlp_norm = config.build_norm()
            self.mlp = config.build_mlp(layer_idx)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, use_cache: bool = False,
                output_attentions: bool = False, cu_seqlens: torch.Tensor | None = None,
                shared_state: dict | None = None, residual: torch.Tensor | None = None):
        """Returns ``(hidden_states, residual, attentions, past_key_values)``; the block's
        output is ``hidden_states + residual``."""
        hidden_states, residual = _norm_for_mixer(self.attn_norm, hidden_states, residual)
        context = dict(attention_mask=attention_mask, past_key_values=past_key_values,
                       use_cache=use_cache, cu_seqlens=cu_seqlens, shared_state=shared_state)
        hidden_states, attentions, past_key_values = self.attn(
            hidden_states, output_attentions=output_attentions, **context)
        if hasattr(self, "mlp"):
            hidden_states, residual = self.mlp_norm(hidden_states, residual, prenorm=True)
            hidden_states = self.mlp(hidden_states, **context)
        return hidden_states, residual, attentions, past_key_values


class FLAPreTrainedModel(PreTrainedModel):
    """The Hugging Face base of every model here: weight initialisation (normal with the
    config's ``initializer_range``), gradient checkpointing, ``save_pretrained`` /
    ``from_pretrained``."""
    config_class = FLAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["FLABlock"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int) -> None:
    """Integer ids ``[B, T]`` in ``[0, vocab_size)`` (``labels`` may also be −100)."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() \
            or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() != 2:
        raise ValueError(f"{name}: expected shape [batch, length], got {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name}: expected at least one token, got shape {tuple(ids.shape)}")
    if ids.is_cuda and torch.cuda.is_current_stream_capturing():
        # Values cannot be read while a CUDA graph records (fla.models.generation's
        # decoding step); its ids are the model's own argmax, always in range.
        return
    valid = ids if name != "labels" else ids[ids != -100]
    if valid.numel() == 0:
        return
    lo, hi = int(valid.min()), int(valid.max())
    if hi >= vocab_size:
        raise ValueError(f"{name}: token ids must lie in [0, vocab_size = {vocab_size}); the "
                         f"maximum is {hi}")
    if lo < 0:
        raise ValueError(f"{name}: token ids must lie in [0, vocab_size = {vocab_size}); the "
                         f"minimum is {lo}" + (" (only -100 is ignored)" if name == "labels"
                                               else ""))


class FLAModel(FLAPreTrainedModel):
    """Embeddings (then the config's embedding norm, if any), ``num_hidden_layers`` blocks,
    final norm."""

    def __init__(self, config: FLAConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        embeddings_norm = config.build_embedding_norm()
        if embeddings_norm is not None:
            self.embeddings_norm = embeddings_norm
        self.layers = nn.ModuleList(FLABlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = config.build_norm()
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def forward(self, input_ids: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None,
                past_key_values: Cache | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, cu_seqlens: torch.Tensor | None = None,
                **kwargs: Any):
        """Hidden states of ``input_ids [B, T]`` (or ``inputs_embeds [B, T, d]``).

        ``attention_mask [B, L ≥ T]``: 2-D padding mask (left padding; see
        :mod:`fla.layers.utils`). ``cu_seqlens [N + 1]``: packed sequences in a batch of
        one (B == 1), no state or attention crosses a boundary. ``past_key_values``: a
        :class:`fla.models.utils.Cache`, created when ``use_cache`` and None; ``use_cache``
        defaults to the config's in eval mode and to False in training mode.
        Everything is checked before any kernel runs.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            check_token_ids("input_ids", input_ids, self.config.vocab_size)
            B, T = input_ids.shape
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size:
                raise ValueError(f"inputs_embeds: expected [batch, length, hidden_size = "
                                 f"{self.config.hidden_size}], got {tuple(inputs_embeds.shape)}")
            B, T = inputs_embeds.shape[:2]
        from fla.utils.validation import check_cu_seqlens

        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or \
                    attention_mask.shape[1] < T:
                raise ValueError(
                    f"attention_mask: expected a 2-D padding mask [batch, length] = [{B}, L >= "
                    f"{T}] matching the inputs (its last {T} columns are theirs), got shape "
                    f"{tuple(attention_mask.shape)}")
            if cu_seqlens is not None:
                raise ValueError("attention_mask and cu_seqlens: give one of them (packed "
                                 "sequences have no padding)")
        check_cu_seqlens(cu_seqlens, T=T, B=B)
        if past_key_values is not None and not isinstance(past_key_values, Cache):
            raise TypeError(f"past_key_values: expected a fla.models.utils.Cache, got "
                            f"{type(past_key_values).__name__}")

        if use_cache is None:
            # A training forward returns no cache unless asked for one: building it costs
            # the final states and convolution caches of every layer (and keeps the q, k, v
            # projections and convolutions from running fused, fla/layers/utils.py).
            use_cache = self.config.use_cache and not self.training
        if self.gradient_checkpointing and self.training:
            use_cache = False  # recomputed blocks must not write the cache twice
        output_attentions = bool(output_attentions)
        output_hidden_states = bool(output_hidden_states)
        return_dict = getattr(self.config, "return_dict", True) if return_dict is None \
            else return_dict
        if use_cache and past_key_values is None:
            past_key_values = Cache()

        hidden_states = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if hasattr(self, "embeddings_norm"):
            hidden_states = self.embeddings_norm(hidden_states)
        all_hidden_states = [] if output_hidden_states else None
        all_attentions = [] if output_attentions else None
        shared_state: dict[str, torch.Tensor] = {}  # see FLABlock
        residual = None  # each block's input is hidden_states + residual (see FLABlock)
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states.append(hidden_states if residual is None
                                         else hidden_states + residual)
            if self.gradient_checkpointing and self.training:
                hidden_states, residual, attentions = self._checkpointed(
                    layer, hidden_states, residual, attention_mask, output_attentions,
                    cu_seqlens, shared_state)
            else:
                hidden_states, residual, attentions, past_key_values = layer(
                    hidden_states, attention_mask=attention_mask,
                    past_key_values=past_key_values, use_cache=use_cache,
                    output_attentions=output_attentions, cu_seqlens=cu_seqlens,
                    shared_state=shared_state, residual=residual)
            if output_attentions:
                all_attentions.append(attentions)
        hidden_states = _norm_sum(self.norm, hidden_states, residual)
        if output_hidden_states:
            all_hidden_states.append(hidden_states)
        cache = past_key_values if use_cache else None
        if not return_dict:
            return tuple(x for x in (hidden_states, cache, all_hidden_states, all_attentions)
                         if x is not None)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states, past_key_values=cache,
            hidden_states=None if all_hidden_states is None else tuple(all_hidden_states),
            attentions=None if all_attentions is None else tuple(all_attentions))


    def _checkpointed(self, layer: FLABlock, hidden_states, residual, attention_mask,
                      output_attentions, cu_seqlens, shared_state: dict) -> tuple:
        """One block under activation checkpointing, without the cache: returns
        ``(hidden_states, residual, attentions)``. The shared state's tensors enter and
        leave as the checkpointed function's own inputs and outputs, so that their
        gradients flow with reentrant checkpointing too (it sees only tensor arguments);
        ``shared_state`` is updated in place."""
        keys_in = list(shared_state)
        keys_out: list[str] = []

        def run(hidden_states, residual, *values):
            state = dict(zip(keys_in, values))
            hidden_states, residual, attentions, _ = layer(
                hidden_states, attention_mask=attention_mask, past_key_values=None,
                use_cache=False, output_attentions=output_attentions, cu_seqlens=cu_seqlens,
                shared_state=state, residual=residual)
            keys_out[:] = list(state)
            return (hidden_states, residual, attentions, *state.values())

        hidden_states, residual, attentions, *values = self._gradient_checkpointing_func(
            run, hidden_states, residual, *shared_state.values())
        shared_state.clear()
        shared_state.update(zip(keys_out, values))
        return hidden_states, residual, attentions


class FLAForCausalLM(FLAPreTrainedModel, GenerationMixin):
    """The model plus a linear head over the vocabulary, a shifted next-token loss and
    ``generate()`` with the recurrent cache. Subclasses set ``model_class``."""

    model_class: type[FLAModel] = FLAModel
    _tied_weights_keys = ({"lm_head.weight": "model.embeddings.weight"} if _TRANSFORMERS_V5
                          else ["lm_head.weight"])
    # The cache is this library's (recurrent states cannot be cropped): no assisted or
    # contrastive decoding, and generate() must not build a DynamicCache of its own.
    _is_stateful = True

    def __init__(self, config: FLAConfig):
        super().__init__(config)
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.criterion = None
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_decoder(self):
        return self.model

    def set_decoder(self, decoder):
        self.model = decoder

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor | None = None,
                                      past_key_values: Cache | None = None,
                                      attention_mask: torch.Tensor | None = None,
                                      inputs_embeds: torch.Tensor | None = None,
                                      use_cache: bool = True,
                                      logits_to_keep: int | None = None, **kwargs):
        """Feed only the tokens the cache has not seen (the whole prompt first)."""
        if not isinstance(past_key_values, Cache):
            past_key_values = None
        seen = 0 if past_key_values is None else past_key_values.get_seq_length()
        if seen > 0:
            # With inputs_embeds, generate() holds only the generated ids: take the last.
            new = input_ids.shape[1] - seen
            model_inputs = {"input_ids": input_ids[:, -(new if new > 0 else 1):].contiguous()}
        elif inputs_embeds is not None:
            model_inputs = {"inputs_embeds": inputs_embeds}
        else:
            model_inputs = {"input_ids": input_ids.contiguous()}
        model_inputs.update(past_key_values=past_key_values, use_cache=use_cache,
                            attention_mask=attention_mask)
        if logits_to_keep is not None:
            model_inputs["logits_to_keep"] = logits_to_keep
        return model_inputs

    def forward(self, input_ids: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None,
                past_key_values: Cache | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                logits_to_keep: int | None = 0, cu_seqlens: torch.Tensor | None = None,
                **kwargs: Any):
        """Logits ``[B, T, vocab_size]`` (the last ``logits_to_keep`` positions when it
        is > 0) and, with ``labels [B, T]`` (−100 ignored), the mean next-token loss:
        position t predicts ``labels[t + 1]``."""
        if labels is not None:
            check_token_ids("labels", labels, self.config.vocab_size)
            shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
            if labels.shape != shape:
                raise ValueError(f"labels: expected the inputs' shape {tuple(shape)}, got "
                                 f"{tuple(labels.shape)}")
        return_dict = getattr(self.config, "return_dict", True) if return_dict is None \
            else return_dict
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             inputs_embeds=inputs_embeds, past_key_values=past_key_values,
                             use_cache=use_cache, output_attentions=output_attentions,
                             output_hidden_states=output_hidden_states, return_dict=True,
                             cu_seqlens=cu_seqlens)
        hidden_states = outputs.last_hidden_state
        loss, logits = None, None
        from fla.modules import FusedCrossEntropyLoss, FusedLinearCrossEntropyLoss

        fuse_linear = labels is not None and self.config.fuse_linear_cross_entropy
        if not fuse_linear:
            keep = hidden_states if labels is not None or not logits_to_keep \
                else hidden_states[:, -logits_to_keep:]
            logits = self.lm_head(keep)
        if labels is not None:
            # Next-token targets: shift left, the last position predicts nothing.
            target = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], 1)
            target = target.to(hidden_states.device).reshape(-1)
            if fuse_linear:
                loss = FusedLinearCrossEntropyLoss()(
                    hidden_states.reshape(-1, hidden_states.shape[-1]), target,
                    self.lm_head.weight, self.lm_head.bias)
            elif self.config.fuse_cross_entropy:
                loss = FusedCrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), target)
            else:
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                   target, ignore_index=-100)
        if not return_dict:
            out = (logits, outputs.past_key_values, outputs.hidden_states, outputs.attentions)
            out = tuple(x for x in out if x is not None)
            return (loss, *out) if loss is not None else out
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions)
