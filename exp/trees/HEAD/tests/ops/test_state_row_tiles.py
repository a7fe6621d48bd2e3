"""The sequential chunk passes with their state in 128-row tiles.

From K = 128 on, the state passes may hold the K x BV fp32 state as [128, BV] register
tiles instead of [64, BV] ones (a tuning choice, ``fla.ops.utils.tiles.state_row_heights``):
the delta rule's fused forward pass (and the backward's states pass), GLA's and RWKV6's
state pass, and the reverse pass with the vector gate on the gated operands. Here each
family runs at K = V = 128 on a grid its defaults count as full (one SM is reported, as
the interpreter does), the passes are checked to have taken 128-row tiles (the delta
rule's backward states pass keeps 64), and outputs, final states and every gradient are
compared with the float64 loop. The GPU config sweeps of each family run every height.
"""
import pytest

from fla.ops.common import chunk_delta_h_bwd, chunk_fwd_inter, chunk_gk_fwd, chunk_segments
from tests.helpers import generator, odd_length
from tests.ops import gated_delta_cases, test_gla, test_rwkv6
from tests.ops.config_sweep import record_launches
from tests.ops.gated_delta_cases import INTERPRETER_DTYPES

PASSES = {
    "inter": chunk_fwd_inter.chunk_gated_delta_rule_fwd_inter_kernel,
    "gk_fwd_h": chunk_gk_fwd.chunk_gk_fwd_h_kernel,
    "dhu": chunk_delta_h_bwd.chunk_gated_delta_rule_bwd_dhu_kernel,
}


def _row_heights(monkeypatch, names, call) -> dict:
    """Run ``call`` on a grid counted as full and return, per pass named, the set of
    (STATES_ONLY, BK) its launches took (the config the tuning layer picked for each
    launch's key)."""
    from fla.utils import grid
    monkeypatch.setattr(grid, "multiprocessor_count", lambda: 1)
    monkeypatch.setattr(chunk_segments, "multiprocessor_count", lambda: 1)
    launches = {name: record_launches(monkeypatch, PASSES[name]) for name in names}
    call()
    heights = {}
    for name, calls in launches.items():
        kernel = PASSES[name]
        heights[name] = {(bool(named.get("STATES_ONLY")),
                          kernel.chosen_config(**named).meta["BK"]) for _, named in calls}
    return heights


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
def test_delta_rule_pass_in_128_row_tiles(dtype, device, seed, monkeypatch):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    gen = generator(seed)
    inputs = gated_delta_cases.make_inputs(gen, B=1, T=odd_length(gen, 65, 100), H=2, HV=2,
                                           K=128, V=128)
    heights = _row_heights(monkeypatch, ["inter"], lambda: gated_delta_cases.compare(
        inputs, dtype, device, fn=chunk_gated_delta_rule, gen=gen))
    assert heights == {"inter": {(False, 128), (True, 64)}}


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("exclusive", [False, True], ids=["gla", "rwkv6"])
def test_vector_gate_passes_in_128_row_tiles(exclusive, dtype, device, seed, monkeypatch):
    from fla.ops.gla import chunk_gla
    from fla.ops.rwkv6 import chunk_rwkv6
    gen = generator(seed)
    T = odd_length(gen, 65, 100)
    if exclusive:
        inputs = test_rwkv6.make_inputs(gen, B=1, T=T, H=2, K=128, V=128)

        def call():
            test_rwkv6.compare(inputs, dtype, device, fn=chunk_rwkv6, gen=gen)
    else:
        inputs = test_gla.make_inputs(gen, B=1, T=T, H=2, K=128, V=128)

        def call():
            test_gla.compare(inputs, dtype, device, fn=chunk_gla, gen=gen)
    heights = _row_heights(monkeypatch, ["gk_fwd_h", "dhu"], call)
    assert heights == {"gk_fwd_h": {(False, 128)}, "dhu": {(False, 128)}}
