"""Simple GLA and retention (chunk and fused recurrent) against the float64 loop: outputs,
final states and every gradient (q, k, v, g, g_gamma, initial_state), through the Triton
kernels (interpreted on CPU: fp32, fp16, small shapes; bf16 at real shapes on the GPU)
and the PyTorch paths."""
import pytest
import torch

from fla.ops.retention import (
    chunk_retention,
    fused_recurrent_retention,
    naive_recurrent_retention,
)
from fla.ops.simple_gla import (
    chunk_simple_gla,
    fused_recurrent_simple_gla,
    naive_recurrent_simple_gla,
)
from tests.helpers import (
    TOLERANCE,
    assert_rel_close,
    counted_segment_combines,
    cu_seqlens_of,
    generator,
    log_gate,
    odd_length,
    output_grad,
    packed_or_batch,
    randn,
    reference_device,
    uneven_lengths,
)
from tests.ops.gated_delta_cases import INTERPRETER_DTYPES, cast, run
from tests.ops.vector_gate_cases import compare_with_loop

OPS = {"chunk": chunk_simple_gla, "fused_recurrent": fused_recurrent_simple_gla}


def make_inputs(gen, *, B, T, H, HV, K, V, N=None, gate=True, gamma=False, h0=True,
                gate_low=-0.5):
    """float64 leaves: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV]; g_gamma [HV]; h0."""
    N = B if N is None else N
    return {
        "q": randn((B, T, H, K), gen, torch.float64),
        "k": randn((B, T, H, K), gen, torch.float64, scale=K ** -0.5),
        "v": randn((B, T, HV, V), gen, torch.float64),
        "g": log_gate((B, T, HV), gen, low=gate_low, dtype=torch.float64) if gate else None,
        "g_gamma": log_gate((HV,), gen, low=-0.2, dtype=torch.float64) if gamma else None,
        "initial_state": randn((N, HV, K, V), gen, torch.float64, scale=0.5) if h0 else None,
    }


def compare(inputs, dtype, device, *, fn, ref_fn=naive_recurrent_simple_gla, gen, tol=None,
            **kwargs):
    """fn and the float64 loop on the same rounded inputs: o, final state, all gradients.
    Gates and states in float32 (what layers pass), the rest in the tested dtype. g and
    g_gamma enter as one decay, so dg_gamma[h] = Σ_t dg[t, h]: a sum whose terms cancel,
    its relative error that of the sum (2.4e-4 seen in fp32 at seed 59350227), bounded
    by the size of the terms."""
    compare_with_loop(inputs, dtype, device, fn=fn, ref_fn=ref_fn, gen=gen,
                      fp32_names=("initial_state", "g", "g_gamma"), tol=tol,
                      ref_device=reference_device(device), sums={"g_gamma": "g"}, **kwargs)


CASES = {
    "gate": dict(B=2, H=2, HV=2, K=32, V=16),
    "gate_and_gamma": dict(B=1, H=1, HV=1, K=16, V=32, gamma=True),
    "gamma_only_grouped_heads": dict(B=1, H=1, HV=2, K=16, V=16, gate=False, gamma=True),
    "no_decay_no_h0": dict(B=2, H=1, HV=1, K=16, V=16, gate=False, h0=False),
    # Above SCORES_IN_PASS_MAX_K (128) the chunk op stores Aqk from the intra kernel.
    "wide_keys_stored_scores": dict(B=1, H=1, HV=1, K=160, V=16),
}


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", list(OPS))
def test_matches_float64_loop(mode, case, dtype, device, seed):
    gen = generator(seed)
    T = odd_length(gen, low=65, high=150)          # more than one chunk, never a multiple
    compare(make_inputs(gen, T=T, **CASES[case]), dtype, device, fn=OPS[mode], gen=gen)


@pytest.mark.interpret
@pytest.mark.parametrize("mode", list(OPS))
def test_varlen_uneven_sequences(mode, device, seed):
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=140)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=2, HV=2, K=16, V=16, N=3, gamma=True)
    compare(inputs, torch.float16, device, fn=OPS[mode], gen=gen,
            cu_seqlens=cu_seqlens_of(lengths, device))


