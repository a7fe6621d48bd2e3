"""The tuning layer (fla/utils/tuning.py).

* In the interpreter: a real tiny kernel (tests/utils/tiny_kernels.py).
* The GPU path (warmup, tuning, disk cache) without a GPU: a fake kernel object, a fake
  ``do_bench`` whose timings are known, and ``is_interpreter``/``device_name`` patched.
"""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import triton
import triton.testing

import fla.utils.tuning as tuning
from fla.utils.triton_facts import TRITON_VERSION_STRING
from fla.utils.tuning import Config, TunedKernel, cache_dir, tuned, tuning_enabled
from tests.utils.tiny_kernels import (
    ALSO_GOOD,
    BROKEN,
    BROKEN_TOO,
    GOOD,
    double_kernel,
    grid,
    make_tuned,
)

pytestmark = pytest.mark.no_poison


def nan_like(x):
    return torch.full_like(x, float("nan"))


def count_runs(kernel: TunedKernel) -> list:
    """Record the config of every launch that reaches the Triton kernel, through Triton
    or (on a GPU, calls seen before) directly."""
    runs = []
    real_run = kernel._run

    def run(config, grid, named):
        runs.append(config)
        return real_run(config, grid, named)

    kernel._run = run
    direct = kernel._direct
    if direct is not None:
        real_lookup = direct.lookup

        def lookup(named):
            hit = real_lookup(named)
            if hit is not None:
                runs.append(hit[0])
            return hit

        direct.lookup = lookup
    return runs


# ------------------------------------------------------------------------------ Config
def test_config_equality_hash_and_json():
    a = Config(BK=64, BV=32, num_warps=4)
    b = Config({"BV": 32}, BK=64)
    assert a == b and hash(a) == hash(b)
    assert a != Config(BK=64, BV=32, num_warps=8)
    assert a != Config(BK=64, BV=32, num_stages=3)
    assert list(a.meta) == ["BK", "BV"]
    assert Config.from_json(json.loads(json.dumps(a.to_json()))) == a
    assert a.launch_kwargs() == {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 2,
                                 "enable_fp_fusion": True}
    assert a.options() == {"num_warps": 4, "num_stages": 2, "enable_fp_fusion": True}
    assert str(a) == "Config(BK=64, BV=32, num_warps=4, num_stages=2)"


def test_config_register_cap():
    """``maxnreg`` is part of a config's identity, its compile options and its JSON (a
    tuning cache written before it existed still reads: the key is optional)."""
    a = Config(BK=64, num_warps=1, maxnreg=168)
    assert a != Config(BK=64, num_warps=1) and a == Config(BK=64, num_warps=1, maxnreg=168)
    assert a.options() == {"num_warps": 1, "num_stages": 2, "enable_fp_fusion": True,
                           "maxnreg": 168}
    assert a.launch_kwargs()["maxnreg"] == 168
    assert Config.from_json(json.loads(json.dumps(a.to_json()))) == a
    assert Config.from_json({"meta": {"BK": 64}, "num_warps": 1, "num_stages": 2}).maxnreg is None
    assert str(a) == "Config(BK=64, num_warps=1, num_stages=2, maxnreg=168)"


# A kernel built offline for sm_90 with a config's options; prints each warning's text.
_OFFLINE_BUILD = """
import warnings
warnings.simplefilter("always")
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fla.utils.tuning import Config

@triton.jit
def axpy(x, y, a, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y + o, a * tl.load(x + o, mask=m) + tl.load(y + o, mask=m), mask=m)

with warnings.catch_warnings(record=True) as seen:
    k = triton.compile(ASTSource(axpy, {"x": "*fp32", "y": "*fp32", "a": "fp32", "n": "i32",
                                        "BLOCK": "constexpr"}, {"BLOCK": 128}),
                       target=GPUTarget("cuda", 90, 32), options=Config(BLOCK=128).options())
print("fma" if "fma.rn.f32" in k.asm["ptx"] else "no fma")
for w in seen:
    print("warning:", w.message)
"""


