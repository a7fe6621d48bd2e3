"""Runtime layer shared by every kernel: backend choice, Triton facts, tuning, checks."""
from fla.utils.backend import Backend, select_backend, use_triton
from fla.utils.triton_facts import (
    TRITON_VERSION,
    device_capability,
    device_name,
    is_hopper,
    is_interpreter,
)
from fla.utils.tuning import Config, TunedKernel, tuned

__all__ = [
    "Backend", "select_backend", "use_triton", "TRITON_VERSION", "device_capability",
    "device_name", "is_hopper", "is_interpreter", "Config", "TunedKernel", "tuned",
]
