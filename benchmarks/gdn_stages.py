"""Per-kernel timings of ``chunk_gated_delta_rule`` (or, with ``--family simple_gla``,
``chunk_simple_gla``) on the GPU (ours only), for kernel work.

    python -m benchmarks.gdn_stages [--shapes 1x8192x96x128 ...] [--family simple_gla]
                                    [--sweep [--only NAME]] [--quick] [--json FILE]

For each shape (B, T, H, D; K = V = D; bf16 inputs, fp32 gates) prints the median
``do_bench`` time of the whole op (fwd, fwd+bwd) and of each kernel of the forward and
the backward, called as the op calls them, next to the bytes each must move at least
and the rate that implies. The side-by-side comparison with the reference library is
``benchmarks/run_side.py``; this script explains where our time goes.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = ["1x8192x96x128", "2x16384x16x128", "4x2048x16x128", "4x4096x64x128", "8x1024x8x64",
          "8x2048x32x256", "1x65536x8x128"]


def bench(fn, quick: bool) -> float:
    import triton.testing
    warm, rep = (10, 40) if quick else (25, 100)
    return float(triton.testing.do_bench(fn, warmup=warm, rep=rep, return_mode="median"))


def make(shape: str, device="cuda"):
    B, T, H, D = (int(x) for x in shape.split("x"))
    gen = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16

    def rnd(*s, dtype=bf):
        return torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = rnd(B, T, H, D)
    k = F.normalize(rnd(B, T, H, D).float(), dim=-1).to(bf)
    v = rnd(B, T, H, D)
    g = F.logsigmoid(rnd(B, T, H, dtype=torch.float32)) / 16
    beta = torch.rand(B, T, H, generator=gen, device=device).to(bf)
    return dict(q=q, k=k, v=v, g=g, beta=beta, B=B, T=T, H=H, D=D)


class Stages:
    """Times each call: the first (compile included) as ``cold``, then ``do_bench``."""

    def __init__(self, quick: bool):
        self.quick, self.warm, self.cold = quick, {}, {}

    def __call__(self, name, fn):
        import time
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        self.cold[name] = time.perf_counter() - t0
        self.warm[name] = bench(fn, self.quick)
        return out


def stage_times(x, quick: bool) -> tuple[dict, dict]:
    from fla.ops.common.chunk_delta_h_bwd import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.common.chunk_o_bwd import chunk_bwd_dqkwg
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.common.chunk_fwd_inter import chunk_gated_delta_rule_fwd_inter, state_buffers
    from fla.ops.common.chunk_fwd_intra import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
    from fla.ops.gated_delta_rule.wy_fast_bwd import prepare_wy_repr_bwd

    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    scale = x["D"] ** -0.5
    do = torch.randn_like(v)
    st = Stages(quick)
    with torch.no_grad():
        g_cum, Ai, Aqk = st("fwd intra", lambda: chunk_gated_delta_rule_fwd_intra(q, k, g, beta))
        st("fwd inter", lambda: chunk_gated_delta_rule_fwd_inter(q, k, v, g_cum, beta, Ai, Aqk,
                                                                 scale))
        h, v_new = state_buffers(k, v, None, False)
        st("bwd states (h, Vn)", lambda: chunk_gated_delta_rule_fwd_inter(
            None, k, v, g_cum, beta, Ai, None, scale, states_out=(h, v_new)))
        w, _ = st("bwd recompute w", lambda: recompute_w_u_fwd(k, v, beta, Ai, g_cum,
                                                               with_u=False))
        dh, dh0, dv2 = st("bwd dhu (dv_local from Aqk)",
                          lambda: chunk_gated_delta_rule_bwd_dhu(q, k, w, g_cum, None, None,
                                                                 do, None, scale, Aqk=Aqk))
        dq, dk, dw, dg = st("bwd dqkwg", lambda: chunk_bwd_dqkwg(q, k, v_new, w, g_cum, h, dv2,
                                                                 do, dh, scale))
        st("bwd wy", lambda: prepare_wy_repr_bwd(k, v, beta, Ai, dw, dv2, g_cum))
    leaves = [t_.requires_grad_() for t_ in (q, k, v, g, beta)]

    def fwd():
        with torch.no_grad():
            chunk_gated_delta_rule(q, k, v, g, beta)

    def fwdbwd():
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
        o.backward(do)
        for leaf in leaves:
            leaf.grad = None

    st("op fwd", fwd)
    st("op fwd+bwd", fwdbwd)
    return st.warm, st.cold


def simple_gla_stage_times(x, quick: bool) -> tuple[dict, dict]:
    """The kernels of chunk_simple_gla, the op with its scores formed in the forward pass
    (the default up to K = 128; kept for the backward) and with them stored by the intra
    kernel (``SCORES_IN_PASS_MAX_K = 0``), and the staged forward (state pass storing h, then
    the parallel output stage) it could use instead of the fused one."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_delta_h_bwd import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.common.chunk_fwd_inter import (
        MAX_K_FORMING_SCORES,
        chunk_gated_delta_rule_fwd_inter,
    )
    from fla.ops.common.chunk_fwd_intra import chunk_gated_delta_rule_fwd_intra
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.common.chunk_o_bwd import chunk_bwd_dqkwg
    from fla.ops.simple_gla import chunk_simple_gla
    from fla.ops.simple_gla import chunk as simple_gla_chunk
    from fla.ops.utils.cumsum import chunk_local_cumsum

    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    scale = x["D"] ** -0.5
    do = torch.randn_like(v)
    st = Stages(quick)
    with torch.no_grad():
        g_cum, _, Aqk = st("fwd intra", lambda: chunk_gated_delta_rule_fwd_intra(
            q, k, g, None, delta=False))
        st("fwd inter (stored Aqk)", lambda: chunk_gated_delta_rule_fwd_inter(
            q, k, v, g_cum, None, None, Aqk, scale))
        st("fwd cumsum", lambda: chunk_local_cumsum(g, 64))
        if k.shape[-1] <= MAX_K_FORMING_SCORES:
            st("fwd inter (scores in pass)", lambda: chunk_gated_delta_rule_fwd_inter(
                q, k, v, g_cum, None, None, None, scale))
            scores = torch.empty_like(Aqk)
            st("fwd inter (scores in pass, kept)", lambda: chunk_gated_delta_rule_fwd_inter(
                q, k, v, g_cum, None, None, None, scale, scores_out=scores))
        h, _, _ = st("staged fwd_h", lambda: chunk_gated_delta_rule_fwd_h(
            k, None, v, g_cum, save_new_value=False))
        st("staged fwd_o", lambda: chunk_fwd_o(q, k, v, h, g_cum, scale))
        dh, _, dv2 = st("bwd dhu (dv_local from stored Aqk)",
                        lambda: chunk_gated_delta_rule_bwd_dhu(q, k, None, g_cum, None, None,
                                                               do, None, scale, Aqk=Aqk))
        st("bwd dqkwg", lambda: chunk_bwd_dqkwg(q, k, v, None, g_cum, h, dv2, do, dh, scale))
    leaves = [t_.requires_grad_() for t_ in (q, k, v, g)]

    def fwd():
        with torch.no_grad():
            chunk_simple_gla(q, k, v, g)

    def fwdbwd():
        o, _ = chunk_simple_gla(q, k, v, g)
        o.backward(do)
        for leaf in leaves:
            leaf.grad = None

    default = simple_gla_chunk.SCORES_IN_PASS_MAX_K
    for label, max_k in (("scores in pass", default), ("stored Aqk", 0)):
        simple_gla_chunk.SCORES_IN_PASS_MAX_K = max_k
        try:
            st(f"op fwd ({label})", fwd)
            st(f"op fwd+bwd ({label})", fwdbwd)
            torch.cuda.reset_peak_memory_stats()
            fwdbwd()
            st.warm[f"op fwd+bwd peak GiB ({label})"] = torch.cuda.max_memory_allocated() / 2 ** 30
        finally:
            simple_gla_chunk.SCORES_IN_PASS_MAX_K = default
    return st.warm, st.cold


