"""The fused forward of the chunked gated delta rule (``chunk_fwd_intra`` and
``chunk_fwd_inter``) against float64 references of the chunk equations.

Each kernel is fed inputs in the tested dtype and compared with float64 results computed
from the very same (rounded) inputs; the inter-chunk pass gets the float64 Ai and Aqk
rounded as the intra kernel would store them, so each comparison measures one kernel.
"""
from __future__ import annotations

import pytest
import torch

from fla.ops.common.chunk_fwd_inter import (
    chunk_gated_delta_rule_fwd_inter,
    chunk_gated_delta_rule_fwd_inter_kernel,
)
from fla.ops.common.chunk_fwd_intra import (
    chunk_fwd_scores_kernel,
    chunk_gated_delta_rule_fwd_intra,
    chunk_gated_delta_rule_fwd_intra_kernel,
)
from fla.ops.utils.index import prepare_chunk_indices
from tests.helpers import assert_rel_close, generator
from tests.ops.config_sweep import sweep_configs
from tests.ops.test_chunk_stages_fwd import (
    DTYPES,
    F64,
    chunk_spans,
    f32,
    gate_matrix,
    make_problem,
    recurrence_loop,
    ref_kkt,
    ref_tinv,
    tol,
    uneven_lengths,
)

CASES = {
    "T100": dict(B=2, T=100, H=2, K=32, V=32),
    "T130_K_ne_V": dict(B=1, T=130, H=2, K=48, V=32),
    "varlen": dict(B=1, T=0, H=2, K=32, V=32, lengths=3),
}


def problem(case, gen, device, dtype):
    spec = dict(CASES[case])
    n = spec.pop("lengths", None)
    lengths = uneven_lengths(n, gen, low=1, high=140) if n else None
    return make_problem(gen, device, dtype=dtype, lengths=lengths, **spec)


def ref_aqk(q, k, gc, offsets, BT=64):
    """(Q Kᵀ ⊙ Γ) on and below the diagonal, per chunk, float64, [B, T, H, BT]."""
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, BT, dtype=F64, device=q.device)
    for b, _, s, e in chunk_spans(B, T, offsets, BT):
        scores = torch.einsum("ihk,jhk->hij", q[b, s:e].to(F64), k[b, s:e].to(F64))
        scores = (scores * gate_matrix(gc[b, s:e].to(F64), False) if gc is not None
                  else scores.tril())
        out[b, s:e, :, :e - s] = scores.permute(1, 0, 2)
    return out


def chunk_indices_of(p):
    return None if p["cu_seqlens"] is None else prepare_chunk_indices(p["cu_seqlens"], 64)


def run_intra(p, gated):
    return chunk_gated_delta_rule_fwd_intra(p["q"], p["k"], p["g"] if gated else None,
                                            p["beta"], cu_seqlens=p["cu_seqlens"],
                                            chunk_indices=chunk_indices_of(p))


def run_inter(p, gated, Ai, Aqk, h0=True, final=True, segment_chunks=None, scores_out=None,
              lead_chunks=0):
    return chunk_gated_delta_rule_fwd_inter(
        p["q"], p["k"], p["v"], f32(p["gc"]) if gated else None, p["beta"], Ai, Aqk,
        p["scale"], p["h0"] if h0 else None, final, cu_seqlens=p["cu_seqlens"],
        offsets=p["offsets"], segment_chunks=segment_chunks, scores_out=scores_out,
        lead_chunks=lead_chunks)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gated", [True, False])
