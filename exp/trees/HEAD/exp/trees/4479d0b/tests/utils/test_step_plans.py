"""Step plans (fla/utils/step_plans.py): a replay must launch what the step launches and
return what it returns.

Without a GPU the direct launcher has no compiled kernels, so these tests stand one in:
every tuned kernel gets a direct launcher whose "compiled" entry runs the kernel in the
interpreter with the values the launcher passes (every parameter in signature order).
The op's outputs and gradients through replays are then compared, bit for bit, with the
same calls made with plans off.
"""
import sys

import pytest
import torch
from triton.runtime.jit import JITFunction

from fla.utils import direct_launch, step_plans
from fla.utils.custom_ops import StageOp, stage_op
from fla.utils.direct_launch import DirectLauncher
from fla.utils.step_plans import step_plans as plans_switch
from fla.utils.tuning import TunedKernel

pytestmark = pytest.mark.interpret


def _module_objects(kind):
    """Every ``kind`` instance held by a loaded ``fla`` module (the kernels and steps)."""
    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.") and module is not None:
            for value in list(vars(module).values()):
                if type(value) is kind:
                    found[id(value)] = value
    return list(found.values())


def _interpreted_launch(self, jit_fn, config, grid, args, options):
    """DirectLauncher.launch with an interpreter-backed entry (see the module's doc)."""
    key = self.key(config, args)
    entry = self._compiled.get(key)
    if entry is not None:
        return self.run(entry, grid, args, key[1])
    self.stats["through_triton"] += 1
    jit_fn[grid](**args)  # through Triton's path: a recording running now is dropped
    names = self.names

    def run(gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit, *values):
        # The stand-in for a compiled launcher: its interpreter run is not a launch
        # through Triton's path as far as a recording is concerned.
        recorder = getattr(step_plans._state, "recorder", None)
        step_plans._state.recorder = None
        try:
            jit_fn[(gx, gy, gz)](**dict(zip(names, values)))
        finally:
            step_plans._state.recorder = recorder

    self._compiled[key] = (run, None, None, None)
    return None


@pytest.fixture
def replay_count(monkeypatch):
    """The plans replayed during a test (a list, one entry a replay)."""
    replays = []
    original = step_plans._Plan.__call__

    def counted(self, args):
        replays.append(self)
        return original(self, args)

    monkeypatch.setattr(step_plans._Plan, "__call__", counted)
    return replays


@pytest.fixture
def emulated_gpu(monkeypatch, replay_count):
    """Direct launches in the interpreter, and step plans for CPU tensors."""
    if torch.cuda.is_available():
        pytest.skip("emulates the direct launcher where there is no GPU")
    monkeypatch.setattr(DirectLauncher, "launch", _interpreted_launch)
    monkeypatch.setattr(DirectLauncher, "_head", lambda self: (0, None, None))
    monkeypatch.setattr(direct_launch.torch._C, "_cuda_getCurrentRawStream", lambda d: 0,
                        raising=False)
    monkeypatch.setattr(step_plans, "_launches_kernels", lambda args: True)
    import fla.ops.gated_delta_rule  # noqa: F401 - their kernels must exist before the scan
    import fla.ops.simple_gla  # noqa: F401
    for kernel in _module_objects(TunedKernel):
        monkeypatch.setattr(kernel, "_direct", DirectLauncher(JITFunction(kernel.kernel.fn),
                                                              valued=kernel.key))
    for op in _module_objects(StageOp):
        op._plans.clear()
    yield replay_count
    for op in _module_objects(StageOp):
        op._plans.clear()


def _gdn_inputs(seed, B, T, H, D, dtype):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=dtype) for _ in range(3))
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(dtype)
    gate = -torch.rand(B, T, H, generator=g) * 0.2 - 0.01
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float32).to(dtype) * 0.8 + 0.1
    h0 = torch.randn(B, H, D, D, generator=g) * 0.1
    do = torch.randn(B, T, H, D, generator=g, dtype=dtype)
    dht = torch.randn(B, H, D, D, generator=g)
    return [q, k, v, gate, beta, h0], do, dht


