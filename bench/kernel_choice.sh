#!/usr/bin/env bash
# `make bench-kernel-choice`: what measuring the kernels costs a run (flotilla/kernels/choice.h).
# For each of MODELS: 2 workers on loopback train EPOCHS x STEPS steps at PRECISION, first with an
# empty kernel cache (the first worker to meet each shape times flotilla's kernel against ATen's,
# the other reads its choice), then again with the cache that run wrote (nothing timed). The cost
# is the first epoch's wall seconds of the first run over the second's (every worker waits for
# the one measuring at the next all-reduce); RUNS pairs, medians. Also the chief's own count of
# shapes timed and seconds spent timing (its recipe line). Prints JSON lines.
# Usage: bench/kernel_choice.sh [RUNS=3]   env: MODELS="resnet18" PRECISION=mixed_bfloat16
#        BATCH=64 (per replica) STEPS=6
set -euo pipefail
cd "$(dirname "$0")/.."
FLOTILLA=${FLOTILLA:-build/flotilla}
RUNS=${1:-3}
MODELS=${MODELS:-resnet18}
PRECISION=${PRECISION:-mixed_bfloat16}
BATCH=${BATCH:-64}
STEPS=${STEPS:-6}
machine=$(bench/machine.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
epoch1() { grep '"epoch": *1[,}]' "$1" | sed 's/.*"seconds": *\([0-9.e+-]*\).*/\1/'; }
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
for model in $MODELS; do
  for run in $(seq "$RUNS"); do
    rm -rf "$tmp/cache"
    for pass in cold warm; do
      FLOTILLA_CACHE_DIR="$tmp/cache" "$FLOTILLA" launch --workers 2 -- flotilla train \
        --model "$model" --batch-per-replica "$BATCH" --steps-per-epoch "$STEPS" --epochs 2 \
        --precision "$PRECISION" --verbose 0 --no-doctor --metrics-json "$tmp/$pass-$run.json" \
        >"$tmp/$pass-$run.log" 2>&1 || { tail -20 "$tmp/$pass-$run.log" >&2; exit 1; }
      epoch1 "$tmp/$pass-$run.json" >>"$tmp/$model-$pass"
      sed -n 's/.*recipe: kernels: measure .*: \([0-9]*\) shape(s), \([0-9]*\) read from .*, \([0-9]*\) timed in \([0-9.]*\) s$/\1 \2 \3 \4/p' \
        "$tmp/$pass-$run.log" >>"$tmp/$model-$pass-chief"
    done
  done
  cold=$(median <"$tmp/$model-cold")
  warm=$(median <"$tmp/$model-warm")
  read -r shapes read_cold timed seconds < <(tail -n 1 "$tmp/$model-cold-chief")
  read -r _ read_warm timed_warm seconds_warm < <(tail -n 1 "$tmp/$model-warm-chief")
  printf '{"bench":"kernel_choice","model":"%s","precision":"%s","batch_per_replica":%d,"workers":2,"metric":"first_epoch_seconds","cold":%s,"warm":%s,"cost_seconds":%.2f,"runs":%d,"chief_cold":{"shapes":%s,"read":%s,"timed":%s,"seconds_timing":%s},"chief_warm":{"read":%s,"timed":%s,"seconds_timing":%s},"machine":%s}\n' \
    "$model" "$PRECISION" "$BATCH" "$cold" "$warm" "$(awk -v c="$cold" -v w="$warm" 'BEGIN {print c - w}')" \
    "$RUNS" "$shapes" "$read_cold" "$timed" "$seconds" "$read_warm" "$timed_warm" "$seconds_warm" "$machine"
done