@pytest.mark.interpret
@pytest.mark.parametrize("varlen", [False, True])
def test_scores_kept_only_for_a_backward(varlen, device, seed):
    """The forward keeps the chunk scores only when a gradient will be needed; a backward
    handed none (a forward run without gradients) forms the same scores again and gives
    the same gradients bit for bit."""
    from fla.ops.simple_gla import chunk as simple_gla_chunk
    from fla.ops.utils.index import prepare_chunk_indices
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=140) if varlen else [odd_length(gen, 65, 150)]
    x = {n: None if t is None else t.to(torch.float32).to(device)
         for n, t in make_inputs(gen, B=1, T=sum(lengths), H=2, HV=2, K=32, V=16,
                                 N=len(lengths)).items()}
    cu = cu_seqlens_of(lengths, device) if varlen else None
    chunks = None if cu is None else prepare_chunk_indices(cu, 64)
    offsets = None if cu is None else cu.tolist()
    args = (x["q"], x["k"], x["v"], x["g"], x["initial_state"], 0.25, True)
    o0, ht0, _, none, _, _ = simple_gla_chunk._forward(*args, False, cu, chunks, offsets)
    o, ht, g_cum, Aqk, segment_states, h = simple_gla_chunk._forward(*args, True, cu, chunks,
                                                                     offsets)
    assert none is None and h is None and Aqk.shape == (*x["k"].shape[:3], 64)
    assert torch.equal(o0, o) and torch.equal(ht0, ht)
    do = randn(o.shape, gen, torch.float32).to(device)
    dht = randn(ht.shape, gen, torch.float32).to(device)
    bwd = (x["q"], x["k"], x["v"], g_cum)
    rest = (segment_states, None, x["initial_state"], cu, chunks, offsets, do, dht, 0.25,
            torch.float32)
    kept = simple_gla_chunk._backward(*bwd, Aqk, *rest)
    formed = simple_gla_chunk._backward(*bwd, None, *rest)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), kept, formed):
        assert torch.equal(a, b), name
    # Through the op: no input requires grad, so no scores are written.
    with torch.no_grad():
        o_ng, _ = chunk_simple_gla(x["q"], x["k"], x["v"], x["g"],
                                   initial_state=x["initial_state"], scale=0.25,
                                   cu_seqlens=cu)
    assert torch.equal(o_ng, o)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
def test_forward_without_gradients_above_k128(dtype, device, seed, monkeypatch):
    """Above K = 128 a forward that feeds no backward stores the per-chunk states and
    computes the outputs in parallel: packed uneven sequences, initial and final states,
    against the float64 loop and against the forward that keeps its scores."""
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=150)
    x = make_inputs(gen, B=1, T=sum(lengths), H=1, HV=1, K=160, V=48, N=3, gamma=True)
    cu = cu_seqlens_of(lengths, device)
    o_ref, ht_ref = naive_recurrent_simple_gla(
        *(x[n].to(dtype).double() for n in ("q", "k", "v")), x["g"].float().double(),
        g_gamma=x["g_gamma"].float().double(), initial_state=x["initial_state"].float().double(),
        output_final_state=True, cu_seqlens=cu.cpu())
    args = [x[n].to(dtype).to(device) for n in ("q", "k", "v")]
    kwargs = dict(g=x["g"].float().to(device), g_gamma=x["g_gamma"].float().to(device),
                  initial_state=x["initial_state"].float().to(device),
                  output_final_state=True, cu_seqlens=cu)
    from fla.ops.simple_gla import chunk as simple_gla_chunk
    staged = []
    output_stage = simple_gla_chunk.chunk_fwd_o
    # Three short sequences over one head would be cut into segments on a GPU (few
    # programs for its SMs), which keeps the fused pass: this test is about the other path.
    monkeypatch.setattr(simple_gla_chunk, "_pass_would_split", lambda *a: False)
    # Count real launches only, not the compile-ahead recording of the first call.
    monkeypatch.setenv("FLA_COMPILE_AHEAD", "0")
    monkeypatch.setattr(simple_gla_chunk, "chunk_fwd_o",
                        lambda *a, **kw: staged.append(1) or output_stage(*a, **kw))
    with torch.no_grad():
        o, ht = chunk_simple_gla(*args, **kwargs)
    assert staged == [1]
    assert_rel_close("o", o, o_ref, TOLERANCE[dtype])
    assert_rel_close("final_state", ht, ht_ref, TOLERANCE[dtype])
    o_grad, ht_grad = chunk_simple_gla(args[0].requires_grad_(), *args[1:], **kwargs)
    assert staged == [1, 1]  # the forward feeding a backward is staged too
    assert_rel_close("o vs the forward keeping scores", o, o_grad, TOLERANCE[dtype])
    assert_rel_close("final_state vs it", ht, ht_grad, TOLERANCE[dtype])


