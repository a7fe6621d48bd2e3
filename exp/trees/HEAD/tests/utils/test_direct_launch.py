"""Direct launches (fla/utils/direct_launch.py): the key must be at least as fine as
Triton's own specialization, and a direct launch must compute what Triton's path does.

The key tests run anywhere (Triton's specializer is plain host code); the launch tests
need a GPU.
"""
import itertools
import inspect

import pytest
import torch

from fla.utils import direct_launch
from fla.utils.direct_launch import DirectLauncher, _specialization, direct_launches


def _triton_specialization():
    """Triton's own (type, specialization) of a non-constexpr argument, or None where
    this release does not expose it as one host function (3.3)."""
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl
    except ImportError:
        return None
    return lambda value: native_specialize_impl(BaseBackend, value, False, True, True)


def _values():
    base = torch.arange(64, dtype=torch.float32)
    half = torch.arange(64, dtype=torch.float16)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
            -2**31, -2**31 - 1, -2**31 - 16, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]
    return [base, base[1:], base[4:], base[8:], half, half[1:], half[8:],
            *ints, True, False, 0.0, 1.0, 1.5, None]


def test_our_key_is_at_least_as_fine_as_tritons():
    triton_spec = _triton_specialization()
    if triton_spec is None:
        pytest.skip("this Triton release has no native specializer to compare with")
    values = _values()
    ours = [_specialization(v) for v in values]
    theirs = [triton_spec(v) for v in values]
    for i, j in itertools.combinations(range(len(values)), 2):
        if ours[i] == ours[j]:
            assert theirs[i] == theirs[j], (
                f"our key merges {values[i]!r} and {values[j]!r}, which Triton "
                f"specializes apart: {theirs[i]} vs {theirs[j]}")


def test_key_separates_alignment_ints_and_types():
    x = torch.arange(16, dtype=torch.float32)
    assert _specialization(x) != _specialization(x[1:])            # 16-byte alignment
    assert _specialization(x) == _specialization(x[4:])
    assert _specialization(x) != _specialization(x.half())           # dtype
    assert len({_specialization(v) for v in (1, 16, 17)}) == 3       # == 1, % 16
    assert _specialization(2**31 - 1) != _specialization(2**31)       # int32 vs int64
    assert _specialization(2**63 - 1) != _specialization(2**63)       # int64 vs uint64
    for unsupported in ((1, 2), 2**64, -2**63 - 1):
        with pytest.raises(direct_launch._Unsupported):
            _specialization(unsupported)


class _Param:
    def __init__(self, name, constexpr=False, default=inspect.Parameter.empty):
        self.name, self.is_constexpr, self.default = name, constexpr, default


class _StandIn:
    """The parts of a JITFunction a DirectLauncher reads."""
    params = [_Param("x"), _Param("n"), _Param("flag", default=None),
              _Param("BLOCK", constexpr=True)]


