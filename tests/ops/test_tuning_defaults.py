"""The tuning defaults of the chunk kernels' sequential passes against H100 sweeps.

Each table holds a kernel's measured times (H100, Triton 3.6, bf16, 2026-11-26; ms, by
shape B x T x H x K with K = V) for the config its default picks, the fastest of its
space and the default before that day; a default must stay within 5% of the fastest.
The rules read the launcher's ``FEW_PROGRAMS`` hint (:func:`fla.utils.grid.grid_fill`),
computed here for a 132-SM H100.
"""
from __future__ import annotations

import pytest
import torch

from fla.utils.grid import grid_fill

SMS = 132
BF16 = torch.empty(1, dtype=torch.bfloat16)
FP32 = torch.empty(1, dtype=torch.float32)

# The fused forward pass with the delta (chunk_fwd_inter): (BV, stages) at 4 warps.
PASS_MS = {
    "1x8192x96x128": {(32, 2): 0.953, (64, 2): 0.720, (64, 3): 1.075},
    "1x8192x80x128": {(32, 2): 0.901, (64, 2): 0.660, (64, 3): 1.040},
    "1x8192x64x128": {(32, 2): 0.460, (32, 3): 0.769, (64, 2): 0.624, (64, 3): 0.547},
    "4x2048x16x128": {(32, 2): 0.126, (32, 3): 0.185, (64, 2): 0.158, (64, 3): 0.132},
    "8x1024x8x64": {(32, 2): 0.057, (32, 3): 0.051, (64, 2): 0.074, (64, 3): 0.055},
    "2x16384x16x128": {(32, 2): 0.776, (32, 3): 0.720, (64, 2): 1.060, (64, 3): 0.876},
}

# The state pass (chunk_delta_h, "W": the delta rule's, else simple GLA's) and its
# reverse (chunk_delta_h_bwd): (BV, warps, stages); the WY backward: (BK, BV, warps,
# stages).
STAGE_MS = {
    "fwd_h W": {
        "1x8192x96x128": {(64, 4, 2): 0.468},
        "1x8192x64x128": {(64, 4, 2): 0.383, (64, 4, 3): 0.287},
        "4x2048x16x128": {(64, 4, 2): 0.095, (64, 4, 3): 0.077},
        "2x16384x16x128": {(32, 4, 4): 0.318, (64, 4, 2): 0.593},
        "8x1024x8x64": {(32, 2, 4): 0.025, (64, 4, 2): 0.038, (64, 4, 4): 0.025},
    },
    # Without W, (BV, warps, stages, KH): the rows a program holds (row_blocks).
    "fwd_h": {
        # (2026-11-27, H100: each config forced, the rest of the space slower.)
        "1x8192x96x128": {(64, 4, 2, 128): 0.336, (64, 8, 3, 64): 0.323,
                          (64, 4, 3, 64): 0.323, (64, 4, 2, 64): 0.324},
        "4x4096x64x128": {(64, 4, 2, 128): 0.441, (128, 8, 4, 64): 0.383,
                          (64, 4, 2, 64): 0.386},
        "1x8192x64x128": {(64, 4, 2, 128): 0.287, (64, 4, 3, 128): 0.203,
                          (64, 4, 4, 128): 0.197},
        "4x2048x16x128": {(64, 4, 2, 128): 0.075, (64, 4, 3, 128): 0.055,
                          (64, 4, 4, 128): 0.054},
        "2x16384x16x128": {(32, 4, 4, 128): 0.217, (32, 8, 4, 128): 0.215,
                           (64, 4, 2, 128): 0.407, (64, 8, 4, 64): 0.213},
        "8x1024x8x64": {(32, 4, 4, 64): 0.018, (64, 4, 2, 64): 0.05, (64, 4, 4, 64): 0.018},
        # (2026-11-26 evening, `profile_case --tune`: the whole space at 2 and 1 stages;
        # 2026-11-27 the row blocks.)
        "8x2048x32x256": {(64, 4, 2, 256): 0.584, (64, 8, 2, 256): 0.586,
                          (32, 2, 2, 256): 0.648, (32, 4, 2, 256): 0.700,
                          (32, 8, 2, 256): 0.713, (64, 4, 1, 256): 0.848,
                          (32, 4, 1, 256): 0.899, (64, 2, 2, 256): 2.817,
                          (128, 4, 2, 128): 0.566, (128, 8, 3, 128): 0.575},
    },
    "dhu W": {
        "8x2048x32x256": {(32, 4, 2): 2.043, (32, 8, 2): 2.157, (32, 2, 2): 53.41,
                          (64, 2, 2): 60.12},
        "1x8192x96x128": {(64, 4, 2): 0.86, (64, 4, 3): 0.687},
        "1x8192x64x128": {(64, 4, 2): 0.467, (64, 4, 3): 0.353},
        "4x2048x16x128": {(64, 4, 2): 0.125, (64, 4, 3): 0.097},
        "2x16384x16x128": {(32, 4, 3): 0.525, (64, 4, 2): 0.792},
        "8x1024x8x64": {(32, 4, 3): 0.033, (64, 4, 2): 0.05},
    },
    "dhu": {
        # (2026-11-26 evening: the whole space, simple GLA's reverse pass.)
        "8x2048x32x256": {(64, 4, 2): 1.143, (64, 8, 2): 1.270, (32, 4, 2): 1.634,
                          (32, 8, 2): 1.895, (32, 2, 2): 5.000, (64, 2, 2): 31.85},
        "1x8192x96x128": {(64, 4, 2): 0.554},
        "1x8192x64x128": {(64, 4, 2): 0.425, (64, 4, 3): 0.386},
        "4x2048x16x128": {(64, 4, 2): 0.109, (64, 4, 3): 0.101},
        "2x16384x16x128": {(32, 8, 3): 0.526, (64, 4, 2): 0.672},
        "8x1024x8x64": {(32, 8, 3): 0.036, (64, 4, 2): 0.045},
    },
    # The vector gate on the forward's gated operands (GLA; 2026-11-26, later that day).
    "dhu GK": {
        "1x8192x96x128": {(64, 4, 1): 0.809, (64, 4, 2): 0.565, (64, 4, 3): 0.735,
                          (32, 4, 2): 0.786},
        "2x16384x16x128": {(32, 4, 3): 0.582, (32, 4, 2): 0.687, (64, 4, 3): 0.679,
                           (64, 4, 1): 1.236},
        "8x2048x32x256": {(64, 4, 1): 1.466, (32, 4, 1): 2.163, (32, 2, 1): 1.941},
    },
    "wy": {
        "1x8192x96x128": {(64, 64, 4, 2): 0.787, (64, 64, 4, 3): 0.684},
        "1x8192x64x128": {(64, 64, 4, 2): 0.527, (64, 64, 4, 3): 0.455},
        "4x2048x16x128": {(64, 64, 4, 2): 0.138, (64, 64, 4, 3): 0.121},
        "2x16384x16x128": {(64, 64, 4, 2): 0.516, (64, 64, 4, 3): 0.452},
        "8x1024x8x64": {(64, 64, 4, 2): 0.044, (64, 64, 4, 3): 0.044},
    },
}