def test_intra_matches_chunk_equations(device, seed, dtype, case, gated):
    p = problem(case, generator(seed), device, dtype)
    g_cum, Ai, Aqk = run_intra(p, gated)
    assert Ai.shape == Aqk.shape == (*p["k"].shape[:3], 64)
    assert Ai.dtype == Aqk.dtype == dtype
    if gated:
        assert g_cum.dtype == torch.float32
        assert_rel_close("g_cum", g_cum, p["gc"], 1e-6)
    else:
        assert g_cum is None
    # The references take the kernel's own γ (fp32) so that only the kernel is measured.
    gc = g_cum if gated else None
    Tinv = ref_tinv(ref_kkt(p["k"], p["beta"], gc, p["offsets"], 64), p["offsets"], 64)
    # One rounding of the stored result on top of fp32 arithmetic.
    assert_rel_close("Ai", Ai, Tinv, {torch.float32: 1e-5}.get(dtype, tol(dtype)))
    assert_rel_close("Aqk", Aqk, ref_aqk(p["q"], p["k"], gc, p["offsets"]),
                     {torch.float32: 1e-5}.get(dtype, tol(dtype)))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gated", [True, False])
def test_inter_matches_recurrence(device, seed, dtype, case, gated):
    """Fed exact Ai and Aqk (rounded to the dtype as stored), the state pass gives the
    per-token recurrence's output and final state."""
    p = problem(case, generator(seed), device, dtype)
    gc = p["gc"] if gated else None
    Ai = ref_tinv(ref_kkt(p["k"], p["beta"], gc, p["offsets"], 64), p["offsets"], 64)
    Aqk = ref_aqk(p["q"], p["k"], gc, p["offsets"])
    o, ht = run_inter(p, gated, Ai.to(dtype), Aqk.to(dtype))
    g = p["g"] if gated else torch.zeros_like(p["g"])
    o_ref, ht_ref = recurrence_loop(p["q"], p["k"], p["v"], g, p["beta"], p["scale"],
                                    p["h0"], p["offsets"])
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert_rel_close("o", o, o_ref, tol(dtype))
    assert_rel_close("final_state", ht, ht_ref, tol(dtype))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["T300_K_ne_V", "varlen_long"])
@pytest.mark.parametrize("segment_chunks", [1, 2])
def test_inter_split_into_segments(device, seed, dtype, case, segment_chunks):
    """Sequences cut into segments (transitions [M | X], combine, output pass) give the
    recurrence's output and final state: a sequence shorter than a segment, segments
    ending in a partial chunk, with and without an initial state."""
    gen = generator(seed)
    if case == "varlen_long":
        lengths = uneven_lengths(3, gen, low=1, high=300)
        p = make_problem(gen, device, B=1, T=0, H=2, K=32, V=32, dtype=dtype, lengths=lengths)
    else:
        p = make_problem(gen, device, B=2, T=300, H=1, K=48, V=32, dtype=dtype)
    Ai = ref_tinv(ref_kkt(p["k"], p["beta"], p["gc"], p["offsets"], 64), p["offsets"], 64)
    Aqk = ref_aqk(p["q"], p["k"], p["gc"], p["offsets"])
    o_ref, ht_ref = recurrence_loop(p["q"], p["k"], p["v"], p["g"], p["beta"], p["scale"],
                                    p["h0"], p["offsets"])
    for h0 in (True, False):
        o, ht = run_inter(p, True, Ai.to(dtype), Aqk.to(dtype), h0=h0,
                          segment_chunks=segment_chunks)
        if not h0:
            o_ref, ht_ref = recurrence_loop(p["q"], p["k"], p["v"], p["g"], p["beta"],
                                            p["scale"], None, p["offsets"])
        assert_rel_close(f"o (h0={h0})", o, o_ref, tol(dtype))
        assert_rel_close(f"final_state (h0={h0})", ht, ht_ref, tol(dtype))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["T130_K_ne_V", "varlen", "T300_split", "varlen_split"])
