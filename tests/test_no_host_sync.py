"""A training step waits for the GPU nowhere: after the first calls at a shape (which
compile, tune and read host copies of their tables), a forward + backward of every
sequence op runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any
device synchronisation that PyTorch makes (a ``.item()``, a copy to the host, or a host
scalar copied to the device, as ``t[index_tensor] = 0.`` does). One such wait in the
middle of a step idles the GPU while the host catches up with the rest of the step's
launches: at the delta rule's 1x65536x8x128 a scalar fill in the split reverse pass cost
~170 µs of a 3.5 ms step this way.

Not covered here: the fused cross-entropy loss reads the targets' range on the host once
a call, on purpose (a class id past the vocabulary must raise before any kernel runs);
a ``cu_seqlens`` tensor is read on the host once (cached while it is unchanged), so the
varlen case below reuses one tensor, as a training step does.
"""
import pytest
import torch

from benchmarks.cases import BY_NAME, Prepared
from tests.helpers import cu_seqlens_of, generator, log_gate, randn, unit_interval

# (case, shape): one shape a family, large enough for its real launch paths, small
# enough for a test.
CASES = {
    "gated_delta_rule": ("chunk_gated_delta_rule/1x8192x96x128", (2, 1024, 4, 128)),
    "delta_rule": ("chunk_delta_rule/4x4096x16x128", (2, 1024, 4, 128)),
    "simple_gla": ("chunk_simple_gla/1x8192x96x128", (2, 1024, 4, 128)),
    "gla": ("chunk_gla/1x8192x96x128", (2, 1024, 4, 128)),
    "rwkv6": ("chunk_rwkv6/4x4096x16x128", (2, 1024, 4, 64)),
    "rwkv7": ("chunk_rwkv7/4x4096x32x64", (2, 1024, 4, 64)),
    "mamba2": ("mamba_chunk_scan_combined/4x4096x32x64x128", (2, 1024, 4, 64, 64)),
    "rms_norm": ("RMSNorm/16384x4096", (2048, 1024)),
    "decode": ("fused_recurrent_gated_delta_rule/256x1x32x128", (16, 1, 4, 128)),
}


def _prepared(name: str) -> Prepared:
    case_name, shape = CASES[name]
    case = BY_NAME[case_name].with_shape(shape)
    return case.prepare(case.resolve(), "cuda", grad="fwdbwd" in case.modes)


def _steps_without_sync(prepared: Prepared, warm: int = 3, checked: int = 2) -> None:
    """``warm`` steps (the second eager call records a step plan, the third replays it),
    then ``checked`` steps with any device synchronisation raising."""
    grad = None

    def step():
        nonlocal grad
        out = prepared.forward()
        if prepared.leaves:
            target = prepared.grad_target(out)
            if grad is None:
                grad = torch.randn_like(target)
            target.backward(grad)

    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(checked):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_step_never_waits_for_the_gpu(name):
    _steps_without_sync(_prepared(name))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gated_delta_rule", "delta_rule", "simple_gla", "gla"])
def test_split_step_never_waits_for_the_gpu(name, monkeypatch):
    """The same with every sequence split into segments of 4 chunks (what a few long
    sequences get): the segment tables, the combine and the reverse pass's maps."""
    from fla.ops.common import chunk_segments
    monkeypatch.setattr(chunk_segments, "segment_chunks_for", lambda *args: 4)
    _steps_without_sync(_prepared(name))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_varlen_step_never_waits_for_the_gpu(split, monkeypatch):
    """Packed sequences of uneven lengths, one ``cu_seqlens`` tensor reused across steps
    (read on the host at the first), whole or split into segments."""
    if split:
        from fla.ops.common import chunk_segments
        monkeypatch.setattr(chunk_segments, "segment_chunks_for", lambda *args: 4)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    lengths = [700, 93, 1500, 251]
    T, H, D = sum(lengths), 4, 128
    gen = generator(0)
    leaf = dict(device="cuda", requires_grad=True)
    q, k, v = (randn((1, T, H, D), gen, torch.bfloat16, **leaf) for _ in range(3))
    g = log_gate((1, T, H), gen, low=-0.1, **leaf)
    beta = unit_interval((1, T, H), gen, torch.bfloat16, **leaf)
    cu = cu_seqlens_of(lengths, "cuda")
    kn = torch.nn.functional.normalize
    prepared = Prepared(
        lambda: chunk_gated_delta_rule(kn(q, dim=-1), kn(k, dim=-1), v, g, beta,
                                       cu_seqlens=cu),
        [q, k, v, g, beta])
    _steps_without_sync(prepared)


def test_every_family_is_covered():
    """Each sequence family of the benchmark registry has a case here (a new family must
    add its own), and every named case exists."""
    from benchmarks.cases import CASES as REGISTRY
    families = {c.family for c in REGISTRY if not c.baseline}
    covered = {BY_NAME[name].family for name, _ in CASES.values()}
    # The loss syncs once a call on purpose (module doc); fwd_h is a stage of the delta
    # rule, covered by its op.
    assert families - covered <= {"loss"}, families - covered