# The parallel output kernel of simple GLA's staged forward above K = 128 (chunk_fwd_o):
# (BK, BV, warps, stages), the whole space at 8x2048x32x256 (2026-11-26 evening).
OUTPUT_MS = {
    "8x2048x32x256": {
        (64, 128, 4, 3): 0.746, (64, 128, 8, 3): 0.749, (64, 64, 4, 3): 0.775,
        (64, 64, 8, 3): 0.787, (64, 128, 4, 2): 0.801, (64, 128, 8, 2): 0.808,
        (128, 64, 2, 2): 0.820, (128, 128, 8, 3): 0.867, (64, 64, 2, 3): 0.880,
        (64, 64, 4, 2): 0.882, (64, 64, 8, 2): 0.893, (128, 128, 4, 3): 0.894,
        (64, 128, 2, 2): 0.908, (64, 64, 2, 2): 0.912, (128, 64, 4, 2): 0.916,
        (128, 128, 8, 2): 0.938, (128, 64, 8, 2): 0.961, (128, 128, 4, 2): 0.966,
        (128, 128, 2, 2): 0.972, (128, 64, 2, 3): 0.998, (64, 128, 2, 3): 1.026,
        (128, 64, 4, 3): 1.256, (128, 64, 8, 3): 1.296, (128, 128, 2, 3): 1.355,
    },
}

# The scores kernel of the fused forward (the delta rule's, and simple GLA's above K =
# 128): (BK, warps, stages), each whole space on an H200 (Triton 3.6, bf16, 2026-11-28).
SCORES_MS = {
    "1x8192x96x128": {(64, 2, 2): 0.1475, (64, 2, 1): 0.1571, (64, 4, 2): 0.1572,
                      (64, 8, 1): 0.1589, (64, 8, 2): 0.1628, (64, 4, 1): 0.1798,
                      (32, 2, 2): 0.2186, (32, 2, 1): 0.2209, (32, 4, 2): 0.2219,
                      (32, 4, 1): 0.2227, (32, 8, 2): 0.2404, (32, 8, 1): 0.2422},
    "8x2048x32x256": {(64, 2, 2): 0.1591, (64, 4, 2): 0.1638, (64, 8, 2): 0.1652,
                      (64, 8, 1): 0.1668, (64, 2, 1): 0.1736, (64, 4, 1): 0.1802,
                      (32, 2, 2): 0.2354, (32, 4, 2): 0.2393, (32, 4, 1): 0.2398,
                      (32, 2, 1): 0.2417, (32, 8, 2): 0.2455, (32, 8, 1): 0.2469},
}

# The delta rule's WY kernel ((I + A)⁻¹, one warp), same runs: (BK, warps, stages,
# register cap); the capped default timed in a later call of the same day (uncapped
# there: 0.1671 and 0.1488 ms).
WY_MS = {
    "1x8192x96x128": {(64, 1, 2, 168): 0.1516, (64, 1, 2, None): 0.1664,
                      (32, 1, 2, None): 0.1976, (64, 1, 1, None): 0.2062,
                      (32, 1, 1, None): 0.2138, (64, 2, 2, None): 0.3197,
                      (32, 2, 2, None): 0.3362, (64, 2, 1, None): 0.3526,
                      (32, 2, 1, None): 0.4603, (64, 4, 2, None): 0.5282,
                      (32, 4, 2, None): 0.6155, (32, 4, 1, None): 0.6247,
                      (64, 4, 1, None): 0.6928},
    "8x2048x32x256": {(64, 1, 2, 168): 0.1338, (64, 1, 2, None): 0.1493,
                      (32, 1, 2, None): 0.1556, (64, 1, 1, None): 0.1908,
                      (32, 1, 1, None): 0.2234, (64, 2, 2, None): 0.2805,
                      (32, 2, 2, None): 0.2933, (64, 2, 1, None): 0.3310,
                      (32, 2, 1, None): 0.3702, (64, 4, 1, None): 0.5148,
                      (64, 4, 2, None): 0.5298, (32, 4, 2, None): 0.5355,
                      (32, 4, 1, None): 0.6219},
}

# The DPLR (RWKV7) kernels at head size 128, RWKV7 4x4096x16x128 (2026-11-26 night, each
# whole space): (BV, warps, stages).
DPLR_K128_MS = {
    "fwd_h SAVE": {(64, 8, 1): 1.511, (32, 4, 1): 1.608, (64, 4, 1): 1.968,
                   (32, 8, 1): 2.272},
    "fwd_h": {(64, 8, 1): 1.193, (64, 4, 1): 1.344, (32, 4, 1): 1.730, (32, 8, 1): 2.050},
    "dhu": {(64, 4, 1): 1.801, (64, 8, 1): 1.880, (32, 4, 1): 2.101, (32, 8, 1): 2.943},
    "bwd_local": {(64, 8, 2): 1.073, (32, 8, 2): 1.194, (32, 8, 1): 1.219,
                  (64, 8, 1): 1.255, (32, 4, 2): 1.845, (32, 4, 1): 2.062,
                  (64, 4, 2): 2.223, (64, 4, 1): 2.609},
}


# The DPLR (RWKV7) forward intra-chunk kernel with bf16 dot operands (H200, Triton 3.6,
# 2026-11-28, each whole space, no-grad forward): (BK, warps, stages), ms.
DPLR_INTRA_BF16_MS = {
    "4x4096x32x64": {(64, 4, 2): 0.5398, (64, 4, 1): 0.5442, (32, 4, 2): 0.7350,
                     (32, 4, 1): 0.7867, (64, 8, 2): 1.0283, (64, 8, 1): 1.0290,
                     (32, 8, 1): 1.2308, (32, 8, 2): 1.2494},
    "4x4096x16x128": {(128, 4, 2): 0.5519, (128, 4, 1): 0.5520, (64, 4, 1): 0.5830,
                      (64, 4, 2): 0.6116, (32, 4, 2): 0.6458, (32, 4, 1): 0.7076,
                      (128, 8, 2): 0.7927, (128, 8, 1): 0.7933, (64, 8, 2): 0.9390,
                      (64, 8, 1): 0.9938, (32, 8, 1): 1.1052, (32, 8, 2): 1.1201},
}

# The state passes' row tiles (BK = 64 or 128, ``state_row_heights``) with the rest of each
# default's config held (H100, Triton 3.6, bf16, 2026-11-27; ms; the 4x4096x64x128,
# 1x8192x96x128 "h" and 8x2048x32x256 "out" rows from `profile_case --tune`, the others
# from the op's profile with every pass at 64 rows, then at 128).
ROW_TILE_MS = {
    "inter": {  # the delta rule's fused forward pass
        "1x8192x96x128": {64: 0.701, 128: 0.637},
        "4x4096x64x128": {64: 0.826, 128: 0.748},
        "2x16384x16x128": {64: 0.721, 128: 0.717},
        "4x2048x16x128": {64: 0.118, 128: 0.124},
    },
    "inter states": {  # the backward's states pass (STATES_ONLY)
        "4x4096x64x128": {64: 0.608, 128: 0.622},
    },
    # GLA / RWKV6's output pass on the gated operands and their backward's h pass, the
    # state held transposed (GK_PASS_MS below, the rest of each default held).
    "gk out": {
        "8x2048x32x256": {64: 0.684, 128: 0.698},
        "4x2048x16x128": {64: 0.088, 128: 0.077},
    },
    "gk h": {
        "1x8192x96x128": {64: 0.380, 128: 0.331},
    },
    "dhu GK": {  # their reverse pass
        "1x8192x96x128": {64: 0.561, 128: 0.521},
        "8x2048x32x256": {64: 1.461, 128: 1.339},
        "4x2048x16x128": {64: 0.099, 128: 0.105},
        "2x16384x16x128": {64: 0.576, 128: 0.629},
    },
}


