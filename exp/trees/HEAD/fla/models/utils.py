"""The generation cache shared by every model: per layer, a recurrent state, the short
convolutions' states and the attention keys/values, plus the tokens each layer has seen.

It is a plain object, not a subclass of ``transformers.Cache``: that class changed shape
between transformers 4.5x and 5.x (layer objects, lazy layers, offloading), and the models
tell ``generate()`` not to build a cache of its own (``_supports_default_dynamic_cache``
returns False), so nothing outside this library needs the base class. What ``generate()``
does call is here: ``get_seq_length``, ``reorder_cache`` (beam search) and
``is_compileable``.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["Cache"]


class Cache:
    """Per-layer decoding state.

    ``cache[i]`` is layer i's dict (or None before its first update)::

        recurrent_state  [N, H, K, V] float32 (Mamba2: [N, H, P, N_state])
        conv_state       tuple of [N, D, W] short-convolution caches (most recent last)
        attn_state       (k, v), each [B, L, H_kv, D]: the last L tokens' keys and values
                         (L ≤ window_size for sliding-window layers)
        ffn_state        the block's feed-forward state, if it has one (RWKV channel mix:
                         the last token's input [N, D] for its token shift)

    ``get_seq_length(i)`` counts the tokens layer i has consumed (positions, padding
    included).
    """

    is_compileable = False  # read by generate() when it decides on auto-compilation

    def __init__(self) -> None:
        self.states: list[dict[str, Any] | None] = []
        self.seen_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, layer_idx: int) -> dict[str, Any] | None:
        return self.states[layer_idx] if 0 <= layer_idx < len(self.states) else None

    def __repr__(self) -> str:
        return f"Cache(layers={len(self.states)}, seen_tokens={self.seen_tokens})"

    def _grow(self, layer_idx: int) -> None:
        while len(self.states) <= layer_idx:
            self.states.append(None)
            self.seen_tokens.append(0)

    def update(
        self,
        layer_idx: int,
        recurrent_state: torch.Tensor | None = None,
        attn_state: tuple[torch.Tensor, torch.Tensor] | None = None,
        conv_state: Any = None,
        offset: int = 1,
        ffn_state: Any = None,
        window_size: int | None = None,
    ) -> dict[str, Any]:
        """Record layer ``layer_idx``'s state after it consumed ``offset`` more tokens.

        ``recurrent_state``, ``conv_state`` and ``ffn_state`` replace the stored ones (a
        feed-forward updating after its layer's mixer passes ``offset=0``). ``attn_state`` holds
        the *new* tokens' (k, v) ``[B, T, H_kv, D]``: they are appended to the stored
        ones, and only the last ``window_size`` are kept when a window is given.

        Returns the layer's dict, whose ``attn_state`` is the full (k, v) the current
        queries attend to (appended, not yet cut to the window).
        """
        self._grow(layer_idx)
        state = self.states[layer_idx] or {"recurrent_state": None, "attn_state": None,
                                           "conv_state": None, "ffn_state": None}
        if recurrent_state is not None:
            state["recurrent_state"] = recurrent_state
        if conv_state is not None:
            state["conv_state"] = conv_state
        if ffn_state is not None:
            state["ffn_state"] = ffn_state
        full = None
        if attn_state is not None:
            k, v = attn_state
            if state["attn_state"] is not None:
                k_old, v_old = state["attn_state"]
                k, v = torch.cat([k_old, k], dim=1), torch.cat([v_old, v], dim=1)
            full = (k, v)
            if window_size is not None and k.shape[1] > window_size:
                k, v = k[:, -window_size:], v[:, -window_size:]
            state["attn_state"] = (k, v)
        self.states[layer_idx] = state
        self.seen_tokens[layer_idx] += int(offset)
        return state if full is None else {**state, "attn_state": full}

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Tokens seen by layer ``layer_idx`` (0 before any update)."""
        layer_idx = 0 if layer_idx is None else layer_idx
        return self.seen_tokens[layer_idx] if layer_idx < len(self.seen_tokens) else 0

    def get_max_length(self) -> None:
        return None  # no fixed capacity

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows (beam search): every tensor's dim 0 is indexed by beam_idx."""
        def pick(x):
            if isinstance(x, torch.Tensor):
                return x.index_select(0, beam_idx.to(x.device))
            if isinstance(x, (tuple, list)):
                return type(x)(pick(t) for t in x)
            return x
        self.states = [None if s is None else {k: pick(v) for k, v in s.items()}
                       for s in self.states]
