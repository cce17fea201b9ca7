#!/usr/bin/env bash
# `make bench-scale`: the control plane at 64, 256 and 1024 members (bench/scale.cpp): a real
# `flotilla rendezvous` and simulated members speaking its protocol, the data plane stubbed
# (each generation's Gloo address exchange replayed against the store). For each size, the
# exchange flotilla's groups make (batched: ranks as sequence numbers, records read 128 per
# request) and Gloo's default (pairs: a pair identifier per rank in every record, each record
# read alone), then the ratios of the two. Prints JSON lines; the members' and the rendezvous's
# log goes to $LOG (default: a file under /tmp, named on stderr).
# Usage: bench/scale.sh [SIZES="64 256 1024"]   env: EXCHANGES="batched pairs"
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${1:-64 256 1024}
EXCHANGES=${EXCHANGES:-batched pairs}
LOG=${LOG:-$(mktemp /tmp/bench-scale.XXXXXX.log)}
echo "bench-scale: log in $LOG" >&2
machine=$(bench/machine.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for n in $SIZES; do
  for exchange in $EXCHANGES; do
    build/bench_scale --members "$n" --exchange "$exchange" --flotilla build/flotilla \
      2>>"$LOG" | tee "$tmp/$n-$exchange.json" | bench/machine.sh --tag
  done
  if [ -s "$tmp/$n-batched.json" ] && [ -s "$tmp/$n-pairs.json" ]; then
    python3 - "$tmp/$n-batched.json" "$tmp/$n-pairs.json" "$machine" <<'PY'
import json, sys
new, old = (json.loads(open(p).read()) for p in sys.argv[1:3])
ratio = lambda k: round(old[k] / new[k], 1) if new[k] else None
print(json.dumps({"bench": "scale", "members": new["members"], "of": "pairs/batched",
                  "exchange_mb": ratio("exchange_mb"),
                  "exchange_requests": ratio("exchange_requests"),
                  "formation_s": ratio("formation_s"), "heal_s": ratio("heal_s"),
                  "machine": json.loads(sys.argv[3])}, separators=(",", ":")))
PY
  fi
done
