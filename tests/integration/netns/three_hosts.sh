#!/usr/bin/env bash
# Scenario 1: three hosts. The chief and two workers, each in its own network namespace
# (198.18.0.1..3, veth pairs to a bridge), train together with TF_CONFIG; the run must end with
# the same weights, loss and accuracy as the same 3-task run on loopback (`flotilla launch`):
# training is deterministic for a fixed seed and world size, and the ranks are the same (chief
# first, then workers by index), so the network between the tasks must change no number.
#   three_hosts.sh [FLOTILLA] [PYTHON]       (ctest -R netns_three_hosts)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
netns_init three_hosts 170 "$@"

WORKER_HOSTS=2
train_args=(--model mlp --epochs 2 --steps-per-epoch 20 --batch-per-replica 32 --seed 7
  --threads 1 --verbose 2 --timeout 60)

reference_run "${train_args[@]}"
netns_add_hosts 3
mkdir -p "$tmp/run"
start_cluster run 23456 120 "${train_args[@]}" --checkpoint-dir "$tmp/run/ckpt" \
  --metrics-json "$tmp/run/metrics.json"
if wait_cluster run; then
  log "namespaced run: $(grep -o 'Test: .*' "$tmp/run-chief.log" | tail -n1)"
  grep -q "rendezvous $(host_ip 0):23456" "$tmp/run-chief.log" ||
    check_fail "the chief's log does not name the rendezvous $(host_ip 0):23456"
  same_weights "$tmp/run/ckpt" "$tmp/ref/ckpt" 1e-6 "3 namespaces vs loopback"
  same_metrics "$tmp/run/metrics.json" "$tmp/ref/metrics.json" 1e-6 "3 namespaces vs loopback"
fi
netns_finish
