"""fla: fast, checked GPU kernels for linear-attention and state-space sequence models.

Subpackages: ``fla.ops`` (token-mixing recurrences), ``fla.modules`` (fused building
blocks), ``fla.layers`` (token-mixing layers), ``fla.models`` (Hugging Face models,
registered with transformers' Auto classes on import), ``fla.utils`` (runtime layer).
"""
__version__ = "0.1.0"

# Registers the models with transformers' AutoConfig / AutoModel / AutoModelForCausalLM.
# Light: no kernel module, no Triton, none of transformers' modeling code is imported here
# (see fla/models/config.py); a kernel module is imported with the op or layer using it.
# Last, so that the subpackages it imports find this package initialised.
from fla import models  # noqa: E402,F401
