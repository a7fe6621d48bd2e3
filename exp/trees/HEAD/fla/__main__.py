"""Command line: ``python -m fla demo | train | generate | bench`` (also the ``fla`` script).

``demo`` runs the Gated DeltaNet recurrence on fresh random inputs (two packed sequences
of uneven length, each with its own initial state) through every implementation this
machine can run, forward and backward, and prints their relative errors against the
float64 reference loop. Without a GPU it sets ``TRITON_INTERPRET=1`` first, so the Triton
kernels themselves run (interpreted) on the CPU.

``train``, ``generate`` and ``bench`` live in :mod:`fla.cli` (one module each): train a
small model on the bundled corpus (one process or ``torchrun``, FSDP2), stream text from
its checkpoint, and time an op over sequence lengths. Usage errors exit with code 2 and
an argparse-style message, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _demo(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        # Must precede the first import of a kernel module: triton.jit reads it then.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from fla.ops.gated_delta_rule import (
        chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule,
        naive_recurrent_gated_delta_rule,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    H, K, V = args.heads, args.dim, args.dim
    lengths = [args.length // 3 + 1, args.length - args.length // 3 - 1]
    T = sum(lengths)
    cu_seqlens = torch.tensor([0, lengths[0], T], device=device)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rand(1, T, H, K)
    k = torch.nn.functional.normalize(rand(1, T, H, K), dim=-1)
    v = rand(1, T, H, V)
    g = torch.nn.functional.logsigmoid(rand(1, T, H)) * 0.5
    beta = torch.sigmoid(rand(1, T, H))
    h0 = rand(2, H, K, V) * 0.1
    do, dht = rand(1, T, H, V), rand(2, H, K, V)
    inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}

    def run(fn, dtype, dev, **extra):
        leaves = {n: x.to(dev, dtype if n != "initial_state" else torch.float32)
                  .detach().requires_grad_() for n, x in inputs.items()}
        start = time.perf_counter()
        o, ht = fn(**leaves, output_final_state=True, cu_seqlens=cu_seqlens.to(dev), **extra)
        (o.double() * do.to(dev)).sum().add_((ht.double() * dht.to(dev)).sum()).backward()
        elapsed = time.perf_counter() - start
        return o, ht, {n: x.grad for n, x in leaves.items()}, elapsed

    o_ref, ht_ref, grads_ref, t_ref = run(naive_recurrent_gated_delta_rule, torch.float64, "cpu")

    def rel(a, b):
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        return ((a - b).norm() / b.norm()).item()

    kernel_where = "GPU" if device == "cuda" else "CPU, interpreted"
    rows = [("float64 reference loop", "float64", o_ref, ht_ref, grads_ref, t_ref)]
    for label, fn, dev, env in (
        (f"chunk, Triton ({kernel_where})", chunk_gated_delta_rule, device, None),
        (f"fused_recurrent, Triton ({kernel_where})", fused_recurrent_gated_delta_rule,
         device, None),
        ("chunk, PyTorch path (CPU)", chunk_gated_delta_rule, "cpu", "torch"),
    ):
        previous = os.environ.get("FLA_BACKEND")
        if env:
            os.environ["FLA_BACKEND"] = env
        try:
            o, ht, grads, elapsed = run(fn, torch.float32, dev)
        finally:
            if env:
                os.environ.pop("FLA_BACKEND") if previous is None else os.environ.update(
                    FLA_BACKEND=previous)
        rows.append((label, "float32", o, ht, grads, elapsed))

    print(f"Gated delta rule, 2 packed sequences of {lengths} tokens, H={H}, K=V={K}; "
          f"relative error against the float64 loop (fwd + bwd):")
    header = f"{'implementation':44} {'dtype':8} {'o':>9} {'state':>9} {'worst grad':>11} {'time s':>8}"
    print(header)
    print("-" * len(header))
    worst_all = 0.0
    for label, dtype, o, ht, grads, elapsed in rows:
        errs = [rel(o, o_ref), rel(ht, ht_ref)]
        worst = max(rel(grads[n], grads_ref[n]) for n in grads)
        if dtype != "float64":
            worst_all = max(worst_all, *errs, worst)
        print(f"{label:44} {dtype:8} {errs[0]:9.1e} {errs[1]:9.1e} {worst:11.1e} {elapsed:8.2f}")
    ok = worst_all <= 1e-4
    print(f"\n{'OK' if ok else 'MISMATCH'}: worst relative error {worst_all:.1e} "
          f"(bound 1e-4 in float32)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    from fla.cli import CLIError, bench, generate, train

    prog = "fla" if os.path.basename(sys.argv[0] or "") == "fla" else "python -m fla"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="run the gated delta rule every way and compare")
    demo.add_argument("--length", type=int, default=150, help="total tokens of the two sequences")
    demo.add_argument("--heads", type=int, default=2)
    demo.add_argument("--dim", type=int, default=32, help="head width K = V")
    demo.add_argument("--seed", type=int, default=None, help="fixed seed (default: fresh)")
    demo.set_defaults(func=_demo)
    parsers = {"demo": demo}
    for module in (train, generate, bench):
        p = module.add_parser(sub)
        p.set_defaults(func=module.run)
        parsers[p.prog.split()[-1]] = p
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["demo", *argv]      # the demo is the default command
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CLIError as exc:
        # argparse's own format (without the long usage block of train): exit code 2.
        print(f"{parsers[args.command].prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
