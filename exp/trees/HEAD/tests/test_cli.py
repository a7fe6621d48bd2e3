"""The README's main-job command runs on the CPU and reports agreement."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.no_poison
def test_demo_runs_and_every_path_agrees_with_float64():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "fla", "demo", "--length", "80"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: worst relative error" in result.stdout
    for row in ("float64 reference loop", "chunk, Triton", "fused_recurrent, Triton",
                "chunk, PyTorch path"):
        assert row in result.stdout
