"""Facts about the installed Triton: version parsing, support range, compiled-kernel
counts, dot precision."""
from collections import defaultdict

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import fla.utils.triton_facts as facts
from fla.utils.triton_facts import (
    MIN_TRITON,
    _parse_version,
    compiled_kernel_count,
    dot_precision,
    is_interpreter,
    supported,
)
from fla.utils.tuning import Config
from tests.utils.tiny_kernels import GOOD, double_kernel, grid, make_tuned

pytestmark = pytest.mark.no_poison


@pytest.mark.parametrize("text, parsed", [
    ("3.3.0", (3, 3, 0)),
    ("3.9.0+git123", (3, 9, 0)),
    ("3.10.1rc1", (3, 10, 1)),
    ("3.4.0a0+gitdeadbee", (3, 4, 0)),
    ("3.5", (3, 5, 0)),
    ("4", (4, 0, 0)),
    ("3.6.0.post1", (3, 6, 0)),
    ("12.0.0", (12, 0, 0)),
])
def test_parse_version(text, parsed):
    assert _parse_version(text) == parsed


def test_parsed_versions_order_numerically():
    assert _parse_version("3.10.0") > _parse_version("3.9.9")
    assert _parse_version("3.10.1rc1") < _parse_version("3.10.2")


def test_installed_version_is_parsed():
    assert facts.TRITON_VERSION == _parse_version(triton.__version__)
    assert facts.TRITON_VERSION_STRING == triton.__version__


@pytest.mark.parametrize("version, ok", [
    ((MIN_TRITON[0], MIN_TRITON[1], 0), True),
    ((MIN_TRITON[0], MIN_TRITON[1], 7), True),
    ((MIN_TRITON[0], MIN_TRITON[1] + 7, 0), True),
    ((MIN_TRITON[0] + 1, 0, 0), True),
    ((MIN_TRITON[0], MIN_TRITON[1] - 1, 9), False),
    ((MIN_TRITON[0] - 1, 9, 9), False),
])
def test_supported_against_min_triton(monkeypatch, version, ok):
    monkeypatch.setattr(facts, "TRITON_VERSION", version)
    assert supported() is ok


def test_min_triton_is_3_3():
    # The docstrings and the kernels' comments promise 3.3 and later.
    assert MIN_TRITON == (3, 3)


def test_is_interpreter_reads_the_environment(monkeypatch):
    for value, on in [("1", True), ("true", True), ("0", False), ("", False)]:
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert is_interpreter() is on
    monkeypatch.delenv("TRITON_INTERPRET")
    assert is_interpreter() is False


# --------------------------------------------------------------- compiled_kernel_count
def _plain(x, BLOCK: tl.constexpr):
    pass


def test_count_of_a_real_jit_function_before_any_launch():
    # Built directly so that it is a compiling JITFunction even under TRITON_INTERPRET.
    kernel = JITFunction(_plain)
    assert compiled_kernel_count(kernel) == 0


def test_count_stays_zero_in_the_interpreter():
    if not is_interpreter():
        pytest.skip("interpreter-only behaviour")
    x = torch.randn(40)
    y = torch.zeros(40)
    assert compiled_kernel_count(double_kernel) == 0
    double_kernel[(2,)](x, y, 40, D=16, BLOCK=32)
    assert torch.equal(y, 2 * x)  # it did run
    assert compiled_kernel_count(double_kernel) == 0


class FakeJit:
    """The 3.3-3.9 layout: ``device_caches[device] = (kernel_cache, ...more)``."""

    def __init__(self, per_device):
        self.device_caches = defaultdict(lambda: ({}, {}, None, None, None))
        for device, n in per_device.items():
            self.device_caches[device] = ({f"k{i}": object() for i in range(n)}, {"x": 1},
                                          "target", "backend", "binder")


class FakeLegacyJit:
    """Older layout: ``cache[device] = {key: kernel}``."""

    def __init__(self, per_device):
        self.cache = {d: {f"k{i}": object() for i in range(n)} for d, n in per_device.items()}


class Wrapper:
    """Like triton's Autotuner/Heuristics: the jit function is in ``.fn``."""

    def __init__(self, fn):
        self.fn = fn


def test_count_on_device_caches():
    assert compiled_kernel_count(FakeJit({})) == 0
    assert compiled_kernel_count(FakeJit({0: 3})) == 3
    # Counts the first member only (the kernel cache), summed over devices.
    assert compiled_kernel_count(FakeJit({0: 2, 1: 5})) == 7


def test_count_on_legacy_cache():
    assert compiled_kernel_count(FakeLegacyJit({0: 4, 1: 1})) == 5


