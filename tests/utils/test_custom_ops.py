"""fla.utils.custom_ops.outside_graph: a graph break under torch.compile, a plain call in
eager mode, and no import of torch._dynamo by eager code (it cost the first call of a
lazily loaded op 1-4 s on the GPU host); needs_backward."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from fla.utils.custom_ops import outside_graph

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _offsets(cu: torch.Tensor) -> tuple[int, ...]:
    return tuple(cu.tolist())


def test_eager_call_is_the_plain_call():
    wrapped = outside_graph(_offsets)
    assert wrapped(torch.tensor([0, 3, 7])) == (0, 3, 7)
    assert wrapped.__name__ == "_offsets"


def test_compiled_caller_runs_it_eagerly_and_reads_new_values():
    """Under torch.compile the wrapped host function runs eagerly (a graph break before
    it, as with torch.compiler.disable): it never sees a tracing context, and new
    offsets give new results without a new graph per value."""
    import torch._dynamo  # noqa: F401  (loaded as compile would load it)

    compiling = []

    def offsets(cu):
        compiling.append(torch.compiler.is_compiling())
        return tuple(cu.tolist())

    host = outside_graph(offsets)
    graphs = []

    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        return gm

    def f(x, cu):
        o = host(cu)
        return x * len(o) + o[-1]

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=count_graphs)
    x = torch.randn(5, generator=torch.Generator().manual_seed(0))
    for cu in ([0, 2, 4], [0, 1, 4], [0, 3, 4], [0, 1, 2, 4], [0, 1, 3, 4]):
        cu = torch.tensor(cu)
        assert torch.equal(compiled(x, cu), f(x, cu))
    assert compiling and not any(compiling), compiling
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} graphs for 5 offset values"


def test_eager_varlen_ops_never_import_dynamo():
    """A packed-sequence call of the ops that read offsets on the host (the chunk cumsum,
    the short convolution, a chunk op) runs without loading torch._dynamo."""
    script = textwrap.dedent("""
        import sys, torch
        from fla.modules import ShortConvolution
        from fla.ops.simple_gla import chunk_simple_gla
        from fla.ops.utils import chunk_local_cumsum
        gen = torch.Generator().manual_seed(0)
        cu = torch.tensor([0, 5, 17, 30])
        g = -torch.rand(1, 30, 2, generator=gen)
        chunk_local_cumsum(g, chunk_size=16, cu_seqlens=cu)
        conv = ShortConvolution(8, 4)
        conv(torch.randn(1, 30, 8, generator=gen), cu_seqlens=cu)
        q, k, v = (torch.randn(1, 30, 2, 16, generator=gen) for _ in range(3))
        chunk_simple_gla(q, k, v, g, cu_seqlens=cu)
        assert "torch._dynamo" not in sys.modules, "eager code imported torch._dynamo"
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=_REPO)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=280)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_needs_backward():
    """A differentiated call: grad mode on and some tensor requiring grad (None skipped)."""
    from fla.utils.custom_ops import needs_backward
    x, w = torch.ones(2), torch.ones(2, requires_grad=True)
    assert needs_backward(x, None, w)
    assert not needs_backward(x, None)
    assert not needs_backward()
    with torch.no_grad():
        assert not needs_backward(x, w)
