"""Simple GLA's forward pass unsplit and as lead splits of several lengths, on the GPU
(ours only), next to the launch model's pick: the data behind
``fla.ops.common.chunk_segments``' lead-split model.

    python -m benchmarks.lead_split [--shapes 1x8192x96x128 ...] [--leads 16 24 32 40 48]

For each shape (B, T, H, D; K = V = D; bf16 inputs, fp32 log decays as in the benchmark
cases) prints the median ``do_bench`` time of the pass (no scores kept, no final state)
unsplit and cut after each lead length, the lead split's relative error against the
unsplit output, and the model's chosen length and time relative to unsplit.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def main(argv=None) -> None:
    import triton.testing

    from fla.ops.common import chunk_segments
    from fla.ops.common.chunk_fwd_inter import (_pass_tiles, chunk_gated_delta_rule_fwd_inter,
                                                default_lead_chunks)
    from fla.ops.utils.cumsum import chunk_local_cumsum_fwd

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["1x8192x96x128", "1x8192x80x128"])
    p.add_argument("--leads", nargs="+", type=int, default=[16, 24, 32, 40, 48])
    args = p.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        B, T, H, D = (int(x) for x in shape.split("x"))
        q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=gen,
                               dtype=torch.bfloat16) for _ in range(3))
        g = F.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen))
        g_cum = chunk_local_cumsum_fwd(g, 64)

        def run(lead):
            return chunk_gated_delta_rule_fwd_inter(q, k, v, g_cum, None, None, None,
                                                    D ** -0.5, segment_chunks=0,
                                                    lead_chunks=lead)[0]

        whole = run(0)
        unsplit = triton.testing.do_bench(lambda: run(0), warmup=25, rep=150,
                                          return_mode="median")
        print(f"{shape}: unsplit {unsplit:.3f} ms", flush=True)
        for lead in args.leads:
            err = ((run(lead).float() - whole.float()).norm() / whole.float().norm()).item()
            ms = triton.testing.do_bench(lambda: run(lead), warmup=25, rep=150,
                                         return_mode="median")
            print(f"  lead {lead:3d}: {ms:.3f} ms ({ms / unsplit:.3f}x), rel err {err:.1e}",
                  flush=True)
        chosen = default_lead_chunks(None, B, T, H, D, D, True)
        chunks = [-(-T // 64)] * B
        tiles = _pass_tiles(D, D, False, True)
        model = (chunk_segments.lead_split_time(chosen, chunks, H, *tiles,
                                                chunk_segments.program_slots())
                 / max(chunks) if chosen else 1.0)
        print(f"  the model picks {chosen or 'no split'} ({model:.3f}x of unsplit)",
              flush=True)


if __name__ == "__main__":
    main()
