#!/usr/bin/env bash
# The one command for the GPU machine, run from the repo root of the copy it receives
# (carry .ref, made here by scripts/fetch_reference.sh):
#
#     bash scripts/gpu_run.sh [pytest args...]
#
# 1. prints versions and the GPU's name;
# 2. installs the reference wheels from .ref/ into /tmp/ref-site (ours is not installed:
#    it runs from the checkout with PYTHONPATH=$PWD);
# 3. runs `python3 -m pytest -m gpu -q tests [pytest args]` -> $OUT/pytest.log;
# 4. benchmarks ours and the reference, each in its own process and with its own
#    timeout (the reference from a directory where our ./fla is not importable)
#    -> $OUT/ours.json, $OUT/reference.json, $OUT/bench_*.log;
# 5. benchmarks/compare.py writes $OUT/RESULTS.md (benchmarks/RESULTS.md with its
#    generated block replaced: copy it back into the repo) and prints the table last.
#
# Environment:
#   GPU_TESTS=0          skip pytest            BENCH=0       skip the benchmarks
#   BENCH_CASES="..."    case selectors (names, op names, globs, 'all'); default: the
#                        'default' set restricted to the ops that exist in ours
#   BENCH_QUICK=1        shorter do_bench
#   BENCH_ARGS="..."     extra run_side flags (e.g. "--tiny" for a smoke test of the harness)
#   TOTAL_BUDGET=540     seconds for the whole script (the device allows 600 per command)
#   TEST_TIMEOUT         pytest's limit (default 240 s when benchmarks follow)
#   BENCH_TIMEOUT_OURS   ours' limit (default 150 s or 2/5 of what is left)
#   BENCH_TIMEOUT_REF    the reference's limit (default: what is left, less 15 s)
#   CASE_TIMEOUT_OURS=120, CASE_TIMEOUT_REF=200   per-case limits (the reference
#                        autotunes ~100 s per new shape, chunk_rwkv7 over 5 min)
#   OUT                  where results go (default /tmp/out)
#   REF_AUTOTUNE         a tarball of the reference's autotuning results (Triton's
#                        *.autotune.json files) from an earlier run, default
#                        .refcache/ref-autotune.tgz, else the committed
#                        benchmarks/reference_autotune.tgz (H100, Triton 3.6): unpacked into
#                        its Triton cache so that it skips re-benchmarking every config; the
#                        run writes the updated set to $OUT/ref-autotune.tgz (carry it back
#                        as .refcache/, or commit it as benchmarks/reference_autotune.tgz)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$SECONDS
BUDGET="${TOTAL_BUDGET:-540}"
left() { echo $(( BUDGET - (SECONDS - T0) )); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
OURS_PATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

echo "== versions"
python3 - <<'EOF' || true
import platform, torch, triton
print(f"python {platform.python_version()} | torch {torch.__version__} (CUDA {torch.version.cuda}) "
      f"| triton {triton.__version__}")
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0), "| capability",
          ".".join(map(str, torch.cuda.get_device_capability(0))))
else:
    print("device: no CUDA device visible to torch")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
    || echo "nvidia-smi: not available"