def test_kernels_ask_for_fused_multiply_adds_explicitly(tmp_path):
    """Triton 3.10 builds without fused multiply-adds unless a kernel asks (3.9 warns on
    every first build that leaves it to the default): our configs ask, so the numerics and
    speed measured stay, and no warning reaches the user. Offline sm_90 build of a·x + y in a
    subprocess (the tests run Triton in the interpreter)."""
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    script = tmp_path / "offline_build.py"      # Triton reads a kernel's source file
    script.write_text(_OFFLINE_BUILD)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == "fma", proc.stdout
    assert "FP_FUSION" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_tuning_enabled_and_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "is_interpreter", lambda: False)
    monkeypatch.setenv("FLA_TUNE", "1")
    assert tuning_enabled()
    monkeypatch.setenv("FLA_TUNE", "0")
    assert not tuning_enabled()
    monkeypatch.setenv("FLA_TUNE", "1")
    monkeypatch.setattr(tuning, "is_interpreter", lambda: True)
    assert not tuning_enabled()  # never in the interpreter
    monkeypatch.setenv("FLA_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("FLA_CACHE_DIR")
    assert cache_dir().parts[-3:] == (".cache", "fla", "tuning")


# ================================================================ a. interpreter path
@pytest.fixture
def kernel_device(monkeypatch, tmp_path):
    """Where the tiny kernel runs: CPU tensors in the interpreter (CI), or the GPU when
    there is one (then with tuning off and an empty cache, so the same rules apply)."""
    monkeypatch.setenv("FLA_CACHE_DIR", str(tmp_path))
    if tuning.is_interpreter():
        monkeypatch.setenv("FLA_TUNE", "1")  # must be ignored in the interpreter
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter or a GPU")
    monkeypatch.setenv("FLA_TUNE", "0")
    return "cuda"


def test_interpreter_runs_the_default_only(kernel_device):
    space = [ALSO_GOOD, Config(BLOCK=128, num_warps=4)]
    k = make_tuned(lambda a: GOOD, space=space)
    runs = count_runs(k)
    x = torch.randn(100, device=kernel_device)
    y = nan_like(x)
    k[grid](x, y, 100, D=16)
    assert torch.equal(y, 2 * x)
    assert runs == [GOOD]
    assert k.stats == {"heuristic": 1, "tuned": 0, "disk_hits": 0, "skipped_configs": 0}
    assert k.chosen_config(D=16) == GOOD


def test_interpreter_new_length_does_not_choose_again(kernel_device):
    k = make_tuned(lambda a: GOOD, space=[ALSO_GOOD])
    runs = count_runs(k)
    for n in (100, 33, 257):
        x = torch.randn(n, device=kernel_device)
        y = nan_like(x)
        k[grid](x, y, n, D=16)
        assert torch.equal(y, 2 * x)
    assert k.stats["heuristic"] == 1
    assert runs == [GOOD] * 3


def test_interpreter_one_choice_per_key(kernel_device):
    chosen_for = []

    def default(args):
        chosen_for.append(args["D"])
        return GOOD if args["D"] == 16 else ALSO_GOOD

    k = make_tuned(default)
    runs = count_runs(k)
    x = torch.randn(70, device=kernel_device)
    for D in (16, 32, 16, 32, 64):
        y = nan_like(x)
        k[grid](x, y, 70, D=D)
        assert torch.equal(y, 2 * x)
    assert k.stats["heuristic"] == 3
    assert chosen_for.count(16) >= 1 and sorted(set(chosen_for)) == [16, 32, 64]
    assert runs == [GOOD, ALSO_GOOD, GOOD, ALSO_GOOD, ALSO_GOOD]
    assert k.chosen_config(D=32) == ALSO_GOOD


# ============================================================= b. failing configs skipped
def test_failing_default_is_skipped_with_a_warning(kernel_device):
    k = make_tuned(lambda a: BROKEN, space=[BROKEN, ALSO_GOOD, GOOD])
    runs = count_runs(k)
    x = torch.randn(100, device=kernel_device)
    y = nan_like(x)
    with pytest.warns(RuntimeWarning, match=r"1 config\(s\) failed to build .* using "
                                            r"Config\(BLOCK=64"):
        k[grid](x, y, 100, D=16)
    assert torch.equal(y, 2 * x)
    # The interpreter finds out by running; on a GPU the warmup fails before any launch.
    first_runs = [BROKEN, ALSO_GOOD] if kernel_device == "cpu" else [ALSO_GOOD]
    assert runs == first_runs
    assert k.stats["skipped_configs"] >= 1
    assert k.chosen_config(D=16) == ALSO_GOOD
    assert "power of 2" in k.failures[(16,)][BROKEN]
    # The next call uses the working config straight away, with no new warning.
    y = nan_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k[grid](x, y, 100, D=16)
    assert torch.equal(y, 2 * x)
    assert runs == first_runs + [ALSO_GOOD]
    assert k.stats["heuristic"] == 1


def test_every_config_failing_raises_listing_them(kernel_device):
    k = make_tuned(lambda a: BROKEN, space=[BROKEN_TOO])
    x = torch.randn(10, device=kernel_device)
    with pytest.raises(RuntimeError) as info:
        k[grid](x, nan_like(x), 10, D=16)
    text = str(info.value)
    assert "no config could be built for key {'D': 16}" in text
    assert str(BROKEN) in text and str(BROKEN_TOO) in text
    assert "power of 2" in text
    assert k.stats["skipped_configs"] == 2
    assert "NumPy" not in text      # the interpreter's setup is not the problem here


def test_the_failure_names_an_interpreter_that_cannot_run_with_this_numpy(monkeypatch):
    """Triton 3.3-3.6's interpreter fails every kernel with NumPy 2 ("only 0-dimensional
    arrays can be converted"): the tuning layer's error then says what to install."""
    import numpy

    import fla.utils.triton_facts as facts
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(facts, "INTERPRETER_NEEDS_NUMPY_1", True)
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    problem = facts.interpreter_setup_problem()
    assert "needs NumPy < 2, found 2.4.6" in problem and "Triton >= 3.7" in problem
    with monkeypatch.context() as m:
        for needs, version in ((True, "1.26.4"), (False, "2.4.6")):
            m.setattr(facts, "INTERPRETER_NEEDS_NUMPY_1", needs)
            m.setattr(numpy, "__version__", version)
            assert facts.interpreter_setup_problem() is None
        m.setenv("TRITON_INTERPRET", "0")
        assert facts.interpreter_setup_problem() is None
    if torch.cuda.is_available():
        pytest.skip("the tuning layer's part runs the interpreter: CPU tensors only")
    k = make_tuned(lambda a: BROKEN, space=[BROKEN_TOO])
    x = torch.randn(10)
    with pytest.raises(RuntimeError, match=r"(?s)no config could be built.*needs NumPy < 2"):
        k[grid](x, nan_like(x), 10, D=16)


# =================================================================== c. keys are names
def test_unknown_key_is_refused_at_decoration():
    with pytest.raises(ValueError, match=r"key names \['T'\] are not arguments of the kernel; "
                                         r"its arguments are \['x', 'y', 'n', 'D', 'BLOCK'\]"):
        tuned(key=["D", "T"], default=lambda a: GOOD)(double_kernel)


@pytest.mark.parametrize("what", ["reset_to_zero", "restore"])
def test_unknown_reset_or_restore_is_refused(what):
    with pytest.raises(ValueError, match=rf"{what} names \['dq'\] are not arguments"):
        tuned(key=["D"], default=lambda a: GOOD, **{what: ["dq"]})(double_kernel)


def test_positional_and_keyword_give_the_same_key(kernel_device):
    k = make_tuned(lambda a: GOOD)
    x = torch.randn(50, device=kernel_device)
    y = nan_like(x)
    k[grid](x, y, 50, 16)
    assert torch.equal(y, 2 * x)
    y = nan_like(x)
    k[grid](x=x, y=y, n=50, D=16)
    assert torch.equal(y, 2 * x)
    y = nan_like(x)
    k[grid](x, y, n=50, D=16)
    assert torch.equal(y, 2 * x)
    assert k.stats["heuristic"] == 1
    assert k.key_of({"x": x, "y": y, "n": 50, "D": 16}) == (16,)


def test_a_tensor_key_contributes_its_dtype(kernel_device):
    k = make_tuned(lambda a: GOOD, key=["x", "D"])
    for dtype in (torch.float32, torch.float16, torch.float32):
        x = torch.randn(40, device=kernel_device).to(dtype)
        y = nan_like(x)
        k[grid](x, y, 40, D=16)
        assert torch.equal(y, 2 * x)
    assert k.stats["heuristic"] == 2
    assert set(k._chosen) == {("float32", 16), ("float16", 16)}


def test_binding_errors():
    k = make_tuned(lambda a: GOOD)
    x = torch.randn(8)
    with pytest.raises(TypeError, match="6 positional arguments for 5 parameters"):
        k[grid](x, x, 8, 16, 32, 1)
    with pytest.raises(TypeError, match="unexpected argument 'T'"):
        k[grid](x, x, 8, D=16, T=8)
    with pytest.raises(TypeError, match="argument 'D' given twice"):
        k[grid](x, x, 8, 16, D=16)
    with pytest.raises(TypeError, match=r"the caller passed \['BLOCK'\], which the tuning "
                                        r"layer supplies"):
        k[grid](x, x, 8, D=16, BLOCK=32)
    assert k.stats["skipped_configs"] == 0 and not k.failures


def test_a_meta_parameter_from_the_caller_is_a_usage_error_when_tuning(gpu):
    k = gpu.kernel(FakeKernel())
    with pytest.raises(TypeError, match=r"the caller passed \['BLOCK'\]"):
        call(k, BLOCK=64)
    assert k.stats["skipped_configs"] == 0 and k.stats["tuned"] == 0
    assert not gpu.bench_log


# ========================================================= d./e. the GPU path, faked
def fake_fn(x, y, n, D, BLOCK):
    """The signature the fake kernel stands for."""


class FakeKernel:
    """Stands for a compiled ``@triton.jit`` kernel on a GPU.

    ``warmup`` raises for the BLOCK sizes in ``fail_warmup``; a launch raises for those in
    ``fail_launch`` (Triton reports shared-memory overflow only at the first launch).
    Every launch computes ``y = 2 * x``, and adds 1 to ``acc`` and doubles ``state`` when
    the kernel is given them (an atomic accumulator and an in-place update).
    """

    def __init__(self, fn=fake_fn, fail_warmup=(), fail_launch=()):
        self.fn = fn
        self.fail_warmup = set(fail_warmup)
        self.fail_launch = set(fail_launch)
        self.events = []       # ("warmup" | "launch", BLOCK)
        self.launches = []     # (grid, kwargs) of every launch
        self.acc_seen = []     # acc's value as each launch found it

    def warmup(self, *args, grid, **kwargs):
        assert not args, "the tuning layer passes arguments by name"
        self.events.append(("warmup", kwargs["BLOCK"]))
        if kwargs["BLOCK"] in self.fail_warmup:
            raise RuntimeError(f"cannot compile BLOCK={kwargs['BLOCK']}")

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            assert not args, "the tuning layer passes arguments by name"
            self.events.append(("launch", kwargs["BLOCK"]))
            if kwargs["BLOCK"] in self.fail_launch:
                raise RuntimeError(f"out of resource: shared memory, BLOCK={kwargs['BLOCK']}")
            self.launches.append((grid, kwargs))
            kwargs["y"].copy_(2 * kwargs["x"])
            if kwargs.get("acc") is not None:
                self.acc_seen.append(kwargs["acc"].clone())
                kwargs["acc"].add_(1)
            if kwargs.get("state") is not None:
                kwargs["state"].mul_(2)
        return launch

    def blocks(self, what):
        return [b for kind, b in self.events if kind == what]


def cfg(block, warps=4):
    return Config(BLOCK=block, num_warps=warps)


# Benchmark times by BLOCK: 128 is the fastest, then 64, 32, 16.
TIMES = {16: 4.0, 32: 3.0, 64: 2.0, 128: 1.0}
SPACE = [cfg(16), cfg(32), cfg(64), cfg(128)]
NAME = "tests.fake.double"


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """A fake GPU: no interpreter, device 'FakeGPU', cache under tmp_path, a fake do_bench
    timing each config by its BLOCK (and running it once, as the real one does)."""
    monkeypatch.setattr(tuning, "is_interpreter", lambda: False)
    monkeypatch.setattr(tuning, "device_name", lambda: "FakeGPU")
    monkeypatch.setenv("FLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLA_TUNE", "1")
    benched = []

    def do_bench(fn, warmup=25, rep=100, return_mode="mean", **kwargs):
        assert return_mode == "median"
        fn()
        block = fake_kernel_of_last_call[0].launches[-1][1]["BLOCK"]
        benched.append(block)
        return TIMES[block]

    fake_kernel_of_last_call = []
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)

    class Gpu:
        root = tmp_path
        bench_log = benched

        @staticmethod
        def kernel(fake, default=lambda a: cfg(32), space=SPACE, **kw):
            fake_kernel_of_last_call[:] = [fake]
            return TunedKernel(fake, key=kw.pop("key", ["D"]), default=default, space=space,
                               name=kw.pop("name", NAME), **kw)

        @staticmethod
        def cache_path(device="FakeGPU", version=TRITON_VERSION_STRING, name=NAME):
            # The file name carries a hash of the kernel's source (all fakes share one).
            source_hash = TunedKernel(FakeKernel(), key=["D"], default=lambda a: cfg(32),
                                      name=name).source_hash
            return tmp_path / device / version / f"{name}-{source_hash}.json"

    return Gpu


