#!/usr/bin/env bash
# The GPU evidence in one command, run THERE (a GPU machine, from the repository root, with $OUT
# set) on the binaries bench/gpu/package.sh built here and left in .device/ (carried along: the
# GPU image lacks flotilla's build dependencies). They run against that machine's own LibTorch
# (python3's torch 2.11 + CUDA 13, the same build as here) through LD_LIBRARY_PATH.
#
# Writes, each as soon as it is known, so that a run cut short still returns what it did:
#   $OUT/machine.txt     GPU, driver, torch/CUDA/NCCL/cuDNN, glibc/libstdc++, what the binaries need
#   $OUT/gpu_tests.log   the gpu-labelled GoogleTest suite
#   $OUT/bench.jsonl     one JSON line per configuration (or an error line naming it):
#       for model in cnn mlp-wide, per-replica batch in 256 1024:
#         flotilla float32 / mixed_bfloat16 / mixed_float16, CUDA graph (jit_compile) off and on
#         in channels-last and in NCHW (one of them is its default for the model);
#         PyTorch eager float32 / bf16 autocast / fp16 autocast + GradScaler (torch_peer.py),
#         each in NCHW and in channels_last; the CNN's max-pools before its ReLUs, as flotilla's
#         zoo computes it (--pool-first);
#       2 processes on the one GPU (flotilla launch --workers 2): NCCL first; if NCCL refuses
#         two ranks on one device, {"bench":"gpu_train_2proc","nccl":"refused",...} and the
#         Gloo ring instead;
#       last, torch.compile (bf16 first, then float32, float16; channels_last; its
#         mode="reduce-overhead" with CUDA graphs first, then the default mode) while the time
#         budget lasts: compiling costs tens of seconds per configuration.
#   $OUT/summary.json    bench/gpu/summarize.py's ratios (flotilla best bf16 / torch-eager bf16,
#                        goal >= 1.1; / torch-compile bf16, default and reduce-overhead, each goal >= 1.0), rewritten after each
#                        phase
#   $OUT/run.log         this script's output
#
# Usage: OUT=/some/dir bench/gpu/run.sh [--dry-run]
#   --dry-run: on a machine without a GPU (the build machine): the CPU device, tiny batches and
#   step counts, the GPU tests' result not held against the run, no torch.compile.
#   env: BUDGET_S=450 (the whole run; torch.compile gets what is left)  STEPS=200  WARMUP=50
#        MODELS="cnn mlp-wide"  BATCHES="256 1024"  PRECISIONS="float32 mixed_bfloat16 mixed_float16"
#        TWO_PROC=1 (0: no 2-process runs)  COMPILE_MODES="compile-graphs compile" (none: no torch.compile)  PYTHON=python3
#        ADAM_MODELS="" (models also timed with Adam, bf16, first batch of BATCHES: flotilla graph
#        off and on, PyTorch eager in both formats; run before torch.compile)
set -uo pipefail # not -e: one failed configuration records an error line and the run goes on
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD

DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: OUT=DIR bench/gpu/run.sh [--dry-run]" >&2; exit 2 ;;
esac
: "${OUT:?set OUT to the directory for the results}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/bench.jsonl" "$OUT/summary.json"
: >"$OUT/bench.jsonl"
exec > >(tee "$OUT/run.log") 2>&1

if [ "$DRY" = 1 ]; then
  DEVICE=cpu BUDGET_S=${BUDGET_S:-900} STEPS=${STEPS:-3} WARMUP=${WARMUP:-2}
  BATCHES=${BATCHES:-16} TWO_PROC_BATCH=16 TWO_PROC_STEPS=3 TWO_PROC_WARMUP=2
else
  DEVICE=cuda:0 BUDGET_S=${BUDGET_S:-450} STEPS=${STEPS:-200} WARMUP=${WARMUP:-50}
  BATCHES=${BATCHES:-256 1024} TWO_PROC_BATCH=256 TWO_PROC_STEPS=100 TWO_PROC_WARMUP=20
fi
MODELS=${MODELS:-cnn mlp-wide}
PRECISIONS=${PRECISIONS:-float32 mixed_bfloat16 mixed_float16}
BIN=$ROOT/.device/bin
JSONL=$OUT/bench.jsonl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

say() { echo "[run.sh $(date -u +%T) +${SECONDS}s] $*"; }
left() { echo $((BUDGET_S - SECONDS)); }

# python3 with torch: the GPU image's; on the build machine, the project venv's.
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if ! python3 -c 'import torch' 2>/dev/null && [ -x .venv/bin/python ]; then PYTHON=$ROOT/.venv/bin/python; fi
fi
if ! torch_lib=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))'); then
  say "FATAL: $PYTHON cannot import torch; set PYTHON"
  exit 1
