"""Time one side (ours or the reference) of the side-by-side benchmark, in one process.

    python -m benchmarks.run_side --label ours|reference --out FILE.json
                                  [--cases NAME ...] [--quick] [--case-timeout S]
    python -m benchmarks.run_side --list [--available] [--cases NAME ...]

Whichever ``fla`` is importable is measured: run it once with our checkout on the path
and once, in another process, with the reference library on the path and ours not
(never both in one process: the reference's ``fla`` extends its package path).

For each case (see :mod:`benchmarks.cases`):

* the op is imported; a missing module/name, an ImportError or a NotImplementedError is
  recorded as ``missing``, not raised;
* ``cold_s``: wall clock of the first call at that shape in this process (fwd+bwd where
  the case has a backward), compile and autotuning included: the cold start;
* peak memory of one call per mode (``torch.cuda.max_memory_allocated``, absolute and
  above what was allocated before the call);
* ``triton.testing.do_bench(..., return_mode='median')`` per mode: ``fwd`` runs under
  ``torch.no_grad()``; ``fwdbwd`` runs the forward and backpropagates a fixed random
  grad_output from the first output into every input (gradients reset between reps);
* an exception stops only its own mode; an OOM frees memory and the run goes on; a CUDA
  error that leaves the context unusable restarts the process for the remaining cases.

The JSON file is rewritten after every measurement, so a run killed by a timeout still
leaves what it measured. Once per run it also records the device, versions, and the
measured copy bandwidth (a 1 GiB device-to-device copy; bytes read + written).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import cases as registry
from benchmarks.cases import Case, MissingOp

SCHEMA = 1
REF_PATCH_NOTE = "reference bwd check patched out, results untrusted"
COPY_BYTES = 1 << 30          # per buffer: 1 GiB read + 1 GiB written
MAX_RESTARTS = 4
RESTART_ENV = "FLA_BENCH_RESTARTS"


class CaseTimeout(BaseException):
    """A case ran past --case-timeout (BaseException: ops' `except Exception` let it by)."""


class Terminated(BaseException):
    """SIGTERM/SIGINT: record what we have and stop."""


# ---------------------------------------------------------------------------------------
# Small utilities

def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: dict) -> None:
    """Atomic rewrite: a reader (or a kill) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def is_oom(exc: BaseException) -> bool:
    """Device memory exhausted (not Triton's OutOfResources, which is shared memory)."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc)


def describe(exc: BaseException, limit: int = 1500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " ..."


def tb_tail(exc: BaseException) -> str:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return "".join(tb)[-3000:] if tb else ""


def classify(exc: BaseException) -> str:
    if isinstance(exc, CaseTimeout):
        return "timeout"
    if isinstance(exc, (NotImplementedError, MissingOp)):
        return "missing"
    if is_oom(exc):
        return "oom"
    if "Hopper" in str(exc) and "Triton" in str(exc):
        return "refused"  # the reference's own version check
    return "error"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a broken context is detected elsewhere
            pass
        torch.cuda.empty_cache()


def cuda_usable(case_name: str = "") -> bool:
    """False when the CUDA context is broken (illegal address, device assert ...).

    ``FLA_BENCH_SIMULATE_LOST_CONTEXT=<case name>`` pretends it broke after an error in
    that case: the CPU tests use it to exercise the restart path."""
    if case_name and os.environ.get("FLA_BENCH_SIMULATE_LOST_CONTEXT") == case_name:
        return False
    if not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        x = torch.ones(4, device="cuda")
        return float((x + 1).sum().item()) == 8.0
    except Exception:  # noqa: BLE001
        return False


class Timer:
    """do_bench on CUDA; a plain median of wall-clock runs elsewhere (CPU smoke tests)."""

    def __init__(self, device: str, quick: bool):
        self.device = device
        # Quick runs warm up 100 ms too: after a cold start's seconds of compiling the GPU
        # idles, and 10 ms of warm-up left some medians 1.2-2.6x the settled ones (H100,
        # 2026-11-26: chunk_gla 4x2048x16x128 fwd+bwd 0.99-1.38 ms against 0.85).
        self.warmup, self.rep = (100, 40) if quick else (100, 200)
        self.cpu_runs = 3 if quick else 5

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def median_ms(self, fn: Callable[[], Any], grad_to_none=None) -> float:
        if self.device == "cuda":
            import triton.testing
            return float(triton.testing.do_bench(fn, warmup=self.warmup, rep=self.rep,
                                                 grad_to_none=grad_to_none,
                                                 return_mode="median"))
        times = []
        for _ in range(self.cpu_runs):
            for x in grad_to_none or []:
                x.grad = None
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return float(statistics.median(times))


# ---------------------------------------------------------------------------------------
# Run-level facts

def environment(label: str, device: str) -> dict:
    import triton
    info: dict[str, Any] = {
        "label": label, "device_kind": device, "torch": torch.__version__,
        "cuda": torch.version.cuda, "triton": triton.__version__,
        "python": platform.python_version(), "host": platform.node(),
        "argv": sys.argv[1:],
        "env": {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "FLA_TUNE", "FLA_CACHE_DIR",
                                                "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES",
                                                "PYTHONPATH")},
    }
    cache = os.environ.get("TRITON_CACHE_DIR")
    if cache:
        p = Path(cache)
        info["triton_cache_empty_at_start"] = not p.exists() or not any(p.iterdir())
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    sm_count=props.multi_processor_count,
                    total_memory_gib=round(props.total_memory / 2 ** 30, 1))
    else:
        info["device"] = platform.processor() or "cpu"
    try:
        import fla
        info["fla_version"] = getattr(fla, "__version__", None)
        info["fla_file"] = getattr(fla, "__file__", None) or str(list(getattr(fla, "__path__", [])))
    except Exception as exc:  # noqa: BLE001 - recorded; every case will say missing
        info["fla_import_error"] = describe(exc)
    return info


