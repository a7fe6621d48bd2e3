"""The split's serial combine (``combine_segment_states``) against a float64 walk: each
segment's entering state and each sequence's final state, ``S ← M_s S + X_s`` (delta
form) or ``S ← diag(e^d) S + X_s`` (scalar and vector forms).

The delta form walks with the state in registers up to K = 128 (one tile) and through
memory in row tiles above it; both are run here, on sequences with one, two and three
segments, with and without initial and final states.
"""
from __future__ import annotations

import pytest
import torch

from fla.ops.common.chunk_state_combine import combine_segment_states
from tests.helpers import assert_rel_close, generator

F64 = torch.float64


def _walk(M, X, decay, form, seg_counts, h0):
    """float64 reference: ``(entering [P, H, K, V], final [N, H, K, V])``."""
    P, H, K, V = X.shape
    entering = torch.empty(P, H, K, V, dtype=F64)
    finals = []
    s = 0
    for n, count in enumerate(seg_counts):
        S = torch.zeros(H, K, V, dtype=F64) if h0 is None else h0[n].to(F64)
        for i in range(s, s + count):
            entering[i] = S
            if form == "delta":
                S = M[i].to(F64) @ S + X[i].to(F64)
            elif form == "scalar":
                S = decay[i].to(F64).exp()[:, None, None] * S + X[i].to(F64)
            else:
                S = decay[i].to(F64).exp()[:, :, None] * S + X[i].to(F64)
        finals.append(S)
        s += count
    return entering, torch.stack(finals)


@pytest.mark.interpret
@pytest.mark.parametrize("form,K", [("delta", 48), ("delta", 160), ("scalar", 48),
                                    ("vector", 48)])
@pytest.mark.parametrize("initial,final", [(True, True), (False, True), (True, False)])
def test_combine_matches_the_float64_walk(device, seed, form, K, initial, final):
    """V = 40: a partial V tile; without ``final`` the walk skips each sequence's last
    step (the forward pass's case: its output launch writes the final states)."""
    gen = generator(seed)
    H, V = 2, 40
    seg_counts = [3, 1, 2]
    P = sum(seg_counts)
    # A contractive M (near a decayed identity), as the delta rule's transitions are.
    M = 0.9 * torch.eye(K) + 0.05 * torch.randn(P, H, K, K, generator=gen) / K ** 0.5
    X = torch.randn(P, H, K, V, generator=gen)
    decay = None
    if form == "delta":
        mx = torch.cat([M, X], -1)
    else:
        mx = X
        shape = (P, H) if form == "scalar" else (P, H, K)
        decay = -torch.rand(shape, generator=gen) * 2 - 0.01
    h0 = torch.randn(len(seg_counts), H, K, V, generator=gen) if initial else None
    offsets = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    to = dict(device=device)
    ht = torch.empty(len(seg_counts), H, K, V, dtype=torch.float32, **to) if final else None
    entering = combine_segment_states(
        mx.to(**to).contiguous(), None if decay is None else decay.to(**to), form,
        offsets.to(**to), V, None if h0 is None else h0.to(**to), ht)
    ref_entering, ref_final = _walk(M, X, decay, form, seg_counts, h0)
    assert_rel_close("entering states", entering.cpu(), ref_entering, 1e-4)
    if final:
        assert_rel_close("final states", ht.cpu(), ref_final, 1e-4)