def call(kernel, D=16, n=64, **extra):
    x = torch.randn(n)
    y = nan_like(x)
    kernel[grid](x, y, n, D=D, **extra)
    assert torch.equal(y, 2 * x)
    return y


def test_cache_miss_tunes_and_saves_the_fastest(gpu):
    fake = FakeKernel()
    k = gpu.kernel(fake)
    call(k)
    assert k.stats == {"heuristic": 0, "tuned": 1, "disk_hits": 0, "skipped_configs": 0}
    assert sorted(gpu.bench_log) == [16, 32, 64, 128]
    assert k.chosen_config(D=16) == cfg(128)
    # The real launch after tuning used the fastest config and needed no new warmup.
    assert fake.launches[-1][1]["BLOCK"] == 128
    assert fake.events[-1] == ("launch", 128)
    assert fake.blocks("warmup") == [32, 16, 64, 128]  # the default first
    saved = json.loads(gpu.cache_path().read_text())
    assert saved == {"[16]": cfg(128).to_json()}
    # Another length, same key: nothing is tuned again.
    call(k, n=1000)
    assert k.stats["tuned"] == 1 and len(gpu.bench_log) == 4
    assert fake.launches[-1][1]["BLOCK"] == 128


def test_grid_gets_the_config(gpu):
    fake = FakeKernel()
    k = gpu.kernel(fake)
    call(k, n=1000)
    grid_used, kwargs = fake.launches[-1]
    assert grid_used == (triton.cdiv(1000, 128),)
    assert kwargs["num_warps"] == 4 and kwargs["num_stages"] == 2