@pytest.mark.parametrize("gated", [True, False])
def test_inter_stores_the_states_of_the_staged_pass(device, seed, dtype, case, gated):
    """With ``states_out`` (the delta rule's backward) the pass stores every chunk's
    entering state h and Vn = Ai β(V − e^γ K S): the staged state pass's h and U − W S,
    here from float64 W and U; unsplit and cut into segments, varlen included."""
    from fla.ops.common.chunk_torch import (chunk_gated_delta_rule_fwd_h_torch,
                                            recompute_w_u_fwd_torch)
    gen = generator(seed)
    split = case.endswith("_split")
    if case == "T300_split":
        p = make_problem(gen, device, B=2, T=300, H=1, K=48, V=32, dtype=dtype)
    elif case == "varlen_split":
        p = make_problem(gen, device, B=1, T=0, H=2, K=32, V=32, dtype=dtype,
                         lengths=uneven_lengths(3, gen, low=1, high=300))
    else:
        p = problem(case, gen, device, dtype)
    gc = p["gc"] if gated else None
    Ai = ref_tinv(ref_kkt(p["k"], p["beta"], gc, p["offsets"], 64), p["offsets"], 64)
    k64, v64, b64 = (p[n].to(F64) for n in ("k", "v", "beta"))
    gc64 = None if gc is None else gc.to(F64)
    w, u = recompute_w_u_fwd_torch(k64, v64, b64, Ai, gc64, p["offsets"], 64)
    h_ref, vn_ref, _ = chunk_gated_delta_rule_fwd_h_torch(
        k64, w, u, gc64, p["h0"].to(F64), False, p["offsets"], 64)
    h = torch.empty(h_ref.shape, dtype=dtype, device=device)
    v_new = torch.empty_like(p["v"])
    o, ht = chunk_gated_delta_rule_fwd_inter(
        None, p["k"], p["v"], f32(gc) if gated else None, p["beta"], Ai.to(dtype), None, 1.0,
        p["h0"], True, cu_seqlens=p["cu_seqlens"], offsets=p["offsets"],
        segment_chunks=1 if split else 0, states_out=(h, v_new))
    assert o is None
    assert_rel_close("h", h, h_ref, tol(dtype))
    assert_rel_close("v_new", v_new, vn_ref, tol(dtype))
    g = p["g"] if gated else torch.zeros_like(p["g"])
    _, ht_ref = recurrence_loop(p["q"], p["k"], p["v"], g, p["beta"], p["scale"], p["h0"],
                                p["offsets"])
    assert_rel_close("final_state", ht, ht_ref, tol(dtype))
    with pytest.raises(ValueError, match="states_out"):
        chunk_gated_delta_rule_fwd_inter(
            None, p["k"], p["v"], None, p["beta"], Ai.to(dtype), None, 1.0,
            cu_seqlens=p["cu_seqlens"], offsets=p["offsets"], states_out=(h[:, :-1], v_new))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES) + ["T300_split", "wide", "wide_varlen_split"])
@pytest.mark.parametrize("gated", [True, False])
def test_simple_gla_pass_forms_its_own_scores(device, seed, dtype, case, gated):
    """Without delta and without Aqk the pass forms Q Kᵀ ⊙ Γ itself: it gives the simple
    GLA recurrence's output and final state (also split into segments), and the output
    of the pass fed the exact Aqk within one rounding of it; asked to keep the scores,
    it writes Q Kᵀ ⊙ Γ (zeros past each sequence's end) and the same output."""
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla
    gen = generator(seed)
    if case == "T300_split":
        p = make_problem(gen, device, B=1, T=300, H=2, K=48, V=32, dtype=dtype)
        split = 2
    elif case.startswith("wide"):
        # Two 64-row state tiles (K = 96) and three 64-wide V tiles, only one of which
        # may write the kept scores; with varlen, also cut into one-chunk segments.
        varlen = case == "wide_varlen_split"
        lengths = uneven_lengths(3, gen, low=1, high=200) if varlen else None
        p = make_problem(gen, device, B=1, T=150, H=1, K=96, V=160, dtype=dtype,
                         lengths=lengths)
        split = 1 if varlen else 0
    else:
        p = problem(case, gen, device, dtype)
        split = 0
    gc = p["gc"] if gated else None
    p = dict(p, beta=None)
    o, ht = run_inter(p, gated, None, None, segment_chunks=split)
    aqk_ref = ref_aqk(p["q"], p["k"], gc, p["offsets"])
    o_fed, _ = run_inter(p, gated, None, aqk_ref.to(dtype), segment_chunks=split)
    # NaN-filled: every element of the kept scores must be written.
    kept = torch.full_like(aqk_ref, float("nan"), dtype=dtype)
    o_kept, _ = run_inter(p, gated, None, None, segment_chunks=split, scores_out=kept)
    assert torch.equal(o_kept, o)
    assert_rel_close("kept scores", kept, aqk_ref, tol(dtype))
    o_ref, ht_ref = naive_recurrent_simple_gla(
        p["q"].to(F64), p["k"].to(F64), p["v"].to(F64), p["g"].to(F64) if gated else None,
        scale=p["scale"], initial_state=p["h0"].to(F64), output_final_state=True,
        cu_seqlens=p["cu_seqlens"])
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert_rel_close("o", o, o_ref, tol(dtype))
    assert_rel_close("final_state", ht, ht_ref, tol(dtype))
    assert_rel_close("o vs the pass fed Aqk", o, o_fed, tol(dtype))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["T300", "varlen"])
