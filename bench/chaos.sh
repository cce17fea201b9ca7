#!/usr/bin/env bash
# `make bench-chaos`: elastic training under a fault every 20-40 s, against the same training
# with no fault, on namespaced hosts (tests/integration/netns/lib.sh: root, ip netns, iptables).
#
# Five hosts: the four workers' (chief on 198.18.0.1, workers on .2-.4) and the rendezvous's
# (`flotilla rendezvous` on .5, as a cluster would run it beside its tasks). On each worker host a
# supervisor loop, as a scheduler would, starts `flotilla train --elastic` again whenever it
# exits without having finished. Both runs train the same steps; during the chaos run the
# injector cycles through the three faults, on the worker hosts in turn (each round of four
# faults hits every host once, the chief's too, in a random order):
#   kill  SIGKILL
#   stop  SIGSTOP, then SIGCONT after --heartbeat-timeout + 3 s
#   cut   every packet of the host dropped (iptables, inside its namespace), restored after
#         --heartbeat-timeout + 3 s
#   rendezvous  the rendezvous SIGKILLed, and a new one started on its address after
#         --heartbeat-timeout + 3 s (a cluster's supervisor would): the members train on and
#         join the new one, which takes the membership up from them; no regroup is expected
#   etcd  (RENDEZVOUS=etcd) an etcd member SIGKILLed (each round, the leader first), and started
#         again after --heartbeat-timeout + 3 s: nothing is expected to happen
# RENDEZVOUS=etcd: both runs meet through the rendezvous replicated in a real etcd cluster over
# TLS with client certificates (FLOTILLA_RENDEZVOUS=etcds://...): etcd members on three more
# hosts (.5-.7), replicas of `flotilla rendezvous --etcd` on the first two; a `rendezvous` fault kills the serving replica
# and starts it again (as the standby) after --heartbeat-timeout + 3 s. FAULTS defaults to
# "kill stop cut rendezvous etcd" there.
# Each run's processes append a step ledger (flotilla train --step-ledger): per committed
# update, the epoch and step it trained on. A global batch is the same rows whoever trains it
# (the deterministic pipeline; the exactness test in `make test` checks it sample by sample), so
# the ledgers count samples lost or trained twice as whole global batches.
# ELASTIC_BATCH=per-replica: both runs keep the per-replica batch (--elastic-batch per-replica;
# whole passes over the training set, since that option refuses --steps-per-epoch), and the
# ledgers count rows: each update took the rows of its epoch's pass from where the input stood
# after it back by the rows the model counted it training on, and every row of every epoch must
# be taken once.
#
# JSON lines: each run's samples/s (the whole run, start to finish) and their ratio, which the
# VM's speed drift moves since the runs follow each other; so also the chaos run against its own
# epochs that no fault touched (goal >= 0.9: the time the faults cost, drift-proof),
# the ledger's lost/repeated samples (goal 0), restarts beyond one per fault (survivors
# restarted; goal 0), the test accuracy of each run and the difference in points (goal <= 0.5),
# and the time from each fault to the survivors training again. Fails (exit 1) when a goal of
# correctness is missed: samples lost or repeated, or the accuracy (a run without it, or more
# than 0.5 points apart); the goals of time are reported only.
# Usage: bench/chaos.sh [FLOTILLA] [PYTHON]
#   env: CHAOS_LOGS=DIR (keep both runs' logs there) FAULTS="kill stop cut" GAP_MIN=20 GAP_MAX=40
#        DURATION=300 (s of faults) EPOCHS=64 STEPS=468 (an epoch: 60000 rows) BATCH=32 MODEL=mlp
#        HB=2 SEED=1 ELASTIC_BATCH=global|per-replica RENDEZVOUS=builtin|etcd
set -euo pipefail
source "$(dirname "$0")/../tests/integration/netns/lib.sh"
DURATION=${DURATION:-300}
netns_init chaos $((4 * DURATION + 600)) "$@"

