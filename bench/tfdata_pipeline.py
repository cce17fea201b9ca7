"""tf.data's side of `make bench-data`: the same pipeline as bench/data_pipeline.cpp.

Usage: python tfdata_pipeline.py [element|batch] [epochs] [data_dir]
       python tfdata_pipeline.py folder epochs class_folder_dir size
  folder: keras.utils.image_dataset_from_directory(grayscale, size x size, batch 256, shuffled)
          -> map(normalize, AUTOTUNE) -> prefetch(AUTOTUNE)
Prints one JSON line: elements per second over `epochs` passes, after one untimed pass.
"""
import gzip
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

order = sys.argv[1] if len(sys.argv) > 1 else "element"
epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
data_dir = sys.argv[3] if len(sys.argv) > 3 else "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530
AUTOTUNE = tf.data.AUTOTUNE


def read_idx(name):
    with gzip.open(os.path.join(data_dir, name), "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def normalize(x):
    return (tf.cast(x, tf.float32) / 255.0 - MEAN) / STD


def preprocess(x):
    # Works on one image [28, 28, 1] or a batch [N, 28, 28, 1].
    x = tf.image.random_flip_left_right(x)
    if len(x.shape) == 3:
        x = tf.image.random_crop(tf.pad(x, [[2, 2], [2, 2], [0, 0]]), [28, 28, 1])
    else:
        padded = tf.pad(x, [[0, 0], [2, 2], [2, 2], [0, 0]])
        x = tf.map_fn(lambda im: tf.image.random_crop(im, [28, 28, 1]), padded)
    return normalize(x)


if order == "folder":
    size = int(sys.argv[4]) if len(sys.argv) > 4 else 28
    ds = (tf.keras.utils.image_dataset_from_directory(
        data_dir, color_mode="grayscale", image_size=(size, size), batch_size=256, seed=7,
        verbose=False)
        .map(lambda x, y: (normalize(x), y), num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE))
    order = "folder %d" % size
elif order == "element":
    images = read_idx("train-images-idx3-ubyte.gz")[..., np.newaxis]  # [N, 28, 28, 1], TF's layout
    labels = read_idx("train-labels-idx1-ubyte.gz").astype(np.int64)
    source = tf.data.Dataset.from_tensor_slices((images, labels))
    ds = (source.map(lambda x, y: (preprocess(x), y), num_parallel_calls=AUTOTUNE)
          .shuffle(10000, seed=7).batch(256).prefetch(AUTOTUNE))
else:
    images = read_idx("train-images-idx3-ubyte.gz")[..., np.newaxis]
    labels = read_idx("train-labels-idx1-ubyte.gz").astype(np.int64)
    source = tf.data.Dataset.from_tensor_slices((images, labels))
    ds = (source.shuffle(10000, seed=7).batch(256)
          .map(lambda x, y: (preprocess(x), y), num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE))

elements, seconds, checksum = 0, 0.0, 0.0
for epoch in range(epochs + 1):
    start = time.perf_counter()
    n = 0
    for x, y in ds:
        n += int(y.shape[0])
        checksum += float(x[0, 14, 14, 0])
    if epoch == 0:
        continue
    seconds += time.perf_counter() - start
    elements += n
print(json.dumps({"bench": "data", "system": "tf.data", "pipeline": order, "metric": "elements_per_s",
                  "value": round(elements / seconds), "epochs": epochs, "tensorflow": tf.__version__}))
