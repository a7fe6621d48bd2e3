"""fla.models.decode: the tokens of generate() (greedy, eos, left padding), reproducible
sampling, argument checks on CPU (eager steps, the PyTorch path); on the GPU the CUDA-graph
step replays the eager step token for token for every architecture."""
from __future__ import annotations

import pytest
import torch

from fla.models import decode, graph_capturable
from tests.helpers import generator
from tests.models.test_models import CONFIGS, GPU_CONFIGS, V, make, token_ids


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("FLA_BACKEND", "torch")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_generate(name, seed):
    model = make(name)
    ids = token_ids(seed, 2, 7)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9,
                              do_sample=False)
    got = decode(model, ids, 9)
    assert got.shape == (2, 16)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["gated_deltanet", "rwkv7", "gated_deltanet_hybrid"])
def test_left_padding_equals_generate(name, seed):
    model = make(name)
    lengths, T = (8, 3), 8
    ids = torch.cat([torch.cat([torch.zeros(1, T - L, dtype=torch.long),
                                token_ids(seed + i, 1, L)], 1) for i, L in enumerate(lengths)])
    mask = (torch.arange(T)[None] >= torch.tensor([T - L for L in lengths])[:, None]).long()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(decode(model, ids, 6, attention_mask=mask), expected)


def test_eos_stops_like_generate(seed):
    model = make("gated_deltanet")
    ids = token_ids(seed, 3, 5)
    free = decode(model, ids, 12)
    # Make a token that row 0 produces mid-way the end of sequence.
    eos = int(free[0, 5 + 3])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              do_sample=False, eos_token_id=eos, pad_token_id=0)
    got = decode(model, ids, 12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, expected)


def test_sampling_is_seeded_and_respects_top_k(seed):
    model = make("gla")
    # Token 0 is the padding id: its embedding is zero, and this GLA (no short conv) then
    # gives all-zero logits, a tie over the whole vocabulary that greedy and top-1
    # sampling break differently. A nonzero row keeps the comparison about top_k.
    with torch.no_grad():
        model.get_input_embeddings().weight[0].normal_(generator=generator(seed))
    ids = token_ids(seed, 2, 4)
    torch.manual_seed(seed)
    a = decode(model, ids, 10, do_sample=True, temperature=0.8, top_k=3)
    torch.manual_seed(seed)
    b = decode(model, ids, 10, do_sample=True, temperature=0.8, top_k=3)
    assert torch.equal(a, b)
    assert ((a >= 0) & (a < V)).all()
    # top_k = 1 is greedy.
    assert torch.equal(decode(model, ids, 6, do_sample=True, top_k=1), decode(model, ids, 6))


def test_argument_checks():
    model = make("gated_deltanet")
    ids = token_ids(0, 1, 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode(model, ids, 0)
    with pytest.raises(ValueError, match="temperature"):
        decode(model, ids, 2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        decode(model, ids, 2, top_k=-1)
    with pytest.raises(ValueError, match="cuda_graph=True needs CUDA"):
        decode(model, ids, 2, cuda_graph=True)
    with pytest.raises(ValueError, match="eval mode"):
        decode(model.train(), ids, 2)
    assert graph_capturable(model)
    assert not graph_capturable(make("gated_deltanet_hybrid"))
    assert not graph_capturable(make("transformer"))
    assert not graph_capturable(make("retnet"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", [n for n in GPU_CONFIGS if n not in ("transformer", "retnet")])
def test_cuda_graph_replays_the_eager_step(name, dtype, seed, monkeypatch):
    """The captured step gives the eager steps' tokens exactly, greedy and sampling from
    the same seed."""
    monkeypatch.delenv("FLA_BACKEND")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = GPU_CONFIGS[name]()
    config.attn = None  # softmax attention layers are decoded eagerly (no graph)
    model = AutoModelForCausalLM.from_config(config).cuda().to(dtype).eval()
    assert graph_capturable(model)
    ids = torch.randint(3, 1000, (3, 40), generator=generator(seed)).cuda()
    eager = decode(model, ids, 24, cuda_graph=False)
    graphed = decode(model, ids, 24, cuda_graph=True)
    # Bitwise: the replay runs the eager step's kernels. (Against generate() the GPU
    # tokens may part after a near-tie: its prefill computes the head on every position,
    # another GEMM shape, and a random model's logits are close; the CPU tests compare
    # with generate().)
    assert torch.equal(graphed, eager)
    torch.manual_seed(seed)
    sampled_eager = decode(model, ids, 16, cuda_graph=False, do_sample=True, top_k=50)
    torch.manual_seed(seed)
    sampled_graph = decode(model, ids, 16, cuda_graph=True, do_sample=True, top_k=50)
    assert torch.equal(sampled_graph, sampled_eager)


@pytest.mark.gpu
def test_hybrid_model_decodes_eagerly_on_cuda(seed, monkeypatch):
    monkeypatch.delenv("FLA_BACKEND")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(GPU_CONFIGS["gated_deltanet"]()).cuda().eval()
    ids = torch.randint(3, 1000, (2, 20), generator=generator(seed)).cuda()
    assert not graph_capturable(model)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              do_sample=False)
    assert torch.equal(decode(model, ids, 8), expected)
    with pytest.raises(ValueError, match="attention"):
        decode(model, ids, 8, cuda_graph=True)