EPOCHS=${EPOCHS:-64}
STEPS=${STEPS:-468}
BATCH=${BATCH:-32}
MODEL=${MODEL:-mlp}
HB=${HB:-2}
SEED=${SEED:-1}
RENDEZVOUS=${RENDEZVOUS:-builtin}
case $RENDEZVOUS in
  builtin) FAULTS=${FAULTS:-kill stop cut rendezvous} ;; # cycled through in this order
  etcd)
    command -v etcd >/dev/null || die "RENDEZVOUS=etcd needs etcd (apt install etcd-server)"
    FAULTS=${FAULTS:-kill stop cut rendezvous etcd}
    ;;
  *) die "RENDEZVOUS is builtin or etcd; saw '$RENDEZVOUS'" ;;
esac
ETCD_HOSTS=(4 5 6)
GAP_MIN=${GAP_MIN:-20}          # seconds between faults: drawn from [GAP_MIN, GAP_MAX]
GAP_MAX=${GAP_MAX:-40}
WORKER_HOSTS=3 # + the chief: 4 workers
HOSTS=4
RDZV_HOST=4
machine=$(bash "$(dirname "$0")/machine.sh")
ELASTIC_BATCH=${ELASTIC_BATCH:-global}
case $ELASTIC_BATCH in
  global) length=(--steps-per-epoch "$STEPS") ;;
  per-replica) length=(--elastic-batch per-replica) ;;
  *) die "ELASTIC_BATCH is global or per-replica; saw '$ELASTIC_BATCH'" ;;
esac
train_args=(--elastic --heartbeat-timeout "$HB" --timeout 120 --model "$MODEL" --epochs "$EPOCHS"
  "${length[@]}" --batch-per-replica "$BATCH" --seed 7 --threads 1 --verbose 2 --no-doctor)

if [[ $RENDEZVOUS == etcd ]]; then netns_add_hosts 7; else netns_add_hosts 5; fi
etcd_endpoints=""
etcd_members=""
if [[ $RENDEZVOUS == etcd ]]; then # over TLS with client certificates, as production runs it
  etcd_tls "$tmp/certs" "${ETCD_HOSTS[@]}"
  etcd_endpoints=$(etcd_endpoints "${ETCD_HOSTS[@]}")
  etcd_members=$(etcd_members "${ETCD_HOSTS[@]}")
fi

alive() {
  local p
  for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done
  return 1
}

# run NAME PORT FAULTS: one whole training; sets run_seconds.
run() {
  local name=$1 port=$2 faults=$3 host
  local rdzv="$(host_ip "$RDZV_HOST"):$port"
  [[ $RENDEZVOUS == builtin ]] || rdzv="etcds://$etcd_endpoints/$name"
  mkdir -p "$tmp/$name/ledger"
  if [[ $RENDEZVOUS == etcd ]]; then
    local h
    for h in "${ETCD_HOSTS[@]}"; do etcd_start "$h" "$tmp/$name" "$etcd_members" "$prefix-$name"; done
    until etcd_ctl "$etcd_endpoints" endpoint health >/dev/null 2>&1; do sleep 0.2; done
    for h in 4 5; do start_replica "$name" "$h" "$port"; done
  else
    start_rendezvous "$name" "$rdzv"
  fi
  local start=$SECONDS supervisors=()
  for ((host = 0; host < HOSTS; host++)); do
    supervise "$name" "$host" "$port" "$rdzv" &
    supervisors+=($!)
    pids+=($!)
  done
  if ((faults)); then inject "$name" "$start" "$rdzv" & fi
  local injector=$!
  # Once the group has finished, a worker still waiting to rejoin it has nothing to join.
  while [[ ! -e $tmp/$name/done ]] && kill -0 "${supervisors[0]}" 2>/dev/null; do sleep 1; done
  local grace=$((SECONDS + 20))
  while ((SECONDS < grace)) && alive "${supervisors[@]}"; do sleep 1; done
  for ((host = 0; host < HOSTS; host++)); do
    kill -TERM "$(cat "$tmp/$name/pid-$host")" 2>/dev/null || true
  done
  local s
  for s in "${supervisors[@]}"; do wait "$s" || true; done
  [[ -e $tmp/$name/done ]] || die "$name: no worker finished; logs in $tmp/$name"
  run_seconds=$(($(cat "$tmp/$name/done") - start))
  if ((faults)); then wait "$injector" || true; fi
  local f
  for f in "$tmp/$name"/rdzv-pid "$tmp/$name"/replica-pid-* "$tmp/$name"/etcd-pid-*; do
    [[ -e $f ]] || continue
    kill -TERM "$(cat "$f")" 2>/dev/null || true
    while kill -0 "$(cat "$f")" 2>/dev/null; do sleep 0.1; done
  done
  log "$name: $run_seconds s; $(grep -ho 'Test: .*' "$tmp/$name"/host-*.log | tail -n1)"
}

