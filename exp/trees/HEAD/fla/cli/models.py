"""Which model ``train --model NAME`` builds, and at what size.

Names are the model types of :mod:`fla.models` (registered with transformers'
``AutoConfig`` on ``import fla``) plus a few aliases. An architecture whose config class
is not registered in this install (e.g. one still being written) is listed as
unavailable rather than failing at import.

Sizes: ``--size tiny`` (the CPU default), ``small``, ``340m`` (the multi-GPU check), and
any of ``--hidden-size``, ``--layers``, ``--head-dim`` override a preset. Each
architecture turns (hidden size, head width) into its own head settings in
:func:`mixer_kwargs`.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

# Every model type the library defines, in the order they are listed to users.
MODEL_TYPES = ("gated_deltanet", "delta_net", "retnet", "gla", "rwkv6", "rwkv7", "mamba2",
               "transformer")
ALIASES = {
    "gdn": "gated_deltanet", "gated_delta_net": "gated_deltanet",
    "gated-deltanet": "gated_deltanet", "deltanet": "delta_net", "delta-net": "delta_net",
    "mamba": "mamba2", "attention": "transformer", "llama": "transformer",
}


@dataclass(frozen=True)
class Size:
    hidden_size: int
    num_hidden_layers: int
    head_dim: int
    intermediate_size: int | None = None   # the MLP width (None: the library's default)


SIZES = {
    # ~0.5M parameters: a few minutes of training on 2 CPU cores (see train.py's default).
    "tiny": Size(hidden_size=128, num_hidden_layers=2, head_dim=32, intermediate_size=256),
    "small": Size(hidden_size=512, num_hidden_layers=8, head_dim=64),
    # The literature's "340M" shape (width 1024, 24 layers, with a 32k vocabulary); with
    # the byte vocabulary the embeddings are tiny and the blocks carry it all: 410M
    # parameters for gated_deltanet (its 2-GPU run in benchmarks/RESULTS.md).
    "340m": Size(hidden_size=1024, num_hidden_layers=24, head_dim=128),
}


class UnknownModel(ValueError):
    """The name is neither a model type nor an alias of an available one."""


def available_types() -> dict[str, type]:
    """``{model_type: config class}`` of the architectures this install provides."""
    import fla  # noqa: F401 - registers the model types with AutoConfig
    from transformers import CONFIG_MAPPING

    found: dict[str, type] = {}
    for name in MODEL_TYPES:
        try:
            cls = CONFIG_MAPPING[name]
        except KeyError:
            continue
        # transformers ships its own 'mamba2': only ours (registered by fla) counts.
        if cls.__module__.startswith("fla."):
            found[name] = cls
    return found


def resolve(name: str) -> tuple[str, type]:
    """``(model_type, config class)`` for a user-given name; UnknownModel otherwise."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    found = available_types()
    if key in found:
        return key, found[key]
    missing = [t for t in MODEL_TYPES if t not in found]
    msg = f"unknown model {name!r}; available: {', '.join(found)}"
    if key in missing:
        msg = (f"model {name!r} is not available in this install of fla (its config class "
               f"is not registered); available: {', '.join(found)}")
    elif missing:
        msg += f" (not in this install: {', '.join(missing)})"
    raise UnknownModel(msg)


def mixer_kwargs(model_type: str, hidden: int, head_dim: int) -> dict:
    """Head settings of one architecture for a hidden size and a head width."""
    heads = max(1, hidden // head_dim)
    if model_type == "gated_deltanet":
        # q/k of width heads·head_dim = hidden, v twice that (expand_v = 2).
        return {"head_dim": head_dim, "num_heads": heads, "expand_v": 2}
    if model_type in ("delta_net", "retnet", "transformer"):
        return {"num_heads": heads}
    if model_type == "gla":
        # expand_k = 0.5: key width hidden / 2, split into heads of head_dim.
        return {"num_heads": max(1, hidden // (2 * head_dim))}
    if model_type == "mamba2":
        return {"head_dim": head_dim, "num_heads": 2 * hidden // head_dim,
                "state_size": min(128, max(16, head_dim)), "expand": 2}
    return {"head_dim": head_dim, "num_heads": heads, "head_size": head_dim}


def build_config(config_cls: type, model_type: str, *, vocab_size: int, hidden_size: int,
                 num_hidden_layers: int, head_dim: int, bos_token_id: int,
                 eos_token_id: int, pad_token_id: int | None, fuse_cross_entropy: bool,
                 fuse_linear_cross_entropy: bool, max_position_embeddings: int,
                 intermediate_size: int | None = None):
    """The config object; architecture settings the config class does not take are
    dropped (so that architectures added later plug in with their defaults)."""
    accepted = set(inspect.signature(config_cls.__init__).parameters)
    extra = {k: v for k, v in mixer_kwargs(model_type, hidden_size, head_dim).items()
             if k in accepted}
    if intermediate_size is not None:
        extra["intermediate_size"] = intermediate_size
    return config_cls(vocab_size=vocab_size, hidden_size=hidden_size,
                      num_hidden_layers=num_hidden_layers, bos_token_id=bos_token_id,
                      eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                      fuse_cross_entropy=fuse_cross_entropy,
                      fuse_linear_cross_entropy=fuse_linear_cross_entropy,
                      max_position_embeddings=max_position_embeddings, **extra)
