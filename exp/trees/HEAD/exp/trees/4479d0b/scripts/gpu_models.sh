#!/usr/bin/env bash
# Issue 8's model-level figures on the GPU machine (carry .ref, and .refcache if present):
#
#     bash scripts/gpu_models.sh
#
# benchmarks/model_throughput.py (training tokens/s of the ~340M GatedDeltaNet at 4 x 4096,
# decoding tokens/s at batch 1 and 64) for ours, then for the reference library in its own
# process, from a directory where our ./fla is not importable (as scripts/gpu_run.sh does),
# each under its own time limit. One JSON line per measurement -> $OUT/models.jsonl, and a
# table at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WHAT="${WHAT:-decode train}"
# MODEL_ARGS="--profile": also the per-kernel GPU time of a training step, both sides.
MODEL_ARGS="${MODEL_ARGS:-}"
TAIL="${TAIL:-20}"
# SIDES="reference": the reference alone (e.g. to let its autotuning finish and keep it).
SIDES="${SIDES:-ours reference}"

if [[ " $SIDES " == *" ours "* ]]; then
    echo "== ours"
    PYTHONPATH="$REPO" timeout -k 10 "${OURS_TIMEOUT:-200}" python3 -m benchmarks.model_throughput \
        --what $WHAT $MODEL_ARGS --out "$OUT/models.jsonl" 2>&1 | tail -n "$TAIL"
fi
[[ " $SIDES " == *" reference "* ]] || exit 0

echo "== reference"
REF_SITE=/tmp/ref-site HARNESS=/tmp/models-harness
rm -rf "$REF_SITE" "$HARNESS" && mkdir -p "$HARNESS"
python3 -m pip install -q --no-index --no-deps --target "$REF_SITE" .ref/*.whl
cp -r benchmarks "$HARNESS/"
REF_CACHE=$(mktemp -d /tmp/triton-ref.XXXXXX)
for tgz in benchmarks/reference_autotune.tgz .refcache/ref-autotune.tgz; do
    [ -f "$tgz" ] && tar xzf "$tgz" -C "$REF_CACHE"
done
# One process per measurement kind, decoding first: the reference's first training step
# autotunes for minutes, and a time limit there must not cost the decoding figures.
for what in $WHAT; do
    [ "$what" = train ] && limit="${REF_TIMEOUT:-360}" || limit="${REF_DECODE_TIMEOUT:-150}"
    ( cd "$HARNESS" && TRITON_CACHE_DIR="$REF_CACHE" PYTHONPATH="$REF_SITE:$HARNESS" \
        timeout -k 10 "$limit" python3 -m benchmarks.model_throughput \
        --what "$what" $MODEL_ARGS --out "$OUT/models.jsonl" ) 2>&1 | tail -n "$TAIL"
done
( cd "$REF_CACHE" && find . -name '*.autotune.json' -print0 \
    | tar czf "$OUT/ref-autotune.tgz" --null -T - )

echo "== table"
python3 - "$OUT/models.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("| fla | what | batch | tokens/s | step or wall s | peak MiB | note |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    t = r.get("step_s", r.get("wall_s"))
    print(f"| {r['fla']} | {r['what']} | {r['batch']} | "
          f"{r['tokens_per_s']:,.0f} | {t:.4f} | {r.get('peak_mib') or '':} | "
          f"{r.get('error', '') or '; '.join(r.get('notes', []))[:80]} |"
          if "tokens_per_s" in r else
          f"| {r['fla']} | {r['what']} | {r['batch']} | - | - | - | {r.get('error', '')} |")
PY