def _reverse_case(gen, H, K, V, seg_counts):
    """The reverse pass's combine inputs: ``(mx, forward_maps, reverse_m, X)``. Each
    sequence's segments are listed last to first in ``mx`` (its X only; M's columns NaN,
    never read); the forward's maps first to last, each sequence's last one NaN (the
    forward keeps no map of it). ``reverse_m`` is what the combine must use: row i the
    transpose of the forward's row s0 + s1 - 1 - i, and zero at each sequence's first
    row (it multiplies the zero entering state)."""
    P = sum(seg_counts)
    forward_m = 0.9 * torch.eye(K) + 0.05 * torch.randn(P, H, K, K, generator=gen) / K ** 0.5
    reverse_m = torch.empty(P, H, K, K)
    s = 0
    for count in seg_counts:
        forward_m[s + count - 1] = float("nan")
        for i in range(s, s + count):
            reverse_m[i] = forward_m[2 * s + count - 1 - i].transpose(-1, -2)
        reverse_m[s] = 0.
        s += count
    X = torch.randn(P, H, K, V, generator=gen)
    mx = torch.cat([torch.full((P, H, K, K), float("nan")), X], -1)
    forward_maps = torch.cat([forward_m, torch.randn(P, H, K, V, generator=gen)], -1)
    return mx, forward_maps, reverse_m, X


@pytest.mark.interpret
@pytest.mark.parametrize("K", [48, 160])
@pytest.mark.parametrize("final", [True, False])
def test_combine_takes_the_forward_maps_transposed(device, seed, K, final):
    """The reverse pass's combine with ``forward_maps`` (:func:`_reverse_case`), in both
    walks: in registers (K = 48) and through memory (K = 160)."""
    gen = generator(seed)
    H, V = 2, 40
    seg_counts = [4, 1, 2]   # four: a middle row that is not its own mirror
    mx, forward_maps, reverse_m, X = _reverse_case(gen, H, K, V, seg_counts)
    offsets = torch.tensor([0, 4, 5, 7], dtype=torch.int32)
    to = dict(device=device)
    ht = torch.empty(len(seg_counts), H, K, V, dtype=torch.float32, **to) if final else None
    entering = combine_segment_states(mx.to(**to), None, "delta", offsets.to(**to), V, None,
                                      ht, forward_maps=forward_maps.to(**to))
    ref_entering, ref_final = _walk(reverse_m, X, None, "delta", seg_counts, None)
    assert_rel_close("entering states", entering.cpu(), ref_entering, 1e-4)
    if final:
        assert_rel_close("final states", ht.cpu(), ref_final, 1e-4)


@pytest.mark.interpret
@pytest.mark.parametrize("sms,thin", [(64, True), (63, False)])
def test_thin_grid_walks_sixteen_columns(device, seed, monkeypatch, sms, thin):
    """Where every 16-column program has an SM of its own (N·H·⌈V/16⌉ = 2·4·8 = 64
    programs here), the launcher marks the grid thin and the walk runs 16 columns (under
    MIN_DOT_TILE, its fp32 dots sanitizer-checked), still giving the float64 walk, with
    and without the forward's maps."""
    from fla.ops.common import chunk_state_combine
    from tests.ops.config_sweep import record_launches
    monkeypatch.setattr(chunk_state_combine, "multiprocessor_count", lambda: sms)
    calls = record_launches(monkeypatch, chunk_state_combine.chunk_state_combine_kernel)
    gen = generator(seed)
    H, K, V, seg_counts = 4, 64, 128, [3, 2]
    offsets = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    P = sum(seg_counts)
    M = 0.9 * torch.eye(K) + 0.05 * torch.randn(P, H, K, K, generator=gen) / K ** 0.5
    X = torch.randn(P, H, K, V, generator=gen)
    final = torch.empty(len(seg_counts), H, K, V, dtype=torch.float32, device=device)
    entering = combine_segment_states(torch.cat([M, X], -1).to(device), None, "delta",
                                      offsets, V, None, final)
    ref_entering, ref_final = _walk(M, X, None, "delta", seg_counts, None)
    assert_rel_close("entering states", entering.cpu(), ref_entering, 1e-4)
    assert_rel_close("final states", final.cpu(), ref_final, 1e-4)
    mx, forward_maps, reverse_m, X = _reverse_case(gen, H, K, V, seg_counts)
    entering = combine_segment_states(mx.to(device), None, "delta", offsets, V, None, final,
                                      forward_maps=forward_maps.to(device))
    ref_entering, ref_final = _walk(reverse_m, X, None, "delta", seg_counts, None)
    assert_rel_close("entering states (maps)", entering.cpu(), ref_entering, 1e-4)
    assert_rel_close("final states (maps)", final.cpu(), ref_final, 1e-4)
    assert [named["THIN_GRID"] for _, named in calls] == [thin, thin]
    kernel = chunk_state_combine.chunk_state_combine_kernel
    # In the tuning key: else whichever case ran first would fix the width for both.
    named = calls[0][1]
    assert kernel.key_of(dict(named, THIN_GRID=True)) != kernel.key_of(
        dict(named, THIN_GRID=False))
    widths = {kernel.chosen_config(**named).meta["BV"] for _, named in calls}
    assert widths == ({16} if thin else {32})