fi
# LibTorch's own CUDA libraries (cudart, nvrtc, NCCL, cuDNN...) live in the nvidia-* wheels next
# to torch; the binaries link some of them directly, so they must be on the path too.
site=$(dirname "$(dirname "$torch_lib")")
lib_path=$ROOT/.device/lib:$torch_lib
for d in "$site"/nvidia/*/lib "$site"/nvidia/*/*/lib; do [ -d "$d" ] && lib_path+=":$d"; done
# Only the carried binaries get this path; python3 keeps its own environment.
bin_env=(env "LD_LIBRARY_PATH=$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")

summarize() { python3 bench/gpu/summarize.py "$JSONL" "$OUT/summary.json" | sed 's/^/  /'; }

# JSON of the config fields in $1 (a JSON object) plus rc and error: a line summarize counts.
error_line() {  # meta_json rc message
  python3 -c 'import json, sys
line = {"bench": "gpu_train"} | json.loads(sys.argv[1])
line.update({"rc": int(sys.argv[2]), "error": sys.argv[3][:500]})
print(json.dumps(line))' "$1" "$2" "$3" >>"$JSONL"
}

# Runs one command under a timeout; appends its JSON result lines (also those "flotilla launch"
# prefixed with "[worker i] ") to bench.jsonl; on failure or no result, an error line. Sets
# $rc and $log (the command's output).
record() {  # label meta_json timeout_s command...
  local label=$1 meta=$2 limit=$3
  shift 3
  log=$tmp/$(printf %s "$label" | tr -c 'A-Za-z0-9_.-' _).log
  : >"$log"
  # No configuration may run past the budget: whatever it leaves is better than nothing back.
  if [ $(($(left) - 10)) -lt "$limit" ]; then limit=$(($(left) - 10)); fi
  if [ "$limit" -lt 10 ]; then
    say "budget spent: skipping $label"
    rc=125
    error_line "$meta" "$rc" "skipped: the ${BUDGET_S}s budget was spent"
    return
  fi
  say "$label (timeout ${limit}s)"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  local results
  results=$(sed 's/^\[worker [0-9]*\] //' "$log" | grep '^{"bench"' || true)
  [ -n "$results" ] && echo "$results" >>"$JSONL" && echo "$results" | sed 's/^/  /'
  if [ "$rc" -ne 0 ] || [ -z "$results" ]; then
    local why
    why=$(sed 's/^\[worker [0-9]*\] //' "$log" | grep -iE 'error|exception|fatal|abort|terminate' |
      grep -v '^{"bench"' | head -n 1)
    [ "$rc" -eq 124 ] && why="timed out after ${limit}s${why:+; $why}"
    [ -n "$why" ] || why=$(tail -n 1 "$log")
    # torch_peer.py writes its own error lines; any other failure gets one here.
    if ! grep -q '"error"' <<<"$results"; then error_line "$meta" "$rc" "$why"; fi
    say "  failed (exit $rc, $((SECONDS - start))s); last lines:"
    tail -n 15 "$log" | sed 's/^/  | /'
  else
    say "  ok ($((SECONDS - start))s)"
  fi
}

# --- 1. The machine --------------------------------------------------------------------------
say "machine facts -> $OUT/machine.txt"
{
  echo "== date: $(date -u +%FT%TZ)  mode: $([ "$DRY" = 1 ] && echo dry-run || echo gpu)"
  echo "== nvidia-smi"
  nvidia-smi 2>&1 || echo "(no nvidia-smi)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1 || true
  echo "== torch"
  "$PYTHON" -c 'import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
    print("nccl", torch.cuda.nccl.version())
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("triton: not importable:", e)' 2>&1
  echo "== host"
  uname -a
  grep PRETTY_NAME /etc/os-release 2>/dev/null
  ldd --version 2>&1 | head -n 1
  echo "libstdc++ has up to $(grep -ao 'GLIBCXX_[0-9.]*' "$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')" 2>/dev/null | sort -uV | tail -n 1)"
  echo "cpus $(nproc); $(free -g 2>/dev/null | awk '/Mem:/ {print "memory " $2 " GiB"}')"
  echo "cc: $(command -v cc gcc 2>/dev/null | head -n 1) (torch.compile's inductor needs a C compiler)"
  echo "== .device/MANIFEST.txt (what the carried binaries are and need)"
  cat .device/MANIFEST.txt 2>&1
} >"$OUT/machine.txt" 2>&1
sed -n '1,4p;/== torch/,/== host/p' "$OUT/machine.txt" | grep -v '^==' | head -n 12 | sed 's/^/  /'