def _fwd_bwd(op, inputs, do, dht):
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, ht = op(*leaves)
    torch.autograd.backward((o, ht), (do, dht))
    return [o.detach(), ht.detach()] + [x.grad for x in leaves]


def _check_replays_match(op, make_inputs, replays, calls=4):
    for i in range(calls):
        inputs, do, dht = make_inputs(i)
        with plans_switch(False):
            expected = _fwd_bwd(op, inputs, do, dht)
        got = _fwd_bwd(op, inputs, do, dht)
        for e, g in zip(expected, got):
            assert (e is None and g is None) or torch.equal(e, g), (
                f"call {i}: a replay differs from the step")
    return replays


def _chunk_ops():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gla import chunk_gla
    from fla.ops.simple_gla import chunk_simple_gla

    def gdn(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                      output_final_state=True)

    def sgla(q, k, v, g, beta, h0):
        return chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)

    def gla(q, k, v, g, beta, h0):
        gk = g[..., None].expand(*g.shape, q.shape[-1]).contiguous()
        return chunk_gla(q, k, v, gk, initial_state=h0, output_final_state=True)

    return {"gated_delta_rule": gdn, "simple_gla": sgla, "gla": gla}


def test_gated_delta_rule_replays_equal_its_steps(emulated_gpu, seed):
    replays = _check_replays_match(
        _chunk_ops()["gated_delta_rule"], lambda i: _gdn_inputs(seed + i, 1, 100, 2, 32, torch.float32), emulated_gpu)
    # Calls 0 and 1 run the steps (the second recording them), calls 2 and 3 replay the
    # forward and the backward.
    assert len(replays) == 4


def test_simple_gla_replays_equal_its_steps(emulated_gpu, seed):
    replays = _check_replays_match(
        _chunk_ops()["simple_gla"], lambda i: _gdn_inputs(seed + i, 2, 70, 2, 32, torch.float32), emulated_gpu)
    assert len(replays) == 4


def test_a_new_signature_runs_the_step(emulated_gpu, seed):
    shapes = [(1, 70, 2, 32), (1, 70, 2, 32), (1, 90, 2, 32), (1, 70, 2, 32)]
    _check_replays_match(_chunk_ops()["simple_gla"], lambda i: _gdn_inputs(seed + i, *shapes[i], torch.float32),
                         emulated_gpu)
    # T = 90 is seen once (run, not recorded); the last call replays T = 70's plans.
    assert len(emulated_gpu) == 2


def test_forgetting_configs_drops_the_plans(emulated_gpu, seed):
    from fla.ops.simple_gla import chunk_simple_gla
    from fla.ops.common.chunk_fwd_inter import chunk_gated_delta_rule_fwd_inter_kernel

    q, k, v, g, _, h0 = _gdn_inputs(seed, 1, 70, 2, 32, torch.float32)[0]
    for _ in range(3):
        chunk_simple_gla(q, k, v, g, initial_state=h0)
    assert len(emulated_gpu) == 1
    chunk_gated_delta_rule_fwd_inter_kernel._direct.forget()
    chunk_simple_gla(q, k, v, g, initial_state=h0)
    assert len(emulated_gpu) == 1


def _double_step(x):
    y = torch.empty_like(x)
    y.copy_(x * 2)
    return y


def _reading_step(x):
    scale = float(x.abs().max().item())  # a value read on the host
    return x * scale


_cache = {}


def _outside_tensor_step(x):
    if "w" not in _cache:
        _cache["w"] = torch.ones_like(x)
    return x + _cache["w"]