def check_isolation(label: str, env: dict, notes: list) -> None:
    """Ours must be the checkout next to this file; the reference must not be."""
    here = Path(__file__).resolve().parent.parent
    fla_file = env.get("fla_file") or ""
    ours_here = fla_file.startswith(str(here / "fla"))
    if label == "reference" and ours_here:
        raise SystemExit(f"run_side: label 'reference' but the fla imported is ours "
                         f"({fla_file}); run it from a directory where ./fla is not "
                         f"importable, with the reference first on PYTHONPATH")
    if label == "ours" and fla_file and not ours_here:
        notes.append(f"label 'ours' but fla was imported from {fla_file}")


def patch_reference_check(notes: list) -> bool:
    """flash-linear-attention refuses its gated backward on Hopper with Triton 3.4-3.7.0;
    flip its module-level flag so that it can be timed (results then untrusted)."""
    try:
        import fla.ops.common.chunk_o as chunk_o
    except Exception as exc:  # noqa: BLE001
        notes.append(f"could not import fla.ops.common.chunk_o to patch its check: "
                     f"{describe(exc, 300)}")
        return False
    if hasattr(chunk_o, "TRITON_ABOVE_3_7_1"):
        was = chunk_o.TRITON_ABOVE_3_7_1
        chunk_o.TRITON_ABOVE_3_7_1 = True
        if not was:
            notes.append(REF_PATCH_NOTE + " (fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 "
                         "set to True before the gated backward)")
            return True
    return False


def copy_bandwidth(timer: Timer) -> dict:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    if timer.device != "cuda":
        return {"copy_gbps": None, "copy_bytes": None}
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = timer.median_ms(lambda: dst.copy_(src))
    del src, dst
    free_memory()
    return {"copy_gbps": 2 * COPY_BYTES / ms / 1e6, "copy_bytes": 2 * COPY_BYTES, "copy_ms": ms}


# ---------------------------------------------------------------------------------------
# One case

def case_record(case: Case) -> dict:
    return {
        "name": case.name, "op": case.op, "family": case.family, "path": case.path,
        "shape": list(case.shape), "dims": case.dims, "baseline": case.baseline,
        "baseline_for": case.baseline_for, "issue": case.issue, "note": case.note,
        "status": "pending", "error": None, "notes": [], "cold_s": None, "cold_mode": None,
        "modes": {},
    }


