#!/usr/bin/env bash
# Scenario 7: the rendezvous replicated through a real 3-member etcd cluster over TLS, with client
# certificates (FLOTILLA_RENDEZVOUS=etcds://..., FLOTILLA_ETCD_CACERT/_CERT/_KEY): killing the etcd leader, then the serving rendezvous replica,
# during an elastic fit costs no regroup and no sample.
#
# Hosts 3, 4 and 5 each run an etcd member (Debian's etcd-server, v3 API); hosts 3 and 4 also run
# a replica of `flotilla rendezvous --etcd` (heartbeat timeout 8 s: an 8 s lease, so a replica
# steps down after 6 s without a confirmed renewal; under make test's load the serving replica
# once went 4.3 s without one while etcd elected a new leader (with 4 s: a 5 s lease, 3.75 s),
# and once 4.6 s (with 6 s: a 6 s lease, 4.5 s), and stepped down). Hosts 0-2 run
# tests/multiworker/elastic_trainer (an elastic group of 3, 8 epochs of 10 global batches of 24
# rows, 150 ms a step) with FLOTILLA_RENDEZVOUS=etcds://<the three members>/flit. One replica is
# elected (it creates the job's key under its lease) and serves; the other stands by without
# listening. After 10 committed steps the etcd leader is SIGKILLed: etcd elects another, the
# serving replica keeps renewing its lease through the others, and nothing else happens. After 30,
# the serving replica is SIGKILLed: its lease expires, the standby is elected, the workers find it
# in etcd and join it again naming their generation, and it takes the generation up as it was.
#
# Checks: the first replica serves until it is killed (never steps down for etcd's election); the
# standby takes over; every worker exits 0 in the process it started in, in generation 0 (no
# regroup); the weights equal a one-worker run's within 1e-6 and the ledgers hold each sample once
# per epoch.
#   etcd.sh [FLOTILLA] [PYTHON] [ELASTIC_TRAINER]     (ctest -R netns_etcd)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
netns_init etcd 150 "$@"
command -v etcd >/dev/null || skip "etcd is not installed (apt install etcd-server)"
elastic_trainer_init "${3:-}"

WORKER_HOSTS=2
ETCD_HOSTS=(3 4 5)
REPLICA_HOSTS=(3 4)
PORT=24300
"$trainer" --reference --epochs 14 --out "$tmp/ref" >"$tmp/ref.log" 2>&1 ||
  die "the one-worker reference run failed: $(tail -n 5 "$tmp/ref.log")"

netns_add_hosts 6
etcd_tls "$tmp/certs" "${ETCD_HOSTS[@]}"
members=$(etcd_members "${ETCD_HOSTS[@]}")
endpoints=$(etcd_endpoints "${ETCD_HOSTS[@]}")
declare -A replica_pid
for h in "${ETCD_HOSTS[@]}"; do etcd_start "$h" "$tmp" "$members" "$prefix"; done
etcdctl() { etcd_ctl "$endpoints" "$@"; }
start=$SECONDS
until etcdctl endpoint health >/dev/null 2>&1; do
  ((SECONDS - start < 30)) || die "etcd did not become healthy: $(tail -n 3 "$tmp"/etcd*.log)"
  sleep 0.2
done
url="etcds://$endpoints/flit"
log "etcd: 3 members healthy ($endpoints, TLS with client certificates)"

# start_replica H: a replica of `flotilla rendezvous --etcd` on host H (again, after a kill).
# Its heartbeat timeout (8 s, above) is also the members': they must be back at a newly elected
# replica within it, and with 2 s one run in about eight on this loaded 2-core VM had a worker
# rejoin 2 s after the others (expelled: "did not come back within 2 s after the rendezvous
# restarted").
start_replica() {
  local h=$1
  ip netns exec "$(host_ns "$h")" env FLOTILLA_CLUSTER_TOKEN="$cluster_token" \
    "$bin" rendezvous --listen "$(host_ip "$h"):$PORT" --workers 3 --heartbeat-timeout 8 \
    --etcd "$url" >>"$tmp/replica$h.log" 2>&1 &
  replica_pid[$h]=$!
  pids+=($!)
}
for h in "${REPLICA_HOSTS[@]}"; do
  start_replica "$h"
  sleep 0.5 # the first one is elected
done

# trainer_on NAME HOST: lib.sh's start_trainer with this scenario's settings.
trainer_on() { start_trainer "$1" "$2" "$url" $((PORT + 1)) --epochs 14 --sleep-ms 150; }
for host in 0 1 2; do trainer_on "host$host" "$host"; done
serving_now() { etcdctl get --print-value-only /flotilla/flit/rendezvous; }

wait_steps 10
first=$(serving_now)
leader=$(etcd_leader "${ETCD_HOSTS[@]}")
[[ -n $leader ]] || die "no etcd member says it leads"
kill -KILL "${etcd_pid[$leader]}"
log "killed the etcd leader (member e$leader at $(host_ip "$leader")) after $(($(committed) / 3)) steps"

wait_steps 30
serving=$(serving_now)
serving_host=""
for h in "${REPLICA_HOSTS[@]}"; do [[ $serving == "$(host_ip "$h"):$PORT" ]] && serving_host=$h; done
[[ -n $serving_host ]] || die "etcd names no replica as serving (\"$serving\")"
[[ $serving == "$first" ]] ||
  check_fail "the serving replica changed from $first to $serving while etcd elected a new leader"
