#!/usr/bin/env bash
# `make bench-allreduce`: all-reduce bus bandwidth (nccl-tests' definition: algbw x 2(n-1)/n) for
# message sizes 4 KiB to 256 MiB, flotilla's Communicator against raw c10d ProcessGroupGloo in
# the same processes (bench/allreduce.cpp), 2 and 3 processes on loopback. Prints rank 0's JSON
# lines: one per system and size, the time ratio flotilla/c10d-gloo (the cost of flotilla's
# layer; the goal is < 1.05 from 1 MiB up), and per process count the median and worst of those
# ratios from 1 MiB up. Each process count runs twice: flotilla over Gloo's ring (the layer's
# cost: the same transport on both sides) and through its shared-memory all-reduce (what its
# workers on one host use by default: a transport c10d does not have for CPU tensors).
# Usage: bench/allreduce.sh [ROUNDS=7] [MAX_BYTES=268435456]
#   env: PROCESSES="2 3" TRANSPORTS="ring shared-memory"
set -euo pipefail
# Every JSON line names the machine: the script runs again through bench/machine.sh --tag.
[ -n "${BENCH_TAGGED:-}" ] || { BENCH_TAGGED=1 "$(readlink -f "$0")" "$@" |
  "$(dirname "$(readlink -f "$0")")/machine.sh" --tag; exit "${PIPESTATUS[0]}"; }
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
ROUNDS=${1:-7}
MAX_BYTES=${2:-268435456}
tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]+"${pids[@]}"}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
for n in ${PROCESSES:-2 3}; do
  for transport in ${TRANSPORTS:-ring shared-memory}; do
    port=$(free_port)
    pids=()
    for rank in $(seq 0 $((n - 1))); do
      # One intra-op thread each: the reduction's arithmetic runs in Gloo's own threads anyway.
      RANK=$rank WORLD_SIZE=$n LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        OMP_NUM_THREADS=1 "$BUILD_DIR/bench_allreduce" "$ROUNDS" "$MAX_BYTES" \
        "$([ "$transport" = shared-memory ] && echo 1 || echo 0)" \
        >"$tmp/out.$rank" 2>"$tmp/err.$rank" &
      pids+=($!)
    done
    for i in "${!pids[@]}"; do
      if ! wait "${pids[$i]}"; then
        echo "bench/allreduce.sh: rank $i of $n failed:" >&2
        tail -n 20 "$tmp/err.$i" >&2
        exit 1
      fi
    done
    cat "$tmp/out.0"
    # The verdict: flotilla/c10d-gloo time ratios from 1 MiB up, their median and worst.
    python3 - "$n" "$tmp/out.0" "$transport" <<'PY'
import json, statistics, sys
n, path, transport = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ratios = [l["ratio"] for l in map(json.loads, open(path)) if "ratio" in l and l["bytes"] >= 1 << 20]
if ratios:
    print(json.dumps({"bench": "allreduce", "processes": n, "metric": "time_ratio_from_1MiB",
                      "flotilla": {"precision": "float32", "transport": transport},
                      "peer": {"precision": "float32", "transport": "gloo"},
                      "median": round(statistics.median(ratios), 4), "max": round(max(ratios), 4),
                      "sizes": len(ratios), "of": "flotilla/c10d-gloo"}, separators=(",", ":")))
PY
  done
done
