#!/usr/bin/env bash
# Groups of test files side by side on one host (each group one scripts/gpu_tests.sh run,
# its files in turn), the logs packed into $OUT/logs.tgz (a device call brings back at
# most 8 files) and every group's table printed last:
#
#     GROUP_LIMIT=520 MARK=gpu bash scripts/gpu_test_groups.sh \
#         "tests/ops/test_gla.py tests/ops/test_rwkv6.py" "tests/ops/test_mamba2.py" \
#         -- -k "not every_tuning and not compile"
#
# TRITON_RELEASE=3.9.0 runs them on that release (scripts/gpu_other_triton.sh; carry
# .whl). Each group gets OMP_NUM_THREADS = cores / groups: the tests' float64 references
# run on the CPU, and five groups of 16 OpenMP threads each on 16 cores left some of them
# running for minutes (2026-11-26). Environment: OUT (default /tmp/out), GROUP_LIMIT
# (seconds a group, default 540), PER_FILE and MARK as for gpu_tests.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
groups=()
extra=()
while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
    groups+=("$1"); shift
done
[ "${#groups[@]}" -gt 0 ] || { echo "usage: $0 \"FILES\" ... [-- PYTEST ARGS]"; exit 2; }
LOGS=$(mktemp -d /tmp/test-groups.XXXXXX)
threads=$(( $(nproc) / ${#groups[@]} ))
[ "$threads" -ge 1 ] || threads=1
runner=(bash scripts/gpu_tests.sh)
[ -n "${TRITON_RELEASE:-}" ] && runner=(bash scripts/gpu_other_triton.sh "$TRITON_RELEASE")
if [ -n "${TRITON_RELEASE:-}" ] && [ ! -d "/tmp/triton-$TRITON_RELEASE/triton" ]; then
    # Unpacked once here, not by every group at the same time.
    mkdir -p "/tmp/triton-$TRITON_RELEASE" &&
        tar xJf ".whl/triton-$TRITON_RELEASE.tar.xz" -C "/tmp/triton-$TRITON_RELEASE" || exit 1
fi
i=0
for g in "${groups[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086  # a group is a list of files
    OUT="$LOGS/group$i" OMP_NUM_THREADS="$threads" FLA_CACHE_DIR="/tmp/fla-cache-group$i" \
        timeout -k 10 "${GROUP_LIMIT:-540}" "${runner[@]}" $g \
        ${extra[@]+-- "${extra[@]}"} > "$LOGS/group$i.txt" 2>&1 &
done
wait
for j in $(seq 1 "$i"); do
    echo "== group $j: ${groups[$((j - 1))]}"
    grep -v '^$' "$LOGS/group$j.txt" | tail -n 25
done
tar czf "$OUT/logs.tgz" -C "$LOGS" .
