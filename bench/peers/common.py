"""What both peer scripts share: the IDX reader and the training constants flotilla uses."""
import gzip
import os

import numpy as np

MEAN, STD = 0.2860, 0.3530
LR, MOMENTUM, SEED = 0.04, 0.9, 42


def read_idx(path):
    """An IDX file (gzip) as a numpy array of uint8."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def parse_args(argv):
    """MODEL GLOBAL_BATCH STEPS [THREADS] [DATA_DIR] -> (model, global_batch, steps, threads, dir)."""
    threads = int(argv[4]) if len(argv) > 4 else max(1, (os.cpu_count() or 2) // 2)
    data_dir = argv[5] if len(argv) > 5 else "/usr/share/datasets/fashion-mnist"
    return argv[1], int(argv[2]), int(argv[3]), threads, data_dir
