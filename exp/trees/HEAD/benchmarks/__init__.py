"""Side-by-side benchmarks of `fla` against the reference library (flash-linear-attention).

* :mod:`benchmarks.cases`: the registry of cases (op, shape, inputs, FLOP/byte counts).
* :mod:`benchmarks.run_side`: times whichever ``fla`` is importable, in one process, and
  writes a JSON file (``python -m benchmarks.run_side --label ours --out ours.json``).
* :mod:`benchmarks.compare`: merges two such files into a table and rewrites the
  generated part of ``benchmarks/RESULTS.md``.

``scripts/gpu_run.sh`` chains the three on the GPU machine. This package imports nothing
heavy at import time: ``compare`` needs only the standard library.
"""
