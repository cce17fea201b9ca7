#!/usr/bin/env bash
# `make bench-link`: gradient sync over a bandwidth-limited link. Trains mlp-wide (~5.8M params,
# ~23 MB of fp32 gradients per step) with WORKERS workers, each in its own network namespace,
# joined by veth pairs to a Linux bridge in a namespace of its own (the root namespace is not
# touched). Every veth end is capped with `tc ... tbf rate $RATE` (both directions), so
# communication costs what it would on a real 1 Gbit/s network. Compares the configurations in
# the table below (overlap of all-reduce with backward, no overlap, overlap + fp16 compression),
# run interleaved (A B C A B C ...) so drift on a shared machine hits all alike.
#
# How: creates namespaces flb-<pid>-0..N-1 (198.18.0.1/24, 198.18.0.2/24, ...; inside the
# benchmarking range 198.18.0.0/15) and flb-<pid>-br (the bridge); checks connectivity between
# every pair and measures the achieved throughput ns 0 -> ns 1 (python3 socket sender and
# receiver, LINK_MB=50 MB); then runs `flotilla train` in every namespace at once with TF_CONFIG
# (chief at 198.18.0.1, workers 0..N-2 after it), --threads and OMP_NUM_THREADS = nproc / N.
# The step time is epoch 2's seconds / steps from the chief's --metrics-json (steady state).
# Everything it creates is removed on any exit (success, failure, Ctrl-C); logs stay in a temp
# dir only when something failed (not when interrupted). Needs root and `ip netns`; skips (exit 0)
# without them.
#
# Prints JSON lines only (stdout): the measured link throughput, one line per configuration
# (medians over RUNS: step_ms, samples_per_s, comm_hidden_share, ...), then the ratios
# no-overlap/overlap and overlap/overlap+fp16 of step_ms. Progress and errors go to stderr.
#
# Usage: bench/link.sh [STEPS=30] [RUNS=1] [WORKERS=2]      (make bench-link)
#   The positional arguments may also be given as environment variables of those names.
#   CONFIGS="overlap no-overlap"  only these configurations (default: all in the table)
#   MODEL=mlp-wide BATCH=64       the zoo model and batch per replica (resnet18, vit-tiny, ...)
#   PRECISION=auto                flotilla train's --precision
#   RATE=1gbit                    the tbf rate of every link
#   FLOTILLA=build/flotilla       the binary (copied once, so a relink mid-bench changes nothing)
#   RUN_TIMEOUT=900               seconds one training run may take before it is killed
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

STEPS=${1:-${STEPS:-30}}
RUNS=${2:-${RUNS:-1}}
WORKERS=${3:-${WORKERS:-2}}
RATE=${RATE:-1gbit}
LINK_MB=${LINK_MB:-50}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
FLOTILLA=${FLOTILLA:-$ROOT/${BUILD_DIR:-build}/flotilla}
MODEL=${MODEL:-mlp-wide}
BATCH=${BATCH:-64}   # per replica
# Gradient bucket size for every configuration. At the default 25 MiB all 23 MB of mlp-wide's
# gradients form one bucket, which can only start when backward ends: nothing to overlap. At
# 4 MiB the last layers' buckets start while the first layer's gradients are still computed.
export PACK=${PACK:-4194304}
export BATCH MACHINE=$(bench/machine.sh)

# The configurations: name -> extra `flotilla train` flags.
config_names=(overlap no-overlap overlap+fp16 overlap+bf16)
declare -A config_flags=(
  [overlap]=""
  [no-overlap]="--no-overlap"
  [overlap+fp16]="--compression fp16"
  [overlap+bf16]="--compression bf16"
)

log() { echo "bench/link: $*" >&2; }
skip() {
  log "skipped: $*"
  exit 0
}
die() {
  log "error: $*"
  exit 1
}

for v in STEPS RUNS WORKERS LINK_MB RUN_TIMEOUT; do
  [[ ${!v} =~ ^[0-9]+$ && ${!v} -ge 1 ]] || die "$v must be a positive integer; saw '${!v}'"
done
((WORKERS >= 2 && WORKERS <= 200)) || die "WORKERS must be 2..200; saw $WORKERS"
selected=()
for c in ${CONFIGS:-${config_names[*]}}; do
  [[ -v "config_flags[$c]" ]] || die "unknown configuration '$c'; known: ${config_names[*]}"
  selected+=("$c")
done

