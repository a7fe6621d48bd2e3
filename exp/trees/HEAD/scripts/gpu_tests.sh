#!/usr/bin/env bash
# GPU tests file by file, each under its own time limit, so that one slow file cannot
# hide the results of the others (a pytest killed at its limit prints no report):
#
#     bash scripts/gpu_tests.sh FILE[::SELECTOR] ... [-- PYTEST ARGS]
#
# Each file runs `python3 -m pytest -p no:cacheprovider -v --tb=short -m "$MARK"` into
# $OUT/tests_<name>.log: -v writes each test's outcome as it finishes, so a file stopped
# at its limit still shows which tests passed and failed (the tracebacks come at the end
# of a file's run). The FAILED lines are echoed, and a table of passed / failed / skipped
# per file comes last.
#
# Environment: OUT (default /tmp/out), PER_FILE (seconds per file, default 150),
# MARK (default "gpu or interpret": the GPU tests and the kernel tests, which run on
# CUDA tensors when there is a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
PER_FILE="${PER_FILE:-150}"
MARK="${MARK:-gpu or interpret}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

files=()
extra=()
while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
    files+=("$1"); shift
done

summary=()
for f in "${files[@]}"; do
    name=$(basename "${f%%::*}" .py)
    # A selector gets a log of its own (FILE::test_a and FILE::test_b both run).
    [ "$f" != "${f%%::*}" ] && name="${name}_$(printf '%s' "${f#*::}" | tr -c 'A-Za-z0-9_.-' '_')"
    log="$OUT/tests_${name}.log"
    timeout -k 10 "$PER_FILE" python3 -m pytest -p no:cacheprovider -v --tb=short \
        -m "$MARK" "$f" "${extra[@]}" > "$log" 2>&1
    rc=$?
    passed=$(grep -c " PASSED" "$log")
    failed=$(grep -c " FAILED" "$log")
    skipped=$(grep -c " SKIPPED" "$log")
    state="done"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && state="stopped at ${PER_FILE}s"
    summary+=("| $f | $passed | $failed | $skipped | $state |")
    grep " FAILED" "$log" | head -n 5
done

echo "| file | passed | failed | skipped | run |"
echo "| --- | --- | --- | --- | --- |"
printf '%s\n' "${summary[@]}"
