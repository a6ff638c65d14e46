"""Weight gradients run before input gradients in memsave's segments."""

import numpy as np
import tensorflow as tf

import memsave
from memsave.graph.schedule import reducers_first
from memsave.graph.walk import backward_ops


def _conv_net(graph):
    with graph.as_default():
        rng = np.random.RandomState(0)
        x = tf.constant(rng.randn(4, 32, 32, 16).astype(np.float32))     # 256 KiB
        ws = [tf.Variable(rng.randn(3, 3, 16, 16).astype(np.float32) * 0.1) for _ in range(4)]
        h = x
        for w in ws:
            h = tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME"))
        return tf.reduce_sum(h * h), ws


def _pairs(graph, kind_reducer, kind_big):
    """(reducer, big) op pairs sharing a *_grad scope."""
    scopes = {}
    for op in graph.get_operations():
        scope, _, _ = op.name.rpartition("/")
        if scope.endswith("_grad"):
            scopes.setdefault(scope, []).append(op)
    pairs = []
    for ops in scopes.values():
        reducers = [op for op in ops if op.type == kind_reducer]
        bigs = [op for op in ops if op.type == kind_big]
        pairs += [(r, b) for r in reducers for b in bigs]
    return pairs


def test_filter_gradient_runs_before_input_gradient():
    graph = tf.Graph()
    loss, ws = _conv_net(graph)
    with graph.as_default():
        grads = memsave.gradients(loss, ws, checkpoints="optimal", min_checkpoint_size=0)
    # The input gradients that run: the first convolution's (of a constant
    # input) is built by tf.gradients but nothing reads it.
    runs = backward_ops(grads, control=True)
    pairs = [(r, b) for r, b in _pairs(graph, "Conv2DBackpropFilter", "Conv2DBackpropInput")
             if ("memsave" in r.name or "gradients" in r.name) and b in runs]
    assert len(pairs) >= 3
    for reducer, big in pairs:
        assert reducer in big.control_inputs, (reducer.name, big.name)
    # The edges leave the values alone.
    with graph.as_default():
        plain = tf.gradients(loss, ws)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        a, b = sess.run([plain, grads])
    for p, q in zip(a, b):
        assert np.max(np.abs(p - q)) <= 1e-6 * max(1.0, np.max(np.abs(p)))


def test_matmul_weight_gradient_first_and_small_tensors_left_alone():
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(1)
        big = tf.constant(rng.randn(1024, 64).astype(np.float32))       # 256 KiB
        small = tf.constant(rng.randn(8, 64).astype(np.float32))        # 2 KiB
        w = tf.constant(rng.randn(64, 64).astype(np.float32))
        before = len(graph.get_operations())
        tf.gradients([tf.reduce_sum(tf.matmul(big, w)), tf.reduce_sum(tf.matmul(small, w))],
                     [big, w, small])
        new = graph.get_operations()[before:]
        edges = reducers_first(new)
    # Only the large activation's weight gradient gets an edge.
    assert edges == 1
    marked = [op for op in new if op.control_inputs]
    assert len(marked) == 1 and marked[0].type == "MatMul"
    reducer = marked[0].control_inputs[0]
    assert any(t is big for t in reducer.inputs)
    assert not any(t is big for t in marked[0].inputs)


def test_no_edge_when_it_would_make_a_cycle():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.ones((4096, 16), np.float32))                 # 256 KiB activation
        before = len(graph.get_operations())
        with tf.name_scope("f_grad"):
            big = tf.math.multiply(tf.ones((4096, 16)), 2.0, name="big")  # large, reads no x
            reducer = tf.matmul(x, big, transpose_a=True, name="reducer")  # 16x16, reads x, big
        new = graph.get_operations()[before:]
        edges = reducers_first(new)
    # Every large sibling feeds the reducer: any edge would be a cycle.
    assert edges == 0
    assert all(not op.control_inputs for op in new)
    assert reducer.op not in big.op.control_inputs
