# The libFuzzer targets as CTest entries (label "fuzz"), included from tests/CMakeLists.txt: one
# entry builds them all (clang, in <build>/fuzz, through tests/fuzz/run.sh), then each target
# runs for 12 s from its seed corpus. run.sh exits 77 (skipped) when clang or libFuzzer is
# missing. `make fuzz` runs each target longer.
set(FLOTILLA_FUZZ_RUNNER ${CMAKE_SOURCE_DIR}/tests/fuzz/run.sh)
set(FLOTILLA_FUZZ_ENV "FLOTILLA_FUZZ_BUILD=${CMAKE_BINARY_DIR}/fuzz")
add_test(NAME fuzz_build COMMAND ${FLOTILLA_FUZZ_RUNNER} --build)
set_tests_properties(fuzz_build PROPERTIES LABELS fuzz SKIP_RETURN_CODE 77 TIMEOUT 900
  FIXTURES_SETUP fuzz_targets ENVIRONMENT ${FLOTILLA_FUZZ_ENV})
foreach(target tf_config slurm idx tfrecord csv manifest)
  add_test(NAME fuzz_${target} COMMAND ${FLOTILLA_FUZZ_RUNNER} ${target} 12)
  # The timeout only guards against a hang: a run takes its 12 s plus start-up.
  set_tests_properties(fuzz_${target} PROPERTIES LABELS fuzz SKIP_RETURN_CODE 77 TIMEOUT 300
    FIXTURES_REQUIRED fuzz_targets ENVIRONMENT ${FLOTILLA_FUZZ_ENV})
endforeach()