# start_rendezvous RUN RDZV: `flotilla rendezvous` on its host; its pid in RUN/rdzv-pid.
start_rendezvous() {
  ip netns exec "$(host_ns "$RDZV_HOST")" env FLOTILLA_CLUSTER_TOKEN="$cluster_token" \
    "$bin" rendezvous --listen "$2" --workers "$HOSTS" --heartbeat-timeout "$HB" \
    >>"$tmp/$1/rendezvous.log" 2>&1 &
  echo $! >"$tmp/$1/rdzv-pid"
  pids+=($!)
}

# start_replica RUN H PORT: a replica of `flotilla rendezvous --etcd` on host H; pid in
# RUN/replica-pid-H.
start_replica() {
  ip netns exec "$(host_ns "$2")" env FLOTILLA_CLUSTER_TOKEN="$cluster_token" \
    "$bin" rendezvous --listen "$(host_ip "$2"):$3" --workers "$HOSTS" --heartbeat-timeout "$HB" \
    --etcd "etcds://$etcd_endpoints/$1" >>"$tmp/$1/replica$2.log" 2>&1 &
  echo $! >"$tmp/$1/replica-pid-$2"
  pids+=($!)
}

# supervise RUN HOST PORT RDZV: starts the host's worker again until the group has finished.
supervise() {
  local name=$1 host=$2 port=$3 rdzv=$4 rc tf type=chief index=0
  ((host == 0)) || { type=worker; index=$((host - 1)); }
  tf=$(tf_config "$port" "$type" "$index")
  while [[ ! -e $tmp/$name/done ]]; do
    # No `timeout` in between: the pid is the trainer's own, for the injector's signals.
    ip netns exec "$(host_ns "$host")" env TF_CONFIG="$tf" FLOTILLA_RENDEZVOUS="$rdzv" \
      FLOTILLA_CLUSTER_TOKEN="$cluster_token" OMP_NUM_THREADS=1 \
      "$bin" train "${train_args[@]}" --step-ledger "$tmp/$name/ledger" \
      >>"$tmp/$name/host-$host.log" 2>&1 &
    local pid=$!
    echo "$pid" >"$tmp/$name/pid-$host"
    echo "$SECONDS start $pid" >>"$tmp/$name/starts-$host"
    sample "$name" "$pid" &
    rc=0
    wait "$pid" || rc=$?
    echo "$SECONDS exit $pid $rc" >>"$tmp/$name/starts-$host"
    if ((rc == 0)); then
      # The run's end: when the group finished (its members exit together).
      [[ -e $tmp/$name/done ]] || echo "$SECONDS" >"$tmp/$name/done"
      break
    fi
    sleep 1 # a late joiner fails once the group has finished: done says so by then
  done
}