echo "== reference"
REF_SITE=/tmp/ref-site
HAVE_REF=0
if compgen -G ".ref/*.whl" >/dev/null; then
    rm -rf "$REF_SITE"
    if python3 -m pip install -q --no-index --no-deps --target "$REF_SITE" .ref/*.whl; then
        HAVE_REF=1
        ls .ref/*.whl
    else
        echo "reference: pip install of .ref/*.whl failed: the reference is not measured"
    fi
else
    echo "reference: no .ref/*.whl (run scripts/fetch_reference.sh on the dev machine and" \
         "carry .ref): the reference is not measured"
fi

TEST_RC=skipped
if [ "${GPU_TESTS:-1}" != 0 ]; then
    if [ "${BENCH:-1}" != 0 ]; then
        TT="${TEST_TIMEOUT:-240}"
    else
        TT="${TEST_TIMEOUT:-$(( $(left) - 10 ))}"
    fi
    TT=$(min "$TT" $(( $(left) - 10 )))
    echo "== pytest -m gpu (limit ${TT}s)"
    if [ "$#" -gt 0 ]; then PYTEST_ARGS=("$@"); else PYTEST_ARGS=(tests); fi
    PYTHONPATH="$OURS_PATH" timeout -k 10 "$TT" \
        python3 -m pytest -m gpu -q "${PYTEST_ARGS[@]}" 2>&1 | tee "$OUT/pytest.log"
    TEST_RC=${PIPESTATUS[0]}
    [ "$TEST_RC" = 124 ] && echo "pytest: stopped at its ${TT}s limit"
fi

OURS_RC=skipped
REF_RC=skipped
if [ "${BENCH:-1}" != 0 ]; then
    echo "== benchmarks"
    SEL="${BENCH_CASES:-default}"
    LIST_ARGS=()
    [ "$SEL" = default ] && LIST_ARGS=(--available)
    # shellcheck disable=SC2086  # selectors are words
    mapfile -t CASES < <(PYTHONPATH="$OURS_PATH" python3 -m benchmarks.run_side --list \
                             ${LIST_ARGS[@]+"${LIST_ARGS[@]}"} --cases $SEL)
    EXTRA=()
    [ "${BENCH_QUICK:-0}" != 0 ] && EXTRA=(--quick)
    # shellcheck disable=SC2206  # BENCH_ARGS: extra run_side flags, e.g. "--tiny --device cpu"
    [ -n "${BENCH_ARGS:-}" ] && EXTRA+=(${BENCH_ARGS})
    if [ "${#CASES[@]}" -eq 0 ]; then
        echo "benchmarks: no case selected (with BENCH_CASES=default only the ops that exist" \
             "in ours run; BENCH_CASES=all runs every case)"
    else
        printf 'cases: %s\n' "${CASES[*]}"
        L=$(left)
        if [ "$HAVE_REF" = 1 ]; then
            OT="${BENCH_TIMEOUT_OURS:-$(min 150 $(( L * 2 / 5 )))}"
        else
            OT="${BENCH_TIMEOUT_OURS:-$(( L - 15 ))}"
        fi
        OT=$(min "$OT" $(( L - 15 )))
        if [ "$OT" -lt 20 ]; then
            echo "benchmarks: only ${L}s left: not run"
        else
            echo "== ours (limit ${OT}s)"
            OURS_CACHE=$(mktemp -d /tmp/triton-ours.XXXXXX)
            TRITON_CACHE_DIR="$OURS_CACHE" FLA_CACHE_DIR="${FLA_CACHE_DIR:-$OURS_CACHE/fla}" \
            PYTHONPATH="$OURS_PATH" timeout -k 15 "$OT" \
                python3 -m benchmarks.run_side --label ours --out "$OUT/ours.json" \
                    --case-timeout "${CASE_TIMEOUT_OURS:-120}" ${EXTRA[@]+"${EXTRA[@]}"} \
                    --cases "${CASES[@]}" 2>&1 | tee "$OUT/bench_ours.log"
            OURS_RC=${PIPESTATUS[0]}
        fi
        if [ "$HAVE_REF" = 1 ]; then
            RT="${BENCH_TIMEOUT_REF:-$(( $(left) - 15 ))}"
            RT=$(min "$RT" $(( $(left) - 15 )))
            if [ "$RT" -lt 30 ]; then
                echo "reference: only $(left)s left: not run"
            else
                echo "== reference (limit ${RT}s)"
                # Only the harness on the path next to the reference: our ./fla must not be
                # importable there (the reference's fla extends its package path).
                HARNESS=/tmp/bench-harness
                rm -rf "$HARNESS" && mkdir -p "$HARNESS"
                cp -r benchmarks "$HARNESS/"
                REF_CACHE=$(mktemp -d /tmp/triton-ref.XXXXXX)
                REF_TUNED="${REF_AUTOTUNE:-.refcache/ref-autotune.tgz}"
                [ -f "$REF_TUNED" ] || REF_TUNED=benchmarks/reference_autotune.tgz
                if [ -f "$REF_TUNED" ]; then
                    tar xzf "$REF_TUNED" -C "$REF_CACHE" \
                        && echo "reference: autotuning results from $REF_TUNED"
                fi
                ( cd "$HARNESS" && TRITON_CACHE_DIR="$REF_CACHE" PYTHONPATH="$REF_SITE:$HARNESS" \
                    timeout -k 15 "$RT" python3 -m benchmarks.run_side --label reference \
                        --out "$OUT/reference.json" \
                        --case-timeout "${CASE_TIMEOUT_REF:-200}" ${EXTRA[@]+"${EXTRA[@]}"} \
                        --cases "${CASES[@]}" ) 2>&1 | tee "$OUT/bench_ref.log"
                REF_RC=${PIPESTATUS[0]}
                # Keep only the autotuning results (small JSON), not the compiled kernels.
                ( cd "$REF_CACHE" && find . -name '*.autotune.json' -print0 \
                    | tar czf "$OUT/ref-autotune.tgz" --null -T - ) \
                    && echo "reference: autotuning results saved to \$OUT/ref-autotune.tgz"
            fi
        fi
    fi
fi

echo "== summary: pytest rc=$TEST_RC, bench ours rc=$OURS_RC, reference rc=$REF_RC" \
     "(124: stopped at its limit), $(( SECONDS - T0 ))s"
if [ -f "$OUT/ours.json" ] || [ -f "$OUT/reference.json" ]; then
    cp benchmarks/RESULTS.md "$OUT/RESULTS.md" 2>/dev/null || true
    PYTHONPATH="$OURS_PATH" python3 -m benchmarks.compare "$OUT/ours.json" "$OUT/reference.json" \
        --results "$OUT/RESULTS.md" 2>&1 | tee "$OUT/summary.txt"
fi

case "$TEST_RC" in
    skipped|0|5) exit 0 ;;   # 5: no test selected
    *) exit "$TEST_RC" ;;
esac
