#!/usr/bin/env python3
"""The median step time of some training runs: each FILE is a run's --metrics-json, whose last
epoch line gives seconds / steps (the steady state). Prints it in milliseconds, one decimal.

Usage: bench/step_ms.py FILE [FILE ...]
"""
import json
import statistics
import sys

values = []
for path in sys.argv[1:]:
    with open(path) as f:
        last = [json.loads(line) for line in f if '"epoch"' in line][-1]
    values.append(1000 * last["seconds"] / last["steps"])
print(round(statistics.median(values), 1))
