#!/usr/bin/env bash
# Issue 9's multi-GPU check, for the 2-GPU machine (nvidia-h200-x2 through the device tool):
#
#     bash scripts/multi_gpu_check.sh            # ~340M GatedDeltaNet, bf16, 2 GPUs
#     SIZE=tiny DEVICE=cpu NPROC=2 STEPS=6 bash scripts/multi_gpu_check.sh   # CPU smoke (gloo)
#
# Trains the same model twice with the same global batch and seed: once in one process on
# one GPU, once with `torchrun --nproc_per_node=$NPROC` (FSDP2). It then compares the two
# loss curves at each logged step and the steady-state tokens/s (median of the logged rates
# after the first WARM steps, which compile kernels), and prints a table. Both runs'
# metrics and logs land in $OUT.
#
# The one-process run accumulates gradients over ONE_ACCUM micro-batches (default NPROC):
# the same global batch, and the same work per GPU per micro-step as each of the N
# processes. Without it, the N-process run's GPUs get 1/N of the work per step and the
# check measures the host's launch rate rather than the scaling.
#
# NOISE_SEED=S adds a third run: the one-process run again with --seed S (another
# initialisation and data order), whose distance from the first gives the scale of
# "within noise" for the comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SIZE="${SIZE:-340m}"
DEVICE="${DEVICE:-cuda}"
NPROC="${NPROC:-2}"
STEPS="${STEPS:-60}"
WARM="${WARM:-10}"
SEQ="${SEQ_LEN:-2048}"
BATCH="${BATCH:-32}"
ONE_ACCUM="${ONE_ACCUM:-$NPROC}"
ARGS=(train --model "${MODEL:-gated_deltanet}" --size "$SIZE" --seq-len "$SEQ"
      --batch-size "$BATCH" --max-steps "$STEPS" --warmup 10 --lr 1e-3 --log-every "${LOG_EVERY:-5}"
      --eval-every 1000000 --eval-batches 2 --sample-tokens 0 --no-plot --device "$DEVICE"
      --seed 0)
NOISE_SEED="${NOISE_SEED:-}"

python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__,
'| gpus', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"

echo "== one process (gradient accumulation over $ONE_ACCUM micro-batches)"
CUDA_VISIBLE_DEVICES="${ONE_GPU:-0}" python3 -m fla "${ARGS[@]}" --grad-accum "$ONE_ACCUM" --out /tmp/mg-one \
    2>&1 | tee "$OUT/train_one.log" | grep -v "it/s\]$" | tail -n 15
ONE_RC=${PIPESTATUS[0]}

echo "== torchrun --nproc_per_node=$NPROC"
torchrun --standalone --nproc_per_node="$NPROC" -m fla "${ARGS[@]}" --out /tmp/mg-multi \
    2>&1 | tee "$OUT/train_multi.log" | grep -v "it/s\]$" | tail -n 15
MULTI_RC=${PIPESTATUS[0]}
if [ -n "$NOISE_SEED" ]; then
    echo "== one process, --seed $NOISE_SEED (the noise scale)"
    CUDA_VISIBLE_DEVICES="${ONE_GPU:-0}" python3 -m fla "${ARGS[@]}" --grad-accum "$ONE_ACCUM" \
        --seed "$NOISE_SEED" --out /tmp/mg-noise 2>&1 | tee "$OUT/train_noise.log" | tail -n 4
    cp /tmp/mg-noise/metrics.jsonl "$OUT/metrics_noise.jsonl" 2>/dev/null
fi
cp /tmp/mg-one/metrics.jsonl "$OUT/metrics_one.jsonl" 2>/dev/null
cp /tmp/mg-multi/metrics.jsonl "$OUT/metrics_multi.jsonl" 2>/dev/null

echo "== compare (rc one=$ONE_RC, multi=$MULTI_RC)"
python3 - "$OUT/metrics_one.jsonl" "$OUT/metrics_multi.jsonl" "$WARM" "$NPROC" \
    /tmp/mg-multi "${NOISE_SEED:+$OUT/metrics_noise.jsonl}" <<'EOF'
import json, pathlib, statistics, sys

one_path, multi_path, warm, nproc, multi_dir, noise_path = sys.argv[1:7]
warm, nproc = int(warm), int(nproc)

def train_rows(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        if "tok_per_s" in r:
            out[r["step"]] = r
    return out

one, multi = train_rows(one_path), train_rows(multi_path)
steps = sorted(set(one) & set(multi))
key = "loss"
diffs = [abs(one[s][key] - multi[s][key]) for s in steps]
rel = [d / abs(one[s][key]) for d, s in zip(diffs, steps)]
rate = lambda rs: statistics.median(r["tok_per_s"] for s, r in rs.items() if s > warm)
r1, rn = rate(one), rate(multi)
print(f"logged steps compared: {len(steps)}; step {steps[0]}: {one[steps[0]][key]:.4f} / "
      f"{multi[steps[0]][key]:.4f}; last step {steps[-1]}: {one[steps[-1]][key]:.4f} / "
      f"{multi[steps[-1]][key]:.4f}")
print(f"max |loss_1 - loss_{nproc}| = {max(diffs):.4g} (relative {max(rel):.3g}); "
      f"mean relative {statistics.mean(rel):.3g}")
if noise_path:
    noise = train_rows(noise_path)
    gaps = [abs(one[s][key] - noise[s][key]) / abs(one[s][key]) for s in steps if s in noise]
    print(f"noise scale (seed 0 vs another seed, one process): max relative "
          f"{max(gaps):.3g}, mean relative {statistics.mean(gaps):.3g}")
ckpt = pathlib.Path(multi_dir) / "checkpoint"
print(f"multi-process checkpoint: {'present' if ckpt.exists() else 'MISSING'} "
      f"({', '.join(sorted(p.name for p in ckpt.iterdir())) if ckpt.exists() else ''})")
print()
print("| run | tokens/s (median after step %d) | scaling |" % warm)
print("| --- | --- | --- |")
print(f"| 1 process | {r1:,.0f} | 1.00x |")
print(f"| {nproc} processes (FSDP2) | {rn:,.0f} | {rn / r1:.2f}x |")
EOF
