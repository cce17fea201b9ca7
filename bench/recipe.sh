#!/usr/bin/env bash
# The recipe's acceptance run: MODEL on Fashion-MNIST, 2 workers on loopback, global batch 256,
# linear LR scaling + 1 warmup epoch + cosine decay, EPOCHS epochs in PRECISION; then the same
# job under mixed_bfloat16 and float32 for BF16_STEPS steps per epoch (on a CPU without bfloat16
# instructions a whole bf16 run takes hours). Prints JSON lines: the long run's test accuracy,
# accuracy curve, wall time and samples/s, then bf16's samples/s against float32's measured in
# this run (the steady-state epoch), each naming the machine (bench/machine.sh).
# MODEL=cnn: float32, as before. MODEL=resnet20: with flip + crop augmentation and weight decay
# 5e-4 (EXTRA replaces those), 15 epochs by default.
# Usage: [MODEL=cnn|resnet20] [PRECISION=...] [EXTRA="..."] bench/recipe.sh [EPOCHS] [BF16_STEPS=40]
#   (make bench-recipe)
set -euo pipefail
cd "$(dirname "$0")/.."
FLOTILLA=${FLOTILLA:-build/flotilla}
MODEL=${MODEL:-cnn}
case $MODEL in
  cnn) default_epochs=10; default_precision=float32; default_extra="" ;;
  resnet20) default_epochs=15; default_precision=auto; default_extra="--augment --weight-decay 5e-4 --validation" ;;
  *) default_epochs=10; default_precision=auto; default_extra="" ;;
esac
EPOCHS=${1:-$default_epochs}
BF16_STEPS=${2:-40}
PRECISION=${PRECISION:-$default_precision}
EXTRA=${EXTRA-$default_extra}
machine=$(bench/machine.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2206
common=(train --model "$MODEL" --batch-per-replica 128 --lr-scaling linear --warmup-epochs 1
        --schedule cosine $EXTRA)
start=$(date +%s)
"$FLOTILLA" launch --workers 2 -- flotilla "${common[@]}" --epochs "$EPOCHS" \
  --precision "$PRECISION" --metrics-json "$tmp/fp32.json" >"$tmp/fp32.log" 2>&1 ||
  { tail -20 "$tmp/fp32.log" >&2; exit 1; }
wall=$(($(date +%s) - start))
"$FLOTILLA" launch --workers 2 -- flotilla "${common[@]}" --epochs 2 \
  --steps-per-epoch "$BF16_STEPS" --precision mixed_bfloat16 --metrics-json "$tmp/bf16.json" \
  >"$tmp/bf16.log" 2>&1
# Same-run float32 reference at bf16's step count (the epoch-2 figure skips start-up).
"$FLOTILLA" launch --workers 2 -- flotilla "${common[@]}" --epochs 2 \
  --steps-per-epoch "$BF16_STEPS" --precision float32 --metrics-json "$tmp/fp32short.json" \
  >"$tmp/fp32short.log" 2>&1
python3 - "$tmp" "$EPOCHS" "$BF16_STEPS" "$MODEL" "$PRECISION" "$wall" "$machine" <<'PY'
import json, sys
tmp, epochs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, precision, wall, machine = sys.argv[4], sys.argv[5], int(sys.argv[6]), json.loads(sys.argv[7])
def lines(name):
    return [json.loads(l) for l in open(f"{tmp}/{name}.json")]
fp32 = lines("fp32")
test = [l for l in fp32 if "test_accuracy" in l][0]
epochs_rows = [l for l in fp32 if "epoch" in l]
sps = sorted(l["samples_per_s"] for l in epochs_rows)[len(epochs_rows) // 2]
print(json.dumps({"bench": "recipe", "model": model, "precision": precision, "epochs": epochs,
                  "global_batch": 256, "test_accuracy": test["test_accuracy"],
                  "train_accuracy_by_epoch": [round(l["accuracy"], 4) for l in epochs_rows],
                  "train_loss_by_epoch": [round(l["loss"], 4) for l in epochs_rows],
                  "val_accuracy_by_epoch": [round(l["val_accuracy"], 4) for l in epochs_rows
                                            if "val_accuracy" in l],
                  "median_samples_per_s": round(sps, 1), "wall_seconds": wall,
                  "machine": machine}))
bf16 = [l for l in lines("bf16") if "epoch" in l][-1]
ref = [l for l in lines("fp32short") if "epoch" in l][-1]
print(json.dumps({"bench": "recipe", "model": model, "precision": "mixed_bfloat16", "steps": steps,
                  "samples_per_s": round(bf16["samples_per_s"], 1),
                  "float32_samples_per_s": round(ref["samples_per_s"], 1),
                  "ratio": round(bf16["samples_per_s"] / ref["samples_per_s"], 3),
                  "of": "bf16/float32", "train_accuracy_bf16": round(bf16["accuracy"], 4),
                  "train_accuracy_float32": round(ref["accuracy"], 4), "machine": machine}))
PY
