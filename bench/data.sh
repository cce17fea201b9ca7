#!/usr/bin/env bash
# `make bench-data`: flotilla's input pipeline against tf.data, side by side on this machine.
# Both run the same Fashion-MNIST pipeline with AUTOTUNE (bench/data_pipeline.cpp,
# bench/tfdata_pipeline.py), in two orders: the issue's element-wise map before shuffle/batch,
# and the seeds' batch-then-map; and images as files: Fashion-MNIST's 60,000 training images
# written as PNG and as JPEG class folders (scripts/fashion_mnist_images.py, once, under .cache/),
# read by image_dataset_from_directory (decode, resize to 28x28 and to 32x32, batch 256) -> map ->
# prefetch on both sides. Runs alternate (A B A B ...) so drift hits both; prints one JSON line per
# system and pipeline (median elements/s) and one ratio line per pipeline, then the input-bound
# share of the 2-worker CNN training (time waiting for data / step time).
# Usage: bench/data.sh [RUNS=3] [EPOCHS=2]   (PIPELINES="element batch png-28 ..." to choose)
set -euo pipefail
# Every JSON line names the machine: the script runs again through bench/machine.sh --tag.
[ -n "${BENCH_TAGGED:-}" ] || { BENCH_TAGGED=1 "$(readlink -f "$0")" "$@" |
  "$(dirname "$(readlink -f "$0")")/machine.sh" --tag; exit "${PIPESTATUS[0]}"; }
cd "$(dirname "$0")/.."
RUNS=${1:-3}
EPOCHS=${2:-2}
BUILD_DIR=${BUILD_DIR:-build}
bench/setup_tf.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

PIPELINES=${PIPELINES:-element batch png-28 png-32 jpeg-28 jpeg-32}
# The image folders, written once (Pillow, from the project venv).
for format in png jpeg; do
  case " $PIPELINES " in *" $format-"*) ;; *) continue ;; esac
  folder=.cache/fashion-mnist-$format
  if [ ! -f "$folder/.complete" ]; then
    .venv/bin/python -c 'import PIL' 2>/dev/null || .venv/bin/pip install --quiet pillow==13.0.0
    rm -rf "$folder"
    .venv/bin/python scripts/fashion_mnist_images.py write "$folder" --format "$format"
    touch "$folder/.complete"
  fi
done
# A pipeline's arguments to both programs: "element", or "folder EPOCHS DIR SIZE".
args() {
  case $1 in
    element | batch) echo "$1 $EPOCHS" ;;
    *) echo "folder $EPOCHS .cache/fashion-mnist-${1%-*}/train ${1#*-}" ;;
  esac
}
# What each side's pipeline hands over, as JSON: both give float32 batches of 256 from the same
# images; at 28x28 flotilla skips the resize to the size the images already have, TF does not.
settings() {  # pipeline, system
  local resize=none
  case $1 in
    *-28) [ "$2" = flotilla ] && resize="none (already 28x28)" || resize="bilinear to 28x28" ;;
    *-32) resize="bilinear to 32x32" ;;
  esac
  printf '{"precision":"float32 output","batch":256,"resize":"%s","threads":"all cores"}' "$resize"
}
value() { sed 's/.*"value": *\([0-9.]*\).*/\1/'; }
for _ in $(seq "$RUNS"); do
  for order in $PIPELINES; do
    # shellcheck disable=SC2046
    "$BUILD_DIR/bench_data_pipeline" $(args "$order") | tail -n1 | value >>"$tmp/flotilla-$order"
    # shellcheck disable=SC2046
    bench/.venv-tf/bin/python bench/tfdata_pipeline.py $(args "$order") 2>/dev/null | tail -n1 |
      value >>"$tmp/tf-$order"
  done
done
median() { sort -g "$1" | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
tf_version=$(bench/.venv-tf/bin/python -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)
for order in $PIPELINES; do
  f=$(median "$tmp/flotilla-$order")
  t=$(median "$tmp/tf-$order")
  printf '{"bench":"data","system":"flotilla","pipeline":"%s","metric":"elements_per_s","value":%s,"runs":%d}\n' "$order" "$f" "$RUNS"
  printf '{"bench":"data","system":"tf.data","pipeline":"%s","metric":"elements_per_s","value":%s,"runs":%d,"version":"%s"}\n' "$order" "$t" "$RUNS" "$tf_version"
  # Both sides' settings in the ratio line: a ratio holds only like for like.
  awk -v f="$f" -v t="$t" -v o="$order" -v fs="$(settings "$order" flotilla)" \
    -v ts="$(settings "$order" tf.data)" 'BEGIN {printf "{\"bench\":\"data\",\"pipeline\":\"%s\",\"metric\":\"elements_per_s\",\"ratio\":%.2f,\"of\":\"flotilla/tf.data\",\"flotilla\":%s,\"peer\":%s}\n", o, f / t, fs, ts}'
done

# The input-bound share of the main job's training (300 steps, 2 workers, CNN).
"$BUILD_DIR/flotilla" launch --workers 2 -- flotilla train --model cnn --steps-per-epoch 300 \
  --metrics-json "$tmp/train.json" >/dev/null 2>&1
share=$(head -n1 "$tmp/train.json" | sed 's/.*"input_bound_share":\([0-9.e-]*\).*/\1/')
printf '{"bench":"data","system":"flotilla","pipeline":"train cnn, 2 workers","metric":"input_bound_share","value":%.4f}\n' "$share"
