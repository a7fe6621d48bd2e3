"""Cold start: the first fwd+bwd call of each chunk op at a new shape, from empty caches.

    python -m benchmarks.cold_start [--cases NAME ...] [--out FILE.json]

Each case runs in a fresh process (``benchmarks.run_side --quick``) with an empty Triton
kernel cache and an empty tuning cache (``TRITON_CACHE_DIR``, ``FLA_CACHE_DIR``), so its
first call compiles every kernel it launches: ``cold_s`` is that call's wall clock
(compile included, process start and imports not). The same case then runs again in a
second fresh process over the now-filled caches: ``warm_s`` shows what persists across
processes. Issue 10 asks for cold ≤ 10 s on the H100.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# One case per family of chunk ops, at a shape the family's benchmarks use.
DEFAULT_CASES = (
    "chunk_gated_delta_rule/4x4096x64x128",
    "chunk_delta_rule/4x4096x16x128",
    "chunk_simple_gla/4x4096x64x128",
    "chunk_gla/1x8192x96x128",
    "chunk_rwkv6/4x4096x16x128",
    "chunk_rwkv7/4x4096x32x64",
    "mamba_chunk_scan_combined/4x4096x32x64x128",
)


def first_call(case: str, caches: Path, timeout: float, extra: list[str]) -> dict:
    """One fresh process over ``caches``; the case's record (cold_s and status)."""
    out = caches / "record.json"
    env = dict(os.environ, TRITON_CACHE_DIR=str(caches / "triton"),
               FLA_CACHE_DIR=str(caches / "fla"))
    try:
        subprocess.run([sys.executable, "-m", "benchmarks.run_side", "--label", "ours",
                        "--quick", "--out", str(out), "--cases", case, *extra],
                       env=env, timeout=timeout, check=False, capture_output=True)
        record = json.loads(out.read_text())["cases"][case]
    except (subprocess.TimeoutExpired, FileNotFoundError, json.JSONDecodeError,
            IndexError, KeyError) as exc:
        return {"status": f"failed: {type(exc).__name__}", "cold_s": None}
    finally:
        out.unlink(missing_ok=True)
    return {"status": record.get("status"), "cold_s": record.get("cold_s"),
            "cold_mode": record.get("cold_mode")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES))
    p.add_argument("--out", type=Path, help="write the rows as JSON")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per process")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="more run_side flags (e.g. --tiny --device cpu for a smoke test)")
    args = p.parse_args(argv)
    rows = []
    for case in args.cases:
        with tempfile.TemporaryDirectory(prefix="fla-cold-") as tmp:
            caches = Path(tmp)
            cold = first_call(case, caches, args.timeout, args.extra)
            warm = first_call(case, caches, args.timeout, args.extra)
        row = {"case": case, "status": cold["status"], "cold_s": cold["cold_s"],
               "cold_mode": cold.get("cold_mode"), "warm_s": warm["cold_s"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print("\n| case | first fwd+bwd, empty caches (s) | again, new process (s) |")
    print("| --- | --- | --- |")
    for r in rows:
        fmt = (lambda v: "-" if v is None else f"{v:.2f}")
        print(f"| {r['case']} | {fmt(r['cold_s'])} | {fmt(r['warm_s'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
