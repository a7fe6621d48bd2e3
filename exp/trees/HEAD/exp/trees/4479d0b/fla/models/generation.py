"""Fast decoding: prefill once, then one-token steps replayed from a CUDA graph.

``generate()`` of transformers runs every decoding step through Python: for a 20-layer
model that is a few hundred kernel launches and a few thousand Python calls per token, and
at small batch the GPU waits on the host (21 tokens/s for the 340M GatedDeltaNet at batch
1 on the H100, where the GPU work of a step takes about a millisecond). :func:`decode`
records one step -- the model's forward on one token per row, the choice of the next token
and the state hand-off -- as a CUDA graph and replays it, so that a step costs one graph
launch on the host.

What makes a recurrent model capturable: its per-step state has a fixed shape (the
recurrent states, the short convolutions' windows, the token-shift inputs), so the graph
can read it from, and write it back to, the same memory at every replay. Softmax attention
layers grow their key/value cache each step, and RetNet rotates q and k by a position
counted on the host: models with either are decoded eagerly (:func:`graph_capturable`).
"""
from __future__ import annotations

from contextlib import nullcontext as _nothing
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["decode", "graph_capturable"]


def graph_capturable(model) -> bool:
    """True when a decoding step of ``model`` can be replayed as recorded: every layer
    keeps a fixed-size state and nothing in the step depends on a host-side count. Softmax
    attention (its key/value cache grows each token) and RetNet's retention (its rotary
    position is the host's token count, which a replay would freeze) are decoded eagerly."""
    from fla.layers import Attention, MultiScaleRetention

    return not any(isinstance(module, (Attention, MultiScaleRetention))
                   for module in model.modules())


@dataclass
class _Choice:
    """How the next token is picked from the last position's logits."""
    do_sample: bool
    temperature: float
    top_k: int
    eos_token_id: int | None
    pad_token_id: int

    def __call__(self, logits: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """``logits [B, vocab]`` -> ``[B, 1]`` ids; rows already ``done`` get the pad id,
        and ``done [B]`` (bool) is updated in place. No host synchronisation: this runs
        inside the captured step."""
        logits = logits.float()
        if self.do_sample:
            logits = logits / self.temperature
            if self.top_k:
                kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits),
            # with no host-side branching (torch.multinomial would need none either, but
            # this keeps greedy and sampled steps the same graph shape).
            u = torch.rand_like(logits).clamp_(min=torch.finfo(torch.float32).tiny)
            logits = logits - torch.log(-torch.log(u))
        ids = logits.argmax(-1)
        ids = torch.where(done, torch.full_like(ids, self.pad_token_id), ids)
        if self.eos_token_id is not None:
            done |= ids == self.eos_token_id
        return ids.unsqueeze(1)


def _state_slots(cache) -> list[tuple[Any, Any, torch.Tensor]]:
    """Every tensor of the cache as ``(container, key, tensor)``: the layer dicts and the
    tuples inside them (conv states), so that a slot can be read and re-pointed."""
    slots = []
    for layer in cache.states:
        if layer is None:
            continue
        for name, value in layer.items():
            if isinstance(value, torch.Tensor):
                slots.append((layer, name, value))
            elif isinstance(value, (tuple, list)):
                for i, item in enumerate(value):
                    if isinstance(item, torch.Tensor):
                        slots.append(((layer, name), i, item))
    return slots


def _read(container, key) -> torch.Tensor:
    if isinstance(container, tuple):  # (layer dict, name) of a tuple entry
        layer, name = container
        return layer[name][key]
    return container[key]


def _write(container, key, tensor: torch.Tensor) -> None:
    if isinstance(container, tuple):
        layer, name = container
        items = list(layer[name])
        items[key] = tensor
        layer[name] = type(layer[name])(items)
    else:
        container[key] = tensor


def _uncached_autocast():
    """Under autocast, the same autocast without its cast cache: cached casts made during
    capture would be freed with the cache while the graph still reads them."""
    if not torch.is_autocast_enabled("cuda"):
        return _nothing()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


class _GraphedStep:
    """One decoding step captured as a CUDA graph over a fixed set of state tensors.

    The step's forward leaves its new states in fresh tensors (or, for the short
    convolutions, updates them in place); the graph copies each back into the tensor the
    next replay reads, and the cache keeps pointing at those. The tokens each layer has
    seen are counted on the host after every replay (the Python of the forward ran only
    once, at capture)."""

    def __init__(self, model, cache, ids: torch.Tensor, done: torch.Tensor, choose: _Choice,
                 stream: torch.cuda.Stream):
        self.cache, self.ids = cache, ids
        slots = _state_slots(cache)
        seen = list(cache.seen_tokens)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream), _uncached_autocast():
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits[:, -1]
            nxt = choose(logits, done)
            for container, key, static in slots:
                new = _read(container, key)
                if new is not static:
                    static.copy_(new)
                    _write(container, key, static)
            ids.copy_(nxt)
        cache.seen_tokens[:] = seen  # the capture consumed no token

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        self.cache.seen_tokens[:] = [n + 1 for n in self.cache.seen_tokens]
        return self.ids