@pytest.mark.interpret
def test_staged_forward_feeds_its_backward_above_k128(device, seed, monkeypatch):
    """Above K = 128 a forward feeding a backward is staged too: the output kernel writes
    the scores (equal to the intra kernel's) and the states are kept, so the backward runs
    no state pass of its own and gives the gradients it gives recomputing them (bit for
    bit), and those of the float64 loop over packed uneven sequences."""
    from fla.ops.common.chunk_fwd_intra import chunk_gated_delta_rule_fwd_intra
    from fla.ops.simple_gla import chunk as simple_gla_chunk
    from fla.ops.utils.index import prepare_chunk_indices
    monkeypatch.setattr(simple_gla_chunk, "_pass_would_split", lambda *a: False)
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=150)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=1, HV=1, K=160, V=48, N=3, gamma=True)
    cu = cu_seqlens_of(lengths, device)
    compare(inputs, torch.float16, device, fn=chunk_simple_gla, gen=gen, cu_seqlens=cu)

    x = {n: None if t is None else t.to(torch.float32).to(device) for n, t in inputs.items()}
    chunks, offsets = prepare_chunk_indices(cu, 64), cu.tolist()
    args = (x["q"], x["k"], x["v"], x["g"], x["initial_state"], 0.25, True)
    o, ht, g_cum, Aqk, segment_states, h = simple_gla_chunk._forward(*args, True, cu, chunks,
                                                                     offsets)
    assert segment_states is None and h is not None
    _, _, intra_scores = chunk_gated_delta_rule_fwd_intra(
        x["q"], x["k"], x["g"], None, cu_seqlens=cu, chunk_indices=chunks, delta=False)
    assert_rel_close("scores", Aqk, intra_scores, TOLERANCE[torch.float32])
    state_passes = []
    state_pass = simple_gla_chunk.chunk_gated_delta_rule_fwd_h
    monkeypatch.setattr(simple_gla_chunk, "chunk_gated_delta_rule_fwd_h",
                        lambda *a, **kw: state_passes.append(1) or state_pass(*a, **kw))
    do = randn(o.shape, gen, torch.float32).to(device)
    dht = randn(ht.shape, gen, torch.float32).to(device)
    tail = (x["initial_state"], cu, chunks, offsets, do, dht, 0.25, torch.float32)
    kept = simple_gla_chunk._backward(x["q"], x["k"], x["v"], g_cum, Aqk, None, h, *tail)
    assert state_passes == []
    again = simple_gla_chunk._backward(x["q"], x["k"], x["v"], g_cum, Aqk, None, None, *tail)
    assert state_passes == [1]
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), kept, again):
        assert torch.equal(a, b), name


def test_staged_forward_only_where_the_pass_would_not_split(monkeypatch):
    """Few long sequences keep the fused pass (cut into segments on an H100's 132 SMs):
    the staged state pass would walk each one whole."""
    from fla.ops.common import chunk_segments
    from fla.ops.simple_gla import chunk as simple_gla_chunk
    monkeypatch.setattr(chunk_segments, "multiprocessor_count", lambda: 132)
    chunk_segments._segment_lengths.clear()

    def splits(B, T, H, K=256, V=256, offsets=None):
        k = torch.empty(B, T, H, K, device="meta")
        return simple_gla_chunk._pass_would_split(k, torch.empty(B, T, H, V, device="meta"),
                                                  offsets)

    assert splits(1, 65536, 4)                  # a 64K-token prompt over 4 heads
    assert splits(1, 40000, 2, offsets=[0, 39000, 40000])
    assert not splits(8, 2048, 32)              # the benchmark shape fills the GPU
    assert not splits(1, 900, 4)                # too short to cut
    chunk_segments._segment_lengths.clear()


def test_backward_without_scores_above_k128_is_refused():
    """Above K = 128 no pass can form the scores again from γ: a backward handed none
    says so instead of failing deeper."""
    from fla.ops.simple_gla import chunk as simple_gla_chunk
    q = k = torch.zeros(1, 8, 1, 160)
    v = do = torch.zeros(1, 8, 1, 16)
    with pytest.raises(RuntimeError, match="above K = 128"):
        simple_gla_chunk._backward(q, k, v, None, None, None, None, None, None, None, None,
                                   do, None, 1.0, None)


