#!/usr/bin/env bash
# Scenario 6: elastic mode, the workers partitioned from each other while all reach the
# rendezvous; the larger side goes on, the smaller is expelled.
#
# Three hosts run tests/multiworker/elastic_trainer (an elastic group of 3, 8 epochs of 10 global
# batches of 24 rows, collectives timing out after 6 s) and a fourth runs the rendezvous. Once the
# group has committed 7 steps, host 2 drops every packet from and to hosts 0 and 1 (iptables
# inside its namespace), not the rendezvous's: every heartbeat still arrives, so no member is
# silent, and the collectives time out on all three. Each member then probes the others
# (flotilla/rendezvous/probe.h) and reports whom it could not reach; the rendezvous expels slot 2, the
# smaller side, and hosts 0 and 1 train on in generation 1. Before, every worker exited 3 after
# the timeout ("no member left the group"). The expelled process exits 3 saying so; once the cut
# is lifted it is started again and admitted.
#
# Checks: the rendezvous names the partition and expels slot 2 only; the survivors keep their
# processes and exit 0; the victim exits 3, expelled; its restart is admitted; every slot's final
# weights equal a one-worker run's within 1e-6 and the ledgers hold each sample once per epoch.
#   partition.sh [FLOTILLA] [PYTHON] [ELASTIC_TRAINER]     (ctest -R netns_partition)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
netns_init partition 150 "$@"
elastic_trainer_init "${3:-}"

WORKER_HOSTS=2
VICTIM=2
RDZV_HOST=3
PORT=24200
rdzv="$(host_ip "$RDZV_HOST"):$PORT"
"$trainer" --reference --epochs 8 --out "$tmp/ref" >"$tmp/ref.log" 2>&1 ||
  die "the one-worker reference run failed: $(tail -n 5 "$tmp/ref.log")"

netns_add_hosts 4
ip netns exec "$(host_ns "$RDZV_HOST")" env FLOTILLA_CLUSTER_TOKEN="$cluster_token" \
  "$bin" rendezvous --listen "$rdzv" --workers 3 --heartbeat-timeout 2 >"$tmp/rendezvous.log" 2>&1 &
pids+=($!)

# trainer_on NAME HOST: lib.sh's start_trainer with this scenario's settings.
trainer_on() { start_trainer "$1" "$2" "$rdzv" $((PORT + 1)) --epochs 8 --sleep-ms 200 --timeout-s 6; }
for host in 0 1 2; do trainer_on "host$host" "$host"; done

wait_steps 7
vns=$(host_ns "$VICTIM")
cut() {
  for peer in 0 1; do
    ip netns exec "$vns" iptables "$1" INPUT -s "$(host_ip "$peer")" -j DROP
    ip netns exec "$vns" iptables "$1" OUTPUT -d "$(host_ip "$peer")" -j DROP
  done
}
cut -I
cut_at=$(date +%s%N)
log "partitioned slot 2 from slots 0 and 1 after $(($(committed) / 3)) steps (all reach the rendezvous)"
healed='going on from epoch'
while ! grep -q "generation 1 with 2 workers" "$tmp/host0.log" &&
  (($(date +%s%N) - cut_at < 40000000000)); do sleep 0.05; done
if grep -q "$healed" "$tmp/host0.log"; then
  log "slots 0 and 1 train again $((($(date +%s%N) - cut_at) / 1000000)) ms after the cut" \
    "(collective timeout 6 s): $(grep -o 'elastic: generation 1.*' "$tmp/host0.log" | head -n1)"
else
  check_fail "no generation 1 without slot 2 within 40 s of the cut"
fi
wait_task host2
cut -D
log "the partitioned process exited with $task_rc: $(tail -n 1 "$tmp/host2.log")"
((task_rc == 3)) || check_fail "the partitioned process exited with $task_rc, not 3"
grep -q 'it was expelled from the training group (start it again to rejoin)' "$tmp/host2.log" ||
  check_fail "the partitioned process did not say it was expelled"
grep -q 'slot 2 could not be reached by the other members' "$tmp/rendezvous.log" ||
  check_fail "the rendezvous did not name the partition: $(grep -i expel "$tmp/rendezvous.log")"
if grep -qE 'slot [01] could not be reached' "$tmp/rendezvous.log"; then
  check_fail "the rendezvous expelled a slot of the larger side"
fi
trainer_on host2-again "$VICTIM"
for name in host0 host1 host2-again; do
  wait_task "$name"
  ((task_rc == 0)) || {
    check_fail "$name exited with $task_rc"
    show_log "$name"
  }
done
grep -q "with 3 workers (admitted slot 2); $healed" "$tmp/host0.log" ||
  check_fail "the restarted slot 2 was not admitted"
if out=$("$PYTHON" "$HELPER" elastic "$tmp/out" "$tmp/ref" 1e-6 8 240 3 4 2>&1); then
  log "$out"
else
  check_fail "$out"
fi
netns_finish