@pytest.mark.parametrize("gated", [True, False])
def test_simple_gla_pass_as_a_lead_split(device, seed, dtype, case, gated):
    """The lead split (each sequence cut once after ``lead`` chunks, the lead pieces'
    transitions, then every piece longest first) gives the simple GLA recurrence's output
    and final state, with and without an initial state; a packed batch mixes sequences
    cut and too short to cut (one of them a partial chunk), and the kept scores equal the
    unsplit pass's."""
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla
    gen = generator(seed)
    if case == "varlen":
        lengths = uneven_lengths(3, gen, low=1, high=120) + uneven_lengths(2, gen, low=200,
                                                                           high=330)
        lengths = [lengths[i] for i in torch.randperm(5, generator=gen).tolist()]
        p = make_problem(gen, device, B=1, T=0, H=2, K=48, V=32, dtype=dtype, lengths=lengths)
    else:
        p = make_problem(gen, device, B=2, T=300, H=1, K=32, V=80, dtype=dtype)
    p = dict(p, beta=None)
    g64 = p["g"].to(F64) if gated else None
    for h0 in (True, False):
        o_ref, ht_ref = naive_recurrent_simple_gla(
            p["q"].to(F64), p["k"].to(F64), p["v"].to(F64), g64, scale=p["scale"],
            initial_state=p["h0"].to(F64) if h0 else None, output_final_state=True,
            cu_seqlens=p["cu_seqlens"])
        whole = torch.empty(*p["k"].shape[:3], 64, dtype=dtype, device=device)
        o_whole, _ = run_inter(p, gated, None, None, h0=h0, segment_chunks=0,
                               scores_out=whole)
        for lead in (1, 2, 4):
            kept = torch.full_like(whole, float("nan"))
            o, ht = run_inter(p, gated, None, None, h0=h0, segment_chunks=0, lead_chunks=lead,
                              scores_out=kept)
            what = f"(lead {lead}, h0={h0})"
            assert_rel_close(f"o {what}", o, o_ref, tol(dtype))
            assert_rel_close(f"final_state {what}", ht, ht_ref, tol(dtype))
            assert_rel_close(f"o against the unsplit pass {what}", o, o_whole,
                             {torch.float32: 1e-6}.get(dtype, tol(dtype)))
            assert torch.equal(kept, whole), what
        _, none = run_inter(p, gated, None, None, h0=h0, final=False, segment_chunks=0,
                            lead_chunks=2)
        assert none is None


