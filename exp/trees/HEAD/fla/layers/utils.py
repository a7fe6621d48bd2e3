"""Helpers shared by the token-mixing layers: checks of the common forward arguments,
padding masks, rotary offsets of left-padded rows, the decoding-mode switch and the
cache hand-off.

Padding. A 2-D ``attention_mask [B, L]`` (1 = token, 0 = padding; L ≥ T, the last T
columns belong to this call's tokens) marks positions that must not exist for the
recurrence. Layers make them absent exactly rather than approximately: the inputs of the
short convolutions are zeroed there (so a real token's window sees zeros before its
sequence starts, as it would alone with an empty history), and the recurrence's write is
switched off (k = v = 0, β = 0, log decay g = 0, Mamba's dt = 0), which leaves the state
bit-for-bit unchanged. Outputs at padded positions are meaningless.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fla.modules import FusedRMSNormGated, RMSNorm, ShortConvolution
from fla.modules.convolution import causal_conv1d
from fla.modules.l2norm import l2norm
from fla.modules.qkv_l2norm import split_qkv_l2norm

MODES = ("chunk", "fused_recurrent")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return mode


def decode_mode(mode: str, T: int) -> str:
    """The recurrent kernel for single-token steps (decoding), ``mode`` otherwise."""
    return "fused_recurrent" if T == 1 else mode


def begin_forward(layer, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                  past_key_values, cu_seqlens: torch.Tensor | None):
    """The first step of a recurrent layer's ``forward``: check the arguments
    (:func:`check_layer_inputs`), choose the kernel (:func:`decode_mode`: recurrent for a
    single-token step), the real tokens (:func:`token_mask`) and the layer's cache entry
    (:func:`cached_state`). Returns ``(mode, mask, state)``."""
    check_layer_inputs(hidden_states, layer.hidden_size, attention_mask, cu_seqlens)
    T = hidden_states.shape[1]
    return (decode_mode(layer.mode, T), token_mask(attention_mask, T),
            cached_state(past_key_values, layer.layer_idx))


def check_heads(hidden_size: int, num_heads: int, key_dim: int, value_dim: int) -> None:
    """Widths a multi-head layer can split: positive, and key/value widths divisible by
    the number of heads."""
    for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    for name, value in (("key_dim", key_dim), ("value_dim", value_dim)):
        if value < 1 or value % num_heads:
            raise ValueError(f"{name} = {value} (from hidden_size = {hidden_size} and the "
                             f"expansion) is not divisible by num_heads = {num_heads}")


def check_layer_inputs(hidden_states: torch.Tensor, hidden_size: int,
                       attention_mask: torch.Tensor | None,
                       cu_seqlens: torch.Tensor | None = None) -> None:
    """``hidden_states [B, T, hidden_size]``; ``attention_mask [B, L ≥ T]`` (2-D, padding
    only); not both a mask and ``cu_seqlens``. Raises ``ValueError`` naming the argument."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        raise ValueError(f"hidden_states: expected a [B, T, {hidden_size}] tensor, got "
                         f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
    B, T, D = hidden_states.shape
    if D != hidden_size:
        raise ValueError(f"hidden_states: expected last dim hidden_size = {hidden_size}, got "
                         f"shape {tuple(hidden_states.shape)}")
    if attention_mask is not None:
        check_attention_mask(attention_mask, B, T)
        if cu_seqlens is not None:
            raise ValueError("attention_mask and cu_seqlens: give one of them (packed "
                             "sequences have no padding)")


def check_attention_mask(attention_mask: torch.Tensor, B: int, T: int) -> None:
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a tensor, got "
                        f"{type(attention_mask).__name__}")
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
        raise ValueError(
            f"attention_mask: expected a 2-D padding mask [batch, length] = [{B}, L >= {T}] "
            f"(1 for tokens, 0 for padding; the last {T} columns are this call's tokens), "
            f"got shape {tuple(attention_mask.shape)}")


