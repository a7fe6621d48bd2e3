"""Backend choice: Triton on CUDA, PyTorch on CPU, Triton on CPU under the interpreter,
and the FLA_BACKEND override."""
import pytest
import torch

import fla.utils.backend as backend
from fla.utils.backend import Backend, forced_backend, select_backend, use_triton

pytestmark = pytest.mark.no_poison


class FakeCuda:
    """Stands for a CUDA tensor: ``select_backend`` only looks at ``is_cuda``."""
    is_cuda = True


@pytest.fixture
def cpu():
    return torch.zeros(2)


@pytest.fixture
def interpreter(monkeypatch):
    """``interpreter(True/False)`` sets what the backend module sees as TRITON_INTERPRET."""
    def set_to(on: bool):
        monkeypatch.setattr(backend, "is_interpreter", lambda: on)
    monkeypatch.delenv("FLA_BACKEND", raising=False)
    return set_to


def test_cpu_tensors_use_torch_outside_the_interpreter(interpreter, cpu):
    interpreter(False)
    assert select_backend(cpu, None, cpu) is Backend.TORCH
    assert use_triton(cpu) is False


def test_cpu_tensors_use_triton_in_the_interpreter(interpreter, cpu):
    interpreter(True)
    assert select_backend(cpu) is Backend.TRITON
    assert use_triton(cpu, None) is True


def test_meta_tensors_are_not_cuda(interpreter):
    interpreter(False)
    assert select_backend(torch.zeros(2, device="meta")) is Backend.TORCH


@pytest.mark.parametrize("on", [False, True])
def test_cuda_tensors_use_triton(interpreter, cpu, on):
    interpreter(on)
    assert select_backend(cpu, FakeCuda()) is Backend.TRITON
    assert select_backend(None, FakeCuda()) is Backend.TRITON


def test_only_none_is_cpu(interpreter):
    interpreter(False)
    assert select_backend(None, None) is Backend.TORCH
    assert select_backend() is Backend.TORCH


@pytest.mark.parametrize("value", ["torch", "TORCH", " torch "])
@pytest.mark.parametrize("on", [False, True])
def test_forced_torch_wins_everywhere(interpreter, monkeypatch, cpu, value, on):
    interpreter(on)
    monkeypatch.setenv("FLA_BACKEND", value)
    assert forced_backend() is Backend.TORCH
    assert select_backend(cpu) is Backend.TORCH
    assert select_backend(FakeCuda()) is Backend.TORCH


def test_forced_triton_on_cuda_and_in_the_interpreter(interpreter, monkeypatch, cpu):
    monkeypatch.setenv("FLA_BACKEND", "triton")
    interpreter(False)
    assert select_backend(FakeCuda()) is Backend.TRITON
    interpreter(True)
    assert select_backend(cpu) is Backend.TRITON


def test_forced_triton_on_cpu_without_the_interpreter_is_refused(interpreter, monkeypatch,
                                                                  cpu):
    interpreter(False)
    monkeypatch.setenv("FLA_BACKEND", "triton")
    with pytest.raises(ValueError, match="FLA_BACKEND=triton: the inputs are CPU tensors and "
                                         "TRITON_INTERPRET is not set"):
        select_backend(cpu)


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_override_is_unset(interpreter, monkeypatch, cpu, value):
    interpreter(False)
    monkeypatch.setenv("FLA_BACKEND", value)
    assert forced_backend() is None
    assert select_backend(cpu) is Backend.TORCH


@pytest.mark.parametrize("on", [False, True])
def test_bogus_override_is_refused(interpreter, monkeypatch, cpu, on):
    interpreter(on)
    monkeypatch.setenv("FLA_BACKEND", "Bogus")
    with pytest.raises(ValueError, match="FLA_BACKEND: expected one of 'triton', 'torch' or "
                                         "unset, got 'bogus'"):
        select_backend(cpu)


def test_the_real_interpreter_flag_is_read(monkeypatch, cpu):
    """Without patching: the backend follows the TRITON_INTERPRET environment variable."""
    monkeypatch.delenv("FLA_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend(cpu) is Backend.TRITON
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select_backend(cpu) is Backend.TORCH
