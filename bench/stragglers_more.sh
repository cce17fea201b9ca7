#!/usr/bin/env bash
# `make bench-stragglers`, its second half: shares by speed with 3 workers, and a worker slowed
# midway. Needs a cgroup with a CPU quota (root; cgroup v2 cpu.max or v1 cpu.cfs_quota_us).
#   three   3 workers on this host (1 thread each, not pinned) under CPU quotas of 0.6, 0.6 and
#           0.3 of a core: worker 2 at half the others' speed, 1.5 cores in all on 2. Equal
#           shares against --shares auto, as samples/s against the ideal (the sum of each
#           worker's solo speed under its quota, at a third of the global batch).
#   midway  2 workers pinned to a core each, both at full speed until the chief's metrics show
#           epoch SLOW_AT (of EPOCHS epochs of 10 steps); then worker 1's quota drops to half
#           a core. Each epoch's samples/s against the new ideal (the solo speeds, fast and
#           slowed), and the steps from the slowdown to the end of the first epoch from which
#           every later one is above 85% of it; equal shares beside auto.
#   accuracy  (only when named) the ResNet-20 recipe (global batch 256, linear scaling, a warmup
#           epoch, cosine decay, flip + crop, weight decay 5e-4) for ACC_EPOCHS epochs on 2 workers
#           pinned to a core each, worker 1 under a quota of half its core: the test accuracy
#           with equal shares and with auto, one run each.
# Prints JSON lines; medians of RUNS runs (three), one run (midway: its epochs are the series).
# Usage: bench/stragglers_more.sh [three|midway|both|accuracy=both] [RUNS=3]
#        env: MODEL=cnn GLOBAL=480 STEPS=60 (three) MID_GLOBAL=960 EPOCHS=20 SLOW_AT=6 (midway)
#        FLOTILLA=build/flotilla PERIOD_US=100000 (the quotas' period, bench/stragglers_lib.sh)
#        DATA_DIR=/usr/share/datasets/fashion-mnist
set -euo pipefail
cd "$(dirname "$0")/.."
FLOTILLA=${FLOTILLA:-build/flotilla}
WHAT=${1:-both}
RUNS=${2:-3}
MODEL=${MODEL:-cnn}
GLOBAL=${GLOBAL:-480}
STEPS=${STEPS:-60}
MID_GLOBAL=${MID_GLOBAL:-960}
ACC_EPOCHS=${ACC_EPOCHS:-15}
EPOCHS=${EPOCHS:-20}
SLOW_AT=${SLOW_AT:-6}
DATA_DIR=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
machine=$(bench/machine.sh)
fail() { echo "bench/stragglers_more.sh: $*" >&2; exit 1; }
. bench/stragglers_lib.sh
tmp=$(mktemp -d)
groups=()
cleanup() {
  for g in "${groups[@]}"; do rmdir "$g" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
[ "$(nproc)" -ge 2 ] || fail "needs 2 cores; this machine has $(nproc)"
[ $((GLOBAL % 3)) -eq 0 ] || fail "GLOBAL=$GLOBAL must divide by 3 (three equal shares)"
[ $((MID_GLOBAL % 2)) -eq 0 ] || fail "MID_GLOBAL=$MID_GLOBAL must be even (two equal shares)"
cgroup_for() { # $1 name, $2 quota: a cgroup, remembered for the cleanup
  local g
  g=$(quota_cgroup "$1" "$2")
  [ -n "$g" ] || fail "no cgroup with a CPU quota can be made here (root, cgroup v2 cpu or v1 cpu)"
  groups+=("$g")
  echo "$g"
}
# One `flotilla train` worker, 1 thread: $1 cgroup, $2 cores (taskset list), $3 TF_CONFIG,
# $4 metrics JSON (the chief's only), then train's flags.
worker() {
  local group=$1 cores=$2 tf_config=$3 json=$4
  shift 4
  in_cgroup "$group" taskset -c "$cores" env TF_CONFIG="$tf_config" LOCAL_WORLD_SIZE= \
    "$FLOTILLA" train --threads 1 --data-dir "$DATA_DIR" --verbose 0 --no-doctor \
    --metrics-json "$json" "$@"
}
# The zoo model's flags: $1 batch per replica, $2 steps per epoch, $3 epochs.
zoo() { echo --model "$MODEL" --batch-per-replica "$1" --steps-per-epoch "$2" --epochs "$3"; }
tf_config() { # $1 ports (space-separated), $2 index
  local list="" p
  for p in $1; do list+="${list:+, }\"127.0.0.1:$p\""; done
  echo "{\"cluster\": {\"worker\": [$list]}, \"task\": {\"type\": \"worker\", \"index\": $2}}"
}
# A job: $1 name, then "cgroup:cores" per worker, then --, then train's flags. The chief's
# metrics in $tmp/$1.json, each worker's log in $tmp/$1-W.log.
job() {
  local name=$1 specs=() ports="" pids=() w=0 spec
  shift
  while [ "$1" != -- ]; do specs+=("$1"); shift; done
  shift
  for _ in "${specs[@]}"; do ports+=" $(port)"; done
  for spec in "${specs[@]}"; do
    worker "${spec%%:*}" "${spec#*:}" "$(tf_config "$ports" "$w")" "$tmp/$name.json" "$@" \
      > "$tmp/$name-$w.log" 2>&1 &
    pids+=($!)
    w=$((w + 1))
  done
  for w in "${!pids[@]}"; do
    wait "${pids[$w]}" || fail "$name: worker $w failed: $(tail -3 "$tmp/$name-$w.log")"
  done
}
last_division() { { grep -o 'shares: now [0-9,]* of [0-9]*' "$tmp/$1-0.log" || echo 'shares: now equal'; } | tail -1 | sed 's/shares: now //'; }

if [ "$WHAT" = three ] || [ "$WHAT" = both ]; then
  fast0=$(cgroup_for fast0 0.6); fast1=$(cgroup_for fast1 0.6); slow=$(cgroup_for slow 0.3)
  how="$(cgroup_kind "$slow"): quotas 0.6, 0.6 and 0.3 of a core, not pinned"
  : > "$tmp/runs3"
  for run in $(seq "$RUNS"); do
    for w in 0 1 2; do
      g=$([ "$w" = 2 ] && echo "$slow" || ([ "$w" = 0 ] && echo "$fast0" || echo "$fast1"))
      # shellcheck disable=SC2046
      job "solo$w-$run" "$g:0,1" -- $(zoo $((GLOBAL / 3)) "$STEPS" 2)
    done
    for shares in equal auto; do
      # shellcheck disable=SC2046
      job "$shares"3-"$run" "$fast0:0,1" "$fast1:0,1" "$slow:0,1" -- \
        $(zoo $((GLOBAL / 3)) "$STEPS" 2) --shares "$shares"
    done
    echo "$(epoch_speed "$tmp/solo0-$run.json") $(epoch_speed "$tmp/solo1-$run.json")" \
      "$(epoch_speed "$tmp/solo2-$run.json") $(epoch_speed "$tmp/equal3-$run.json")" \
      "$(epoch_speed "$tmp/auto3-$run.json")" >> "$tmp/runs3"
    last_division "auto3-$run" >> "$tmp/divisions3"
  done
  col() { awk "{print \$$1}" "$tmp/runs3" | median; }
  of_ideal() { awk "{printf \"%.4f\\n\", \$$1 / (\$1 + \$2 + \$3)}" "$tmp/runs3" | median; }
  printf '{"bench":"stragglers","case":"three workers","model":"%s","global_batch":%s,"workers":3,"threads_per_worker":1,"slowed":"worker 2 to half the others by %s","precision":"auto","metric":"samples_per_s","solo":[%s,%s,%s],"equal_shares":%s,"equal_of_ideal":%s,"auto_shares":%s,"auto_of_ideal":%s,"ratio":%s,"of":"auto/equal","auto_last_division":"%s","runs":%s,"machine":%s}\n' \
    "$MODEL" "$GLOBAL" "$how" "$(col 1)" "$(col 2)" "$(col 3)" "$(col 4)" "$(of_ideal 4)" \
    "$(col 5)" "$(of_ideal 5)" "$(awk '{printf "%.4f\n", $5 / $4}' "$tmp/runs3" | median)" \
    "$(tr '\n' ';' < "$tmp/divisions3" | sed 's/;$//')" "$RUNS" "$machine"
fi

if [ "$WHAT" = midway ] || [ "$WHAT" = both ]; then
  later=$(cgroup_for later max)
  how="$(cgroup_kind "$later") of 0.5 core from epoch $SLOW_AT's end"
  # The new ideal: each worker alone, fast on core 0, slowed on core 1, at half the batch.
  # shellcheck disable=SC2046
  job mid-solo0 ":0" -- $(zoo $((MID_GLOBAL / 2)) "$STEPS" 2)
  set_quota "$later" 0.5
  # shellcheck disable=SC2046
  job mid-solo1 "$later:1" -- $(zoo $((MID_GLOBAL / 2)) "$STEPS" 2)
  set_quota "$later" max
  ideal=$(awk -v a="$(epoch_speed "$tmp/mid-solo0.json")" -v b="$(epoch_speed "$tmp/mid-solo1.json")" 'BEGIN {printf "%.1f", a + b}')
  for shares in auto equal; do
    set_quota "$later" max
    # shellcheck disable=SC2046
    job "mid-$shares" ":0" "$later:1" -- $(zoo $((MID_GLOBAL / 2)) 10 "$EPOCHS") --shares "$shares" &
    jp=$!
    until n=$(grep -c '"epoch"' "$tmp/mid-$shares.json" 2>/dev/null || true); [ "${n:-0}" -ge "$SLOW_AT" ]; do
      kill -0 "$jp" 2>/dev/null || break
      sleep 0.2
    done
    set_quota "$later" 0.5
    wait "$jp"
    series=""
    for e in $(seq $((SLOW_AT + 1)) "$EPOCHS"); do
      series+="${series:+,}$(awk -v s="$(epoch_speed "$tmp/mid-$shares.json" "$e")" -v i="$ideal" 'BEGIN {printf "%.3f", s / i}')"
    done
    # The end of the first epoch from which every later one is above 85% (-1: the last is not).
    back=$(echo "$series" | tr ',' '\n' | awk '$1 < 0.85 {below = NR} END {print below == NR ? -1 : (below + 1) * 10}')
    printf '{"bench":"stragglers","case":"slowed midway","model":"%s","global_batch":%s,"workers":2,"threads_per_worker":1,"shares":"%s","slowed":"worker 1 to half its core by %s","metric":"samples_per_s of each epoch of 10 steps after the slowdown / the new ideal","new_ideal":%s,"of_ideal_by_epoch":[%s],"steps_until_above_85pct":%s,"last_division":"%s","machine":%s}\n' \
      "$MODEL" "$MID_GLOBAL" "$shares" "$how" "$ideal" "$series" "$back" "$(last_division "mid-$shares")" "$machine"
  done
fi

if [ "$WHAT" = accuracy ]; then
  half=$(cgroup_for half 0.5)
  for shares in equal auto; do
    job "acc-$shares" ":0" "$half:1" -- --model resnet20 --batch-per-replica 128 \
      --lr-scaling linear --warmup-epochs 1 --schedule cosine --augment --weight-decay 5e-4 \
      --epochs "$ACC_EPOCHS" --shares "$shares"
  done
  acc() { grep -o '"test_accuracy": *[0-9.]*' "$tmp/acc-$1.json" | sed 's/.*: *//'; }
  speed() { grep '"epoch"' "$tmp/acc-$1.json" | sed 's/.*"samples_per_s": *\([0-9.e+-]*\).*/\1/' | median; }
  printf '{"bench":"stragglers","case":"accuracy","model":"resnet20","recipe":"global batch 256, linear scaling, 1 warmup epoch, cosine, flip+crop, weight decay 5e-4","epochs":%s,"workers":2,"threads_per_worker":1,"slowed":"worker 1 to half its core by %s","test_accuracy_equal":%s,"test_accuracy_auto":%s,"points":%s,"samples_per_s_equal":%s,"samples_per_s_auto":%s,"last_division":"%s","machine":%s}\n' \
    "$ACC_EPOCHS" "$(cgroup_kind "$half")" "$(acc equal)" "$(acc auto)" \
    "$(awk -v a="$(acc auto)" -v e="$(acc equal)" 'BEGIN {printf "%.2f", 100 * (a - e)}')" \
    "$(speed equal)" "$(speed auto)" "$(last_division acc-auto)" "$machine"
fi
