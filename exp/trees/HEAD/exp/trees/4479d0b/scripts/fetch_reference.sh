#!/usr/bin/env bash
# Fetch the reference library (flash-linear-attention 0.6.0 and fla-core 0.6.0) as wheels
# into .ref/ at the repo root. Run HERE (the machine with network), once per checkout;
# the GPU call then carries .ref (run tool: carry=[".ref"]) and scripts/gpu_run.sh
# installs it apart from ours (see shared/gpu/REFERENCE.md).
set -euo pipefail
cd "$(dirname "$0")/.."

REF_VERSION="${REF_VERSION:-0.6.0}"
GIT_DIR="$(git rev-parse --git-dir 2>/dev/null || echo .git)"
mkdir -p "$GIT_DIR/info"
touch "$GIT_DIR/info/exclude"
grep -qxF '/.ref/' "$GIT_DIR/info/exclude" || echo '/.ref/' >> "$GIT_DIR/info/exclude"

mkdir -p .ref
python3 -m pip download -q --no-deps -d .ref \
    "flash-linear-attention==${REF_VERSION}" "fla-core==${REF_VERSION}"

ls -l .ref
n=$(ls .ref/*.whl 2>/dev/null | wc -l)
if [ "$n" -lt 2 ]; then
    echo "fetch_reference: expected 2 wheels in .ref, found $n" >&2
    exit 1
fi
du -sh .ref