def test_count_through_wrappers():
    assert compiled_kernel_count(Wrapper(FakeJit({0: 2}))) == 2
    assert compiled_kernel_count(Wrapper(Wrapper(FakeJit({0: 3})))) == 3
    assert compiled_kernel_count(Wrapper(FakeLegacyJit({0: 6}))) == 6


def test_count_through_a_tuned_kernel():
    tuned = make_tuned(lambda a: GOOD)
    tuned.kernel = FakeJit({0: 4})  # what a compiled GPU kernel would hold
    assert compiled_kernel_count(tuned) == 4


def test_count_of_objects_without_caches_is_zero():
    assert compiled_kernel_count(object()) == 0
    assert compiled_kernel_count(_plain) == 0


# ------------------------------------------------------------------------- dot_precision
def test_dot_precision(monkeypatch):
    import fla.utils.triton_facts as facts

    monkeypatch.setattr(facts, "is_interpreter", lambda: True)
    assert dot_precision(torch.float32) == "ieee"
    monkeypatch.setattr(facts, "is_interpreter", lambda: False)
    assert dot_precision(torch.float32) == "tf32x3"
    assert dot_precision(torch.float16) == "tf32"
    assert dot_precision(torch.bfloat16) == "tf32"


@pytest.mark.gpu
def test_count_on_the_gpu(monkeypatch, tmp_path):
    """A compiling Triton: one binary per constexpr set, none for a new length."""
    if is_interpreter() or not torch.cuda.is_available():
        pytest.skip("needs a GPU outside the interpreter")

    @triton.jit(do_not_specialize=["n"])
    def copy_kernel(x, y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)

    x = torch.randn(300, device="cuda")
    y = torch.zeros_like(x)
    assert compiled_kernel_count(copy_kernel) == 0
    copy_kernel[(10,)](x, y, 300, BLOCK=32)
    assert compiled_kernel_count(copy_kernel) == 1
    copy_kernel[(10,)](x, y, 299, BLOCK=32)  # a new length: no new binary
    assert compiled_kernel_count(copy_kernel) == 1
    copy_kernel[(5,)](x, y, 300, BLOCK=64)
    assert compiled_kernel_count(copy_kernel) == 2
    torch.cuda.synchronize()
    assert torch.equal(y, x)
    # Through the tuning layer the count reaches the jit function too.
    monkeypatch.setenv("FLA_TUNE", "0")
    monkeypatch.setenv("FLA_CACHE_DIR", str(tmp_path))
    k = make_tuned(lambda a: Config(BLOCK=16))
    before = compiled_kernel_count(double_kernel)
    k[grid](x, y, 300, D=8)
    assert compiled_kernel_count(k) == before + 1
    k[grid](x, y, 123, D=8)
    assert compiled_kernel_count(k) == before + 1


@pytest.mark.interpret
def test_the_tiny_kernel_is_usable_through_the_tuning_layer(device, monkeypatch, tmp_path):
    """Sanity check that the helper used above really computes 2x."""
    if not is_interpreter() and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter or a GPU")
    monkeypatch.setenv("FLA_TUNE", "0")
    monkeypatch.setenv("FLA_CACHE_DIR", str(tmp_path))
    k = make_tuned(lambda a: Config(BLOCK=16))
    x = torch.randn(37, device=device)
    y = torch.full_like(x, float("nan"))
    k[grid](x, y, 37, D=8)
    assert torch.equal(y, 2 * x)


@triton.jit
def _cast_kernel(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, tl.load(x + o).to(y.dtype.element_ty))


@pytest.mark.interpret
def test_bf16_cast_rounding_is_as_recorded(device):
    """The fp32 -> bf16 cast of a kernel: to nearest on the GPU; by truncation in the
    interpreter while ``INTERPRETER_BF16_CAST_TRUNCATES`` says so (a Triton release that
    fixes it fails here, so that the tests relying on the fact can be tightened)."""
    # 1 + 3·2^-9 lies between the bf16 neighbours 1 and 1 + 2^-7, nearer the second.
    x = torch.tensor([1 + 3 * 2 ** -9, -(1 + 3 * 2 ** -9)] * 8, device=device)
    y = torch.empty(16, dtype=torch.bfloat16, device=device)
    _cast_kernel[(1,)](x, y, N=16)
    truncates = is_interpreter() and torch.device(device).type == "cpu"
    expected = (x.abs().double() - 3 * 2 ** -9 if truncates and facts.INTERPRETER_BF16_CAST_TRUNCATES
                else x.abs().double() + 2 ** -9) * x.sign().double()
    assert torch.equal(y.double(), expected), (y.tolist(), expected.tolist())