# The fused forward pass with the delta at K = V = 256 on a full grid: the op's forward
# (ms, H100, Triton 3.6, bf16, 8x2048x32x256, 2026-11-27; each config forced in its own
# process, outputs bit-equal to the old default's) by (BK, BV, warps, stages). The
# default until then, (128, 32, 4, 2), held one program an SM by its shared memory.
# (The 2026-11-27 row-tile pair of this shape, 64 -> 128 rows at 32 columns / 4 warps:
# 2.119 -> 2.076 ms for the pass alone.)
WIDE_PASS_MS = {
    "8x2048x32x256": {(128, 32, 4, 2): 2.665, (128, 32, 4, 1): 2.548, (64, 32, 4, 1): 3.230,
                      (64, 64, 4, 1): 2.409, (128, 64, 4, 1): 2.504, (128, 64, 8, 1): 2.707,
                      (128, 64, 8, 2): 2.061, (64, 64, 8, 2): 2.159, (128, 32, 8, 2): 3.094,
                      (64, 32, 8, 2): 3.459},
}


# Above K = 128 in bf16, on an H200 (Triton 3.6, FLA_TUNE=1, 2026-11-29 00:40 UTC; each
# whole space at 8x2048x32x256, ms): the reverse pass with the scaled dh, with W (the gated
# delta rule) and without (simple GLA), by (BV, warps, stages); simple GLA's pass (no
# delta) by (BK, BV, warps, stages); the W-only recompute by (BD, warps, stages).
WIDE_H200_MS = {
    "dhu W scaled": {(64, 8, 2): 1.6498, (64, 4, 2): 2.4563, (32, 4, 2): 2.4826,
                     (32, 8, 2): 2.8993, (32, 2, 2): 45.89, (64, 2, 2): 58.14},
    "dhu scaled": {(64, 8, 2): 1.4955, (64, 4, 2): 1.5265, (32, 4, 2): 2.0825,
                   (32, 8, 2): 2.5031, (32, 2, 2): 27.17, (64, 2, 2): 29.45},
    "inter no delta": {(128, 64, 8, 2): 1.0224, (64, 64, 8, 2): 1.0786,
                       (128, 32, 4, 2): 1.2594, (128, 32, 4, 1): 1.2856,
                       (64, 32, 4, 2): 1.3934, (64, 32, 4, 1): 1.8890},
    "w only": {(64, 8, 3): 0.1729, (64, 8, 2): 0.1733, (128, 2, 3): 0.1759,
               (128, 2, 2): 0.1764, (64, 4, 3): 0.1807, (64, 4, 2): 0.1811,
               (128, 4, 3): 0.1898, (128, 4, 2): 0.1900, (32, 4, 2): 0.1953,
               (32, 4, 3): 0.1953, (32, 2, 3): 0.1986, (32, 2, 2): 0.1991,
               (64, 2, 3): 0.2006, (64, 2, 2): 0.2014, (128, 8, 2): 0.2078,
               (128, 8, 3): 0.2085, (32, 8, 2): 0.2527, (32, 8, 3): 0.2528},
}


