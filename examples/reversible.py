"""Reversible nets with memsave.reversible: a RevNet classifier and a small Glow flow.

    python examples/reversible.py [--blocks 32] [--steps 5]

Both models train a few steps on synthetic data with a Keras optimizer
inside ``tf.function``, then the script measures the peak memory of one
training step with reversible backprop (``seq(x)``) and with every
activation stored (``seq(x, store_activations=True)``, plain autodiff), on
the same weights.

* RevNet: ``Dense`` stem (not invertible, its activations are stored) ->
  ``--blocks`` ``ReversibleResidual`` blocks whose F and G are Keras
  ``Dense`` layers -> ``Dense`` head, softmax cross-entropy.
* Glow-like flow on ``[batch, 4, 4, 8]`` inputs: ``--blocks // 4`` steps of
  ``ActNorm -> Invertible1x1Conv -> AffineCoupling``, trained by negative
  log-likelihood under a standard normal prior (the log-determinant comes
  out of the sequence and is differentiated like any other output).
"""

import argparse
import math
import os
import time

# The meter needs TensorFlow's BFC allocator on CPU, and one inter-op thread
# makes the schedule (and so the peak) repeatable; both before TF starts.
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

from memsave import reversible as R  # noqa: E402
from memsave.profile import peak_memory  # noqa: E402

MB = 2 ** 20


def train_step(seq, loss_fn, x, y, optimizer, store):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            out, log_det = seq(x, store_activations=store)
            loss = loss_fn(out, log_det, y)
        variables = seq.trainable_variables
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss
    return step


def revnet(blocks, steps, batch=2048, width=128, classes=10):
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    centers = rng.randn(classes, 32).astype(np.float32) * 0.3
    labels = rng.randint(0, classes, batch)
    x = tf.constant(centers[labels] + rng.randn(batch, 32).astype(np.float32))
    y = tf.constant(labels)
    half = width // 2

    def dense(activation=None):
        return keras.layers.Dense(half, activation=activation,
                                  kernel_initializer=keras.initializers.RandomNormal(stddev=0.05))

    layers = [keras.layers.Dense(width)]
    layers += [R.ReversibleResidual(dense("tanh"), dense("tanh")) for _ in range(blocks)]
    layers += [keras.layers.Dense(classes)]
    seq = R.ReversibleSequence(layers)
    seq(x[:1])                                   # builds the Keras layers

    def loss_fn(logits, log_det, labels):
        del log_det                              # a classifier has no use for it
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    return seq, loss_fn, x, y


def glow(blocks, steps, batch=512, side=4, channels=8):
    keras.utils.set_random_seed(1)
    tf.random.set_seed(1)
    rng = np.random.RandomState(1)
    # Correlated Gaussian data with a non-zero mean: a flow can learn it.
    mix = (rng.randn(channels, channels) * 0.5 + np.eye(channels)).astype(np.float32)
    x = tf.constant(rng.randn(batch, side, side, channels).astype(np.float32) @ mix + 1.0)
    layers = []
    for i in range(max(1, blocks // 4)):
        f = keras.Sequential([
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(channels, kernel_initializer="zeros")])   # starts as identity
        layers += [R.ActNorm(channels), R.Invertible1x1Conv(channels, seed=i),
                   R.AffineCoupling(f, swap=i % 2 == 1)]
    seq = R.ReversibleSequence(layers)
    seq(x[:1])
    dims = side * side * channels

    def loss_fn(z, log_det, _):
        log_prior = -0.5 * tf.reduce_sum(z * z, axis=[1, 2, 3]) - 0.5 * dims * math.log(2 * math.pi)
        nll = -(log_prior + log_det)
        return tf.reduce_mean(nll) / (dims * math.log(2.0))     # bits per dimension

    return seq, loss_fn, x, tf.zeros([batch])


def run(name, build, blocks, steps, lr):
    seq, loss_fn, x, y = build(blocks, steps)
    optimizer = keras.optimizers.Adam(lr)
    step = train_step(seq, loss_fn, x, y, optimizer, store=False)
    start = time.perf_counter()
    losses = [float(step()) for _ in range(steps)]
    print("%s: %d trainable variables, losses %s (%.1f s)" % (
        name, len(seq.trainable_variables), " ".join("%.4f" % v for v in losses),
        time.perf_counter() - start))
    rev = peak_memory(step) / MB
    plain = peak_memory(train_step(seq, loss_fn, x, y, optimizer, store=True)) / MB
    print("%s: peak memory of one step: reversible %.1f MB, all activations stored %.1f MB "
          "(%.1fx)" % (name, rev, plain, plain / rev))
    return rev, plain


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    rows = [("RevNet, %d blocks" % args.blocks,) + run("revnet", revnet, args.blocks,
                                                        args.steps, 1e-3),
            ("Glow, %d steps" % max(1, args.blocks // 4),) + run("glow", glow, args.blocks,
                                                                  args.steps, 1e-2)]
    print()
    print("| model | reversible | stored | ratio |")
    print("|---|---:|---:|---:|")
    for name, rev, plain in rows:
        print("| %s | %.1f MB | %.1f MB | %.1fx |" % (name, rev, plain, plain / rev))


if __name__ == "__main__":
    main()
