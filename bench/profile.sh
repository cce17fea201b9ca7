#!/usr/bin/env bash
# What the step profiler costs. fit() always keeps the per-epoch phase sums (a few clock reads a
# step); --trace also records every step's spans and bucket all-reduces for the timeline. Runs
# the same 2-worker training with and without --trace, interleaved (A B A B ...) so a shared
# machine's drift hits both alike, and prints one JSON line per model and configuration (median
# ms per step of the chief, from --metrics-json) and the overhead ratio traced / untraced.
# Usage: bench/profile.sh [STEPS=200] [RUNS=5]   (make bench-profile)
set -euo pipefail
# Every JSON line names the machine: the script runs again through bench/machine.sh --tag.
[ -n "${BENCH_TAGGED:-}" ] || { BENCH_TAGGED=1 "$(readlink -f "$0")" "$@" |
  "$(dirname "$(readlink -f "$0")")/machine.sh" --tag; exit "${PIPESTATUS[0]}"; }
cd "$(dirname "$0")/.."
FLOTILLA=${FLOTILLA:-build/flotilla}
STEPS=${1:-200}
RUNS=${2:-5}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

run() {  # model config -> appends the chief's ms per step to $tmp/<model>.<config>
  local m="$tmp/m.json" extra=()
  rm -f "$m"
  [ "$2" = traced ] && extra=(--trace "$tmp/trace.json")
  "$FLOTILLA" launch --workers 2 -- flotilla train --model "$1" --steps-per-epoch "$STEPS" \
    --no-doctor --metrics-json "$m" "${extra[@]}" >/dev/null 2>&1
  python3 -c 'import json,sys; e=json.loads(open(sys.argv[1]).readline()); print(1000*e["seconds"]/e["steps"])' "$m" >>"$tmp/$1.$2"
}
median() { sort -g "$1" | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
for model in mlp cnn; do
  for _ in $(seq "$RUNS"); do
    run "$model" untraced
    run "$model" traced
  done
  for config in untraced traced; do
    printf '{"bench":"profile","model":"%s","workers":2,"config":"%s","metric":"step_ms","median":%.3f,"runs":%d}\n' \
      "$model" "$config" "$(median "$tmp/$model.$config")" "$RUNS"
  done
  # The ratio of medians, and the median of the per-pair ratios (robust to drift between pairs).
  paste "$tmp/$model.traced" "$tmp/$model.untraced" | awk '{print $1/$2}' >"$tmp/$model.ratio"
  printf '{"bench":"profile","model":"%s","metric":"trace_overhead","of":"traced/untraced step time","median_of_pair_ratios":%.4f,"min":%.4f,"max":%.4f}\n' \
    "$model" "$(median "$tmp/$model.ratio")" "$(sort -g "$tmp/$model.ratio" | head -1)" "$(sort -g "$tmp/$model.ratio" | tail -1)"
done
