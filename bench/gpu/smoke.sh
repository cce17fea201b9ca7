#!/usr/bin/env bash
# On a GPU machine: runs flotilla's binaries built on the CPU machine (carried in .device/)
# against that machine's own LibTorch (same 2.11 + CUDA 13 build), the gpu-labelled tests
# first, then the CPU suites. Writes logs to $OUT. The build-there path is issue 8's run.sh.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
torch_lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'; } 2>&1 | tee "$OUT/machine.txt"
cd .device
# The tests find the CLI at ../flotilla relative to themselves.
mkdir -p bin/tests && cp flotilla bin/ && cp *_tests collective_worker bin/tests/
rc=0
for suite in gpu_tests unit_tests multiworker_tests; do
  timeout 300 "bin/tests/$suite" --gtest_brief=1 >"$OUT/$suite.log" 2>&1 || rc=1
  tail -n 3 "$OUT/$suite.log"
done
exit $rc
