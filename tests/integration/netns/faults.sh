#!/usr/bin/env bash
# Scenario 3: a lossy, slow network. Every host drops 1% of its packets at random, in both
# directions (iptables statistic match on INPUT and OUTPUT, loopback exempt), and every link is
# capped at 100 Mbit/s (tbf on both veth ends). TCP retransmits what is lost, so training must
# complete with exactly the numbers of the same run on loopback. The drop counters must show that
# packets were in fact dropped, or the scenario tested nothing.
#   faults.sh [FLOTILLA] [PYTHON]       (ctest -R netns_faults)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
netns_init faults 170 "$@"

WORKER_HOSTS=2
DROP_PROBABILITY=0.01
RATE=100mbit
train_args=(--model mlp --epochs 2 --steps-per-epoch 20 --batch-per-replica 32 --seed 7
  --threads 1 --verbose 2 --timeout 60)

reference_run "${train_args[@]}"
netns_add_hosts 3
for ((i = 0; i < 3; i++)); do
  ns=$(host_ns "$i")
  ip netns exec "$ns" iptables -A INPUT ! -i lo -m statistic --mode random \
    --probability "$DROP_PROBABILITY" -j DROP 2>"$tmp/setup.err" ||
    skip "iptables' statistic match is not available: $(cat "$tmp/setup.err")"
  ip netns exec "$ns" iptables -A OUTPUT ! -o lo -m statistic --mode random \
    --probability "$DROP_PROBABILITY" -j DROP
  cap_link "$i" "$RATE" 2>"$tmp/setup.err" ||
    skip "cannot add a tbf qdisc (sch_tbf): $(cat "$tmp/setup.err")"
done
log "every host drops $DROP_PROBABILITY of its packets each way; every link capped at $RATE"

mkdir -p "$tmp/run"
start_cluster run 23456 150 "${train_args[@]}" --checkpoint-dir "$tmp/run/ckpt" \
  --metrics-json "$tmp/run/metrics.json"
start=$SECONDS
if wait_cluster run; then
  log "lossy run took $((SECONDS - start)) s: $(grep -o 'Test: .*' "$tmp/run-chief.log" | tail -n1)"
  same_weights "$tmp/run/ckpt" "$tmp/ref/ckpt" 1e-6 "lossy namespaces vs loopback"
  same_metrics "$tmp/run/metrics.json" "$tmp/ref/metrics.json" 1e-6 "lossy namespaces vs loopback"
fi

# Packets and bytes each host's DROP rules matched (columns 1 and 2 of iptables -L -v -x).
dropped=0
for ((i = 0; i < 3; i++)); do
  counts=$(for chain in INPUT OUTPUT; do
    ip netns exec "$(host_ns "$i")" iptables -L "$chain" -v -x -n | awk '$3 == "DROP" {print $1}'
  done | paste -sd' ')
  log "host $i ($(host_ip "$i")) dropped packets in, out: $counts"
  for c in $counts; do dropped=$((dropped + c)); done
done
((dropped > 0)) || check_fail "no packet was dropped: the iptables rules did not act"
netns_finish
