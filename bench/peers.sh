#!/usr/bin/env bash
# `make bench-peers`: training throughput of flotilla against its peers, like for like, on this
# machine: PyTorch DDP (gloo, bench/peers/ddp_train.py) and TF MultiWorkerMirroredStrategy
# (Keras fit, bench/peers/tf_mwms_train.py). All train the same models (models/zoo.cpp) on
# Fashion-MNIST with 2 workers on 127.0.0.1, the same global batch, SGD (lr 0.04, momentum 0.9),
# cross-entropy from logits, cores/2 intra-op threads per worker (OMP_NUM_THREADS too), and the
# same precision: each PRECISIONS entry runs every system at it (float32; mixed_bfloat16: bf16
# compute, float32 weights: flotilla's policy, DDP under torch.autocast, Keras' policy).
#
# Each peer runs twice, as its users would write it and at its fastest settings found here:
#   pytorch-ddp        NCHW, torch.optim.SGD's default loop
#   pytorch-ddp-best   channels_last model and batches, SGD(fused=True), glibc's malloc
#                      keeping freed blocks (GLIBC_TUNABLES: the settings flotilla's
#                      --freed-memory keep makes with mallopt), and the CNN's max-pools before
#                      their ReLUs (the same values, as flotilla's MaxPool2ReLU computes them)
#   pytorch-ddp-compile  DDP at its best under torch.compile (Inductor's CPU code generation):
#                      PyTorch's best on the CPU; its compilation falls in the untimed warm-up,
#                      whose seconds its line gives apart ("compile_seconds_in_warmup")
#   All all-reduce over Gloo's TCP ring: PyTorch has no other backend for CPU tensors.
#   flotilla's workers, all on this host, all-reduce through shared memory (its default;
#   the "all_reduce" field says which ran).
#   tf-mwms            Keras' defaults (NHWC: Keras' only CPU layout); also its fastest here:
#   tf-mwms-pool-relu  the CNN's ReLUs after its max-pools (Conv2D without activation: TF no
#                      longer fuses the ReLU into the convolution): level with tf-mwms here, up
#                      to 1.04x at a global batch of 512; not in the default PEERS
#   tf-mwms-xla        model.compile(jit_compile=True) fails under MWMS on the CPU ("Collectives
#                      are not yet implemented for CPU devices when compiling with XLA", TF
#                      2.21); not in the default PEERS, its note printed when asked for
# flotilla runs as its users get it: its defaults (channels-last for models with 2-D
# convolutions; the compile step, with flotilla's kernels where they measure faster on this CPU:
# its lines' "kernels" field says what ran). Every line names each side's precision and memory
# format.
#
# Each run trains S untimed warm-up steps, then times S steps on worker 0 between syncs
# (flotilla: its second epoch of --steps-per-epoch S; DDP: barriers; TF: fit's second epoch,
# between all-reduce barriers): samples/s = S x global batch / wall seconds. The RUNS runs of
# each configuration alternate systems (flotilla, ddp, ddp-best, tf, tf-xla, flotilla, ...) so
# drift on a shared machine hits all alike. Prints JSON lines only: per system the median
# samples/s over the runs with its spread (min, max), its share of the machine's matmul peak
# (train FLOPs per sample from bench/peers/utilisation.py x samples/s over workers x threads x
# one thread's measured peak at that precision), then per configuration the ratios
# flotilla/peer: of the medians, and the spread of the runs' own ratios (run i against run i).
# Logs go to a temporary directory; on a failure the command and the tail of its log go to
# stderr and the exit status is non-zero.
#
# flotilla's input makes one pass over the 60,000 training images without repeating, so both
# epochs must fit in it: S <= 60000 / (2 x global batch). Hence the short mlp epochs.
# The TF peer uses tf-keras (Keras 2): Keras 3's fit fails under MWMS (keras-team/keras#20585).
#
# Usage: bench/peers.sh [RUNS=5]
#   env: MODELS="cnn resnet20 resnet18 vit-tiny" (also mlp, mlp-wide, and models nobody here
#          wrote: tv-resnet18, tv-mobilenetv2, torchvision's made for 28x28 images
#          (bench/peers/common.py), which flotilla trains from a file scripted with
#          torch.jit.script, DDP as nn.Modules, and TF not at all; bench/setup_torchvision.sh
#          installs torchvision once)  BATCHES="128 512" (global)
#        PRECISIONS="float32 mixed_bfloat16" (mixed_bfloat16 only on CPUs with AVX512-BF16/AMX)
#        STEPS=S (all configurations)
#        FLOTILLA=build/flotilla  PYTHON=.venv/bin/python  TIMEOUT=600 (seconds, per process)
#        DATA_DIR=/usr/share/datasets/fashion-mnist
#        BASELINE=path/to/another/flotilla: that build too, alternating with FLOTILLA in the same
#          runs ("system":"flotilla-baseline"), with the ratio flotilla/baseline: a change's
#          before and after in one sitting
#        PEERS="pytorch-ddp pytorch-ddp-best tf-mwms" (also pytorch-ddp-compile, tf-mwms-xla,
#          and flotilla itself with one choice changed: flotilla-no-compile (--no-jit-compile,
#          the model as written), flotilla-fixed (--kernels fixed), flotilla-none (--kernels
#          none); PEERS= runs flotilla alone)
#        FLOTILLA_ARGS="..." more flags for flotilla train (e.g. --channels-last off)
#        CONVS=1: first, a line per convolutional model and batch: its convolutions' training
#          time per step alone (bench/peers/utilisation.py convs), each precision
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
MODELS=${MODELS:-cnn resnet20 resnet18 vit-tiny}
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
FLOTILLA_ARGS=${FLOTILLA_ARGS:-}
# malloc keeps what a step frees, as flotilla's --freed-memory keep (base/system.h).
KEEP_FREED=GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824
machine=$(bench/machine.sh)
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  PRECISIONS=${PRECISIONS:-float32 mixed_bfloat16}
else
  PRECISIONS=${PRECISIONS:-float32}
