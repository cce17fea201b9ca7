#!/usr/bin/env bash
# `make bench-stragglers`: what one slow worker costs a synchronous job (issue 53's baseline).
# 2 workers on this host, started by hand from TF_CONFIG, one thread each, each pinned to a core
# of its own (taskset); worker 1 is slowed to SLOW of its core in a reproducible way:
#   cgroup      a CPU quota on its process: cgroup v2's cpu.max, or v1's cpu.cfs_quota_us (root)
#               (v1 ran here; the v2 branch has not run yet: it needs the cpu controller
#               enabled in the root's cgroup.subtree_control, which this script does not change)
#   competitor  a CPU-bound loop pinned to its core beside it (the kernel's fair share: about half)
# METHOD=auto takes the cgroup where one can be made, else the competitor; the lines say which.
# The ideal is the sum of each worker's solo speed (one worker alone on its core, as slowed, at
# its share of the global batch); the job's speed is flotilla's own samples/s of its second
# epoch. Equal shares (each worker half the global batch) make the step as long as the slow
# worker's half; --shares auto divides it by the speeds the workers measure as they train.
# Prints JSON lines; RUNS interleaved runs, medians.
# Usage: bench/stragglers.sh [RUNS=3]   env: MODEL=cnn GLOBAL=256 STEPS=30 SLOW=0.5
#        METHOD=auto|cgroup|competitor  FLOTILLA=build/flotilla  PERIOD_US=100000 (the quota's
#        period, bench/stragglers_lib.sh)
#        EQUAL=equal (the equal side's --shares; 1,1 divides equally without the advice's
#        measurement, for auto's cost against plain equal shares: SLOW=1.0 METHOD=cgroup)
#        DATA_DIR=/usr/share/datasets/fashion-mnist
set -euo pipefail
cd "$(dirname "$0")/.."
FLOTILLA=${FLOTILLA:-build/flotilla}
RUNS=${1:-3}
MODEL=${MODEL:-cnn}
GLOBAL=${GLOBAL:-256}
STEPS=${STEPS:-30}
SLOW=${SLOW:-0.5}
METHOD=${METHOD:-auto}
EQUAL=${EQUAL:-equal}
DATA_DIR=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
machine=$(bench/machine.sh)
tmp=$(mktemp -d)
cgroup=""
competitor=""
cleanup() {
  [ -n "$competitor" ] && kill "$competitor" 2>/dev/null || true
  if [ -n "$cgroup" ] && [ -d "$cgroup" ]; then rmdir "$cgroup" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "bench/stragglers.sh: $*" >&2; exit 1; }
. bench/stragglers_lib.sh
[ "$(nproc)" -ge 2 ] || fail "needs 2 cores (one a worker); this machine has $(nproc)"
[ $((GLOBAL % 2)) -eq 0 ] || fail "GLOBAL=$GLOBAL must be even (two equal shares)"
half=$((GLOBAL / 2))

how=""
if [ "$METHOD" != competitor ]; then
  cgroup=$(quota_cgroup slow "$SLOW")
  [ -n "$cgroup" ] && how=$(cgroup_kind "$cgroup")
fi
if [ -z "$how" ]; then
  [ "$METHOD" = cgroup ] &&
    fail "METHOD=cgroup, but no cgroup with a CPU quota can be made here (root, cgroup v2 cpu or v1 cpu)"
  [ "$SLOW" = 0.5 ] || fail "METHOD=competitor slows a worker to about half only (SLOW=$SLOW)"
  how="a competitor pinned to its core"
fi

# Runs `flotilla train` for one worker: $1 core, $2 slowed (1/0), $3 TF_CONFIG, $4 batch, $5 json,
# $6 --shares ($EQUAL by default).
worker() {
  local core=$1 slowed=$2 tf_config=$3 batch=$4 json=$5 shares=${6:-$EQUAL}
  local cmd=(taskset -c "$core" env TF_CONFIG="$tf_config" LOCAL_WORLD_SIZE= "$FLOTILLA" train
    --model "$MODEL" --batch-per-replica "$batch" --steps-per-epoch "$STEPS" --epochs 2
    --threads 1 --data-dir "$DATA_DIR" --verbose 0 --no-doctor --metrics-json "$json"
    --shares "$shares")
  in_cgroup "$([ "$slowed" = 1 ] && echo "$cgroup")" "${cmd[@]}"
}
epoch2() { epoch_speed "$1" 2; }
if [ -z "$cgroup" ]; then
  taskset -c 1 sh -c 'while :; do :; done' &
  competitor=$!
fi

