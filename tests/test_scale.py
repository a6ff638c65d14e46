"""Scale: a 2,000-layer chain plans and rewrites with 'memory' without recursion errors.

Tensors are tiny ([2, 4] activations, [4, 4] weights) so the test measures
graph work, not arithmetic. The graph ends up with well over 20,000 ops
(forward, plain gradients and memsave's copies and gradients). The
recursion limit is left at Python's default, so any recursive walk over the
chain (depth 2,000 > 1,000) would fail here. Timings are printed (run
pytest with -s to see them).

The per-segment gradient calls each walk their own share of the graph, not
all of the forward pass after their checkpoints (a 120-layer chain), and
a segment's control edges grow with its copies plus the sums it waits
for, not with their product.
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


def test_each_segments_gradient_call_walks_only_its_own_ops(monkeypatch):
    """A segment's tf.gradients call walks forward from its xs (the weights
    and checkpoints it reads) through every op they reach, to keep those
    that are ancestors of its ys. The forward pass past the segment's
    checkpoints and what earlier segments made are no such ancestors: left
    out, the walks add up to a few times the graph, not segments x graph."""
    from memsave import tf_internal  # pylint: disable=import-outside-toplevel
    walked = []
    mark = tf_internal._mark_reached_ops  # pylint: disable=protected-access

    def counting(from_ops, reached_ops, func_graphs):
        before = len(reached_ops)
        mark(from_ops, reached_ops, func_graphs)
        walked.append(len(reached_ops) - before)

    monkeypatch.setattr(tf_internal, "_mark_reached_ops", counting)
    graph = tf.Graph()
    with graph.as_default():
        ws, loss = _chain(120)
        forward_ops = len(graph.get_operations())
        hs = [op.outputs[0] for op in graph.get_operations() if op.type == "Tanh"]
        ours = memsave.gradients(loss, ws, checkpoints=hs[9::10])
        plain = tf.gradients(loss, ws)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b = sess.run([plain, ours])
    # One call per segment: 12 checkpoints, the last one the chain's end.
    assert len(walked) == 13, walked
    # Each call walks about its segment's share of the forward pass (its
    # originals, copies and weight reads), however far it is from the end.
    # Walking to the end of the forward pass, the calls took 93 up to 312
    # ops here, 2,540 in all.
    share = forward_ops / 12
    assert max(walked) <= 2 * share, (walked, forward_ops)
    assert sum(walked) <= 1.5 * forward_ops, (walked, forward_ops)
    scale = max(np.abs(p).max() for p in a)
    assert all(np.abs(p - q).max() <= 1e-5 * scale for p, q in zip(a, b))


def test_walks_skip_earlier_segments_through_calls_and_conds(monkeypatch):
    """A function call's or a cond's gradient adds outputs to the forward op,
    never inputs, so an op's inputs still exist before it and the walks skip
    what earlier segments made there too (a while loop's gradient adds
    inputs: its regions walk everything). Every segment's pending counts are
    TensorFlow's own, walked in full."""
    from tensorflow.python.ops import gradients_util  # pylint: disable=C0415
    from memsave import tf_internal  # pylint: disable=import-outside-toplevel
    tf_walk = tf_internal.mark_reached_ops
    pending_count = gradients_util._PendingCount  # pylint: disable=protected-access
    calls = []

    def both(to_ops, from_ops, colocate, func_graphs, xs_set):
        skip = getattr(tf_internal._local_skip, "skip", None)  # pylint: disable=W0212
        ours = gradients_util._MarkReachedOps  # pylint: disable=protected-access
        monkeypatch.setattr(gradients_util, "_MarkReachedOps", tf_walk)
        full = pending_count(to_ops, from_ops, colocate, func_graphs, xs_set)
        monkeypatch.setattr(gradients_util, "_MarkReachedOps", ours)
        tf_internal._local_skip.skip = skip  # pylint: disable=protected-access
        skipped = pending_count(to_ops, from_ops, colocate, func_graphs, xs_set)
        calls.append((skip is not None, full[0] == skipped[0],
                      dict(full[1]) == dict(skipped[1])))
        return skipped

    monkeypatch.setattr(gradients_util, "_PendingCount", both)
    rng = np.random.RandomState(0)

    @tf.function
    def layer(h, w):
        return tf.tanh(tf.matmul(h, w))

    graph = tf.Graph()
    with graph.as_default():
        ws = [tf.Variable((rng.randn(4, 4) * 0.5).astype(np.float32)) for _ in range(24)]
        h, hs = tf.constant(rng.randn(2, 4).astype(np.float32)), []
        for i, w in enumerate(ws):
            h = layer(h, w)
            if i % 6 == 5:
                h = tf.cond(tf.reduce_sum(h) > -100.0, lambda h=h: h * 1.5, lambda h=h: h)
            hs.append(h)
        loss = tf.reduce_sum(h * h)
        kinds = {op.type for op in graph.get_operations()}
        ours = memsave.gradients(loss, ws, checkpoints=hs[3::4])
        plain = tf.gradients(loss, ws)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b = sess.run([plain, ours])
    assert {"StatefulPartitionedCall", "StatelessIf"} <= kinds, kinds
    assert sum(skipped for skipped, _, _ in calls) >= 3, calls
    assert all(same_ys and same_counts for _, same_ys, same_counts in calls), calls
    scale = max(np.abs(p).max() for p in a)
    assert all(np.abs(p - q).max() <= 1e-5 * scale for p, q in zip(a, b))


