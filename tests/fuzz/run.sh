#!/usr/bin/env bash
# Runs one libFuzzer target for a bounded time: tests/fuzz/run.sh TARGET SECONDS
#        tests/fuzz/run.sh --list      (the targets)
#        tests/fuzz/run.sh --build     (build every target, run none)
#        tests/fuzz/run.sh --all SECONDS DIR   (every target, two at a time: a target is one
#                                       process on one core; each one's output and exit status
#                                       go to DIR/TARGET.out and DIR/TARGET.status)
#        tests/fuzz/run.sh --report TARGET DIR (prints what --all saved for TARGET and exits
#                                       with its status: its CTest entry)
# The first use configures build/fuzz with clang (ASan + UBSan + libFuzzer) and builds there;
# later uses rebuild only what changed (ccache makes a fresh clone cheap too). The seed corpus
# (tests/fuzz/corpus/TARGET) is copied to a temporary directory, so nothing is written into the
# repository; a crashing input is saved under build/fuzz/crashes/TARGET/ and the exit status is
# nonzero. Exit status 77 (ctest's skip) when clang or libFuzzer is missing.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${FLOTILLA_FUZZ_BUILD:-$root/build/fuzz}
targets=(tf_config slurm idx tfrecord csv manifest pointer wire safetensors cache image)

usage() {
  echo "usage: $0 TARGET SECONDS | --list | --build   (targets: ${targets[*]})" >&2
  exit 2
}

[[ $# -ge 1 ]] || usage
if [[ $1 == --list ]]; then
  printf '%s\n' "${targets[@]}"
  exit 0
fi
if [[ $1 == --report ]]; then
  [[ $# -eq 3 ]] || usage
  if [[ ! -f $3/$2.status ]]; then
    echo "fuzz_$2: no result in $3: did this ctest run include fuzz_run?" >&2
    exit 1
  fi
  cat "$3/$2.out"
  status=$(cat "$3/$2.status")
  exit "$status"
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

if [[ $1 == --all ]]; then
  [[ $# -eq 3 && $2 =~ ^[0-9]+$ ]] || usage
  mkdir -p "$3"
  rm -f "$3"/*.out "$3"/*.status
  ninja -C "$build" -j "${JOBS:-2}" $(printf 'fuzz_%s ' "${targets[@]}") >"$probe/build.log" 2>&1 ||
    { cat "$probe/build.log" >&2; exit 1; }
  export FLOTILLA_FUZZ_PREBUILT=1
  # Each target's status is its own; this run fails only if it could not run them.
  printf '%s\n' "${targets[@]}" | xargs -P "${JOBS:-2}" -I{} sh -c \
    '"$0" {} "$1" > "$2/{}.out" 2>&1; echo $? > "$2/{}.status"' "$0" "$2" "$3"
  # A skip (77: no clang or libFuzzer) is everyone's.
  if grep -qx 77 "$3"/*.status; then exit 77; fi
  exit 0
fi
if [[ $1 == --build ]]; then
  ninja -C "$build" -j "${JOBS:-2}" $(printf 'fuzz_%s ' "${targets[@]}")
  exit 0
fi

[[ $# -eq 2 && $2 =~ ^[0-9]+$ ]] || usage
target=$1
seconds=$2
[[ " ${targets[*]} " == *" $target "* ]] || usage
# --all builds every target first, then runs them side by side: two ninjas in one build
# directory at once could corrupt its logs.
if [[ -z ${FLOTILLA_FUZZ_PREBUILT:-} ]]; then
  ninja -C "$build" -j "${JOBS:-2}" "fuzz_$target" >"$probe/build.log" 2>&1 ||
    { cat "$probe/build.log" >&2; exit 1; }
fi

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
