"""The gated MLP of LLaMA-style blocks: ``down(act(gate(x)) · up(x))``."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fla.modules.activations import swiglu_packed
from fla.utils.validation import check_tensor

__all__ = ["GatedMLP"]


# The activations LLaMA-style configs use; any other name is looked up in transformers'
# table (imported only then: it takes seconds).
_ACTIVATIONS = {
    "swish": F.silu, "silu": F.silu, "gelu": F.gelu, "relu": F.relu,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _activation(name: str):
    if name in _ACTIVATIONS:
        return _ACTIVATIONS[name]
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ValueError(f"hidden_act: unknown activation {name!r}; expected one of "
                         f"{sorted(set(_ACTIVATIONS) | set(ACT2FN))}")
    return ACT2FN[name]


class GatedMLP(nn.Module):
    """``down_proj(act(gate) · up)`` with ``[gate, up] = gate_up_proj(x)``.

    Args:
        hidden_size: width of x and of the output.
        hidden_ratio: intermediate width as a multiple of hidden_size before the 2/3
            rescale (default 4), used when ``intermediate_size`` is None.
        intermediate_size: I; default ``int(hidden_size · hidden_ratio · 2/3)`` rounded
            up to a multiple of 256.
        hidden_act: the gate's activation (``'swish'``/``'silu'``, ``'gelu'``, ... or any
            name of ``transformers.activations.ACT2FN``).
        fuse_swiglu: with a swish activation, compute ``swish(gate) · up`` in one Triton
            kernel (forward and backward) instead of three PyTorch ops.

    The gate and up projections are one ``nn.Linear(hidden_size, 2I)`` (rows ``[:I]``
    the gate, ``[I:]`` up): one matmul reads x once. State dicts with separate
    ``gate_proj``/``up_proj`` weights (the reference library's) are merged on load.
    """

    def __init__(self, hidden_size: int, hidden_ratio: float | None = None,
                 intermediate_size: int | None = None, hidden_act: str = "swish",
                 fuse_swiglu: bool = True, device=None, dtype=None):
        super().__init__()
        if intermediate_size is None:
            hidden_ratio = 4 if hidden_ratio is None else hidden_ratio
            intermediate_size = int(hidden_size * hidden_ratio * 2 / 3)
            intermediate_size = 256 * ((intermediate_size + 256 - 1) // 256)
        if intermediate_size < 1:
            raise ValueError(f"intermediate_size: expected >= 1, got {intermediate_size}")
        self.hidden_size = hidden_size
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.fuse_swiglu = fuse_swiglu and hidden_act in ("swish", "silu")
        self.act_fn = _activation(hidden_act)
        factory = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)
        self._register_load_state_dict_pre_hook(self._merge_gate_up)

    @staticmethod
    def _merge_gate_up(state_dict, prefix, *args, **kwargs):
        gate, up = prefix + "gate_proj.weight", prefix + "up_proj.weight"
        if gate in state_dict and up in state_dict:
            state_dict[prefix + "gate_up_proj.weight"] = torch.cat(
                [state_dict.pop(gate), state_dict.pop(up)], dim=0)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"hidden_act={self.hidden_act!r}, fuse_swiglu={self.fuse_swiglu}")

    def _check_input(self, x) -> None:
        """Refuse what ``nn.Linear`` would refuse with a RuntimeError about matrix sizes:
        name x, the width expected and the one given."""
        check_tensor("x", x, dtypes=None)
        if not x.is_floating_point():
            raise TypeError(f"x: expected a floating dtype (that of the weights, "
                            f"{str(self.gate_up_proj.weight.dtype).replace('torch.', '')}), "
                            f"got {str(x.dtype).replace('torch.', '')}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected shape [..., hidden_size] with hidden_size = "
                             f"{self.hidden_size}, got {tuple(x.shape)}")
        weight = self.gate_up_proj.weight
        # Under autocast nn.Linear casts x itself; otherwise a dtype mismatch is an error.
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"x: expected the dtype of the weights "
                            f"{str(weight.dtype).replace('torch.', '')}, got "
                            f"{str(x.dtype).replace('torch.', '')}")
        if x.device != weight.device:
            raise ValueError(f"x: expected device {weight.device} (the weights'), got "
                             f"{x.device}")

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """x ``[..., hidden_size]`` -> ``[..., hidden_size]``. Extra keyword arguments
        (a layer's ``attention_mask`` and the like) are accepted and ignored."""
        self._check_input(x)
        gate_up = self.gate_up_proj(x)
        if self.fuse_swiglu:
            h = swiglu_packed(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self.act_fn(gate) * up
        return self.down_proj(h)