fi
PEERS=${PEERS-pytorch-ddp pytorch-ddp-best tf-mwms}

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
    tv-resnet18:128) echo 4 ;;
    tv-resnet18:512) echo 2 ;;
    tv-mobilenetv2:128) echo 6 ;;
    tv-mobilenetv2:512) echo 3 ;;
    *) fail "unknown model $1 (use mlp, mlp-wide, cnn, resnet20, vit-tiny, resnet18, tv-resnet18, tv-mobilenetv2)" ;;
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

run_flotilla() {  # model, global batch, steps, run, precision[, binary[, name, flags...]] -> samples/s
  local model=$1 batch=$2 steps=$3 precision=$5 binary=${6:-$FLOTILLA} name=${7:-flotilla${6:+-baseline}}
  local extra=("${@:8}")
  local log="$tmp/$name-$1-$2-$5-$4.log" metrics="$tmp/$name-$1-$2-$5-$4.json"
  # A torchvision model trains from the TorchScript file scripted from it (as its users would).
  local model_arg=$model
  case $model in tv-*) model_arg="$tmp/$model.pt" ;; esac
  # shellcheck disable=SC2206
  local cmd=("$binary" launch --workers "$WORKERS" -- flotilla train --model "$model_arg"
    --data-dir "$DATA_DIR" --batch-per-replica $((batch / WORKERS)) --steps-per-epoch "$steps"
    --epochs 2 --lr 0.04 --momentum 0.9 --metrics-json "$metrics" --verbose 0
    --precision "$precision" $FLOTILLA_ARGS "${extra[@]+"${extra[@]}"}")
  for _ in $(seq 30); do [ -x "$binary" ] && break; sleep 2; done  # may be being relinked
  start "$log" env -u OMP_NUM_THREADS "${cmd[@]}"
  wait_all "${cmd[*]}" "$started"
  local epoch2
  epoch2=$(grep '"epoch": *2[,}]' "$metrics" 2>/dev/null || true)
  [ -n "$epoch2" ] || fail "${cmd[*]}: no epoch 2 in $metrics" "$log"
  [ "$(json_number steps <<<"$epoch2")" = "$steps" ] ||
    fail "${cmd[*]}: epoch 2 ran $(json_number steps <<<"$epoch2") steps, not $steps" "$log"
  if grep -q 'recipe: freed memory: kept' "$log"; then
    echo kept >"$tmp/freed-$name-$model"
  else
    echo released >"$tmp/freed-$name-$model"
  fi
  # What the compile step rewrote, and what ran for each kind of layer with its measured ratio
  # (its "recipe: <layer>: flotilla's at N of M shape(s) ..." lines), joined by "; ".
  { sed -n "s/.*recipe: compile step: \(.*\)$/compile step: \1/p" "$log"
    sed -n "s/.*recipe: \([^:]*\): flotilla's at \(.*\)$/\1: flotilla's at \2/p" "$log"
  } | paste -sd '|' | sed 's/|/; /g' >"$tmp/kernels-$name-$model-$precision"
  # How its gradients crossed the workers (builds before shared memory name none).
  sed -n 's/.*gradients: .*, all-reduce over \(.*\)$/\1/p' "$log" | head -n 1 >"$tmp/allreduce-$name-$model"
  if grep -q 'recipe: memory format: channels-last' "$log"; then
    echo channels_last >"$tmp/format-$name-$model"
  else
    echo nchw >"$tmp/format-$name-$model"
  fi
  json_number samples_per_s <<<"$epoch2"
}