@pytest.mark.interpret
def test_split_tables(device):
    """The uniform split's transitions list every segment but each sequence's last (the
    output launch writes the final states), with their rows in the output table."""
    from fla.ops.common.chunk_segments import split_tables
    # Sequences of 5, 2 and 3 chunks (the last partial) in 2-chunk segments.
    transitions, outputs, starts = split_tables([0, 300, 428, 600], 2, device)
    assert starts.tolist() == [0, 3, 4, 6]
    assert outputs.tolist() == [[0, 0, 2, 0], [0, 2, 4, 1], [0, 4, 5, 2], [1, 0, 2, 3],
                                [2, 0, 2, 4], [2, 2, 3, 5]]
    assert transitions.tolist() == [[0, 0, 2, 0], [0, 2, 4, 1], [2, 0, 2, 4]]


@pytest.mark.interpret
def test_lead_split_tables(device):
    """Pieces numbered sequence by sequence in time order; the transitions list the cut
    sequences' lead pieces, the outputs every piece longest first, with their rows."""
    from fla.ops.common.chunk_fwd_inter import lead_split_tables
    # Sequences of 5, 2 (not cut), 3 chunks (the last partial), lead 2.
    transitions, outputs, starts = lead_split_tables([0, 300, 428, 600], 2, device)
    assert starts.tolist() == [0, 2, 3, 5]
    assert transitions.tolist() == [[0, 0, 2, 0], [2, 0, 2, 3]]
    assert outputs.tolist() == [[0, 2, 5, 1], [0, 0, 2, 0], [1, 0, 2, 2], [2, 0, 2, 3],
                                [2, 2, 3, 4]]


@pytest.mark.interpret
def test_pass_refuses_what_it_cannot_form_or_keep(device, seed):
    """No scores formed in the pass above K = 128 (no registers for them there), and a
    scores buffer of the wrong shape, dtype or layout is refused before any launch."""
    gen = generator(seed)
    wide = make_problem(gen, device, B=1, T=70, H=1, K=160, V=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="K <= 128"):
        run_inter(dict(wide, beta=None), True, None, None)
    p = dict(make_problem(gen, device, B=1, T=70, H=1, K=32, V=16, dtype=torch.float32),
             beta=None)
    good = torch.empty(1, 70, 1, 64, device=device)
    for bad in (good[:, :69], good.half(), torch.empty(1, 70, 1, 128, device=device)[..., ::2]):
        with pytest.raises(ValueError, match="scores_out"):
            run_inter(p, True, None, None, scores_out=bad)
    with pytest.raises(ValueError, match="scores_out is for a pass"):
        run_inter(p, True, None, good, scores_out=good)


# The simple GLA pass at 2x16384x16x128 (H100, Triton 3.6, bf16; 2 sequences x 16 heads x
# 2 V tiles of 64, transitions carrying X only): ms per segment length (0: unsplit),
# 2026-11-25.
MEASURED_SPLIT_MS = {0: 0.907, 8: 0.538, 16: 0.456, 32: 0.403, 48: 0.502, 64: 0.408,
                     96: 0.571, 128: 0.613}


