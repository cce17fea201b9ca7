#!/usr/bin/env bash
# The recipe's acceptance run: the CNN on Fashion-MNIST, 2 workers on loopback, global batch 256,
# linear LR scaling + 1 warmup epoch + cosine decay, EPOCHS epochs in float32; then the same job
# under mixed_bfloat16 for BF16_STEPS steps per epoch (on a CPU without bfloat16 instructions a
# whole bf16 run takes hours). Prints JSON lines: float32's test accuracy and samples/s, bf16's
# samples/s, and their ratio measured in this run (the steady-state float32 epoch against bf16).
# Usage: bench/recipe.sh [EPOCHS=10] [BF16_STEPS=40]   (make bench-recipe)
set -euo pipefail
cd "$(dirname "$0")/.."
FLOTILLA=${FLOTILLA:-build/flotilla}
EPOCHS=${1:-10}
BF16_STEPS=${2:-40}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(train --model cnn --batch-per-replica 128 --lr-scaling linear --warmup-epochs 1
        --schedule cosine)
"$FLOTILLA" launch --workers 2 -- flotilla "${common[@]}" --epochs "$EPOCHS" \
  --precision float32 --metrics-json "$tmp/fp32.json" >"$tmp/fp32.log" 2>&1
"$FLOTILLA" launch --workers 2 -- flotilla "${common[@]}" --epochs 2 \
  --steps-per-epoch "$BF16_STEPS" --precision mixed_bfloat16 --metrics-json "$tmp/bf16.json" \
  >"$tmp/bf16.log" 2>&1
# Same-run float32 reference at bf16's step count (the epoch-2 figure skips start-up).
"$FLOTILLA" launch --workers 2 -- flotilla "${common[@]}" --epochs 2 \
  --steps-per-epoch "$BF16_STEPS" --precision float32 --metrics-json "$tmp/fp32short.json" \
  >"$tmp/fp32short.log" 2>&1
python3 - "$tmp" "$EPOCHS" "$BF16_STEPS" <<'PY'
import json, sys
tmp, epochs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def lines(name):
    return [json.loads(l) for l in open(f"{tmp}/{name}.json")]
fp32 = lines("fp32")
test = [l for l in fp32 if "test_accuracy" in l][0]
epochs_rows = [l for l in fp32 if "epoch" in l]
sps = sorted(l["samples_per_s"] for l in epochs_rows)[len(epochs_rows) // 2]
print(json.dumps({"bench": "recipe", "precision": "float32", "epochs": epochs,
                  "global_batch": 256, "test_accuracy": test["test_accuracy"],
                  "train_accuracy_by_epoch": [round(l["accuracy"], 4) for l in epochs_rows],
                  "median_samples_per_s": round(sps, 1)}))
bf16 = [l for l in lines("bf16") if "epoch" in l][-1]
ref = [l for l in lines("fp32short") if "epoch" in l][-1]
print(json.dumps({"bench": "recipe", "precision": "mixed_bfloat16", "steps": steps,
                  "samples_per_s": round(bf16["samples_per_s"], 1),
                  "float32_samples_per_s": round(ref["samples_per_s"], 1),
                  "ratio": round(bf16["samples_per_s"] / ref["samples_per_s"], 3),
                  "of": "bf16/float32", "train_accuracy_bf16": round(bf16["accuracy"], 4),
                  "train_accuracy_float32": round(ref["accuracy"], 4)}))
PY
