# Sourced by the scenario scripts in this folder (never run by itself). Gives each scenario
# "hosts": network namespaces joined by veth pairs to a Linux bridge that lives in a namespace of
# its own, so the root namespace's network is never touched. Host i is namespace <prefix>-i with
# address 198.18.0.<i+1>/24 on its eth0 (the benchmarking range 198.18.0.0/15). Tasks run there
# with `ip netns exec` and their own TF_CONFIG, each under `timeout` so none can outlive a hang.
#
# Every namespace, and with it every veth, bridge, qdisc and iptables rule (all rules are added
# inside our namespaces, never in the root one), is removed on every exit: success, failure,
# Ctrl-C, or the scenario's own deadline (the script re-runs itself under `timeout`, whose SIGTERM
# reaches the trap; ctest's TIMEOUT is only the outer hang guard). Namespaces left by a run that
# was killed outright (SIGKILL) carry its PID in their name and are removed by the next run once
# that PID is gone.
#
# A scenario script calls, in order:
#   netns_init NAME DEADLINE_S "$@"  checks root / ip netns / iptables / tc (exit 77 to skip),
#                                     makes $tmp, copies the binary to $bin, installs the trap
#   netns_add_hosts N                 the bridge and N hosts; checks every pair can connect
# then start_task / wait_task / the check helpers below, and ends with netns_finish.
# Arguments to the script: [FLOTILLA] [PYTHON] (defaults: build/flotilla, .venv/bin/python).

NETNS_PREFIX=flit # flotilla integration test; stale-namespace cleanup matches "flit-<pid>-"
NETNS_SKIP=77     # ctest SKIP_RETURN_CODE

log() { echo "[$netns_name] $*"; }
skip() {
  log "SKIPPED: $*"
  exit "$NETNS_SKIP"
}
die() {
  log "ERROR: $*"
  exit 1
}
# A failed check is recorded and the scenario goes on (later checks still say something); the
# scenario fails at netns_finish if any check failed.
netns_failures=()
check_fail() {
  log "FAIL: $*"
  netns_failures+=("$*")
}

host_ip() { echo "198.18.0.$(($1 + 1))"; }
host_ns() { echo "$prefix-$1"; }

# Removes namespaces named flit-<pid>-* whose <pid> no longer runs: a run killed with SIGKILL
# (ctest's timeout) could not clean up. Processes still inside them were started by that run.
netns_remove_stale() {
  local ns pid p
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ $ns =~ ^$NETNS_PREFIX-([0-9]+)- ]] || continue
    pid=${BASH_REMATCH[1]}
    [[ $pid != "$$" ]] || continue
    kill -0 "$pid" 2>/dev/null && continue
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null && log "removed stale namespace $ns (its run, pid $pid, is gone)"
  done
  return 0
}

netns_cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM HUP
  local pid ns
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  # Whatever still runs inside our namespaces was started by this script.
  for ns in "${namespaces[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
  done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  # Deleting a namespace destroys its veth ends (and their peers), its qdiscs and its iptables
  # rules; the bridge namespace takes the bridge with it.
  for ns in "${namespaces[@]}"; do ip netns del "$ns" 2>/dev/null; done
  for ns in "${namespaces[@]}"; do
    [[ ! -e /run/netns/$ns ]] || echo "[$netns_name] WARNING: could not remove namespace $ns" >&2
  done
  if ((rc == 0 || rc == NETNS_SKIP)); then
    rm -rf "$tmp"
  elif [[ -n ${tmp:-} ]]; then
    log "logs kept in $tmp"
  fi
  exit "$rc"
}