def test_split_model_matches_the_measured_pass(monkeypatch):
    """The segment split's launch model reproduces the pass timed on an H100 (within 15%
    at every length), picks a length within 3% of the measured best, and keeps the
    measured no-split and split choices of the delta rule."""
    from fla.ops.common import chunk_fwd_inter as inter
    from fla.ops.common import chunk_segments as segments
    monkeypatch.setattr(segments, "multiprocessor_count", lambda: 132)
    shape = ([256, 256], 16, 2, 2, "scalar", segments.PROGRAMS_PER_SM * 132)
    step_ms = MEASURED_SPLIT_MS[0] / segments.split_time(0, *shape)  # one output chunk step
    for length, ms in MEASURED_SPLIT_MS.items():
        model = segments.split_time(length, *shape) * step_ms
        assert abs(model / ms - 1) < 0.15, (length, model, ms)
    chosen = segments.segment_chunks_for(*shape[:5])
    assert MEASURED_SPLIT_MS[chosen] <= 1.03 * min(MEASURED_SPLIT_MS.values()), chosen
    assert inter.default_segment_chunks(None, 2, 16384, 16, 128, 128, False, True) == chosen
    # The delta rule: 32 programs over 1024 chunks split (3.74 ms unsplit, 1.38 at 64
    # chunks); 128 programs over 256 chunks do not (a split measured 0.99 -> 1.27 ms).
    split = segments.segment_chunks_for([1024], 8, 4, 8, "delta")
    assert split and split % segments.MIN_SEGMENT_CHUNKS == 0
    assert segments.split_time(split, [1024], 8, 4, 8, "delta", 264) < segments.split_time(
        64, [1024], 8, 4, 8, "delta", 264) < segments.split_time(0, [1024], 8, 4, 8, "delta",
                                                            264)
    assert segments.segment_chunks_for([256] * 8, 4, 4, 8, "delta") == 0
    # Since the delta's transitions run 64 columns (2026-11-28: 4 transition tiles at K = V
    # = 128, not 8), the model splits 2x16384x16x128 in 64-chunk segments, as it does
    # 1x65536x8x128; measured (H100, the op's forward): 0.987 -> 0.902 ms there, and
    # 1x65536x8x128 1.137 -> 0.976 with the faster transitions.
    assert inter.default_segment_chunks(None, 2, 16384, 16, 128, 128, True, False) == 64
    assert inter.default_segment_chunks(None, 1, 65536, 8, 128, 128, True, False) == 64
    # A pass that fills a wave, or sequences too short to cut, is never split.
    assert segments.segment_chunks_for([1024] * 4, 33, 2, 4, "scalar") == 0
    assert segments.segment_chunks_for([15], 1, 1, 2, "scalar") == 0


# Simple GLA's no-grad pass at 1x8192x{96,80}x128 (H100, Triton 3.6, bf16; 128 chunks, 2
# V tiles of 64 a head), unsplit (0) and as lead splits, ms per lead length; 2026-11-27,
# 96 heads by hand-made tables, 80 through the launcher (`python -m benchmarks.lead_split`).
MEASURED_LEAD_MS = {96: {0: 0.550, 16: 0.503, 24: 0.480, 32: 0.465, 40: 0.539, 48: 0.579},
                    80: {0: 0.539, 24: 0.479, 32: 0.459, 40: 0.434, 42: 0.426, 48: 0.460}}


def test_lead_split_model_matches_the_measured_pass(monkeypatch):
    """The lead split's launch model reproduces the pass timed on an H100 (within 15% at
    every length timed), picks the best timed length (or one within 4 chunks of it, where
    its pick was not timed), and leaves alone the
    passes it does not fit: a full wave, every program on an SM of its own (Mamba2's 128
    heads: a split measured slower there), short sequences."""
    from fla.ops.common import chunk_fwd_inter as inter
    from fla.ops.common import chunk_segments as segments
    monkeypatch.setattr(segments, "multiprocessor_count", lambda: 132)
    segments._lead_lengths.clear()
    for heads, measured in MEASURED_LEAD_MS.items():
        shape = ([128], heads, 2, 2, segments.program_slots())
        step_ms = measured[0] / 128          # the unsplit pass: one wave of 128 steps
        for lead, ms in measured.items():
            model = (segments.lead_split_time(lead, *shape) if lead else 128) * step_ms
            assert abs(model / ms - 1) < 0.15, (heads, lead, model, ms)
        chosen = segments.lead_chunks_for(*shape[:4])
        best = min(measured, key=measured.get)
        assert (measured[chosen] <= 1.03 * measured[best] if chosen in measured
                else abs(chosen - best) <= 4), (heads, chosen, best)
        assert inter.default_lead_chunks(None, 1, 8192, heads, 128, 128, True) == chosen
    assert segments.lead_chunks_for([64] * 4, 32, 1, 1) == 0      # 128 programs, 132 SMs
    assert segments.lead_chunks_for([64] * 4, 64, 2, 2) == 0      # 512 programs: full
    assert segments.lead_chunks_for([32] * 8, 12, 2, 2) == 0      # short sequences
    # A packed batch of long uneven sequences (new lengths every training step): at most
    # 64 lengths modelled, each a list of every piece.
    modelled = []
    model = segments.lead_split_time
    monkeypatch.setattr(segments, "lead_split_time",
                        lambda *args: modelled.append(args[0]) or model(*args))
    segments.lead_chunks_for([1000, 700, 430, 990, 64, 880, 300, 777], 16, 2, 2)
    assert 0 < len(modelled) <= 65, len(modelled)


