"""fla.utils.compile_ahead: at the first call of a chunk op's forward or backward with new
argument types, every kernel the step launches is handed to the compile pool (recorded,
not launched), then the step runs for real with the same results; a second call records
nothing. On CPU the compile itself is replaced by a recorder (the interpreter compiles
nothing); the GPU cold-start benchmark measures the real thing."""
from __future__ import annotations

import threading

import pytest
import torch

from fla.utils import compile_ahead
from fla.utils.tuning import TunedKernel
from tests.helpers import generator, log_gate, randn

pytestmark = pytest.mark.interpret


@pytest.fixture
def compiled(monkeypatch):
    """Compile ahead switched on for CPU tensors, every kernel unbuilt (as in a fresh
    process); returns the names of the kernels it hands to the compiler."""
    import gc

    names: list[str] = []
    monkeypatch.setattr(compile_ahead, "_enabled", lambda args: True)
    monkeypatch.setattr(compile_ahead, "_seen", set())
    monkeypatch.setattr(compile_ahead, "_builds", {})
    real_compile = TunedKernel._compile

    def compile_(self, config, grid, named):
        # Count the builds handed to the pool; on a GPU a first launch also builds inline
        # (TunedKernel._run_first), which is not compile ahead's doing.
        if threading.current_thread().name.startswith("fla-compile"):
            names.append(self.name)
        elif torch.cuda.is_available():
            real_compile(self, config, grid, named)

    monkeypatch.setattr(TunedKernel, "_compile", compile_)
    for kernel in [obj for obj in gc.get_objects() if type(obj) is TunedKernel]:
        monkeypatch.setattr(kernel, "_verified", set())
    return names


def _gdn(gen, device, T=100):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    leaves = dict(q=randn((1, T, 2, 32), gen), k=randn((1, T, 2, 32), gen, scale=32 ** -0.5),
                  v=randn((1, T, 2, 32), gen), g=log_gate((1, T, 2), gen),
                  beta=torch.rand(1, T, 2, generator=gen),
                  initial_state=randn((1, 2, 32, 32), gen))
    leaves = {n: x.to(device).requires_grad_() for n, x in leaves.items()}
    o, ht = chunk_gated_delta_rule(**leaves, output_final_state=True)
    (o.sum() + ht.sum()).backward()
    return o.detach(), ht.detach(), {n: x.grad for n, x in leaves.items()}


def test_records_every_kernel_once_and_changes_nothing(compiled, seed, device, monkeypatch):
    ahead = _gdn(generator(seed), device)
    kernels = {name.rsplit(".", 1)[-1] for name in compiled}
    assert {"chunk_gated_delta_rule_fwd_intra_kernel", "chunk_gated_delta_rule_fwd_inter_kernel",
            "chunk_gated_delta_rule_bwd_dhu_kernel", "chunk_bwd_dqkwg_kernel",
            "prepare_wy_repr_bwd_kernel"} <= kernels, kernels
    count = len(compiled)
    _gdn(generator(seed), device)  # the same types and sizes: nothing new to compile
    assert len(compiled) == count
    monkeypatch.setattr(compile_ahead, "_enabled", lambda args: False)
    plain = _gdn(generator(seed), device)
    assert torch.equal(ahead[0], plain[0]) and torch.equal(ahead[1], plain[1])
    for name, grad in plain[2].items():
        assert torch.equal(ahead[2][name], grad), name


def test_off_without_cuda_tensors():
    assert not compile_ahead._enabled((torch.zeros(2),))


def test_first_forward_prefetches_the_backward(compiled, seed, device):
    """A forward whose inputs need gradients records its backward's kernels too (they
    build while the forward runs); the backward then adds nothing. Without gradients,
    nothing of the backward is built."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    gen = generator(seed)
    x = dict(q=randn((1, 80, 2, 32), gen), k=randn((1, 80, 2, 32), gen, scale=32 ** -0.5),
             v=randn((1, 80, 2, 32), gen), g=log_gate((1, 80, 2), gen),
             beta=torch.rand(1, 80, 2, generator=gen))
    x = {n: t.to(device) for n, t in x.items()}
    with torch.no_grad():
        chunk_gated_delta_rule(**x)
    assert "chunk_bwd_dqkwg_kernel" not in {n.rsplit(".", 1)[-1] for n in compiled}
    compiled.clear()
    compile_ahead._seen.clear()
    compile_ahead._builds.clear()
    leaves = {n: t.requires_grad_() for n, t in x.items()}
    o, _ = chunk_gated_delta_rule(**leaves)
    after_forward = list(compiled)
    assert {"chunk_bwd_dqkwg_kernel", "chunk_gated_delta_rule_bwd_dhu_kernel",
            "prepare_wy_repr_bwd_kernel"} <= {n.rsplit(".", 1)[-1] for n in after_forward}
    o.sum().backward()
    assert compiled == after_forward