# Prerequisites: root, ip netns, tc, python3 (link check and JSON).
[[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces, veth, tc)"
if ! command -v ip >/dev/null || ! ip netns list >/dev/null 2>&1; then
  skip "'ip netns' is not available"
fi
command -v tc >/dev/null || skip "'tc' (iproute2) is not available"
PYTHON=/usr/bin/python3
[[ -x $PYTHON ]] || PYTHON=$(command -v python3) || skip "needs python3"

tmp=$(mktemp -d -t flotilla-bench-link.XXXXXX)
prefix="flb-$$"
bridge_ns="$prefix-br"
namespaces=()
pids=()

cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  local pid ns
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  # Whatever still runs inside our namespaces was started by this script.
  for ns in "${namespaces[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
  done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  # Deleting a namespace destroys its veth ends and their peers, and the bridge with its own.
  for ns in "${namespaces[@]}"; do ip netns del "$ns" 2>/dev/null; done
  if ((rc == 0 || rc == 130 || rc == 143)); then # success or interrupted: nothing to look at
    rm -rf "$tmp"
  else
    log "logs kept in $tmp"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The helper: socket probe / link throughput, and the JSON report.
cat >"$tmp/helper.py" <<'PY'
import json, os, socket, statistics, sys, time

def serve(port, count, timeout):
    """Accepts `count` connections one by one, reads each to EOF; prints the largest transfer."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(count)
    s.settimeout(timeout)
    best = (0, 0.0)
    for _ in range(count):
        c, _ = s.accept()
        c.settimeout(timeout)
        n, start = 0, None
        while True:
            b = c.recv(1 << 20)
            if not b:
                break
            if start is None:
                start = time.perf_counter()
            n += len(b)
        secs = time.perf_counter() - start if start else 0.0
        c.close()
        if n >= best[0]:
            best = (n, secs)
    print(json.dumps({"bytes": best[0], "seconds": best[1]}))

def send(host, port, nbytes, timeout):
    deadline = time.monotonic() + timeout
    while True:
        try:
            c = socket.create_connection((host, port), timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    c.settimeout(timeout)
    chunk = b"\0" * (1 << 20)
    left = nbytes
    while left > 0:
        c.sendall(chunk[: min(left, len(chunk))])
        left -= min(left, len(chunk))
    c.shutdown(socket.SHUT_WR)
    c.recv(1)  # returns at the receiver's close: everything arrived
    c.close()

def run_result(path):
    """The last epoch's object of a --metrics-json file -> per-run numbers (None if absent)."""
    epochs = [o for o in map(json.loads, filter(str.strip, open(path))) if "epoch" in o]
    e = epochs[-1]
    return {
        "step_ms": 1000.0 * e["seconds"] / e["steps"],
        "samples_per_s": e.get("samples_per_s"),
        "comm_hidden_share": e.get("comm_hidden_share"),
        "comm_seconds": e.get("comm_seconds"),
        "comm_exposed_seconds": e.get("comm_exposed_seconds"),
    }

def median(values, digits):
    values = [v for v in values if v is not None]
    if not values:
        return None
    m = round(float(statistics.median(values)), digits)
    return int(m) if digits == 0 else m

def report(tmp, workers, link, model, configs):
    step = {}
    for name in configs:
        runs = [json.loads(l) for l in open(f"{tmp}/result-{name}.jsonl")]
        line = {"bench": "link", "system": "flotilla", "model": model, "workers": workers,
                "link": link, "config": name,
                "bytes_per_pack": int(os.environ.get("PACK", "0")), "metric": "step_ms",
                "value": median([r.get("step_ms") for r in runs], 1),
                "samples_per_s": median([r.get("samples_per_s") for r in runs], 0),
                "comm_hidden_share": median([r.get("comm_hidden_share") for r in runs], 3),
                "comm_seconds": median([r.get("comm_seconds") for r in runs], 3),
                "comm_exposed_seconds": median([r.get("comm_exposed_seconds") for r in runs], 3),
                "runs": len(runs), "batch_per_replica": int(os.environ.get("BATCH", "64")),
                "machine": json.loads(os.environ.get("MACHINE", "null"))}
        step[name] = line["value"]
        print(json.dumps(line, separators=(",", ":")))
    for a, b in (("no-overlap", "overlap"), ("overlap", "overlap+fp16"),
                 ("overlap", "overlap+bf16")):
        if step.get(a) and step.get(b):
            print(json.dumps({"bench": "link", "metric": "step_ms",
                              "ratio": round(step[a] / step[b], 3), "of": f"{a}/{b}"},
                             separators=(",", ":")))

cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "serve":
    serve(int(args[0]), int(args[1]), float(args[2]))
elif cmd == "send":
    send(args[0], int(args[1]), int(args[2]), float(args[3]))
elif cmd == "result":
    print(json.dumps(run_result(args[0])))
elif cmd == "report":
    report(args[0], int(args[1]), args[2], args[3], args[4:])
PY
helper() { "$PYTHON" "$tmp/helper.py" "$@"; }

# The binary: one copy for the whole bench (the build dir may be relinked meanwhile). Retried for
# a while, since a relink can briefly remove or half-write it.
bin="$tmp/flotilla"
for attempt in $(seq 30); do
  if [[ -x $FLOTILLA ]] && cp "$FLOTILLA" "$bin" 2>/dev/null &&
    "$bin" train --help >"$tmp/help" 2>&1; then
    break
  fi
  ((attempt < 30)) || die "no working $FLOTILLA (build it first: make build)"
  sleep 2
done
for c in "${selected[@]}"; do
  for flag in ${config_flags[$c]}; do
    [[ $flag != --* ]] || grep -q -- "$flag\b" "$tmp/help" ||
      die "configuration '$c' needs 'flotilla train $flag', which this binary lacks" \
        "(CONFIGS=\"...\" runs only the others)"
  done
done

# The network: bridge namespace, worker namespaces, veth pairs, tbf on both ends.
ip_of() { echo "198.18.0.$(($1 + 1))"; }
ip netns add "$bridge_ns" 2>"$tmp/setup.err" ||
  skip "cannot create a network namespace: $(cat "$tmp/setup.err")"
namespaces+=("$bridge_ns")
ip -n "$bridge_ns" link set lo up
ip -n "$bridge_ns" link add br0 type bridge 2>"$tmp/setup.err" ||
  skip "cannot create a bridge: $(cat "$tmp/setup.err")"
ip -n "$bridge_ns" link set br0 up
# burst: 256 KiB (well above one 64 KiB GSO segment and rate/HZ); latency 25 ms: ~3 MB queue.
tbf=(tbf rate "$RATE" burst 256kb latency 25ms)
for i in $(seq 0 $((WORKERS - 1))); do
  ns="$prefix-$i"
  ip netns add "$ns"
  namespaces+=("$ns")
  ip -n "$ns" link set lo up
  ip -n "$bridge_ns" link add "v$i" type veth peer name eth0 netns "$ns"
  ip -n "$bridge_ns" link set "v$i" master br0 up
  ip -n "$ns" addr add "$(ip_of "$i")/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip netns exec "$ns" tc qdisc add dev eth0 root "${tbf[@]}" 2>"$tmp/setup.err" ||
    skip "cannot add a tbf qdisc (sch_tbf): $(cat "$tmp/setup.err")"
  ip netns exec "$bridge_ns" tc qdisc add dev "v$i" root "${tbf[@]}"
done
log "$WORKERS namespaces ($prefix-0..$((WORKERS - 1)), bridge in $bridge_ns)," \
  "links capped at $RATE (tbf)"

# Sanity: every namespace reaches every other (ping if present, else a TCP probe).
probe_port=5000
for i in $(seq 0 $((WORKERS - 1))); do
  if command -v ping >/dev/null; then
    for j in $(seq 0 $((WORKERS - 1))); do
      ((i == j)) || ip netns exec "$prefix-$j" ping -c1 -W1 "$(ip_of "$i")" >/dev/null ||
        die "no connectivity from $prefix-$j to $(ip_of "$i")"
    done
  else
    ip netns exec "$prefix-$i" "$PYTHON" "$tmp/helper.py" serve $probe_port $((WORKERS - 1)) 10 \
      >/dev/null 2>"$tmp/probe-$i.err" &
    server=$!
    pids+=("$server")
    for j in $(seq 0 $((WORKERS - 1))); do
      ((i == j)) || ip netns exec "$prefix-$j" "$PYTHON" "$tmp/helper.py" send "$(ip_of "$i")" \
        $probe_port 1 5 2>>"$tmp/probe-$i.err" ||
        die "no connectivity from $prefix-$j to $(ip_of "$i")"
    done
    wait "$server" || die "probe receiver in $prefix-$i failed: $(cat "$tmp/probe-$i.err")"
  fi
done
log "connectivity between all namespaces: ok"

# The link check: LINK_MB from ns 0 to ns 1 through both tbf ends.
ip netns exec "$prefix-1" "$PYTHON" "$tmp/helper.py" serve 5001 1 60 \
  >"$tmp/link.json" 2>"$tmp/link.err" &
server=$!
pids+=("$server")
ip netns exec "$prefix-0" "$PYTHON" "$tmp/helper.py" send "$(ip_of 1)" 5001 \
  $((LINK_MB * 1000000)) 60 \
  2>>"$tmp/link.err" || die "link check sender failed: $(cat "$tmp/link.err")"
wait "$server" || die "link check receiver failed: $(cat "$tmp/link.err")"
"$PYTHON" -c '
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"bench": "link", "metric": "measured_link_mbit_s",
                  "value": round(r["bytes"] * 8 / r["seconds"] / 1e6, 1),
                  "link": sys.argv[2] + " tbf",
                  "bytes": r["bytes"], "from": "ns0", "to": "ns1"}, separators=(",", ":")))' \
  "$tmp/link.json" "$RATE"