# Both workers together: $1 the case's name, $2 the run, $3 --shares; metrics in $tmp/$1-$2.json.
pair() {
  local name=$1 run=$2 shares=$3 cluster w0
  cluster="{\"cluster\": {\"worker\": [\"127.0.0.1:$(port)\", \"127.0.0.1:$(port)\"]}"
  worker 0 0 "$cluster, \"task\": {\"type\": \"worker\", \"index\": 0}}" "$half" "$tmp/$name-$run.json" \
    "$shares" > "$tmp/${name}0-$run.log" 2>&1 &
  w0=$!
  worker 1 1 "$cluster, \"task\": {\"type\": \"worker\", \"index\": 1}}" "$half" "$tmp/$name-$run.json" \
    "$shares" > "$tmp/${name}1-$run.log" 2>&1 || fail "worker 1 failed: $(tail -3 "$tmp/${name}1-$run.log")"
  wait "$w0" || fail "worker 0 failed: $(tail -3 "$tmp/${name}0-$run.log")"
}

for run in $(seq "$RUNS"); do
  # Solo: each worker alone, at its share of the global batch.
  for w in 0 1; do
    p=$(port)
    worker "$w" "$w" "{\"cluster\": {\"worker\": [\"127.0.0.1:$p\"]}, \"task\": {\"type\": \"worker\", \"index\": 0}}" \
      "$half" "$tmp/solo$w-$run.json" equal > "$tmp/solo$w-$run.log" 2>&1 ||
      fail "solo worker $w failed: $(tail -3 "$tmp/solo$w-$run.log")"
  done
  pair equal "$run" "$EQUAL"
  pair auto "$run" auto
  { grep -o 'shares: now [^,]*,[^ ]* of [0-9]*' "$tmp/auto0-$run.log" || echo 'shares: now equal'; } | tail -1 | sed 's/shares: now //' \
    > "$tmp/auto-shares-$run"
  s0=$(epoch2 "$tmp/solo0-$run.json"); s1=$(epoch2 "$tmp/solo1-$run.json")
  eq=$(epoch2 "$tmp/equal-$run.json")
  au=$(epoch2 "$tmp/auto-$run.json")
  echo "$s0 $s1 $eq $au" >> "$tmp/runs"
done
s0=$(awk '{print $1}' "$tmp/runs" | median)
s1=$(awk '{print $2}' "$tmp/runs" | median)
eq=$(awk '{print $3}' "$tmp/runs" | median)
share=$(awk '{printf "%.4f\n", $3 / ($1 + $2)}' "$tmp/runs" | median)
lo=$(awk '{printf "%.4f\n", $3 / ($1 + $2)}' "$tmp/runs" | sort -g | head -1)
hi=$(awk '{printf "%.4f\n", $3 / ($1 + $2)}' "$tmp/runs" | sort -g | tail -1)
au=$(awk '{print $4}' "$tmp/runs" | median)
auto_share=$(awk '{printf "%.4f\n", $4 / ($1 + $2)}' "$tmp/runs" | median)
alo=$(awk '{printf "%.4f\n", $4 / ($1 + $2)}' "$tmp/runs" | sort -g | head -1)
ahi=$(awk '{printf "%.4f\n", $4 / ($1 + $2)}' "$tmp/runs" | sort -g | tail -1)
ratio=$(awk '{printf "%.4f\n", $4 / $3}' "$tmp/runs" | median)
last_shares=$(cat "$tmp"/auto-shares-* 2>/dev/null | tr '\n' ';' | sed 's/;$//')
printf '{"bench":"stragglers","model":"%s","global_batch":%s,"workers":2,"threads_per_worker":1,"slowed":"worker 1 to %s of its core by %s","precision":"auto","metric":"samples_per_s","solo_fast":%s,"solo_slow":%s,"ideal":%s,"equal_shares":%s,"equal_flag":"--shares %s","equal_of_ideal":%s,"equal_of_ideal_runs":[%s,%s],"auto_shares":%s,"auto_of_ideal":%s,"auto_of_ideal_runs":[%s,%s],"ratio":%s,"of":"auto/equal","auto_last_division":"%s","runs":%s,"machine":%s}\n' \
  "$MODEL" "$GLOBAL" "$SLOW" "$how" "$s0" "$s1" "$(awk -v a="$s0" -v b="$s1" 'BEGIN{printf "%.1f", a + b}')" \
  "$eq" "$EQUAL" "$share" "$lo" "$hi" "$au" "$auto_share" "$alo" "$ahi" "$ratio" "$last_shares" "$RUNS" "$machine"