peer_result() {  # system, short name, rank 0's log, command -> samples/s; version in $tmp
  local line
  line=$(grep "\"system\": \"$1\"" "$3" || true)
  [ -n "$line" ] || fail "$4: no result from rank 0" "$3"
  sed -n 's/.*"version": "\([^"]*\)".*/\1/p' <<<"$line" >"$tmp/version-$2"
  json_number samples_per_s <<<"$line"
}

run_ddp() {  # model, global batch, steps, run, precision, layout, optimizer[, malloc[, order[, attention[, compile]]]]
  local model=$1 batch=$2 steps=$3 log="$tmp/ddp-$1-$2-$5-$6-${11:-eager}-$4" port rank pids=() tunables=()
  port=$(free_ports 1)
  [ "${8:-}" = keep ] && tunables=("$KEEP_FREED")
  local cmd=("$PYTHON" bench/peers/ddp_train.py "$model" "$batch" "$steps" "$THREADS" "$DATA_DIR"
    "$5" "$6" "$7" "${9:-relu-pool}" "${10:-default}" "${11:-eager}")
  for rank in $(seq 0 $((WORKERS - 1))); do
    start "$log.$rank.log" env "${tunables[@]}" PYTHONPATH="$TORCHVISION_PATH" \
      OMP_NUM_THREADS="$THREADS" MASTER_ADDR=127.0.0.1 \
      MASTER_PORT="$port" RANK="$rank" WORLD_SIZE="$WORKERS" GLOO_SOCKET_IFNAME=lo "${cmd[@]}"
    pids+=("$started")
  done
  wait_all "${cmd[*]}" "${pids[@]}"
  # torch.compile's compilation fell in the untimed warm-up: its length, apart.
  sed -n 's/.*"warmup_seconds": \([0-9.]*\).*/\1/p' "$log.0.log" >>"$tmp/warmup-$model-$batch-$5-${11:-eager}"
  peer_result pytorch-ddp ddp "$log.0.log" "${cmd[*]}"
}

