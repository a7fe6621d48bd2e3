"""fla: fast, checked GPU kernels for linear-attention and state-space sequence models.

Subpackages: ``fla.ops`` (token-mixing recurrences), ``fla.utils`` (runtime layer).
"""
__version__ = "0.1.0"