@pytest.mark.interpret
@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "batch"])
def test_chunk_with_sequences_split_into_segments(varlen, device, seed, monkeypatch):
    """The split state pass (few long sequences on a large GPU), forced at every chunk.
    The backward recomputes the states segment by segment from the forward's segment
    states, never by the sequential walk (which would fail here), and splits its reverse
    pass the same way: one combine launch, the reverse pass's (the forward's output
    programs form their entering states themselves; not counting compile ahead's
    recording of a first call on a GPU, which launches nothing)."""
    from fla.ops.simple_gla import chunk as simple_gla_chunk

    def no_walk(*args, **kwargs):
        raise AssertionError("the backward walked the sequences despite the split")

    combines = counted_segment_combines(monkeypatch)
    monkeypatch.setattr(simple_gla_chunk, "chunk_gated_delta_rule_fwd_h", no_walk)
    gen = generator(seed)
    B, T, N, cu = packed_or_batch(uneven_lengths(2, gen, low=30, high=200), varlen, device)
    inputs = make_inputs(gen, B=B, T=T, H=2, HV=2, K=16, V=32, N=N)
    compare(inputs, torch.float32, device, fn=chunk_simple_gla, gen=gen, cu_seqlens=cu)
    assert sum(combines) == 1, combines


@pytest.mark.interpret
@pytest.mark.parametrize("mode", list(OPS))
def test_long_decays_in_fp16_stay_finite_and_exact(mode, device, seed):
    """Per-step log decays down to −20 (a chunk's γ reaches −1280): no inf/NaN, and the
    results still match float64 (exponents are only ever formed as differences ≤ 0).
    Without an initial state: its gradient decays like e^γ of the first tokens, below
    fp16's smallest number (6e-8) once one gate is under −17, where no fp16 kernel can
    carry it."""
    gen = generator(seed)
    inputs = make_inputs(gen, B=1, T=odd_length(gen, 65, 140), H=2, HV=2, K=16, V=16,
                         gate_low=-20.0, h0=False)
    compare(inputs, torch.float16, device, fn=OPS[mode], gen=gen)


@pytest.mark.interpret
def test_scale_and_head_first(device, seed):
    gen = generator(seed)

    def head_first_op(q, k, v, g, g_gamma, initial_state, **kw):
        o, ht = chunk_simple_gla(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 g.transpose(1, 2), g_gamma, initial_state=initial_state,
                                 head_first=True, **kw)
        return o.transpose(1, 2), ht

    compare(make_inputs(gen, B=2, T=70, H=2, HV=2, K=16, V=16, gamma=True), torch.float32,
            device, fn=head_first_op, gen=gen, scale=0.3)


@pytest.mark.interpret
@pytest.mark.parametrize("fn", [chunk_retention, fused_recurrent_retention],
                         ids=["chunk", "fused_recurrent"])
def test_retention_wrappers(fn, device, seed):
    gen = generator(seed)
    inputs = make_inputs(gen, B=2, T=odd_length(gen, 65, 130), H=3, HV=3, K=16, V=16,
                         gate=False)
    inputs.pop("g"), inputs.pop("g_gamma")
    compare(inputs, torch.float32, device, fn=fn, ref_fn=naive_recurrent_retention, gen=gen)


@pytest.mark.interpret
def test_chunk_equals_fused_recurrent(device, seed):
    gen = generator(seed)
    lengths = uneven_lengths(2, gen, low=10, high=140)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=1, HV=2, K=16, V=32, N=2, gamma=True)
    cu = cu_seqlens_of(lengths, device)
    do = torch.randn(inputs["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(inputs["initial_state"].shape, generator=gen, dtype=torch.float64)
    results = [run(fn, cast(inputs, torch.float32, device), do, dht, cu_seqlens=cu)
               for fn in OPS.values()]
    (o1, h1, g1), (o2, h2, g2) = results
    assert_rel_close("o", o1, o2, 1e-4)
    assert_rel_close("final_state", h1, h2, 1e-4)
    for name in g1:
        if g1[name] is not None:
            assert_rel_close(f"d{name}", g1[name], g2[name], 1e-4)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mode", list(OPS))
def test_torch_paths_match_float64_loop(mode, dtype, seed, monkeypatch):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=140)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=1, HV=2, K=16, V=16, N=3, gamma=True)
    compare(inputs, dtype, "cpu", fn=OPS[mode], gen=gen, cu_seqlens=cu_seqlens_of(lengths))