run_tf() {  # model, global batch, steps, run, precision, xla[, order] -> samples/s ("" when XLA fails)
  local model=$1 batch=$2 steps=$3 log="$tmp/tf-$1-$2-$5-$6-${7:-relu-pool}-$4" ports task pids=() cluster
  read -r -a ports <<<"$(free_ports "$WORKERS")"
  cluster=$(printf '"127.0.0.1:%s",' "${ports[@]}")
  local cmd=("$TF_PYTHON" bench/peers/tf_mwms_train.py "$model" "$batch" "$steps" "$THREADS"
    "$DATA_DIR" "$5" "$6" "${7:-relu-pool}")
  for task in $(seq 0 $((WORKERS - 1))); do
    start "$log.$task.log" env OMP_NUM_THREADS="$THREADS" TF_CPP_MIN_LOG_LEVEL=2 \
      TF_CONFIG="{\"cluster\":{\"worker\":[${cluster%,}]},\"task\":{\"type\":\"worker\",\"index\":$task}}" \
      "${cmd[@]}"
    pids+=("$started")
  done
  if [ "$6" = on ]; then  # XLA may not run under MWMS here: a note, not a failure
    local pid done_pid rc=0 pending=("${pids[@]}") rest
    while [ ${#pending[@]} -gt 0 ] && [ "$rc" -eq 0 ]; do
      wait -n -p done_pid "${pending[@]}" || rc=$?
      rest=()
      for pid in "${pending[@]}"; do [ "$pid" = "$done_pid" ] || rest+=("$pid"); done
      pending=("${rest[@]+"${rest[@]}"}")
    done
    if [ "$rc" -ne 0 ]; then
      for pid in "${pending[@]+"${pending[@]}"}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
      grep -v '^[IWE]0000' "$log.0.log" | grep -m1 -iE 'not yet implemented|error:' |
        cut -c1-300 >"$tmp/xla-failed" || true
      return 0
    fi
  else
    wait_all "${cmd[*]}" "${pids[@]}"
  fi
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
TORCHVISION_PATH=
case " $MODELS " in
  *" tv-"*)
    bench/setup_torchvision.sh >&2 || fail "bench/setup_torchvision.sh"
    TORCHVISION_PATH=$PWD/bench/.torchvision
    for model in $MODELS; do
      case $model in tv-*) ;; *) continue ;; esac
      # The same seed as the DDP peer's model (every side starts from the same weights).
      (cd bench/peers && PYTHONPATH="$TORCHVISION_PATH" "../../$PYTHON" -c '
import sys, torch, common
torch.manual_seed(common.SEED)
torch.jit.script(common.make_torch_model(sys.argv[1])).save(sys.argv[2])' "$model" "$tmp/$model.pt") ||
        fail "scripting $model"
    done ;;
esac
for model in $MODELS; do
  for batch in $BATCHES; do
    steps=$(steps_for "$model" "$batch")
    [ $((batch % WORKERS)) -eq 0 ] || fail "global batch $batch is not divisible by $WORKERS workers"
    [ $((2 * steps * batch)) -le "$TRAIN_SIZE" ] ||
      fail "$model @ $batch: 2 x $steps steps x $batch exceed flotilla's one pass of $TRAIN_SIZE images"
  done
done

# What utilisation is measured against: each model's training FLOPs per sample, and one
# thread's matmul peak at each precision (measured now, on this machine).
declare -A flops=()
for model in $MODELS; do
  flops[$model]=$(cd bench/peers && PYTHONPATH="$TORCHVISION_PATH" "../../$PYTHON" utilisation.py flops "$model" | json_number train_flops_per_sample)
done
peak_line=$(cd bench/peers && OMP_NUM_THREADS=1 "../../$PYTHON" utilisation.py peak)
peak_float32=$(sed 's/.*"float32": *\([0-9.]*\).*/\1/' <<<"$peak_line")
peak_bfloat16=$(sed 's/.*"bfloat16": *\([0-9.]*\).*/\1/' <<<"$peak_line")
printf '{"bench":"peers","metric":"matmul_peak_gflops_per_thread","float32":%s,"bfloat16":%s,"how":"1024x1024 torch.mm, one thread, median of 7","machine":%s}\n' \
  "$peak_float32" "$peak_bfloat16" "$machine"

# CONVS=1: each convolutional model's convolutions alone at each configuration's batch per
# worker, one thread (utilisation.py convs; oneDNN's kernels, which every system calls): a
# floor under any system's step at that model and batch, measured in this sitting.
if [ "${CONVS:-0}" = 1 ]; then
  for model in $MODELS; do
    case $model in cnn | resnet20 | resnet18) ;; *) continue ;; esac
    for batch in $BATCHES; do
      # Freed memory kept, as flotilla and DDP at its best run (otherwise glibc maps and faults
      # the large buffers anew each step: float32 ResNet-20 at 256 images took 534 ms, not 449).
      line=$(cd bench/peers && env "$KEEP_FREED" OMP_NUM_THREADS=1 "../../$PYTHON" utilisation.py convs "$model" $((batch / WORKERS)) | tail -n 1)
      echo "${line%\}}, \"global_batch\": $batch, \"machine\": $machine}"
    done
  done
fi

# DDP at its best: under bf16 autocast nn.MultiheadAttention's own path (need_weights=True:
# bmm, softmax, bmm; ViT-tiny's step 545 ms against 566 with math attention and 656 with flash
# attention for the CPU, one thread, 64 images), the default (flash) in float32 (all three level).
ddp_best_attention() {  # precision
  if [ "$1" = mixed_bfloat16 ]; then echo weights; else echo default; fi
}

