#!/usr/bin/env bash
# Scenario 5: elastic mode, a host cut off mid-fit; the others heal without restarting.
#
# Three hosts run tests/multiworker/elastic_trainer (Model::fit in an elastic group of 3 with a
# per-sample ledger; 8 epochs of 10 global batches of 24 rows) and a fourth runs the rendezvous
# (`flotilla rendezvous --heartbeat-timeout 2`). Once the group has committed 7 steps, every packet
# of host 2 is dropped (iptables DROP on INPUT and OUTPUT inside its namespace). The rendezvous
# must expel slot 2 after the heartbeat timeout and the two others train on in generation 1 with
# the same global batch. The cut-off process exits 3 by itself (it cannot reach the rendezvous,
# or reads that it was expelled) and is started again at once, as a scheduler would; the link
# is restored 4 s after the others regrouped, and the new process joins and gets the state from
# a live peer's memory.
#
# Checks: the survivors keep their processes (four processes in all, each with its own ledger;
# the survivors exit 0, never killed by the SIGPIPE of a write to the dead peer's socket); the
# rendezvous names slot 2's silence; the victim exits 3 saying why and its restart is admitted;
# every slot's final weights equal a one-worker run's on the same global batches within 1e-6
# (float32), and the ledgers of all four processes hold each sample once per epoch.
#   elastic_cut.sh [FLOTILLA] [PYTHON] [ELASTIC_TRAINER]     (ctest -R netns_elastic_cut)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
netns_init elastic_cut 150 "$@"
elastic_trainer_init "${3:-}"

WORKER_HOSTS=2
VICTIM=2
RDZV_HOST=3
PORT=24100
rdzv="$(host_ip "$RDZV_HOST"):$PORT"
"$trainer" --reference --epochs 8 --out "$tmp/ref" >"$tmp/ref.log" 2>&1 ||
  die "the one-worker reference run failed: $(tail -n 5 "$tmp/ref.log")"

netns_add_hosts 4
ip netns exec "$(host_ns "$RDZV_HOST")" env FLOTILLA_CLUSTER_TOKEN="$cluster_token" \
  "$bin" rendezvous --listen "$rdzv" --workers 3 --heartbeat-timeout 2 >"$tmp/rendezvous.log" 2>&1 &
pids+=($!)

# trainer_on NAME HOST: lib.sh's start_trainer with this scenario's settings.
trainer_on() { start_trainer "$1" "$2" "$rdzv" $((PORT + 1)) --epochs 8 --sleep-ms 200; }
for host in 0 1 2; do trainer_on "host$host" "$host"; done

wait_steps 7
vns=$(host_ns "$VICTIM")
ip netns exec "$vns" iptables -I INPUT 1 ! -i lo -j DROP
ip netns exec "$vns" iptables -I OUTPUT 1 ! -o lo -j DROP
cut_at=$(date +%s%N)
log "cut off $(host_ip "$VICTIM") (slot 2) after $(($(committed) / 3)) steps"
healed='going on from epoch'
while ! grep -q "generation 1 with 2 workers (slot 2 stopped sending heartbeats" "$tmp/host0.log" &&
  (($(date +%s%N) - cut_at < 30000000000)); do sleep 0.05; done
if grep -q "$healed" "$tmp/host0.log"; then
  log "the others train again $((($(date +%s%N) - cut_at) / 1000000)) ms after the cut" \
    "(heartbeat timeout 2 s): $(grep -o 'elastic: generation 1.*' "$tmp/host0.log" | head -n1)"
else
  check_fail "no generation 1 without slot 2 within 30 s of the cut"
fi
# The cut-off process exits 3 on its own once it cannot reach the rendezvous (or, if the cut
# ends first, once it reads that it was expelled); like a scheduler, start it again at once,
# even while the cut lasts: it joins once its host is back.
restore_at=$((SECONDS + 4))
while kill -0 "${task_pid[host2]}" 2>/dev/null && ((SECONDS < restore_at)); do sleep 0.05; done
restored=0
restore() {
  ip netns exec "$vns" iptables -D INPUT ! -i lo -j DROP
  ip netns exec "$vns" iptables -D OUTPUT ! -o lo -j DROP
  restored=1
  log "link of slot 2 restored"
}
kill -0 "${task_pid[host2]}" 2>/dev/null && restore
wait_task host2
log "the cut-off process exited with $task_rc: $(tail -n 1 "$tmp/host2.log")"
((task_rc == 3)) || check_fail "the cut-off process exited with $task_rc, not 3"
said='it was expelled from the training group \(start it again to rejoin\)'
said+='|stopped answering heartbeats .*this worker cannot regroup'
grep -qE "$said" "$tmp/host2.log" ||
  check_fail "the cut-off process did not say it was expelled or cut off from the rendezvous"
trainer_on host2-again "$VICTIM"
((restored)) || {
  while ((SECONDS < restore_at)); do sleep 0.05; done
  restore
}
for name in host0 host1 host2-again; do
  wait_task "$name"
  ((task_rc == 0)) || {
    check_fail "$name exited with $task_rc"
    show_log "$name"
  }
done
grep -q "with 3 workers (admitted slot 2); $healed" "$tmp/host0.log" ||
  check_fail "the restarted slot 2 was not admitted"
log "rendezvous: $(grep -c 'generation' "$tmp/rendezvous.log") generations;" \
  "$(grep -o 'slot 2 stopped sending heartbeats[^(]*' "$tmp/rendezvous.log" | head -n1)"
if out=$("$PYTHON" "$HELPER" elastic "$tmp/out" "$tmp/ref" 1e-6 8 240 3 4 2>&1); then
  log "$out"
else
  check_fail "$out"
fi
netns_finish