class CaseRunner:
    def __init__(self, label: str, timer: Timer, device: str, patched: bool,
                 save: Callable[[], None], log: Callable[[str], None]):
        self.label, self.timer, self.device = label, timer, device
        self.patched, self.save, self.log = patched, save, log

    def run(self, case: Case, rec: dict) -> None:
        """Fill ``rec`` in place (saving after each step). Exceptions stay inside."""
        if case.baseline and self.label != "ours":
            rec.update(status="skipped", error="plain-PyTorch baseline: timed with ours only")
            return
        try:
            fn = case.resolve()
        except MissingOp as exc:
            rec.update(status="missing", error=str(exc))
            return
        except (Terminated, CaseTimeout):
            raise
        except BaseException as exc:  # noqa: BLE001 - a module that fails on import
            rec.update(status="error", error=f"import failed: {describe(exc)}",
                       traceback=tb_tail(exc))
            return
        if self.patched and case.ref_gated_bwd and "fwdbwd" in case.modes:
            rec["notes"].append(REF_PATCH_NOTE)
        try:
            self._run_modes(case, fn, rec)
        finally:
            statuses = [m["status"] for m in rec["modes"].values()]
            if statuses and all(s == "ok" for s in statuses):
                rec["status"] = "ok"
            elif any(s == "ok" for s in statuses):
                rec["status"] = "partial"
            elif statuses:
                rec["status"] = statuses[0]
                rec["error"] = rec["error"] or next(
                    (m.get("error") for m in rec["modes"].values() if m.get("error")), None)
            free_memory()

    def _run_modes(self, case: Case, fn: Any, rec: dict) -> None:
        has_bwd = "fwdbwd" in case.modes
        prepared = None
        try:
            prepared = case.prepare(fn, self.device, grad=has_bwd)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, Terminated):
                raise
            status = classify(exc)
            for mode in case.modes:
                rec["modes"][mode] = {"status": status, "error": describe(exc),
                                      "traceback": tb_tail(exc), **self._work(case, mode)}
            return
        # fwd+bwd first, so that its first call is the cold start.
        order = [m for m in ("fwdbwd", "fwd") if m in case.modes]
        do = None
        for mode in order:
            entry = {"status": "running", "ms": None, **self._work(case, mode)}
            rec["modes"][mode] = entry
            out = target = None
            oom = False
            try:
                if mode == "fwdbwd":
                    if rec["cold_s"] is None:
                        self.timer.sync()
                        t0 = time.perf_counter()
                    out = prepared.forward()
                    target = prepared.grad_target(out)
                    gen = torch.Generator(device=self.device).manual_seed(case.seed + 1)
                    do = torch.randn(target.shape, generator=gen, device=self.device,
                                     dtype=torch.float32).to(target.dtype)
                    torch.autograd.backward(target, do)
                    self.timer.sync()
                    if rec["cold_s"] is None:
                        rec.update(cold_s=time.perf_counter() - t0, cold_mode="fwdbwd")
                    del out, target

                    def step(p=prepared, d=do):
                        result = p.forward()
                        torch.autograd.backward(p.grad_target(result), d)
                else:
                    def step(p=prepared):
                        with torch.no_grad():
                            p.forward()

                    self.timer.sync()
                    t0 = time.perf_counter()
                    step()
                    self.timer.sync()
                    if rec["cold_s"] is None:
                        rec.update(cold_s=time.perf_counter() - t0, cold_mode="fwd")
                self.save()
                step()  # one warm call (a mode may compile kernels the other did not)
                entry.update(self._memory(step, prepared.leaves))
                entry["ms"] = self.timer.median_ms(step, grad_to_none=prepared.leaves or None)
                entry["status"] = "ok"
                self.log(f"{case.name} {mode}: {entry['ms']:.4f} ms"
                         + (f", cold {rec['cold_s']:.1f} s" if mode == order[0] else "")
                         + (f", peak +{entry['extra_mem_bytes'] / 2**20:.0f} MiB"
                            if entry.get("extra_mem_bytes") is not None else ""))
            except Terminated:
                entry.update(status="killed", error="terminated while running")
                raise
            except BaseException as exc:  # noqa: BLE001 - recorded per mode
                status = classify(exc)
                entry.update(status=status, error=describe(exc), traceback=tb_tail(exc))
                self.log(f"{case.name} {mode}: {status}: {describe(exc, 300)}")
                for x in prepared.leaves:
                    x.grad = None
                oom = status == "oom"
                if status == "timeout":
                    break
                if not oom and not cuda_usable(case.name):
                    raise StickyCudaError(describe(exc)) from exc
            finally:
                for note in prepared.notes:
                    if note not in rec["notes"]:
                        rec["notes"].append(note)
                self.save()
            if oom:
                # Outside the except block, so that the traceback's frames (holding the
                # tensors of the failed call) are gone before the cache is emptied.
                out = target = None
                free_memory()

    def _work(self, case: Case, mode: str) -> dict:
        return {"work": case.work_for(mode)}

    def _memory(self, step: Callable[[], None], leaves: list) -> dict:
        if self.device != "cuda":
            return {"peak_mem_bytes": None, "extra_mem_bytes": None}
        for x in leaves:
            x.grad = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        for x in leaves:
            x.grad = None
        return {"peak_mem_bytes": int(peak), "extra_mem_bytes": int(peak - base),
                "base_mem_bytes": int(base)}