def test_first_copies_wait_through_one_op_per_segment():
    """A segment's copies that read no other copy wait for every running sum
    the segment before changed. Here each layer scales by a reshaped weight
    (as Keras's batch norm does), so a segment of 10 layers has 11 such
    copies and waits for about 21 sums: about 230 control edges, where one
    NoOp in between makes it 11 + 21, in the same order."""
    rng = np.random.RandomState(0)
    graph = tf.Graph()
    with graph.as_default():
        ws = [tf.Variable((rng.randn(4, 4) * 0.5).astype(np.float32)) for _ in range(60)]
        gs = [tf.Variable((1 + 0.1 * rng.randn(4)).astype(np.float32)) for _ in range(60)]
        h = tf.constant(rng.randn(2, 4).astype(np.float32))
        for w, g in zip(ws, gs):
            h = tf.tanh(tf.matmul(h, w) * tf.reshape(g, [1, 4]))
        loss = tf.reduce_sum(h * h)
        hs = [op.outputs[0] for op in graph.get_operations() if op.type == "Tanh"]
        before = len(graph.get_operations())
        ours = memsave.gradients(loss, ws + gs, checkpoints=hs[9::10])
        made = [op for op in graph.get_operations()[before:]
                if op.name.startswith("memsave_") and "/gradients" not in op.name]
        plain = tf.gradients(loss, ws + gs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b = sess.run([plain, ours])
    joins = [op for op in made if op.type == "NoOp"]
    assert len(joins) >= 4, [op.name for op in made if op.control_inputs]
    assert all(len(op.control_inputs) <= 1 for op in made if op.type != "NoOp")
    edges = sum(len(op.control_inputs) for op in made)
    assert edges <= 400, edges   # 172 here; each copy waiting for each sum: 1,167
    scale = max(np.abs(p).max() for p in a)
    assert all(np.abs(p - q).max() <= 1e-5 * scale for p, q in zip(a, b))


def _normalized_chain(depth, batch=256, width=32):
    """Dense layers with a batch norm's arithmetic (float64): ``z = h @ w``,
    ``h' = tanh((z - mean(z)) * rsqrt(var(z) + eps))``, whose per-channel
    statistics are 1/256 of a feature map. Returns the weights, the loss and
    its tensors by kind."""
    rng = np.random.RandomState(0)
    ws = [tf.Variable(rng.randn(width, width) * 0.3) for _ in range(depth)]
    h = tf.constant(rng.randn(batch, width))
    kinds = {key: [] for key in ("z", "mean", "centered", "square", "var", "shifted",
                                 "scale", "normed", "h")}
    for w in ws:
        z = tf.matmul(h, w)
        mean = tf.reduce_mean(z, axis=0)
        centered = z - mean
        square = tf.square(centered)
        var = tf.reduce_mean(square, axis=0)
        shifted = var + 1e-3
        scale = tf.math.rsqrt(shifted)
        normed = centered * scale
        h = tf.tanh(normed)
        for key, t in (("z", z), ("mean", mean), ("centered", centered), ("square", square),
                       ("var", var), ("shifted", shifted), ("scale", scale),
                       ("normed", normed), ("h", h)):
            kinds[key].append(t)
    return ws, tf.reduce_sum(h * h), kinds


def _gradient_calls(monkeypatch):
    from memsave import rewrite  # pylint: disable=import-outside-toplevel
    calls = []
    plain_gradients = rewrite.plain_gradients

    def counting(*args, **kwargs):
        calls.append(1)
        return plain_gradients(*args, **kwargs)

    monkeypatch.setattr(rewrite, "plain_gradients", counting)
    return calls


def _against_plain(graph, loss, ws, checkpoints):
    with graph.as_default():
        ours = memsave.gradients(loss, ws, checkpoints=checkpoints)
        plain = tf.gradients(loss, ws)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b = sess.run([plain, ours])
    scale = max(np.abs(p).max() for p in a)
    return max(np.abs(p - q).max() for p, q in zip(a, b)) / scale


@pytest.mark.parametrize("kept, calls", [
    # Everything kept: no segment recomputes anything, and all 72 levels
    # below the top share one call.
    (("z", "mean", "centered", "square", "var", "shifted", "scale", "normed", "h"), 2),
    # Each layer's per-channel scale recomputed (a 256th of a feature map):
    # in a shared call it reads the copy of 'variance + epsilon' below it,
    # which then runs too (small, from small tensors), and that copy the
    # variance's, a reduction of a feature map: there each call ends. One
    # call per layer, the top one and the last layer's remainder.
    (("z", "mean", "centered", "square", "var", "normed", "h"), 10),
    # 'centered' recomputed (a feature map) where 'normed' and 'square' are
    # differentiated: each starts a call; the mean, which the copy of
    # 'centered' reads, starts a third per layer. With the top call and the
    # last layer's tanh alone: 26, against 56 levels.
    (("z", "mean", "var", "shifted", "scale", "normed", "h"), 26),
])
def test_segments_that_recompute_nothing_big_share_a_gradient_call(monkeypatch, kept, calls):
    """Levels of checkpoints whose segments only differentiate kept ops (and
    recompute at most per-channel vectors) share a tf.gradients call with
    the level before: the same gradients for a fraction of the build time.
    A level that recomputes a feature map only starts a call, so that its
    recomputation waits for the gradients of the levels above, as with one
    call per level. The audit checks each shared call against plain
    backprop; the values match to float64's rounding."""
    made = _gradient_calls(monkeypatch)
    graph = tf.Graph()
    with graph.as_default():
        ws, loss, kinds = _normalized_chain(8)
        checkpoints = [t for key in kept for t in kinds[key]]
    error = _against_plain(graph, loss, ws, checkpoints)
    assert len(made) == calls, len(made)
    assert error <= 1e-12, error
