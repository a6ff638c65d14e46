"""Train a deep Keras MLP with and without memsave and compare peak memory.

    python examples/keras_fit.py [--layers 64] [--width 256] [--batch 1024]

Both runs start from the same weights and data. For each, the script trains
a few steps with model.fit, then measures the peak memory of one more train
step with memsave.profile.peak_memory, and prints a Markdown table.

The optimizer is plain SGD. With momentum, TensorFlow computes
``momentum * m`` for every layer as soon as the step starts (it does not
depend on the gradient), which keeps weight-sized temporaries alive through
the whole step in both runs; checkpointing cannot remove those
(``--optimizer momentum`` shows it).
"""

import argparse
import os
import time

# The meter needs TensorFlow's BFC allocator on CPU, and one inter-op thread
# makes the schedule (and so the peak) repeatable. Both must be set before
# TensorFlow runs its first op.
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import memsave.keras  # noqa: E402
from memsave.profile import peak_memory  # noqa: E402

MB = 2 ** 20


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.01),
    "momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-4),
}


def build(layers, width, optimizer, classes=10):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="tanh") for _ in range(layers)]
        + [keras.layers.Dense(classes)])
    model.compile(optimizer=OPTIMIZERS[optimizer](),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model


def run(args, use_memsave, x, y):
    model = build(args.layers, args.width, args.optimizer)
    if use_memsave:
        memsave.keras.enable(model, args.strategy)
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
    fit_seconds = time.perf_counter() - start
    batch = (x[:args.batch], y[:args.batch])
    peak = peak_memory(lambda: model.train_on_batch(*batch))   # one warm-up step, then measured
    times = []
    for _ in range(3):
        start = time.perf_counter()
        model.train_on_batch(*batch)
        times.append(time.perf_counter() - start)
    step_seconds = float(np.median(times))
    return {"peak": peak, "loss": history.history["loss"][-1], "step": step_seconds,
            "fit": fit_seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="training steps before measuring")
    parser.add_argument("--strategy", default="memory", choices=["memory", "speed"])
    parser.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS))
    args = parser.parse_args()

    rng = np.random.RandomState(0)
    x = rng.randn(args.steps * args.batch, args.width).astype("float32")
    y = rng.randint(0, 10, len(x))

    plain = run(args, False, x, y)
    ours = run(args, True, x, y)

    activation = args.batch * args.width * 4 / MB
    print("%d x Dense(%d), batch %d, float32 (one activation = %.1f MB), optimizer %s, "
          "%d fit steps, then one measured train step\n"
          % (args.layers, args.width, args.batch, activation, args.optimizer, args.steps))
    print("| gradients | peak memory of one step | step time (median of 3) | loss after fit |")
    print("|---|---:|---:|---:|")
    for name, r in (("plain Keras", plain), ("memsave ('%s')" % args.strategy, ours)):
        print("| %s | %.1f MB | %.2f s | %.6f |" % (name, r["peak"] / MB, r["step"], r["loss"]))
    print("\npeak memory %.1fx lower with memsave; step %.2fx the time"
          % (plain["peak"] / ours["peak"], ours["step"] / plain["step"]))


if __name__ == "__main__":
    main()
