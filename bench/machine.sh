#!/usr/bin/env bash
# The machine a benchmark ran on, as a JSON object for its lines: the CPU model, the vector
# extensions that decide which kernels LibTorch's and TF's oneDNN pick (AVX2, AVX-512, its BF16
# and VNNI forms, AMX), and the cores. Ratios between stacks depend on these: a CNN that is
# 1.4x TF on one CPU can be 0.65x on another.
# Usage: bench/machine.sh  ->  {"cpu":"AMD EPYC 9R14","isa":"avx2,avx512f,avx512_bf16","cores":2}
#        bench/machine.sh --tag  copies standard input to standard output, adding "machine" to
#        every JSON object line that lacks it (the bench scripts pipe themselves through it).
set -euo pipefail
cpu=$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo | sed 's/  */ /g; s/"//g')
flags=" $(awk -F': ' '/^flags/ {print $2; exit}' /proc/cpuinfo) "
isa=""
for f in avx2 avx512f avx512_bf16 avx512_vnni avx512_fp16 amx_bf16 amx_int8; do
  case "$flags" in *" $f "*) isa+="${isa:+,}$f" ;; esac
done
machine=$(printf '{"cpu":"%s","isa":"%s","cores":%d}' "${cpu:-unknown}" "$isa" "$(nproc)")
if [ "${1:-}" = --tag ]; then
  exec python3 -u -c '
import json, sys
machine = json.loads(sys.argv[1])
for line in sys.stdin:
    try:
        o = json.loads(line)
    except ValueError:
        o = None
    if isinstance(o, dict) and "machine" not in o:
        o["machine"] = machine
        line = json.dumps(o, separators=(",", ":")) + "\n"
    sys.stdout.write(line)
' "$machine"
fi
echo "$machine"