@torch.no_grad()
def decode(model, input_ids: torch.LongTensor, max_new_tokens: int, *,
           attention_mask: torch.Tensor | None = None, do_sample: bool = False,
           temperature: float = 1.0, top_k: int = 0, eos_token_id: int | None = None,
           pad_token_id: int = 0, cuda_graph: bool | None = None,
           check_every: int = 32) -> torch.LongTensor:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids [B, T]`` with the
    recurrent cache; returns ``[B, T + n]`` (prompt then the new tokens, ``n ≤
    max_new_tokens``: fewer only when every row has produced ``eos_token_id``; rows that
    finished earlier are filled with ``pad_token_id``).

    Args:
        model: a ``fla.models`` causal LM (any architecture), in eval mode. For speed in
            bf16, cast it (``model.to(torch.bfloat16)``) rather than running under
            autocast: a captured step under autocast re-casts every weight at each token.
        attention_mask: ``[B, T]`` left-padding mask of the prompt (1 = token).
        do_sample, temperature, top_k: sampling (Gumbel-max over ``softmax(logits /
            temperature)``, restricted to the ``top_k`` largest when > 0); greedy by
            default. Seed with ``torch.manual_seed`` for reproducible draws.
        cuda_graph: replay the step from a CUDA graph (default: on CUDA tensors when
            :func:`graph_capturable`); ``False`` runs every step eagerly, ``True`` raises
            if the model cannot be captured.
        check_every: steps between host checks for "every row finished" (only with
            ``eos_token_id``).

    Greedy decoding gives the tokens of ``model.generate(..., do_sample=False)``.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature: expected > 0 when sampling, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k: expected an int >= 0, got {top_k!r}")
    if model.training:
        raise ValueError("decode: put the model in eval mode first (model.eval())")
    capturable = graph_capturable(model)
    on_cuda = input_ids.is_cuda
    if cuda_graph and not on_cuda:
        raise ValueError("cuda_graph=True needs CUDA inputs (and the model on that device)")
    if cuda_graph and not capturable:
        raise ValueError("cuda_graph=True: the model has softmax attention layers (their "
                         "key/value cache grows every step) or retention layers (their "
                         "rotary position is counted on the host); decode it with "
                         "cuda_graph=False")
    use_graph = (on_cuda and capturable) if cuda_graph is None else cuda_graph

    choose = _Choice(do_sample, float(temperature), top_k, eos_token_id, pad_token_id)
    B = input_ids.shape[0]
    out = torch.full((B, input_ids.shape[1] + max_new_tokens), pad_token_id,
                     dtype=input_ids.dtype, device=input_ids.device)
    out[:, :input_ids.shape[1]] = input_ids
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)

    # Prefill: the whole prompt (chunked kernels), its last position's logits.
    result = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                   logits_to_keep=1)
    cache = result.past_key_values
    ids = choose(result.logits[:, -1], done)
    pos = input_ids.shape[1]
    out[:, pos:pos + 1] = ids
    n = 1
    mask = attention_mask

    def eager_step(ids: torch.Tensor) -> torch.Tensor:
        nonlocal mask
        if mask is not None:  # attention layers read the whole mask; keep it growing
            mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
        logits = model(input_ids=ids, attention_mask=mask if not capturable else None,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        return choose(logits[:, -1], done)

    # Eager steps first: on the graph path they compile and tune every kernel the step
    # launches (nothing may compile or synchronise during capture). They run on the side
    # stream that captures, as CUDA graph capture wants its warm-up.
    stream = torch.cuda.Stream() if use_graph else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream) if stream is not None else _nothing():
        warm = 2 if use_graph else max_new_tokens
        while n < min(warm + 1, max_new_tokens):
            if eos_token_id is not None and n % check_every == 0 and bool(done.all()):
                break
            ids = eager_step(ids)
            out[:, pos + n:pos + n + 1] = ids
            n += 1
        finished = eos_token_id is not None and bool(done.all())
        if use_graph and n < max_new_tokens and not finished:
            step = _GraphedStep(model, cache, ids.clone(), done, choose, stream)
    if stream is not None and not finished:
        torch.cuda.current_stream().wait_stream(stream)
        while n < max_new_tokens:
            if eos_token_id is not None and n % check_every == 0 and bool(done.all()):
                break
            out[:, pos + n:pos + n + 1] = step()
            n += 1
    if eos_token_id is not None:
        # Stop after the step where the last row finished (as generate() does).
        eos = out[:, pos:pos + n] == eos_token_id
        first = torch.where(eos.any(1), eos.int().argmax(1), torch.full_like(eos[:, 0], n,
                                                                             dtype=torch.long))
        n = min(n, int(first.max()) + 1)
    return out[:, :pos + n]