@pytest.mark.no_poison
@pytest.mark.parametrize("mode", list(OPS))
def test_bad_inputs_are_refused(mode):
    fn = OPS[mode]
    q = torch.randn(1, 10, 2, 16)
    v = torch.randn(1, 10, 2, 16)
    g = -torch.rand(1, 10, 2)
    with pytest.raises(ValueError, match=r"g_gamma: expected one log decay per head, "
                                         r"shape \[2\].*\[3\]"):
        fn(q, q, v, g, g_gamma=torch.zeros(3))
    with pytest.raises(ValueError, match=r"g: expected shape \[B, T, HV\].*\(1, 10, 3\)"):
        fn(q, q, v, -torch.rand(1, 10, 3))
    with pytest.raises(ValueError, match=r"looks like a \[B, H, T, \.\.\.\] tensor"):
        x = torch.randn(1, 4, 300, 16)   # [B, H, T, K] passed time-major
        fn(x, x, x, -torch.rand(1, 4, 300))
    with pytest.raises(TypeError, match=r"g_gamma: expected dtype in .*got int64"):
        fn(q, q, v, g, g_gamma=torch.zeros(2, dtype=torch.long))


# ------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("mode", list(OPS))
def test_bf16_at_real_shapes_matches_float64_loop(mode, D, seed):
    """bf16 at (2, 1000, 4, D) and a varlen case: every gradient against float64 (the
    reference library refuses this gated backward on Hopper with Triton 3.4–3.7.0)."""
    gen = generator(seed)
    compare(make_inputs(gen, B=2, T=1000, H=4, HV=4, K=D, V=D, gamma=True),
            torch.bfloat16, "cuda", fn=OPS[mode], gen=gen)
    lengths = uneven_lengths(4, gen, low=30, high=700)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=4, HV=4, K=D, V=D, N=4)
    compare(inputs, torch.bfloat16, "cuda", fn=OPS[mode], gen=gen,
            cu_seqlens=cu_seqlens_of(lengths, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_every_tuning_config_of_the_simple_gla_kernels(D, seed, monkeypatch):
    """Each config the tuning layer may pick for a kernel of chunk_simple_gla (forward and
    backward, the W-less variants of the shared stages) compiles on this Triton/GPU and
    gives the float64 loop's outputs and gradients."""
    from fla.ops.common import (
        chunk_delta_h,
        chunk_delta_h_bwd,
        chunk_fwd_inter,
        chunk_fwd_intra,
        chunk_o,
        chunk_o_bwd,
    )
    from tests.ops.config_sweep import launched_stages, sweep_configs

    gen = generator(seed)
    inputs = make_inputs(gen, B=2, T=300, H=2, HV=2, K=D, V=D, gamma=True)
    do = output_grad(inputs["v"].shape, gen, torch.bfloat16)
    dht = randn(inputs["initial_state"].shape, gen, torch.float64)
    leaves = cast(inputs, torch.bfloat16, "cpu")
    ref_leaves = {n: None if x is None else x.detach().double().cuda().requires_grad_()
                  for n, x in leaves.items()}
    o_ref, h_ref, g_ref = run(naive_recurrent_simple_gla, ref_leaves, do, dht)
    refs = [o_ref, h_ref] + [g_ref[n] for n in ("q", "k", "v", "g", "initial_state")]

    def call():
        cuda = {n: None if x is None else x.detach().cuda().requires_grad_()
                for n, x in leaves.items()}
        o, ht, grads = run(chunk_simple_gla, cuda, do, dht)
        return [o, ht] + [grads[n] for n in ("q", "k", "v", "g", "initial_state")]

    # (Above K = 128 the forward is staged: chunk_o writes the output and the scores.)
    modules = (chunk_fwd_intra, chunk_fwd_inter, chunk_delta_h, chunk_delta_h_bwd, chunk_o,
               chunk_o_bwd)
    launched = launched_stages(monkeypatch, modules, call, refs, 2e-2)
    failures = sweep_configs(monkeypatch, launched, min_configs=2)
    assert not failures, "\n".join(failures)