def test_key_holds_constexpr_values_and_defaults(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launcher = DirectLauncher(_StandIn())
    x = torch.zeros(32)
    key = launcher.key("cfg", {"x": x, "n": 17, "BLOCK": 64})          # flag: its default
    assert key == launcher.key("cfg", {"x": x, "n": 33, "BLOCK": 64, "flag": None})
    assert key != launcher.key("cfg", {"x": x, "n": 17, "BLOCK": 32})    # constexpr value
    assert key != launcher.key("other", {"x": x, "n": 17, "BLOCK": 64})  # config
    assert key != launcher.key("cfg", {"x": x, "n": 16, "BLOCK": 64})    # n % 16
    assert launcher.key("cfg", {"x": (x,), "n": 1, "BLOCK": 64}) is None  # unsupported
    # A constexpr's type counts (1, True and 1.0 compare equal but compile apart).
    assert len({launcher.key("cfg", {"x": x, "n": 17, "BLOCK": v}) for v in (1, True, 1.0)}) == 3
    # Triton's runtime switches (debug, sanitizer instrumentation) are part of the key.
    monkeypatch.setattr(direct_launch, "_switches", lambda: ("instrumented",))
    assert launcher.key("cfg", {"x": x, "n": 17, "BLOCK": 64}) != key


def test_a_kernel_without_parameters_gets_a_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class NoParams:
        params = []

    launcher = DirectLauncher(NoParams())
    assert launcher.key("cfg", {})[0] == "cfg" and launcher.values({}) == []


class _Config:
    """A config as the tuning layer passes it: hashable, with meta-parameters."""

    def __init__(self, **meta):
        self.meta = meta

    def __hash__(self):
        return hash(tuple(sorted(self.meta.items())))

    def __eq__(self, other):
        return isinstance(other, _Config) and self.meta == other.meta


class _Tunable:
    """A kernel whose launch takes a meta-parameter (BLOCK) from its config."""
    params = [_Param("x"), _Param("n"), _Param("mode"), _Param("D", constexpr=True),
              _Param("BLOCK", constexpr=True)]


def test_a_call_seen_before_finds_its_config_and_kernel(monkeypatch):
    """remember / lookup: the caller's arguments (without the config's meta-parameters)
    find the config and compiled kernel again, and any change that could change either
    (the tuning key's values, Triton's specialization, the runtime switches) misses."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launcher = DirectLauncher(_Tunable(), valued=["mode", "D"])
    x = torch.zeros(64)
    named = {"x": x, "n": 17, "mode": 3, "D": 16}
    config = _Config(BLOCK=64)
    assert launcher.lookup(named) is None                  # nothing remembered yet
    launcher.remember(config, named)
    assert launcher.lookup(named) is None                  # no compiled kernel for it
    entry = ("run", "function", "metadata", "kernel")
    launcher._compiled[launcher.key(config, {**named, "BLOCK": 64})] = entry
    launcher.remember(config, named)
    assert launcher.lookup(named) == (config, entry, 0)
    assert launcher.lookup({**named, "n": 33}) == (config, entry, 0)    # same specialization
    misses = [{**named, "mode": 4},          # a tuning-key value: maybe another config
              {**named, "n": 16},            # n % 16: another Triton specialization
              {**named, "x": x[1:]},         # misaligned
              {**named, "x": x.half()},      # dtype
              {**named, "D": 32},            # constexpr value
              {**named, "x": (x,)},          # a type not covered
              {"x": x, "n": 17, "D": 16}]    # an argument missing
    for call in misses:
        assert launcher.lookup(call) is None, call
    # A config with other meta-parameter names is launched, not remembered.
    other = _Config(BLOCK=64, SPLIT=2)
    launcher._compiled[launcher.key(other, {**named, "mode": 5, "BLOCK": 64, "SPLIT": 2})] = entry
    launcher.remember(other, {**named, "mode": 5})
    assert launcher.lookup({**named, "mode": 5}) is None
    # Runtime switches, launch hooks and the off switch all send calls the long way.
    with direct_launches(False):
        assert launcher.lookup(named) is None
    monkeypatch.setattr(direct_launch, "_hooks_installed", lambda: True)
    assert launcher.lookup(named) is None
    monkeypatch.setattr(direct_launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(direct_launch, "_switches", lambda: ("instrumented",))
    assert launcher.lookup(named) is None


def test_a_bound_launch_runs_only_calls_equal_to_the_one_it_was_bound_with(monkeypatch):
    """bind / BoundLaunch: the launch is made with the bound scalars and the call's
    tensors; a tensor of another dtype, alignment or presence, another set of names, a
    non-tensor, or a change of device or runtime switches refuses (returns False) and
    launches nothing; the bound template keeps no tensor alive."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)

    class WithFlag:
        params = [_Param("x"), _Param("y"), _Param("flag"), _Param("n"), _Param("mode"),
                  _Param("D", constexpr=True), _Param("BLOCK", constexpr=True)]

    launched = []
    entry = (lambda *args: launched.append(args), "function", "metadata", "kernel")
    launcher = DirectLauncher(WithFlag(), valued=["mode", "D"])
    x, y = torch.zeros(64), torch.zeros(64)
    named = {"x": x, "y": y, "flag": None, "n": 17, "mode": 3, "D": 16}
    config = _Config(BLOCK=64)
    grid_of = lambda args: (args["n"] // 8, args["BLOCK"])  # noqa: E731
    assert launcher.bind(named, ("x", "y", "flag"), grid_of) is None   # not remembered
    launcher._compiled[launcher.key(config, {**named, "BLOCK": 64})] = entry
    launcher.remember(config, named)
    bound = launcher.bind(named, ("x", "y", "flag"), grid_of)
    assert bound is not None and launcher.bind(named, ("x", "n"), grid_of) is None
    assert all(v is not x and v is not y for v in bound._values)
    # The tensor check is generated once per slot layout and shared.
    other = launcher.bind({**named, "n": 33}, ("x", "y", "flag"), grid_of)
    assert other is not None and other._arguments is bound._arguments

    x2, y2 = torch.ones(64), torch.ones(64)
    assert bound({"x": x2, "y": y2, "flag": None})
    (gx, gy, gz, stream, function, metadata, _, _, _, *values), = launched
    assert (gx, gy, gz, stream, function, metadata) == (2, 64, 1, 7, "function", "metadata")
    assert values[0] is x2 and values[1] is y2 and values[2:] == [None, 17, 3, 16, 64]
    refused = [{"x": x2, "y": y2},                              # a name missing
               {"x": x2, "y": y2, "flag": None, "z": x2},       # a name more
               {"x": x2, "y": y2, "other": None},               # another name
               {"x": x2[1:], "y": y2, "flag": None},            # misaligned
               {"x": x2.half(), "y": y2, "flag": None},         # dtype
               {"x": x2, "y": y2, "flag": x2},                  # a tensor where None was
               {"x": None, "y": y2, "flag": None},              # None where a tensor was
               {"x": 3, "y": y2, "flag": None}]                 # not a tensor
    for call in refused:
        assert not bound(call), call
    assert len(launched) == 1
    monkeypatch.setattr(direct_launch, "_switches", lambda: ("instrumented",))
    assert not bound({"x": x2, "y": y2, "flag": None})
    monkeypatch.setattr(direct_launch, "_switches", lambda: ())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert not bound({"x": x2, "y": y2, "flag": None})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with direct_launches(False):
        assert not bound({"x": x2, "y": y2, "flag": None})
    assert len(launched) == 1


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_direct_launches_match_tritons_path_on_every_specialization():
    from tests.utils.tiny_kernels import double_kernel, grid, make_tuned
    from fla.utils.tuning import Config

    kernel = make_tuned(lambda a: Config(BLOCK=64, num_warps=2))
    assert kernel._direct is not None
    base = torch.randn(4096 + 64, device="cuda")
    # Aligned and misaligned starts, lengths that are and are not multiples of 16, n == 1:
    # each is a separate Triton specialization; reusing the wrong one would read the
    # wrong elements or mask wrongly.
    for offset, n in [(0, 4096), (1, 4096), (0, 4095), (3, 1000), (0, 1), (5, 1), (8, 17),
                      (0, 4096), (1, 4096), (3, 1000)]:
        x = base[offset:offset + n]
        y = torch.full_like(x, float("nan"))
        kernel[grid](x=x, y=y, n=n, D=16)
        torch.testing.assert_close(y, 2 * x, rtol=0, atol=0)
    assert kernel._direct.stats["direct"] >= 3      # the repeated rows went direct
    with direct_launches(False):
        before = dict(kernel._direct.stats)
        y = torch.empty(4096, device="cuda")
        kernel[grid](x=base[:4096], y=y, n=4096, D=16)
        assert kernel._direct.stats["direct"] == before["direct"]
    assert double_kernel is kernel.kernel


@pytest.mark.gpu
def test_a_launch_hook_sends_launches_through_triton():
    from tests.utils.tiny_kernels import grid, make_tuned
    from fla.utils.tuning import Config

    try:
        from triton import knobs
    except ImportError:
        pytest.skip("Triton 3.3 keeps its hooks on CompiledKernel")
    kernel = make_tuned(lambda a: Config(BLOCK=64, num_warps=2))
    x = torch.randn(256, device="cuda")
    y = torch.empty_like(x)
    kernel[grid](x=x, y=y, n=256, D=16)
    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            kernel[grid](x=x, y=y, n=256, D=16)
        finally:
            chain.remove(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
        try:
            kernel[grid](x=x, y=y, n=256, D=16)
        finally:
            knobs.runtime.launch_enter_hook = None
    assert len(seen) == 1
    kernel[grid](x=x, y=y, n=256, D=16)
    assert kernel._direct.stats["direct"] >= 1
    torch.testing.assert_close(y, 2 * x, rtol=0, atol=0)


@pytest.mark.gpu
def test_calls_seen_before_keep_the_config_their_tuning_key_chose():
    """A tuning key holding a runtime integer (n, not a constexpr): calls that alternate
    between two of its values must each get their own config through the shortcut."""
    from tests.utils.tiny_kernels import grid, make_tuned
    from fla.utils.tuning import Config

    kernel = make_tuned(lambda a: Config(BLOCK=32 if a["n"] < 1000 else 128, num_warps=2),
                        key=("n",))
    base = torch.randn(8192, device="cuda")
    for _ in range(3):
        for n in (500, 4000, 512, 4096):
            y = torch.full((n,), float("nan"), device="cuda")
            kernel[grid](x=base[:n], y=y, n=n, D=16)
            torch.testing.assert_close(y, 2 * base[:n], rtol=0, atol=0)
    assert kernel._direct.stats["direct"] >= 8
    for n in (500, 4000, 512, 4096):
        named = {"x": base[:n], "y": base[:n], "n": n, "D": 16}
        config, _, _ = kernel._direct.lookup(named)
        assert config == kernel.chosen_config(**named)
        assert config.meta["BLOCK"] == (32 if n < 1000 else 128)


@pytest.mark.gpu
def test_bound_launches_match_the_usual_path():
    """launch_bound: after two calls at a scalar set, later calls go bound and compute
    what the usual path does; misaligned and other-dtype tensors get bound launches of
    their own at the same scalars; a forced config (the tests' way to change the rules)
    drops them, and so does turning bound launches off."""
    from tests.utils.tiny_kernels import grid, make_tuned
    from fla.utils.direct_launch import bound_launches
    from fla.utils.tuning import Config

    kernel = make_tuned(lambda a: Config(BLOCK=64, num_warps=2))
    base = torch.randn(4096 + 64, device="cuda")

    def call(offset, n, dtype=torch.float32):
        x = base[offset:offset + n].to(dtype)
        y = torch.full_like(x, float("nan"))
        before = kernel._direct.stats["bound"]
        kernel.launch_bound(grid, {"x": x, "y": y}, {"n": n, "D": 16})
        torch.testing.assert_close(y, 2 * x, rtol=0, atol=0)
        return kernel._direct.stats["bound"] - before

    rows = [(0, 4096, torch.float32), (1, 4096, torch.float32), (0, 4096, torch.float16),
            (0, 1000, torch.float32), (3, 1000, torch.float32), (8, 17, torch.float16)]
    for _ in range(2):             # the first calls choose, verify and remember
        for row in rows:
            call(*row)
    assert [call(*row) for row in rows] == [1] * len(rows)
    assert len(kernel._direct.bound[(("n", 4096), ("D", 16))]) == 3
    # A scalar set called once (a packed batch's token count) is remembered, not bound.
    assert call(0, 333) == 0
    assert (("n", 333), ("D", 16)) in kernel._direct.seen_once
    assert (("n", 333), ("D", 16)) not in kernel._direct.bound
    with bound_launches(False):
        assert call(0, 4096) == 0
    kernel._chosen = {}            # what tests do to force configs: the bound set goes too
    assert kernel._direct.bound == {}
    assert call(0, 4096) == 0
