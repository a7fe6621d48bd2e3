"""Time one op at several shapes with the harness of ``benchmarks/`` (run_side's
CaseRunner), in this process; write the records as JSON.

Used two ways by :mod:`fla.cli.bench`: imported (ours, in the ``bench`` process), and
copied next to a copy of ``benchmarks/`` and run as a script in a separate process whose
``fla`` is the reference library (the two libraries share the import name ``fla``, so
they never meet in one process). It therefore imports nothing from ``fla`` itself:

    python _bench_driver.py SPEC.json OUT.json

SPEC: ``{"op": ..., "shapes": [[...], ...], "device": "cuda", "quick": true,
"label": "ours" | "reference"}``.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace


def measure(spec: dict, log=print) -> dict:
    """``{"copy_gbps": ..., "cases": {name: run_side record}}`` for every shape."""
    from benchmarks import cases as registry
    from benchmarks import run_side

    template = next(c for c in registry.CASES if c.op == spec["op"] and not c.baseline)
    timer = run_side.Timer(spec["device"], spec.get("quick", True))
    patched = False
    if spec.get("label") == "reference":
        patched = run_side.patch_reference_check([])
    runner = run_side.CaseRunner(spec.get("label", "ours"), timer, spec["device"], patched,
                                 save=lambda: None, log=log)
    result = {"copy_gbps": None, "cases": {}}
    try:
        result["copy_gbps"] = run_side.copy_bandwidth(timer).get("copy_gbps")
    except Exception:  # noqa: BLE001 - rates against copy bandwidth are optional
        run_side.free_memory()
    for shape in spec["shapes"]:
        shape = tuple(shape)
        case = replace(template, shape=shape,
                       name=f"{template.op}/{'x'.join(str(s) for s in shape)}")
        rec = run_side.case_record(case)
        try:
            runner.run(case, rec)
        except run_side.StickyCudaError as exc:
            rec.update(status="error", error=f"CUDA context lost: {exc}")
            result["cases"][case.name] = rec
            break
        result["cases"][case.name] = rec
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[1]).read())
    result = measure(spec, log=lambda msg: print(f"[{spec.get('label')}] {msg}", flush=True))
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
