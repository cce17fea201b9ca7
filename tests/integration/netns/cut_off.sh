#!/usr/bin/env bash
# Scenario 4: a host cut off mid-training, then a restart that resumes from the backup.
#
# Worker 1 (host 2, 198.18.0.3) has its link capped (tbf) so that steps take long enough to cut
# it off in the middle of training: once BackupAndRestore has written its second backup (10 of
# 40 updates), every packet of that host is dropped (iptables DROP on INPUT and OUTPUT inside
# its namespace, loopback exempt). The chief and worker 0 must then fail (not hang) within the
# collective timeout with exit code 3 (communication / timeout) and an error that names the
# cut-off host's address.
#
# Then the link is restored and all three tasks start again with the same --backup-dir: the
# chief must say it resumed, training must complete, and the final weights must equal those of
# an uninterrupted run on loopback (within 1e-5 relative; backups make resume exact).
#
# The address check relies on the rendezvous heartbeat, which names a silent peer as "worker I at
# HOST:PORT" within ~10 s. Before it, the error named only the rank ("rank 2 did not arrive"), or,
# when a healthy peer's timeout closed its connections first, blamed that healthy peer ("Connection
# closed by peer [198.18.0.2]"); this scenario failed on that check alone then.
#   cut_off.sh [FLOTILLA] [PYTHON]       (ctest -R netns_cut_off)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
netns_init cut_off 230 "$@"

WORKER_HOSTS=2
VICTIM=2 # host 2: worker 1
TIMEOUT_S=20
SLOW_RATE=${SLOW_RATE:-50mbit}
train_args=(--model mlp --epochs 2 --steps-per-epoch 20 --batch-per-replica 32 --seed 7
  --threads 1 --verbose 2 --timeout "$TIMEOUT_S")
backup_args=(--backup-dir "$tmp/backup" --backup-freq 5)

reference_run "${train_args[@]}"
netns_add_hosts 3
victim_ip=$(host_ip "$VICTIM")
cap_link "$VICTIM" "$SLOW_RATE"

# Run 1: cut off once the second backup is committed (the pointer file names it).
mkdir -p "$tmp/cut" "$tmp/resume"
guard=$((6 * TIMEOUT_S + 60))
start_cluster cut 23456 "$guard" "${train_args[@]}" "${backup_args[@]}" \
  --checkpoint-dir "$tmp/cut/ckpt" --metrics-json "$tmp/cut/metrics.json"
running() { kill -0 "${task_pid[cut-chief]}" 2>/dev/null; }
start=$SECONDS
backed_up() { grep -qs '^model_checkpoint_path: "backup-2"' "$tmp/backup/checkpoint"; }
while ! backed_up && running && ((SECONDS - start < guard)); do sleep 0.1; done
backed_up && running ||
  die "the run ended (or never backed up) before it could be cut off; backups: \
$(ls "$tmp/backup" 2>&1 | paste -sd' '); tail of the chief's log: $(tail -n 5 "$tmp/cut-chief.log")"
vns=$(host_ns "$VICTIM")
ip netns exec "$vns" iptables -I INPUT 1 ! -i lo -j DROP
ip netns exec "$vns" iptables -I OUTPUT 1 ! -o lo -j DROP
cut_at=$SECONDS
log "cut off $victim_ip (worker 1) after $((cut_at - start)) s of run 1; backups then:" \
  "$(ls "$tmp/backup" | paste -sd' ')"

for name in cut-chief cut-worker0; do
  wait_task "$name"
  log "$name exited with $task_rc, $((SECONDS - cut_at)) s after the cut (--timeout $TIMEOUT_S);" \
    "its last lines:"
  tail -n 4 "$tmp/$name.log" | sed "s/^/[$netns_name]   /"
  ((task_rc == 3)) || check_fail "$name exited with $task_rc, not 3 (communication/timeout error)"
  grep -qF "$victim_ip" "$tmp/$name.log" ||
    check_fail "$name's error does not name the cut-off host $victim_ip"
done

# Restore the link; the cut-off task then learns its peers are gone (or times out itself).
ip netns exec "$vns" iptables -D INPUT ! -i lo -j DROP
ip netns exec "$vns" iptables -D OUTPUT ! -o lo -j DROP
uncap_link "$VICTIM"
restored_at=$SECONDS
while kill -0 "${task_pid[cut-worker1]}" 2>/dev/null && ((SECONDS - restored_at < 3 * TIMEOUT_S)); do
  sleep 0.2
done
kill -TERM "${task_pid[cut-worker1]}" 2>/dev/null && log "cut-worker1 still ran; stopped it"
wait_task cut-worker1
log "the cut-off task exited with $task_rc, $((SECONDS - cut_at)) s after the cut; its last lines:"
tail -n 3 "$tmp/cut-worker1.log" | sed "s/^/[$netns_name]   /"

# Run 2: the same command and --backup-dir (a fresh port: the old one may linger in TIME_WAIT).
[[ -d $tmp/backup ]] || die "the backup directory $tmp/backup is gone after the cut"
log "backups before the restart: $(ls "$tmp/backup" | paste -sd' ')"
start_cluster resume 23457 120 "${train_args[@]}" "${backup_args[@]}" \
  --checkpoint-dir "$tmp/resume/ckpt" --metrics-json "$tmp/resume/metrics.json"
if wait_cluster resume; then
  resumed=$(grep -o 'BackupAndRestore: resuming from .*' "$tmp/resume-chief.log" || true)
  if [[ -n $resumed ]]; then
    log "restart: $resumed"
  else
    check_fail "the restarted chief did not say it resumed from the backup"
    show_log resume-chief
  fi
  log "resumed run: $(grep -o 'Test: .*' "$tmp/resume-chief.log" | tail -n1)"
  same_weights "$tmp/resume/ckpt" "$tmp/ref/ckpt" 1e-5 "resumed after the cut vs uninterrupted loopback"
  same_metrics "$tmp/resume/metrics.json" "$tmp/ref/metrics.json" 1e-5 \
    "resumed after the cut vs uninterrupted loopback" epoch,test
  [[ ! -e $tmp/backup ]] || check_fail "the completed run left its backup directory $tmp/backup"
fi
netns_finish
