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
python3 - "$tmp" "$RUNS" "$MODEL" "$BATCH" "$machine" <<'PY'
import json, statistics, sys
tmp, runs, model, batch, machine = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
step = {}
for config in ("plain", "sync"):
    values = []
    for run in range(1, runs + 1):
        last = [json.loads(l) for l in open(f"{tmp}/{config}-{run}.json") if '"epoch"' in l][-1]
        values.append(1000 * last["seconds"] / last["steps"])
    step[config] = statistics.median(values)
    print(json.dumps({"bench": "batchnorm", "model": model, "config": config, "workers": 2,
                      "batch_per_replica": batch, "metric": "step_ms", "value": round(step[config], 1),
                      "runs": runs, "machine": machine}))
print(json.dumps({"bench": "batchnorm", "model": model, "metric": "step_ms",
                  "ratio": round(step["sync"] / step["plain"], 3), "of": "sync/plain",
                  "machine": machine}))
PY
