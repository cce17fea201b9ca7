# The libFuzzer targets as CTest entries (label "fuzz"), included from tests/CMakeLists.txt: one
# entry builds them all (clang, in <build>/fuzz, through tests/fuzz/run.sh), one runs every
# target for 6 s from its seed corpus, two at a time (each is one process on one core), and each
# target's entry then reports its run. run.sh exits 77 (skipped) when clang or libFuzzer is
# missing. `make fuzz` runs each target longer.
set(FLOTILLA_FUZZ_RUNNER ${CMAKE_SOURCE_DIR}/tests/fuzz/run.sh)
set(FLOTILLA_FUZZ_ENV "FLOTILLA_FUZZ_BUILD=${CMAKE_BINARY_DIR}/fuzz")
set(FLOTILLA_FUZZ_RESULTS ${CMAKE_BINARY_DIR}/fuzz/results)
add_test(NAME fuzz_build COMMAND ${FLOTILLA_FUZZ_RUNNER} --build)
set_tests_properties(fuzz_build PROPERTIES LABELS fuzz SKIP_RETURN_CODE 77 TIMEOUT 900
  FIXTURES_SETUP fuzz_targets ENVIRONMENT ${FLOTILLA_FUZZ_ENV} PROCESSORS 4)
add_test(NAME fuzz_run COMMAND ${FLOTILLA_FUZZ_RUNNER} --all 6 ${FLOTILLA_FUZZ_RESULTS})
# The timeout only guards against a hang: eleven runs of 6 s, two at a time, plus start-up.
set_tests_properties(fuzz_run PROPERTIES LABELS fuzz SKIP_RETURN_CODE 77 TIMEOUT 600
  FIXTURES_REQUIRED fuzz_targets FIXTURES_SETUP fuzz_results ENVIRONMENT ${FLOTILLA_FUZZ_ENV}
  PROCESSORS 3 COST 45)
foreach(target tf_config slurm idx tfrecord csv manifest pointer wire safetensors cache image)
  add_test(NAME fuzz_${target}
    COMMAND ${FLOTILLA_FUZZ_RUNNER} --report ${target} ${FLOTILLA_FUZZ_RESULTS})
  set_tests_properties(fuzz_${target} PROPERTIES LABELS fuzz SKIP_RETURN_CODE 77 TIMEOUT 60
    FIXTURES_REQUIRED fuzz_results)
endforeach()