def test_a_new_process_reads_the_cache_without_tuning(gpu, monkeypatch):
    call(gpu.kernel(FakeKernel()))
    monkeypatch.setenv("FLA_TUNE", "0")
    fake = FakeKernel()
    k = gpu.kernel(fake)  # a new TunedKernel over the same function: a new process
    call(k)
    assert k.stats == {"heuristic": 0, "tuned": 0, "disk_hits": 1, "skipped_configs": 0}
    assert len(gpu.bench_log) == 4  # only the first process benchmarked
    assert fake.blocks("launch") == [128]
    # A config read from disk is still built once before its first launch.
    assert fake.events == [("warmup", 128), ("launch", 128)]


def test_the_cache_is_read_with_tuning_on_too(gpu):
    call(gpu.kernel(FakeKernel()))
    k = gpu.kernel(FakeKernel())
    call(k)
    assert k.stats["disk_hits"] == 1 and k.stats["tuned"] == 0
    assert len(gpu.bench_log) == 4


def test_a_different_key_is_a_miss(gpu, monkeypatch):
    call(gpu.kernel(FakeKernel()), D=16)
    monkeypatch.setenv("FLA_TUNE", "0")
    k = gpu.kernel(FakeKernel())
    call(k, D=32)
    assert k.stats == {"heuristic": 1, "tuned": 0, "disk_hits": 0, "skipped_configs": 0}
    assert k.chosen_config(D=32) == cfg(32)


