"""Model-level throughput: training tokens/s and decoding tokens/s (issue 8's figures).

    python -m benchmarks.model_throughput [--model gated_deltanet] [--what train decode]
                                          [--out FILE.json] [--tiny]

Measures whichever ``fla`` is importable (ours from the checkout, or the reference
library in its own process, as ``benchmarks/run_side.py`` does), on the same config:

* ``train``: a ~340M-parameter model (hidden 1024, 20 layers, 4 heads of 256, vocab
  32000) at batch 4 x 4096 tokens: forward, backward and an AdamW step under bf16
  autocast (fp32 master weights); tokens/s from the median of the timed steps.
* ``decode``: 512 new tokens (greedy, cache on) after a 16-token prompt at batch 1 and
  batch 64, bf16 weights; tokens/s = batch x 512 / wall time. ``decode_generate`` is
  transformers' ``generate()``; ``decode_graph`` (ours only) is :func:`fla.models.decode`,
  whose steps replay a CUDA graph.

``--profile`` adds the per-kernel GPU time of one training step (torch.profiler), to
compare where ours and the reference spend a step; ``--host`` where the host's time of a
step goes (cProfile). ``--tiny`` shrinks everything for a CPU smoke test of the script itself.

The reference library refuses its gated backward on Hopper with Triton 3.4-3.7.0; when
the imported ``fla`` is not this checkout's, its check is switched off (as
``benchmarks/run_side.py`` does) so that its training step can be timed, and the row
says so. ``scripts/gpu_models.sh`` runs both sides on the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

CONFIGS = {
    "gated_deltanet": ("GatedDeltaNetConfig", "GatedDeltaNetForCausalLM",
                       dict(hidden_size=1024, num_hidden_layers=20, num_heads=4, head_dim=256,
                            expand_v=1, vocab_size=32000)),
}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, vocab_size=256)


def build(model: str, tiny: bool, device: str):
    import fla.models as models

    config_name, model_name, sizes = CONFIGS[model]
    config = getattr(models, config_name)(**(TINY if tiny else sizes))
    torch.manual_seed(0)
    return getattr(models, model_name)(config).to(device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def training_step(net, device: str, batch: int, length: int):
    """A closure running one training step (forward + backward + AdamW under bf16
    autocast on the GPU) on a fixed random batch; returns the loss."""
    vocab = net.config.vocab_size
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=device == "cuda")
    ids = torch.randint(0, vocab, (batch, length), device=device)

    def step():
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def train_tokens_per_s(net, device: str, batch: int, length: int, steps: int) -> dict:
    step_fn = training_step(net, device, batch, length)
    times = []
    for i in range(steps + 3):
        sync(device)
        t0 = time.perf_counter()
        loss = step_fn()
        sync(device)
        if i >= 3:  # the first steps compile kernels and warm the allocator
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return {"step_s": step, "tokens_per_s": batch * length / step, "loss": float(loss.detach()),
            "peak_mib": peak}


def profile_train_step(net, device: str, batch: int, length: int, top: int = 30) -> dict:
    """Per-kernel GPU time of one training step (torch.profiler over 2 steps after the
    timed ones), kernels grouped by name, longest first; printed as a table."""
    from torch.profiler import ProfilerActivity, profile

    step = training_step(net, device, batch, length)
    step()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        sync(device)
    rows = {}
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", None)
        if cuda_us is None:
            cuda_us = getattr(event, "cuda_time_total", 0)
        if cuda_us and event.key:
            total, count = rows.get(event.key, (0.0, 0))
            rows[event.key] = (total + cuda_us / 2e3, count + event.count / 2)
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][0])
    total_ms = sum(ms for ms, _ in rows.values())
    print(f"kernels of one step: {total_ms:.1f} ms in all")
    print("| ms/step | launches/step | kernel |")
    print("| --- | --- | --- |")
    for name, (ms, count) in ranked[:top]:
        print(f"| {ms:.2f} | {count:g} | {name[:110]} |")
    return {"kernel_ms_per_step": total_ms,
            "top_kernels": [[name[:110], round(ms, 3)] for name, (ms, _) in ranked[:top]]}


def profile_host(net, device: str, batch: int, length: int, steps: int = 3,
                 top: int = 35) -> dict:
    """Where the host's time of a training step goes (cProfile over ``steps`` steps, by
    own time): when the GPU waits for the host, these are what to cut."""
    import cProfile
    import io
    import pstats

    step = training_step(net, device, batch, length)
    step()
    sync(device)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    host = (time.perf_counter() - t0) / steps
    sync(device)
    wall = (time.perf_counter() - t0) / steps
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    print(text.getvalue())
    return {"host_s_per_step_profiled": host, "wall_s_per_step_profiled": wall}


def decode_tokens_per_s(net, device: str, batch: int, new_tokens: int,
                        graph: bool = False) -> dict:
    """``generate()`` (or, with ``graph``, this library's :func:`fla.models.decode`, whose
    steps replay a CUDA graph) of ``new_tokens`` greedy tokens after a 16-token prompt."""
    vocab = net.config.vocab_size
    prompt = torch.randint(0, vocab, (batch, 16), device=device)
    if graph:
        from fla.models import decode

        def run(n):
            return decode(net, prompt, n)
    else:
        def run(n):
            return net.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                use_cache=True, pad_token_id=0,
                                attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        run(8)
        sync(device)
        t0 = time.perf_counter()
        out = run(new_tokens)
        sync(device)
        wall = time.perf_counter() - t0
    generated = out.shape[1] - prompt.shape[1]
    return {"wall_s": wall, "new_tokens": generated,
            "tokens_per_s": batch * generated / wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(CONFIGS), default="gated_deltanet")
    p.add_argument("--what", nargs="+", choices=("train", "decode"),
                   default=["train", "decode"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", help="append one JSON line per measurement")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test of the script")
    p.add_argument("--profile", action="store_true",
                   help="also print the per-kernel GPU time of one training step")
    p.add_argument("--host", action="store_true",
                   help="also print where the host's time of a training step goes")
    p.add_argument("--backward-one-thread", action="store_true",
                   help="run autograd's backward on the calling thread "
                        "(torch.autograd.set_multithreading_enabled(False))")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    import pathlib

    import fla

    label = getattr(fla, "__version__", "?")
    notes = []
    checkout = pathlib.Path(__file__).resolve().parent.parent
    ours = pathlib.Path(fla.__file__).resolve().parent.parent == checkout
    if not ours:
        from benchmarks.run_side import patch_reference_check
        patch_reference_check(notes)
    if args.backward_one_thread:
        torch.autograd.set_multithreading_enabled(False)
        notes.append("backward on the calling thread")
    net = build(args.model, args.tiny, device)
    params = sum(t.numel() for t in net.parameters())

    def measure(row: dict, fn, *fn_args) -> None:
        """One row, printed (and appended to --out) at once; an error becomes the row's
        result instead of ending the run."""
        try:
            row.update(fn(*fn_args))
        except Exception as exc:  # noqa: BLE001 - reported, and the next row still runs
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        row.update(model=args.model, params=params, fla=label, notes=notes, device=device,
                   gpu=torch.cuda.get_device_name(0) if device == "cuda" else None,
                   torch=torch.__version__)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as handle:
                handle.write(json.dumps(row) + "\n")

    if "train" in args.what:
        batch, length = (2, 64) if args.tiny else (4, 4096)
        measure({"what": "train", "batch": batch, "length": length}, train_tokens_per_s,
                net, device, batch, length, 2 if args.tiny else args.steps)
        if args.profile and device == "cuda":
            measure({"what": "train_profile", "batch": batch, "length": length},
                    profile_train_step, net, device, batch, length)
        if args.host and device == "cuda":
            measure({"what": "train_host", "batch": batch, "length": length},
                    profile_host, net, device, batch, length)
    if "decode" in args.what:
        # Decoding with bf16 weights (no autocast: the usual way to serve a model, and the
        # captured step would otherwise re-cast every weight at each token).
        net = net.to(torch.bfloat16 if device == "cuda" else torch.float32).eval()
        for batch in ((1, 2) if args.tiny else (1, 64)):
            for graph in ((False, True) if ours else (False,)):
                measure({"what": "decode_graph" if graph else "decode_generate",
                         "batch": batch}, decode_tokens_per_s, net, device, batch,
                        8 if args.tiny else 512, graph)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
