#!/usr/bin/env bash
# `make bench-peers`: training throughput of flotilla against its peers, side by side on this
# machine: PyTorch DDP (gloo, bench/peers/ddp_train.py) and TF MultiWorkerMirroredStrategy
# (Keras fit, bench/peers/tf_mwms_train.py). All three train the same models (models/zoo.cpp)
# on Fashion-MNIST with 2 workers on 127.0.0.1, the same global batch, SGD (lr 0.04, momentum
# 0.9), cross-entropy from logits, and cores/2 intra-op threads per worker (OMP_NUM_THREADS
# too). Each run trains S untimed warm-up steps, then times S steps on worker 0 between syncs
# (flotilla: its second epoch of --steps-per-epoch S; DDP: barriers; TF: fit's second epoch,
# between all-reduce barriers): samples/s = S x global batch / wall seconds. Runs alternate
# systems (flotilla, ddp, tf, flotilla, ...) so drift on a shared machine hits all alike.
# Prints JSON lines only: per system, model and global batch the median samples/s over RUNS,
# then per model and batch the ratios flotilla/peer. Logs go to a temporary directory; on a
# failure the command and the tail of its log go to stderr and the exit status is non-zero.
#
# flotilla's input makes one pass over the 60,000 training images without repeating, so both
# epochs must fit in it: S <= 60000 / (2 x global batch). Hence the short mlp epochs.
# The TF peer uses tf-keras (Keras 2): Keras 3's fit fails under MWMS (keras-team/keras#20585).
#
# Usage: bench/peers.sh [RUNS=1]
#   env: MODELS="mlp mlp-wide cnn" (also resnet20, vit-tiny, resnet18)  BATCHES="128 512" (global)
#        STEPS=S (all configurations)
#        PRECISION=auto|float32 (flotilla's --precision; the peers train in float32)
#        FLOTILLA=build/flotilla  PYTHON=.venv/bin/python  TIMEOUT=600 (seconds, per process)
#        DATA_DIR=/usr/share/datasets/fashion-mnist
#        BASELINE=path/to/another/flotilla: that build too, alternating with FLOTILLA in the same
#          runs ("system":"flotilla-baseline"), with the ratio flotilla/baseline: a change's
#          before and after in one sitting
#        PEERS="pytorch-ddp tf-mwms" (the peers to run; PEERS= runs flotilla alone)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-1}
MODELS=${MODELS:-mlp mlp-wide cnn}
BATCHES=${BATCHES:-128 512}
FLOTILLA=${FLOTILLA:-${BUILD_DIR:-build}/flotilla}
PYTHON=${PYTHON:-.venv/bin/python}
TF_PYTHON=bench/.venv-tf/bin/python
TIMEOUT=${TIMEOUT:-600}
DATA_DIR=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
TRAIN_SIZE=60000
WORKERS=2
THREADS=$(($(nproc) / 2 > 0 ? $(nproc) / 2 : 1))
TF_KERAS_VERSION=2.21.0
BASELINE=${BASELINE:-}
PRECISION=${PRECISION:-auto}
machine=$(bench/machine.sh)
PEERS=${PEERS-pytorch-ddp tf-mwms}

tmp=$(mktemp -d)
keep_logs=0
children=()
cleanup() {
  local pid
  for pid in "${children[@]+"${children[@]}"}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  [ "$keep_logs" = 1 ] || rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail() {  # message, log file -> stderr (the logs are kept), exit 1
  echo "bench/peers.sh: failed: $1" >&2
  if [ -n "${2:-}" ] && [ -f "$2" ]; then
    echo "--- last lines of $2 (logs kept in $tmp):" >&2
    tail -n 25 "$2" >&2 || true
    keep_logs=1
  fi
  exit 1
}

# Timed steps per configuration: each timed epoch takes a few seconds here (2 cores), within
# flotilla's one pass. STEPS overrides all of them (e.g. STEPS=5 for a quick check).
steps_for() {  # model, global batch
  if [ -n "${STEPS:-}" ]; then echo "$STEPS"; return; fi
  case "$1:$2" in
    mlp:128) echo 230 ;;
    mlp:512) echo 58 ;;
    mlp-wide:128) echo 60 ;;
    mlp-wide:512) echo 30 ;;
    cnn:128) echo 80 ;;
    cnn:512) echo 30 ;;
    resnet20:128) echo 24 ;;
    resnet20:512) echo 8 ;;
    vit-tiny:128) echo 16 ;;
    vit-tiny:512) echo 5 ;;
    resnet18:128) echo 4 ;;
    resnet18:512) echo 2 ;;
    *) fail "unknown model $1 (use mlp, mlp-wide, cnn, resnet20, vit-tiny, resnet18)" ;;
  esac
}

