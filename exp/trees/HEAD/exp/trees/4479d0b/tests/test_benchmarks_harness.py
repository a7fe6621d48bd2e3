"""CPU tests of the benchmark harness (benchmarks/): the case registry, the runner's
bookkeeping (missing / error / timeout / kill / restart, run against a fake ``fla`` in a
subprocess) and compare.py's merging, ratios, tables and RESULTS.md rewrite.
No GPU needed; the timings themselves are only meaningful on the GPU machine."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from benchmarks import cases as reg
from benchmarks import compare

REPO = Path(__file__).resolve().parent.parent

GDN_SIX = [(1, 8192, 96, 128), (2, 16384, 16, 128), (4, 2048, 16, 128), (4, 4096, 64, 128),
           (8, 1024, 8, 64), (8, 2048, 32, 256)]


def shapes_of(op: str) -> list[tuple]:
    return [c.shape for c in reg.CASES if c.op == op]


# ---------------------------------------------------------------------------------------
# Registry

def test_every_case_names_a_module_and_function():
    assert len({c.name for c in reg.CASES}) == len(reg.CASES)
    for case in reg.CASES:
        assert case.module.startswith("torch.") if case.baseline else case.module.startswith("fla.")
        assert case.function and case.function.isidentifier()
        assert case.name == f"{case.op}/{case.shape_str}"
        assert set(case.modes) <= set(reg.MODES) and case.modes
        assert len(case.dims.split(",")) == len(case.shape)
        if case.baseline:
            assert case.baseline_for in reg.BY_NAME


def test_shapes_are_the_issues():
    assert shapes_of("chunk_gated_delta_rule") == GDN_SIX + [(1, 65536, 8, 128)]
    assert shapes_of("chunk_simple_gla") == GDN_SIX
    assert shapes_of("chunk_gla") == GDN_SIX
    assert shapes_of("chunk_rwkv6") == [(4, 4096, 16, 128)]
    # the issue's two, and head sizes 128 and 256 at the first one's channels a token
    assert shapes_of("chunk_rwkv7") == [(4, 4096, 32, 64), (8, 4096, 64, 64), (4, 4096, 16, 128),
                                        (4, 4096, 8, 256)]
    assert shapes_of("chunk_delta_rule") == [(4, 4096, 16, 128)]
    assert shapes_of("chunk_gated_delta_rule_fwd_h") == [(1, 8192, 36, 256)]
    assert shapes_of("fused_recurrent_gated_delta_rule") == [(256, 1, 32, 128)]
    assert shapes_of("RMSNorm") == [(16384, 4096)]
    paths = {c.op: c.path for c in reg.CASES}
    assert paths["chunk_gated_delta_rule"] == "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
    assert paths["chunk_gated_delta_rule_fwd_h"] == \
        "fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_fwd_h"
    assert paths["fused_recurrent_gated_delta_rule"] == \
        "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule"
    assert paths["chunk_simple_gla"] == "fla.ops.simple_gla.chunk_simple_gla"
    assert paths["chunk_gla"] == "fla.ops.gla.chunk_gla"
    assert paths["chunk_rwkv6"] == "fla.ops.rwkv6.chunk_rwkv6"
    assert paths["chunk_rwkv7"] == "fla.ops.rwkv7.chunk_rwkv7"
    assert paths["chunk_delta_rule"] == "fla.ops.delta_rule.chunk_delta_rule"
    assert paths["RMSNorm"] == "fla.modules.RMSNorm"
    # fwd-only cases, and the reference's patched gated backward.
    assert reg.BY_NAME["chunk_gated_delta_rule_fwd_h/1x8192x36x256"].modes == ("fwd",)
    assert reg.BY_NAME["fused_recurrent_gated_delta_rule/256x1x32x128"].modes == ("fwd",)
    gated = {c.family for c in reg.CASES if c.ref_gated_bwd}
    assert gated == {"gated_delta_rule", "simple_gla"}


def test_work_counts():
    for case in reg.CASES:
        for mode in case.modes:
            work = case.work_for(mode)
            assert work and all(v > 0 and math.isfinite(v) for v in work.values()), case.name
    gdn = reg.BY_NAME["chunk_gated_delta_rule/1x8192x96x128"]
    # the floor of issue 3: q, k, v read and o written once, ~0.81 GB (0.27 ms at 3 TB/s)
    assert gdn.work_for("fwd")["bytes"] == pytest.approx(4 * 8192 * 96 * 128 * 2, rel=0.01)
    assert gdn.work_for("fwdbwd")["flops"] == 3 * gdn.work_for("fwd")["flops"]
    decode = reg.BY_NAME["fused_recurrent_gated_delta_rule/256x1x32x128"].work_for("fwd")
    assert decode["state_bytes"] == 2 * 256 * 32 * 128 * 128 * 4
    fwd_h = reg.BY_NAME["chunk_gated_delta_rule_fwd_h/1x8192x36x256"].work_for("fwd")
    assert fwd_h["flops"] == 8192 * 36 * 4 * 256 * 256
    rms = reg.BY_NAME["RMSNorm/16384x4096"]
    assert rms.work_for("fwd")["bytes"] == 2 * 16384 * 4096 * 2


def test_select():
    assert reg.select(["all"]) == reg.CASES
    default = reg.select([])
    assert default == reg.select(["default"]) == reg.default_cases()
    primary = [c for c in default if not c.baseline]
    assert [c.est_ref_cold_s for c in primary] == sorted(c.est_ref_cold_s for c in primary)
    assert {c.family for c in primary} >= {"gated_delta_rule", "delta_rule", "simple_gla", "gla",
                                            "rwkv6", "rwkv7", "norm"}
    assert [c.shape for c in reg.select(["chunk_gla"])] == GDN_SIX
    names = reg.select(["chunk_rwkv6/4x4096x16x128,chunk_gla/8x1024x8x64", "chunk_rwkv6"])
    assert [c.name for c in names] == ["chunk_rwkv6/4x4096x16x128", "chunk_gla/8x1024x8x64"]
    assert [c.shape for c in reg.select(["chunk_gated_delta_rule/1x*"])] == \
        [(1, 8192, 96, 128), (1, 65536, 8, 128)]
    with pytest.raises(ValueError, match="unknown benchmark case"):
        reg.select(["chunk_nothing"])


class Recorder:
    """Stands in for an op: records the keyword arguments and returns a tensor."""

    def __init__(self, reject=()):
        self.calls, self.reject = [], reject

    def __call__(self, *args, **kwargs):
        for name in self.reject:
            if name in kwargs:
                raise TypeError(f"f() got an unexpected keyword argument '{name}'")
        self.calls.append((args, kwargs))
        first = next(v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor))
        return first * 2, None


@pytest.mark.parametrize("name", [c.name for c in reg.CASES
                                  if c.module.startswith("fla.ops")])
def test_builders_call_ops_with_keywords(name):
    case = reg.BY_NAME[name].tiny()
    fn = Recorder()
    prepared = case.prepare(fn, "cpu", grad="fwdbwd" in case.modes)
    prepared.forward()
    (args, kwargs), = fn.calls
    assert not args, "ops are called with keyword arguments only"
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            assert torch.isfinite(value.float()).all()
            assert (value != 0).any(), "inputs are never zeros"
    if "fwdbwd" in case.modes:
        assert prepared.leaves and all(x.requires_grad for x in prepared.leaves)
    k = kwargs.get("k")
    if k is not None:
        assert k.dtype == torch.bfloat16 and k.shape[:3] == case.shape[:3]
    if case.op in ("chunk_gated_delta_rule", "chunk_delta_rule",
                   "fused_recurrent_gated_delta_rule"):
        norms = k.float().norm(dim=-1)
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
        assert ((kwargs["beta"] > 0) & (kwargs["beta"] < 1)).all()
    if "g" in kwargs and case.op != "chunk_gated_delta_rule_fwd_h":
        assert (kwargs["g"] < 0).all()


def test_field_call_of_fwd_h():
    case = reg.BY_NAME["chunk_gated_delta_rule_fwd_h/1x8192x36x256"].with_shape((1, 200, 3, 16))
    fn = Recorder()
    case.prepare(fn, "cpu", grad=False).forward()
    (_, kw), = fn.calls
    assert set(kw) == {"k", "w", "u", "g", "head_first", "chunk_size"}
    assert kw["head_first"] is False and kw["chunk_size"] == 64
    assert kw["g"].dtype == torch.float32 and kw["g"].shape == (1, 200, 3)
    for t in ("k", "w", "u"):
        assert kw[t].dtype == torch.bfloat16 and kw[t].shape == (1, 200, 3, 16)
    g = kw["g"]
    # chunk-local cumsum: decreasing inside a chunk, restarting at each chunk start
    steps = torch.diff(g[0, :64], dim=0)
    assert (steps < 0).all() and (g[0, 64] > g[0, 63]).all() and (g[0, 192] > g[0, 191]).all()
    # a library without head_first is called without it, and the run says so
    fn = Recorder(reject=("head_first",))
    prepared = case.prepare(fn, "cpu", grad=False)
    prepared.forward()
    prepared.forward()
    assert all("head_first" not in kw for _, kw in fn.calls) and len(fn.calls) == 2
    assert prepared.notes == ["this fla does not accept head_first=False: called without it"]


def test_decode_case_inputs():
    case = reg.BY_NAME["fused_recurrent_gated_delta_rule/256x1x32x128"].tiny()
    fn = Recorder()
    case.prepare(fn, "cpu", grad=False).forward()
    (_, kw), = fn.calls
    assert kw["output_final_state"] is True
    assert kw["initial_state"].dtype == torch.float32
    B, T, H, D = case.shape
    assert T == 1 and kw["initial_state"].shape == (B, H, D, D)


# ---------------------------------------------------------------------------------------
# The runner, against a fake fla in a subprocess

FAKE = {
    "fla/__init__.py": "__version__ = '9.9.9-fake'\n",
    "fla/ops/__init__.py": "",
    "fla/ops/common/__init__.py": "",
    "fla/ops/common/chunk_o.py": "TRITON_ABOVE_3_7_1 = False\n",
    "fla/ops/gated_delta_rule/__init__.py": """
        import torch

        def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                   output_final_state=False):
            w = (beta.float() * g.float().exp()).unsqueeze(-1)
            o = ((q.float() * k.float()).sum(-1, keepdim=True) * v.float() * w).to(v.dtype)
            return o, None

        def fused_recurrent_gated_delta_rule(*args, **kwargs):
            raise NotImplementedError("decode kernel not written yet")
        """,
    "fla/ops/delta_rule/__init__.py": """
        def chunk_delta_rule(**kwargs):
            raise RuntimeError("boom")
        """,
    "fla/ops/simple_gla/__init__.py": """
        import time

        def chunk_simple_gla(**kwargs):
            time.sleep(60)
        """,
    "fla/ops/rwkv6/__init__.py": """
        import torch

        def chunk_rwkv6(**kwargs):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
        """,
    "fla/modules/__init__.py": """
        import torch

        class RMSNorm(torch.nn.Module):
            def __init__(self, hidden_size, eps=1e-5):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.ones(hidden_size))
                self.eps = eps

            def forward(self, x):
                return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        """,
}


@pytest.fixture
def fake_env(tmp_path):
    """A fake fla, and a copy of the harness alone (our fla must not be importable)."""
    for rel, text in FAKE.items():
        path = tmp_path / "fake" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    harness = tmp_path / "harness"
    harness.mkdir()
    shutil.copytree(REPO / "benchmarks", harness / "benchmarks",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'fake'}{os.pathsep}{harness}",
               PYTHONUNBUFFERED="1")
    env.pop("FLA_BENCH_RESTARTS", None)
    return tmp_path, harness, env


def run_side(harness, env, *args, timeout=240):
    cmd = [sys.executable, "-m", "benchmarks.run_side", "--device", "cpu", "--tiny", "--quick",
           *args]
    return subprocess.run(cmd, cwd=harness, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_runner_records_every_outcome(fake_env):
    tmp, harness, env = fake_env
    out = tmp / "ref.json"
    selection = ["chunk_gated_delta_rule/1x8192x96x128", "chunk_simple_gla/1x8192x96x128",
                 "chunk_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_gla/8x1024x8x64",
                 "chunk_rwkv6", "RMSNorm", "rms_norm_torch"]
    # The fake chunk_simple_gla sleeps 60 s; 10 s leaves the real tiny cases a wide
    # margin on a loaded 2-core CI machine (2 s was seen to time out a fake GDN case).
    proc = run_side(harness, env, "--label", "reference", "--out", str(out),
                    "--case-timeout", "10", "--cases", *selection)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["env"]["fla_version"] == "9.9.9-fake"
    assert data["finished"] and data["settings"]["return_mode"] == "median"
    assert any(n.startswith("reference bwd check patched out, results untrusted")
               for n in data["notes"])
    cases = data["cases"]
    gdn = cases["chunk_gated_delta_rule/1x8192x96x128"]
    assert gdn["status"] == "ok" and gdn["cold_mode"] == "fwdbwd" and gdn["cold_s"] > 0
    assert set(gdn["modes"]) == {"fwd", "fwdbwd"}
    assert all(m["ms"] > 0 and m["work"]["flops"] > 0 for m in gdn["modes"].values())
    assert "reference bwd check patched out, results untrusted" in gdn["notes"]
    assert cases["chunk_simple_gla/1x8192x96x128"]["status"] == "timeout"
    assert cases["chunk_delta_rule/4x4096x16x128"]["status"] == "error"
    assert "boom" in cases["chunk_delta_rule/4x4096x16x128"]["error"]
    assert cases["fused_recurrent_gated_delta_rule/256x1x32x128"]["status"] == "missing"
    assert cases["chunk_gla/8x1024x8x64"]["status"] == "missing"
    assert cases["chunk_rwkv6/4x4096x16x128"]["status"] == "oom"
    assert cases["RMSNorm/16384x4096"]["status"] == "ok"
    assert cases["rms_norm_torch/16384x4096"]["status"] == "skipped"  # baseline: ours only

    # the same run as "ours", then the comparison of the two files
    ours = tmp / "ours.json"
    proc = run_side(harness, env, "--label", "ours", "--out", str(ours), "--case-timeout", "10",
                    "--cases", *selection)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(ours.read_text())
    assert not any(n.startswith("reference bwd") for n in data["notes"])
    assert data["cases"]["rms_norm_torch/16384x4096"]["status"] == "ok"
    results = tmp / "RESULTS.md"
    results.write_text("# Results\n\nhand-written text\n")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compare", str(ours), str(out),
                           "--results", str(results)], cwd=harness, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.strip().splitlines()
    assert table[-1].startswith("rms_norm_torch/16384x4096 (torch)")
    text = results.read_text()
    assert text.startswith("# Results\n\nhand-written text\n")
    assert "| chunk_gated_delta_rule | 1x128x2x32 | fwd+bwd |" in text
    assert "ref bwd check patched out: untrusted" in text
    assert "WARNING: --tiny run" in text


def test_runner_list_available(fake_env):
    tmp, harness, env = fake_env
    proc = run_side(harness, env, "--list", "--available", "--cases", "default")
    names = proc.stdout.split()
    assert "chunk_gated_delta_rule/1x8192x96x128" in names and "RMSNorm/16384x4096" in names
    assert "sdpa_causal_torch/1x8192x96x128" in names and "rms_norm_torch/16384x4096" in names
    assert "chunk_gla/1x8192x96x128" not in names  # no such op in the fake
    assert "chunk_rwkv7/4x4096x32x64" not in names


def test_runner_restarts_after_a_lost_context(fake_env):
    tmp, harness, env = fake_env
    out = tmp / "ours.json"
    env = dict(env, FLA_BENCH_SIMULATE_LOST_CONTEXT="chunk_delta_rule/4x4096x16x128")
    proc = run_side(harness, env, "--label", "ours", "--out", str(out), "--cases",
                    "chunk_delta_rule", "RMSNorm", "chunk_gated_delta_rule/8x1024x8x64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [c["status"] for c in data["cases"].values()] == ["error", "ok", "ok"]
    assert any("restarted after a CUDA error" in n for n in data["notes"])


def test_runner_keeps_results_when_killed(fake_env):
    tmp, harness, env = fake_env
    out = tmp / "ours.json"
    cmd = [sys.executable, "-m", "benchmarks.run_side", "--device", "cpu", "--tiny", "--quick",
           "--label", "ours", "--out", str(out), "--cases", "RMSNorm",
           "chunk_simple_gla/1x8192x96x128", "chunk_gated_delta_rule/1x8192x96x128"]
    proc = subprocess.Popen(cmd, cwd=harness, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                data = json.loads(out.read_text())
                if data["cases"].get("chunk_simple_gla/1x8192x96x128", {}).get("status") \
                        == "running":
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 124
    data = json.loads(out.read_text())
    assert data["cases"]["RMSNorm/16384x4096"]["status"] == "ok"
    assert data["cases"]["chunk_simple_gla/1x8192x96x128"]["status"] == "killed"
    assert "chunk_gated_delta_rule/1x8192x96x128" not in data["cases"]
    assert any("terminated" in n for n in data["notes"])


# ---------------------------------------------------------------------------------------
# compare.py on synthetic results

def side(label, cases, copy_gbps=3000.0, **env):
    return {"schema": 1, "label": label, "started": "2026-01-02T03:04:05+00:00",
            "finished": "2026-01-02T03:14:05+00:00", "copy_gbps": copy_gbps,
            "env": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0",
                    "fla_version": "0.6.0" if label == "reference" else "0.1.0", **env},
            "settings": {"warmup_ms": 50, "rep_ms": 200}, "notes": [], "cases": cases}


def case(name, modes, status="ok", cold=1.5, notes=(), baseline_for=None, error=None):
    op, shape = name.split("/")
    return {"name": name, "op": op, "shape": [int(s) for s in shape.split("x")],
            "dims": "B,T,H,D", "baseline": baseline_for is not None,
            "baseline_for": baseline_for, "status": status, "error": error,
            "notes": list(notes), "cold_s": cold, "cold_mode": "fwdbwd", "modes": modes}


def mode(ms, flops=None, nbytes=None, mem=2 ** 20 * 100, status=None, error=None, state=None):
    work = {k: v for k, v in (("flops", flops), ("bytes", nbytes), ("state_bytes", state)) if v}
    return {"status": status or ("ok" if ms else "error"), "ms": ms, "work": work,
            "extra_mem_bytes": mem if ms else None, "peak_mem_bytes": mem, "error": error}


GDN = "chunk_gated_delta_rule/1x8192x96x128"
RMS = "RMSNorm/16384x4096"
DEC = "fused_recurrent_gated_delta_rule/256x1x32x128"


def synthetic():
    ours = side("ours", {
        GDN: case(GDN, {"fwd": mode(0.5, flops=1e12, nbytes=3e9),
                        "fwdbwd": mode(2.0, flops=3e12, nbytes=9e9)}, cold=4.0),
        RMS: case(RMS, {"fwd": mode(None, status="error", error="RuntimeError: bad"),
                        "fwdbwd": mode(None, status="error", error="RuntimeError: bad")},
                  status="error", error="RuntimeError: bad"),
        DEC: case(DEC, {"fwd": mode(0.4, nbytes=1.2e9, state=1.0e9, mem=None)}),
        "sdpa_causal_torch/1x8192x96x128": case(
            "sdpa_causal_torch/1x8192x96x128", {"fwd": mode(3.0, flops=1.6e12)},
            baseline_for=GDN),
    })
    ref = side("reference", {
        GDN: case(GDN, {"fwd": mode(1.0, flops=1e12, nbytes=3e9, mem=2 ** 20 * 200),
                        "fwdbwd": mode(8.0, flops=3e12, mem=2 ** 20 * 400)}, cold=100.0,
                  notes=[compare.REF_PATCH_NOTE]),
        RMS: case(RMS, {"fwd": mode(0.11, nbytes=2.7e8), "fwdbwd": mode(0.98, nbytes=6.7e8)}),
        DEC: case(DEC, {"fwd": mode(None, status="missing", error="MissingOp: nope")},
                  status="missing"),
        "sdpa_causal_torch/1x8192x96x128": case("sdpa_causal_torch/1x8192x96x128", {},
                                                status="skipped", baseline_for=GDN),
    })
    ref["notes"] = [compare.REF_PATCH_NOTE + " (flag set)"]
    return ours, ref


def test_merge_ratios_and_rates():
    ours, ref = synthetic()
    rows = compare.merge(ours, ref)
    keys = [(r["case"], r["mode"]) for r in rows]
    assert keys == [(GDN, "fwd"), (GDN, "fwdbwd"), ("sdpa_causal_torch/1x8192x96x128", "fwd"),
                    (RMS, "fwd"), (RMS, "fwdbwd"), (DEC, "fwd")]
    fwd, bwd = rows[0], rows[1]
    assert fwd["ratio"] == pytest.approx(0.5) and bwd["ratio"] == pytest.approx(0.25)
    assert fwd["mem_ratio"] == pytest.approx(0.5)
    assert fwd["ours"]["rates"]["tflops"] == pytest.approx(2000.0)   # 1e12 / 0.5 ms
    assert fwd["ours"]["rates"]["gbps"] == pytest.approx(6000.0)
    assert fwd["ours"]["rates"]["pct_copy"] == pytest.approx(200.0)
    assert "ref bwd check patched out: untrusted" in bwd["notes"]
    assert "ref bwd check patched out: untrusted" not in fwd["notes"]
    assert rows[2]["baseline"] and rows[2]["ref"]["status"] == "skipped"
    rms = rows[3]
    assert rms["ratio"] is None and compare.fmt_ms(rms["ours"]) == "error"
    assert any(n.startswith("ours error: RuntimeError: bad") for n in rms["notes"])
    dec = rows[5]
    assert dec["ours"]["rates"]["state_gbps"] == pytest.approx(2500.0)
    assert compare.fmt_ms(dec["ref"]) == "missing"
    assert "state 2.50 TB/s (83% copy)" in compare.fmt_rate(dec["ours"])


def test_merge_with_one_side_only():
    ours, _ = synthetic()
    rows = compare.merge(ours, None)
    assert rows and all(r["ratio"] is None for r in rows)
    assert compare.fmt_ms(rows[0]["ref"]) == "—"
    md = compare.generated_block(ours, None, rows)
    assert "Reference: not run" in md


def test_tables():
    ours, ref = synthetic()
    rows = compare.merge(ours, ref)
    md = compare.markdown_table(rows)
    lines = md.splitlines()
    assert len(lines) == 2 + len(rows)
    assert all(line.count(" | ") == 10 for line in lines[2:])
    assert "| chunk_gated_delta_rule | 1x8192x96x128 | fwd | 0.500 | 1.000 | 0.50× |" in md
    assert "| 100 / 200 |" in md and "| 4.0 / 100 |" in md
    plain = compare.plain_table(rows)
    assert plain.splitlines()[0].startswith("case")
    assert "0.25×" in plain
    header = "\n".join(compare.header_lines(ours, ref))
    assert "NVIDIA H100 80GB HBM3" in header and "Triton 3.6.0" in header
    assert "flash-linear-attention 0.6.0" in header
    assert "reference: " + compare.REF_PATCH_NOTE in header
    assert "3.00 TB/s" in header


def test_versions_that_differ_are_both_shown():
    ours, ref = synthetic()
    ref["env"]["triton"] = "3.7.1"
    header = "\n".join(compare.header_lines(ours, ref))
    assert "Triton 3.6.0 (ours) / 3.7.1 (reference)" in header


def test_results_rewrite_keeps_hand_written_text(tmp_path):
    ours, ref = synthetic()
    rows = compare.merge(ours, ref)
    path = tmp_path / "RESULTS.md"
    path.write_text(f"# Results\n\nintro\n\n{compare.START}\nold table\n{compare.END}\n\n"
                    "## Analysis\n\nkept\n")
    block = compare.generated_block(ours, ref, rows)
    text = compare.update_results(path, block)
    assert text.startswith("# Results\n\nintro\n\n" + compare.START)
    assert "old table" not in text and text.endswith("## Analysis\n\nkept\n")
    assert text.count(compare.START) == 1 and text.count(compare.END) == 1
    assert compare.update_results(path, block) == text  # idempotent
    # no markers yet: the block is appended
    path.write_text("# Mine\n\nnotes\n")
    text = compare.update_results(path, block)
    assert text.startswith("# Mine\n\nnotes\n\n" + compare.START)
    # no file yet: the default preamble, then the block
    fresh = tmp_path / "new" / "RESULTS.md"
    text = compare.update_results(fresh, block)
    assert text.startswith(compare.DEFAULT_PREAMBLE) and compare.END in text


def test_compare_main(tmp_path, capsys):
    ours, ref = synthetic()
    (tmp_path / "o.json").write_text(json.dumps(ours))
    (tmp_path / "r.json").write_text(json.dumps(ref))
    results = tmp_path / "R.md"
    assert compare.main([str(tmp_path / "o.json"), str(tmp_path / "r.json"),
                         "--results", str(results)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("NVIDIA H100 80GB HBM3 | torch 2.11.0 | Triton 3.6.0")
    assert out[-1].startswith(DEC)
    assert compare.START in results.read_text()
    # a missing reference file leaves that side empty instead of failing
    assert compare.main([str(tmp_path / "o.json"), str(tmp_path / "absent.json")]) == 0
    assert compare.main([str(tmp_path / "x.json"), str(tmp_path / "y.json")]) == 1


def test_committed_results_file_has_markers():
    text = (REPO / "benchmarks" / "RESULTS.md").read_text()
    assert text.count(compare.START) == 1 and text.count(compare.END) == 1


# ---------------------------------------------------------------------------------------
# profile_case --tune

def test_tuning_report_lists_every_config_fastest_first_with_the_default_marked(capsys,
                                                                            monkeypatch):
    """``profile_case --tune`` prints, per tuned key, each config's time, fastest first,
    the default rule's config marked (the timings here are placed by hand: tuning itself
    runs on the GPU)."""
    from benchmarks.profile_case import _print_tuning
    from fla.ops.common import chunk_gk_bwd
    from fla.utils.tuning import Config

    kernel = chunk_gk_bwd.chunk_gk_bwd_dqkg_kernel
    named = {"K": 128, "V": 128, "q": "bfloat16", "dg": "float32", "EXCLUSIVE": False,
             "USE_U": False}
    key = tuple(named[n] for n in kernel.key)
    default = kernel.default(named)
    other = Config(BK=64, BV=64, num_warps=8, num_stages=2)
    monkeypatch.setattr(kernel, "timings", {key: (default, {default: 2.9, other: 2.5})})
    _print_tuning()
    lines = capsys.readouterr().out.strip().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("chunk_gk_bwd_dqkg_kernel"))
    assert "2.5000 ms" in lines[at + 1] and str(other) in lines[at + 1]
    assert "2.9000 ms" in lines[at + 2] and lines[at + 2].endswith("<- default")


# ------------------------------------------------------------------- host_python
@pytest.mark.parametrize("op", ["simple_gla", "gla", "gdn", "rms"])
def test_host_python_times_the_triton_path_without_launching(op, monkeypatch):
    """The harness walks each op's Triton path on CPU tensors with every launch skipped
    (a launch would run the interpreter: seconds, not microseconds) and leaves the
    process's TRITON_INTERPRET as it found it."""
    from benchmarks import host_python
    from fla.utils import tuning

    # Triton makes a kernel interpreted or compiled when its module is first imported:
    # import the op's modules under the suite's interpreter before the switch is taken
    # away, or the rest of the process gets compiled kernels (run alone, this file's
    # later interpreter tests then failed on a CPU-only torch).
    host_python.OPS[op]()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    launched = []
    original = tuning.TunedKernel._run
    monkeypatch.setattr(tuning.TunedKernel, "_run",
                        lambda *a, **k: launched.append(a) or original(*a, **k))
    us = host_python.measure(op, "fwdbwd", steps=3)
    assert 0 < us < 1e6
    assert launched == []
    assert "TRITON_INTERPRET" not in os.environ


