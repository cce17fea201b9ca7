#!/usr/bin/env bash
# `make bench-plan`: checks `flotilla plan` against real training. For each worker count n in
# WORKER_COUNTS (2 3), it predicts mlp-wide's step time at n workers from a single-worker
# profile, then measures it with n workers in network namespaces joined by tbf-limited links, and
# prints predicted, measured and the relative error.
#
# Fairness on a small machine: the planner assumes one machine per worker, so compute does not
# change with n. Here n workers share nproc cores (3 workers on 2 cores run slower), so the
# single-worker profile is measured under the same sharing: n independent single-worker runs at
# once (no cluster, loopback only, --threads 1 and OMP_NUM_THREADS=1 each, as every worker of the
# real run), their phase times averaged into one profile. The profile runs go right before and
# right after the n-worker run and both are averaged, so drift of a shared machine hits both
# sides alike. Every process runs at `nice -n $NICE` (-15): on a machine shared with other work,
# the Linux scheduler favours a process that sleeps part of the time (the real workers, idle while
# the link carries the gradients) over one that never does (the profiling runs), which made the
# real workers compute faster than their profiles (a +20% prediction error at 2 workers in a
# first run without it); with priority over the other load, both sides get the cores alike.
#
# The link is 1 Gbit/s (RATE) tbf on every veth end, where mlp-wide's 23 MB of gradients take
# about 190 ms (2 workers) to 250 ms (3 workers) per step against ~40-200 ms of compute: the
# communication model is what gets tested. The planner is given the throughput bench/link.sh
# measures through the same links (TCP goodput, ~4% under the tbf rate: Ethernet, IP and TCP
# headers count against tbf's rate) and LATENCY per hop (veth + bridge between namespaces: tens
# of microseconds; with a few buckets per step it hardly counts).
#
# The n-worker runs are bench/link.sh's (its namespaces 198.18.0.0/24, its tbf setup, its cleanup
# on every exit): `CONFIGS=<config> bench/link.sh STEPS 1 n`. Its step time is the chief's last
# epoch's seconds / steps (--metrics-json), so start-up is excluded; the profile uses the same
# epoch (RunSummary::steady_phases).
#
# Prints JSON lines (stdout): one {"bench":"plan","workers":n,...} per worker count and run.
# Needs root (namespaces, tc); exits 77 without it.
#
# Usage: bench/plan.sh [STEPS=15] [RUNS=1]            (make bench-plan)
#   WORKER_COUNTS="2 3"   worker counts to check
#   CONFIG=overlap        bench/link.sh's configuration: overlap, no-overlap or overlap+fp16
#   PACK=26214400         --bytes-per-pack of every run (25 MiB: all of mlp-wide in one bucket)
#   RATE=1gbit            tbf rate of every link
#   LATENCY=20us          one-way latency per hop given to the planner
#   PER_COLLECTIVE_US=75  the planner's fixed cost per all-reduce
#   NICE=-15              niceness of every training process (0: as started)
#   FLOTILLA=build/flotilla
set -euo pipefail
# Every JSON line names the machine: the script runs again through bench/machine.sh --tag.
[ -n "${BENCH_TAGGED:-}" ] || { BENCH_TAGGED=1 "$(readlink -f "$0")" "$@" |
  "$(dirname "$(readlink -f "$0")")/machine.sh" --tag; exit "${PIPESTATUS[0]}"; }
cd "$(dirname "$0")/.."
ROOT=$(pwd)

STEPS=${1:-${STEPS:-15}}
RUNS=${2:-${RUNS:-1}}
WORKER_COUNTS=${WORKER_COUNTS:-2 3}
CONFIG=${CONFIG:-overlap}
export PACK=${PACK:-26214400}
export RATE=${RATE:-1gbit}
LATENCY=${LATENCY:-20us}
PER_COLLECTIVE_US=${PER_COLLECTIVE_US:-75}
NICE=${NICE:--15}
FLOTILLA=${FLOTILLA:-$ROOT/${BUILD_DIR:-build}/flotilla}
MODEL=${MODEL:-mlp-wide}
BATCH=${BATCH:-64}   # per replica

log() { echo "bench/plan: $*" >&2; }
die() {
  log "error: $*"
  exit 1
}

for v in STEPS RUNS PACK; do
  [[ ${!v} =~ ^[0-9]+$ && ${!v} -ge 1 ]] || die "$v must be a positive integer; saw '${!v}'"
done
[[ $NICE =~ ^-?[0-9]+$ ]] || die "NICE must be an integer; saw '$NICE'"
if [[ $(id -u) -ne 0 ]]; then
  log "skipped: needs root (network namespaces, veth, tc via bench/link.sh); run it as root"
  exit 77
fi
declare -A config_flags=([overlap]="" [no-overlap]="--no-overlap"
  [overlap+fp16]="--compression fp16")
[[ -v "config_flags[$CONFIG]" ]] ||
  die "unknown CONFIG '$CONFIG'; use overlap, no-overlap or overlap+fp16"
read -ra extra <<<"${config_flags[$CONFIG]}"
PYTHON=$(command -v python3) || die "needs python3"

tmp=$(mktemp -d -t flotilla-bench-plan.XXXXXX)
pids=()
cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  local pid
  # bench/link.sh removes its namespaces on TERM; the profile runs are plain processes.
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  if ((rc == 0 || rc == 130 || rc == 143)); then rm -rf "$tmp"; else log "logs kept in $tmp"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# One copy of the binary for the whole bench (the build dir may be relinked meanwhile).
bin="$tmp/flotilla"
for attempt in $(seq 30); do
  if [[ -x $FLOTILLA ]] && cp "$FLOTILLA" "$bin" 2>/dev/null &&
    "$bin" train --help >"$tmp/help" 2>&1; then
    break
  fi
  ((attempt < 30)) || die "no working $FLOTILLA (build it first: make build)"
  sleep 2
