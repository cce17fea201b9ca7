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

Settings (bench/peers.sh runs TF at flotilla's precision, as a Keras user writes it by default
and with XLA, TF's own compiler, where it runs):
  PRECISION  float32, or mixed_bfloat16: Keras' mixed-precision policy of that name (bfloat16
             compute, float32 variables), the logits in float32 as Keras' guide does it
  XLA        off, or on: model.compile(jit_compile=True)
  ORDER      relu-pool (the CNN as usually written: Conv2D(activation="relu"), then max-pool),
             or pool-relu (the ReLU after the max-pool; see make_model)
Keras layers are NHWC (channels-last) only on the CPU.

Started once per worker by bench/peers.sh, with TF_CONFIG in the environment.
Usage: python tf_mwms_train.py MODEL GLOBAL_BATCH STEPS [THREADS] [DATA_DIR] [PRECISION] [XLA]
       [ORDER]
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


def make_model(name, pool_first=False):
    """The same layers as flotilla's models/zoo.cpp, channels-last. pool_first: the CNN's
    convolutions without their ReLU, which follows the max-pool (common.make_torch_model)."""
    layers = keras.layers
    if name == "resnet20":
        return make_resnet((16, 32, 64), blocks=3)
    if name == "resnet18":
        return make_resnet((64, 128, 256, 512), blocks=2)
    if name == "vit-tiny":
        return make_vit()
    if name in ("mlp", "mlp-wide"):
        hidden = 256 if name == "mlp" else 2048
        body = [layers.Flatten(), layers.Dense(hidden, activation="relu"),
                layers.Dense(hidden, activation="relu"), layers.Dense(10)]
    elif name == "cnn":
        def conv_relu_pool(filters):
            if pool_first:
                return [layers.Conv2D(filters, 3, padding="same"), layers.MaxPooling2D(2),
                        layers.ReLU()]
            return [layers.Conv2D(filters, 3, padding="same", activation="relu"),
                    layers.MaxPooling2D(2)]
        body = conv_relu_pool(32) + conv_relu_pool(64) + [
            layers.Flatten(), layers.Dense(128, activation="relu"), layers.Dense(10)]
    else:
        raise SystemExit(
            f"unknown model {name!r}; use mlp, mlp-wide, cnn, resnet20, resnet18 or vit-tiny")
    return keras.Sequential([keras.Input((28, 28, 1))] + body)


def make_resnet(widths, blocks):
    """common.py's _torch_resnet in Keras: the same convolutions, BatchNorms (momentum 0.9 here
    is torch's 0.1) and projection shortcuts. Padding "same": for the stride-2 3x3 convolutions
    on an even size (28 -> 14, 14 -> 7) TF pads 0 before and 1 after where torch pads 1 and 1:
    the same shapes and work, fine for a throughput twin, not for comparing activations."""
    layers = keras.layers

    def conv_bn(x, filters, kernel, stride):
        x = layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False)(x)
        return layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)

    inputs = keras.Input((28, 28, 1))
    x = layers.ReLU()(conv_bn(inputs, widths[0], 3, 1))
    for stage, width in enumerate(widths):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            body = conv_bn(layers.ReLU()(conv_bn(x, width, 3, stride)), width, 3, 1)
            shortcut = x if stride == 1 and x.shape[-1] == width else conv_bn(x, width, 1, stride)
            x = layers.ReLU()(layers.Add()([body, shortcut]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x))


class ClassTokenAndPosition(keras.layers.Layer):
    """Prepends a learned class token (zeros at first) to [N, T, D] tokens and adds a learned
    position embedding (normal, std 0.02) to the T + 1: Keras has no layer for either."""

    def build(self, input_shape):
        _, tokens, width = input_shape
        self.cls_token = self.add_weight(name="cls_token", shape=(1, 1, width),
                                         initializer="zeros")
        self.position = self.add_weight(
            name="position", shape=(1, tokens + 1, width),
            initializer=keras.initializers.RandomNormal(stddev=0.02))
        super().build(input_shape)

    def call(self, x):
        cls = tf.broadcast_to(self.cls_token, [tf.shape(x)[0], 1, x.shape[-1]])
        return tf.concat([cls, x], axis=1) + self.position


def make_vit(width=192, depth=6, heads=3, mlp=768, patch=4, dropout=0.1):
    """common.py's _torch_vit in Keras: the same patches, class token, pre-norm blocks (no
    dropout inside the attention) and head; exact GELU; LayerNorm epsilon 1e-6 (set: Keras'
    default is 1e-3)."""
    layers = keras.layers
    inputs = keras.Input((28, 28, 1))
    x = layers.Conv2D(width, patch, strides=patch)(inputs)  # [N, 7, 7, width]
    x = layers.Reshape(((28 // patch) ** 2, width))(x)
    x = layers.Dropout(dropout)(ClassTokenAndPosition()(x))
    for _ in range(depth):
        h = layers.LayerNormalization(epsilon=1e-6)(x)
        h = layers.MultiHeadAttention(num_heads=heads, key_dim=width // heads)(h, h)
        x = layers.Add()([x, layers.Dropout(dropout)(h)])
        h = layers.LayerNormalization(epsilon=1e-6)(x)
        h = layers.Dense(mlp, activation=keras.activations.gelu)(h)  # approximate=False
        h = layers.Dense(width)(layers.Dropout(dropout)(h))
        x = layers.Add()([x, layers.Dropout(dropout)(h)])
    x = layers.LayerNormalization(epsilon=1e-6)(x)
    return keras.Model(inputs, layers.Dense(10)(x[:, 0]))


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
    precision = sys.argv[6] if len(sys.argv) > 6 else "float32"
    xla = (sys.argv[7] if len(sys.argv) > 7 else "off") == "on"
    order = sys.argv[8] if len(sys.argv) > 8 else "relu-pool"
    if precision not in ("float32", "mixed_bfloat16") or order not in ("relu-pool", "pool-relu"):
        raise SystemExit(f"bad settings {precision} {order}")
    keras.mixed_precision.set_global_policy(precision)
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
        model = make_model(model_name, pool_first=order == "pool-relu")
        if precision != "float32":  # the loss on float32 logits, as Keras' guide does it
            model = keras.Model(model.inputs,
                                keras.layers.Activation("linear", dtype="float32")(model.output))
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=xla)

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
            "version": tf.__version__, "keras": keras.__version__, "precision": precision,
            "memory_format": "channels_last", "xla": xla, "relu_pool_order": order,
        }), flush=True)


if __name__ == "__main__":
    main()