# ---------------------------------------------------------------------------------------
# scripts/config_isolation.py: configs forced where a launch's arguments match


def _config_isolation():
    import importlib.util
    path = Path(__file__).resolve().parent.parent / "scripts" / "config_isolation.py"
    spec = importlib.util.spec_from_file_location("config_isolation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_isolation_parses_configs_and_conditions():
    from fla.utils.tuning import Config
    tool = _config_isolation()
    assert tool.parse_items("K=256, USE_W=True,FEW_PROGRAMS=0,h0=None,name=x") == {
        "K": 256, "USE_W": True, "FEW_PROGRAMS": 0, "h0": None, "name": "x"}
    assert tool.parse_items("") == {}
    assert tool.parse_config("BV=64,BK=128,num_warps=8,num_stages=2") == Config(
        BV=64, BK=128, num_warps=8, num_stages=2)
    assert tool.parse_config("BV=32") == Config(BV=32)
    for bad in ("BV", "=3", "BV=32,num_warps"):
        with pytest.raises(ValueError):
            tool.parse_config(bad)


def test_config_isolation_forces_only_where_every_condition_holds():
    tool = _config_isolation()
    where = {"K": 256, "STATES_ONLY": None}
    assert tool.matches({"K": 256, "USE_W": True}, where)       # a missing one is None
    assert tool.matches({"K": 256, "STATES_ONLY": None}, where)
    assert not tool.matches({"K": 256, "STATES_ONLY": True}, where)
    assert not tool.matches({"K": 128}, where)
    assert tool.matches({"K": 1}, {})


def test_config_isolation_refuses_a_bad_config_before_running_anything(monkeypatch):
    tool = _config_isolation()
    monkeypatch.setattr(tool, "_case", lambda *a: pytest.fail("ran the case"))
    with pytest.raises(ValueError):
        tool.main(["chunk_gla/8x2048x32x256", "--only", "x", "--config", "BV"])
    with pytest.raises(ValueError):
        tool.main(["chunk_gla/8x2048x32x256", "--where", "K"])


# ------------------------------------------------------------------- norm_timeline
def test_norm_timeline_stamps_the_ops_and_launches_in_order(monkeypatch):
    """On the Triton path (the interpreter here) a step's stamps come in the order the
    host reaches them, and the stamped ops and kernels are put back afterwards."""
    from benchmarks import norm_timeline
    from fla.modules import RMSNorm
    import fla.modules.layernorm as ln
    import fla.modules.layernorm_kernels as lk

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    before = (ln._norm_fwd_op, ln._norm_bwd_op, lk.norm_fwd_kernel, lk.norm_bwd_kernel,
              lk.sum_partial_pair)
    norm = RMSNorm(32)
    x = torch.randn(4, 32, requires_grad=True)
    dy = torch.randn(4, 32)
    median, stamps = norm_timeline.timeline(lambda: (norm(x), dy), [x, norm.weight],
                                            steps=2, device="cpu", warmup=1, flush_mb=1)
    assert median is None   # no do_bench off the GPU
    order = ["forward op >", "forward kernel launch >", "forward kernel launch <",
             "forward op <", "forward returned", "backward op >",
             "backward kernel launch >", "backward kernel launch <", "dw sum >",
             "dw sum <", "backward op <", "backward returned"]
    assert list(stamps) == order
    mids = [stamps[name][0] for name in order]
    assert mids == sorted(mids) and mids[0] > 0
    assert (ln._norm_fwd_op, ln._norm_bwd_op, lk.norm_fwd_kernel, lk.norm_bwd_kernel,
            lk.sum_partial_pair) == before
    assert x.grad is not None and torch.isfinite(x.grad).all()