def test_a_second_key_is_added_to_the_same_file(gpu):
    k = gpu.kernel(FakeKernel())
    call(k, D=16)
    call(k, D=32)
    assert k.stats["tuned"] == 2
    saved = json.loads(gpu.cache_path().read_text())
    assert set(saved) == {"[16]", "[32]"}
    assert not list(gpu.cache_path().parent.glob("*.tmp"))


@pytest.mark.parametrize("what", ["device", "version"])
def test_the_cache_is_keyed_by_gpu_and_triton_version(gpu, monkeypatch, what):
    call(gpu.kernel(FakeKernel()))
    assert gpu.cache_path().exists()
    monkeypatch.setenv("FLA_TUNE", "0")
    if what == "device":
        monkeypatch.setattr(tuning, "device_name", lambda: "OtherGPU")
    else:
        monkeypatch.setattr(tuning, "TRITON_VERSION_STRING", "9.9.9")
    k = gpu.kernel(FakeKernel())
    call(k)
    assert k.stats["disk_hits"] == 0 and k.stats["heuristic"] == 1
    assert k.chosen_config(D=16) == cfg(32)


def test_cache_file_path_is_made_safe(gpu, monkeypatch):
    monkeypatch.setattr(tuning, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    k = gpu.kernel(FakeKernel(), name="pkg/mod.kernel")
    assert k.cache_file() == (gpu.root / "NVIDIA_H100_80GB_HBM3" / TRITON_VERSION_STRING
                              / f"pkg_mod.kernel-{k.source_hash}.json")


def test_cache_file_changes_with_the_kernel_source():
    def kernel_a(x, D):
        return x

    def kernel_b(x, D):
        return x + 1

    names = [TunedKernel(type("K", (), {"fn": staticmethod(f)})(), key=["D"],
                         default=lambda a: cfg(32), name="same").cache_file()
             for f in (kernel_a, kernel_b)]
    assert names[0] != names[1]


def test_a_failing_warmup_is_skipped_while_tuning(gpu):
    fake = FakeKernel(fail_warmup={128})
    k = gpu.kernel(fake)
    call(k)
    assert k.chosen_config(D=16) == cfg(64)  # the fastest that builds
    assert 128 not in gpu.bench_log
    assert k.stats["skipped_configs"] == 1
    assert "cannot compile BLOCK=128" in k.failures[(16,)][cfg(128)]
    assert json.loads(gpu.cache_path().read_text())["[16]"] == cfg(64).to_json()


def test_a_failing_benchmark_is_skipped_while_tuning(gpu):
    fake = FakeKernel(fail_launch={128})  # builds, but fails when it runs
    k = gpu.kernel(fake)
    call(k)
    assert k.chosen_config(D=16) == cfg(64)
    assert k.stats["skipped_configs"] == 1


def test_every_config_failing_while_tuning_raises(gpu):
    k = gpu.kernel(FakeKernel(fail_warmup={16, 32, 64, 128}))
    with pytest.raises(RuntimeError, match=r"every config failed while tuning key \{'D': 16\}"
                                           r"(.|\n)*BLOCK=128"):
        call(k)
    assert not gpu.cache_path().exists()


def fake_acc_fn(x, y, n, D, acc, state, BLOCK):
    """Signature of a kernel with an accumulator and an in-place state."""


def test_reset_to_zero_before_each_trial_and_restore_after_tuning(gpu):
    fake = FakeKernel(fn=fake_acc_fn)
    k = gpu.kernel(fake, reset_to_zero=["acc"], restore=["state"])
    x = torch.randn(64)
    y = nan_like(x)
    acc = torch.full((4,), 5.0)
    state = torch.randn(4)
    state0 = state.clone()
    k[grid](x, y, 64, D=16, acc=acc, state=state)
    assert k.stats["tuned"] == 1
    # Every tuning trial started from a zeroed accumulator...
    trials = fake.acc_seen[:-1]
    assert len(trials) == 4 and all(torch.equal(a, torch.zeros(4)) for a in trials)
    # ...and the real launch saw the caller's tensors as they were passed: the call's
    # effect is exactly that of one launch.
    assert torch.equal(fake.acc_seen[-1], torch.full((4,), 5.0))
    assert torch.equal(acc, torch.full((4,), 6.0))
    assert torch.equal(state, 2 * state0)
    assert torch.equal(y, 2 * x)


def test_optional_reset_and_restore_tensors_may_be_none(gpu):
    fake = FakeKernel(fn=fake_acc_fn)
    k = gpu.kernel(fake, reset_to_zero=["acc"], restore=["state"])
    call(k, acc=None, state=None)
    assert k.stats["tuned"] == 1 and k.chosen_config(D=16) == cfg(128)


@pytest.mark.parametrize("content", [
    b"{not json",
    b"\xff\xfe\x00garbage",
    b"[1, 2, 3]",
    b'"a string"',
    b'{"[16]": "oops"}',
    b'{"[16]": {"meta": {"BLOCK": 32}}}',
    b'{"[16]": {"meta": {"BLOCK": 32}, "num_warps": "many", "num_stages": 2}}',
])
def test_a_corrupt_cache_file_is_ignored(gpu, monkeypatch, content):
    path = gpu.cache_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    monkeypatch.setenv("FLA_TUNE", "0")
    k = gpu.kernel(FakeKernel())
    call(k)
    assert k.stats == {"heuristic": 1, "tuned": 0, "disk_hits": 0, "skipped_configs": 0}
    # With tuning on, the damaged file is replaced by a good one.
    monkeypatch.setenv("FLA_TUNE", "1")
    k = gpu.kernel(FakeKernel())
    call(k)
    assert k.stats["tuned"] == 1
    assert json.loads(path.read_text())["[16]"] == cfg(128).to_json()


def test_an_unwritable_cache_warns_and_still_runs(gpu, monkeypatch):
    blocker = gpu.root / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FLA_CACHE_DIR", str(blocker))
    k = gpu.kernel(FakeKernel())
    with pytest.warns(RuntimeWarning, match="could not save tuned config"):
        call(k)
    assert k.chosen_config(D=16) == cfg(128)


# ------------------------------------------------- e. first launch on the GPU path
def test_first_launch_warms_up_then_runs(gpu, monkeypatch):
    monkeypatch.setenv("FLA_TUNE", "0")
    fake = FakeKernel()
    k = gpu.kernel(fake)
    call(k)
    assert k.stats == {"heuristic": 1, "tuned": 0, "disk_hits": 0, "skipped_configs": 0}
    assert fake.events == [("warmup", 32), ("launch", 32)]
    call(k, n=500)
    assert fake.events == [("warmup", 32), ("launch", 32), ("launch", 32)]
    assert not gpu.cache_path().exists()  # heuristics are not written to disk


def test_warmup_failure_falls_back_to_the_next_candidate(gpu, monkeypatch):
    monkeypatch.setenv("FLA_TUNE", "0")
    fake = FakeKernel(fail_warmup={32})
    k = gpu.kernel(fake)
    with pytest.warns(RuntimeWarning, match=r"failed to build on Triton .* / FakeGPU .* using "
                                            r"Config\(BLOCK=16"):
        call(k)
    assert fake.events == [("warmup", 32), ("warmup", 16), ("launch", 16)]
    assert k.chosen_config(D=16) == cfg(16)
    assert k.stats["skipped_configs"] == 1
    call(k)
    assert fake.events[-1] == ("launch", 16) and len(fake.events) == 4


def test_launch_failure_after_warmup_falls_back(gpu, monkeypatch):
    """Triton reports too much shared memory when the kernel is first loaded, at launch."""
    monkeypatch.setenv("FLA_TUNE", "0")
    fake = FakeKernel(fail_launch={32})
    k = gpu.kernel(fake)
    with pytest.warns(RuntimeWarning, match="out of resource"):
        call(k)
    assert fake.events == [("warmup", 32), ("launch", 32), ("warmup", 16), ("launch", 16)]
    assert k.chosen_config(D=16) == cfg(16)


def test_every_candidate_failing_on_the_gpu_raises(gpu, monkeypatch):
    monkeypatch.setenv("FLA_TUNE", "0")
    k = gpu.kernel(FakeKernel(fail_warmup={16, 32, 64, 128}))
    with pytest.raises(RuntimeError, match=r"no config could be built for key \{'D': 16\}"):
        call(k)
    assert k.stats["skipped_configs"] == 4


def test_a_cached_config_that_no_longer_builds_falls_back(gpu, monkeypatch):
    call(gpu.kernel(FakeKernel()))  # caches BLOCK=128
    monkeypatch.setenv("FLA_TUNE", "0")
    fake = FakeKernel(fail_warmup={128})
    k = gpu.kernel(fake)
    with pytest.warns(RuntimeWarning):
        call(k)
    assert k.stats["disk_hits"] == 1
    assert fake.events == [("warmup", 128), ("warmup", 32), ("launch", 32)]
