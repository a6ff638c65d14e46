"""A U-Net (4 down / 4 up levels, conv + skip concatenation) under each strategy.

Prints Markdown tables of measured peak memory (allocator peak above the
pre-step baseline, CPU) and step time relative to plain ``tf.gradients``,
for conv-BatchNorm-ReLU blocks (as most U-Nets are built) and for plain
conv-ReLU blocks.

    python examples/unet.py
"""

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)

import memsave  # noqa: E402
from memsave.profile import peak_memory, session_step  # noqa: E402

LEVELS, BATCH, SIZE, CHANNELS, CONVS = 4, 4, 64, 8, 2


def unet(rng, norm):
    """Forward pass; returns (loss, weights)."""
    weights = []

    def conv(h, cout, k=3):
        w = tf.Variable((rng.randn(k, k, h.shape[-1], cout) / np.sqrt(k * k * h.shape[-1]))
                        .astype(np.float32))
        weights.append(w)
        return tf.nn.conv2d(h, w, 1, "SAME")

    def block(h, cout):
        h = conv(h, cout)
        if norm:
            scale, offset = tf.Variable(tf.ones([cout])), tf.Variable(tf.zeros([cout]))
            weights.extend([scale, offset])
            h, _, _ = tf.compat.v1.nn.fused_batch_norm(h, scale, offset, is_training=True)
        return tf.nn.relu(h)

    h = tf.constant(rng.randn(BATCH, SIZE, SIZE, CHANNELS).astype(np.float32))
    skips = []
    for level in range(LEVELS):
        for _ in range(CONVS):
            h = block(h, CHANNELS * 2 ** (level + 1))
        skips.append(h)
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
    for skip in reversed(skips):
        h = tf.image.resize(h, skip.shape[1:3], method="nearest")
        h = tf.concat([h, skip], axis=-1)
        for _ in range(CONVS):
            h = block(h, skip.shape[-1])
    out = conv(h, 1, k=1)
    return tf.reduce_mean(tf.square(out)), weights


def measure(norm, strategy, **kwargs):
    graph = tf.Graph()
    with graph.as_default():
        loss, ws = unet(np.random.RandomState(0), norm)
        if strategy == "plain":
            grads = tf.gradients(loss, ws)
        else:
            grads = memsave.gradients(loss, ws, checkpoints=strategy, **kwargs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            step = session_step(sess, grads)
            peak = peak_memory(step)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
    return peak, statistics.median(times)


def table(norm):
    rows = []
    base_peak, base_time = measure(norm, "plain")
    rows.append(("plain tf.gradients", base_peak, base_time))
    for label, strategy, kwargs in [("'memory'", "memory", {}), ("'speed'", "speed", {}),
                                    ("'optimal'", "optimal", {}),
                                    ("'optimal', budget=0.5", "optimal", {"budget": 0.5}),
                                    ("'optimal', budget=0.7", "optimal", {"budget": 0.7})]:
        try:
            peak, seconds = measure(norm, strategy, **kwargs)
            rows.append((label, peak, seconds))
        except (memsave.NoBottleneckError, ValueError) as e:
            rows.append((label, None, "raises: " + str(e)))
    print("U-Net %d levels, %d %s blocks/level, batch %d, %dx%d, %d channels (CPU)" % (
        LEVELS, CONVS, "conv-BN-ReLU" if norm else "conv-ReLU", BATCH, SIZE, SIZE, CHANNELS))
    print()
    print("| method | peak MB | vs plain | step time vs plain |")
    print("|---|---|---|---|")
    for label, peak, seconds in rows:
        if peak is None:
            print("| %s | — | — | %s |" % (label, seconds))
        else:
            print("| %s | %.1f | %.0f%% | %.2f× |" % (
                label, peak / 2**20, 100.0 * peak / base_peak, seconds / base_time))
    print()


def main():
    for norm in (True, False):
        table(norm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
