#!/usr/bin/env bash
# Packs a Triton release small enough to travel with a device call (64 MiB in all), so
# that the GPU tests can run on a release other than the device's own:
#
#     bash scripts/pack_triton.sh 3.3.1 [PYTHON_VERSION]    # -> .whl/triton-3.3.1.tar.xz
#
# The wheel (~150 MB, 540 MB installed) is cut to what compiling and launching kernels
# needs on an H100: libtriton.so stripped of its debug sections (323 -> 127 MB for 3.3.1;
# the dynamic symbols Python loads stay), the ptxas it runs for sm_90 (its own: an older
# Triton cannot read a newer CUDA's version, 3.3.1 knows CUDA up to 12.x), libdevice and
# the CUDA headers for its launcher. Left out: CUPTI and the profiler, the instrumentation
# libraries, nvdisasm, cuobjdump, the other ptxas and the AMD backend. xz -9 then gives
# ~35 MB for 3.3.1, ~50 MB for 3.9.0.
# PYTHON_VERSION is the device's (3.12: KINDS.md). On the device:
#     bash scripts/gpu_other_triton.sh 3.3.1 FILE ... [-- PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="$1"
PY="${2:-3.12}"
TAG="cp${PY/./}"
WORK=$(mktemp -d /tmp/pack-triton.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
    "triton==$VERSION" -d "$WORK"
mkdir "$WORK/x"
unzip -q "$WORK"/triton-"$VERSION"-"$TAG"-*.whl -d "$WORK/x"
T="$WORK/x/triton"
rm -rf "$T"/backends/nvidia/lib/cupti* "$T/instrumentation" "$T/_C/libproton.so" \
    "$T/profiler" "$T/backends/amd" "$T/backends/nvidia/bin/nvdisasm" \
    "$T/backends/nvidia/bin/cuobjdump"
# The ptxas that compiles for sm_90: "ptxas" up to 3.8 ("ptxas-blackwell" from sm_100
# on); 3.9 runs "ptxas-blackwell" from sm_90 on (`if arch < 90: ptxas`).
if grep -q "arch < 90" "$T/backends/nvidia/compiler.py"; then
    rm -f "$T/backends/nvidia/bin/ptxas"
else
    rm -f "$T/backends/nvidia/bin/ptxas-blackwell"
fi
strip --strip-unneeded "$T/_C/libtriton.so"
# Newer releases find their backends through the dist-info's entry points: drop AMD's.
sed -i '/^amd *= *triton.backends.amd/d' "$WORK"/x/triton-"$VERSION".dist-info/entry_points.txt \
    2>/dev/null || true
mkdir -p .whl
tar cf - -C "$WORK/x" . | xz -9 -T0 > ".whl/triton-$VERSION.tar.xz"
ls -la ".whl/triton-$VERSION.tar.xz"