def token_mask(attention_mask: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """``[B, T]`` bool: which of this call's tokens are real (None: all of them)."""
    if attention_mask is None:
        return None
    return attention_mask[:, -T:].bool()


def mask_tokens(x: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | None:
    """Zero ``x [B, T, ...]`` where ``mask [B, T]`` is False."""
    if x is None or mask is None:
        return x
    return x * mask.view(*mask.shape, *([1] * (x.dim() - 2))).to(x.dtype)


def position_offsets(attention_mask: torch.Tensor | None, seen: int) -> int | torch.Tensor:
    """Rotary position of this call's first token, per row: ``seen`` minus the row's
    padding (its first real token is position 0, as it would be alone). ``attention_mask``
    must then cover every position seen so far (``generate()`` passes it so)."""
    if attention_mask is None:
        return seen
    return seen - (attention_mask == 0).sum(-1)


def cached_state(past_key_values, layer_idx: int | None) -> dict | None:
    """Layer ``layer_idx``'s dict in the cache, or None."""
    if past_key_values is None or layer_idx is None:
        return None
    return past_key_values[layer_idx]


def cache_entry(state: dict | None, name: str):
    """``state[name]`` (``'recurrent_state'``, ``'conv_state'``, ...) of the layer's cache
    dict from :func:`cached_state`; None without a cache."""
    return None if state is None else state[name]


def update_cache(past_key_values, layer_idx: int | None, use_cache: bool, offset: int,
                 **entries) -> None:
    """Write this call's ``entries`` (``recurrent_state=``, ``conv_state=``, ...) into the
    layer's cache entry, counting ``offset`` new tokens; only with ``use_cache``."""
    if past_key_values is not None and use_cache:
        past_key_values.update(layer_idx, offset=offset, **entries)


def seen_tokens(past_key_values, layer_idx: int | None) -> int:
    if past_key_values is None or layer_idx is None:
        return 0
    return past_key_values.get_seq_length(layer_idx)


def short_conv(conv, x: torch.Tensor, cache: torch.Tensor | None, use_cache: bool,
               mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None):
    """Run a :class:`fla.modules.ShortConvolution` on ``x [B, T, D]`` with its padded
    positions zeroed first; returns ``(y, new_cache or None)``. A single-token step
    updates the cache in place, so without ``use_cache`` it runs on a copy: a call that
    does not store its state must leave the stored one as it was."""
    if cache is not None and not use_cache:
        cache = cache.clone()
    return conv(mask_tokens(x, mask), cache=cache, output_final_state=use_cache,
                cu_seqlens=cu_seqlens)


def short_convs(convs, xs, conv_state, use_cache: bool, mask: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None):
    """:func:`short_conv` over matching lists ``convs`` and ``xs`` (e.g. q, k, v), with
    ``conv_state`` the tuple of their caches (or None). Returns ``(ys, new_state)``;
    new_state is a tuple, or None unless ``use_cache``."""
    ys, states = [], []
    for i, (conv, x) in enumerate(zip(convs, xs)):
        y, s = short_conv(conv, x, None if conv_state is None else conv_state[i], use_cache,
                          mask, cu_seqlens)
        ys.append(y)
        states.append(s)
    return ys, (tuple(states) if use_cache else None)


def qkv_short_convs(key_dim: int, value_dim: int, conv_size: int, conv_bias: bool):
    """The SiLU short convolutions of q, k (``key_dim`` channels) and v (``value_dim``),
    created in that order; :func:`project_qkv` runs them as ``layer.q_conv1d``, ..."""
    return tuple(ShortConvolution(width, conv_size, bias=conv_bias, activation="silu")
                 for width in (key_dim, key_dim, value_dim))


def output_norm(head_v_dim: int, gated: bool, eps: float, activation: str = "swish"):
    """The per-head output norm :func:`gated_output` applies: RMSNorm gated by
    ``activation`` of ``g_proj(x)`` when ``gated``, else a plain RMSNorm."""
    if gated:
        return FusedRMSNormGated(head_v_dim, eps=eps, activation=activation)
    return RMSNorm(head_v_dim, eps=eps)


def _plain(module: torch.nn.Module, kind: type) -> bool:
    """``module`` is exactly ``kind`` with no hooks: its forward is its weights' maths, so
    reading the weights directly (fusing it with others) computes the same thing. An
    adapter (LoRA), a quantized or tensor-parallel Linear, or a hook changes that."""
    return (type(module) is kind and not module._forward_hooks
            and not module._forward_pre_hooks)


def fused_linear(x: torch.Tensor, *linears: torch.nn.Linear) -> torch.Tensor:
    """``cat([l(x) for l in linears], -1)`` as one GEMM over the concatenated weights:
    one launch and one read of x forward, and backward one dX GEMM instead of one per
    projection plus the sums of their input gradients. Modules that are not plain
    ``nn.Linear`` (:func:`_plain`: adapters, hooks) run their own forward instead."""
    if not all(_plain(lin, torch.nn.Linear) for lin in linears):
        return torch.cat([lin(x) for lin in linears], dim=-1)
    weight = torch.cat([lin.weight for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else lin.weight.new_zeros(lin.out_features)
         for b, lin in zip(biases, linears)])
    return F.linear(x, weight, bias)


class _SharedInputLinear(torch.autograd.Function):
    """``[x @ w_g.T for each group g]`` with ``w`` the groups' weights stacked by rows:
    one autograd node whose backward accumulates dx with ``addmm_`` (beta = 1, the sum
    inside the GEMM) instead of one dx GEMM per group plus separate sums."""

    @staticmethod
    def forward(ctx, x, weight, widths):
        outs, start = [], 0
        for width in widths:
            # F.linear's outputs are fresh tensors (not views): a caller may modify them
            # in place, as it could the separate projections'.
            outs.append(F.linear(x, weight[start:start + width]))
            start += width
        ctx.save_for_backward(x, weight)
        ctx.widths = widths
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts):
        x, weight = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dx, dweights, start = None, [], 0
        for width, d in zip(ctx.widths, douts):
            w = weight[start:start + width]
            start += width
            if d is None:
                dweights.append(torch.zeros_like(w) if need_dw else None)
                continue
            d2 = d.reshape(-1, width)
            if need_dx:
                dx = torch.mm(d2, w) if dx is None else torch.addmm(dx, d2, w)
            dweights.append(torch.mm(d2.t(), x2) if need_dw else None)
        dweight = torch.cat(dweights) if need_dw else None
        return (None if dx is None else dx.view(x.shape)), dweight, None


_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def shared_input_linears(x: torch.Tensor, *groups) -> list[torch.Tensor]:
    """``[fused_linear(x, *group) for group in groups]``: the projections of one input
    ``x [..., d]`` (a mixer's q/k/v, gates, ...), each group's outputs concatenated
    (``[..., Σ out_features]``, contiguous).

    Plain bias-free ``nn.Linear`` modules (:func:`_plain`) run as one autograd node: one
    cast of the stacked weights under autocast, one GEMM per group forward, and backward
    the input gradient summed inside the GEMMs (``addmm_``) rather than by a separate add
    per extra group. Anything else runs through :func:`fused_linear` per group. (On the
    one-node path a group whose output the loss does not reach gets zero gradients
    rather than None: its weights are rows of the one stacked weight.)"""
    linears = [lin for group in groups for lin in group]
    if not all(_plain(lin, torch.nn.Linear) and lin.bias is None for lin in linears):
        return [fused_linear(x, *group) for group in groups]
    weight = torch.cat([lin.weight for lin in linears])
    device = x.device.type
    # Autocast's rule for a Linear: 16/32-bit float inputs run in its dtype, float64 not.
    if torch.is_autocast_enabled(device) and x.dtype in _AUTOCAST_ELIGIBLE:
        dtype = torch.get_autocast_dtype(device)
        weight, x = weight.to(dtype), x.to(dtype)
    if weight.dtype != x.dtype:  # F.linear's own error message for the mismatch
        return [fused_linear(x, *group) for group in groups]
    widths = tuple(sum(lin.out_features for lin in group) for group in groups)
    return list(_SharedInputLinear.apply(x, weight, widths))


def _fusable(linears, convs) -> bool:
    """Whether :func:`project_qkv` may run ``linears`` as one GEMM and ``convs`` (or
    None) as one convolution: plain modules (:func:`_plain`), and convolutions alike in
    kernel width, activation and having a bias or not."""
    if not all(_plain(lin, torch.nn.Linear) for lin in linears):
        return False
    if convs is None:
        return True
    first = convs[0]
    return all(_plain(c, ShortConvolution) and c.width == first.width
               and c.activation == first.activation
               and (c.bias is None) == (first.bias is None) for c in convs)


def project_qkv(layer, hidden_states: torch.Tensor, state: dict | None, use_cache: bool,
                mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None, extra=(),
                qk_l2norm: bool = False):
    """q, k, v of ``hidden_states [B, T, d]`` by ``layer.q_proj``, ``k_proj``, ``v_proj``,
    then, with ``layer.use_short_conv``, its ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` (see
    :func:`short_convs`; their caches are the ``conv_state`` of ``state``). Returns
    ``(q, k, v, conv_state)``, each of q, k, v ``[B, T, width]``; conv_state is None unless
    the convolutions ran with ``use_cache``.

    Without caches in or out (training, a plain forward), the three projections run as
    one GEMM and the three depthwise convolutions as one over the concatenated channels
    (the same maths: a depthwise kernel treats channels independently); q, k and v are
    then views of one ``[B, T, 2·key + value]`` tensor. With caches, or modules that are
    not plain (:func:`_fusable`), the three run apart, each with its own cache.

    ``extra``: more groups of Linears reading ``hidden_states`` (a layer's gate
    projections); their outputs (:func:`shared_input_linears`, with q/k/v's when fused)
    follow ``conv_state`` in the returned tuple.

    ``qk_l2norm``: q and k come back normalised to unit L2 norm per head of
    ``layer.head_k_dim`` (after the convolutions, so only for layers whose activation is
    the convolutions' SiLU), as ``[B, T, H, head_k_dim]``. On the fused path
    :func:`fla.modules.qkv_l2norm.split_qkv_l2norm` does it in place on the fused tensor
    (no copies of q and k; one gradient tensor back, no concatenation)."""
    linears = (layer.q_proj, layer.k_proj, layer.v_proj)
    widths = [lin.out_features for lin in linears]
    convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d) if layer.use_short_conv else None
    conv_cache = cache_entry(state, "conv_state")
    if conv_cache is None and not use_cache and _fusable(linears, convs):
        qkv, *extras = shared_input_linears(hidden_states, linears, *extra)
        if convs is not None:
            bias = None if convs[0].bias is None else torch.cat([c.bias for c in convs])
            qkv, _ = causal_conv1d(mask_tokens(qkv, mask),
                                   torch.cat([c.weight for c in convs]), bias,
                                   activation=convs[0].activation, cu_seqlens=cu_seqlens)
        if qk_l2norm:
            q, k, v = split_qkv_l2norm(qkv, widths[0], layer.head_k_dim, layer.head_v_dim)
        else:
            q, k, v = qkv.split(widths, dim=-1)
        return (q, k, v, None, *extras)
    q, k, v = (lin(hidden_states) for lin in linears)
    conv_state = None
    if convs is not None:
        (q, k, v), conv_state = short_convs(convs, (q, k, v), conv_cache, use_cache, mask,
                                            cu_seqlens)
    if qk_l2norm:
        q = l2norm(q.unflatten(-1, (-1, layer.head_k_dim)))
        k = l2norm(k.unflatten(-1, (-1, layer.head_k_dim)))
    return (q, k, v, conv_state, *(fused_linear(hidden_states, *group) for group in extra))