# The settings each system ran at, for the JSON lines: precision and memory format.
settings_of() {  # system, model, precision -> JSON fields
  local format=nchw
  case "$1" in
    flotilla*) format=$(cat "$tmp/format-$1-$2" 2>/dev/null || echo nchw)
      case $1 in
        flotilla-no-compile) printf '"jit_compile":false,' ;;
        flotilla-fixed) printf '"kernels_mode":"fixed",' ;;
        flotilla-none) printf '"kernels_mode":"none",' ;;
      esac
      printf '"precision":"%s","memory_format":"%s","optimizer":"SGD (LibTorch)","freed_memory":"%s"' \
        "$3" "$format" "$(cat "$tmp/freed-$1-$2" 2>/dev/null || echo released)"
      local over
      over=$(cat "$tmp/allreduce-$1-$2" 2>/dev/null || true)
      printf ',"all_reduce":"%s","kernels":"%s"' "${over:-gloo}" \
        "$(cat "$tmp/kernels-$1-$2-$3" 2>/dev/null || true)" ;;
    pytorch-ddp) printf '"precision":"%s","memory_format":"nchw","optimizer":"SGD (default loop)","all_reduce":"gloo"' "$3" ;;
    pytorch-ddp-compile) printf '"precision":"%s","memory_format":"channels_last","optimizer":"SGD fused","freed_memory":"kept","all_reduce":"gloo","torch_compile":"inductor","compile_seconds_in_warmup":%s' "$3" \
        "$(median "$tmp/warmup-$2-$batch-$3-inductor")" ;;
    pytorch-ddp-best) printf '"precision":"%s","memory_format":"channels_last","optimizer":"SGD fused","freed_memory":"kept","all_reduce":"gloo"' "$3"
      [ "$2" != cnn ] || printf ',"relu_pool_order":"pool-relu"'
      local attention
      attention=$(ddp_best_attention "$3")
      [ "$attention" != weights ] || attention="MultiheadAttention need_weights=True (bmm, softmax, bmm)"
      [ "$2" != vit-tiny ] || printf ',"attention":"%s","dropout":"ATen (Bernoulli mask)"' "$attention" ;;
    tf-mwms) printf '"precision":"%s","memory_format":"channels_last","xla":false' "$3" ;;
    tf-mwms-xla) printf '"precision":"%s","memory_format":"channels_last","xla":true' "$3" ;;
    tf-mwms-pool-relu) printf '"precision":"%s","memory_format":"channels_last","xla":false,"relu_pool_order":"pool-relu"' "$3" ;;
  esac
}

for run in $(seq "$RUNS"); do
  for precision in $PRECISIONS; do
    for model in $MODELS; do
      for batch in $BATCHES; do
        steps=$(steps_for "$model" "$batch")
        key="$model-$batch-$precision"
        run_flotilla "$model" "$batch" "$steps" "$run" "$precision" >>"$tmp/flotilla-$key"
        if [ -n "$BASELINE" ]; then
          run_flotilla "$model" "$batch" "$steps" "$run" "$precision" "$BASELINE" \
            >>"$tmp/flotilla-baseline-$key"
        fi
        for peer in $PEERS; do
          # TF has no twin of torchvision's models here.
          case $peer:$model in tf-mwms*:tv-*) continue ;; esac
          case $peer in
            pytorch-ddp) run_ddp "$model" "$batch" "$steps" "$run" "$precision" nchw default ;;
            pytorch-ddp-compile)
              run_ddp "$model" "$batch" "$steps" "$run" "$precision" channels_last fused keep \
                pool-relu "$(ddp_best_attention "$precision")" inductor ;;
            flotilla-no-compile)
              run_flotilla "$model" "$batch" "$steps" "$run" "$precision" "$FLOTILLA" "$peer" --no-jit-compile ;;
            flotilla-fixed)
              run_flotilla "$model" "$batch" "$steps" "$run" "$precision" "$FLOTILLA" "$peer" --kernels fixed ;;
            flotilla-none)
              run_flotilla "$model" "$batch" "$steps" "$run" "$precision" "$FLOTILLA" "$peer" --kernels none ;;
            pytorch-ddp-best)
              run_ddp "$model" "$batch" "$steps" "$run" "$precision" channels_last fused keep \
                pool-relu "$(ddp_best_attention "$precision")" ;;
            tf-mwms) run_tf "$model" "$batch" "$steps" "$run" "$precision" off ;;
            tf-mwms-xla) run_tf "$model" "$batch" "$steps" "$run" "$precision" on ;;
            tf-mwms-pool-relu) run_tf "$model" "$batch" "$steps" "$run" "$precision" off pool-relu ;;
            *) fail "unknown peer $peer" ;;
          esac >>"$tmp/$peer-$key"
        done
      done
    done
  done
