"""GLA (chunk and fused recurrent) against the float64 loop: outputs, final states and
every gradient (q, k, v, gk, gv, initial_state), through the Triton kernels (interpreted
on CPU: fp32, fp16, small shapes; bf16 at real shapes on the GPU) and the PyTorch paths.
Gates are log-sigmoids of scaled normals clamped at −5 a step: over a 64-token chunk the
cumulative gate reaches −320, where exp(γ) and exp(−γ) formed apart would overflow."""
import pytest
import torch

from fla.ops.gla import chunk_gla, fused_recurrent_gla, naive_recurrent_gla
from fla.ops.simple_gla import chunk_simple_gla
from tests.helpers import (
    TOLERANCE,
    assert_rel_close,
    cu_seqlens_of,
    generator,
    odd_length,
    output_grad,
    randn,
    uneven_lengths,
)
from tests.ops.gated_delta_cases import INTERPRETER_DTYPES, run
from tests.ops.vector_gate_cases import cast_leaves, compare_with_loop, log_sigmoid_gate

OPS = {"chunk": chunk_gla, "fused_recurrent": fused_recurrent_gla}
FP32_NAMES = ("initial_state", "g", "gk", "gv")   # gates and states stay float32


def make_inputs(gen, *, B, T, H, K, V, N=None, gv=False, h0=True, low=-5.0):
    """float64 leaves: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K]; gv; h0."""
    N = B if N is None else N
    x = {
        "q": randn((B, T, H, K), gen, torch.float64),
        "k": randn((B, T, H, K), gen, torch.float64, scale=K ** -0.5),
        "v": randn((B, T, H, V), gen, torch.float64),
        "g": log_sigmoid_gate((B, T, H, K), gen, low),
        "initial_state": randn((N, H, K, V), gen, torch.float64, scale=0.5) if h0 else None,
    }
    if gv:
        x["gv"] = log_sigmoid_gate((B, T, H, V), gen, low=-1.0, spread=1.0)
    return x


def leaves_of(inputs, dtype, device):
    return cast_leaves(inputs, dtype, device, FP32_NAMES)


def as_fused(fn):
    """Call fn with GLA's chunk name ``g`` passed as fused_recurrent_gla's ``gk``."""
    def call(g=None, **kw):
        return fn(gk=g, **kw)
    return call


def naive(g=None, **kw):
    return naive_recurrent_gla(gk=g, **kw)


def compare(inputs, dtype, device, *, fn, gen, ref_fn=naive, tol=None, **kwargs):
    """fn and the float64 loop on the same rounded inputs: o, final state, all gradients."""
    compare_with_loop(inputs, dtype, device, fn=fn, ref_fn=ref_fn, gen=gen,
                      fp32_names=FP32_NAMES, tol=tol, **kwargs)


def op(mode):
    return chunk_gla if mode == "chunk" else as_fused(fused_recurrent_gla)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mode", list(OPS))
def test_matches_float64_loop(mode, dtype, device, seed):
    gen = generator(seed)
    T = odd_length(gen, low=65, high=110)          # more than one chunk, never a multiple
    compare(make_inputs(gen, B=2, T=T, H=1, K=16, V=32), dtype, device, fn=op(mode), gen=gen)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("exclusive", [False, True], ids=["gla", "rwkv6"])
def test_chunk_steep_and_mild_heads(exclusive, dtype, device, seed):
    """Head 0's gates within one-reference spans, head 1's 4x steeper (down to −20 a
    step): the forward's strips and the backward's in-block pairs take the one-reference
    form for some chunks and the halving for others in the same call (fp16 inputs: the
    forward's halving throughout; RWKV6's exclusive query gate γ − w included); outputs,
    states and gradients against float64."""
    from fla.ops.common.chunk_gk_fwd import ONE_REFERENCE_MAX_SPAN
    from fla.ops.rwkv6 import chunk_rwkv6
    from tests.ops import test_rwkv6
    gen = generator(seed)
    T = odd_length(gen, low=65, high=110)
    if exclusive:
        inputs, gate = test_rwkv6.make_inputs(gen, B=1, T=T, H=2, K=32, V=16), "w"
    else:
        inputs, gate = make_inputs(gen, B=1, T=T, H=2, K=32, V=16), "g"
    inputs[gate][:, :, 1] *= 4
    spans = strip_spans(inputs[gate][0], torch.tensor([0, T]), exclusive)
    limit = float(ONE_REFERENCE_MAX_SPAN.value)
    assert (spans[:, 0] <= limit).all() and (spans[:, 1] > limit).any()
    if exclusive:
        test_rwkv6.compare(inputs, dtype, device, fn=chunk_rwkv6, gen=gen)
    else:
        compare(inputs, dtype, device, fn=chunk_gla, gen=gen)


