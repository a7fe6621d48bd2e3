"""The vector-gate state pass split into segments (``chunk_gk_fwd_h`` with
``segment_chunks``: transitions, the per-channel combine, the output launch), forced at
short segments, against the float64 loop: GLA and RWKV6 through their public ops (the
forward's output and the backward's recomputed states, so every gradient), and the
launch model's picks at the benchmark shapes (host only)."""
import pytest
import torch

from fla.ops.common import chunk_segments
from fla.ops.common.chunk_gk_fwd import chunk_gk_fwd_A, chunk_gk_fwd_h, gk_default_segment_chunks
from fla.ops.gla import chunk_gla
from fla.ops.rwkv6 import chunk_rwkv6
from fla.ops.utils.index import prepare_chunk_indices, varlen_chunk_offsets
from tests.helpers import assert_rel_close, cu_seqlens_of, generator, odd_length
from tests.ops import test_gla, test_rwkv6

# Packed sequences of 5, 1 and 3 chunks, none a multiple of 64 tokens: with segments of
# 2 chunks the first ends in a 1-chunk segment and the second is shorter than a segment;
# with 3, the first ends in a 2-chunk segment and the last is exactly one segment.
LENGTHS = [300, 40, 170]


def force_segments(monkeypatch, chunks: int) -> list:
    """Make every launch of the vector-gate pass split into ``chunks``-chunk segments;
    returns the list of the launch model's forms asked (one per pass)."""
    forms = []

    def pick(seq_chunks, heads, output_tiles, transition_tiles, form):
        forms.append(form)
        return chunks

    monkeypatch.setattr(chunk_segments, "segment_chunks_for", pick)
    return forms


def inputs_for(exclusive: bool, gen, layout: str, K: int, V: int):
    """float64 leaves and the op's keyword arguments for one layout: ``varlen`` (the
    packed LENGTHS) or ``batch`` (two sequences of one odd length). Two heads: head 0's
    gates 100 times milder (a segment's decay e^d between e^-3 and 1, so that each
    channel's d shows in the state a segment passes on), head 1's the usual (e^d ≈ 0)."""
    make = test_rwkv6.make_inputs if exclusive else test_gla.make_inputs
    if layout == "varlen":
        x = make(gen, B=1, T=sum(LENGTHS), H=2, K=K, V=V, N=len(LENGTHS))
        kwargs = dict(cu_seqlens=cu_seqlens_of(LENGTHS))
    else:
        x, kwargs = make(gen, B=2, T=odd_length(gen, 200, 320), H=2, K=K, V=V), {}
    x["w" if exclusive else "g"][:, :, 0] *= 0.01
    return x, kwargs


CASES = {  # id: (layout, segment chunks, K, V, dtype)
    "varlen-1": ("varlen", 1, 32, 16, torch.float32),
    "varlen-2": ("varlen", 2, 32, 16, torch.float32),
    "varlen-3": ("varlen", 3, 32, 16, torch.float32),
    "varlen-2-fp16": ("varlen", 2, 32, 16, torch.float16),
    "batch-2": ("batch", 2, 32, 16, torch.float32),
    # Two K tiles (the second masked) and two V tiles: every tile's decays and states.
    "varlen-2-K96-V96": ("varlen", 2, 96, 96, torch.float32),
}


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("exclusive", [False, True], ids=["gla", "rwkv6"])
def test_chunk_split_into_segments(exclusive, case, device, seed, monkeypatch):
    """Output, final state and every gradient (initial state included) with the forward's
    pass and the backward's recomputation of h both split."""
    layout, chunks, K, V, dtype = CASES[case]
    forms = force_segments(monkeypatch, chunks)
    gen = generator(seed)
    x, kwargs = inputs_for(exclusive, gen, layout, K, V)
    kwargs = {n: t.to(device) for n, t in kwargs.items()}
    if exclusive:
        test_rwkv6.compare(x, dtype, device, fn=chunk_rwkv6, gen=gen, **kwargs)
    else:
        test_gla.compare(x, dtype, device, fn=chunk_gla, gen=gen, **kwargs)
    # The forward's pass and the backward's at least (on a GPU the first call's
    # compile-ahead of the backward's kernels asks the launch model too).
    assert len(forms) >= 2 and set(forms) == {"vector"}, forms


