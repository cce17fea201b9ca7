#!/usr/bin/env bash
# `make bench-gpu`, run HERE (the CPU build machine): builds what bench/gpu/run.sh needs on the
# GPU machine and puts it in .device/ (ignored by git), to be carried there with the tree.
#
# Why carry binaries instead of building there: the GPU machine's image has CUDA 13, python3
# with torch 2.11.0+cu130 (and so LibTorch), CMake and Ninja, but none of flotilla's other build
# dependencies (nlohmann-json, CLI11, protobuf headers, Gloo headers, GoogleTest, OpenSSL and
# zlib headers), and no network to fetch them. The torch wheel here is the same build as there,
# so binaries linked here run there against THAT machine's LibTorch, found at run time through
# LD_LIBRARY_PATH (run.sh sets it from its python3's torch). What LibTorch does not bring
# travels in .device/lib: every shared library the binaries need (ldd) that is neither from the
# torch wheel or its nvidia-* wheels (cudart, nvrtc, NCCL, cuDNN: the image has them) nor part
# of the C runtime every Linux has (glibc's libraries, the loader, libgcc_s). That is protobuf
# (Debian 12's libprotobuf.so.32: an image rarely has that very version), OpenSSL's libcrypto and zlib: the
# last two may well be there already, but carrying them costs 5 MiB and removes the question
# (an OpenSSL 1.1 image would lack libcrypto.so.3). libstdc++ goes in
# .device/lib/compat, used only if the machine's own is older than the binaries need (run.sh
# checks); glibc cannot be carried, so the GLIBC versions the binaries need are written to
# .device/MANIFEST.txt for comparison with run.sh's machine.txt.
#
# Layout: .device/bin/{flotilla,gpu_train_bench}, .device/bin/tests/{gpu_tests,...} (the tests
# find the CLI at ../flotilla), .device/lib, .device/MANIFEST.txt.
# Usage: bench/gpu/package.sh [--no-build]   (--no-build: package what the build dir holds)
#   env: BUILD_DIR=build JOBS=2
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=1
case "${1:-}" in
  --no-build) BUILD=0 ;;
  "") ;;
  *) echo "usage: bench/gpu/package.sh [--no-build]" >&2; exit 2 ;;
esac
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
DEVICE_DIR=.device

