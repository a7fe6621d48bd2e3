#!/usr/bin/env bash
# On the device: the GPU tests (scripts/gpu_tests.sh) on another Triton release, packed
# by scripts/pack_triton.sh and carried as .whl/triton-VERSION.tar.xz (carry [".whl"]):
#
#     bash scripts/gpu_other_triton.sh 3.3.1 FILE[::SELECTOR] ... [-- PYTEST ARGS]
#
# The release is unpacked to /tmp/triton-VERSION and put before the device's own Triton
# on PYTHONPATH, with a kernel cache of its own. The torch.compile tests do not belong
# here: torch's inductor expects the Triton it was built with.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSION="$1"; shift
DIR="/tmp/triton-$VERSION"
if [ ! -d "$DIR/triton" ]; then
    mkdir -p "$DIR" && tar xJf ".whl/triton-$VERSION.tar.xz" -C "$DIR" || exit 1
fi
export PYTHONPATH="$DIR${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton-cache-$VERSION}"
got=$(python3 -c "import triton; print(triton.__version__)") || exit 1
echo "Triton $got from $(python3 -c 'import triton, os; print(os.path.dirname(triton.__file__))')"
[ "$got" = "$VERSION" ] || { echo "expected Triton $VERSION"; exit 1; }
exec bash scripts/gpu_tests.sh "$@"
