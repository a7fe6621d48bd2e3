"""fla.layers on tiny widths (CPU, fp32, the PyTorch path): chunk == fused_recurrent,
a full forward == prefill + single-token steps through the cache, left padding == each
sequence alone, packed sequences == separate calls, input checks, torch.compile; on the
GPU every layer in fp32 / fp16 / bf16 and both modes against fp32 on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch

from fla.layers import (
    Attention,
    DeltaNet,
    GatedDeltaNet,
    GatedLinearAttention,
    Mamba2,
    MultiScaleRetention,
    RWKV6Attention,
    RWKV7Attention,
)
from fla.models.utils import Cache
from tests.helpers import assert_rel_close, generator

D = 64
LAYERS = {
    "delta_net": lambda mode: DeltaNet(D, num_heads=4, mode=mode, use_gate=True, layer_idx=0),
    "gated_deltanet": lambda mode: GatedDeltaNet(D, head_dim=16, num_heads=2, num_v_heads=4,
                                                 mode=mode, layer_idx=0),
    "gla": lambda mode: GatedLinearAttention(D, num_heads=4, mode=mode, use_short_conv=True,
                                             layer_idx=0),
    "retention": lambda mode: MultiScaleRetention(D, num_heads=4, mode=mode, layer_idx=0),
    "retention_conv": lambda mode: MultiScaleRetention(D, num_heads=4, mode=mode,
                                                       use_short_conv=True, layer_idx=0),
    "mamba2": lambda mode: Mamba2(D, head_dim=16, state_size=16, n_groups=2, mode=mode,
                                  layer_idx=0),
    "rwkv6": lambda mode: RWKV6Attention(D, num_heads=4, mode=mode, proj_low_rank_dim=8,
                                         gate_low_rank_dim=16, layer_idx=0),
    "rwkv7": lambda mode: RWKV7Attention(D, head_dim=16, mode=mode, decay_low_rank_dim=8,
                                         a_low_rank_dim=8, gate_low_rank_dim=16, layer_idx=0),
    "attention": lambda mode: Attention(D, num_heads=4, num_kv_heads=2, layer_idx=0),
    "attention_window": lambda mode: Attention(D, num_heads=4, window_size=7, layer_idx=0),
}
RECURRENT = [name for name in LAYERS if not name.startswith("attention")]


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    # CPU tensors take the PyTorch path (conftest turns on the Triton interpreter where
    # there is no GPU, far too slow for whole layers); CUDA tensors run the kernels.
    if not torch.cuda.is_available():
        monkeypatch.setenv("FLA_BACKEND", "torch")


def make(name: str, mode: str = "chunk", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layer = LAYERS[name](mode)
    with torch.no_grad():  # nonzero norm weights and conv biases, so that all matter
        for p in layer.parameters():
            if p.dim() == 1 and p.shape[0] > 4:
                p.add_(0.1 * torch.randn_like(p))
    return layer


def inputs(seed: int, B: int, T: int) -> torch.Tensor:
    return torch.randn(B, T, D, generator=generator(seed))


@pytest.mark.parametrize("name", RECURRENT)
def test_chunk_equals_fused_recurrent(name, seed):
    chunk, recurrent = make(name, "chunk"), make(name, "fused_recurrent")
    x = inputs(seed, 2, 70).requires_grad_()
    o1, _, _ = chunk(x)
    (g1,) = torch.autograd.grad(o1.sum(), x)
    o2, _, _ = recurrent(x)
    (g2,) = torch.autograd.grad(o2.sum(), x)
    assert_rel_close("output", o2, o1, 1e-4)
    assert_rel_close("dx", g2, g1, 1e-4)


@pytest.mark.parametrize("name", list(LAYERS))
def test_decode_equals_full(name, seed):
    layer = make(name)
    x = inputs(seed, 2, 21)
    with torch.no_grad():
        full, _, _ = layer(x)
        cache = Cache()
        outs = [layer(x[:, :9], past_key_values=cache, use_cache=True)[0]]
        for t in range(9, 21):
            outs.append(layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
    assert cache.get_seq_length(0) == 21
    # A step without use_cache reads the cache but leaves it as it was.
    before = copy.deepcopy(cache.states)
    with torch.no_grad():
        layer(x[:, :1], past_key_values=cache, use_cache=False)

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, (tuple, list)):
            return all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, dict):
            return all(same(a[k], b[k]) for k in a)
        return a is None and b is None
    assert same(cache.states, before) and cache.get_seq_length(0) == 21
    assert_rel_close("prefill + steps", torch.cat(outs, 1), full, 1e-4)


@pytest.mark.parametrize("name", list(LAYERS))
def test_left_padding_equals_alone(name, seed):
    layer = make(name)
    lengths, T = (19, 11), 19
    xs = [inputs(seed + i, 1, L) for i, L in enumerate(lengths)]
    x = torch.cat([torch.cat([torch.randn(1, T - L, D), xi], 1) for xi, L in zip(xs, lengths)])
    mask = torch.tensor([[0] * (T - L) + [1] * L for L in lengths])
    with torch.no_grad():
        cache = Cache()
        padded, _, _ = layer(x, attention_mask=mask, past_key_values=cache, use_cache=True)
        # One more decoding step for both rows, the mask grown by a column of ones.
        step = inputs(seed + 7, 2, 1)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        stepped, _, _ = layer(step, attention_mask=mask, past_key_values=cache, use_cache=True)
        for i, (xi, L) in enumerate(zip(xs, lengths)):
            alone, _, _ = layer(torch.cat([xi, step[i:i + 1]], 1))
            assert_rel_close(f"row {i}", padded[i, T - L:], alone[0, :L], 1e-4)
            assert_rel_close(f"row {i} step", stepped[i], alone[0, L:], 1e-4)


@pytest.mark.parametrize("name", list(LAYERS))
def test_packed_equals_separate(name, seed):
    layer = make(name)
    lengths = [5, 30, 12]
    xs = [inputs(seed + i, 1, L) for i, L in enumerate(lengths)]
    cu_seqlens = torch.tensor([0, 5, 35, 47])
    with torch.no_grad():
        packed, _, _ = layer(torch.cat(xs, 1), cu_seqlens=cu_seqlens)
        separate = torch.cat([layer(xi)[0] for xi in xs], 1)
    assert_rel_close("packed", packed, separate, 1e-4)


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_mamba2_equals_its_formula(mode, seed):
    """Mamba2's mixer against the op composed by hand, the time steps and the z gate in
    PyTorch: in_proj, the short convolution, dt = clamp(softplus(dt + dt_bias)), the SSD
    with the D skip, y · silu(z), the grouped RMSNorm, out_proj (the layer hands the
    time steps and the gate to the op's kernels instead); outputs and every gradient."""
    import torch.nn.functional as F

    from fla.ops.mamba2 import mamba_chunk_scan_combined

    layer = Mamba2(D, head_dim=16, state_size=16, n_groups=2, mode=mode,
                   time_step_limit=(0.0, 0.05))
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator(seed)))
    x = inputs(seed, 2, 70).requires_grad_()
    H, P, G, N, I = (layer.num_heads, layer.head_dim, layer.n_groups, layer.state_size,
                     layer.intermediate_size)
    z, xBC, dt = layer.in_proj(x).split([I, layer.conv_dim, H], dim=-1)
    xBC, _ = layer.conv1d(xBC)
    u, Bm, Cm = xBC.split([I, G * N, G * N], dim=-1)
    dt = F.softplus(dt + layer.dt_bias).clamp(*layer.time_step_limit)
    y = mamba_chunk_scan_combined(u.reshape(2, 70, H, P), dt, -layer.A_log.exp(),
                                  Bm.reshape(2, 70, G, N), Cm.reshape(2, 70, G, N), 256,
                                  D=layer.D).reshape(2, 70, I)
    ref = layer.out_proj(layer.norm(y * F.silu(z)))
    out = layer(x)[0]
    assert_rel_close("o", out, ref, 1e-5)
    leaves = [x, *layer.parameters()]
    for a, b in zip(torch.autograd.grad(out.square().sum(), leaves),
                    torch.autograd.grad(ref.square().sum(), leaves)):
        assert_rel_close("grad", a, b, 1e-5)


