"""Shared pytest set-up.

* Without a CUDA device, Triton kernels run in the CPU interpreter: ``TRITON_INTERPRET``
  is set here, before any ``fla`` kernel module is imported (``triton.jit`` reads it at
  decoration time). Tests of the PyTorch path force it with ``FLA_BACKEND=torch``.
* Markers: ``gpu`` (skipped without CUDA); ``interpret`` (runs Triton kernels: on the GPU
  when there is one, else in the interpreter).
* Every test allocates through a poisoned ``torch.empty``: floating tensors start as NaN
  and integer ones as a sentinel, so an element a kernel forgot to write fails a test
  instead of passing as a lucky zero. Mark a test ``no_poison`` to opt out.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.helpers import fresh_seed  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# ``with torch.device(...)`` finds the factory functions it redirects by identity, in a
# set built once per process at its first use. Built while the poisoned ``torch.empty``
# below is installed, the set would hold that test's stand-in, and ``torch.empty`` inside
# every later ``with torch.device("meta")`` would allocate real CPU memory (the model
# configs' meta-device checks then build real layers and draw from the global RNG,
# giving each model other weights than in a plain process). Build it now, unpatched,
# by a first use.
with torch.device("meta"):
    torch.empty(0)


def pytest_configure(config):
    config.addinivalue_line("markers", "no_poison: do not poison torch.empty in this test")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    """Where kernel tests run: the GPU if present, else CPU tensors in the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, printed so that a failure can be replayed
    (``FLA_TEST_SEED=<seed> pytest ...``)."""
    value = fresh_seed()
    print(f"seed={value}")
    return value


def _poison(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 0:
        return tensor
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.fill_(float("nan"))
        elif tensor.dtype == torch.bool:
            tensor.fill_(True)
        else:
            tensor.fill_(torch.iinfo(tensor.dtype).max // 3)
    return tensor


@pytest.fixture(autouse=True)
def poisoned_empty(request, monkeypatch):
    if "no_poison" in request.keywords:
        yield
        return
    real_empty, real_empty_like = torch.empty, torch.empty_like
    real_new_empty = torch.Tensor.new_empty

    def empty(*args, **kwargs):
        return _poison(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return _poison(real_empty_like(*args, **kwargs))

    def new_empty(self, *args, **kwargs):
        return _poison(real_new_empty(self, *args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    yield


@pytest.fixture(autouse=True)
def fresh_step_plans():
    """Every test starts and ends with no step plan (fla/utils/step_plans.py): a plan
    recorded by an earlier test, or before a test monkeypatched a knob of the host code
    (a launch model's constant, a kernel's launch), would replay the host decisions of
    then."""
    from fla.utils import step_plans

    step_plans.invalidate()
    yield
    step_plans.invalidate()
