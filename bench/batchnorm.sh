#!/usr/bin/env bash
# `make bench-batchnorm`: what SyncBatchNorm costs per step. Trains MODEL (resnet20: 21
# BatchNorms) with 2 workers on loopback, plain BatchNorm (each replica's own statistics,
# averaged where they are read) against --sync-batchnorm (statistics over the global batch: one
# small all-reduce per layer in forward and one in backward), interleaved RUNS times; the step
# time is the chief's second epoch's seconds / steps. Prints JSON lines: the median step_ms of
# each, then their ratio.
# Usage: bench/batchnorm.sh [STEPS=20] [RUNS=3]   env: MODEL=resnet20 BATCH=64 (per replica)
set -euo pipefail
cd "$(dirname "$0")/.."
FLOTILLA=${FLOTILLA:-build/flotilla}
STEPS=${1:-20}
RUNS=${2:-3}
MODEL=${MODEL:-resnet20}
BATCH=${BATCH:-64}
machine=$(bench/machine.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for run in $(seq "$RUNS"); do
  for config in plain sync; do
    flags=()
    [ "$config" = sync ] && flags=(--sync-batchnorm)
    "$FLOTILLA" launch --workers 2 -- flotilla train --model "$MODEL" --batch-per-replica "$BATCH" \
      --steps-per-epoch "$STEPS" --epochs 2 --verbose 0 "${flags[@]}" \
      --metrics-json "$tmp/$config-$run.json" >"$tmp/$config-$run.log" 2>&1 ||
      { tail -20 "$tmp/$config-$run.log" >&2; exit 1; }
  done
done
for config in plain sync; do
  step=$(bench/step_ms.py "$tmp/$config"-*.json)
  declare "step_$config=$step"
  printf '{"bench":"batchnorm","model":"%s","config":"%s","workers":2,"batch_per_replica":%d,"metric":"step_ms","value":%s,"runs":%d,"machine":%s}\n' \
    "$MODEL" "$config" "$BATCH" "$step" "$RUNS" "$machine"
done
awk -v s="$step_sync" -v p="$step_plain" -v m="$MODEL" -v machine="$machine" 'BEGIN {
  printf "{\"bench\":\"batchnorm\",\"model\":\"%s\",\"metric\":\"step_ms\",\"ratio\":%.3f,\"of\":\"sync/plain\",\"machine\":%s}\n", m, s / p, machine }'