# collective_worker only if a GPU test starts it (the cross-process collective tests do).
targets=(flotilla_cli gpu_tests gpu_train_bench)
if grep -lq collective_worker tests/gpu/*.cpp 2>/dev/null; then targets+=(collective_worker); fi
if [ "$BUILD" = 1 ]; then cmake --build "$BUILD_DIR" --target "${targets[@]}" -j "$JOBS"; fi

rm -rf "$DEVICE_DIR"
mkdir -p "$DEVICE_DIR/bin/tests" "$DEVICE_DIR/lib/compat"
declare -A dest=(
  [flotilla_cli]="bin/flotilla"
  [gpu_train_bench]="bin/gpu_train_bench"
  [gpu_tests]="bin/tests/gpu_tests"
  [collective_worker]="bin/tests/collective_worker"
)
declare -A src=(
  [flotilla_cli]="$BUILD_DIR/flotilla"
  [gpu_train_bench]="$BUILD_DIR/gpu_train_bench"
  [gpu_tests]="$BUILD_DIR/tests/gpu_tests"
  [collective_worker]="$BUILD_DIR/tests/collective_worker"
)
binaries=()
for t in "${targets[@]}"; do
  install -m 755 "${src[$t]}" "$DEVICE_DIR/${dest[$t]}"
  # The build tree's RUNPATH points into this checkout (.venv, /usr/local/cuda): meaningless
  # there, so it goes; strip drops the symbols (tens of MB) that only a debugger here would use.
  strip --strip-unneeded "$DEVICE_DIR/${dest[$t]}"
  if command -v patchelf >/dev/null; then patchelf --remove-rpath "$DEVICE_DIR/${dest[$t]}"; fi
  binaries+=("$DEVICE_DIR/${dest[$t]}")
done
# The tests run the project venv's Python through this name (tests/support/paths.h).
printf '#!/bin/sh\nexec python3 "$@"\n' >"$DEVICE_DIR/bin/tests/python"
chmod 755 "$DEVICE_DIR/bin/tests/python"

# Shared libraries to carry: what ldd resolves outside the torch wheel and the C runtime.
torch_site=$(.venv/bin/python -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
is_runtime() {  # soname -> 0 for what every Linux (and CUDA driver install) already has
  case "$1" in
    linux-vdso.so.*|ld-linux*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*| \
    libresolv.so.*|libutil.so.*|libgcc_s.so.*|libcuda.so.*) return 0 ;;
  esac
  return 1
}
# The CUDA runtime the binaries link (cudart, nvrtc, ...) comes from /usr/local/cuda here and
# from the nvidia-* wheels there: same CUDA 13 sonames, so it is never carried either.
is_cuda_toolkit() { case "$1" in /usr/local/cuda*) return 0 ;; esac; return 1; }
declare -A carried=()
for b in "${binaries[@]}"; do
  while read -r name _ path _; do
    [ -n "${path:-}" ] || continue
    is_runtime "$name" && continue
    case "$path" in "$torch_site"/*) continue ;; esac
    is_cuda_toolkit "$path" && continue
    if [ "$path" = "not" ]; then echo "package.sh: $b needs $name, which ldd cannot find here" >&2; exit 1; fi
    if [ "$name" = libstdc++.so.6 ]; then
      cp -L "$path" "$DEVICE_DIR/lib/compat/$name"
    else
      cp -L "$path" "$DEVICE_DIR/lib/$name"
    fi
    carried[$name]=$path
  done < <(ldd "$b" | grep '=>')
done
for f in "$DEVICE_DIR"/lib/*.so* "$DEVICE_DIR"/lib/compat/*.so*; do
  [ -e "$f" ] && strip --strip-unneeded "$f"
done

# Newest symbol versions needed, to compare with the machine's (run.sh's machine.txt).
needed_max() {  # prefix -> the highest PREFIX_x.y any carried file needs
  objdump -T "${binaries[@]}" "$DEVICE_DIR"/lib/*.so* 2>/dev/null |
    grep -o "$1_[0-9.]*" | sort -uV | tail -n 1
}
{
  echo "flotilla $(git describe --always --dirty 2>/dev/null || echo unknown), built $(date -u +%FT%TZ) on $(uname -m)"
  echo "torch (build) $(.venv/bin/python -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"
  echo "needs: $(needed_max GLIBC) (glibc), $(needed_max GLIBCXX) (libstdc++; lib/compat has $(grep -ao 'GLIBCXX_[0-9.]*' "$DEVICE_DIR/lib/compat/libstdc++.so.6" | sort -uV | tail -n1))"
  for name in "${!carried[@]}"; do echo "carried lib: $name <- ${carried[$name]}"; done | sort
  (cd "$DEVICE_DIR" && find bin lib -type f -printf '%s\t%p\n' | sort -k2)
} >"$DEVICE_DIR/MANIFEST.txt"

device_bytes=$(du -sb "$DEVICE_DIR" | cut -f1)
# Files deleted but not yet committed are listed and missing: stat's complaint is no error here.
tree_bytes=$( (git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null || true) |
  awk '{s += $1} END {print s + 0}')
cat "$DEVICE_DIR/MANIFEST.txt"
awk -v d="$device_bytes" -v t="$tree_bytes" 'BEGIN {
  printf "package.sh: .device %.1f MiB; with the working tree (tracked + untracked, not ignored) %.1f MiB of 64 MiB\n", d / 1048576, (d + t) / 1048576 }'
if [ $((device_bytes + tree_bytes)) -gt $((48 * 1048576)) ]; then
  echo "package.sh: over 48 MiB: too close to the 64 MiB carry limit" >&2
  exit 1
fi