# Training: all namespaces at once, the chief first in TF_CONFIG. Every task holds one random
# cluster token: a job across hosts without one is refused (CommunicationOptions::insecure).
cluster_token=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
cores=$(nproc)
threads=$((cores / WORKERS > 0 ? cores / WORKERS : 1))
port=20000
cluster="{\"chief\":[\"$(ip_of 0):PORT\"],\"worker\":["
for i in $(seq 1 $((WORKERS - 1))); do
  ((i == 1)) || cluster+=","
  cluster+="\"$(ip_of "$i"):PORT\""
done
cluster+="]}"

task_name() { if (($1 == 0)); then echo "chief 0"; else echo "worker $(($1 - 1))"; fi; }

run_config() {  # name run -> appends one result line to $tmp/result-<name>.jsonl
  local name=$1 run=$2 i rc failed=0
  local tag="$name-$run" metrics="$tmp/metrics-$1-$2.json"
  local extra
  read -ra extra <<<"${config_flags[$name]}"
  port=$((port + 1)) # a fresh port per run: no TIME_WAIT leftovers from the last one
  local c=${cluster//PORT/$port}
  rm -f "$metrics"
  pids=()
  for i in $(seq 0 $((WORKERS - 1))); do
    local task
    if ((i == 0)); then
      task='{"type":"chief","index":0}'
    else
      task="{\"type\":\"worker\",\"index\":$((i - 1))}"
    fi
    ip netns exec "$prefix-$i" env TF_CONFIG="{\"cluster\":$c,\"task\":$task}" \
      OMP_NUM_THREADS="$threads" FLOTILLA_CLUSTER_TOKEN="$cluster_token" \
      timeout --kill-after=10 "$RUN_TIMEOUT" "$bin" train --model "$MODEL" --batch-per-replica "$BATCH" \
      --steps-per-epoch "$STEPS" --epochs 2 --verbose 0 --metrics-json "$metrics" --timeout 120 \
      --precision "${PRECISION:-auto}" \
      --threads "$threads" --bytes-per-pack "$PACK" "${extra[@]}" >"$tmp/$tag-$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    if ((rc != 0)); then
      log "config '$name' run $run: $(task_name "$i") in $prefix-$i exited with $rc"
      failed=1
    fi
  done
  pids=()
  if ((failed)); then
    for i in $(seq 0 $((WORKERS - 1))); do
      echo "---- $(task_name "$i") ($prefix-$i, $(ip_of "$i")): tail of $tmp/$tag-$i.log" >&2
      tail -n 20 "$tmp/$tag-$i.log" >&2
    done
    die "training failed (config '$name', run $run)"
  fi
  helper result "$metrics" >>"$tmp/result-$name.jsonl" || die "no epoch in $metrics"
  log "config '$name' run $run: $(tail -n1 "$tmp/result-$name.jsonl")"
}

log "training $MODEL: $WORKERS workers x $threads thread(s), $STEPS steps/epoch x 2 epochs," \
  "$RUNS run(s) of: ${selected[*]}"
for run in $(seq "$RUNS"); do
  for name in "${selected[@]}"; do run_config "$name" "$run"; done
done
helper report "$tmp" "$WORKERS" "$RATE tbf" "$MODEL" "${selected[@]}"
