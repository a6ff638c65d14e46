"""Bad inputs get clear errors; odd but valid inputs behave like tf.gradients."""

import logging

import numpy as np
import pytest
import tensorflow as tf

import memsave
from tests.builders import tanh_chain


def _chain_graph(n=6):
    c = tanh_chain(n, scale=0.3, square=False)
    return c.graph, c.loss, c.ws, c.hs


def test_eager_tensor_is_rejected():
    v = tf.Variable(1.0)
    with pytest.raises(TypeError, match="tf.function"):
        memsave.gradients(v * 2.0, [v])


def test_tensors_from_two_graphs():
    _, loss, _, _ = _chain_graph()
    _, _, other_ws, _ = _chain_graph()
    with pytest.raises(ValueError, match="not in the graph"):
        memsave.gradients(loss, other_ws, checkpoints="speed")


def test_empty_xs_or_ys_give_what_tf_gradients_gives():
    """A model with no trainable weights, or a loss of no terms, under
    memsave.patch: tf.gradients gives [] or a None (zeros) per x, not an error."""
    graph, loss, ws, _ = _chain_graph()
    with graph.as_default():
        assert memsave.gradients(loss, [], checkpoints="speed") == tf.gradients(loss, []) == []
        assert memsave.gradients([], ws) == [None] * len(ws)
        zeros = memsave.gradients([], ws[:1], unconnected_gradients="zero")
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            assert (sess.run(zeros[0]) == 0).all()
        assert memsave.plan(loss, []).kept == [] and memsave.plan([], ws).kept == []


def test_unknown_strategy():
    graph, loss, ws, _ = _chain_graph()
    with graph.as_default(), pytest.raises(ValueError, match="unknown checkpoints strategy 'fast'"):
        memsave.gradients(loss, ws, checkpoints="fast")


def test_checkpoint_that_is_not_a_tensor():
    graph, loss, ws, hs = _chain_graph()
    with graph.as_default(), pytest.raises(TypeError, match="checkpoints must be tf.Tensor"):
        memsave.gradients(loss, ws, checkpoints=[hs[2].op])


def test_ys_not_depending_on_xs_gives_none(caplog):
    graph, loss, ws, _ = _chain_graph()
    with graph.as_default():
        unrelated = tf.Variable(np.ones([3], np.float32))
        y = tf.reduce_sum(unrelated * 2.0)
        with caplog.at_level(logging.WARNING, logger="memsave"):
            grads = memsave.gradients(y, ws, checkpoints="memory")
    assert grads == [None] * len(ws)
    assert "none of the ys depends on the xs" in caplog.text


def test_checkpoints_off_the_path_are_reported(caplog):
    graph, loss, ws, hs = _chain_graph()
    with graph.as_default():
        side = tf.constant(np.ones([4, 8], np.float32)) * 3.0
        with caplog.at_level(logging.WARNING, logger="memsave"):
            memsave.gradients(loss, ws[3:], checkpoints=[side, hs[1], hs[4]])
    assert side.name in caplog.text
    # hs[1] is upstream of every x in ws[3:], so it is off the path too.
    assert hs[1].name in caplog.text
    assert hs[4].name not in caplog.text


def test_memory_without_bottleneck_names_alternatives():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.Variable(np.ones([64, 64], np.float32))
        # Two branches that only meet in a scalar: no large tensor cuts the graph.
        loss = tf.reduce_sum(tf.tanh(x)) + tf.reduce_sum(tf.sigmoid(x))
        with pytest.raises(memsave.NoBottleneckError, match="checkpoints='optimal'"):
            memsave.gradients(loss, [x], checkpoints="memory")


def test_rewrite_after_session_run_is_exact():
    """memsave only adds ops, so a Session that already ran the graph sees them."""
    graph, loss, ws, hs = _chain_graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(loss)
        plain = tf.gradients(loss, ws)
        ours = memsave.gradients(loss, ws, checkpoints=[hs[1], hs[3]])
        for a, b in zip(*sess.run([plain, ours])):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_calling_twice_on_one_graph():
    graph, loss, ws, hs = _chain_graph()
    with graph.as_default():
        plain = tf.gradients(loss, ws)
        first = memsave.gradients(loss, ws, checkpoints=[hs[2]])
        second = memsave.gradients(loss, ws, checkpoints=[hs[1], hs[4]])
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b, c = sess.run([plain, first, second])
    for p, q, r in zip(a, b, c):
        np.testing.assert_allclose(p, q, atol=1e-6)
        np.testing.assert_allclose(p, r, atol=1e-6)


def test_forward_ops_are_untouched():
    graph, loss, ws, hs = _chain_graph()
    with graph.as_default():
        before = {op.name: (op.node_def.SerializeToString(), [t.name for t in op.inputs],
                            [c.name for c in op.control_inputs]) for op in graph.get_operations()}
        memsave.gradients(loss, ws, checkpoints=[hs[1], hs[3]])
        after = {op.name: (op.node_def.SerializeToString(), [t.name for t in op.inputs],
                           [c.name for c in op.control_inputs])
                 for op in graph.get_operations() if op.name in before}
    assert after == before
