"""`python -m fla train / generate / bench` on the CPU: a few steps of a tiny model, text
streamed from its checkpoint, resume, Ctrl-C, usage errors, the data sampler, FSDP2 over
two gloo processes, and the bench smoke run."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fla.__main__ import main
from fla.cli import data

ROOT = Path(__file__).resolve().parents[2]
# A model small enough that a step takes milliseconds; the windows too.
TINY = ["--hidden-size", "32", "--layers", "1", "--head-dim", "16", "--seq-len", "32",
        "--batch-size", "4", "--eval-batches", "1", "--threads", "1"]


def _env() -> dict:
    # The PyTorch path: the suite's TRITON_INTERPRET=1 would interpret every kernel.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLA_BACKEND")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def fla(*args, cwd, timeout=300, check=True):
    result = subprocess.run([sys.executable, "-m", "fla", *args], cwd=cwd, env=_env(),
                            capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def _state(run: Path) -> dict:
    return torch.load(run / "checkpoint" / "trainer_state.pt", weights_only=False)


@pytest.mark.no_poison
def test_train_generate_and_resume_equals_an_uninterrupted_run(tmp_path):
    """4 steps (--stop-at on a 6-step schedule), generate from the checkpoint, resume to
    6: the same losses as 6 steps in one go (the batch of a step depends on the step
    alone, and the optimizer state is saved)."""
    common = [*TINY, "--max-steps", "6", "--eval-every", "2", "--sample-tokens", "0"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    fla("train", *common, "--no-plot", "--out", str(straight), cwd=tmp_path)
    r = fla("train", *common, "--stop-at", "4", "--out", str(run), cwd=tmp_path)
    assert "final validation loss" in r.stdout and "unigram baseline" in r.stdout
    ckpt = run / "checkpoint"
    for name in ("config.json", "model.safetensors", "trainer_state.pt", "fla_train.json"):
        assert (ckpt / name).is_file(), name
    assert (run / "loss_curve.png").stat().st_size > 1000
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "gated_deltanet"
    assert _state(run)["step"] == 4

    g = fla("generate", "--checkpoint", str(run), "--prompt", "ROMEO:", "--max-new-tokens",
            "12", "--temperature", "0.8", "--top-k", "20", "--seed", "1", cwd=tmp_path)
    assert g.stdout.startswith("ROMEO:") and len(g.stdout) > len("ROMEO:")

    r = fla("train", *common, "--out", str(run), "--resume", cwd=tmp_path)
    assert "resuming gated_deltanet" in r.stdout and "at step 4" in r.stdout
    state = _state(run)
    assert state["step"] == 6
    assert [h["step"] for h in state["history"] if "val_loss" in h] == [2, 4, 6]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7))
    for key in ("loss", "val_loss"):
        a = [h[key] for h in _state(straight)["history"] if key in h]
        b = [h[key] for h in state["history"] if key in h]
        assert a == pytest.approx(b, rel=1e-5), key


@pytest.mark.no_poison
def test_ctrl_c_saves_a_resumable_checkpoint(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "fla", "train", *TINY, "--max-steps", "100000",
           "--eval-every", "100000", "--out", str(run), "--no-plot"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        metrics = run / "metrics.jsonl"
        while time.time() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err
    assert "resume with" in out
    assert _state(run)["step"] >= 2     # resuming it: the test above


# ------------------------------------------------------------------------ usage errors

def _error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
    return err


def test_unknown_model_lists_the_known(capsys):
    err = _error(capsys, "train", "--model", "nope")
    assert "unknown model 'nope'" in err
    for name in ("gated_deltanet", "delta_net", "retnet", "gla", "mamba2", "transformer"):
        assert name in err


def test_missing_checkpoint(tmp_path, capsys):
    assert "not found" in _error(capsys, "generate", "--checkpoint", str(tmp_path / "none"))
    assert "holds no checkpoint" in _error(capsys, "generate", "--checkpoint", str(tmp_path))
    assert "holds no checkpoint" in _error(capsys, "train", "--resume", str(tmp_path))


def test_corrupt_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "gated_deltanet", ')
    assert "not valid JSON" in _error(capsys, "generate", "--checkpoint", str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "what"}')
    assert "unknown model 'what'" in _error(capsys, "generate", "--checkpoint", str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gated_deltanet", "vocab_size": 264,'
                                          ' "hidden_size": 64, "num_hidden_layers": 1,'
                                          ' "head_dim": 16, "num_heads": 4}')
    assert "cannot load the weights" in _error(capsys, "generate", "--checkpoint",
                                               str(tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_cuda_only_options_on_cpu(capsys):
    assert "no CUDA device" in _error(capsys, "train", "--device", "cuda")
    assert "no CUDA device" in _error(capsys, "generate", "--checkpoint", ".",
                                      "--device", "cuda")
    assert "CUDA option" in _error(capsys, "train", "--dtype", "bfloat16")
    assert "CUDA option" in _error(capsys, "train", "--fuse-linear-ce")


def test_bad_numbers(capsys):
    assert "--max-steps" in _error(capsys, "train", "--max-steps", "0")
    assert "--temperature" in _error(capsys, "generate", "--checkpoint", ".",
                                     "--temperature", "-1")


@pytest.mark.no_poison
def test_errors_through_the_real_command(tmp_path):
    r = fla("train", "--model", "nope", cwd=tmp_path, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("python -m fla train: error: --model: unknown model 'nope'")


# ------------------------------------------------------------------------------- data

def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    text = "Fair is foul — and foul is fair"
    assert tok.decode(tok.encode(text)) == text
    dec = data.IncrementalDecoder()
    assert "".join(dec.feed(t) for t in tok.encode(text)) + dec.flush() == text


def test_sampler_shards_the_global_batch_and_is_a_function_of_the_step():
    corpus = torch.arange(5000, dtype=torch.int64) % 251
    single = data.WindowSampler(corpus, 16, 8, seed=3)
    ranks = [data.WindowSampler(corpus, 16, 8, seed=3, rank=r, world=2) for r in range(2)]
    for step in (0, 1, single.steps_per_epoch + 2):
        whole = single.batch(step)
        parts = [s.batch(step) for s in ranks]
        assert whole.shape == (8, 16) and parts[0].shape == (4, 16)
        assert sorted(map(tuple, whole.tolist())) == \
            sorted(map(tuple, torch.cat(parts).tolist()))
    fresh = data.WindowSampler(corpus, 16, 8, seed=3)
    assert torch.equal(fresh.batch(5), single.batch(5))
    assert not torch.equal(single.batch(0), single.batch(single.steps_per_epoch))


def test_eval_windows_do_not_depend_on_the_world_size():
    split = torch.arange(3000, dtype=torch.int64) % 200
    one = torch.cat(data.eval_batches(split, 16, 8, 2))
    two = torch.cat([torch.cat(data.eval_batches(split, 16, 8, 2, r, 2)) for r in range(2)])
    assert sorted(map(tuple, one.tolist())) == sorted(map(tuple, two.tolist()))


def test_corpus_and_unigram_baseline():
    corpus = data.read_corpus()
    assert 2_000_000 < len(corpus) < 3_500_000
    splits = data.split(corpus, 0.04, 128)
    assert 4.0 < splits.unigram_bits_per_byte() < 5.5


# ------------------------------------------------------------------------ multi-process

@pytest.mark.no_poison
def test_fsdp2_two_gloo_processes_match_one(tmp_path):
    """torchrun --nproc_per_node=2 on the CPU: FSDP2 over gloo, the same losses as one
    process with the same global batch, and a gathered checkpoint that loads."""
    pytest.importorskip("torch.distributed.fsdp")
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    args = [*TINY, "--max-steps", "3", "--eval-every", "2", "--sample-tokens", "0",
            "--no-plot"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_port", str(29400 + os.getpid() % 500), "-m", "fla", "train", *args,
           "--out", str(tmp_path / "two")]
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 processes, FSDP2 (gloo)" in r.stdout
    fla("train", *args, "--out", str(tmp_path / "one"), cwd=tmp_path)
    two, one = _state(tmp_path / "two")["history"], _state(tmp_path / "one")["history"]
    for key in ("loss", "val_loss"):
        a = [h[key] for h in two if key in h]
        b = [h[key] for h in one if key in h]
        assert a == pytest.approx(b, rel=1e-5), key
    ckpt = tmp_path / "two" / "checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["GatedDeltaNetForCausalLM"]
    # The gathered checkpoint holds the full weights: they load into one process.
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    assert sum(p.numel() for p in model.parameters()) > 10_000


# ----------------------------------------------------------------------------- bench

@pytest.mark.no_poison
def test_bench_smoke_on_cpu(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the smoke path is the CPU one")
    monkeypatch.setenv("FLA_BACKEND", "torch")
    assert main(["bench", "--T", "64", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device here" in out and "chunk_gated_delta_rule" in out
    assert (tmp_path / "bench_chunk_gated_delta_rule.png").is_file()
    assert "unknown" in _error(capsys, "bench", "--op", "nope")
