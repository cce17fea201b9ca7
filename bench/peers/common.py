"""What the peer scripts share: the IDX reader, the training constants flotilla uses, and the
PyTorch layers of flotilla's model zoo (for the DDP peer and bench/gpu/torch_peer.py)."""
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


def make_torch_model(name):
    """The same layers as flotilla's models/zoo.cpp, in PyTorch (imported here, not at the top:
    the TensorFlow peer shares this module)."""
    from torch import nn
    if name in ("mlp", "mlp-wide"):
        hidden = 256 if name == "mlp" else 2048
        return nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(),
                             nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(3136, 128), nn.ReLU(), nn.Linear(128, 10))
    raise SystemExit(f"unknown model {name!r}; use mlp, mlp-wide or cnn")