@pytest.mark.interpret
@pytest.mark.parametrize("exclusive", [False, True], ids=["gla", "rwkv6"])
def test_backward_with_and_without_the_gated_operands(exclusive, device, seed):
    """The backward step given the forward's gated operands (what a forward with
    gradients keeps) and given none (its two state passes gate q and k themselves)
    agree, fp32, packed sequences."""
    from fla.ops.gla import chunk as gla_chunk
    from fla.ops.utils.index import prepare_chunk_indices, varlen_chunk_offsets
    gen = generator(seed)
    lengths = uneven_lengths(2, gen, low=30, high=100)
    x = make_inputs(gen, B=1, T=sum(lengths), H=2, K=32, V=16, N=2)
    q, k, v, g, h0 = (x[n].float().to(device) for n in ("q", "k", "v", "g", "initial_state"))
    u = randn((2, 32), gen, torch.float64).float().to(device) if exclusive else None
    cu = cu_seqlens_of(lengths, device)
    ci = prepare_chunk_indices(cu, 64)
    offsets = cu.tolist()
    co = varlen_chunk_offsets(cu, 64, offsets)
    do = randn(v.shape, gen, torch.float64).float().to(device)
    dht = randn(h0.shape, gen, torch.float64).float().to(device)
    _, _, g_cum, A, qg, kg = gla_chunk._forward(q, k, v, g, u, h0, 0.2, True, True, cu, ci,
                                                co, offsets, exclusive, torch.float32)
    rest = (h0, cu, ci, co, offsets, do, dht, 0.2, exclusive)
    with_ops = gla_chunk._backward(q, k, v, g, u, g_cum, A, qg, kg, *rest)
    without = gla_chunk._backward(q, k, v, g, u, g_cum, A, None, None, *rest)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "du", "dh0"), with_ops, without):
        if b is not None:
            assert_rel_close(name, a, b, 1e-5)


@pytest.mark.interpret
@pytest.mark.parametrize("exclusive", [False, True], ids=["gla", "rwkv6"])
def test_backward_level_paths(exclusive, device, seed):
    """dq/dk/dg's three level paths in one call (one level over the chunk, the halving
    then one level a 16-row block, the six halving levels: heads with mild, medium and
    steep gates over packed sequences), fp32, against float64."""
    from fla.ops.common.chunk_gk_fwd import ONE_REFERENCE_MAX_SPAN
    from fla.ops.rwkv6 import chunk_rwkv6
    from tests.ops import test_rwkv6
    gen = generator(seed)
    lengths = uneven_lengths(2, gen, low=70, high=140)
    cu = cu_seqlens_of(lengths)
    if exclusive:
        x = test_rwkv6.make_inputs(gen, B=1, T=sum(lengths), H=3, K=32, V=16, N=2)
        gate = "w"
    else:
        x = make_inputs(gen, B=1, T=sum(lengths), H=3, K=32, V=16, N=2)
        gate = "g"
    # Head 1 at 1.4x: unscaled, ~2% of draws had no chunk on the middle path.
    x[gate][:, :, 0] *= 0.25
    x[gate][:, :, 1] *= 1.4
    x[gate][:, :, 2] *= 4
    counts = backward_level_counts(x[gate][0], cu, exclusive,
                                   float(ONE_REFERENCE_MAX_SPAN.value))
    assert {1, 3, 6} <= set(counts.flatten().tolist()), counts
    if exclusive:
        test_rwkv6.compare(x, torch.float32, device, fn=chunk_rwkv6, gen=gen,
                           cu_seqlens=cu.to(device))
    else:
        compare(x, torch.float32, device, fn=chunk_gla, gen=gen, cu_seqlens=cu.to(device))


@pytest.mark.interpret
def test_chunk_wide_heads_fp16(device, seed):
    """K = 96 (two K tiles of the backward, three 32-wide state tiles), V = 48."""
    gen = generator(seed)
    compare(make_inputs(gen, B=1, T=odd_length(gen, 65, 100), H=1, K=96, V=48),
            torch.float16, device, fn=chunk_gla, gen=gen)


@pytest.mark.interpret
@pytest.mark.parametrize("mode", list(OPS))
def test_varlen_uneven_sequences(mode, device, seed):
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=100)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=1, K=16, V=16, N=3)
    compare(inputs, torch.float32, device, fn=op(mode), gen=gen,
            cu_seqlens=cu_seqlens_of(lengths, device))