done

median() { sort -g "$1" | awk '{v[NR] = $1} END {if (NR == 0) print ""; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
flotilla_version=$("$FLOTILLA" --version | awk '{print $NF}')
systems=(flotilla)
[ -z "$BASELINE" ] || systems+=(flotilla-baseline)
for peer in $PEERS; do systems+=("$peer"); done
for precision in $PRECISIONS; do
  peak=$peak_float32
  [ "$precision" = float32 ] || peak=$peak_bfloat16
  for model in $MODELS; do
    for batch in $BATCHES; do
      key="$model-$batch-$precision"
      declare -A value=()
      for system in "${systems[@]}"; do
        [ -f "$tmp/$system-$key" ] || continue # a peer that has no twin of the model
        value[$system]=$(median "$tmp/$system-$key")
        [ -n "${value[$system]}" ] || continue  # XLA did not run
        case $system in
          flotilla) version=$flotilla_version ;;
          flotilla-baseline) version=$("$BASELINE" --version | awk '{print $NF}') ;;
          flotilla-*) version=$flotilla_version ;;
          pytorch-ddp*) version=$(cat "$tmp/version-ddp") ;;
          tf-mwms*) version=$(cat "$tmp/version-tf") ;;
        esac
        read -r lo hi < <(sort -g "$tmp/$system-$key" | awk 'NR == 1 {lo = $1} {hi = $1} END {print lo, hi}')
        utilisation=$(awk -v s="${value[$system]}" -v f="${flops[$model]}" -v p="$peak" -v n=$((WORKERS * THREADS)) \
          'BEGIN { printf "%.3f", s * f / (n * p * 1e9) }')
        printf '{"bench":"peers","system":"%s","model":"%s","global_batch":%d,%s,"metric":"samples_per_s","value":%.1f,"min":%.1f,"max":%.1f,"runs":%d,"train_flops_per_sample":%s,"share_of_matmul_peak":%s,"version":"%s","machine":%s}\n' \
          "$system" "$model" "$batch" "$(settings_of "$system" "$model" "$precision")" \
          "${value[$system]}" "$lo" "$hi" "$(wc -l <"$tmp/$system-$key")" "${flops[$model]}" \
          "$utilisation" "$version" "$machine"
      done
      for system in "${systems[@]:1}"; do
        [ -n "${value[$system]:-}" ] || continue
        read -r lo hi < <(paste "$tmp/flotilla-$key" "$tmp/$system-$key" |
          awk '$2 > 0 {r = $1 / $2; if (lo == "" || r < lo) lo = r; if (r > hi) hi = r} END {printf "%.3f %.3f\n", lo, hi}')
        printf '{"bench":"peers","model":"%s","global_batch":%d,"metric":"samples_per_s","ratio":%.3f,"of":"flotilla/%s","runs_ratio_min":%s,"runs_ratio_max":%s,"flotilla":{%s},"peer":{%s},"machine":%s}\n' \
          "$model" "$batch" "$(awk -v f="${value[flotilla]}" -v p="${value[$system]}" 'BEGIN {print f / p}')" \
          "$system" "$lo" "$hi" "$(settings_of flotilla "$model" "$precision")" \
          "$(settings_of "$system" "$model" "$precision")" "$machine"
      done
      unset value
    done
  done
done
if [ -f "$tmp/xla-failed" ]; then
  printf '{"bench":"peers","system":"tf-mwms-xla","note":"did not run: %s"}\n' \
    "$(sed 's/["\\]/ /g' "$tmp/xla-failed")"
fi