def states_loop(k, v, g, h0, offsets):
    """float64: the state entering each 64-token chunk (``[NT_total, H, K, V]``, the
    sequences' chunks in order) and each sequence's final state, from
    S_t = diag(e^{g_t}) S_{t−1} + k_t v_tᵀ."""
    entering, final = [], []
    for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        S = h0[n].clone()
        for t in range(bos, eos):
            if (t - bos) % 64 == 0:
                entering.append(S.clone())
            S = S * g[0, t].exp()[..., None] + k[0, t][..., None] * v[0, t][:, None, :]
        final.append(S)
    return torch.stack(entering), torch.stack(final)


@pytest.mark.interpret
@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated-operands"])
def test_split_states_match_the_loop(gated, chunks, device, seed):
    """The backward's recomputation (``store_h``, no output) split, in both operand forms
    (the gated one the forward keeps, the plain one gating k in the pass): every chunk's
    entering state h at its global chunk index, and the final states."""
    gen = generator(seed)
    x = test_gla.make_inputs(gen, B=1, T=sum(LENGTHS), H=2, K=96, V=48, N=len(LENGTHS))
    x["g"][:, :, 0] *= 0.01   # head 0's state carried across segments (see inputs_for)
    q, k, v, g, h0 = (x[n].float().to(device) for n in ("q", "k", "v", "g", "initial_state"))
    offsets = cu_seqlens_of(LENGTHS).tolist()
    cu = cu_seqlens_of(LENGTHS, device)
    ci = prepare_chunk_indices(cu, 64)
    g_cum, _, qg, kg = chunk_gk_fwd_A(q, k, g, cu_seqlens=cu, chunk_indices=ci,
                                      gate_operands=gated)
    _, h, ht = chunk_gk_fwd_h(qg if gated else q, kg if gated else k, v, g_cum, None, 1.0,
                              h0, True, store_h=True, store_o=False, cu_seqlens=cu,
                              chunk_offsets=varlen_chunk_offsets(cu, 64, offsets),
                              NT=ci.shape[0], gated_operands=gated, offsets=offsets,
                              segment_chunks=chunks)
    h_ref, ht_ref = states_loop(x["k"], x["v"], x["g"], x["initial_state"], offsets)
    assert_rel_close("h", h[0], h_ref, 1e-4)
    assert_rel_close("final_state", ht, ht_ref, 1e-4)


def test_split_of_packed_sequences_needs_their_host_offsets():
    """Splitting packed sequences needs their host offsets (the launcher never reads
    cu_seqlens back from the device); without them the default is not to split."""
    k = v = torch.zeros(1, 100, 1, 16)
    cu = torch.tensor([0, 30, 100])
    with pytest.raises(ValueError, match="needs offsets"):
        chunk_gk_fwd_h(k, k, v, k, cu_seqlens=cu, segment_chunks=1)


# The benchmark shapes (B, T, H, K = V): GLA's, and RWKV6's 4x4096x16x128.
NO_SPLIT_SHAPES = [(1, 8192, 96, 128), (4, 4096, 64, 128), (4, 2048, 16, 128),
                   (8, 1024, 8, 64), (8, 2048, 32, 256), (4, 4096, 16, 128)]


def test_launch_model_splits_only_thin_grids(monkeypatch):
    """On a 132-SM GPU: 2x16384x16x128 (64 programs of 64 columns over 256 chunks each)
    splits, into segments that save the model's required share; grids that already fill
    the GPU (1x8192x96x128: 192 programs) or sequences too short to gain do not; the
    packed form of a batch picks as the batch does."""
    monkeypatch.setattr(chunk_segments, "multiprocessor_count", lambda: 132)
    chunks = gk_default_segment_chunks(None, 2, 16384, 16, 128, 128)
    assert chunks > 0 and chunks % chunk_segments.MIN_SEGMENT_CHUNKS == 0, chunks
    model = ([256, 256], 16, 2, 2, "vector", chunk_segments.program_slots())
    assert (chunk_segments.split_time(chunks, *model)
            <= (1 - chunk_segments.MIN_SPLIT_SAVING) * chunk_segments.split_time(0, *model))
    assert gk_default_segment_chunks([0, 16384, 32768], 1, 32768, 16, 128, 128) == chunks
    assert gk_default_segment_chunks(None, 2, 16384, 16, 128, 128, False) > 0
    for B, T, H, D in NO_SPLIT_SHAPES:
        assert gk_default_segment_chunks(None, B, T, H, D, D) == 0, (B, T, H, D)