@pytest.mark.interpret
def test_fused_recurrent_value_gate_and_reverse(device, seed):
    """gk and gv together, run backwards in time over packed sequences: the reference is
    the float64 loop on the sequences reversed."""
    gen = generator(seed)
    lengths = uneven_lengths(2, gen, low=5, high=60)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=2, K=16, V=16, N=2, gv=True)
    cu = cu_seqlens_of(lengths)
    index = torch.cat([torch.arange(e - 1, s - 1, -1) for s, e in
                       zip(cu[:-1].tolist(), cu[1:].tolist())])

    def reversed_naive(q, k, v, g, gv, **kw):
        flip = [x.index_select(1, index) for x in (q, k, v, g, gv)]
        o, ht = naive_recurrent_gla(*flip[:3], gk=flip[3], gv=flip[4], **kw)
        return o.index_select(1, index), ht

    def fused(g, **kw):
        return fused_recurrent_gla(gk=g, reverse=True, **kw)

    compare(inputs, torch.float16, device, fn=fused, ref_fn=reversed_naive, gen=gen,
            cu_seqlens=cu.to(device))


@pytest.mark.interpret
def test_head_first_and_scale(device, seed):
    gen = generator(seed)

    def head_first_op(q, k, v, g, initial_state, **kw):
        o, ht = chunk_gla(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          g.transpose(1, 2), initial_state=initial_state, head_first=True, **kw)
        return o.transpose(1, 2), ht

    compare(make_inputs(gen, B=2, T=70, H=1, K=16, V=16), torch.float32, device,
            fn=head_first_op, gen=gen, scale=0.3)


