#!/usr/bin/env bash
# Scenario 2: three training hosts plus an evaluator task on a fourth (TF_CONFIG's "evaluator"
# job, TF's SidecarEvaluator). Training must complete; the evaluator, which joins no collective,
# must evaluate at least one of the chief's checkpoints, end with the final one and exit 0. Its
# result on the final checkpoint must be the chief's own test result: the same accuracy (a count
# over the same 10000 test images) and the same loss up to summation order.
#   evaluator.sh [FLOTILLA] [PYTHON]       (ctest -R netns_evaluator)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
netns_init evaluator 170 "$@"

WORKER_HOSTS=2
EVALUATOR_HOST=3
epochs=2
train_args=(--model mlp --epochs "$epochs" --steps-per-epoch 20 --batch-per-replica 32 --seed 7
  --threads 1 --verbose 2 --timeout 60 --checkpoint-dir "$tmp/ckpt")

netns_add_hosts 4
port=23456
start_task evaluator "$EVALUATOR_HOST" "$(tf_config "$port" evaluator 0)" 120 "${train_args[@]}" \
  --metrics-json "$tmp/evaluator.json"
start_cluster run "$port" 120 "${train_args[@]}" --metrics-json "$tmp/chief.json"
wait_cluster run || true
wait_task evaluator
if ((task_rc != 0)); then
  check_fail "the evaluator exited with $task_rc"
  show_log evaluator
fi

evaluations=$(grep -c '^Evaluator: ckpt-' "$tmp/evaluator.log" || true)
log "evaluator printed $evaluations evaluation line(s):"
grep '^Evaluator: ' "$tmp/evaluator.log" | sed "s/^/[$netns_name]   /" || true
((evaluations >= 1)) || check_fail "the evaluator evaluated no checkpoint"
last=$(grep '^Evaluator: ckpt-' "$tmp/evaluator.log" | tail -n1 || true)
[[ $last == "Evaluator: ckpt-$epochs (epoch $epochs,"* ]] ||
  check_fail "the evaluator's last evaluation is not of the final checkpoint ckpt-$epochs: '$last'"

# The evaluator's numbers on the final checkpoint vs the chief's test result.
if [[ -s $tmp/evaluator.json && -s $tmp/chief.json ]]; then
  if out=$("$PYTHON" - "$tmp/evaluator.json" "$tmp/chief.json" "$epochs" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
test = [o for o in map(json.loads, filter(str.strip, open(sys.argv[2]))) if "test_loss" in o]
final = [o for o in ev if o.get("epoch") == int(sys.argv[3])]
if not final or not test:
    sys.exit(f"missing: evaluator line for the final epoch ({bool(final)}), chief test line ({bool(test)})")
e, t = final[-1], test[-1]
rel = abs(e["eval_loss"] - t["test_loss"]) / abs(t["test_loss"])
msg = (f"evaluator on {e['evaluator_checkpoint']}: loss {e['eval_loss']:.6f} accuracy "
       f"{e['eval_accuracy']:.4f}; chief's test: loss {t['test_loss']:.6f} accuracy "
       f"{t['test_accuracy']:.4f} (loss relative difference {rel:.2g})")
print(msg)
sys.exit(0 if e["eval_accuracy"] == t["test_accuracy"] and rel <= 1e-5 else 1)
PY
  ); then
    log "$out"
  else
    check_fail "evaluator vs chief: $out"
  fi
else
  check_fail "no metrics from the evaluator ($tmp/evaluator.json) or the chief ($tmp/chief.json)"
fi
netns_finish