# --- 2. The carried binaries start -----------------------------------------------------------
flotilla_ok=1
if [ ! -x "$BIN/gpu_train_bench" ]; then
  say "no .device/bin/gpu_train_bench: run bench/gpu/package.sh on the build machine and carry .device"
  flotilla_ok=0
else
  check_libs() { for b in "$BIN"/flotilla "$BIN"/gpu_train_bench "$BIN"/tests/*; do
      [ -x "$b" ] && [ "$(head -c 4 "$b" | tail -c 3)" = ELF ] && "${bin_env[@]}" ldd "$b" 2>&1 | sed "s|^|$(basename "$b"): |"
    done | grep -E 'not found' ; }
  missing=$(check_libs)
  if grep -q 'GLIBCXX' <<<"$missing"; then
    # This machine's libstdc++ is older than the build machine's: use the carried one.
    say "the system libstdc++ is too old ($(grep -o 'GLIBCXX_[0-9.]*' <<<"$missing" | head -n 1)); using .device/lib/compat"
    lib_path=$ROOT/.device/lib/compat:$lib_path
    bin_env=(env "LD_LIBRARY_PATH=$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    missing=$(check_libs)
  fi
  if [ -n "$missing" ]; then
    say "the carried binaries cannot start here:"
    echo "$missing" | sed 's/^/  /' | tee -a "$OUT/machine.txt"
    flotilla_ok=0
  elif ! "${bin_env[@]}" "$BIN/gpu_train_bench" --help >"$tmp/help.log" 2>&1 ||
       ! "${bin_env[@]}" "$BIN/flotilla" --version >>"$tmp/help.log" 2>&1; then
    say "the carried binaries do not run:"
    tail -n 5 "$tmp/help.log" | sed 's/^/  /' | tee -a "$OUT/machine.txt"
    flotilla_ok=0
  else
    say "carried binaries start: $(tail -n 1 "$tmp/help.log")"
    echo "== carried binaries: ldd clean, start ($(tail -n 1 "$tmp/help.log"))" >>"$OUT/machine.txt"
  fi
fi
if [ "$flotilla_ok" = 0 ]; then
  error_line '{"impl":"flotilla","stage":"start"}' 127 "the carried binaries cannot start; see machine.txt"
fi

# --- 3. The GPU tests ------------------------------------------------------------------------
if [ "$flotilla_ok" = 1 ] && [ -x "$BIN/tests/gpu_tests" ]; then
  say "gpu_tests -> $OUT/gpu_tests.log"
  (cd "$BIN/tests" && timeout -k 10 180 "${bin_env[@]}" ./gpu_tests --gtest_brief=1 --gtest_color=no) >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  tail -n 4 "$OUT/gpu_tests.log" | sed 's/^/  /'
  if [ "$rc" -ne 0 ]; then
    if [ "$DRY" = 1 ]; then say "gpu_tests exit $rc (dry run: not counted)"; else say "gpu_tests FAILED (exit $rc)"; fi
  fi
else
  echo "gpu_tests not run: the carried binaries are missing or cannot start (see machine.txt)" >"$OUT/gpu_tests.log"
fi

# --- 4. One device: flotilla and PyTorch eager, side by side per (model, batch) ----------------
flotilla_run() {  # model batch precision graph(on|off) [extra args...]
  local model=$1 batch=$2 precision=$3 graph=$4
  shift 4
  local args=(--model "$model" --batch "$batch" --precision "$precision" --devices "$DEVICE"
    --steps "$STEPS" --warmup "$WARMUP" --optimizer "$OPT")
  [ "$graph" = on ] && args+=(--jit-compile)
  local cuda_graph=false
  [ "$graph" = on ] && [ "$DEVICE" != cpu ] && cuda_graph=true
  record "flotilla $model b$batch $precision graph-$graph $OPT" \
    "{\"impl\":\"flotilla\",\"model\":\"$model\",\"batch\":$batch,\"precision\":\"$precision\",\"cuda_graph\":$cuda_graph,\"workers\":1,\"optimizer\":\"$OPT\"}" \
    90 "${bin_env[@]}" "$BIN/gpu_train_bench" "${args[@]}" "$@"
}
torch_run() {  # mode model batch precisions(comma-separated) timeout [memory formats]
  record "torch-$1 $2 b$3 $4 $OPT" \
    "{\"impl\":\"torch-$1\",\"model\":\"$2\",\"batch\":$3,\"precision\":\"$4\",\"workers\":1,\"optimizer\":\"$OPT\"}" "$5" \
    "$PYTHON" bench/gpu/torch_peer.py --modes "$1" --model "$2" --batch "$3" --precisions "$4" \
    --device "$DEVICE" --steps "$STEPS" --warmup "$WARMUP" \
    --memory-formats "${6:-nchw,channels_last}" --pool-first --optimizer "$OPT"
}
OPT=sgd

for model in $MODELS; do
  for batch in $BATCHES; do
    if [ "$(left)" -lt 60 ]; then say "budget spent: skipping $model b$batch"; continue; fi
    if [ "$flotilla_ok" = 1 ]; then
      for precision in $PRECISIONS; do
        # Conv models in each memory format (whichever the model's default is), the graph off
        # and on; the MLPs have no convolutions and one layout.
        case $model in mlp*) formats=default ;; *) formats="on off" ;; esac
        for cl in $formats; do
          for graph in off on; do
            if [ "$cl" = default ]; then flotilla_run "$model" "$batch" "$precision" "$graph"
            else flotilla_run "$model" "$batch" "$precision" "$graph" --channels-last "$cl"; fi
          done
        done
      done
    fi
    torch_run eager "$model" "$batch" "${PRECISIONS// /,}" 150
  done
  summarize
done

# --- 5. Two processes on the one device --------------------------------------------------------
two_proc() {  # model precision implementation
  local meta="{\"impl\":\"flotilla\",\"model\":\"$1\",\"batch\":$TWO_PROC_BATCH,\"precision\":\"$2\",\"workers\":2,\"implementation\":\"$3\"}"
  record "2 processes $1 b$TWO_PROC_BATCH $2 $3" "$meta" 120 \
    "${bin_env[@]}" NCCL_DEBUG=WARN "$BIN/flotilla" launch --workers 2 -- "$BIN/gpu_train_bench" \
    --devices "$DEVICE" --model "$1" --batch "$TWO_PROC_BATCH" --precision "$2" \
    --steps "$TWO_PROC_STEPS" --warmup "$TWO_PROC_WARMUP" --implementation "$3"
}
if [ "$flotilla_ok" = 1 ] && [ "${TWO_PROC:-1}" = 1 ]; then
  for model in $MODELS; do
    if [ "$(left)" -lt 60 ]; then say "budget spent: skipping the 2-process $model run"; continue; fi
    two_proc "$model" mixed_bfloat16 auto
    if [ "$rc" -ne 0 ] && grep -qi 'nccl' "$log"; then
      # NCCL allows one rank per GPU in a communicator; that is NCCL's rule, not flotilla's.
      why=$(sed 's/^\[worker [0-9]*\] //' "$log" |
        grep -iE 'duplicate gpu|ncclInvalidUsage|nccl.*(error|invalid)' | head -n 1)
      python3 -c 'import json, sys
print(json.dumps({"bench": "gpu_train_2proc", "model": sys.argv[1], "nccl": "refused",
                  "error": sys.argv[2][:500]}))' "$model" "${why:-$(grep -i nccl "$log" | head -n 1)}" >>"$JSONL"
      say "  NCCL refused two ranks on one GPU; the Gloo ring on GPU tensors instead"
      two_proc "$model" mixed_bfloat16 ring
    fi
  done
  summarize
fi

# --- 6. Adam (foreach on both sides: flotilla's make_optimizer, torch.optim.Adam's CUDA default) -
for model in ${ADAM_MODELS:-}; do
  batch=${BATCHES%% *}
  if [ "$(left)" -lt 90 ]; then say "budget spent: skipping Adam on $model"; continue; fi
  OPT=adam
  if [ "$flotilla_ok" = 1 ]; then
    for graph in off on; do flotilla_run "$model" "$batch" mixed_bfloat16 "$graph"; done
  fi
  torch_run eager "$model" "$batch" mixed_bfloat16 90
  OPT=sgd
  summarize
done

# --- 7. torch.compile, last: it compiles for tens of seconds per configuration -----------------
if [ "$DRY" = 1 ]; then
  say "dry run: no torch.compile; the summarizer's own test instead"
  python3 bench/gpu/summarize_test.py | sed 's/^/  /'
else
  for precision in mixed_bfloat16 float32 mixed_float16; do
    for mode in ${COMPILE_MODES:-compile-graphs compile}; do
      [ "$mode" = none ] && continue
      for model in $MODELS; do
        for batch in $BATCHES; do
          budget=$(($(left) - 10))
          if [ "$budget" -lt 45 ]; then say "budget spent: skipping torch-$mode $model b$batch $precision"; continue; fi
          torch_run "$mode" "$model" "$batch" "$precision" $((budget < 150 ? budget : 150)) channels_last
        done
      done
    done
    summarize
  done
fi

summarize
say "done in ${SECONDS}s: $(grep -c . "$JSONL" 2>/dev/null || echo 0) lines in $JSONL"
