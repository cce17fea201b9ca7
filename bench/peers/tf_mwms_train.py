"""TF MultiWorkerMirroredStrategy's side of `make bench-peers`: one worker of Keras fit.

Trains the Keras equivalents of flotilla's zoo models (models/zoo.cpp; channels-last) on
Fashion-MNIST under tf.distribute.MultiWorkerMirroredStrategy, the cluster from TF_CONFIG.
Input: a tf.data Dataset of the arrays in memory, shuffle -> batch(global, drop_remainder)
-> repeat -> prefetch, auto-shard policy DATA. fit(epochs=2, steps_per_epoch=STEPS): epoch 1
warms up, a callback times epoch 2 between two all-reduce barriers; the chief (worker 0)
prints one JSON line with the global samples per second.

Keras is tf-keras (Keras 2, TF_USE_LEGACY_KERAS=1): Keras 3's fit (TF backend) fails under
MWMS: it strategy.reduce()s the first (x, y) batch to build the model, which MWMS can't, and
then all-reduces the scalar logs of each step along axis 0 (keras-team/keras#20585).

Started once per worker by bench/peers.sh, with TF_CONFIG in the environment.
Usage: python tf_mwms_train.py MODEL GLOBAL_BATCH STEPS [THREADS] [DATA_DIR]
"""
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras is Keras 2 (tf_keras), as below
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

from common import LR, MEAN, MOMENTUM, SEED, STD, parse_args, read_idx  # noqa: E402
SHUFFLE_BUFFER = 10000  # flotilla's default --shuffle-buffer


def make_model(name):
    """The same layers as flotilla's models/zoo.cpp, channels-last."""
    layers = keras.layers
    if name in ("mlp", "mlp-wide"):
        hidden = 256 if name == "mlp" else 2048
        body = [layers.Flatten(), layers.Dense(hidden, activation="relu"),
                layers.Dense(hidden, activation="relu"), layers.Dense(10)]
    elif name == "cnn":
        body = [layers.Conv2D(32, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
                layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
                layers.Flatten(), layers.Dense(128, activation="relu"), layers.Dense(10)]
    else:
        raise SystemExit(f"unknown model {name!r}; use mlp, mlp-wide or cnn")
    return keras.Sequential([keras.Input((28, 28, 1))] + body)


class EpochTimer(keras.callbacks.Callback):
    """Wall seconds of the last epoch, between barriers at its start and end."""

    def __init__(self, barrier):
        super().__init__()
        self.barrier = barrier
        self.start = self.seconds = None
        self.logs = {}

    def on_epoch_begin(self, epoch, logs=None):
        self.barrier()
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.barrier()
        self.seconds = time.perf_counter() - self.start
        self.logs = dict(logs or {})


def main():
    model_name, global_batch, steps, threads, data_dir = parse_args(sys.argv)
    # Before the strategy: that initialises the runtime, after which these can't change.
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    keras.utils.set_random_seed(SEED)

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task_index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    workers = strategy.num_replicas_in_sync

    images = read_idx(os.path.join(data_dir, "train-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(data_dir, "train-labels-idx1-ubyte.gz"))
    x = ((images.astype(np.float32) / 255.0 - MEAN) / STD)[..., np.newaxis]  # [N, 28, 28, 1]
    y = labels.astype(np.int64)

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = (tf.data.Dataset.from_tensor_slices((x, y))
               .shuffle(SHUFFLE_BUFFER, seed=SEED)  # same order on every worker, for DATA
               .batch(global_batch, drop_remainder=True)
               .repeat()
               .prefetch(tf.data.AUTOTUNE)
               .with_options(options))

    with strategy.scope():
        model = make_model(model_name)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    @tf.function
    def barrier():
        """One all-reduce of a scalar across the workers."""
        ctx = tf.distribute.get_replica_context
        return strategy.run(lambda: ctx().all_reduce(tf.distribute.ReduceOp.SUM, 1.0))

    timer = EpochTimer(barrier)
    model.fit(dataset, epochs=2, steps_per_epoch=steps, callbacks=[timer], verbose=0)

    if task_index == 0:
        print(json.dumps({
            "system": "tf-mwms", "model": model_name, "global_batch": global_batch,
            "workers": workers, "threads": threads, "steps": steps, "seconds": timer.seconds,
            "samples_per_s": steps * global_batch / timer.seconds,
            "loss": float(timer.logs.get("loss", float("nan"))),
            "accuracy": float(timer.logs.get("accuracy", float("nan"))),
            "version": tf.__version__, "keras": keras.__version__,
        }), flush=True)


if __name__ == "__main__":
    main()