free_ports() {  # n -> n distinct free TCP ports on 127.0.0.1
  "$PYTHON" - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

json_number() {  # key -> the number after "key": on stdin's first matching line
  sed -n "s/.*\"$1\": *\([0-9.eE+-]*\).*/\1/p" | head -n1
}

# Starts one process in its own process group (killed whole on exit); sets $started.
declare -A log_of=()
start() {  # log, command...
  local log=$1
  shift
  setsid timeout "$TIMEOUT" "$@" >"$log" 2>&1 &
  started=$!
  children+=("$started")
  log_of[$started]=$log
}

# Waits for the given pids; as soon as one fails, stops the rest and reports it with its log.
wait_all() {  # label, pids...
  local label=$1 pid done_pid rc
  shift
  local pending=("$@")
  while [ ${#pending[@]} -gt 0 ]; do
    rc=0
    wait -n -p done_pid "${pending[@]}" || rc=$?
    local rest=()
    for pid in "${pending[@]}"; do [ "$pid" = "$done_pid" ] || rest+=("$pid"); done
    pending=("${rest[@]+"${rest[@]}"}")
    if [ "$rc" -ne 0 ]; then
      for pid in "${pending[@]+"${pending[@]}"}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
      [ "$rc" -eq 124 ] && label="$label (timed out after ${TIMEOUT}s)"
      fail "$label (exit $rc)" "${log_of[$done_pid]:-}"
    fi
  done
}

run_flotilla() {  # model, global batch, steps, run[, binary] -> samples/s on stdout
  local model=$1 batch=$2 steps=$3 binary=${5:-$FLOTILLA} name=flotilla${5:+-baseline}
  local log="$tmp/$name-$1-$2-$4.log" metrics="$tmp/$name-$1-$2-$4.json"
  local cmd=("$binary" launch --workers "$WORKERS" -- flotilla train --model "$model"
    --data-dir "$DATA_DIR" --batch-per-replica $((batch / WORKERS)) --steps-per-epoch "$steps"
    --epochs 2 --lr 0.04 --momentum 0.9 --metrics-json "$metrics" --verbose 0
    --precision "$PRECISION")
  for _ in $(seq 30); do [ -x "$binary" ] && break; sleep 2; done  # may be being relinked
  start "$log" env -u OMP_NUM_THREADS "${cmd[@]}"
  wait_all "${cmd[*]}" "$started"
  local epoch2
  epoch2=$(grep '"epoch": *2[,}]' "$metrics" 2>/dev/null || true)
  [ -n "$epoch2" ] || fail "${cmd[*]}: no epoch 2 in $metrics" "$log"
  [ "$(json_number steps <<<"$epoch2")" = "$steps" ] ||
    fail "${cmd[*]}: epoch 2 ran $(json_number steps <<<"$epoch2") steps, not $steps" "$log"
  json_number samples_per_s <<<"$epoch2"
}

peer_result() {  # system, short name, rank 0's log, command -> samples/s; version in $tmp
  local line
  line=$(grep "\"system\": \"$1\"" "$3" || true)
  [ -n "$line" ] || fail "$4: no result from rank 0" "$3"
  sed -n 's/.*"version": "\([^"]*\)".*/\1/p' <<<"$line" >"$tmp/version-$2"
  json_number samples_per_s <<<"$line"
}

run_ddp() {  # model, global batch, steps, run -> samples/s on stdout; torch version in $tmp
  local model=$1 batch=$2 steps=$3 log="$tmp/ddp-$1-$2-$4" port rank pids=()
  port=$(free_ports 1)
  local cmd=("$PYTHON" bench/peers/ddp_train.py "$model" "$batch" "$steps" "$THREADS" "$DATA_DIR")
  for rank in $(seq 0 $((WORKERS - 1))); do
    start "$log.$rank.log" env OMP_NUM_THREADS="$THREADS" MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
      RANK="$rank" WORLD_SIZE="$WORKERS" GLOO_SOCKET_IFNAME=lo "${cmd[@]}"
    pids+=("$started")
  done
  wait_all "${cmd[*]}" "${pids[@]}"
  peer_result pytorch-ddp ddp "$log.0.log" "${cmd[*]}"
}

run_tf() {  # model, global batch, steps, run -> samples/s on stdout; TF version in $tmp
  local model=$1 batch=$2 steps=$3 log="$tmp/tf-$1-$2-$4" ports task pids=() cluster
  read -r -a ports <<<"$(free_ports "$WORKERS")"
  cluster=$(printf '"127.0.0.1:%s",' "${ports[@]}")
  local cmd=("$TF_PYTHON" bench/peers/tf_mwms_train.py "$model" "$batch" "$steps" "$THREADS" "$DATA_DIR")
  for task in $(seq 0 $((WORKERS - 1))); do
    start "$log.$task.log" env OMP_NUM_THREADS="$THREADS" TF_CPP_MIN_LOG_LEVEL=2 \
      TF_CONFIG="{\"cluster\":{\"worker\":[${cluster%,}]},\"task\":{\"type\":\"worker\",\"index\":$task}}" \
      "${cmd[@]}"
    pids+=("$started")
  done
  wait_all "${cmd[*]}" "${pids[@]}"
  peer_result tf-mwms tf "$log.0.log" "${cmd[*]}"
}

# Preconditions: the binary, the project venv (torch), the TF venv (installed once).
for _ in $(seq 30); do [ -x "$FLOTILLA" ] && break; sleep 2; done
[ -x "$FLOTILLA" ] || fail "$FLOTILLA not found (make build)"
[ -z "$BASELINE" ] || [ -x "$BASELINE" ] || fail "BASELINE $BASELINE is not an executable"
[ -x "$PYTHON" ] || fail "$PYTHON not found (make bootstrap)"
bench/setup_tf.sh >&2 || fail "bench/setup_tf.sh"
if ! compgen -G "bench/.venv-tf/lib/python3*/site-packages/tf_keras-${TF_KERAS_VERSION}.dist-info" >/dev/null; then
  bench/.venv-tf/bin/pip install --quiet "tf-keras==${TF_KERAS_VERSION}" >&2 ||
    fail "pip install tf-keras==${TF_KERAS_VERSION} into bench/.venv-tf"
fi
for model in $MODELS; do
  for batch in $BATCHES; do
    steps=$(steps_for "$model" "$batch")
    [ $((batch % WORKERS)) -eq 0 ] || fail "global batch $batch is not divisible by $WORKERS workers"
    [ $((2 * steps * batch)) -le "$TRAIN_SIZE" ] ||
      fail "$model @ $batch: 2 x $steps steps x $batch exceed flotilla's one pass of $TRAIN_SIZE images"
  done
done

for run in $(seq "$RUNS"); do
  for model in $MODELS; do
    for batch in $BATCHES; do
      steps=$(steps_for "$model" "$batch")
      run_flotilla "$model" "$batch" "$steps" "$run" >>"$tmp/flotilla-$model-$batch"
      if [ -n "$BASELINE" ]; then
        run_flotilla "$model" "$batch" "$steps" "$run" "$BASELINE" >>"$tmp/flotilla-baseline-$model-$batch"
      fi
      case " $PEERS " in *" pytorch-ddp "*)
        run_ddp "$model" "$batch" "$steps" "$run" >>"$tmp/pytorch-ddp-$model-$batch" ;;
      esac
      case " $PEERS " in *" tf-mwms "*)
        run_tf "$model" "$batch" "$steps" "$run" >>"$tmp/tf-mwms-$model-$batch" ;;
      esac
    done
  done
done

median() { sort -g "$1" | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
flotilla_version=$("$FLOTILLA" --version | awk '{print $NF}')
systems=(flotilla)
[ -z "$BASELINE" ] || systems+=(flotilla-baseline)
for peer in $PEERS; do systems+=("$peer"); done
for model in $MODELS; do
  for batch in $BATCHES; do
    declare -A value=()
    for system in "${systems[@]}"; do
      value[$system]=$(median "$tmp/$system-$model-$batch")
      case $system in
        flotilla) version=$flotilla_version ;;
        flotilla-baseline) version=$("$BASELINE" --version | awk '{print $NF}') ;;
        pytorch-ddp) version=$(cat "$tmp/version-ddp") ;;
        tf-mwms) version=$(cat "$tmp/version-tf") ;;
      esac
      printf '{"bench":"peers","system":"%s","model":"%s","global_batch":%d,"metric":"samples_per_s","value":%.1f,"runs":%d,"version":"%s","machine":%s}\n' \
        "$system" "$model" "$batch" "${value[$system]}" "$RUNS" "$version" "$machine"
    done
    ratios=""
    for system in "${systems[@]:1}"; do
      case $system in
        flotilla-baseline) key=ratio_vs_baseline ;;
        pytorch-ddp) key=ratio_vs_ddp ;;
        tf-mwms) key=ratio_vs_tf ;;
      esac
      ratios+=$(awk -v k="$key" -v f="${value[flotilla]}" -v p="${value[$system]}" \
        'BEGIN { printf ",\"%s\":%.3f", k, f / p }')
    done
    printf '{"bench":"peers","model":"%s","global_batch":%d,"metric":"samples_per_s"%s,"of":"flotilla/peer","precision":"%s","machine":%s}\n' \
      "$model" "$batch" "$ratios" "$PRECISION" "$machine"
    unset value
  done
done