def gated_output(layer, o: torch.Tensor, hidden_states: torch.Tensor, gated: bool,
                 gate: torch.Tensor | None = None):
    """The heads' output ``o [B, T, H, V]`` through ``layer.o_norm`` (a gated RMSNorm fed
    ``gate``, by default ``layer.g_proj(hidden_states)``, when ``gated``, else a plain
    one), heads merged, then ``layer.o_proj``: ``[B, T, d]``."""
    if gated:
        gate = layer.g_proj(hidden_states) if gate is None else gate
        o = layer.o_norm(o, gate.view(o.shape))
    else:
        o = layer.o_norm(o)
    return layer.o_proj(o.flatten(2))


def inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    """y with softplus(y) = x (x > 0), for initialising time-step biases."""
    return x + torch.log(-torch.expm1(-x))


def init_time_step_bias(n: int, dt_min: float = 0.001, dt_max: float = 0.1,
                        dt_floor: float = 1e-4) -> torch.Tensor:
    """``[n]`` biases whose softplus is log-uniform in [dt_min, dt_max] (Mamba's init)."""
    dt = torch.exp(torch.rand(n) * (torch.log(torch.tensor(dt_max)) -
                                    torch.log(torch.tensor(dt_min))) +
                   torch.log(torch.tensor(dt_min)))
    return inverse_softplus(dt.clamp(min=dt_floor))