class StickyCudaError(Exception):
    """The CUDA context is unusable after an error: the process must be replaced."""


# ---------------------------------------------------------------------------------------
# Driver

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_side", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", choices=("ours", "reference"))
    p.add_argument("--out", type=Path, help="JSON file to write")
    p.add_argument("--cases", nargs="*", default=[],
                   help="case names, op/family names, globs, 'default' or 'all' "
                        "(default: default)")
    p.add_argument("--quick", action="store_true", help="shorter do_bench (10/40 ms)")
    p.add_argument("--case-timeout", type=float, default=0.0,
                   help="seconds one case may take (0 = no limit); past it the case is "
                        "recorded as timeout and the next one starts")
    p.add_argument("--list", action="store_true", help="print the selected case names")
    p.add_argument("--available", action="store_true",
                   help="with --list: keep only cases whose op imports here")
    p.add_argument("--resume", action="store_true",
                   help="keep the cases already in --out and run the others")
    p.add_argument("--no-patch-reference-check", action="store_true",
                   help="leave the reference's Hopper backward check in place")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--tiny", action="store_true",
                   help="shrink every shape (smoke test of the harness, e.g. on CPU)")
    args = p.parse_args(argv)
    if not args.list and (args.label is None or args.out is None):
        p.error("--label and --out are required (or use --list)")
    return args


