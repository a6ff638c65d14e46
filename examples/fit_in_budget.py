"""Train in the memory you have: plain Keras fails under a memory limit, memsave fits it.

TensorFlow's CPU allocator can be capped like a full GPU
(``TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=N``: past N MiB
an allocation fails with ``ResourceExhaustedError``). Each run below is a
fresh process under the same cap: plain ``model.fit``, then the same model
with ``memsave.keras.enable(model, budget=...)``. The cap limits the
allocator's pool and the budget the bytes the step has in use (memsave
measures the step and replans once to come close to it), so the budget is
three quarters of the cap: BFC's fragmentation takes the rest.
A last run, plain and uncapped, gives the loss memsave must reproduce.

    python examples/fit_in_budget.py
    python examples/fit_in_budget.py --limit 400 --budget 300MiB
"""

import argparse
import os
import subprocess
import sys

# A conv net whose activations, not its weights, fill the memory.
BATCH, SIZE, CHANNELS, LAYERS = 32, 64, 32, 12
LIMIT_MB, BUDGET = 240, "180MiB"


def build():
    import keras   # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    layers = [keras.Input((SIZE, SIZE, 3))]
    for _ in range(LAYERS):
        layers += [keras.layers.Conv2D(CHANNELS, 3, padding="same"),
                   keras.layers.BatchNormalization(), keras.layers.Activation("relu")]
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), jit_compile=False)
    return model


def train(budget):
    """One process: two epochs of one batch; prints the outcome."""
    import numpy as np   # pylint: disable=import-outside-toplevel
    import tensorflow as tf   # pylint: disable=import-outside-toplevel
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import memsave.keras   # pylint: disable=import-outside-toplevel
    model = build()
    if budget:
        memsave.keras.enable(model, budget=budget)
    rng = np.random.RandomState(0)
    x = rng.randn(BATCH, SIZE, SIZE, 3).astype("float32")
    y = rng.randint(0, 10, BATCH)
    try:
        history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    except tf.errors.ResourceExhaustedError:
        print("OUT OF MEMORY")
        return
    print("trained, loss %.6f" % history.history["loss"][-1])


def run(limit_mb, budget):
    """The outcome of :func:`train` in a fresh process under ``limit_mb`` (None: no cap)."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
    if limit_mb is not None:
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(limit_mb)
    out = subprocess.run([sys.executable, __file__, "--child", budget or ""], env=env,
                         capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    if lines:
        return lines[-1]
    if out.returncode < 0:
        # Some kernels abort instead of raising when an allocation fails.
        return "OUT OF MEMORY (the process died: signal %d)" % -out.returncode
    return "failed (exit %d): %s" % (out.returncode, out.stderr.strip()[-300:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=LIMIT_MB, help="MiB the allocator may use")
    parser.add_argument("--budget", default=BUDGET, help="memsave's budget for the step")
    parser.add_argument("--child", help=argparse.SUPPRESS)   # the budget, '' for plain
    args = parser.parse_args()
    if args.child is not None:
        train(args.child or None)
        return
    print("%d x (Conv2D %d + BN + ReLU), batch %d at %dx%d, allocator capped at %d MiB"
          % (LAYERS, CHANNELS, BATCH, SIZE, SIZE, args.limit))
    print("| training | cap | outcome |\n|---|---|---|")
    print("| plain model.fit | %d MiB | %s |" % (args.limit, run(args.limit, None)))
    print("| memsave.keras.enable(model, budget=%r) | %d MiB | %s |" % (
        args.budget, args.limit, run(args.limit, args.budget)))
    print("| plain model.fit | none | %s |" % run(None, None))


if __name__ == "__main__":
    main()