def token_shift(x: torch.Tensor, state: torch.Tensor | None, mask: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None):
    """RWKV's token shift: each token's predecessor in its own sequence.

    ``x [B, T, D]`` (padded positions zeroed first, so that a sequence's first real token
    sees zeros, as it would alone); ``state [N, D]`` the last token of the previous call
    (None: zeros), N = B or the number of packed sequences. Returns ``(x_prev [B, T, D],
    new_state [N, D])``: the last token of every sequence, the next call's ``state``.
    """
    x = mask_tokens(x, mask)
    B, T, D = x.shape
    if cu_seqlens is None:
        first = x.new_zeros(B, 1, D) if state is None else state.to(x.dtype).unsqueeze(1)
        return torch.cat([first, x[:, :-1]], 1), x[:, -1]
    # Packed sequences (B == 1): every sequence start takes its own state (or zeros).
    N = cu_seqlens.shape[0] - 1
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    first = x.new_zeros(N, D) if state is None else state.to(x.dtype)
    x_prev = torch.cat([x.new_zeros(1, 1, D), x[:, :-1]], 1)
    x_prev = x_prev.index_copy(1, starts, first.unsqueeze(0))
    return x_prev, x[0].index_select(0, ends - 1)


def channel_ramp(n: int) -> torch.Tensor:
    """``[n]`` float32 values from 0 to 1 by channel position (the RWKV layers' per-channel
    initialisations)."""
    return torch.arange(n, dtype=torch.float32) / max(n - 1, 1)
