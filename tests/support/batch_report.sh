#!/bin/sh
# One test's CTest entry in a batched suite (see batch_main.cpp): CTest runs it as the suite's
# "emulator", so its arguments are the suite's command for this test:
#   batch_report.sh --shards=N <suite> --gtest_filter=<Suite.Test> --gtest_also_run_disabled_tests
# It runs nothing: it prints the test's block from <suite>.<i>.results (i < N), written by this
# ctest run's <suite>_run_<i> fixtures, and exits 0 (passed or skipped) or 1 (failed, crashed,
# timed out, or no result). Asked to list the tests (gtest_discover_tests), it runs the suite.
shards=${1#--shards=}
exe=$2
shift 2
case "$*" in *--gtest_list_tests*) exec "$exe" "$@" ;; esac
name=
for a in "$@"; do
  case "$a" in --gtest_filter=*) name=${a#--gtest_filter=} ;; esac
done
results="$exe.{0..$((shards - 1))}.results"
set -- /dev/null # what awk reads: the shards' results that exist
i=0
while [ "$i" -lt "$shards" ]; do
  [ -f "$exe.$i.results" ] && set -- "$@" "$exe.$i.results"
  i=$((i + 1))
done
awk -v name="$name" -v results="$results" '
  $1 == "START" && $2 == name { inside = 1; lines = ""; next }
  inside && $1 == "END" && $2 == name { status = $3; ms = $4; inside = 0; next }
  inside && /^\| / { lines = lines substr($0, 3) "\n"; next }
  END {
    if (status == "") {
      printf "%s: no result in %s: did this ctest run include its suite'"'"'s _run entries?\n",
             name, results
      exit 1
    }
    printf "%s", lines
    # gtest'"'"'s own words, which CTest'"'"'s SKIP_REGULAR_EXPRESSION for skipped tests looks for.
    word = status == "PASSED" ? "       OK " : status == "SKIPPED" ? "  SKIPPED " : \
           status == "FAILED" ? "  FAILED  " : " " status " "
    printf "[%s] %s (%d ms, in one process with the rest of its suite)\n", word, name, ms
    exit (status == "PASSED" || status == "SKIPPED") ? 0 : 1
  }' "$@"
