"""``python -m fla bench``: time one op over sequence lengths; a table (ms, TFLOP/s, GB/s,
ratio to the reference library) and a PNG of time against T.

The cases, their inputs and their work counts (FLOPs, bytes) come from the harness in
``benchmarks/`` (:mod:`benchmarks.cases`, timed by :mod:`benchmarks.run_side`'s
CaseRunner with ``triton.testing.do_bench``): ``bench`` takes the op's registered case
and varies T. The reference library (flash-linear-attention) is timed in its own process,
where it is the ``fla`` on the path, when ``--reference DIR`` (or ``FLA_REFERENCE``)
names a directory holding its installed package or its wheels; ``<repo>/.ref`` with
wheels is used when present.

Without CUDA there is nothing to time (the kernels are GPU code): ``bench`` says so and
runs a smoke version on the CPU (tiny shapes through the PyTorch path) that checks the
machinery, not the speed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fla.cli import CLIError, choose_device

DEFAULT_T = (1024, 2048, 4096, 8192, 16384)
SMOKE_T = (64, 128, 256)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="benchmark an op over sequence lengths",
                       description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--op", default="chunk_gated_delta_rule",
                   help="an op of benchmarks/cases.py (see --list)")
    p.add_argument("--T", "--seq-lens", dest="T", type=int, nargs="+", default=None,
                   help=f"sequence lengths (default {' '.join(map(str, DEFAULT_T))}; "
                        f"{' '.join(map(str, SMOKE_T))} in the CPU smoke run)")
    p.add_argument("--batch", type=int, default=None, help="B (default: the case's)")
    p.add_argument("--heads", type=int, default=None, help="H (default: the case's)")
    p.add_argument("--head-dim", type=int, default=None, help="D (default: the case's)")
    p.add_argument("--reference", default=None,
                   help="directory with the reference library installed (or its wheels); "
                        "default $FLA_REFERENCE, else <repo>/.ref when it holds wheels")
    p.add_argument("--no-reference", action="store_true", help="time ours only")
    p.add_argument("--out", default="runs/bench", help="where the JSON and PNG go")
    p.add_argument("--full", action="store_true", help="longer do_bench (200 ms per point)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--list", action="store_true", help="list the ops that can be benchmarked")
    return p


def _harness_root() -> Path:
    """The repository root holding ``benchmarks/`` (put on sys.path)."""
    import fla
    for root in (Path(fla.__file__).resolve().parent.parent, Path.cwd()):
        if (root / "benchmarks" / "cases.py").is_file():
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
            return root
    raise CLIError("the benchmark harness (benchmarks/ of the fla repository) was not "
                   "found next to the fla package or in the current directory: run bench "
                   "from a checkout of the repository")


def _reference_site(arg: str | None, root: Path, tmp: Path) -> Path | None:
    """A directory whose ``fla`` package is the reference library, or None."""
    path = arg or os.environ.get("FLA_REFERENCE")
    if path is None:
        if not list((root / ".ref").glob("*.whl")):
            return None
        path = str(root / ".ref")
    p = Path(path)
    if not p.is_dir():
        raise CLIError(f"--reference {path!r}: no such directory")
    if (p / "fla" / "__init__.py").is_file():
        return p
    wheels = sorted(p.glob("*.whl"))
    if not wheels:
        raise CLIError(f"--reference {path!r}: holds neither an installed 'fla' package "
                       f"nor wheels (*.whl)")
    site = tmp / "ref-site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--target", str(site), *map(str, wheels)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise CLIError(f"--reference {path!r}: pip could not install its wheels: "
                       f"{done.stderr.strip()[-500:]}")
    return site


def _shapes(template, args, Ts) -> list[tuple]:
    dims = template.dims.split(",")
    if "T" not in dims:
        raise CLIError(f"--op {template.op}: its cases have no sequence length "
                       f"(dims {template.dims}); pick an op with T")
    shapes = []
    override = {"B": args.batch, "H": args.heads, "D": args.head_dim}
    base = template.tiny().shape if args.smoke else template.shape
    for T in Ts:
        shape = []
        for letter, size in zip(dims, base):
            shape.append(T if letter == "T" else (override.get(letter) or size))
        shapes.append(tuple(shape))
    return shapes


def _run_reference(spec: dict, root: Path, site: Path, tmp: Path) -> dict | None:
    """Time the reference in a process where its ``fla`` is the one imported."""
    harness = tmp / "harness"
    shutil.copytree(root / "benchmarks", harness / "benchmarks",
                    ignore=shutil.ignore_patterns("*.tgz", "__pycache__"))
    shutil.copy(Path(__file__).with_name("_bench_driver.py"), harness / "driver.py")
    spec_path, out_path = tmp / "spec.json", tmp / "reference.json"
    spec_path.write_text(json.dumps({**spec, "label": "reference"}))
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{harness}")
    print(f"timing the reference library from {site} (its own process) ...", flush=True)
    done = subprocess.run([sys.executable, str(harness / "driver.py"), str(spec_path),
                           str(out_path)], cwd=harness, env=env)
    if done.returncode != 0 or not out_path.is_file():
        print(f"reference: its process failed (exit {done.returncode}): no ratios",
              file=sys.stderr)
        return None
    return json.loads(out_path.read_text())


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def run(args) -> int:
    device = choose_device(args.device)
    root = _harness_root()
    from benchmarks import cases as registry
    from benchmarks.compare import rates

    ops = sorted({c.op for c in registry.CASES if not c.baseline and "T" in c.dims.split(",")})
    if args.list:
        print("\n".join(ops))
        return 0
    if args.op not in ops:
        raise CLIError(f"--op {args.op!r}: unknown; one of {', '.join(ops)}")
    for name in ("batch", "heads", "head_dim"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise CLIError(f"--{name.replace('_', '-')}: expected a positive integer, got {v}")
    args.smoke = device != "cuda"
    if args.smoke:
        print("bench: no CUDA device here, and the numbers bench reports are GPU kernel "
              "timings. Running a CPU smoke version instead (tiny shapes, PyTorch path, "
              "no reference): it checks the machinery, its times mean nothing. Run "
              "`python -m fla bench` on a GPU machine for the real table.\n", flush=True)
    Ts = args.T or (SMOKE_T if args.smoke else DEFAULT_T)
    if any(t < 1 for t in Ts):
        raise CLIError(f"--T: expected positive lengths, got {Ts}")
    template = next(c for c in registry.CASES if c.op == args.op and not c.baseline)
    shapes = _shapes(template, args, Ts)
    spec = {"op": args.op, "shapes": [list(s) for s in shapes], "device": device,
            "quick": not args.full, "label": "ours"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from fla.cli._bench_driver import measure
    print(f"{args.op}: {template.dims} = " + ", ".join("x".join(map(str, s)) for s in shapes),
          flush=True)
    ours = measure(spec, log=lambda msg: print(f"[fla] {msg}", flush=True))
    ref = None
    with tempfile.TemporaryDirectory(prefix="fla-bench-") as tmp:
        site = None if (args.no_reference or args.smoke) else \
            _reference_site(args.reference, root, Path(tmp))
        if site is not None:
            ref = _run_reference(spec, root, site, Path(tmp))

    rows = []
    for shape in shapes:
        name = f"{args.op}/{'x'.join(map(str, shape))}"
        T = shape[template.dims.split(",").index("T")]
        o = ours["cases"].get(name, {})
        r = (ref or {}).get("cases", {}).get(name, {})
        for mode in template.modes:
            om, rm = o.get("modes", {}).get(mode, {}), r.get("modes", {}).get(mode, {})
            rate = rates(om.get("ms"), om.get("work"), ours.get("copy_gbps"))
            rows.append({"T": T, "shape": list(shape), "mode": mode, "ours_ms": om.get("ms"),
                         "ours_status": om.get("status", o.get("status")),
                         "ours_error": om.get("error") or o.get("error"),
                         "tflops": rate.get("tflops"), "gbps": rate.get("gbps"),
                         "ref_ms": rm.get("ms"),
                         "ratio": (om["ms"] / rm["ms"]) if om.get("ms") and rm.get("ms")
                         else None})
    header = (f"{'T':>7} {'mode':7} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>8}"
              + (f" {'ref ms':>9} {'ratio':>6}" if ref else ""))
    print(f"\n{args.op} ({template.dims} = {'x'.join(map(str, shapes[0]))} at the first T), "
          f"{device}" + ("" if ref else "; no reference measured") + ":")
    print(header)
    print("-" * len(header))
    for row in rows:
        ms = _fmt(row["ours_ms"], ".3f", row["ours_status"] or "-")
        line = (f"{row['T']:>7} {row['mode']:7} {ms:>9} {_fmt(row['tflops'], '.1f'):>8} "
                f"{_fmt(row['gbps'], '.0f'):>8}")
        if ref:
            line += f" {_fmt(row['ref_ms'], '.3f'):>9} {_fmt(row['ratio'], '.2f'):>6}"
        print(line)
    if ref:
        print("ratio = ours / reference (below 1: ours is faster)")
    failed = [r for r in rows if r["ours_ms"] is None]
    for r in failed[:3]:
        print(f"T={r['T']} {r['mode']}: {r['ours_status']}: {(r['ours_error'] or '')[:300]}")
    (out / f"bench_{args.op}.json").write_text(json.dumps(
        {"op": args.op, "device": device, "smoke": args.smoke, "rows": rows,
         "ours": ours, "reference": ref}, indent=1, default=str) + "\n")
    try:
        from fla.cli.plot import bench_curve
        png = bench_curve(rows, out / f"bench_{args.op}.png",
                          title=f"{args.op}, {template.dims} = "
                                f"{'x'.join('T' if d == 'T' else str(s) for d, s in zip(template.dims.split(','), shapes[0]))}"
                                + (" (CPU smoke run)" if args.smoke else ""))
        print(f"\nplot: {png}")
    except ImportError:
        print("note: matplotlib is not installed: no plot")
    print(f"data: {out / f'bench_{args.op}.json'}")
    return 1 if len(failed) == len(rows) else 0
