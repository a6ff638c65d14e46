"""Scale: a 2,000-layer chain plans and rewrites with 'memory' without recursion errors.

Tensors are tiny ([2, 4] activations, [4, 4] weights) so the test measures
graph work, not arithmetic. The graph ends up with well over 20,000 ops
(forward, plain gradients and memsave's copies and gradients). The
recursion limit is left at Python's default, so any recursive walk over the
chain (depth 2,000 > 1,000) would fail here. Timings are printed (run
pytest with -s to see them).
"""

import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import memsave

DEPTH = 2000
LIMIT_SECONDS = 120.0   # make test runs two workers on CI's 2 cores


def _chain(depth):
    rng = np.random.RandomState(0)
    ws = [tf.Variable((rng.randn(4, 4) * 0.5).astype(np.float32), name="w%d" % i)
          for i in range(depth)]
    h = tf.constant(rng.randn(2, 4).astype(np.float32))
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
    return ws, tf.reduce_sum(h * h)


@pytest.mark.heavy
def test_2000_layer_chain_memory():
    limit = sys.getrecursionlimit()
    graph = tf.Graph()
    with graph.as_default():
        ws, loss = _chain(DEPTH)
        forward_ops = len(graph.get_operations())

        start = time.perf_counter()
        plan = memsave.plan(loss, ws, checkpoints="memory", min_checkpoint_size=0)
        plan_seconds = time.perf_counter() - start

        start = time.perf_counter()
        ours = memsave.gradients(loss, ws, checkpoints="memory", min_checkpoint_size=0)
        gradients_seconds = time.perf_counter() - start
        memsave_ops = len(graph.get_operations()) - forward_ops

        start = time.perf_counter()
        plain = tf.gradients(loss, ws)
        plain_seconds = time.perf_counter() - start
        total_ops = len(graph.get_operations())

        print("\n%d-layer chain: %d forward ops, %d added by memsave, %d in all; "
              "%d checkpoints\n  memsave.plan %.1f s, memsave.gradients (plan + rewrite) "
              "%.1f s; plain tf.gradients %.1f s"
              % (DEPTH, forward_ops, memsave_ops, total_ops, len(plan.checkpoints),
                 plan_seconds, gradients_seconds, plain_seconds))

        assert sys.getrecursionlimit() == limit, "memsave changed the recursion limit"
        assert total_ops >= 20000, total_ops
        # About sqrt(2n) checkpoints on a uniform chain; certainly neither none nor all.
        assert 10 <= len(plan.checkpoints) <= 400, len(plan.checkpoints)
        assert all(g is not None for g in ours)

        # Grappler spends ~15 s optimizing a 34k-node graph on the first run;
        # the value check does not need it.
        config = tf.compat.v1.ConfigProto()
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b = sess.run([plain, ours])
    for p, q in zip(a, b):
        assert np.all(np.abs(p - q) <= 1e-5 * np.maximum(1.0, np.abs(p)))
    assert gradients_seconds < LIMIT_SECONDS, (
        "plan + rewrite took %.1f s (> %.0f s)" % (gradients_seconds, LIMIT_SECONDS))