done
grep -q -- "--profile-json" "$tmp/help" || die "$FLOTILLA train has no --profile-json"
"$bin" plan --help >/dev/null 2>&1 || die "$FLOTILLA has no plan subcommand"

# n single-worker runs at once, each alone (no TF_CONFIG), one thread; their last epoch's phases
# averaged into $2.
profile() { # n out
  local n=$1 out=$2 i failed=0
  pids=()
  for i in $(seq 0 $((n - 1))); do
    nice -n "$NICE" env -u TF_CONFIG OMP_NUM_THREADS=1 "$bin" train --model "$MODEL" \
      --batch-per-replica "$BATCH" --steps-per-epoch "$STEPS" --epochs 2 --verbose 0 --threads 1 \
      --bytes-per-pack "$PACK" "${extra[@]}" --profile-json "$out.$i" >"$out.$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed=1; done
  pids=()
  ((!failed)) || die "a profiling run failed: $(tail -n 5 "$out".*.log)"
  "$PYTHON" - "$out" "$n" <<'PY'
import json, sys
out, n = sys.argv[1], int(sys.argv[2])
runs = [json.load(open(f"{out}.{i}")) for i in range(n)]
merged = runs[0]
w = merged["epochs"][-1]["workers"][0]
ws = [r["epochs"][-1]["workers"][0] for r in runs]
assert all(x["steps"] == w["steps"] for x in ws), "profiles of different step counts"
for key in w["phases"]:
    w["phases"][key] = sum(x["phases"][key] for x in ws) / n
w["step_seconds"] = sum(x["step_seconds"] for x in ws) / n
json.dump(merged, open(out, "w"))
PY
}

# Two profiles (before and after the n-worker run) -> one, averaged the same way.
average_profiles() { # a b out
  "$PYTHON" - "$@" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
wa, wb = a["epochs"][-1]["workers"][0], b["epochs"][-1]["workers"][0]
for key in wa["phases"]:
    wa["phases"][key] = (wa["phases"][key] + wb["phases"][key]) / 2
wa["step_seconds"] = (wa["step_seconds"] + wb["step_seconds"]) / 2
json.dump(a, open(sys.argv[3], "w"))
PY
}

for run in $(seq "$RUNS"); do
  for n in $WORKER_COUNTS; do
    log "run $run, $n workers: profiling $n single-worker runs at once"
    profile "$n" "$tmp/before-$n-$run.json"
    log "run $run, $n workers: training in namespaces (bench/link.sh, $RATE, $CONFIG)"
    CONFIGS="$CONFIG" FLOTILLA="$bin" nice -n "$NICE" bench/link.sh "$STEPS" 1 "$n" \
      >"$tmp/link-$n-$run.jsonl" 2>"$tmp/link-$n-$run.log" &
    pids=($!)
    wait "${pids[0]}" || die "bench/link.sh failed: $(tail -n 20 "$tmp/link-$n-$run.log")"
    pids=()
    log "run $run, $n workers: profiling again"
    profile "$n" "$tmp/after-$n-$run.json"
    average_profiles "$tmp/before-$n-$run.json" "$tmp/after-$n-$run.json" "$tmp/prof-$n-$run.json"
    # The link as measured through the same namespaces, and the measured step.
    read -r mbit measured exposed < <("$PYTHON" - "$tmp/link-$n-$run.jsonl" "$STEPS" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
mbit = next(l["value"] for l in lines if l.get("metric") == "measured_link_mbit_s")
step = next(l for l in lines if l.get("config"))
print(mbit, step["value"], 1000 * step["comm_exposed_seconds"] / int(sys.argv[2]))
PY
    ) || die "no link or step line from bench/link.sh (skipped? see $tmp/link-$n-$run.log)"
    "$bin" plan --profile "$tmp/prof-$n-$run.json" --workers "$n" --link "${mbit}Mbit" \
      --latency "$LATENCY" --per-collective-us "$PER_COLLECTIVE_US" --json \
      >"$tmp/plan-$n-$run.json"
    "$PYTHON" - "$tmp/plan-$n-$run.json" "$tmp/prof-$n-$run.json" "$n" "$measured" "$mbit" \
      "$RATE" "$CONFIG" "$run" "$exposed" <<'PY'
import json, sys
plan = json.loads(open(sys.argv[1]).readline())
prof = json.load(open(sys.argv[2]))
n, measured, mbit = int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
w = prof["epochs"][-1]["workers"][0]
compute_ms = 1000 * w["step_seconds"] / w["steps"]
print(json.dumps({
    "bench": "plan", "model": prof["recipe"]["model"], "workers": n, "config": sys.argv[7],
    "link": sys.argv[6] + " tbf", "link_mbit_s": mbit,
    "bytes_per_pack": plan["bytes_per_pack"], "buckets": plan["buckets"],
    "profile_step_ms": round(compute_ms, 1),
    "predicted_step_ms": round(plan["step_ms"], 1), "predicted_comm_ms": round(plan["comm_ms"], 1),
    "predicted_exposed_ms": round(plan["exposed_ms"], 1),
    "measured_step_ms": round(measured, 1), "measured_exposed_ms": round(float(sys.argv[9]), 1),
    "error": round((plan["step_ms"] - measured) / measured, 3), "run": int(sys.argv[8])},
    separators=(",", ":")))
PY
  done
done
