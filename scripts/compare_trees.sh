#!/usr/bin/env bash
# Time and test several versions of the kernels in one GPU call: each version is a plain
# source tree (a branch exported with `git archive`, no .git inside, so that it travels
# with the device copy of the working tree).
#
#     bash scripts/compare_trees.sh --export BRANCH ...     # here: writes exp/trees/BRANCH
#     bash scripts/compare_trees.sh [--tests FILES] CASES TREE ...   # on the GPU machine
#
# CASES: benchmark case selectors for benchmarks.profile_case, comma-separated (e.g.
# "chunk_gla/1x8192x96x128,chunk_rwkv6/4x4096x16x128"); TREE: "." for this checkout or
# a directory made by --export. For each tree, in turn and from inside it (so that its
# own fla is the one imported): the GPU tests of FILES (space-separated, optional; any
# failure is printed), then the do_bench median and the per-kernel times of every case
# in both modes. A table of the medians comes last, one column per tree; rounds
# alternate nothing, so run the baseline tree first and last when the spread matters.
#
# Environment: OUT (default /tmp/out) for the logs, PER_FILE for the tests (150 s),
# PROFILE_ARGS more arguments of benchmarks.profile_case (e.g. "--sequence": each step's
# launches in order; only for trees whose profile_case has them).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

if [ "${1:-}" = "--export" ]; then
    shift
    for branch in "$@"; do
        dir="exp/trees/${branch//\//_}"
        rm -rf "$dir" && mkdir -p "$dir"
        git archive "$branch" | tar -x -C "$dir"
        echo "$dir  ($(git rev-parse --short "$branch"))"
    done
    exit 0
fi

TEST_FILES=""
if [ "${1:-}" = "--tests" ]; then
    TEST_FILES="$2"; shift 2
fi
CASES="${1:?usage: compare_trees.sh [--tests FILES] CASES TREE ...}"; shift
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
IFS=',' read -r -a case_list <<< "$CASES"

declare -A median
trees=("$@")
for tree in "${trees[@]}"; do
    name=$(basename "$(cd "$tree" && pwd)")
    log="$OUT/trees_${name}.log"
    echo "== $tree"
    (
        cd "$tree" || exit 1
        if [ -n "$TEST_FILES" ]; then
            # shellcheck disable=SC2086
            OUT="$OUT/tests_$name" PER_FILE="${PER_FILE:-150}" MARK=gpu \
                bash scripts/gpu_tests.sh $TEST_FILES 2>&1 | tail -n 12
        fi
        # shellcheck disable=SC2086
        python3 -m benchmarks.profile_case "${case_list[@]}" --mode both ${PROFILE_ARGS:-} 2>&1 \
            | grep -v -i "warn" | tee "$log"
    )
    while read -r label mode ms; do
        median["$name|$label|$mode"]=$ms
    done < <(sed -n 's/^\([^ ]*\) \(fwd\|fwdbwd\): do_bench median \([0-9.]*\) ms.*/\1 \2 \3/p' "$log")
done

echo
printf '| case | mode |'
for tree in "${trees[@]}"; do printf ' %s |' "$(basename "$(cd "$tree" && pwd)")"; done
echo
printf '| --- | --- |'
for _ in "${trees[@]}"; do printf ' --- |'; done
echo
for c in "${case_list[@]}"; do
    for mode in fwd fwdbwd; do
        printf '| %s | %s |' "$c" "$mode"
        for tree in "${trees[@]}"; do
            printf ' %s |' "${median["$(basename "$(cd "$tree" && pwd)")|$c|$mode"]:-—}"
        done
        echo
    done
done
cd "$REPO"