def sweep(x, quick: bool, only: str = "", delta: bool = True) -> dict:
    """Median time of every config in the tuning space of the fused forward's kernels."""
    from fla.ops.simple_gla import chunk as simple_gla_chunk
    from fla.ops.common.chunk_fwd_inter import (
        chunk_gated_delta_rule_fwd_inter, chunk_gated_delta_rule_fwd_inter_kernel)
    from fla.ops.common.chunk_fwd_intra import (
        chunk_fwd_scores_kernel, chunk_gated_delta_rule_fwd_intra,
        chunk_gated_delta_rule_fwd_intra_kernel)

    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    beta = x["beta"] if delta else None
    scale = x["D"] ** -0.5
    out = {}
    with torch.no_grad():
        g_cum, Ai, Aqk = chunk_gated_delta_rule_fwd_intra(q, k, g, beta, delta=delta)
        if not delta and k.shape[-1] <= simple_gla_chunk.SCORES_IN_PASS_MAX_K:
            Aqk = None  # simple GLA's pass forms its scores itself there
        intra = (lambda: chunk_gated_delta_rule_fwd_intra(q, k, g, beta, delta=delta))
        # Without the delta (simple GLA) only the scores kernel runs.
        wy = ((chunk_gated_delta_rule_fwd_intra_kernel, intra),) if delta else ()
        for kernel, call in (
                (chunk_fwd_scores_kernel, intra), *wy,
                (chunk_gated_delta_rule_fwd_inter_kernel,
                 lambda: chunk_gated_delta_rule_fwd_inter(q, k, v, g_cum, beta, Ai, Aqk, scale,
                                                          segment_chunks=0))):
            if only not in kernel.name:
                continue
            seen = {}
            original = kernel.launch

            def record(grid, args, kwargs, seen=seen, original=original):
                seen.setdefault("kw", dict(kwargs))
                return original(grid, args, kwargs)

            kernel.launch = record
            call()
            kernel.launch = original
            configs = kernel.candidates(seen["kw"])
            if kernel is chunk_gated_delta_rule_fwd_intra_kernel:
                # The WY kernel takes seconds to compile: its warps and register cap are
                # what matters here.
                configs = [c for c in configs if c.num_stages == 2 and c.meta["BK"] == 64]
            for config in configs:
                def forced(grid, args, kwargs, config=config):
                    launch = {**kwargs, **config.launch_kwargs()}
                    return kernel.kernel[grid(launch) if callable(grid) else grid](**launch)
                kernel.launch = forced
                try:
                    out[f"{_short(kernel.name)} {config}"] = bench(call, quick)
                except Exception as exc:  # noqa: BLE001
                    out[f"{_short(kernel.name)} {config}"] = float("nan")
                    print(f"   {config}: {type(exc).__name__}: {str(exc)[:200]}")
                finally:
                    kernel.launch = original
        for chunks in (0, 8, 16, 32, 48, 64, 96, 128):
            out[f"inter, default config, segments of {chunks} chunks"] = bench(
                lambda: chunk_gated_delta_rule_fwd_inter(q, k, v, g_cum, beta, Ai, Aqk, scale,
                                                         segment_chunks=chunks), quick)
    return out