def test_bad_inputs():
    layer = make("gated_deltanet")
    with pytest.raises(ValueError, match="hidden_size"):
        layer(torch.randn(1, 4, D + 1))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(2, 4, D), attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(2, 4, D), attention_mask=torch.ones(2, 4, 1))
    with pytest.raises(ValueError, match="mode"):
        DeltaNet(D, num_heads=4, mode="parallel")
    with pytest.raises(ValueError, match="num_heads"):
        DeltaNet(D, num_heads=5)
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet(D, head_dim=16, num_heads=2, num_v_heads=3)
    with pytest.raises(ValueError, match="num_heads"):
        Attention(D, num_heads=6)
    with pytest.raises(ValueError, match="num_kv_heads"):
        Attention(D, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="inner width"):
        Mamba2(D, num_heads=3, head_dim=16)


# Every layer traces without graph breaks (the chunk grid of the PyTorch paths is sized
# from the host offsets, fla/ops/utils/index.py prepare_token_chunk_positions).
FULLGRAPH: dict[str, bool] = {}


@pytest.mark.parametrize("name", ["delta_net", "gated_deltanet", "gla", "retention",
                                  "mamba2", "rwkv6", "rwkv7", "attention"])
def test_torch_compile(name, seed):
    layer = make(name)
    x = inputs(seed, 2, 20)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=FULLGRAPH.get(name, True), backend="eager")
    with torch.no_grad():
        assert_rel_close("compiled", compiled(x)[0], layer(x)[0], 1e-5)


# ------------------------------------------------------------------------------- GPU
GPU_TOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_gpu_dtypes(name, mode, dtype, seed):
    ref = make(name, mode)
    layer = copy.deepcopy(ref).to("cuda", dtype)
    x = inputs(seed, 2, 150)
    with torch.no_grad():
        expected, _, _ = ref(x)
        out, _, _ = layer(x.to("cuda", dtype))
        # Decoding on the GPU too: prefill, then single-token steps.
        cache = Cache()
        steps = [layer(x[:, :140].to("cuda", dtype), past_key_values=cache, use_cache=True)[0]]
        for t in range(140, 150):
            steps.append(layer(x[:, t:t + 1].to("cuda", dtype), past_key_values=cache,
                               use_cache=True)[0])
    assert out.dtype == dtype
    assert_rel_close("output", out, expected, GPU_TOL[dtype])
    assert_rel_close("decode", torch.cat(steps, 1), expected, GPU_TOL[dtype])
    xg = x.to("cuda", dtype).requires_grad_()
    layer(xg)[0].float().pow(2).sum().backward()
    assert torch.isfinite(xg.grad).all()
