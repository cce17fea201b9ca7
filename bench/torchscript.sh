#!/usr/bin/env bash
# `make bench-torchscript`: what a model from Python costs against the same layers built in C++.
# The zoo's MODELS and their PyTorch twins (bench/peers/common.py), the twins scripted with
# torch.jit.script and trained as --model PATH; 2 workers on loopback, the recipe's defaults
# (PRECISION=auto: bf16 where the CPU has it), interleaved RUNS times; the step time is the
# chief's second epoch's seconds / steps. Prints JSON lines: the median step_ms of each, then the
# ratio script/zoo per model.
# Usage: bench/torchscript.sh [STEPS=30] [RUNS=3]   env: MODELS="cnn resnet20" BATCH=64
set -euo pipefail
cd "$(dirname "$0")/.."
FLOTILLA=${FLOTILLA:-build/flotilla}
STEPS=${1:-30}
RUNS=${2:-3}
MODELS=${MODELS:-cnn resnet20}
BATCH=${BATCH:-64}
PRECISION=${PRECISION:-auto}
machine=$(bench/machine.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for model in $MODELS; do
  PYTHONPATH=bench/peers .venv/bin/python -c '
import sys, torch, common
torch.manual_seed(0)
torch.jit.script(common.make_torch_model(sys.argv[1])).save(sys.argv[2])' "$model" "$tmp/$model.pt"
done
for run in $(seq "$RUNS"); do
  for model in $MODELS; do
    for kind in zoo script; do
      m=$model
      [ "$kind" = script ] && m=$tmp/$model.pt
      "$FLOTILLA" launch --workers 2 -- flotilla train --model "$m" --batch-per-replica "$BATCH" \
        --steps-per-epoch "$STEPS" --epochs 2 --verbose 0 --no-doctor --precision "$PRECISION" \
        --metrics-json "$tmp/$model-$kind-$run.json" >"$tmp/$model-$kind-$run.log" 2>&1 ||
        { tail -20 "$tmp/$model-$kind-$run.log" >&2; exit 1; }
    done
  done
done
for model in $MODELS; do
  for kind in zoo script; do
    step=$(bench/step_ms.py "$tmp/$model-$kind"-*.json)
    declare "step_$kind=$step"
    printf '{"bench":"torchscript","model":"%s","config":"%s","workers":2,"batch_per_replica":%d,"precision":"%s","metric":"step_ms","value":%s,"runs":%d,"machine":%s}\n' \
      "$model" "$kind" "$BATCH" "$PRECISION" "$step" "$RUNS" "$machine"
  done
  awk -v s="$step_script" -v z="$step_zoo" -v m="$model" -v p="$PRECISION" -v machine="$machine" 'BEGIN {
    printf "{\"bench\":\"torchscript\",\"model\":\"%s\",\"precision\":\"%s\",\"metric\":\"step_ms\",\"ratio\":%.3f,\"of\":\"script/zoo\",\"machine\":%s}\n", m, p, s / z, machine }'
done
