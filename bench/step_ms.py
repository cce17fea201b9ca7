#!/usr/bin/env python3
"""The median step time of some training runs: each FILE is a run's --metrics-json, whose last
epoch line gives seconds / steps (the steady state). Prints it in milliseconds, one decimal
(--digits N: N decimals, for ratios of steps of a few ms).

Usage: bench/step_ms.py [--digits N] FILE [FILE ...]
"""
import json
import statistics
import sys

args = sys.argv[1:]
digits = 1
if args[:1] == ["--digits"]:
    digits, args = int(args[1]), args[2:]
values = []
for path in args:
    with open(path) as f:
        last = [json.loads(line) for line in f if '"epoch"' in line][-1]
    values.append(1000 * last["seconds"] / last["steps"])
print(round(statistics.median(values), digits))