@pytest.mark.interpret
def test_chunk_equals_fused_recurrent(device, seed):
    gen = generator(seed)
    lengths = uneven_lengths(2, gen, low=10, high=140)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=1, K=16, V=32, N=2)
    cu = cu_seqlens_of(lengths, device)
    do = torch.randn(inputs["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(inputs["initial_state"].shape, generator=gen, dtype=torch.float64)
    (o1, h1, g1), (o2, h2, g2) = [run(fn, leaves_of(inputs, torch.float32, device), do, dht,
                                      cu_seqlens=cu)
                                  for fn in (chunk_gla, as_fused(fused_recurrent_gla))]
    assert_rel_close("o", o1, o2, 1e-4)
    assert_rel_close("final_state", h1, h2, 1e-4)
    for name in g1:
        assert_rel_close(f"d{name}", g1[name], g2[name], 1e-4)


@pytest.mark.interpret
def test_gate_constant_over_k_equals_simple_gla(device, seed):
    """A gate that is the same in every key channel is simple GLA's scalar gate; the
    gradient of the scalar gate is the sum over K of GLA's."""
    gen = generator(seed)
    inputs = make_inputs(gen, B=1, T=odd_length(gen, 65, 130), H=2, K=16, V=16)
    scalar = log_sigmoid_gate(inputs["g"].shape[:3], gen)
    do = torch.randn(inputs["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(inputs["initial_state"].shape, generator=gen, dtype=torch.float64)
    results = []
    for vector in (True, False):
        leaves = leaves_of({**inputs, "g": scalar}, torch.float32, device)
        if vector:
            g = leaves.pop("g")
            fn = lambda **kw: chunk_gla(g=g.unsqueeze(-1).expand_as(leaves["q"]), **kw)  # noqa: E731
            o, ht, grads = run(fn, leaves, do, dht)
            grads["g"] = g.grad
        else:
            o, ht, grads = run(chunk_simple_gla, leaves, do, dht)
        results.append((o, ht, grads))
    (o1, h1, g1), (o2, h2, g2) = results
    assert_rel_close("o", o1, o2, 1e-4)
    assert_rel_close("final_state", h1, h2, 1e-4)
    for name in g2:
        assert_rel_close(f"d{name}", g1[name], g2[name], 1e-4)


def scores_float64(q, k, g, u, cu, exclusive, chunk=64):
    """A [T, H, 64] of one packed batch (q, k, g [T, H, K]), chunk by chunk in float64,
    and the mask of the entries that may be nonzero (j ≤ i inside the chunk)."""
    T, H, _ = q.shape
    A = torch.zeros(T, H, chunk, dtype=torch.float64)
    allowed = torch.zeros(T, chunk, dtype=torch.bool)
    bounds = cu.tolist()
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        for c in range(bos, eos, chunk):
            L = min(c + chunk, eos) - c
            gam = g[c:c + L].cumsum(0)
            gq = torch.cat([torch.zeros_like(gam[:1]), gam[:-1]]) if exclusive else gam
            lower = torch.tril(torch.ones(L, L, dtype=torch.bool), -1)
            # Exponents above the diagonal are positive: masked before the exp.
            d = torch.where(lower[:, :, None, None], gq[:, None] - gam[None, :], -torch.inf)
            s = (q[c:c + L, None] * k[None, c:c + L] * d.exp()).sum(-1)
            if u is not None:
                diag = (q[c:c + L] * u * k[c:c + L]).sum(-1)
            elif not exclusive:
                diag = (q[c:c + L] * k[c:c + L]).sum(-1)
            else:
                diag = torch.zeros(L, H, dtype=torch.float64)
            s[torch.arange(L), torch.arange(L)] = diag
            A[c:c + L, :, :L] = s.transpose(1, 2)
            allowed[c:c + L, :L] = torch.tril(torch.ones(L, L, dtype=torch.bool))
    return A, allowed


def chunk_gates(g, cu, exclusive, chunk=64):
    """For each chunk of the packed sequences ``cu`` over g [T, ...]: its token slice,
    γ (the chunk-local cumsum) and γq (γ − g with ``exclusive``, else γ)."""
    bounds = cu.tolist()
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        for c in range(bos, eos, chunk):
            rows = slice(c, min(c + chunk, eos))
            gam = g[rows].cumsum(0)
            yield rows, gam, gam - g[rows] if exclusive else gam


def strip_spans(g, cu, exclusive, chunk=64):
    """Each 16-row strip's span as chunk_gk_fwd_A measures it (max over channels of
    γq_f − γ_m and γ_m − γ_e, f / m / e its first / 8th / last valid rows) for g
    [T, H, K]: a tensor [strips, H]."""
    spans = []
    for _, gam, gq in chunk_gates(g, cu, exclusive, chunk):
        L = gam.shape[0]
        for f in range(0, L, 16):
            m, e = min(f + 7, L - 1), min(f + 15, L - 1)
            spans.append(torch.maximum(gq[f] - gam[m], gam[m] - gam[e]).amax(-1))
    return torch.stack(spans)


def score_forms(g, cu, exclusive, limit, chunk=64):
    """The form chunk_gk_fwd_A takes for each chunk and head of g [T, H, K] (bf16 or
    fp32 inputs): 0 where half the chunk's range of γ in every channel (from its largest
    γq to its smallest γ: the chunk form's largest exponent) is ≤ limit, else 1 where
    each 16-row strip's own reference keeps its exponents ≤ limit, else 2 (the halving);
    a tensor [chunks, H]."""
    strips = strip_spans(g, cu, exclusive, chunk)
    forms, i = [], 0
    for rows, gam, gq in chunk_gates(g, cu, exclusive, chunk):
        n = -(-(rows.stop - rows.start) // 16)
        whole = ((gq.amax(0) - gam.amin(0)) / 2).amax(-1) <= limit
        forms.append(torch.where(whole, 0, torch.where((strips[i:i + n] <= limit).all(0),
                                                       1, 2)))
        i += n
    return torch.stack(forms)


def backward_level_counts(g, cu, exclusive, limit, chunk=64):
    """How many levels dq/dk/dg run for each chunk and head of g [T, H, K] (one K tile):
    1 where a one-reference level over the chunk (middle row 31) keeps every exponent
    ≤ limit, 3 where one over each 16-row block does, else 6."""
    counts = []
    for _, gam, gq in chunk_gates(g, cu, exclusive, chunk):
        L = gam.shape[0]
        rows = torch.arange(L)

        def span(b):
            gm = gam[torch.clamp((rows // b) * b + b // 2 - 1, max=L - 1)]
            return torch.maximum(gm - gam, gq - gm).amax(dim=(0, 2))

        counts.append(torch.where(span(64) <= limit, 1, torch.where(span(16) <= limit, 3, 6)))
    return torch.stack(counts)


def gated_operands_float64(q, k, g, cu, exclusive, chunk=64):
    """q ⊙ e^{γq} and k ⊙ e^{γ_C − γ} ([T, H, K]) chunk by chunk, γ chunk-local, γ_C its
    last row, γq = γ (γ − g with ``exclusive``)."""
    qg, kg = torch.empty_like(q), torch.empty_like(k)
    for rows, gam, gq in chunk_gates(g, cu, exclusive, chunk):
        qg[rows] = q[rows] * gq.exp()
        kg[rows] = k[rows] * (gam[-1:] - gam).exp()
    return qg, kg


# The scores kernel's launches (FORM, FIRST, GATE_OPERANDS) asked for gated operands:
# the first from the strips (a forward feeding a backward up to
# CHUNK_FORM_WITH_GRADIENTS_ABOVE_K), from the chunk form with γ written in full (above
# it) or at each chunk's last row (a forward feeding none); then one follow-up, which
# gates the operands of the chunks it forms only where the first launch left them.
SCORE_LAUNCHES = {"strips_first": ((1, True, True), (2, False, True)),
                  "chunk_form_gamma": ((0, True, True), (1, False, False)),
                  "chunk_form": ((0, True, True), (1, False, False))}


@pytest.mark.interpret
@pytest.mark.parametrize("first", list(SCORE_LAUNCHES))
@pytest.mark.parametrize("steep", [False, True], ids=["one_reference", "mixed"])
@pytest.mark.parametrize("variant", ["gla", "rwkv6"])
def test_intra_chunk_scores_kernel(variant, steep, first, device, seed, monkeypatch):
    """chunk_gk_fwd_A alone (GLA; RWKV6's exclusive scores with the bonus u) against
    float64: packed sequences that each end in a partial chunk, K = 80 (not a multiple
    of the K tile); entries above the diagonal and past the chunk's end exactly zero;
    the state pass's gated operands q ⊙ e^{γq} and k ⊙ e^{γ_C − γ} too, and γ where it
    is written in full. Head 0's mild gates keep half its chunks' range of γ within
    ONE_REFERENCE_MAX_SPAN (the chunk form); head 1's, down to −7 a step, keep only
    every strip's span within it (the strips' form); ``steep`` makes head 2's 4x
    steeper still, so that strips on both sides of the limit meet (the halving for the
    steep ones). Each launch sequence ``first`` (SCORE_LAUNCHES) in two launches: the
    chunks the first refuses, strips' and halving's, all formed by the one follow-up."""
    from fla.ops.common import chunk_gk_fwd
    from fla.ops.common.chunk_gk_fwd import ONE_REFERENCE_MAX_SPAN, chunk_gk_fwd_A
    from fla.ops.utils.index import prepare_chunk_indices
    from tests.ops.config_sweep import record_launches
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=20, high=150)
    T, H, K = sum(lengths), 3, 80
    x = make_inputs(gen, B=1, T=T, H=H, K=K, V=16, h0=False)
    exclusive = variant == "rwkv6"
    x["g"][..., 0, :] *= 0.25
    x["g"][..., 1, :] *= 1.4
    if steep:
        x["g"][..., 2, :] *= 4
    limit = float(ONE_REFERENCE_MAX_SPAN.value)
    forms = score_forms(x["g"][0], cu_seqlens_of(lengths), exclusive, limit)
    assert {0, 1} <= set(forms.flatten().tolist()) and (2 in forms) == steep, forms
    u = randn((H, K), gen, torch.float64) if exclusive else None
    cu = cu_seqlens_of(lengths)
    q, k, g = (x[n][0].to(torch.float32) for n in ("q", "k", "g"))
    if first == "chunk_form_gamma":
        monkeypatch.setattr(chunk_gk_fwd, "CHUNK_FORM_WITH_GRADIENTS_ABOVE_K", 0)
    store_gamma = first != "chunk_form"
    launches = record_launches(monkeypatch, chunk_gk_fwd.chunk_gk_fwd_A_kernel)
    g_cum, A, qg, kg = chunk_gk_fwd_A(
        q[None].to(device), k[None].to(device), g[None].to(device),
        None if u is None else u.to(torch.float32).to(device), cu.to(device),
        prepare_chunk_indices(cu.to(device), 64), exclusive=exclusive, gate_operands=True,
        store_gamma=store_gamma)
    assert tuple((a["FORM"], a["FIRST"], a["GATE_OPERANDS"]) for _, a in launches) \
        == SCORE_LAUNCHES[first]
    assert [a["STORE_GAMMA"] for _, a in launches] == [first == "chunk_form_gamma", False]
    g_cum, A, qg, kg = (t[0].cpu() for t in (g_cum, A, qg, kg))
    if store_gamma:
        gamma = torch.cat([gam for _, gam, _ in chunk_gates(g.double(), cu, False)])
        assert_rel_close("g_cum", g_cum, gamma, 1e-5)
    qg_ref, kg_ref = gated_operands_float64(*(t.double() for t in (q, k, g)), cu, exclusive)
    assert_rel_close("qg", qg, qg_ref, 1e-4)
    assert_rel_close("kg", kg, kg_ref, 1e-4)
    A_ref, allowed = scores_float64(*(t.double() for t in (q, k, g)),
                                    None if u is None else u.to(torch.float32).double(),
                                    cu, exclusive)
    assert A.dtype == torch.float32 and A.shape == (T, H, 64)
    assert (A.transpose(1, 2)[~allowed] == 0).all()
    assert_rel_close("A", A, A_ref, 1e-4)


@pytest.mark.interpret
@pytest.mark.parametrize("exclusive", [False, True], ids=["gla", "rwkv6"])
def test_chunk_form_with_gradients(exclusive, device, seed, monkeypatch):
    """The scores kernel's chunk form feeding a backward (γ written in full by a pass of
    its own; on by K for wide heads, forced here at every K): outputs, final state and
    every gradient against float64, with heads whose chunks take each of the three
    forms (fp32, packed sequences)."""
    from fla.ops.common import chunk_gk_fwd
    from fla.ops.rwkv6 import chunk_rwkv6
    from tests.ops import test_rwkv6
    monkeypatch.setattr(chunk_gk_fwd, "CHUNK_FORM_WITH_GRADIENTS_ABOVE_K", 0)
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=40, high=160)
    cu = cu_seqlens_of(lengths)
    make = test_rwkv6.make_inputs if exclusive else make_inputs
    x = make(gen, B=1, T=sum(lengths), H=3, K=32, V=16, N=3)
    gate = "w" if exclusive else "g"
    x[gate][..., 0, :] *= 0.25
    x[gate][..., 1, :] *= 1.4
    x[gate][..., 2, :] *= 4
    forms = score_forms(x[gate][0], cu, exclusive,
                        float(chunk_gk_fwd.ONE_REFERENCE_MAX_SPAN.value))
    assert set(forms.flatten().tolist()) == {0, 1, 2}, forms
    if exclusive:
        test_rwkv6.compare(x, torch.float32, device, fn=chunk_rwkv6, gen=gen,
                           cu_seqlens=cu.to(device))
    else:
        compare(x, torch.float32, device, fn=chunk_gla, gen=gen, cu_seqlens=cu.to(device))


@pytest.mark.interpret
@pytest.mark.parametrize("variant", ["gla", "rwkv6"])
def test_forward_without_gradients_matches_forward_with(variant, device, seed):
    """A forward that feeds no backward writes γ only where the state pass reads it
    (each chunk's last row) and in full only for the chunks it leaves to the strips or
    the halving: its output and final state equal those of a forward with gradients
    (fp32, packed sequences of lengths 1 and 3 among uneven others, heads whose chunks
    take each of the three forms)."""
    from fla.ops.common.chunk_gk_fwd import ONE_REFERENCE_MAX_SPAN
    from fla.ops.rwkv6 import chunk_rwkv6
    from tests.ops import test_rwkv6
    gen = generator(seed)
    lengths = [1, 3] + uneven_lengths(3, gen, low=40, high=160)
    cu = cu_seqlens_of(lengths)
    if variant == "rwkv6":
        x = test_rwkv6.make_inputs(gen, B=1, T=sum(lengths), H=3, K=32, V=16, N=5)
        fn, gate = chunk_rwkv6, "w"
    else:
        x = make_inputs(gen, B=1, T=sum(lengths), H=3, K=32, V=16, N=5)
        fn, gate = chunk_gla, "g"
    x[gate][..., 0, :] *= 0.25
    x[gate][..., 1, :] *= 1.4
    x[gate][..., 2, :] *= 4
    forms = score_forms(x[gate][0], cu, variant == "rwkv6",
                        float(ONE_REFERENCE_MAX_SPAN.value))
    assert set(forms.flatten().tolist()) == {0, 1, 2}, forms
    args = {n: t.float().to(device) for n, t in x.items()}
    with torch.no_grad():
        o_plain, ht_plain = fn(**args, output_final_state=True, cu_seqlens=cu.to(device))
    leaves = {n: t.requires_grad_() for n, t in args.items()}
    o_grad, ht_grad = fn(**leaves, output_final_state=True, cu_seqlens=cu.to(device))
    # Equal up to rounding: γ's last row is a column sum of g here, a cumsum's last
    # row there (fp32: ~1e-6 relative).
    assert_rel_close("o", o_plain, o_grad.detach(), 1e-5)
    assert_rel_close("final_state", ht_plain, ht_grad.detach(), 1e-5)


@pytest.mark.interpret
@pytest.mark.parametrize("variant", ["gla", "rwkv6"])
def test_forward_without_gradients_under_steep_gates(variant, device, seed):
    """Gates of −10 to −20 a step (γ down to ~−1300 at a chunk's end, where fp32 holds
    ~1e-4 of it): the state is mostly each chunk's last tokens, k ⊙ e^{γ_C − γ} with an
    exponent near 0, which must come out as 0 there. A forward that feeds no backward
    (the scores kernel's chunk form, γ_C from its own cumsum) gives the final state and
    output as close to float64 as fp32 allows (its γ_C taken as a separate sum of g had
    the final state ~1e-4 off on the H100)."""
    from fla.ops.rwkv6 import chunk_rwkv6, naive_recurrent_rwkv6
    from tests.ops import test_rwkv6
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=40, high=160)
    cu = cu_seqlens_of(lengths)
    make = test_rwkv6.make_inputs if variant == "rwkv6" else make_inputs
    x = make(gen, B=1, T=sum(lengths), H=2, K=32, V=16, N=3)
    gate = "w" if variant == "rwkv6" else "g"
    x[gate] = -10 - 10 * torch.rand(x[gate].shape, generator=gen, dtype=torch.float64)
    if variant == "rwkv6":
        fn, ref = chunk_rwkv6, naive_recurrent_rwkv6
    else:
        fn, ref = chunk_gla, naive
    with torch.no_grad():
        o, ht = fn(**{n: t.float().to(device) for n, t in x.items()},
                   output_final_state=True, cu_seqlens=cu.to(device))
        rounded = {n: t.float().double() for n, t in x.items()}
        o_ref, ht_ref = ref(**rounded, output_final_state=True, cu_seqlens=cu)
    assert_rel_close("final_state", ht, ht_ref, 1e-5)
    assert_rel_close("o", o, o_ref, 1e-5)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mode", list(OPS))
def test_torch_paths_match_float64_loop(mode, dtype, seed, monkeypatch):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=140)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=2, K=16, V=16, N=3)
    compare(inputs, dtype, "cpu", fn=op(mode), gen=gen, cu_seqlens=cu_seqlens_of(lengths))


@pytest.mark.no_poison
@pytest.mark.parametrize("mode", list(OPS))
def test_bad_inputs_are_refused(mode):
    fn = op(mode)
    q = torch.randn(1, 10, 2, 16)
    v = torch.randn(1, 10, 2, 8)
    g = -torch.rand(1, 10, 2, 16)
    with pytest.raises(ValueError, match=r"g.*expected .*\[B, T, H, K\].*\(1, 10, 2, 8\)"):
        fn(q=q, k=q, v=v, g=-torch.rand(1, 10, 2, 8))
    with pytest.raises(ValueError, match=r"v: expected shape \[B, T, H, V\]"):
        fn(q=q, k=q, v=torch.randn(1, 10, 3, 8), g=g)
    with pytest.raises(ValueError, match=r"initial_state"):
        fn(q=q, k=q, v=v, g=g, initial_state=torch.zeros(2, 2, 16, 8))
    with pytest.raises(ValueError, match=r"cu_seqlens"):
        fn(q=q, k=q, v=v, g=g, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(TypeError, match=r"k"):
        fn(q=q, k=q.long(), v=v, g=g)
    with pytest.raises(ValueError, match=r"looks like a \[B, H, T, \.\.\.\] tensor"):
        x = torch.randn(1, 4, 300, 16)   # [B, H, T, K] passed time-major
        fn(q=x, k=x, v=x, g=-x.abs())
    if mode == "fused_recurrent":
        with pytest.raises(ValueError, match=r"gv: expected shape"):
            fused_recurrent_gla(q, q, v, gk=g, gv=-torch.rand(1, 10, 2, 16))
    else:
        with pytest.raises(ValueError, match=r"g: chunk_gla needs"):
            chunk_gla(q, q, v, None)


# ------------------------------------------------------------------ GPU, real shapes
GPU_SHAPES = {"2x1000x4x128": dict(B=2, T=1000, H=4, K=128, V=128),
              "K=V=256": dict(B=1, T=300, H=2, K=256, V=256)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("mode", list(OPS))
def test_gpu_bf16_real_shapes(mode, shape):
    gen = generator(0x61a)
    compare(make_inputs(gen, **GPU_SHAPES[shape]), torch.bfloat16, "cuda", fn=op(mode), gen=gen)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("exclusive", [False, True], ids=["gla", "rwkv6"])
def test_gpu_bf16_forward_without_gradients(exclusive, shape):
    """A forward that feeds no backward takes its own path (the scores kernel's chunk
    form, γ written at each chunk's last row only), which the comparisons above, all
    with gradients, never run: bf16 at real shapes against float64, output and final
    state."""
    from fla.ops.rwkv6 import chunk_rwkv6, naive_recurrent_rwkv6
    from tests.ops import test_rwkv6
    gen = generator(0x61c)
    if exclusive:
        x = test_rwkv6.make_inputs(gen, **GPU_SHAPES[shape])
        fn, ref_fn = chunk_rwkv6, naive_recurrent_rwkv6
    else:
        x = make_inputs(gen, **GPU_SHAPES[shape])
        fn, ref_fn = chunk_gla, naive
    leaves = leaves_of(x, torch.bfloat16, "cuda")
    ref = {n: None if t is None else t.detach().cpu().double() for n, t in leaves.items()}
    with torch.no_grad():
        o, ht = fn(**leaves, output_final_state=True)
        o_ref, ht_ref = ref_fn(**ref, output_final_state=True)
    assert_rel_close("o", o, o_ref, TOLERANCE[torch.bfloat16])
    assert_rel_close("final_state", ht, ht_ref, TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(OPS))
def test_gpu_bf16_varlen(mode):
    gen = generator(0x61b)
    lengths = [1, 63, 700, 129, 1000]
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=4, K=128, V=128, N=len(lengths))
    compare(inputs, torch.bfloat16, "cuda", fn=op(mode), gen=gen,
            cu_seqlens=cu_seqlens_of(lengths, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("exclusive", [False, True], ids=["gla", "rwkv6"])
def test_every_tuning_config_of_the_vector_gate_kernels(D, exclusive, monkeypatch):
    """Each config the tuning layer may pick for a kernel of chunk_gla / chunk_rwkv6 (the
    scores, the state pass with and without stored states, dq/dk/dg and the reverse state
    pass) compiles on this Triton/GPU and gives the float64 loop's outputs and gradients.
    (H100, Triton 3.6: the state pass at BV = 32 with one stage faulted with an illegal
    address when FLA_TUNE=1 benchmarked it.)"""
    from fla.ops.common import chunk_delta_h_bwd, chunk_gk_bwd, chunk_gk_fwd
    from fla.ops.rwkv6 import chunk_rwkv6
    fn = chunk_rwkv6 if exclusive else chunk_gla
    _sweep_vector_gate_kernels(D, exclusive, monkeypatch, fn,
                               (chunk_gk_fwd, chunk_gk_bwd, chunk_delta_h_bwd), 3)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("exclusive", [False, True], ids=["gla", "rwkv6"])
def test_every_tuning_config_of_the_recurrent_kernels(D, exclusive, monkeypatch):
    """The same for fused_recurrent_gla / fused_recurrent_rwkv6 (forward and backward
    kernels): the forward's default differs on few sequences x heads (8 columns at 4
    warps at K = 128) from the decode batches' one-warp rule, so more of its space runs."""
    from fla.ops.gla import fused_recurrent as module
    from fla.ops.rwkv6 import fused_recurrent_rwkv6
    fn = fused_recurrent_rwkv6 if exclusive else as_fused(fused_recurrent_gla)
    _sweep_vector_gate_kernels(D, exclusive, monkeypatch, fn, (module,), 2)


def _sweep_vector_gate_kernels(D, exclusive, monkeypatch, fn, modules, kernels: int):
    """Every config of every tuned kernel of ``modules`` that ``fn`` (GLA's or RWKV6's op,
    by ``exclusive``) launches, against the float64 loop (bf16, fwd + bwd, 2e-2)."""
    from fla.ops.rwkv6 import naive_recurrent_rwkv6
    from tests.ops.config_sweep import launched_stages, sweep_configs

    gen = generator(0x61c)
    inputs = make_inputs(gen, B=2, T=300, H=2, K=D, V=D)
    if exclusive:
        inputs["u"] = randn((2, D), gen, torch.float64, scale=0.5)
        ref_fn = naive_recurrent_rwkv6
        names = {"q": "r", "g": "w"}
    else:
        ref_fn, names = naive, {}
    do = output_grad(inputs["v"].shape, gen, torch.bfloat16)
    dht = randn(inputs["initial_state"].shape, gen, torch.float64)
    leaves = leaves_of(inputs, torch.bfloat16, "cpu")
    if exclusive:
        leaves["u"] = leaves["u"].detach().float().requires_grad_()
    renamed = {names.get(n, n): x for n, x in leaves.items()}
    ref_leaves = {n: x.detach().double().cuda().requires_grad_() for n, x in renamed.items()}
    o_ref, h_ref, g_ref = run(ref_fn, ref_leaves, do, dht)
    order = sorted(renamed)
    refs = [o_ref, h_ref] + [g_ref[n] for n in order]

    def call():
        cuda = {n: x.detach().cuda().requires_grad_() for n, x in renamed.items()}
        o, ht, grads = run(fn, cuda, do, dht)
        return [o, ht] + [grads[n] for n in order]

    launched = launched_stages(monkeypatch, modules, call, refs, 2e-2)
    assert len(launched) >= kernels, [name for name, *_ in launched]
    failures = sweep_configs(monkeypatch, launched, min_configs=2)
    assert not failures, "\n".join(failures)