def available(selection: list[Case]) -> list[Case]:
    ok: list[Case] = []
    dropped: set[str] = set()
    for case in selection:
        if case.baseline:
            ok.append(case)
            continue
        try:
            case.resolve()
            ok.append(case)
        except MissingOp:
            dropped.add(case.name)
        except Exception as exc:  # noqa: BLE001 - broken on import: not runnable either
            print(f"run_side: {case.path}: import failed: {describe(exc, 300)}",
                  file=sys.stderr)
            dropped.add(case.name)
    return [c for c in ok if not (c.baseline and c.baseline_for in dropped)]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        selection = registry.select(args.cases)
    except ValueError as exc:
        print(f"run_side: {exc}", file=sys.stderr)
        return 2
    if args.list:
        if args.available:
            selection = available(selection)
        for case in selection:
            print(case.name)
        return 0
    if args.tiny:
        selection = [c.tiny() for c in selection]

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    label = args.label

    def log(msg: str) -> None:
        print(f"[{label}] {msg}", flush=True)

    data: dict[str, Any] | None = None
    if args.resume and args.out.exists():
        try:
            data = json.loads(args.out.read_text())
        except (OSError, ValueError):
            data = None
    timer = Timer(device, args.quick)
    if data is None:
        data = {"schema": SCHEMA, "label": label, "started": now_iso(), "finished": None,
                "env": environment(label, device), "notes": [],
                "settings": {"quick": args.quick, "warmup_ms": timer.warmup,
                             "rep_ms": timer.rep, "return_mode": "median",
                             "tiny": args.tiny, "dtype": "bfloat16",
                             "case_timeout_s": args.case_timeout},
                "cases": {}}
        check_isolation(label, data["env"], data["notes"])
    out = args.out

    def save() -> None:
        write_json(out, data)

    patched = False
    if label == "reference" and not args.no_patch_reference_check:
        patched = patch_reference_check(data["notes"])
        # After a restart the flag is set again in the new process; the note is there.
        patched = patched or any(n.startswith(REF_PATCH_NOTE) for n in data["notes"])
    if "copy_gbps" not in data:
        try:
            data.update(copy_bandwidth(timer))
        except Exception as exc:  # noqa: BLE001
            data.update(copy_gbps=None, copy_error=describe(exc))
            free_memory()
        if data.get("copy_gbps"):
            log(f"copy bandwidth {data['copy_gbps']:.0f} GB/s on {data['env'].get('device')}")
    save()

    # SIGTERM (the outer `timeout`) and SIGINT: stop at the next bytecode, keep results.
    def on_signal(signum, frame):
        raise Terminated(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def on_alarm(signum, frame):
        raise CaseTimeout(f"case ran past --case-timeout {args.case_timeout:g} s")

    use_alarm = args.case_timeout > 0 and hasattr(signal, "SIGALRM")
    if use_alarm:
        signal.signal(signal.SIGALRM, on_alarm)

    runner = CaseRunner(label, timer, device, patched, save, log)
    todo = [c for c in selection
            if not (args.resume and data["cases"].get(c.name, {}).get("status")
                    not in (None, "pending", "running"))]
    exit_code = 0
    for index, case in enumerate(todo):
        rec = case_record(case)
        data["cases"][case.name] = rec
        rec["status"] = "running"
        save()
        try:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, args.case_timeout)
            try:
                runner.run(case, rec)
            finally:
                if use_alarm:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except CaseTimeout as exc:  # fired outside a mode (e.g. while preparing)
            rec.update(status="timeout", error=str(exc))
            free_memory()
        except Terminated as exc:
            if rec["status"] in ("pending", "running"):
                rec["status"] = "killed"
            rec["error"] = rec["error"] or f"process terminated ({exc}) during this case"
            data["notes"].append(f"terminated ({exc}) during {case.name}; later cases not run")
            exit_code = 124
            break
        except StickyCudaError as exc:
            rec["notes"].append("the CUDA context was unusable after this case's error")
            rest = [c.name for c in todo[index + 1:]]
            restarts = int(os.environ.get(RESTART_ENV, "0"))
            if rest and restarts < MAX_RESTARTS:
                data["notes"].append(f"process restarted after a CUDA error in {case.name}: "
                                     f"{exc}")
                save()
                restart(args, rest, restarts + 1)
            data["notes"].append(f"CUDA context lost in {case.name}"
                                 + ("; later cases not run" if rest else ""))
            exit_code = 1
            break
        except Exception as exc:  # noqa: BLE001 - a harness bug must not stop the run
            rec.update(status="error", error=f"harness: {describe(exc)}", traceback=tb_tail(exc))
            free_memory()
        finally:
            log(f"{case.name}: {rec['status']}"
                + (f" ({rec['error'][:200]})" if rec.get("error") and rec["status"] != "ok"
                   else ""))
            save()
    data["finished"] = now_iso()
    save()
    return exit_code


def restart(args: argparse.Namespace, rest: list[str], count: int) -> None:
    """Replace this process (broken CUDA context) by a fresh one for the remaining cases."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[RESTART_ENV] = str(count)
    cmd = [sys.executable, "-m", "benchmarks.run_side", "--label", args.label,
           "--out", str(args.out), "--resume", "--cases", *rest]
    for flag, on in (("--quick", args.quick), ("--tiny", args.tiny),
                     ("--no-patch-reference-check", args.no_patch_reference_check)):
        if on:
            cmd.append(flag)
    if args.case_timeout:
        cmd += ["--case-timeout", str(args.case_timeout)]
    if args.device:
        cmd += ["--device", args.device]
    os.execv(sys.executable, cmd)


if __name__ == "__main__":
    sys.exit(main())