# sample RUN PID: the process's open files and threads every 5 s while it lives, "<ms> <fds>
# <threads>" in res-PID: what a process that lives through others' faults keeps of each (a
# failed group's backend must be destroyed, not left to its threads and sockets).
sample() {
  local name=$1 pid=$2 fds threads
  while sleep 5; do
    fds=$(ls "/proc/$pid/fd" 2>/dev/null | wc -l)
    threads=$(awk '/^Threads:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || break
    [[ -n $threads ]] && ((fds > 0)) || break
    echo "$(now_ms) $fds $threads" >>"$tmp/$name/res-$pid"
  done
}

# Heals so far: the chief's "training goes on" lines (whoever is chief logs them).
heals() { cat "$tmp/$1"/host-*.log 2>/dev/null | grep -c '; going on from epoch' || true; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# inject RUN START RDZV: a fault every 20-40 s until DURATION s after START (or the run's end).
inject() {
  local name=$1 start=$2 rdzv=$3 n=0 kind host pid before t0 resumed hold_ms=$(((HB + 3) * 1000)) i j t
  local etcd_faults=0 h
  local order=()
  local kinds=($FAULTS)
  RANDOM=$SEED
  while :; do
    sleep $((GAP_MIN + RANDOM % (GAP_MAX - GAP_MIN + 1)))
    ((SECONDS - start < DURATION)) && [[ ! -e $tmp/$name/done ]] || break
    kind=${kinds[n % ${#kinds[@]}]}
    if ((n % HOSTS == 0)); then # each round of HOSTS faults hits every host once, in random order
      order=($(seq 0 $((HOSTS - 1))))
      for ((i = HOSTS - 1; i > 0; i--)); do
        j=$((RANDOM % (i + 1)))
        t=${order[i]} && order[i]=${order[j]} && order[j]=$t
      done
    fi
    host=${order[n % HOSTS]}
    if [[ $kind == rendezvous || $kind == etcd ]]; then
      # The group must not notice: no heal while it is down, nor right after its return.
      n=$((n + 1))
      before=$(heals "$name")
      t0=$(now_ms)
      local what victim
      if [[ $kind == etcd ]]; then
        # Alternately the leader and another member.
        local leader
        leader=$(etcd_leader "${ETCD_HOSTS[@]}")
        victim=$leader
        if ((etcd_faults % 2 == 1)) || [[ -z $leader ]]; then
          for h in "${ETCD_HOSTS[@]}"; do [[ $h == "$leader" ]] || { victim=$h; break; }; done
        fi
        etcd_faults=$((etcd_faults + 1))
        what="etcd member e$victim$([[ $victim == "$leader" ]] && echo ' (the leader)')"
        kill -KILL "$(cat "$tmp/$name/etcd-pid-$victim")"
        sleep $((HB + 3))
        etcd_start "$victim" "$tmp/$name" "$etcd_members" "$prefix-$name"
      elif [[ $RENDEZVOUS == etcd ]]; then
        local serving
        serving=$(etcd_ctl "$etcd_endpoints" get --print-value-only "/flotilla/$name/rendezvous" \
          2>/dev/null || true)
        victim=4
        [[ $serving == "$(host_ip 5):"* ]] && victim=5
        what="the serving replica ($serving)"
        kill -KILL "$(cat "$tmp/$name/replica-pid-$victim")"
        sleep $((HB + 3))
        start_replica "$name" "$victim" "${rdzv_port[$name]}"
      else
        victim=$RDZV_HOST
        what="rendezvous"
        kill -KILL "$(cat "$tmp/$name/rdzv-pid")"
        sleep $((HB + 3))
        start_rendezvous "$name" "$rdzv"
      fi
      sleep 10
      echo "$((SECONDS - start)) $kind $victim x $(($(heals "$name") - before)) $t0" >>"$tmp/$name/faults"
      log "fault $n at $((SECONDS - start)) s: $what killed, started again after $((HB + 3)) s;" \
        "$(($(heals "$name") - before)) regroups"
      continue
    fi
    pid=$(cat "$tmp/$name/pid-$host")
    kill -0 "$pid" 2>/dev/null || continue
    n=$((n + 1))
    before=$(heals "$name")
    t0=$(now_ms)
    case $kind in
      kill) kill -KILL "$pid" ;;
      stop) kill -STOP "$pid" ;;
      cut)
        ip netns exec "$(host_ns "$host")" iptables -I INPUT 1 ! -i lo -j DROP
        ip netns exec "$(host_ns "$host")" iptables -I OUTPUT 1 ! -o lo -j DROP
        ;;
    esac
    # Resumed: the survivors regrouped and train again (the chief's line after the heal).
    resumed=none
    while [[ ! -e $tmp/$name/done ]] && (($(now_ms) - t0 < 60000)); do
      if (($(heals "$name") > before)); then
        resumed=$(($(now_ms) - t0))
        break
      fi
      sleep 0.05
    done
    if [[ $kind != kill ]]; then
      local left=$((hold_ms - ($(now_ms) - t0)))
      ((left <= 0)) || sleep "$((left / 1000)).$(printf '%03d' $((left % 1000)))"
      if [[ $kind == stop ]]; then
        kill -CONT "$pid" 2>/dev/null || true
      else
        ip netns exec "$(host_ns "$host")" iptables -D INPUT ! -i lo -j DROP
        ip netns exec "$(host_ns "$host")" iptables -D OUTPUT ! -o lo -j DROP
      fi
    fi
    echo "$((SECONDS - start)) $kind $host $pid $resumed $t0" >>"$tmp/$name/faults"
    log "fault $n at $((SECONDS - start)) s: $kind host $host (pid $pid); training again after" \
      "$resumed ms"
  done
}

declare -A rdzv_port=([free]=23500 [chaos]=23600)
run free 23500 0
free_s=$run_seconds
run chaos 23600 1
chaos_s=$run_seconds

status=0
"$PYTHON" - "$tmp" "$EPOCHS" "$STEPS" "$((BATCH * HOSTS))" "$HOSTS" "$free_s" "$chaos_s" \
  "$MODEL" "$HB" "$machine" "$DURATION" "$ELASTIC_BATCH" "$RENDEZVOUS" <<'EOF' || status=$?
import glob, json, os, re, statistics, sys
tmp, epochs, steps, global_batch, hosts = sys.argv[1], *map(int, sys.argv[2:6])
free_s, chaos_s, model, hb, machine = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8], float(sys.argv[9]), json.loads(sys.argv[10])
duration, elastic_batch, rendezvous = int(sys.argv[11]), sys.argv[12], sys.argv[13]
rows_mode = elastic_batch == "per-replica"
common = {"bench": "chaos", "model": model, "workers": hosts, "global_batch": global_batch,
          "heartbeat_timeout_s": hb, "elastic_batch": elastic_batch, "rendezvous": rendezvous,
          "machine": machine}
if rendezvous == "etcd":  # as production runs it (etcd_tls in tests/integration/netns/lib.sh)
    common["etcd"] = "TLS, client and peer certificates required"
def out(**kv):
    print(json.dumps({**common, **kv}, separators=(",", ":")))
failed = False

def accuracy(run):
    lines = []
    for path in glob.glob(f"{tmp}/{run}/host-*.log"):
        lines += re.findall(r"Test: loss: [0-9.]+ - accuracy: ([0-9.]+)", open(path, errors="replace").read())
    return float(lines[-1]) if lines else None

def ledger(run):
    """The committed updates of all processes, those a heal rolled back dropped: counts, and
    each epoch's end time (the last update's, in ms)."""
    by_update, epoch_end, first = {}, {}, None
    for path in glob.glob(f"{tmp}/{run}/ledger/ledger-*.txt"):
        kept = []
        for line in open(path):
            u, e, s, w, t, read, rows = list(map(int, line.split()))[:7]
            while kept and kept[-1][0] >= u:  # rolled back by a heal: redone below
                kept.pop()
            # Per-replica: where the pass stood after the update and the rows trained so far.
            kept.append((u, e, (e, read, rows) if rows_mode else (e, s), t))
        for u, e, what, t in kept:
            by_update.setdefault(u, set()).add(what)
            epoch_end[e] = max(epoch_end.get(e, 0), t)
            first = t if first is None else min(first, t)
    conflicts = sum(1 for v in by_update.values() if len(v) > 1)
    if rows_mode:
        return rows_ledger(by_update, conflicts), (first, [epoch_end.get(e) for e in range(epochs)])
    trained = {}
    for u, v in by_update.items():
        for batch in v:
            trained.setdefault(batch, set()).add(u)
    lost = sum(1 for e in range(epochs) for s in range(steps) if (e, s) not in trained)
    repeated = sum(len(us) - 1 for us in trained.values())
    return {"updates": len(by_update), "lost_samples": lost * global_batch,
            "repeated_samples": repeated * global_batch, "conflicting_updates": conflicts}, \
        (first, [epoch_end.get(e) for e in range(epochs)])

def rows_ledger(by_update, conflicts):
    """Update u took rows [read - n, read) of its epoch's pass, n its rows trained less update
    u - 1's; every row of every epoch (an epoch: the rows the fault-free run's first pass read)
    must be taken once."""
    taken, unverifiable = {}, 0
    for u, v in by_update.items():
        e, read, rows = min(v)
        before = by_update.get(u - 1)
        if u == 1:
            n = rows
        elif before:
            n = rows - min(before)[2]
        else:  # no process recorded the update before: its rows cannot be told
            unverifiable += 1
            continue
        taken.setdefault(e, []).append((read - n, read))
    lost = repeated = 0
    for e in range(epochs):
        spans, at = sorted(taken.get(e, [])), 0
        for a, b in spans:
            lost += max(0, a - at)
            repeated += max(0, min(b, at) - a)
            at = max(at, b)
        lost += max(0, epoch_rows - at)
    return {"updates": len(by_update), "lost_samples": lost, "repeated_samples": repeated,
            "conflicting_updates": conflicts, "unverifiable_updates": unverifiable,
            "rows_per_epoch": epoch_rows}

epoch_rows = 0
if rows_mode:  # the rows of a pass, as the fault-free run read them
    for path in glob.glob(f"{tmp}/free/ledger/ledger-*.txt"):
        for line in open(path):
            f = list(map(int, line.split()))
            if f[1] == 0:
                epoch_rows = max(epoch_rows, f[5])
samples = epochs * (epoch_rows if rows_mode else steps * global_batch)
for run, seconds in (("free", free_s), ("chaos", chaos_s)):
    out(config="fault-free" if run == "free" else "chaos", metric="samples_per_s",
        value=round(samples / seconds, 1), seconds=seconds, samples=samples)
out(metric="samples_per_s", ratio=round(free_s / chaos_s, 3), of="chaos run/fault-free run",
    note="the two runs follow each other: the VM's speed drift moves this ratio")

faults = [l.split() for l in open(f"{tmp}/chaos/faults")] if os.path.exists(f"{tmp}/chaos/faults") else []
# Drift-proof: each epoch a fault touched (from the fault to 15 s after: detection, the hold,
# the restart, the rejoin) against the median of the 6 nearest epochs no fault touched, in the
# same run. The time lost is the sum of the differences.
stats = {run: ledger(run) for run in ("free", "chaos")}
first, ends = stats["chaos"][1]
if first is not None and all(t is not None for t in ends):
    starts = [first] + ends[:-1]
    spans = list(zip(starts, ends))
    hit = [any(int(f[5]) < b and int(f[5]) + 15000 > a for f in faults) for a, b in spans]
    calm = [i for i in range(1, epochs) if not hit[i]]
    lost_ms = 0.0
    for i in range(epochs):
        if hit[i] and calm:
            near = sorted(calm, key=lambda j: abs(j - i))[:6]
            lost_ms += (spans[i][1] - spans[i][0]) - statistics.median(spans[j][1] - spans[j][0] for j in near)
    total_ms = ends[-1] - first
    out(config="chaos", metric="samples_per_s", ratio=round((total_ms - lost_ms) / total_ms, 3),
        of="chaos/its own fault-free epochs", lost_s=round(lost_ms / 1000, 1),
        lost_s_per_fault=round(lost_ms / 1000 / max(1, len(faults)), 2),
        epochs_touched=sum(hit), goal=">= 0.9")
kinds = {}
for f in faults:
    kinds[f[1]] = kinds.get(f[1], 0) + 1
starts = restarts = 0
for h in range(hosts):
    path = f"{tmp}/chaos/starts-{h}"
    n = sum(1 for l in open(path) if " start " in l) if os.path.exists(path) else 0
    hit = sum(1 for f in faults if int(f[2]) == h)
    starts += n
    restarts += max(0, n - 1 - hit)
out(metric="faults", value=len(faults), kinds=kinds, duration_s=duration,
    process_starts=starts, survivor_restarts=restarts, goal_survivor_restarts=0)
for run in ("free", "chaos"):
    out(config="fault-free" if run == "free" else "chaos", metric="ledger", **stats[run][0], goal="0 lost, 0 repeated")
    if stats[run][0]["lost_samples"] or stats[run][0]["repeated_samples"]:
        print(f"chaos: the {run} run lost or repeated samples (its ledger line above)", file=sys.stderr)
        failed = True
# What processes keep of the faults they lived through (others' faults): open files and threads
# gained per fault, from the last sample before the first of them (a training process; the
# very first sample can be one still starting) to the fewest of its last three before its own
# fault, if any (a failed group is destroyed a moment after the heal, or once a stopped or
# cut-off peer exits).
fds = threads = seen = 0
for path in glob.glob(f"{tmp}/chaos/res-*"):
    pid = path.rsplit("-", 1)[1]
    own = min([int(f[5]) for f in faults if f[3] == pid] or [float("inf")])  # its own fault ends it
    rows = [r for r in (list(map(int, l.split())) for l in open(path) if len(l.split()) == 3) if r[0] < own]
    lived = [int(f[5]) for f in faults if f[3] != pid and rows and rows[0][0] < int(f[5]) < rows[-1][0]]
    before = [r for r in rows if lived and r[0] < min(lived)]
    if len(before) < 2:
        continue
    end = min(rows[-3:], key=lambda r: (r[1], r[2]))
    fds, threads = fds + end[1] - before[-1][1], threads + end[2] - before[-1][2]
    seen += sum(1 for t in lived if t < end[0])
if seen:
    out(config="chaos", metric="kept_per_fault_lived_through", fds=round(fds / seen, 2),
        threads=round(threads / seen, 2), faults_lived_through=seen)
a_free, a_chaos = accuracy("free"), accuracy("chaos")
out(metric="test_accuracy", fault_free=a_free, chaos=a_chaos,
    diff_points=None if a_free is None or a_chaos is None else round(abs(a_free - a_chaos) * 100, 2), goal="<= 0.5")
missing = [run for run, a in (("fault-free", a_free), ("chaos", a_chaos)) if a is None]
if missing:
    print(f"chaos: the {' and the '.join(missing)} run printed no test accuracy (no 'Test: ... accuracy' "
          f"line in its hosts' logs): it did not finish its evaluation; keep its logs with CHAOS_LOGS=DIR "
          f"and read them", file=sys.stderr)
    failed = True
elif abs(a_free - a_chaos) * 100 > 0.5:
    print(f"chaos: the test accuracy differs by {abs(a_free - a_chaos) * 100:.2f} points (goal <= 0.5)",
          file=sys.stderr)
    failed = True
for kind in ("rendezvous", "etcd"):
    outages = [f for f in faults if f[1] == kind]
    if outages:
        out(metric=f"{kind}_outages", count=len(outages), regroups=sum(int(f[4]) for f in outages),
            goal_regroups=0, note="each: killed, started again after heartbeat timeout + 3 s; "
            "regroups counted to 10 s after its return (a fault of another kind in that time "
            "would count too)")
for kind in ("kill", "stop", "cut"):
    times = [int(f[4]) / 1000 for f in faults if f[1] == kind and f[4] != "none"]
    if times:
        out(metric="fault_to_training_again_s", fault=kind, median=round(statistics.median(times), 2),
            max=round(max(times), 2), count=len(times),
            goal=("< 2" if kind == "kill" else f"< {hb + 2:g}"))
sys.exit(1 if failed else 0)
EOF
if [[ -n ${CHAOS_LOGS:-} ]]; then
  mkdir -p "$CHAOS_LOGS"
  cp -r "$tmp/free" "$tmp/chaos" "$CHAOS_LOGS/"
  log "logs copied to $CHAOS_LOGS"
fi
((status == 0)) || netns_failures+=("a goal of correctness missed: samples lost or repeated, or the test accuracy (above)")
netns_finish