def test_pytorch_calls_replay_and_host_reads_do_not_plan(emulated_gpu):
    double = stage_op("test_plans_double", _double_step, "(Tensor x) -> Tensor",
                      ahead=False)
    reading = stage_op("test_plans_reading", _reading_step, "(Tensor x) -> Tensor",
                       ahead=False)
    outside = stage_op("test_plans_outside", _outside_tensor_step, "(Tensor x) -> Tensor",
                       ahead=False)
    for i in range(4):
        x = torch.randn(8) + i
        assert torch.equal(double(x), 2 * x)
        assert torch.equal(reading(x), x * x.abs().max())
        assert torch.equal(outside(x), x + 1)
    # Only the first op plans: the second reads a value, the third uses a cached tensor.
    assert len(emulated_gpu) == 2
    assert list(reading._plans._plans.values()) == [None]
    assert list(outside._plans._plans.values()) == [None]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gated_delta_rule", "simple_gla", "gla"])
@pytest.mark.parametrize("shape", [(2, 300, 4, 64), (1, 1000, 2, 128)])
def test_replays_on_the_gpu_equal_the_steps(replay_count, seed, name, shape):
    op = _chunk_ops()[name]

    def inputs(i):
        x, do, dht = _gdn_inputs(seed + i, *shape, torch.bfloat16)
        return [t.cuda() for t in x], do.cuda(), dht.cuda()

    _check_replays_match(op, inputs, replay_count, calls=5)
    assert len(replay_count) >= 4  # fwd and bwd of the last calls at least


@pytest.mark.gpu
def test_norm_replays_on_the_gpu_equal_the_steps(replay_count, seed):
    from fla.modules import RMSNorm

    torch.manual_seed(seed)
    norm = RMSNorm(512).cuda().to(torch.bfloat16)
    for i in range(5):
        x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        dy = torch.randn_like(x)
        results = []
        for on in (False, True):
            with plans_switch(on):
                xi, ri = x.clone().requires_grad_(), residual.clone().requires_grad_()
                norm.weight.grad = None
                y, r = norm(xi, residual=ri, prenorm=True)
                torch.autograd.backward((y, r), (dy, dy))
                results.append([y.detach(), r.detach(), xi.grad, ri.grad, norm.weight.grad])
        for e, g in zip(*results):
            assert torch.equal(e, g), f"call {i}"
    assert len(replay_count) >= 4


def _raw_launch_step(x):
    from tests.utils.tiny_kernels import double_kernel

    y = torch.empty_like(x)
    double_kernel[(1,)](x, y, x.numel(), D=1, BLOCK=64)  # outside the tuning layer
    return y


def test_a_launch_outside_the_tuning_layer_is_never_planned(emulated_gpu):
    raw = stage_op("test_plans_raw_launch", _raw_launch_step, "(Tensor x) -> Tensor",
                   ahead=False)
    for i in range(4):
        x = torch.randn(50) + i
        assert torch.equal(raw(x), 2 * x)
    assert not emulated_gpu
    assert list(raw._plans._plans.values()) == [None]
    assert "Triton's own path" in raw._plans.last_failure


def test_a_step_inside_a_recorded_step_runs_as_is(emulated_gpu):
    """The inner step's own plan must not replay inside the outer step's recording: its
    launches would pass the recorder, and the outer plan would lack them."""
    from tests.utils.tiny_kernels import GOOD, grid, make_tuned

    double = make_tuned(lambda a: GOOD)
    double._direct = DirectLauncher(JITFunction(double.kernel.fn), valued=double.key)

    def inner_step(x):
        y = torch.empty_like(x)
        double[grid](x=x, y=y, n=x.numel(), D=1)
        return y

    inner = stage_op("test_plans_inner", inner_step, "(Tensor x) -> Tensor", ahead=False)
    outer = stage_op("test_plans_outer", lambda x: inner(x) + 1, "(Tensor x) -> Tensor",
                     ahead=False)
    x = torch.randn(40)
    for _ in range(3):
        assert torch.equal(inner(x), 2 * x)
    assert len(emulated_gpu) == 1  # the inner step has a plan
    for i in range(4):
        x = torch.randn(40) + i
        assert torch.equal(outer(x), 2 * x + 1), f"call {i}"
    # The inner step replays once more inside the outer one's first (unrecorded) call;
    # then the outer step replays twice.
    assert len(emulated_gpu) == 4