# The delta rule's backward states pass (bf16, fwd+bwd of the op; H200, Triton 3.6,
# 2026-11-29 05:50 UTC, states pass µs unsplit -> from the checkpoint at the model's cut):
# 96 heads 696 -> 526, 80 heads 694 -> 463 (one sequence of 128 chunks, 64 columns a
# program, 2 programs a head).
MEASURED_CHECKPOINT_US = {96: (696, 526), 80: (694, 463)}


def test_checkpoint_lead_model(monkeypatch):
    """The checkpointed lead split's model (no transitions: the pieces' schedule alone)
    against the states pass measured from it, its picks, and where it declines: more
    programs than slots, no more than SMs, short sequences, K above 128."""
    from fla.ops.common import chunk_fwd_inter as inter
    from fla.ops.common import chunk_segments as segments
    monkeypatch.setattr(segments, "multiprocessor_count", lambda: 132)
    segments._lead_lengths.clear()
    for heads, (whole, cut) in MEASURED_CHECKPOINT_US.items():
        lead = inter.default_checkpoint_lead_chunks(None, 1, 8192, heads, 128, 128)
        assert lead == segments.checkpoint_lead_chunks_for([128], heads, 2) > 0
        model = segments._pieces_time(lead, [128], heads, 2, segments.program_slots()) / 128
        # The model counts every step alike (measured: within a percent at both).
        assert abs(cut / whole - model) < 0.03, (heads, lead, model, cut / whole)
    assert inter.default_checkpoint_lead_chunks(None, 4, 4096, 64, 128, 128) == 0  # full
    assert inter.default_checkpoint_lead_chunks(None, 1, 8192, 64, 128, 128) == 0  # 128
    assert inter.default_checkpoint_lead_chunks(None, 1, 2048, 96, 128, 128) == 0  # short
    assert inter.default_checkpoint_lead_chunks(None, 1, 8192, 48, 256, 256) == 0  # K


@pytest.mark.interpret
def test_inter_without_initial_or_final_state(device, seed):
    p = problem("varlen", generator(seed), device, torch.float32)
    _, Ai, Aqk = run_intra(p, True)
    o, ht = run_inter(p, True, Ai, Aqk, h0=False, final=False)
    assert ht is None
    o_ref, _ = recurrence_loop(p["q"], p["k"], p["v"], p["g"], p["beta"], p["scale"], None,
                               p["offsets"])
    assert_rel_close("o", o, o_ref, 1e-4)


