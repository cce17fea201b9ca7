"""Prints the scalars of a TensorBoard log directory as JSON, read by TensorBoard's own loader.

    python read_events.py LOGDIR

Output (one line on stdout):
    {"file_version": 2.0, "first_event_timestamp": 1700000000.0,
     "scalars": {"loss": [{"step": 0, "value": 0.5, "wall_time": 1700000000.25}, ...], ...}}

Values are TensorBoard's (float32 widened to float, so they compare exactly with a C++
static_cast<double>(static_cast<float>(x))); NaN and infinities, which JSON lacks, are printed
as the strings "nan", "inf" and "-inf". Every scalar is kept (no reservoir sampling).
"""

import json
import math
import sys

from tensorboard.backend.event_processing import event_accumulator


def number(x):
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: read_events.py LOGDIR")
    acc = event_accumulator.EventAccumulator(
        sys.argv[1], size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    scalars = {
        tag: [{"step": e.step, "value": number(e.value), "wall_time": e.wall_time}
              for e in acc.Scalars(tag)]
        for tag in acc.Tags()[event_accumulator.SCALARS]
    }
    try:
        first = acc.FirstEventTimestamp()
    except ValueError:  # no event at all
        first = None
    print(json.dumps({"file_version": acc.file_version, "first_event_timestamp": first,
                      "scalars": scalars}))


if __name__ == "__main__":
    main()