netns_init() {
  netns_name=$1
  local deadline=$2
  shift 2
  # Re-run under `timeout`: at the deadline the script gets SIGTERM and its trap cleans up.
  if [[ -z ${FLOTILLA_NETNS_GUARDED:-} ]]; then
    FLOTILLA_NETNS_GUARDED=1 exec timeout -k 15 "$deadline" bash "$0" "$@"
  fi
  set -euo pipefail
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
  FLOTILLA=${1:-$root/build/flotilla}
  PYTHON=${2:-$root/.venv/bin/python}
  HELPER=$(dirname "${BASH_SOURCE[0]}")/helper.py

  [[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces, veth, iptables, tc)"
  command -v ip >/dev/null && ip netns list >/dev/null 2>&1 || skip "'ip netns' is not available"
  command -v tc >/dev/null || skip "'tc' (iproute2) is not available"
  command -v iptables >/dev/null || skip "'iptables' is not available"
  command -v timeout >/dev/null || skip "'timeout' (coreutils) is not available"
  [[ -x $PYTHON ]] || die "no python at $PYTHON (run scripts/bootstrap)"
  [[ -x $FLOTILLA ]] || die "no flotilla binary at $FLOTILLA (ninja -C build flotilla_cli)"

  prefix="$NETNS_PREFIX-$$"
  namespaces=()
  pids=()
  declare -gA task_pid=()
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/flotilla-netns-$netns_name.XXXXXX")
  trap netns_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 129' HUP
  trap 'log "deadline or signal: stopping"; exit 143' TERM
  netns_remove_stale

  # One copy for the whole scenario: the build dir may be relinked meanwhile, and the reference
  # run and the namespaced runs must be the same program.
  bin=$tmp/flotilla
  cp "$FLOTILLA" "$bin"
  "$bin" --version >/dev/null 2>&1 || die "$FLOTILLA does not run"
}

netns_add_hosts() {
  local n=$1 i ns bridge_ns="$prefix-br"
  ip netns add "$bridge_ns" 2>"$tmp/setup.err" ||
    skip "cannot create a network namespace: $(cat "$tmp/setup.err")"
  namespaces+=("$bridge_ns")
  ip -n "$bridge_ns" link set lo up
  ip -n "$bridge_ns" link add br0 type bridge 2>"$tmp/setup.err" ||
    skip "cannot create a bridge: $(cat "$tmp/setup.err")"
  ip -n "$bridge_ns" link set br0 up
  for ((i = 0; i < n; i++)); do
    ns=$(host_ns "$i")
    ip netns add "$ns"
    namespaces+=("$ns")
    ip -n "$ns" link set lo up
    ip -n "$bridge_ns" link add "v$i" type veth peer name eth0 netns "$ns" 2>"$tmp/setup.err" ||
      skip "cannot create a veth pair: $(cat "$tmp/setup.err")"
    ip -n "$bridge_ns" link set "v$i" master br0 up
    ip -n "$ns" addr add "$(host_ip "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
  # Every host reaches every other over TCP (no ping on this machine).
  local j port=5000 server
  for ((i = 0; i < n; i++)); do
    ip netns exec "$(host_ns "$i")" "$PYTHON" "$HELPER" serve "$port" $((n - 1)) 10 \
      2>"$tmp/probe.err" &
    server=$!
    pids+=("$server")
    for ((j = 0; j < n; j++)); do
      ((i == j)) || ip netns exec "$(host_ns "$j")" "$PYTHON" "$HELPER" send "$(host_ip "$i")" \
        "$port" 5 2>>"$tmp/probe.err" ||
        die "no TCP connection from $(host_ns "$j") to $(host_ip "$i"): $(cat "$tmp/probe.err")"
    done
    wait "$server" || die "probe listener in $(host_ns "$i") failed: $(cat "$tmp/probe.err")"
  done
  log "$n hosts ($prefix-0..$((n - 1)), 198.18.0.1..$n, bridge in $bridge_ns): all connected"
}

# Caps both ends of host i's link (its eth0 and the bridge's v<i>) with a token bucket.
cap_link() {
  local i=$1 rate=$2
  ip netns exec "$(host_ns "$i")" tc qdisc replace dev eth0 root tbf rate "$rate" burst 32kbit \
    latency 400ms
  ip netns exec "$prefix-br" tc qdisc replace dev "v$i" root tbf rate "$rate" burst 32kbit \
    latency 400ms
}
uncap_link() {
  ip netns exec "$(host_ns "$1")" tc qdisc del dev eth0 root 2>/dev/null || true
  ip netns exec "$prefix-br" tc qdisc del dev "v$1" root 2>/dev/null || true
}

# TF_CONFIG for task TYPE INDEX of the cluster: chief on host 0, worker k on host k+1, all on
# PORT; with EVALUATOR_HOST set, an evaluator on that host (same port).
tf_config() {
  local port=$1 type=$2 index=$3 i cluster
  cluster="\"chief\":[\"$(host_ip 0):$port\"],\"worker\":["
  for ((i = 1; i < WORKER_HOSTS + 1; i++)); do
    ((i == 1)) || cluster+=","
    cluster+="\"$(host_ip "$i"):$port\""
  done
  cluster+="]"
  [[ -z ${EVALUATOR_HOST:-} ]] || cluster+=",\"evaluator\":[\"$(host_ip "$EVALUATOR_HOST"):$port\"]"
  echo "{\"cluster\":{$cluster},\"task\":{\"type\":\"$type\",\"index\":$index}}"
}

# start_task NAME HOST TF_CONFIG TIMEOUT_S ARGS... : `flotilla train ARGS` on host HOST in the
# background, output in $tmp/NAME.log, killed after TIMEOUT_S (a hang guard, never a check).
# Every task of a scenario holds the same random cluster token, so each join across the namespaces
# goes through the HMAC challenge-response, as on real hosts. Equal shares (--shares equal), here
# and in the reference run: a division measured by speed depends on each run's timing, and the
# scenarios compare weights across runs.
cluster_token=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
start_task() {
  local name=$1 host=$2 tf=$3 limit=$4
  shift 4
  ip netns exec "$(host_ns "$host")" env TF_CONFIG="$tf" OMP_NUM_THREADS=1 \
    FLOTILLA_CLUSTER_TOKEN="$cluster_token" \
    timeout -k 5 "$limit" "$bin" train --shares equal "$@" >"$tmp/$name.log" 2>&1 &
  task_pid[$name]=$!
  pids+=($!)
}

# wait_task NAME: sets task_rc to its exit code (124: killed by its hang guard). Not in a $(...):
# a subshell cannot wait for this shell's children.
wait_task() {
  task_rc=0
  wait "${task_pid[$1]}" || task_rc=$?
}

# Scenarios with tests/multiworker/elastic_trainer (its path: the script's third argument):
#   elastic_trainer_init           copies it to $trainer
#   start_trainer NAME HOST RDZV PORT ARGS...   it on HOST as TF_CONFIG's task there (chief on
#                                  host 0, cluster ports PORT), FLOTILLA_RENDEZVOUS=RDZV, ledger in
#                                  $tmp/out, output in $tmp/NAME.log, a 100 s hang guard
#   committed                      ledger lines so far (one per update per worker)
#   wait_steps N [WORKERS]         until the group committed N steps (WORKERS, default 3)
elastic_trainer_init() {
  trainer=$tmp/elastic_trainer
  cp "${1:-$(dirname "$FLOTILLA")/tests/elastic_trainer}" "$trainer"
  mkdir -p "$tmp/ref" "$tmp/out"
}
start_trainer() {
  local name=$1 host=$2 rdzv=$3 port=$4 type=chief index=0
  shift 4
  ((host == 0)) || { type=worker; index=$((host - 1)); }
  ip netns exec "$(host_ns "$host")" env TF_CONFIG="$(tf_config "$port" "$type" "$index")" \
    FLOTILLA_RENDEZVOUS="$rdzv" FLOTILLA_CLUSTER_TOKEN="$cluster_token" OMP_NUM_THREADS=1 \
    timeout -k 5 100 "$trainer" --out "$tmp/out" "$@" >"$tmp/$name.log" 2>&1 &
  task_pid[$name]=$!
  pids+=($!)
}
committed() { cat "$tmp"/out/ledger-*.txt 2>/dev/null | wc -l; }
wait_steps() {
  local n=$1 workers=${2:-3} start=$SECONDS
  while (($(committed) < n * workers)) && ((SECONDS - start < 60)); do sleep 0.05; done
  (($(committed) >= n * workers)) ||
    die "the group did not train $n steps within 60 s: $(tail -n 3 "$tmp"/host*.log)"
}

# etcd (Debian's etcd-server) in the namespaces, as production runs it: TLS between members and
# to clients, and only clients with a certificate its CA signed (--client-cert-auth):
#   etcd_tls DIR H...                certificates for the members on hosts H... in DIR
#                                    (tests/support/etcd_certs.sh); exports FLOTILLA_ETCD_CACERT,
#                                    _CERT and _KEY for every flotilla process started after it
#   etcd_members H...                --initial-cluster's list for members on hosts H...
#   etcd_endpoints H...              their client endpoints, HOST:PORT,...
#   etcd_start H DIR CLUSTER TOKEN   a member named eH on host H (client port 2379, peer 2380),
#                                    its data in DIR/etcdH (kept: starting it again rejoins),
#                                    log DIR/etcdH.log, pid in etcd_pid[H] and in
#                                    DIR/etcd-pid-H (for a subshell's kill); CLUSTER is
#                                    etcd_members', TOKEN the cluster's token
#   etcd_ctl ENDPOINTS ARGS...       etcdctl (v3) from host 0 with the client certificate
#   etcd_leader H...                 which of these hosts' members leads now (none: empty)
# The members run at nice -10: a cluster gives etcd hosts of its own, and here it shares two cores
# with the tests make test runs beside it. Starved, one leader election took over 3.7 s, longer
# than a serving replica may go without renewing its lease, and the replica stepped down.
declare -gA etcd_pid=()
etcd_certs=""
etcd_tls() {
  local dir=$1 ips=() h
  shift
  for h in "$@"; do ips+=("$(host_ip "$h")"); done
  "$(dirname "${BASH_SOURCE[0]}")/../../support/etcd_certs.sh" "$dir" "${ips[@]}" ||
    die "could not make etcd's certificates"
  etcd_certs=$dir
  export FLOTILLA_ETCD_CACERT=$dir/ca.pem FLOTILLA_ETCD_CERT=$dir/client.pem \
    FLOTILLA_ETCD_KEY=$dir/client.key
}
etcd_members() {
  local h out=""
  for h in "$@"; do out+="${out:+,}e$h=https://$(host_ip "$h"):2380"; done
  echo "$out"
}
etcd_endpoints() {
  local h out=""
  for h in "$@"; do out+="${out:+,}$(host_ip "$h"):2379"; done
  echo "$out"
}
etcd_start() {
  local h=$1 dir=$2 ip c=$etcd_certs
  [[ -n $c ]] || die "etcd_start before etcd_tls"
  ip=$(host_ip "$h")
  ip netns exec "$(host_ns "$h")" nice -n -10 etcd --name "e$h" --data-dir "$dir/etcd$h" \
    --listen-client-urls "https://$ip:2379" --advertise-client-urls "https://$ip:2379" \
    --listen-peer-urls "https://$ip:2380" --initial-advertise-peer-urls "https://$ip:2380" \
    --initial-cluster "$3" --initial-cluster-state new --initial-cluster-token "$4" \
    --cert-file "$c/server.pem" --key-file "$c/server.key" --trusted-ca-file "$c/ca.pem" \
    --client-cert-auth --peer-cert-file "$c/server.pem" --peer-key-file "$c/server.key" \
    --peer-trusted-ca-file "$c/ca.pem" --peer-client-cert-auth \
    >>"$dir/etcd$h.log" 2>&1 &
  etcd_pid[$h]=$!
  echo $! >"$dir/etcd-pid-$h"
  pids+=($!)
}
etcd_ctl() {
  local endpoints=$1
  shift
  ip netns exec "$(host_ns 0)" env ETCDCTL_API=3 etcdctl --endpoints "$endpoints" \
    --cacert "$etcd_certs/ca.pem" --cert "$etcd_certs/client.pem" --key "$etcd_certs/client.key" "$@"
}
etcd_leader() {
  local h
  for h in "$@"; do
    if etcd_ctl "$(host_ip "$h"):2379" endpoint status -w json 2>/dev/null | "$PYTHON" -c 'import json, sys
s = json.load(sys.stdin)[0]["Status"]
sys.exit(s["leader"] != s["header"]["member_id"])' 2>/dev/null; then
      echo "$h"
      return
    fi
  done
}

# start_cluster RUN PORT TIMEOUT_S ARGS...: chief + WORKER_HOSTS workers, tasks RUN-chief,
# RUN-worker0, ...
start_cluster() {
  local run=$1 port=$2 limit=$3 k
  shift 3
  start_task "$run-chief" 0 "$(tf_config "$port" chief 0)" "$limit" "$@"
  for ((k = 0; k < WORKER_HOSTS; k++)); do
    start_task "$run-worker$k" $((k + 1)) "$(tf_config "$port" worker "$k")" "$limit" "$@"
  done
}

# wait_cluster RUN: waits for every task of the run; a task that did not exit 0 is a failed
# check, with the tail of its log.
wait_cluster() {
  local run=$1 name k ok=0
  local names=("$run-chief")
  for ((k = 0; k < WORKER_HOSTS; k++)); do names+=("$run-worker$k"); done
  for name in "${names[@]}"; do
    wait_task "$name"
    if ((task_rc != 0)); then
      check_fail "$name exited with $task_rc"
      show_log "$name"
      ok=1
    fi
  done
  return $ok
}

show_log() {
  log "---- tail of $1.log"
  tail -n "${2:-15}" "$tmp/$1.log" | sed "s/^/[$netns_name]   /"
}

# The same training on loopback, as `flotilla launch` runs it: the reference a namespaced run's
# numbers must equal. Over the Gloo ring, as the namespaced hosts reduce (to shared memory they
# are different hosts): shared memory sums three workers' gradients in another order. Output in
# $tmp/ref/ (ckpt/, metrics.json, launch.log).
reference_run() {
  mkdir -p "$tmp/ref"
  local rc=0
  OMP_NUM_THREADS=1 timeout -k 5 "${REF_TIMEOUT:-120}" "$bin" launch --workers "$((WORKER_HOSTS + 1))" -- \
    "$bin" train --shares equal "$@" --no-shared-memory --checkpoint-dir "$tmp/ref/ckpt" --metrics-json "$tmp/ref/metrics.json" \
    >"$tmp/ref/launch.log" 2>&1 || rc=$?
  if ((rc != 0)); then
    tail -n 20 "$tmp/ref/launch.log"
    die "the loopback reference run (flotilla launch --workers $((WORKER_HOSTS + 1))) exited with $rc"
  fi
  log "loopback reference: $(grep -o 'Test: .*' "$tmp/ref/launch.log" | tail -n1)"
}

# same_weights DIR_A DIR_B TOL WHAT: the newest checkpoints' model weights agree within TOL
# (relative, per tensor: max|a-b| / max|b|).
same_weights() {
  local out
  if out=$("$PYTHON" "$HELPER" weights "$1" "$2" "$3" 2>&1); then
    log "weights, $4: $out"
  else
    check_fail "weights, $4: $out"
  fi
}

# same_metrics JSON_A JSON_B TOL WHAT [KEYS]: the last epoch's logs and the test result agree.
same_metrics() {
  local out
  if out=$("$PYTHON" "$HELPER" metrics "$1" "$2" "$3" "${5:-epoch,test}" 2>&1); then
    log "metrics, $4: $out"
  else
    check_fail "metrics, $4: $out"
  fi
}

netns_finish() {
  if ((${#netns_failures[@]})); then
    log "FAILED (${#netns_failures[@]} check(s)):"
    local f
    for f in "${netns_failures[@]}"; do log "  - $f"; done
    exit 1
  fi
  log "PASSED ($SECONDS s)"
  exit 0
}