def _dims(shape: str):
    B, _, H, D = (int(x) for x in shape.split("x"))
    return D, grid_fill(B * H * -(-D // 64), SMS)


def _pick(kernel: str, D: int, few: int, k=BF16):
    from fla.ops.common import chunk_delta_h, chunk_delta_h_bwd
    from fla.ops.gated_delta_rule import wy_fast_bwd

    with_w = kernel.endswith(" W")
    if kernel.startswith("fwd_h"):
        args = dict(K=D, V=D, BT=64, k=k, w=k if with_w else None, FEW_PROGRAMS=few)
        return chunk_delta_h._default(args), chunk_delta_h._space(args)
    if kernel.startswith("dhu"):
        gk = kernel.endswith(" GK")
        args = dict(K=D, V=D, BT=64, k=k, USE_W=with_w, USE_GK=gk, GATED_OPERANDS=gk,
                    FEW_PROGRAMS=few)
        return chunk_delta_h_bwd._dhu_default(args), chunk_delta_h_bwd._dhu_space(args)
    args = dict(K=D, V=D, BT=64, k=k, A=k, USE_G=True)
    return wy_fast_bwd._wy_default(args), wy_fast_bwd._wy_space(args)


def _follows_the_best(label, times: dict, config, space, entry: tuple) -> None:
    """The default's measured time within 5% of the fastest, and the default in its
    space."""
    picked = times[entry]
    assert picked <= 1.05 * min(times.values()), (label, config, picked)
    assert config in space, (label, config)


def _entry(kernel: str, config) -> tuple:
    if kernel == "wy":
        return (config.meta["BK"], config.meta["BV"], config.num_warps, config.num_stages)
    if kernel == "fwd_h" and "KH" in config.meta:  # (not DPLR's fwd_h)
        return (config.meta["BV"], config.num_warps, config.num_stages, config.meta["KH"])
    return (config.meta["BV"], config.num_warps, config.num_stages)


def test_forward_pass_default_follows_the_measured_best():
    """The delta rule's fused pass (the hint once sent 1x8192x96x128's 192 programs to
    BV = 32: 0.95 ms against 0.72)."""
    from fla.ops.common import chunk_fwd_inter as inter
    for shape, times in PASS_MS.items():
        D, few = _dims(shape)
        args = dict(K=D, V=D, k=BF16, DELTA=True, FORM_AQK=False, TRANSITION=False,
                    FEW_PROGRAMS=few)
        config = inter._default(args)
        _follows_the_best(shape, times, config, inter._space(args),
                          (config.meta["BV"], config.num_stages))


def test_wide_forward_pass_default_follows_the_measured_best():
    """At K = 256 the delta rule's output pass takes 64 columns at 8 warps (half the
    programs re-reading Q and K through L2), where the Triton release builds them."""
    from fla.ops.common import chunk_fwd_inter as inter
    for shape, times in WIDE_PASS_MS.items():
        D, few = _dims(shape)
        args = dict(K=D, V=D, k=BF16, DELTA=True, FORM_AQK=False, TRANSITION=False,
                    FEW_PROGRAMS=few)
        config = inter._default(args)
        entry = (config.meta["BK"], config.meta["BV"], config.num_warps, config.num_stages)
        _follows_the_best(shape, times, config, inter._space(args), entry)


@pytest.mark.parametrize("ok", [True, False])
def test_wide_forward_pass_leaves_eight_warps_where_triton_cannot_build_them(monkeypatch,
                                                                            ok):
    """Triton 3.3.1 aborts building the K = 256 output pass at 8 warps (offline sm_90,
    2026-11-27): there neither its default (with the delta or without) nor its space has
    8 warps, nor do fp32
    operands (their two stages would not fit the shared memory), nor a split's passes
    (whose launch model counts 32-column programs), the backward's states pass or thin
    grids, whose rules were not timed."""
    from fla.ops.common import chunk_fwd_inter as inter
    from fla.utils import triton_facts
    monkeypatch.setattr(triton_facts, "WIDE_STMATRIX_8_WARPS_OK", ok)
    base = dict(K=256, V=256, DELTA=True, FORM_AQK=False, TRANSITION=False, FEW_PROGRAMS=0)
    assert (inter._default(dict(base, k=BF16)).num_warps == 8) == ok
    assert (8 in {c.num_warps for c in inter._space(dict(base, k=BF16))}) == ok
    assert 8 not in {c.num_warps for c in inter._space(dict(base, k=FP32))}
    assert (inter._default(dict(base, k=BF16, DELTA=False)).num_warps == 8) == ok
    for other in (dict(k=FP32), dict(k=BF16, TRANSITION=True), dict(k=BF16, STATES_ONLY=True),
                  dict(k=BF16, FEW_PROGRAMS=1), dict(k=BF16, SPLIT=True)):
        assert inter._default(dict(base, **other)).num_warps == 4, other


@pytest.mark.parametrize("kernel", list(ROW_TILE_MS))
def test_state_row_tiles_follow_the_measured_best(kernel):
    """128-row state tiles where they measured faster (full grids; GLA's passes on the
    gated operands), 64 rows elsewhere; each default's height within 5% of the faster."""
    from fla.ops.common import chunk_delta_h_bwd, chunk_fwd_inter, chunk_gk_fwd
    for shape, times in ROW_TILE_MS[kernel].items():
        D, few = _dims(shape)
        if kernel.startswith("inter"):
            config = chunk_fwd_inter._default(dict(
                K=D, V=D, k=BF16, DELTA=True, FORM_AQK=False, TRANSITION=False,
                FEW_PROGRAMS=few, STATES_ONLY=kernel == "inter states"))
            space = chunk_fwd_inter._space(dict(K=D, V=D, k=BF16, DELTA=True, FORM_AQK=False))
        elif kernel.startswith("gk"):
            args = dict(K=D, V=D, k=BF16, GATED_OPERANDS=True, STORE_O=kernel == "gk out",
                        STORE_H=kernel == "gk h", FEW_PROGRAMS=few)
            config, space = chunk_gk_fwd._h_default(args), chunk_gk_fwd._h_space(args)
        else:
            config, space = _pick(kernel, D, few)
        picked = times[config.meta["BK"]]
        assert picked <= 1.05 * min(times.values()), (kernel, shape, config, times)
        assert config in space, (kernel, shape, config)


# GLA / RWKV6's state pass (chunk_gk_fwd_h) holding the state transposed, on the gated
# operands: the forward's output pass ("out") and the backward's h pass ("h"), by (BK,
# BV, warps, stages) (H100, Triton 3.6, bf16, 2026-11-27, each config of the space forced
# in turn; the fastest few and the defaults; 4x4096x16x128 is RWKV6's). Holding S [BK, BV]
# the output pass took 1.122 ms at 8x2048x32x256.
GK_PASS_MS = {
    "out": {
        "8x2048x32x256": {(128, 128, 8, 2): 0.698, (64, 128, 8, 2): 0.684,
                          (64, 32, 4, 2): 0.894, (128, 64, 8, 2): 0.970},
        "4x2048x16x128": {(128, 64, 8, 3): 0.0772, (128, 64, 4, 3): 0.0833,
                          (64, 32, 4, 2): 0.0880},
        "4x4096x16x128": {(128, 64, 8, 3): 0.1393, (128, 64, 4, 3): 0.1514,
                          (64, 64, 8, 3): 0.1611},
    },
    "h": {
        "8x2048x32x256": {(128, 64, 8, 2): 0.690, (128, 64, 4, 2): 0.704,
                          (128, 128, 8, 2): 0.853, (64, 64, 8, 2): 0.763},
        "4x2048x16x128": {(128, 32, 8, 2): 0.0707, (64, 32, 8, 3): 0.0713,
                          (128, 64, 4, 3): 0.0749},
        "4x4096x16x128": {(64, 32, 8, 3): 0.1317, (128, 32, 8, 2): 0.1335,
                          (128, 64, 4, 3): 0.1413},
        "1x8192x96x128": {(128, 64, 4, 3): 0.3312, (128, 32, 4, 2): 0.3618,
                          (128, 64, 8, 3): 0.3735},
    },
}


@pytest.mark.parametrize("mode", list(GK_PASS_MS))
def test_transposed_state_pass_defaults_follow_the_measured_best(mode):
    """Each default within 5% of the fastest measured and in its space."""
    from fla.ops.common import chunk_gk_fwd
    for shape, times in GK_PASS_MS[mode].items():
        D, few = _dims(shape)
        args = dict(K=D, V=D, k=BF16, GATED_OPERANDS=True, STORE_O=mode == "out",
                    STORE_H=mode == "h", FEW_PROGRAMS=few)
        config = chunk_gk_fwd._h_default(args)
        entry = (config.meta["BK"], config.meta["BV"], config.num_warps, config.num_stages)
        _follows_the_best((mode, shape), times, config, chunk_gk_fwd._h_space(args), entry)


@pytest.mark.parametrize("ok", [True, False])
def test_transposed_output_pass_keeps_8_warps_on_the_gated_operands(monkeypatch, ok):
    """On the gated operands the output pass keeps 8 warps on every release (Triton 3.3.1
    builds and runs the transposed pass there: GPU config sweeps, 2026-11-27); gating its
    own operands it keeps the release's rule (no 8 warps where the fact says so), and
    fp32 operands above K = 128 take 32 columns at 4 warps. Every default in its space."""
    from fla.ops.common import chunk_gk_fwd
    from fla.utils import triton_facts
    monkeypatch.setattr(triton_facts, "WIDE_STMATRIX_8_WARPS_OK", ok)
    for D in (64, 128, 256):
        for few in (0, 1, 2):
            for k in (BF16, FP32):
                for gated in (True, False):
                    args = dict(K=D, V=D, k=k, GATED_OPERANDS=gated, STORE_O=True,
                                STORE_H=False, FEW_PROGRAMS=few)
                    config = chunk_gk_fwd._h_default(args)
                    warps = {c.num_warps for c in chunk_gk_fwd._h_space(args)}
                    assert config in chunk_gk_fwd._h_space(args), (D, few, k.dtype, gated)
                    assert (8 in warps) == (gated or ok), (D, few, k.dtype, gated, warps)
    wide = dict(K=256, V=256, GATED_OPERANDS=True, STORE_O=True, STORE_H=False,
                FEW_PROGRAMS=0)
    config = chunk_gk_fwd._h_default(dict(wide, k=BF16))
    assert (config.meta["BV"], config.num_warps) == (128, 8)
    config = chunk_gk_fwd._h_default(dict(wide, k=FP32))
    assert (config.meta["BV"], config.num_warps) == (32, 4)


@pytest.mark.parametrize("ok", [True, False])
def test_transposed_pass_leaves_out_the_tile_triton_3_5_computes_wrong(monkeypatch, ok):
    """Where Triton computes the 128 x 128 tile at 8 warps wrong (3.5.1, a GPU sweep of
    2026-11-27) no space of the vector-gate state pass holds it, and every default, which
    never takes it, stays in its space."""
    from fla.ops.common import chunk_gk_fwd
    from fla.utils import triton_facts
    monkeypatch.setattr(triton_facts, "TRANSPOSED_GK_128X128_OK", ok)
    for D in (128, 256):
        for few in (0, 1, 2):
            for store_o, store_h in ((True, False), (False, True), (True, True)):
                args = dict(K=D, V=D, k=BF16, GATED_OPERANDS=True, STORE_O=store_o,
                            STORE_H=store_h, FEW_PROGRAMS=few)
                space = chunk_gk_fwd._h_space(args)
                config = chunk_gk_fwd._h_default(args)
                big = [c for c in space + [config]
                       if c.meta["BK"] >= 128 and c.meta["BV"] >= 128]
                assert config in space, (D, few, store_o, store_h, config)
                # Left out where it is wrong, kept (timed, as fast as 64 rows) elsewhere.
                assert bool(big) == ok, (D, few, store_o, store_h, big)


@pytest.mark.parametrize("kernel", list(STAGE_MS))
def test_state_pass_defaults_follow_the_measured_best(kernel):
    for shape, times in STAGE_MS[kernel].items():
        D, few = _dims(shape)
        config, space = _pick(kernel, D, few)
        _follows_the_best((kernel, shape), times, config, space, _entry(kernel, config))


@pytest.mark.parametrize("kernel", list(STAGE_MS))
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("few", [0, 1, 2])
def test_defaults_stay_in_their_space_for_every_dtype(kernel, D, few):
    """The deeper pipelines are for 16-bit operands: with fp32 (twice the shared memory
    a stage) every default is still a config of the space, which holds only those that
    fit."""
    for k in (BF16, FP32):
        config, space = _pick(kernel, D, few, k)
        if kernel.startswith("fwd_h"):
            assert config in space, (kernel, D, few, k.dtype, config)
        else:
            assert config.num_stages <= max(c.num_stages for c in space)
        if k is FP32:
            assert config.num_stages <= (3 if D >= 256 and kernel == "wy" else 2)


@pytest.mark.parametrize("ok", [True, False])
def test_state_passes_leave_eight_warps_where_triton_cannot_build_them(monkeypatch, ok):
    """Triton 3.3.1 on H100 aborted building the reverse state pass at 8 warps at every K
    and the state pass with W at K = 128 and 256 (the LLVM layout assertion users hit),
    config sweeps of 2026-11-26: where the fact says so, no default or config of those
    spaces has 8 warps (the state pass with W at no K; the reverse pass's thin-grid
    default without W drops to 4); the releases that build them keep them."""
    from fla.utils import triton_facts
    monkeypatch.setattr(triton_facts, "WIDE_STMATRIX_8_WARPS_OK", ok)
    for kernel in ("fwd_h W", "fwd_h", "dhu W", "dhu", "dhu GK", "wy"):
        for D in (64, 128, 256):
            for few in (0, 1, 2):
                config, space = _pick(kernel, D, few)
                # Without W a program of at most 128 rows builds as the pass at K = 128.
                held = [c for c in space + [config] if c.meta.get("KH", D) == D]
                warps = {c.num_warps for c in held}
                prone = kernel != "fwd_h" or D > 128
                assert (8 in warps) == (ok or not prone), (kernel, D, few, config, warps)
                if kernel == "fwd_h" and D > 128:
                    assert 8 in {c.num_warps for c in space if c.meta["KH"] == 128}
    thin_default, _ = _pick("dhu", 128, 2)
    assert thin_default.num_warps == (8 if ok else 4)


@pytest.mark.parametrize("K, V", [(16, 16), (32, 32), (32, 64), (64, 32)])
def test_wy_backward_keeps_narrow_sixteen_bit_heads_on_two_warps(K, V):
    """On H100 / Triton 3.6 the WY backward faulted (illegal address) at every 4- and
    8-warp config with K = V = 16 or 32 in fp16/bf16 (the DeltaNet layers' GPU tests,
    head dim 16): there its default and every config of its space take 2 warps; wider
    heads and fp32 keep the wgmma configs."""
    from fla.ops.gated_delta_rule import wy_fast_bwd
    for k in (BF16, torch.empty(1, dtype=torch.float16)):
        args = dict(K=K, V=V, BT=64, k=k, A=k, USE_G=True)
        assert wy_fast_bwd._wy_default(args).num_warps == 2
        assert {c.num_warps for c in wy_fast_bwd._wy_space(args)} == {2}
    for k, D in ((FP32, 16), (BF16, 64)):
        args = dict(K=D, V=D, BT=64, k=k, A=k, USE_G=True)
        assert wy_fast_bwd._wy_default(args).num_warps == 4
        assert 4 in {c.num_warps for c in wy_fast_bwd._wy_space(args)}


def test_grid_fill():
    assert grid_fill(192, SMS) == 0      # 1x8192x96 heads: two programs on some SMs
    assert grid_fill(133, SMS) == 0
    assert grid_fill(132, SMS) == 1      # one a SM at BV = 64, two on some at BV = 32
    assert grid_fill(67, SMS) == 1
    assert grid_fill(66, SMS) == 2       # at most one a SM even at BV = 32
    assert grid_fill(1, SMS) == 2


def test_backward_recomputes_states_where_it_measured_faster(monkeypatch):
    """The delta rule's backward takes the forward's pass for h and Vn on full grids and
    where the pass splits, the staged pass on thin grids (H100, ms for the recompute and
    W: 1x8192x96x128 0.73 against 0.83, 4x4096x64x128 0.84 against 1.03, 1x65536x8x128
    split 1.01, 8x2048x32x256 1.47; 4x2048x16x128 staged). 2x16384x16x128 took the staged
    pass unsplit (0.73 against 0.55) until its forward split (2026-11-28): from the
    forward's segment states its recompute is 0.29 + 0.13 ms (profile_case), and the
    op's fwd+bwd went 3.278 -> 3.171 ms. In bf16 the forward's pass everywhere (the
    staged pass's bf16 U and W cost the bound; fla/ops/gated_delta_rule/chunk.py); fp16
    chooses as fp32 (its 11 bits keep the staged pass far inside the bound)."""
    from fla.ops.common import chunk_segments
    from fla.ops.gated_delta_rule import chunk as gdn_chunk
    from fla.utils import grid
    monkeypatch.setattr(grid, "multiprocessor_count", lambda: SMS)
    monkeypatch.setattr(chunk_segments, "multiprocessor_count", lambda: SMS)
    expected = {"1x8192x96x128": True, "4x4096x64x128": True, "1x65536x8x128": True,
                "8x2048x32x256": True, "2x16384x16x128": True, "4x2048x16x128": False}
    for shape, from_pass in expected.items():
        B, T, H, D = (int(x) for x in shape.split("x"))
        k = torch.empty(B, T, H, D, device="meta")
        assert gdn_chunk._states_from_the_forward_pass(k, k, None) is from_pass, shape
        k16 = k.to(torch.float16)
        assert gdn_chunk._states_from_the_forward_pass(k16, k16, None) is from_pass, shape
        k = k.to(torch.bfloat16)
        assert gdn_chunk._states_from_the_forward_pass(k, k, None), shape


def test_reverse_pass_launcher_passes_the_grid_hint_with_the_vector_gate(monkeypatch):
    """GLA's reverse state pass once ran without FEW_PROGRAMS (its thin-grid default never
    fired: 1.24 ms against 0.58 at 2x16384x16x128): its launcher computes the hint for
    the vector gate too."""
    from fla.ops.common import chunk_delta_h_bwd
    calls = []

    def hint(N, H, V):
        calls.append((N, H, V))
        return 0

    monkeypatch.setattr(chunk_delta_h_bwd, "sequential_grid_fill", hint)
    monkeypatch.setattr(chunk_delta_h_bwd, "chunk_gated_delta_rule_bwd_dhu_kernel",
                        _NoLaunch())
    q = torch.zeros(2, 70, 3, 32)
    do = torch.zeros(2, 70, 3, 16)
    A = torch.zeros(2, 70, 3, 64)
    chunk_delta_h_bwd.chunk_gated_delta_rule_bwd_dhu(q, q, None, q, None, None, do, None, 1.0,
                                                     chunk_size=64, Aqk=A,
                                                     gated_operands=True)
    assert calls == [(2, 3, 16)]


class _NoLaunch:
    """A kernel stand-in whose launches do nothing."""

    def __getitem__(self, grid):
        return lambda **kwargs: None


@pytest.mark.parametrize("ok", [True, False])
def test_dv_local_leaves_four_warps_at_wide_heads_where_triton_miscomputes_them(
        monkeypatch, ok):
    """Triton 3.9 on H100 gave non-finite dv from chunk_bwd_dv_local at K = 256 with 4
    warps: where the fact says so, neither its default nor its space holds a 4-warp
    config above K = 128; up to K = 128, and on the releases that compute them right,
    the measured 4-warp default stays."""
    from fla.ops.common import chunk_o_bwd
    from fla.utils import triton_facts
    monkeypatch.setattr(triton_facts, "FOUR_WARP_WIDE_DV_LOCAL_OK", ok)
    for K in (64, 128, 192, 256):
        args = dict(K=K, V=K, BT=64, q=BF16, USE_G=True)
        default = chunk_o_bwd._dv_local_default(args)
        warps = {c.num_warps for c in chunk_o_bwd._dv_local_space(args)}
        assert default in chunk_o_bwd._dv_local_space(args)
        if K > 128 and not ok:
            assert default.num_warps == 8 and 4 not in warps, (K, default, warps)
        else:
            assert default.num_warps == 4 and 4 in warps, (K, default, warps)



def test_output_kernel_default_follows_the_measured_best():
    from fla.ops.common import chunk_o
    for shape, times in OUTPUT_MS.items():
        D, _ = _dims(shape)
        args = dict(K=D, V=D, BT=64, q=BF16)
        config = chunk_o._default(args)
        _follows_the_best(shape, times, config, chunk_o._space(args),
                          (config.meta["BK"], config.meta["BV"], config.num_warps,
                           config.num_stages))


@pytest.mark.parametrize("kernel", ["scores", "wy"])
def test_intra_kernel_defaults_follow_the_measured_best(kernel):
    from fla.ops.common import chunk_fwd_intra
    table, default, space = {
        "scores": (SCORES_MS, chunk_fwd_intra._scores_default, chunk_fwd_intra._scores_space),
        "wy": (WY_MS, chunk_fwd_intra._default, chunk_fwd_intra._space),
    }[kernel]
    for shape, times in table.items():
        D, _ = _dims(shape)
        config = default(dict(K=D, k=BF16))
        entry = (config.meta["BK"], config.num_warps, config.num_stages)
        _follows_the_best(shape, times, config, space(dict(K=D, k=BF16)),
                          entry + (config.maxnreg,) if kernel == "wy" else entry)


@pytest.mark.parametrize("kernel", list(DPLR_K128_MS))
def test_dplr_defaults_at_head_size_128_follow_the_measured_best(kernel):
    """Head size 128 had kept the K = 64 rules untimed: the reverse local pass's 4 warps
    were 2.1x its best there."""
    from fla.ops.common import chunk_dplr_bwd_dhu, chunk_dplr_bwd_local, chunk_dplr_fwd_h
    default, space = {
        "fwd_h SAVE": (chunk_dplr_fwd_h.state_pass_default, chunk_dplr_fwd_h.state_pass_space),
        "fwd_h": (chunk_dplr_fwd_h.state_pass_default, chunk_dplr_fwd_h.state_pass_space),
        "dhu": (chunk_dplr_bwd_dhu._default, chunk_dplr_fwd_h.state_pass_space),
        "bwd_local": (chunk_dplr_bwd_local._default, chunk_dplr_bwd_local._space),
    }[kernel]
    args = dict(K=128, V=128, q=BF16, **({"SAVE": kernel == "fwd_h SAVE"}
                                         if kernel.startswith("fwd_h") else {}))
    config = default(args)
    _follows_the_best(kernel, DPLR_K128_MS[kernel], config, space(args), _entry(kernel, config))


def test_dplr_intra_default_with_bf16_operands_follows_the_measured_best():
    """bf16 operands moved the best K tile at K = 128 from 32 (0.708 ms) to 128 (0.552)."""
    import triton.language as tl
    from fla.ops.common import chunk_dplr_fwd_intra as intra
    for shape, times in DPLR_INTRA_BF16_MS.items():
        D, _ = _dims(shape)
        args = dict(K=D, q=BF16, DT=tl.bfloat16, PRECISION="tf32")
        config = intra._default(args)
        _follows_the_best(shape, times, config, intra._space(args),
                          (config.meta["BK"], config.num_warps, config.num_stages))


# The split's pieces without the delta (simple GLA at 2x16384x16x128; H100, Triton 3.6,
# bf16, 2026-11-27, `profile_case --tune`): the transitions (BK, BV, warps, stages) and
# the scalar combine (BV, warps, stages); and the delta rule's transitions at
# 1x65536x8x128 (the same way, 2026-11-28).
SPLIT_MS = {
    "transition": {(64, 64, 4, 3): 0.1042, (128, 64, 4, 3): 0.1043, (64, 32, 4, 2): 0.1170,
                   (128, 32, 4, 2): 0.1180, (64, 64, 4, 2): 0.1216, (128, 64, 4, 2): 0.1286,
                   (128, 64, 4, 1): 0.1388},
    "delta transition": {(64, 64, 4, 3): 0.3122, (128, 64, 4, 3): 0.3236,
                         (128, 64, 4, 2): 0.3353, (64, 64, 4, 2): 0.3539,
                         (128, 64, 4, 1): 0.3582, (128, 32, 4, 2): 0.4360,
                         (64, 64, 4, 1): 0.4538, (64, 32, 4, 2): 0.4680,
                         (128, 32, 4, 3): 0.4729, (64, 32, 4, 3): 0.4856},
    "combine": {(32, 8, 2): 0.0130, (32, 8, 1): 0.0131, (64, 2, 2): 0.0157,
                (32, 4, 2): 0.0168, (64, 4, 2): 0.0170, (32, 2, 2): 0.0201},
}


def test_split_pieces_follow_the_measured_best():
    """Simple GLA's transitions take a third stage (no Q tiles: the shared memory is
    there) and the scalar combine 8 warps; so do the delta's transitions, at 64 columns."""
    from fla.ops.common import chunk_fwd_inter as inter
    args = dict(K=128, V=128, k=BF16, DELTA=False, FORM_AQK=False, TRANSITION=True,
                SPLIT=True, FEW_PROGRAMS=0)
    config = inter._default(args)
    entry = (config.meta["BK"], config.meta["BV"], config.num_warps, config.num_stages)
    _follows_the_best("transition", SPLIT_MS["transition"], config, inter._space(args),
                      entry)
    # The delta's transitions (K + V columns), timed at 1x65536x8x128 on 2026-11-28.
    delta_args = dict(args, DELTA=True)
    delta = inter._default(delta_args)
    _follows_the_best("delta transition", SPLIT_MS["delta transition"], delta,
                      inter._space(delta_args),
                      (delta.meta["BK"], delta.meta["BV"], delta.num_warps, delta.num_stages))
    args = dict(K=128, V=128, h0=None, FORM="scalar")
    from fla.ops.common import chunk_state_combine as combine
    config = combine._combine_default(args)
    _follows_the_best("combine", SPLIT_MS["combine"], config, combine._combine_space(args),
                      (config.meta["BV"], config.num_warps, config.num_stages))
    # The delta form: its walk in registers up to K = 128 (the delta rule at
    # 1x65536x8x128: 71 µs against the tiled walk's 125 at its best), tiled above.
    delta = combine._combine_default(dict(args, FORM="delta"))
    assert (delta.meta["BV"], delta.num_warps, delta.num_stages) == (32, 8, 3)
    # On a thin grid 16 columns (H200, 2026-11-28: the op's fwd at 1x65536x8x128
    # 0.931 -> 0.915 ms; 2x16384x16x128, not thin, 0.862 against 0.868 at 16).
    thin = combine._combine_default(dict(args, FORM="delta", THIN_GRID=True))
    assert (thin.meta["BV"], thin.num_warps, thin.num_stages) == (16, 8, 3)
    assert thin in combine._combine_space(dict(args, FORM="delta"))
    # Only the walk in registers: the tiled walk and the scalar form keep 32 columns.
    for other in (dict(FORM="delta", K=256), dict(FORM="scalar")):
        assert combine._combine_default(dict(args, THIN_GRID=True, **other)).meta["BV"] == 32
    assert combine._combine_default(dict(args, FORM="delta", K=256)).num_warps == 4


# The delta's transitions of a split forward at two and three stages, by shape: (their
# programs at 64 columns, µs at 2 stages, µs at 3). H200, Triton 3.6, bf16, 2026-11-29,
# `chunk_gated_delta_rule`'s no-grad forward per kernel (torch.profiler), two rounds in
# alternating processes (the 3-stage rows the tree before, its two rounds' range);
# 1x65536x8x128 at two stages from `profile_case --tune` the same day (00:40 UTC).
THIN_TRANSITIONS_US = {
    "2x16384x16x128": (384, 225, (286, 317)),
    "4x8192x8x128": (384, 116, (143, 161)),
    "2x8192x16x128": (384, 117, (161, 164)),
    "1x65536x8x128": (480, 358, (314, 317)),
}


def test_delta_transitions_take_two_stages_where_that_saves_a_wave(monkeypatch):
    """Three programs an SM at two stages, two at three: where the launch's programs take
    fewer waves at two stages, two (1x65536x8x128's 480 need two waves either way)."""
    from fla.ops.common import chunk_fwd_inter as inter
    monkeypatch.setattr(inter, "multiprocessor_count", lambda *a: SMS)
    args = dict(K=128, V=128, k=BF16, DELTA=True, FORM_AQK=False, TRANSITION=True,
                SPLIT=True)
    for shape, (programs, two, three) in THIN_TRANSITIONS_US.items():
        hint = inter._transition_hint(programs, 128, True)
        config = inter._default(dict(args, FEW_PROGRAMS=hint))
        assert config in inter._space(args)
        best = 2 if two < min(three) else 3
        assert config.num_stages == best, (shape, hint, config)
    # Without the delta, above K = 128 and in fp32 the hint stays off or changes nothing.
    assert inter._transition_hint(384, 128, False) == 0
    assert inter._transition_hint(384, 256, True) == 0
    assert inter._default(dict(args, k=FP32, FEW_PROGRAMS=1)).num_stages == 2


def test_split_launcher_passes_the_transition_hint(monkeypatch):
    """The delta's transition launch carries `_transition_hint` of its own program count
    (64 columns of [M | X] x heads x transition pieces), the output launch none."""
    from fla.ops.common import chunk_fwd_inter as inter
    from fla.ops.common.chunk_segments import split_tables
    monkeypatch.setattr(inter, "multiprocessor_count", lambda *a: SMS)
    monkeypatch.setattr(inter, "combine_segment_states", lambda mx, *a, **kw: mx[..., :128])
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda **kw: launches.append(kw)

    K = V = 128
    # 288 programs: one wave at two stages, two at three; 96: one either way; 480 (as at
    # 1x65536x8x128): two either way; 576: two against three.
    for H, pieces, hint in ((24, 4, 1), (8, 4, 0), (40, 4, 0), (48, 4, 1)):
        # 1 sequence in `pieces` segments: pieces - 1 transitions of 4 tiles each a head.
        launches.clear()
        tables = split_tables([0, 64 * 8 * pieces], 8, "cpu")
        k = torch.empty(1, 64 * 8 * pieces, H, K)
        common = dict(H=H, K=K, V=V, q=k, k=k)
        inter._split_pass(Recorder(), common, {}, *tables, True, None, None)
        programs = 4 * H * (pieces - 1)
        assert [kw.get("FEW_PROGRAMS") for kw in launches] == [hint, 0], (H, programs)
        assert (-(-programs // (3 * SMS)) < -(-programs // (2 * SMS))) == bool(hint)


# The reverse pass's split launches without W (simple GLA 2x16384x16x128: 192
# transition programs, 256 output programs; H200, Triton 3.6, bf16, FLA_TUNE=1,
# 2026-11-29): ms by (BV, warps, stages).
SPLIT_REVERSE_NO_W_MS = {
    "transition": {(64, 4, 3): 0.0964, (64, 8, 3): 0.1020, (64, 4, 2): 0.1233,
                   (64, 8, 2): 0.1244, (32, 4, 3): 0.1321, (32, 2, 2): 0.1364,
                   (32, 4, 2): 0.1422, (32, 2, 3): 0.1570},
    "output": {(64, 4, 2): 0.2812, (64, 4, 3): 0.4168, (32, 4, 2): 0.4294,
               (64, 8, 2): 0.4540, (64, 8, 3): 0.4785, (32, 2, 2): 0.5279,
               (32, 8, 2): 0.5293, (32, 4, 3): 0.7071},
}


def test_split_reverse_pass_without_w_follows_the_measured_best():
    """Without W the reverse pass's transitions take three stages, its output launch two."""
    from fla.ops.common import chunk_delta_h_bwd as bwd
    for piece, times in SPLIT_REVERSE_NO_W_MS.items():
        args = dict(K=128, V=128, BT=64, k=BF16, USE_W=False, USE_GK=None,
                    GATED_OPERANDS=None, FEW_PROGRAMS=0, SPLIT=True,
                    TRANSITION=piece == "transition", DH_SCALED=piece == "output")
        config = bwd._dhu_default(args)
        _follows_the_best(piece, times, config, bwd._dhu_space(args),
                          (config.meta["BV"], config.num_warps, config.num_stages))


# The fused recurrent forwards on few sequences x heads (prefill of a small batch; H100,
# Triton 3.6, bf16, 2026-11-27, `scratch/recurrent_fill_probe.py`: the op's no-grad
# forward with each config forced, stage 1): (BV, warps). The one-warp default of the
# decode batches was 2.6x off the best for RWKV7 at K = 64; the gated delta rule's is
# still the best there.
RECURRENT_THIN_MS = {
    ("dplr", "4x1024x32x64"): {(32, 1): 2.8135, (16, 4): 1.0839, (8, 4): 1.2024,
                               (16, 8): 1.3633},
    ("dplr", "4x4096x32x64"): {(32, 1): 11.188, (16, 4): 4.312, (8, 4): 4.808,
                               (16, 8): 5.446, (32, 4): 5.720},
    ("dplr", "4x1024x16x128"): {(16, 1): 2.8500, (64, 8): 2.3462, (8, 4): 2.4990,
                                (8, 2): 2.5234},
    ("gla", "4x2048x16x128"): {(16, 1): 3.6427, (8, 4): 2.9274, (8, 2): 3.0522,
                               (16, 4): 3.1206},
    ("gdn", "4x2048x16x128"): {(16, 1): 2.7420, (8, 1): 2.9980, (16, 4): 3.5212},
}


@pytest.mark.parametrize("family, shape", list(RECURRENT_THIN_MS))
def test_fused_recurrent_forward_defaults_on_thin_grids_follow_the_measured_best(family,
                                                                                 shape):
    """Where the launcher's hint says few sequences x heads, each family's forward takes
    the tile measured best for it (within 5%), and the decode rule elsewhere."""
    from fla.ops.common import fused_recurrent_tiles as tiles
    from fla.ops.gated_delta_rule import fused_recurrent as gdn
    from fla.ops.generalized_delta_rule import fused_recurrent as dplr
    from fla.ops.gla import fused_recurrent as gla
    kernel = {"dplr": dplr.fused_recurrent_dplr_fwd_kernel,
              "gla": gla.fused_recurrent_gla_fwd_kernel,
              "gdn": gdn.fused_recurrent_gated_delta_rule_fwd_kernel}[family]
    B, T, H, D = map(int, shape.split("x"))
    few = grid_fill(B * H * -(-D // 64), SMS)
    assert few > 0
    args = dict(K=D, V=D, BK=tiles.block_k(D), q=BF16, h0=None, FEW_PROGRAMS=few)
    config = kernel.default(args)
    _follows_the_best(f"{family} {shape}", RECURRENT_THIN_MS[family, shape], config,
                      kernel.space(args), (config.meta["BV"], config.num_warps))
    # Decode batches (a full grid) keep the common rule.
    assert kernel.default(dict(args, FEW_PROGRAMS=0)) == tiles.default_config(args)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("few", [0, 1, 2])
def test_sixteen_bit_backward_defaults_stay_in_their_space(D, few):
    """The bf16 delta rules' backward variants (the states pass on two-term dots, the
    reverse pass and dqkwg with the scaled dh) have defaults of their own: each is a config
    of its kernel's space."""
    from fla.ops.common import chunk_delta_h_bwd, chunk_fwd_inter, chunk_o_bwd

    inter = dict(K=D, V=D, k=BF16, DELTA=True, TRANSITION=False, SPLIT=False,
                 FORM_AQK=False, STORE_AQK=False, FEW_PROGRAMS=few, STATES_ONLY=True,
                 TWO_TERM=True)
    assert chunk_fwd_inter._default(inter) in chunk_fwd_inter._space(inter), inter
    for with_w in (True, False):
        dhu = dict(K=D, V=D, BT=64, k=BF16, USE_W=with_w, USE_GK=None, GATED_OPERANDS=None,
                   FEW_PROGRAMS=few, DH_SCALED=True)
        assert (chunk_delta_h_bwd._dhu_default(dhu)
                in chunk_delta_h_bwd._dhu_space(dhu)), dhu
    dqkwg = dict(K=D, V=D, BT=64, BK=64, k=BF16, USE_G=True, USE_W=True, DH_SCALED=True)
    assert chunk_o_bwd._dqkwg_default(dqkwg) in chunk_o_bwd._dqkwg_space(dqkwg), dqkwg


@pytest.mark.parametrize("ok", [True, False])
def test_wide_bf16_defaults_follow_the_measured_best_on_the_h200(monkeypatch, ok):
    """Above K = 128 in bf16: the reverse pass with the scaled dh and simple GLA's pass
    take 64 columns at 8 warps where this Triton builds them (4 warps where it does not),
    the W-only recompute 64-wide tiles at three stages."""
    from fla.ops.common import chunk_delta_h_bwd, chunk_fwd_inter
    from fla.ops.gated_delta_rule import wy_fast
    from fla.utils import triton_facts
    monkeypatch.setattr(triton_facts, "WIDE_STMATRIX_8_WARPS_OK", ok)
    for with_w in (True, False):
        args = dict(K=256, V=256, BT=64, k=BF16, USE_W=with_w, USE_GK=None,
                    GATED_OPERANDS=None, FEW_PROGRAMS=0, DH_SCALED=True)
        config = chunk_delta_h_bwd._dhu_default(args)
        assert config in chunk_delta_h_bwd._dhu_space(args), config
        # 2 warps: 4-35x slower there, and one of them wrote out of bounds (H200 sweep).
        assert 2 not in {c.num_warps for c in chunk_delta_h_bwd._dhu_space(args)}
        times = WIDE_H200_MS["dhu W scaled" if with_w else "dhu scaled"]
        entry = (config.meta["BV"], config.num_warps, config.num_stages)
        if ok:
            _follows_the_best(("dhu", with_w), times, config,
                              chunk_delta_h_bwd._dhu_space(args), entry)
        else:
            assert config.num_warps == 4, config
    args = dict(K=256, V=256, k=BF16, DELTA=False, FORM_AQK=False, TRANSITION=False,
                FEW_PROGRAMS=0)
    config = chunk_fwd_inter._default(args)
    entry = (config.meta["BK"], config.meta["BV"], config.num_warps, config.num_stages)
    if ok:
        _follows_the_best("inter", WIDE_H200_MS["inter no delta"], config,
                          chunk_fwd_inter._space(args), entry)
    else:
        assert config.num_warps == 4 and config in chunk_fwd_inter._space(args), config
    args = dict(K=256, V=256, BT=64, k=BF16, WITH_U=False)
    config = wy_fast._default(args)
    _follows_the_best("w only", WIDE_H200_MS["w only"], config, wy_fast._space(args),
                      (config.meta["BD"], config.num_warps, config.num_stages))