# ------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_every_tuning_config_of_the_fused_forward(seed, monkeypatch, D):
    """Every config of the three kernels' tuning spaces compiles and is correct in bf16 at
    K = V = D (another Triton release hit an LLVM layout assertion at 8 warps, D = 256)."""
    gen = generator(seed)
    p = make_problem(gen, "cuda", B=2, T=200, H=2, K=D, V=D, dtype=torch.bfloat16)
    g_cum, Ai, Aqk = run_intra(p, True)
    o_ref, ht_ref = recurrence_loop(p["q"], p["k"], p["v"], p["g"], p["beta"], p["scale"],
                                    p["h0"], None)
    Ai_ref = ref_tinv(ref_kkt(p["k"], p["beta"], g_cum, None, 64), None, 64)
    stages = [
        ("scores", chunk_fwd_scores_kernel, lambda: run_intra(p, True)[0::2],
         (p["gc"], ref_aqk(p["q"], p["k"], g_cum, None)), 1e-2),
        ("wy", chunk_gated_delta_rule_fwd_intra_kernel, lambda: run_intra(p, True)[1:2],
         (Ai_ref,), 1e-2),
        ("inter", chunk_gated_delta_rule_fwd_inter_kernel, lambda: run_inter(p, True, Ai, Aqk),
         (o_ref, ht_ref), 1e-2),
    ]
    failures = sweep_configs(monkeypatch, stages, min_configs=2)
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_every_tuning_config_of_the_two_term_states_pass(seed, monkeypatch, D):
    """The 16-bit delta rules' backward recomputes h and Vn with the forward's pass on
    two-term dots (``two_term``, its own defaults): every config of that space compiles
    and stores them within bf16 rounding of the float64 staged pass, at K = V = D."""
    from fla.ops.common.chunk_torch import (chunk_gated_delta_rule_fwd_h_torch,
                                            recompute_w_u_fwd_torch)
    gen = generator(seed)
    p = make_problem(gen, "cuda", B=2, T=200, H=2, K=D, V=D, dtype=torch.bfloat16)
    Ai = ref_tinv(ref_kkt(p["k"], p["beta"], p["gc"], p["offsets"], 64), p["offsets"], 64)
    k64, v64, b64, gc64 = (p[n].to(F64) for n in ("k", "v", "beta", "gc"))
    w, u = recompute_w_u_fwd_torch(k64, v64, b64, Ai, gc64, p["offsets"], 64)
    h_ref, vn_ref, _ = chunk_gated_delta_rule_fwd_h_torch(
        k64, w, u, gc64, p["h0"].to(F64), False, p["offsets"], 64)
    h = torch.empty(h_ref.shape, dtype=torch.bfloat16, device="cuda")
    v_new = torch.empty_like(p["v"])

    def states():
        chunk_gated_delta_rule_fwd_inter(
            None, p["k"], p["v"], f32(p["gc"]), p["beta"], Ai.to(torch.bfloat16), None, 1.0,
            p["h0"], cu_seqlens=p["cu_seqlens"], offsets=p["offsets"], segment_chunks=0,
            states_out=(h, v_new), two_term=True)
        return h.clone(), v_new.clone()

    stages = [("states", chunk_gated_delta_rule_fwd_inter_kernel, states, (h_ref, vn_ref),
               1e-2)]
    failures = sweep_configs(monkeypatch, stages, min_configs=2)
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_lead_split_at_a_real_shape(seed, monkeypatch):
    """Where the GPU's launch model takes the lead split (96 heads over one 8K-token
    sequence on an H100), simple GLA's bf16 forward and final state equal the unsplit
    pass's within bf16 rounding, from an initial state."""
    from fla.ops.common import chunk_fwd_inter as inter
    from fla.ops.simple_gla import chunk_simple_gla
    if not inter.default_lead_chunks(None, 1, 8192, 96, 128, 128, True):
        pytest.skip("this GPU's launch model takes no lead split at 1x8192x96x128")
    gen = generator(seed)
    q, k, v = (torch.randn(1, 8192, 96, 128, generator=gen).to("cuda", torch.bfloat16)
               for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 8192, 96, generator=gen)).cuda()
    h0 = torch.randn(1, 96, 128, 128, generator=gen).cuda()
    with torch.no_grad():
        o, ht = chunk_simple_gla(q, k, v, g=g, initial_state=h0, output_final_state=True)
        monkeypatch.setattr(inter, "default_lead_chunks", lambda *args: 0)
        o_whole, ht_whole = chunk_simple_gla(q, k, v, g=g, initial_state=h0,
                                             output_final_state=True)
    assert_rel_close("o", o, o_whole.double(), 2e-3)
    assert_rel_close("final_state", ht, ht_whole.double(), 1e-5)
