#!/usr/bin/env bash
# `make bench-elastic`: what elastic mode costs when nothing fails. The same 2-worker run on
# loopback, fixed (`launch -- flotilla train`) and elastic (`launch --elastic -- flotilla train
# --elastic`: the rendezvous in launch, a one-flag admission vote every 8 steps, the committed
# state recorded after each update), interleaved RUNS times, each pair in the other order than the
# one before; the step time is the chief's second
# epoch's seconds / steps (two decimals). Prints JSON lines: the median step_ms of each, then the ratio
# elastic/fixed per model, of the medians and the median of the per-run pairs (the issue's
# bound: at most 1.02).
# Usage: bench/elastic.sh [STEPS=100] [RUNS=3]   env: MODELS="mlp cnn" BATCH=64
#   ELASTIC_BATCH=per-replica: the elastic runs keep the per-replica batch (--elastic-batch
#   per-replica), which refuses --steps-per-epoch, so both kinds train whole passes (STEPS unused)
set -euo pipefail
cd "$(dirname "$0")/.."
FLOTILLA=${FLOTILLA:-build/flotilla}
STEPS=${1:-100}
RUNS=${2:-3}
MODELS=${MODELS:-mlp cnn}
BATCH=${BATCH:-64}
ELASTIC_BATCH=${ELASTIC_BATCH:-global}
length=(--steps-per-epoch "$STEPS")
[ "$ELASTIC_BATCH" = global ] || length=()
machine=$(bench/machine.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for run in $(seq "$RUNS"); do
  for model in $MODELS; do
    # Each pair in turn fixed-first and elastic-first, so neither kind always runs second (the
    # VM's speed drifts within a call).
    kinds="fixed elastic"
    ((run % 2 == 0)) && kinds="elastic fixed"
    for kind in $kinds; do
      launch=("$FLOTILLA" launch --workers 2)
      train=(flotilla train)
      if [ "$kind" = elastic ]; then
        launch+=(--elastic)
        train+=(--elastic --elastic-batch "$ELASTIC_BATCH")
      fi
      "${launch[@]}" -- "${train[@]}" --model "$model" --batch-per-replica "$BATCH" \
        "${length[@]}" --epochs 2 --verbose 0 --no-doctor \
        --metrics-json "$tmp/$model-$kind-$run.json" >"$tmp/$model-$kind-$run.log" 2>&1 ||
        { tail -20 "$tmp/$model-$kind-$run.log" >&2; exit 1; }
    done
  done
done
for model in $MODELS; do
  for kind in fixed elastic; do
    step=$(bench/step_ms.py --digits 2 "$tmp/$model-$kind"-*.json)
    declare "step_$kind=$step"
    printf '{"bench":"elastic","model":"%s","config":"%s","workers":2,"batch_per_replica":%d,"metric":"step_ms","value":%s,"runs":%d,"machine":%s}\n' \
      "$model" "$kind" "$BATCH" "$step" "$RUNS" "$machine"
  done
  # Also the median of the ratios of the runs taken one after the other (run i elastic / run i
  # fixed): the machine's speed drifts less within a pair than across the whole call.
  paired=$(for run in $(seq "$RUNS"); do
    awk -v e="$(bench/step_ms.py --digits 4 "$tmp/$model-elastic-$run.json")" \
      -v f="$(bench/step_ms.py --digits 4 "$tmp/$model-fixed-$run.json")" 'BEGIN { print e / f }'
  done | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
  awk -v e="$step_elastic" -v f="$step_fixed" -v p="$paired" -v m="$model" -v eb="$ELASTIC_BATCH" -v machine="$machine" 'BEGIN {
    printf "{\"bench\":\"elastic\",\"model\":\"%s\",\"metric\":\"step_ms\",\"ratio\":%.3f,\"paired_ratio\":%.3f,\"of\":\"elastic/fixed\",\"elastic_batch\":\"%s\",\"machine\":%s}\n", m, e / f, p, eb, machine }'
done
