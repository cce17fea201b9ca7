#!/usr/bin/env bash
# Runs one libFuzzer target for a bounded time: tests/fuzz/run.sh TARGET SECONDS
#        tests/fuzz/run.sh --list      (the targets)
#        tests/fuzz/run.sh --build     (build every target, run none)
# The first use configures build/fuzz with clang (ASan + UBSan + libFuzzer) and builds there;
# later uses rebuild only what changed (ccache makes a fresh clone cheap too). The seed corpus
# (tests/fuzz/corpus/TARGET) is copied to a temporary directory, so nothing is written into the
# repository; a crashing input is saved under build/fuzz/crashes/TARGET/ and the exit status is
# nonzero. Exit status 77 (ctest's skip) when clang or libFuzzer is missing.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${FLOTILLA_FUZZ_BUILD:-$root/build/fuzz}
targets=(tf_config slurm idx tfrecord csv manifest)

usage() {
  echo "usage: $0 TARGET SECONDS | --list | --build   (targets: ${targets[*]})" >&2
  exit 2
}

[[ $# -ge 1 ]] || usage
if [[ $1 == --list ]]; then
  printf '%s\n' "${targets[@]}"
  exit 0
fi

cxx=${FUZZ_CXX:-clang++}
cc=${FUZZ_CC:-clang}
if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "SKIP: $cxx not found; the fuzz targets need clang with libFuzzer (apt install clang)" >&2
  exit 77
fi
# libFuzzer ships with clang's compiler-rt; Debian splits it off on some versions.
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }\n' \
  >"$probe/probe.cpp"
if ! "$cxx" -fsanitize=fuzzer,address,undefined "$probe/probe.cpp" -o "$probe/probe" \
  >"$probe/log" 2>&1; then
  echo "SKIP: $cxx cannot link -fsanitize=fuzzer (libclang_rt.fuzzer missing?):" >&2
  tail -3 "$probe/log" >&2
  exit 77
fi

if [[ ! -f $build/build.ninja ]]; then
  CC=$cc CXX=$cxx cmake -G Ninja -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    >"$probe/configure.log" 2>&1 || { cat "$probe/configure.log" >&2; exit 1; }
fi

if [[ $1 == --build ]]; then
  ninja -C "$build" -j "${JOBS:-2}" $(printf 'fuzz_%s ' "${targets[@]}")
  exit 0
fi

[[ $# -eq 2 && $2 =~ ^[0-9]+$ ]] || usage
target=$1
seconds=$2
[[ " ${targets[*]} " == *" $target "* ]] || usage
ninja -C "$build" -j "${JOBS:-2}" "fuzz_$target" >"$probe/build.log" 2>&1 ||
  { cat "$probe/build.log" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$probe" "$work"' EXIT
mkdir -p "$work/corpus"
cp -r "$here/corpus/$target/." "$work/corpus/"
crashes=$build/crashes/$target
mkdir -p "$crashes"

echo "fuzz_$target: ${seconds}s from $(ls "$work/corpus" | wc -l) seeds"
status=0
"$build/fuzz_$target" "$work/corpus" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
  -print_final_stats=1 -artifact_prefix="$crashes/" >"$work/log" 2>&1 || status=$?
# The last progress line and the final statistics: coverage, executions and their rate.
grep -E '^#[0-9]+ +(DONE|pulse|NEW|REDUCE)' "$work/log" | tail -1 || true
grep -E '^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$work/log" || true
if [[ $status -ne 0 ]]; then
  echo "fuzz_$target FAILED (exit $status); the input is under $crashes/:" >&2
  grep -E -A40 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error|terminate called' \
    "$work/log" | head -60 >&2 || tail -40 "$work/log" >&2
  ls -t "$crashes" | head -3 >&2
  exit 1
fi
echo "fuzz_$target: no crash"