def _short(kernel_name: str) -> str:
    return kernel_name.split(".")[-1].replace("chunk_gated_delta_rule_", "")


def floor_ms(x) -> dict:
    """Compulsory bytes (q, k, v read, o written; bf16) at the measured copy rate."""
    B, T, H, D = x["B"], x["T"], x["H"], x["D"]
    tensor = B * T * H * D * 2
    return {"fwd bytes": 4 * tensor, "fwdbwd bytes": 4 * tensor + 4 * tensor + 3 * tensor}


def copy_bandwidth_gbps() -> float:
    """A 1 GiB device-to-device copy, bytes read + written per second (GB/s)."""
    src = torch.empty(1 << 28, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / bench(lambda: dst.copy_(src), True) / 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=SHAPES)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true",
                   help="time every config of the fused forward's kernels instead")
    p.add_argument("--only", default="", help="with --sweep: kernels whose name has this")
    p.add_argument("--family", default="gated_delta_rule",
                   choices=["gated_delta_rule", "simple_gla"])
    args = p.parse_args(argv)
    delta = args.family == "gated_delta_rule"
    copy_gbps = copy_bandwidth_gbps()
    print(f"device {torch.cuda.get_device_name(0)} | torch {torch.__version__} | copy "
          f"{copy_gbps:.0f} GB/s", flush=True)
    results = {}
    for shape in args.shapes:
        x = make(shape)
        if args.sweep:
            times = sweep(x, args.quick, args.only, delta)
            results[shape] = times
            print(f"== {shape} sweep:", flush=True)
            for name, ms in times.items():
                print(f"   {ms:8.4f}  {name}", flush=True)
            continue
        try:
            t, cold = (stage_times if delta else simple_gla_stage_times)(x, args.quick)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{shape}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            continue
        floors = floor_ms(x)
        t["fwd floor"] = floors["fwd bytes"] / copy_gbps / 1e6
        results[shape] = t
        print(f"== {shape}: " + ", ".join(f"{n} {v:.3f}" for n, v in t.items()), flush=True)
        print("   first call, s: " + ", ".join(f"{n} {v:.2f}" for n, v in cold.items()),
              flush=True)
        del x
        torch.cuda.empty_cache()
    if args.sweep:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"copy_gbps": copy_gbps, "sweep": results}, f, indent=1)
        return 0
    names = list(dict.fromkeys(n for times in results.values() for n in times))
    print("\n| ms | " + " | ".join(results) + " |")
    print("| --- |" + " --- |" * len(results))
    for n in names:
        cells = (f"{results[s][n]:.3f}" if n in results[s] else "" for s in results)
        print(f"| {n} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