if grep -q "stopped serving" "$tmp"/replica*.log; then
  check_fail "a replica stepped down while etcd elected a new leader: $(grep -h 'stopped serving' "$tmp"/replica*.log)"
fi
kill -KILL "${replica_pid[$serving_host]}"
killed_at=$(date +%s%N)
log "killed the serving rendezvous replica ($serving) after $(($(committed) / 3)) steps"
standby=3
((serving_host == 3)) && standby=4
grep -q "serving job" "$tmp/replica$standby.log" && check_fail "the standby served before"
while ! grep -q "serving job" "$tmp/replica$standby.log" &&
  (($(date +%s%N) - killed_at < 20000000000)); do sleep 0.05; done
if grep -q "serving job" "$tmp/replica$standby.log"; then
  log "the standby replica serves $((($(date +%s%N) - killed_at) / 1000000)) ms after the kill:" \
    "$(grep -o 'serving job.*' "$tmp/replica$standby.log" | head -n1)"
else
  check_fail "the standby replica was not elected within 20 s: $(tail -n 3 "$tmp/replica$standby.log")"
fi

# Phase 3: the serving replica's host cut off from the two other etcd members (its own member is
# then the minority); the workers still reach it. It must stop serving by itself, before etcd
# lets its lease expire, and the other replica (started again) be elected.
etcd_start "$leader" "$tmp" "$members" "$prefix"
start_replica "$serving_host"
wait_steps 60
until etcdctl endpoint health >/dev/null 2>&1; do sleep 0.2; done
cut_host=$standby
others=()
for h in "${ETCD_HOSTS[@]}"; do ((h == cut_host)) || others+=("$h"); done
cut_etcd() {
  for h in "${others[@]}"; do
    ip netns exec "$(host_ns "$cut_host")" iptables "$1" INPUT -s "$(host_ip "$h")" -j DROP
    ip netns exec "$(host_ns "$cut_host")" iptables "$1" OUTPUT -d "$(host_ip "$h")" -j DROP
  done
}
served_before=$(grep -c "serving job" "$tmp/replica$serving_host.log" || true)
cut_etcd -I
cut_at=$(date +%s%N)
log "cut the serving replica's host ($(host_ip "$cut_host")) off from etcd members" \
  "$(for h in "${others[@]}"; do printf '%s ' "$(host_ip "$h")"; done)after $(($(committed) / 3)) steps"
while ! grep -q "stopped serving" "$tmp/replica$cut_host.log" &&
  (($(date +%s%N) - cut_at < 20000000000)); do sleep 0.05; done
if grep -q "stopped serving" "$tmp/replica$cut_host.log"; then
  log "the cut-off replica stopped serving $((($(date +%s%N) - cut_at) / 1000000)) ms after the" \
    "cut: $(grep -o 'stopped serving.*' "$tmp/replica$cut_host.log" | head -n1)"
else
  check_fail "the cut-off replica did not stop serving within 20 s"
fi
while (($(grep -c "serving job" "$tmp/replica$serving_host.log" || true) <= served_before)) &&
  (($(date +%s%N) - cut_at < 30000000000)); do sleep 0.05; done
# Never two serving: the time of day each replica logged, in ms.
at_ms() {
  local t
  t=$(grep -o "^flotilla rendezvous: [0-9:.]* $2" "$1" | tail -n 1 | awk '{print $3}')
  [[ -n $t ]] || return 0
  echo $(((10#${t:0:2} * 3600 + 10#${t:3:2} * 60 + 10#${t:6:2}) * 1000 + 10#${t:9:3}))
}
stopped=$(at_ms "$tmp/replica$cut_host.log" "stopped serving")
elected=$(at_ms "$tmp/replica$serving_host.log" "serving job")
if (($(grep -c "serving job" "$tmp/replica$serving_host.log" || true) <= served_before)); then
  check_fail "the other replica was not elected within 30 s of the cut"
elif [[ -z $stopped ]] || ((elected <= stopped)); then
  check_fail "the other replica was elected (${elected} ms) before the cut-off one stopped (${stopped:-never})"
else
  log "the other replica serves $((elected - stopped)) ms after the cut-off one stopped serving"
fi
cut_etcd -D

for name in host0 host1 host2; do
  wait_task "$name"
  ((task_rc == 0)) || {
    check_fail "$name exited with $task_rc"
    show_log "$name"
  }
  if grep -q "elastic: generation [1-9]" "$tmp/$name.log"; then
    check_fail "$name regrouped: $(grep -o 'elastic: generation [1-9].*' "$tmp/$name.log" | head -n1)"
  fi
done
log "connections to the rendezvous lost, in all: $(cat "$tmp"/host[012].log |
  grep -c 'lost the connection to the rendezvous')"
grep -h "rendezvous" "$tmp/host0.log" | cut -c1-220 | sed "s/^/[$netns_name]   host0: /"
if out=$("$PYTHON" "$HELPER" elastic "$tmp/out" "$tmp/ref" 1e-6 14 240 3 3 2>&1); then
  log "$out"
else
  check_fail "$out"
fi
netns_finish