@pytest.mark.gpu
@pytest.mark.parametrize("form,K", [("delta", 96), ("delta", 128), ("delta", 256),
                                    ("scalar", 128)])
def test_every_combine_config_gpu(form, K, device, seed, monkeypatch):
    """Each config of the combine's tuning space builds on this GPU and gives the float64
    walk (fp32 states: tf32x3 dots)."""
    from fla.ops.common.chunk_state_combine import chunk_state_combine_kernel
    from tests.ops.config_sweep import force_config
    gen = generator(seed)
    H, V, seg_counts = 4, K, [5, 3]
    P = sum(seg_counts)
    M = 0.9 * torch.eye(K) + 0.05 * torch.randn(P, H, K, K, generator=gen) / K ** 0.5
    X = torch.randn(P, H, K, V, generator=gen)
    decay = -torch.rand(P, H, generator=gen) - 0.01 if form == "scalar" else None
    mx = (torch.cat([M, X], -1) if form == "delta" else X).to(device).contiguous()
    h0 = torch.randn(len(seg_counts), H, K, V, generator=gen)
    offsets = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    ref_entering, ref_final = _walk(M, X, decay, form, seg_counts, h0)
    args = dict(K=K, V=V, h0=h0.to(device), FORM=form)
    configs = chunk_state_combine_kernel.candidates(args)
    assert configs
    for config in configs:
        with monkeypatch.context() as m:
            force_config(m, chunk_state_combine_kernel, config)
            final = torch.empty(len(seg_counts), H, K, V, dtype=torch.float32, device=device)
            entering = combine_segment_states(
                mx, None if decay is None else decay.to(device), form, offsets, V,
                h0.to(device), final)
            torch.cuda.synchronize()
        assert_rel_close(f"entering states {config}", entering.cpu(), ref_entering, 1e-4)
        assert_rel_close(f"final states {config}", final.cpu(), ref_final, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [96, 128, 256])
def test_every_combine_config_with_forward_maps_gpu(K, device, seed, monkeypatch):
    """Each config of the delta form's space with the forward's maps read transposed (the
    reverse pass without a final-state gradient) builds and gives the float64 walk."""
    from fla.ops.common.chunk_state_combine import chunk_state_combine_kernel
    from tests.ops.config_sweep import force_config
    gen = generator(seed)
    H, V, seg_counts = 4, K, [5, 3]
    mx, forward_maps, reverse_m, X = _reverse_case(gen, H, K, V, seg_counts)
    mx, forward_maps = mx.to(device), forward_maps.to(device)
    offsets = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    ref_entering, ref_final = _walk(reverse_m, X, None, "delta", seg_counts, None)
    configs = chunk_state_combine_kernel.candidates(dict(K=K, V=V, h0=None, FORM="delta"))
    assert configs
    for config in configs:
        with monkeypatch.context() as m:
            force_config(m, chunk_state_combine_kernel, config)
            final = torch.empty(len(seg_counts), H, K, V, dtype=torch.float32, device=device)
            entering = combine_segment_states(mx, None, "delta", offsets, V, None, final,
                                              forward_maps=forward_maps)
            torch.cuda.synchronize()
        assert_rel_close(f"entering states {config}", entering.cpu(), ref_entering, 1e-4)
        assert_rel_close(f"final states {config}", final.cpu(), ref_final, 1e-4)
