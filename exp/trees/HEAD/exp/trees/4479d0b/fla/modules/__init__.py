"""Fused building blocks: norms, gated norm, rotary, short convolution, l2norm, losses, MLP.

Each runs Triton kernels on CUDA tensors and a PyTorch path on CPU tensors (or the
kernels themselves under ``TRITON_INTERPRET=1``), with the same results.
"""
from fla.modules.convolution import ShortConvolution
from fla.modules.fused_cross_entropy import FusedCrossEntropyLoss, cross_entropy_loss
from fla.modules.fused_linear_cross_entropy import (
    FusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy,
)
from fla.modules.fused_norm_gate import FusedRMSNormGated, rms_norm_gated
from fla.modules.l2norm import L2Norm, l2_norm
from fla.modules.layernorm import GroupNorm, LayerNorm, RMSNorm, group_norm, layer_norm, rms_norm
from fla.modules.mlp import GatedMLP
from fla.modules.rotary import RotaryEmbedding, rotary_embedding

__all__ = [
    "RMSNorm", "LayerNorm", "GroupNorm", "rms_norm", "layer_norm", "group_norm",
    "FusedRMSNormGated", "rms_norm_gated", "RotaryEmbedding", "rotary_embedding",
    "ShortConvolution", "L2Norm", "l2_norm", "GatedMLP", "FusedCrossEntropyLoss",
    "cross_entropy_loss", "FusedLinearCrossEntropyLoss", "fused_linear_cross_entropy",
]
