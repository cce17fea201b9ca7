#!/usr/bin/env bash
# How intra-op threads per worker change training speed on this machine: the launcher's default
# (cores ÷ local workers, in OMP_NUM_THREADS and torch::set_num_threads) against the alternatives.
# Configurations run interleaved (A B C D A B C D ...) so drift on a shared machine hits all
# alike; prints one JSON line per configuration: the median samples/s and the ratio to default.
# Usage: bench/threads.sh [STEPS=300] [RUNS=3]   (make bench-threads)
set -euo pipefail
# Every JSON line names the machine: the script runs again through bench/machine.sh --tag.
[ -n "${BENCH_TAGGED:-}" ] || { BENCH_TAGGED=1 "$(readlink -f "$0")" "$@" |
  "$(dirname "$(readlink -f "$0")")/machine.sh" --tag; exit "${PIPESTATUS[0]}"; }
cd "$(dirname "$0")/.."
FLOTILLA=${FLOTILLA:-build/flotilla}
STEPS=${1:-300}
RUNS=${2:-3}
CORES=$(nproc)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

train=(train --model cnn --steps-per-epoch "$STEPS")
names=(
  "2 workers x cores/2 threads (default)"
  "2 workers x cores/2 threads, OpenMP pool sized for all cores (set_num_threads only)"
  "2 workers x all cores each (oversubscribed)"
  "1 worker x all cores, same global batch 64"
)
run_config() {  # index -> one run, appends samples/s to $tmp/<index>
  local m="$tmp/m.json"
  rm -f "$m"
  case $1 in
    0) env -u OMP_NUM_THREADS "$FLOTILLA" launch --workers 2 -- flotilla "${train[@]}" --metrics-json "$m" ;;
    1) env OMP_NUM_THREADS="$CORES" "$FLOTILLA" launch --workers 2 -- flotilla "${train[@]}" --threads $((CORES / 2 > 0 ? CORES / 2 : 1)) --metrics-json "$m" ;;
    2) env OMP_NUM_THREADS="$CORES" "$FLOTILLA" launch --workers 2 -- flotilla "${train[@]}" --threads "$CORES" --metrics-json "$m" ;;
    3) env -u OMP_NUM_THREADS "$FLOTILLA" "${train[@]}" --batch-per-replica 64 --metrics-json "$m" ;;
  esac >/dev/null 2>&1
  head -n1 "$m" | sed 's/.*"samples_per_s":\([0-9.]*\).*/\1/' >>"$tmp/$1"
}
for _ in $(seq "$RUNS"); do
  for i in "${!names[@]}"; do run_config "$i"; done
done
median() { sort -g "$1" | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
default=$(median "$tmp/0")
for i in "${!names[@]}"; do
  value=$(median "$tmp/$i")
  awk -v name="${names[$i]}" -v v="$value" -v d="$default" -v c="$CORES" -v r="$RUNS" 'BEGIN {
    printf "{\"bench\":\"threads\",\"system\":\"flotilla\",\"config\":\"%s\",\"metric\":\"samples_per_s\",\"value\":%.0f,\"ratio_vs_default\":%.3f,\"cores\":%d,\"runs\":%d}\n", name, v, v / d, c, r }'
done
