"""Offline sm_90 builds (no GPU needed). The fused forward pass is held to the two
properties its speed on H100 rests on (benchmarks/NOTES.md, 2026-11-26):

* two programs fit an SM: at 4 warps the registers allow two, so the pass's shared
  memory must stay under half an SM's (the delta rule's pass at K = 128 went from 0.72 to
  1.28 ms when pipelined copies of one more operand took it from 99 to 131 KB);
* its 64 x 64 tiles load as vectors: a mask that cuts a tile's contiguous dimension
  makes Triton load it element by element, synchronously (the per-token β of the delta
  rule, a [T, H] tensor, is the only 16-bit scalar load it may keep).

The DPLR kernels' defaults must fit an SM at every head width they serve (one default
once asked for 256 KB of shared memory at K = 256).

Runs ``scripts/compile_check.py --resources`` in a subprocess: the tests' process runs
Triton in the interpreter, which cannot build for a GPU target.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# compile_check labels a build "<kernel> [<tuning key's values>] Config(...)".
LINE = re.compile(r"^ok .*chunk_gated_delta_rule_fwd_inter_kernel (?:\[.*?\] )?"
                  r"(Config\(.*?\)) \| .*?(\d+) programs? an SM \((.*?)\)"
                  r".*16-bit scalar loads (\d+)")


# Any build's kernel name and how many of its programs an SM holds.
FIT = re.compile(r"^ok .*?s  (\w+) .*?(\d+) programs? an SM \((.*?)\)")


def _resources(ops: str, shape: str, only: str | None = None) -> str:
    """compile_check's report of the default configs' builds (stdout)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_check.py"), "--ops", ops,
         "--shape", shape, "--resources", *(["--only", only] if only else [])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def _fused_pass_builds(ops: str) -> list[tuple[str, int, str, int]]:
    stdout = _resources(ops, "1x200x4x128", "fwd_inter")
    builds = [(m[1], int(m[2]), m[3], int(m[4]))
              for m in map(LINE.match, stdout.splitlines()) if m]
    assert builds, stdout[-2000:]
    return builds


@pytest.mark.parametrize("ops, scalar_loads", [("gated_delta_rule", 2), ("simple_gla", 0)])
def test_fused_forward_fits_two_programs_an_sm_with_vector_loads(ops, scalar_loads):
    for config, programs, limit, loads in _fused_pass_builds(ops):
        assert programs >= 2, f"{ops} {config}: {programs} program an SM ({limit})"
        assert loads <= scalar_loads, f"{ops} {config}: {loads} scalar 16-bit loads"


@pytest.mark.parametrize("K", [64, 128, 256])
def test_dplr_defaults_fit_an_sm(K):
    """Every DPLR / RWKV7 kernel's default config can run at head width K: one program
    an SM at least (chunk_dplr_bwd_local's asked for 256 KB of shared memory at K = 256,
    and the tuning layer skipped it, with a warning, at every first call)."""
    stdout = _resources("dplr", f"1x200x4x{K}")
    builds = [(m[1], int(m[2]), m[3]) for m in map(FIT.match, stdout.splitlines()) if m]
    assert len(builds) >= 5, stdout[-2000:]
    for name, programs, limit in builds:
        assert programs >= 1, f"K = {K}: {name} fits no program an SM ({limit})"


@pytest.mark.parametrize("K", [64, 128, 256])
def test_wy_kernel_fits_twelve_programs_an_sm(K):
    """The delta rule's one-warp WY kernel (the chunks' (I + A)⁻¹) is capped at 168
    registers a thread so that 12 programs share an SM (10 uncapped: 0.167 against
    0.152 ms at 1x8192x96x128 on an H200); a change that drops the cap, or a Triton
    that ignores it, shows here."""
    stdout = _resources("gated_delta_rule", f"1x200x4x{K}", "fwd_intra_kernel")
    builds = [(int(m[2]), m[3]) for m in map(FIT.match, stdout.splitlines())
              if m and m[1] == "chunk_gated_delta_rule_fwd_intra_kernel"]
    assert builds, stdout[-2000:]
    for programs, limit in builds:
        assert programs == 12, f"K = {K}: {programs} programs an SM ({limit})"
