#!/usr/bin/env bash
# Nsight Compute on one kernel of one benchmark case, on the GPU machine:
#
#     bash scripts/ncu_kernel.sh CASE KERNEL [MODE] [SKIP]
#
# CASE: a benchmarks.cases selector (e.g. chunk_gla/1x8192x96x128); KERNEL: a regex of
# the kernel's name (e.g. chunk_gk_fwd_A_kernel); MODE: fwd (default) or fwdbwd; SKIP:
# matching launches to let pass first (default 6: past compilation and warm-up). One
# launch is profiled, with the sections that say what bounds a kernel: speed of light,
# occupancy and launch statistics (registers, waves), warp states (what the warps wait
# on) and the memory workload. The full report goes to $OUT/ncu_<KERNEL>.txt; its key
# lines are printed. Clocks are left as they run (`--clock-control none`), as do_bench
# sees them.
set -uo pipefail
cd "$(dirname "$0")/.."
CASE="${1:?usage: ncu_kernel.sh CASE KERNEL [MODE] [SKIP]}"
KERNEL="${2:?usage: ncu_kernel.sh CASE KERNEL [MODE] [SKIP]}"
MODE="${3:-fwd}"
SKIP="${4:-6}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
log="$OUT/ncu_$(printf '%s' "$KERNEL" | tr -c 'A-Za-z0-9_' '_').txt"
ncu --clock-control none --kernel-name "regex:$KERNEL" --launch-skip "$SKIP" \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 -m benchmarks.profile_case "$CASE" --mode "$MODE" --steps 1 > "$log" 2>&1
echo "ncu rc=$? ($log)"
grep -E "^  [a-zA-Z_]+.*\(|Duration|Registers Per Thread|Theoretical Occupancy|Achieved Occupancy|Block Limit|Waves Per SM|Memory Throughput|DRAM Throughput|L2 Hit Rate|Compute \(SM\) Throughput|Warp Cycles Per Issued|Stall|Local Memory" "$log" | head -n 40
