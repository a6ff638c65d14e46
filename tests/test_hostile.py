"""Hostile inputs: a clear error naming the problem, or the documented behaviour.

Every error case asserts the exception type *and* a fragment of the message.
Valid-but-odd inputs are compared with plain ``tf.gradients`` in the same
Session run (``|a - b| <= 1e-5 * max(1, |a|)``, same None pattern). The
"no side effects" tests check that rewriting leaves every pre-existing op
(inputs, attributes, control inputs), the graph's collections and the
forward values exactly as they were. (That importing memsave patches
nothing is tests/test_patch.py::test_import_patches_nothing.)
"""

import logging
import sys

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.log import reset_warnings
from tests.builders import tanh_chain

RTOL = 1e-5


@pytest.fixture
def v1_control_flow():
    """TF1 control flow (``disable_control_flow_v2()``) for the test, as it was after."""
    was_v2 = tf.compat.v1.control_flow_v2_enabled()
    tf.compat.v1.disable_control_flow_v2()
    yield
    if was_v2:
        tf.compat.v1.enable_control_flow_v2()


def _chain(n=6, graph=None):
    c = tanh_chain(n, scale=0.4, graph=graph)
    return c.graph, c.x, c.ws, c.hs, c.loss


def _assert_equal_grads(sess, plain, ours, feed=None):
    assert [g is None for g in plain] == [g is None for g in ours], (
        "None pattern: plain %s, memsave %s" % ([g is None for g in plain],
                                                [g is None for g in ours]))
    pairs = [(tf.convert_to_tensor(a), tf.convert_to_tensor(b))
             for a, b in zip(plain, ours) if a is not None]
    assert pairs, "nothing to compare"
    for a, b in sess.run(pairs, feed_dict=feed):
        assert a.shape == b.shape
        assert np.all(np.abs(a - b) <= RTOL * np.maximum(1.0, np.abs(a))), float(
            np.max(np.abs(a - b)))


def _run_equal(graph, plain, ours, feed=None):
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _assert_equal_grads(sess, plain, ours, feed)


# ------------------------------------------------------------------ eager

def test_eager_ys_rejected():
    v = tf.Variable(1.0)
    with pytest.raises(TypeError, match="eager tensor in ys.*tf.function"):
        memsave.gradients(v * 2.0, [v])


def test_eager_x_with_graph_ys_rejected():
    graph, _, ws, _, loss = _chain()
    with pytest.raises(TypeError, match="eager tensor in xs"):
        memsave.gradients(loss, [tf.constant(1.0)], checkpoints="speed")


def test_eager_variable_as_x_of_a_session_graph():
    graph, _, _, _, loss = _chain()
    v = tf.Variable(np.ones((8, 8), np.float32))
    with pytest.raises(ValueError, match="belongs to another graph"):
        memsave.gradients(loss, [v], checkpoints="speed")


# ------------------------------------------------------------------ two graphs

def test_xs_from_another_graph():
    _, _, _, _, loss = _chain()
    _, _, other_ws, _, _ = _chain()
    with pytest.raises(ValueError, match="not in the graph of ys"):
        memsave.gradients(loss, other_ws, checkpoints="speed")


def test_ys_from_two_graphs():
    _, _, ws, _, loss = _chain()
    _, _, _, _, other_loss = _chain()
    with pytest.raises(ValueError, match="live in different graphs"):
        memsave.gradients([loss, other_loss], ws, checkpoints="speed")


def test_checkpoint_from_another_graph():
    _, _, ws, _, loss = _chain()
    _, _, _, other_hs, _ = _chain()
    with pytest.raises(ValueError, match="checkpoint .* is in another graph"):
        memsave.gradients(loss, ws, checkpoints=[other_hs[2]])


def test_eager_checkpoints_inside_tf_function(caplog):
    # An eager tensor the function captured stands for its placeholder there
    # (an input: not between xs and ys); one it never reads is reported too.
    rng = np.random.RandomState(0)
    ws = [tf.Variable(rng.randn(16, 16) * 0.4) for _ in range(8)]
    x = tf.constant(rng.randn(4, 16))
    unread = tf.constant(1.0)

    @tf.function
    def step():
        def loss_and_layers():
            h, hs = x, []
            for w in ws:
                h = tf.tanh(h @ w)
                hs.append(h)
            return tf.reduce_sum(h * h), hs
        loss, _ = loss_and_layers()
        plain = tf.gradients(loss, ws)
        loss, hs = loss_and_layers()
        ours = memsave.gradients(loss, ws, checkpoints=[x, unread, hs[3]], fallback=False)
        return plain, ours

    with caplog.at_level(logging.WARNING, logger="memsave"):
        plain, ours = step()
    assert "eager float32 tensor of shape ()" in caplog.text
    assert "checkpoint(s) are not between xs and ys" in caplog.text   # x's placeholder
    largest = max(float(np.abs(g).max()) for g in plain)
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain, ours)) <= 1e-12 * largest


def test_grad_ys_from_another_graph():
    _, _, ws, hs, loss = _chain()
    _, _, _, _, other_loss = _chain()
    with pytest.raises(ValueError, match="grad_ys for .* is in another graph"):
        memsave.gradients(loss, ws, grad_ys=[other_loss], checkpoints=[hs[2]])


def test_xs_from_a_foreign_graph_inside_tf_function():
    _, _, session_ws, _, _ = _chain()
    v = tf.Variable(np.ones((8, 8), np.float32))

    @tf.function
    def step():
        return memsave.gradients(tf.reduce_sum(v * 2.0), session_ws[:1], checkpoints="speed")

    with pytest.raises(ValueError, match="graph"):
        step()


# ------------------------------------------------------------------ bad arguments

@pytest.mark.parametrize("bad,match", [
    (np.ones(3), "xs must hold tf.Tensor or tf.Variable"),
    ("MatMul:0", "xs must hold tf.Tensor or tf.Variable"),
])
def test_xs_that_are_not_tensors(bad, match):
    graph, _, _, _, loss = _chain()
    with graph.as_default(), pytest.raises(TypeError, match=match):
        memsave.gradients(loss, [bad], checkpoints="speed")


def test_ys_not_a_tensor():
    graph, _, ws, _, _ = _chain()
    with graph.as_default(), pytest.raises(TypeError, match="ys must hold tensors"):
        memsave.gradients(object(), ws)


def test_ys_that_are_numbers_or_variables_convert_like_tf_gradients():
    """tf.gradients turns a number into a constant (unconnected) and reads a variable."""
    graph, _, ws, _, _ = _chain()
    with graph.as_default():
        assert memsave.gradients(np.ones(3), ws) == tf.gradients(np.ones(3), ws)
        assert memsave.gradients(3.0, ws) == [None] * len(ws)
        got = memsave.gradients(ws[0], ws, checkpoints="speed")
        want = tf.gradients(ws[0], ws)
        assert [g is None for g in got] == [g is None for g in want]


def test_grad_ys_length_mismatch():
    graph, _, ws, hs, loss = _chain()
    with graph.as_default(), pytest.raises(ValueError, match="2 grad_ys for 1 ys"):
        memsave.gradients(loss, ws, grad_ys=[1.0, 2.0], checkpoints=[hs[2]])


@pytest.mark.parametrize("bad", ["op", "variable", "string", "none"])
def test_checkpoint_that_is_not_a_tensor(bad):
    graph, _, ws, hs, loss = _chain()
    item = {"op": hs[2].op, "variable": ws[1], "string": hs[2].name, "none": None}[bad]
    with graph.as_default(), pytest.raises(TypeError, match="checkpoints must be tf.Tensor"):
        memsave.gradients(loss, ws, checkpoints=[hs[1], item])


@pytest.mark.parametrize("bad", [None, 3, {"memory"}])
def test_checkpoints_argument_of_the_wrong_type(bad):
    graph, _, ws, _, loss = _chain()
    with graph.as_default(), pytest.raises(TypeError, match="strategy name .* or a list of tensors"):
        memsave.gradients(loss, ws, checkpoints=bad)


@pytest.mark.parametrize("name", ["fast", "Memory", ""])
def test_unknown_strategy(name):
    graph, _, ws, _, loss = _chain()
    with graph.as_default(), pytest.raises(ValueError,
                                           match="unknown checkpoints strategy %r" % name):
        memsave.gradients(loss, ws, checkpoints=name)


def test_unknown_strategy_inside_tf_function():
    v = tf.Variable(np.ones((4, 4), np.float32))

    @tf.function
    def step():
        return memsave.gradients(tf.reduce_sum(tf.tanh(v)), [v], checkpoints="fast")

    with pytest.raises(ValueError, match="unknown checkpoints strategy 'fast'"):
        step()


def test_negative_min_checkpoint_size():
    graph, _, ws, _, loss = _chain()
    with graph.as_default(), pytest.raises(ValueError, match="min_checkpoint_size must be an int >= 0"):
        memsave.gradients(loss, ws, checkpoints="memory", min_checkpoint_size=-1)


@pytest.mark.parametrize("budget", [0, -1, -0.5])
def test_budget_not_positive(budget):
    graph, _, ws, _, loss = _chain()
    with graph.as_default(), pytest.raises(ValueError, match="budget must be > 0"):
        memsave.gradients(loss, ws, checkpoints="optimal", budget=budget)


def test_budget_needs_optimal():
    graph, _, ws, _, loss = _chain()
    with graph.as_default(), pytest.raises(ValueError, match="budget= needs checkpoints='optimal'"):
        memsave.gradients(loss, ws, checkpoints="memory", budget=0.5)


def test_unknown_keyword_is_named():
    graph, _, ws, hs, loss = _chain()
    with graph.as_default(), pytest.raises(TypeError, match="bogus_option"):
        memsave.gradients(loss, ws, checkpoints=[hs[2]], bogus_option=1)


# ------------------------------------------------------------------ documented behaviour

@pytest.mark.parametrize("strategy", ["memory", "speed", "list"])
def test_ys_not_depending_on_xs_gives_nones(strategy, caplog):
    graph, _, ws, hs, _ = _chain()
    with graph.as_default():
        unrelated = tf.reduce_sum(tf.constant(np.ones(3, np.float32)) * 2.0)
        cps = [hs[2]] if strategy == "list" else strategy
        assert tf.gradients(unrelated, ws) == [None] * len(ws)
        with caplog.at_level(logging.WARNING, logger="memsave"):
            grads = memsave.gradients(unrelated, ws, checkpoints=cps, min_checkpoint_size=0)
        assert grads == [None] * len(ws)
        assert "none of the ys depends on the xs" in caplog.text
        zeros = memsave.gradients(unrelated, ws, checkpoints=cps, min_checkpoint_size=0,
                                  unconnected_gradients="zero")
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for z in sess.run(zeros):
                assert z.shape == (8, 8) and not z.any()


def test_plan_when_ys_do_not_depend_on_xs():
    graph, _, ws, _, _ = _chain()
    with graph.as_default():
        unrelated = tf.reduce_sum(tf.constant(np.ones(3, np.float32)) * 2.0)
        try:
            plan = memsave.plan(unrelated, ws, checkpoints="memory", min_checkpoint_size=0)
        except ValueError as e:
            assert "depend" in str(e), str(e)
        else:
            assert plan.kept == []


@pytest.mark.parametrize("which", ["y", "x"])
def test_checkpoint_that_is_a_y_or_an_x_is_ignored_with_debug_log(which, caplog):
    graph, x, ws, hs, loss = _chain()
    with graph.as_default():
        xs = [x] + ws
        bad = loss if which == "y" else x
        plain = tf.gradients(loss, xs)
        with caplog.at_level(logging.DEBUG, logger="memsave"):
            ours = memsave.gradients(loss, xs, checkpoints=[bad, hs[2]])
        plan = memsave.plan(loss, xs, checkpoints=[bad, hs[2]])
    assert bad.name not in plan.kept and hs[2].name in plan.kept
    _run_equal(graph, plain, ours)
    debug = [r for r in caplog.records
             if r.name == "memsave" and r.levelno == logging.DEBUG and bad.name in r.getMessage()]
    assert debug, "no DEBUG record of logger 'memsave' names the ignored checkpoint %s" % bad.name
    assert "ignored" in debug[0].getMessage()


def test_rewrite_after_session_run_is_exact():
    """memsave only adds ops: a Session that already ran the graph runs them, and
    the gradients of every strategy are right in that same Session."""
    graph, x, ws, hs, loss = _chain()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(loss)
        plain = tf.gradients(loss, ws)
        sess.run(plain)
        for cps in ("memory", "speed", [hs[1], hs[3]]):
            ours = memsave.gradients(loss, ws, checkpoints=cps, min_checkpoint_size=0)
            _assert_equal_grads(sess, plain, ours)


def test_calling_twice_on_one_graph_identical_arguments():
    """The same call twice (same checkpoints, so the same copy names) and a
    different one: all three results are right, in one Session."""
    graph, x, ws, hs, loss = _chain()
    with graph.as_default():
        plain = tf.gradients(loss, ws)
        first = memsave.gradients(loss, ws, checkpoints=[hs[2]])
        second = memsave.gradients(loss, ws, checkpoints=[hs[2]])
        third = memsave.gradients(loss, ws, checkpoints="memory", min_checkpoint_size=0)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for ours in (first, second, third):
                _assert_equal_grads(sess, plain, ours)
    assert {t.name for t in first}.isdisjoint({t.name for t in second})


def test_calling_twice_inside_tf_function():
    rng = np.random.RandomState(1)
    ws = [tf.Variable(rng.randn(8, 8).astype(np.float32) * 0.4) for _ in range(5)]
    x = tf.constant(rng.randn(4, 8).astype(np.float32))

    @tf.function
    def step():
        h, hs = x, []
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
            hs.append(h)
        loss = tf.reduce_sum(h * h)
        return (tf.gradients(loss, ws), memsave.gradients(loss, ws, checkpoints=[hs[1]]),
                memsave.gradients(loss, ws, checkpoints=[hs[1]]))

    plain, first, second = step()
    for a, b, c in zip(plain, first, second):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=RTOL, atol=RTOL)
        np.testing.assert_allclose(c.numpy(), a.numpy(), rtol=RTOL, atol=RTOL)


def _unknown_shape_graph(shape):
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(2)
        ws = [tf.Variable(rng.randn(8, 8).astype(np.float32) * 0.4) for _ in range(6)]
        inp = tf.compat.v1.placeholder(tf.float32, shape=shape)
        h, hs = inp, []
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
            hs.append(h)
        # A reshape to a computed shape keeps the batch dimension unknown.
        h = tf.reshape(h, tf.stack([tf.shape(h)[0], 2, 4]))
        loss = tf.reduce_sum(h * h)
    return graph, inp, ws, hs, loss


@pytest.mark.parametrize("shape", [[None, 8], [None, None], None], ids=["batch", "dims", "rank"])
@pytest.mark.parametrize("strategy", ["memory", "speed", "list"])
def test_unknown_shapes(shape, strategy):
    graph, inp, ws, hs, loss = _unknown_shape_graph(shape)
    with graph.as_default():
        plan = memsave.plan(loss, ws, checkpoints=strategy if strategy != "list" else [hs[2]],
                            min_checkpoint_size=0)
        assert plan.kept, plan.summary()
        plain = tf.gradients(loss, ws)
        ours = memsave.gradients(loss, ws, checkpoints=strategy if strategy != "list" else
                                 [hs[2]], min_checkpoint_size=0)
    feed = {inp: np.random.RandomState(3).randn(5, 8).astype(np.float32)}
    _run_equal(graph, plain, ours, feed)


def test_unknown_batch_inside_tf_function():
    rng = np.random.RandomState(4)
    ws = [tf.Variable(rng.randn(8, 8).astype(np.float32) * 0.4) for _ in range(6)]

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    def step(inp):
        h = inp
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        return tf.gradients(loss, ws), memsave.gradients(loss, ws, checkpoints="memory",
                                                         min_checkpoint_size=0)

    plain, ours = step(tf.constant(rng.randn(3, 8).astype(np.float32)))
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=RTOL, atol=RTOL)


def test_duplicated_xs():
    graph, x, ws, hs, loss = _chain()
    with graph.as_default():
        xs = [ws[0], ws[3], ws[0]]
        plain = tf.gradients(loss, xs)
        ours = memsave.gradients(loss, xs, checkpoints=[hs[2]])
    _run_equal(graph, plain, ours)


def test_duplicated_ys_and_checkpoints():
    graph, x, ws, hs, loss = _chain()
    with graph.as_default():
        plain = tf.gradients([loss, loss], ws)
        ours = memsave.gradients([loss, loss], ws, checkpoints=[hs[2], hs[2], hs[4]])
    _run_equal(graph, plain, ours)


def test_y_that_is_also_an_x():
    graph, x, ws, hs, loss = _chain()
    with graph.as_default():
        xs = [hs[3]] + ws
        plain = tf.gradients([hs[3], loss], xs)
        ours = memsave.gradients([hs[3], loss], xs, checkpoints=[hs[1]])
    _run_equal(graph, plain, ours)


def test_int_tensors_as_checkpoint_and_as_x():
    """An int32 checkpoint (a computed shape) and an int x (no gradient: None)."""
    graph, x, ws, hs, loss = _chain()
    with graph.as_default():
        shape = tf.raw_ops.Shape(input=hs[3])
        total = loss + tf.reduce_sum(tf.reshape(hs[4], tf.reverse(shape, [0])) * 2.0)
        xs = [shape] + ws
        plain = tf.gradients(total, xs)
        ours = memsave.gradients(total, xs, checkpoints=[shape, hs[1]])
    assert plain[0] is None
    _run_equal(graph, plain, ours)


@pytest.mark.parametrize("stop", ["between", "checkpoint"])
def test_stop_gradients_pass_through(stop):
    graph, x, ws, hs, loss = _chain()
    with graph.as_default():
        cps = [hs[1], hs[4]] if stop == "between" else [hs[3]]
        plain = tf.gradients(loss, ws, stop_gradients=[hs[3]])
        ours = memsave.gradients(loss, ws, checkpoints=cps, stop_gradients=[hs[3]])
    _run_equal(graph, plain, ours)


# ------------------------------------------------------------------ no side effects

def _side_effect_graph():
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(5)
        ws = [tf.Variable(rng.randn(8, 8).astype(np.float32) * 0.4) for _ in range(6)]
        h = tf.constant(rng.randn(4, 8).astype(np.float32))
        hs = []
        for i, w in enumerate(ws):
            h = tf.tanh(tf.matmul(h, w))
            if i == 2:
                h = tf.cond(tf.reduce_sum(h) > -1e9, lambda: h * 1.5, lambda: h)
            if i == 3:
                # The loop reads a tensor, not the variable: in a Session a loop
                # reading a variable in its body is kept (an update made after
                # the gradients may write it first), and TensorFlow's gradient
                # of a kept loop changes the loop op, as plain tf.gradients does.
                w0 = ws[0].read_value()
                _, h = tf.while_loop(lambda k, s: k < 2,
                                     lambda k, s: (k + 1, tf.tanh(tf.matmul(s, w0))),
                                     [tf.constant(0), h])
            hs.append(h)
        loss = tf.reduce_sum(h * h)
        tf.compat.v1.add_to_collection("checkpoints", hs[2])
    return graph, ws, hs, loss


def _graph_state(graph):
    ops = {op.name: (op.node_def.SerializeToString(deterministic=True),
                     [t.name for t in op.inputs], [c.name for c in op.control_inputs],
                     [t.name for t in op.outputs])
           for op in graph.get_operations()}
    # Non-empty collections only: TensorFlow's own control-flow gradient code
    # (plain tf.gradients included) may register an empty 'local_variables' key.
    collections = {k: [getattr(t, "name", repr(t)) for t in graph.get_collection(k)]
                   for k in graph.get_all_collection_keys() if graph.get_collection(k)}
    return ops, collections


@pytest.mark.parametrize("strategy", ["memory", "speed", "collection", "list"])
def test_original_ops_and_collections_untouched(strategy):
    graph, ws, hs, loss = _side_effect_graph()
    with graph.as_default():
        before_ops, before_collections = _graph_state(graph)
        memsave.gradients(loss, ws, checkpoints=[hs[1], hs[3]] if strategy == "list"
                          else strategy, min_checkpoint_size=0)
        after_ops, after_collections = _graph_state(graph)
    changed = sorted(n for n in before_ops if after_ops[n] != before_ops[n])
    assert not changed, "memsave changed existing ops: %s" % changed
    assert after_collections == before_collections


def test_forward_values_unchanged_by_rewrite():
    graph, ws, hs, loss = _side_effect_graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        forward = hs + [loss]
        before = sess.run(forward)
        grads = memsave.gradients(loss, ws, checkpoints="memory", min_checkpoint_size=0)
        grads += memsave.gradients(loss, ws, checkpoints=[hs[1], hs[4]])
        after_alone = sess.run(forward)
        after_with_grads, _ = sess.run([forward, grads])
    for a, b, c in zip(before, after_alone, after_with_grads):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_forward_values_unchanged_inside_tf_function():
    rng = np.random.RandomState(6)
    ws = [tf.Variable(rng.randn(8, 8).astype(np.float32) * 0.4) for _ in range(6)]
    x = tf.constant(rng.randn(4, 8).astype(np.float32))

    def forward():
        h, hs = x, []
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
            hs.append(h)
        return hs, tf.reduce_sum(h * h)

    @tf.function
    def plain_step():
        return forward()

    @tf.function
    def memsave_step():
        hs, loss = forward()
        grads = memsave.gradients(loss, ws, checkpoints=[hs[2]])
        return hs, loss, grads

    hs_a, loss_a = plain_step()
    hs_b, loss_b, _ = memsave_step()
    for a, b in zip(hs_a + [loss_a], hs_b + [loss_b]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_calling_memsave_changes_no_global_state():
    """A call leaves tf.gradients, the recursion limit and the default graph alone."""
    originals = (tf.gradients, tf.compat.v1.gradients, sys.getrecursionlimit())
    graph, x, ws, hs, loss = _chain()
    default_before = tf.compat.v1.get_default_graph()
    with graph.as_default():
        memsave.gradients(loss, ws, checkpoints="memory", min_checkpoint_size=0)
        assert graph.get_collection("checkpoints") == []
    assert (tf.gradients, tf.compat.v1.gradients, sys.getrecursionlimit()) == originals
    assert tf.compat.v1.get_default_graph() is default_before


# ------------------------------------------------------------------ inputs tf.gradients accepts

@pytest.mark.parametrize("strategy", ["speed", "memory", "optimal"])
def test_unconnected_gradients_as_a_string(strategy):
    graph, x, ws, _, loss = _chain()
    with graph.as_default():
        z = tf.constant(1.0)
        plain = tf.gradients(loss, ws + [z], unconnected_gradients="zero")
        ours = memsave.gradients(loss, ws + [z], checkpoints=strategy, min_checkpoint_size=0,
                                 unconnected_gradients="zero")
        assert ours[-1] is not None
    _run_equal(graph, plain, ours)


def test_unknown_unconnected_gradients_value():
    graph, _, ws, _, loss = _chain()
    with graph.as_default(), pytest.raises(ValueError, match="unconnected_gradients"):
        memsave.gradients(loss, ws, checkpoints="speed", unconnected_gradients="zeroes")


def test_stop_gradients_a_single_tensor():
    graph, x, ws, hs, loss = _chain()
    with graph.as_default():
        plain = tf.gradients(loss, ws + [x], stop_gradients=hs[2])
        ours = memsave.gradients(loss, ws + [x], checkpoints="speed", stop_gradients=hs[2])
    _run_equal(graph, plain, ours)


@pytest.mark.parametrize("strategy", ["speed", "memory", "optimal"])
def test_reference_variables_as_xs(strategy):
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        ws = [tf.compat.v1.Variable(rng.randn(8, 8).astype(np.float32) * 0.4, use_resource=False)
              for _ in range(4)]
        h = tf.constant(rng.randn(4, 8).astype(np.float32))
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        plain = tf.gradients(loss, ws)
        ours = memsave.gradients(loss, ws, checkpoints=strategy, min_checkpoint_size=0)
    _run_equal(graph, plain, ours)


@pytest.mark.parametrize("structure", ["cond", "while", "tensor_array"])
def test_v1_control_flow_raises_clearly(v1_control_flow, structure):
    """TF1 control flow cannot be copied piecewise: a clear error, never None.
    Nor a TF1 TensorArray without a loop: its gradients gather in a gradient
    array named per tf.gradients call, and memsave's segments are several
    calls (0.18-0.92 of the largest entry off plain's, found by a helper)."""
    graph, x, ws, hs, _ = _chain()
    with graph.as_default():
        h = hs[2]
        if structure == "cond":
            h = tf.cond(tf.reduce_sum(h) > 0, lambda: tf.tanh(h @ ws[3]), lambda: h * 2.0)
        elif structure == "while":
            h = tf.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, tf.tanh(a @ ws[3])),
                              [0, h])[1]
        else:
            rows = tf.TensorArray(h.dtype, size=h.shape[0], clear_after_read=False).unstack(h)
            h = tf.tanh(rows.stack() @ ws[3]) * (rows.read(1) * 2.0 + rows.read(0))
        loss = tf.reduce_sum(tf.tanh(h @ ws[4]))
        for strategy in ("speed", "memory", "optimal", "collection"):
            with pytest.raises(memsave.V1ControlFlowError, match="TF1 control flow"):
                memsave.gradients(loss, ws, checkpoints=strategy, min_checkpoint_size=0)


@pytest.mark.parametrize("carried", ["stop_gradient", "argmax"])
def test_v1_control_flow_no_gradient_reaches_is_read_not_copied(v1_control_flow, carried):
    """TF1 control flow between xs and ys that no gradient passes through (a
    loop over tf.stop_gradient(h), over an argmax index; Optimizer.minimize
    of such a model under memsave.patch()) was refused where plain works
    (found by a helper). Its outputs are read where the forward pass made
    them; the rest is rewritten, with plain's gradients."""
    graph, x, ws, hs, _ = _chain(8)
    with graph.as_default():
        if carried == "stop_gradient":
            s = tf.while_loop(lambda k, a: k < 3, lambda k, a: (k + 1, a * 0.9),
                              [0, tf.stop_gradient(hs[3])])[1]
            loss = tf.reduce_sum(hs[-1] * s)
        else:
            idx = tf.argmax(hs[3], 1, output_type=tf.int32)
            idx = tf.while_loop(lambda k, a: k < 3,
                                lambda k, a: (k + 1, (a + 1) % hs[-1].shape[1]), [0, idx])[1]
            loss = tf.reduce_sum(tf.gather(hs[-1], idx, axis=1, batch_dims=1) ** 2)
        plain = tf.gradients(loss, ws)
        ours = [memsave.gradients(loss, ws, checkpoints=strategy, fallback=False,
                                  min_checkpoint_size=0)
                for strategy in ("speed", "memory", "optimal", [hs[2], hs[5]])]
        with memsave.patch(checkpoints=[hs[2], hs[5]], fallback=False):
            ours.append(tf.gradients(loss, ws))
    copied = [op for op in graph.get_operations() if op.name.startswith("memsave")]
    assert copied and not any(op.type in ("Enter", "Exit", "Merge") for op in copied)
    for grads in ours:
        _run_equal(graph, plain, grads)


def test_v1_control_flow_no_gradient_reaches_leaves_ys_it_alone_connects_none(v1_control_flow):
    """ys that only a TF1 loop no gradient passes through connects to the xs:
    plain's Nones, under every strategy ('memory' raised NoBottleneckError on
    the rest of the region, found by a helper)."""
    graph, x, ws, hs, _ = _chain(6)
    with graph.as_default():
        s = tf.while_loop(lambda k, a: k < 3, lambda k, a: (k + 1, a * 0.9),
                          [0, tf.stop_gradient(hs[3])])[1]
        loss = tf.reduce_sum(s)
        assert tf.gradients(loss, ws) == [None] * len(ws)
        for strategy in ("speed", "memory", "optimal", [hs[2]]):
            assert memsave.gradients(loss, ws, checkpoints=strategy, fallback=False,
                                     min_checkpoint_size=0) == [None] * len(ws)


@pytest.mark.parametrize("strategy", ["speed", "memory", [1, 3]])
def test_gradients_inside_a_v1_while_body_are_plain(v1_control_flow, strategy, caplog):
    """memsave.gradients built inside a TF1 while loop's body: its copies and
    fences, built outside the loop's context, could not read the body's
    tensors ("Cannot use 'while/Sum' as input to 'memsave_fence/while/Sum'
    because 'while/Sum' is in a while loop", found by a helper). Plain
    tf.gradients is used there, with a WARNING."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        ws = [tf.constant(rng.randn(6, 6) * 0.5) for _ in range(6)]
        x0 = tf.constant(rng.randn(4, 6))

        def summed(differentiate):
            def body(k, total):
                local = [w * 1.0 for w in ws]
                h, hs = x0 * tf.cast(k + 1, tf.float64), []
                for w in local:
                    h = tf.tanh(tf.matmul(h, w))
                    hs.append(h)
                grads = differentiate(tf.reduce_sum(h * h), local, hs)
                return k + 1, total + tf.add_n([tf.reduce_sum(g * g) for g in grads])
            return tf.while_loop(lambda k, _: k < 2, body,
                                 [0, tf.constant(0.0, tf.float64)])[1]

        plain = summed(lambda y, xs, hs: tf.gradients(y, xs))
        reset_warnings()
        with caplog.at_level(logging.WARNING, logger="memsave"):
            ours = summed(lambda y, xs, hs: memsave.gradients(
                y, xs, fallback=False, min_checkpoint_size=0,
                checkpoints=[hs[i] for i in strategy] if isinstance(strategy, list)
                else strategy))
    assert any("TF1 while loop" in r.getMessage() for r in caplog.records)
    with tf.compat.v1.Session(graph=graph) as sess:
        a, b = sess.run([plain, ours])
    assert a > 0 and b == pytest.approx(a, rel=1e-12)


def test_v1_while_loop_upstream_of_the_region(v1_control_flow):
    """A TF1 loop that only feeds the region (a scale no x reaches) is a cycle
    in the graph (NextIteration feeds Merge): the audit's walk went round it
    forever. Nothing of it is differentiated: plain's gradients."""
    graph, x, ws, hs, _ = _chain()
    with graph.as_default():
        scale = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 0.9),
                              [0, tf.constant(1.0, hs[0].dtype)])[1]
        loss = tf.reduce_sum(tf.tanh(hs[-1] * scale))
        plain = tf.gradients(loss, ws)
        ours = memsave.gradients(loss, ws, checkpoints=[hs[2]])
    _run_equal(graph, plain, ours)


# ------------------------------------------------------------------ the None-pattern guard

def test_guard_refuses_a_lost_gradient(monkeypatch):
    """If the rewrite ever loses a gradient, memsave raises instead of returning None
    (the None guard alone: the audit, which catches this first, is tested in
    tests/test_audit.py)."""
    from memsave import api  # pylint: disable=import-outside-toplevel
    original = api.rewrite
    monkeypatch.setattr(api.audit, "check", lambda *args: None)

    def losing(*args, **kwargs):
        grads = original(*args, **kwargs)
        return [None] + list(grads[1:])

    monkeypatch.setattr(api, "rewrite", losing)
    graph, _, ws, hs, loss = _chain()
    with graph.as_default(), pytest.raises(memsave.GradientMismatchError, match="None for w0"):
        memsave.gradients(loss, ws, checkpoints=[hs[2]])


def test_guard_refuses_a_gradient_for_an_unconnected_x(monkeypatch):
    from memsave import api  # pylint: disable=import-outside-toplevel
    original = api.rewrite
    monkeypatch.setattr(api.audit, "check", lambda *args: None)
    graph, _, ws, hs, loss = _chain()
    with graph.as_default():
        stray = tf.Variable(1.0, name="stray")

    def inventing(*args, **kwargs):
        grads = original(*args, **kwargs)
        return list(grads[:-1]) + [tf.constant(0.0)]

    monkeypatch.setattr(api, "rewrite", inventing)
    with graph.as_default(), pytest.raises(memsave.GradientMismatchError,
                                           match="unconnected stray"):
        memsave.gradients(loss, ws + [stray], checkpoints=[hs[2]])


@pytest.mark.parametrize("strategy", ["speed", "optimal"])
def test_guard_accepts_a_path_without_gradient(strategy):
    """A path through Floor reaches the y, yet tf.gradients gives None: so must memsave."""
    graph, x, ws, hs, _ = _chain()
    with graph.as_default():
        side = tf.Variable(np.ones([4, 8], np.float32), name="side")
        loss = tf.reduce_sum(hs[-1] * hs[-1]) + tf.reduce_sum(tf.floor(side * 3.0))
        plain = tf.gradients(loss, ws + [side])
        ours = memsave.gradients(loss, ws + [side], checkpoints=strategy, min_checkpoint_size=0)
        assert plain[-1] is None and ours[-1] is None
    _run_equal(graph, plain, ours)


def test_gradients_in_a_cond_branch_through_a_capture():
    """tf.gradients called in a cond branch on a y computed there from a tensor
    of the enclosing graph follows the capture out (tf.hessians does this in a
    while body): memsave gives the same gradient, not None (by plain
    tf.gradients, with a WARNING), and tf.hessians under the patch works."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(1)
        w = tf.Variable(rng.randn(4, 4) * 0.5)
        h = tf.constant(rng.randn(3, 4))
        for _ in range(4):
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h ** 2)

        def branch():
            y = loss * 2.0
            ours = memsave.gradients(y, [w], checkpoints="optimal", fallback=False)[0]
            assert ours is not None
            return tf.gradients(y, [w])[0], ours

        zeros = tf.zeros([4, 4], tf.float64)
        plain, ours = tf.cond(tf.constant(True), branch, lambda: (zeros, zeros))
        plain_hessian = tf.hessians(loss, w)[0]
        with memsave.patch("optimal"):
            our_hessian = tf.hessians(loss, w)[0]
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b, c, d = sess.run([plain, ours, plain_hessian, our_hessian])
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-12 * np.abs(a).max())
    np.testing.assert_allclose(d, c, rtol=0, atol=1e-12 * np.abs(c).max())


@pytest.mark.parametrize("checkpoints", ["memory", "speed", "optimal", "list"])
def test_an_unused_output_of_a_differentiated_op_gets_tensorflows_zeros(checkpoints):
    """An x that is one half of a Split whose other half reaches the loss: TF
    differentiates the Split and gives zeros for the unused half, not None.
    The tape gives None for it, and so does memsave's tape."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(2)
        ws = [tf.Variable(rng.randn(6, 6) / 2.5) for _ in range(10)]
        h, hs = tf.constant(rng.randn(4, 6)), []
        for w in ws[:5]:
            h = tf.tanh(h @ w)
            hs.append(h)
        used, unused = tf.split(h, 2, axis=1)
        h = tf.concat([used, used], axis=1)
        for w in ws[5:]:
            h = tf.tanh(h @ w)
            hs.append(h)
        loss = tf.reduce_sum(h * h)
        listed = [hs[2], hs[7]] if checkpoints == "list" else checkpoints
        ours = memsave.gradients(loss, ws + [unused], checkpoints=listed,
                                 min_checkpoint_size=0, fallback=False)
        plain = tf.gradients(loss, ws + [unused])
        assert plain[-1] is not None and ours[-1] is not None
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _assert_equal_grads(sess, plain, ours)


def test_an_unused_output_of_a_differentiated_op_is_none_for_the_tape():
    """The tape gives None for a watched source no target depends on, where
    tf.gradients gives zeros: so does memsave's tape."""
    rng = np.random.RandomState(3)
    ws = [tf.Variable(rng.randn(6, 6) / 2.5) for _ in range(10)]
    x = tf.constant(rng.randn(4, 6))

    def grads(tape_type, **options):
        @tf.function
        def step():
            with tape_type(**options) as tape:
                h = x
                for w in ws[:5]:
                    h = tf.tanh(h @ w)
                used, unused = tf.split(h, 2, axis=1)
                tape.watch(unused)
                h = tf.concat([used, used], axis=1)
                for w in ws[5:]:
                    h = tf.tanh(h @ w)
                loss = tf.reduce_sum(h * h)
            return tape.gradient(loss, [unused] + ws)
        return step()
    plain = grads(tf.GradientTape)
    ours = grads(memsave.GradientTape, checkpoints="memory", min_checkpoint_size=0)
    assert plain[0] is None and ours[0] is None
    for a, b in zip(plain[1:], ours[1:]):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", ["optimal", "speed", "memory", "list"])
def test_one_variable_gathered_with_int32_and_int64_ids(strategy):
    """tf.gather with int32 ids and with tf.argmax's int64 ones: the sparse
    partials are summed in int64, as TensorFlow sums them (memsave's concat of
    the ids raised a TypeError, found by a helper)."""
    graph = tf.Graph()
    with graph.as_default():
        table = tf.Variable(np.random.RandomState(0).randn(6, 4))
        h = tf.tanh(tf.gather(table, tf.constant([1, 3, 1], tf.int32)))
        looked_up = tf.gather(table, tf.argmax(h, 1))
        loss = tf.reduce_sum(tf.tanh(h * looked_up) ** 2)
        plain = tf.gradients(loss, [table])
        ours = memsave.gradients(loss, [table], fallback=False, min_checkpoint_size=0,
                                 checkpoints=[h] if strategy == "list" else strategy)
        assert isinstance(ours[0], tf.IndexedSlices) and ours[0].indices.dtype == tf.int64
    _run_equal(graph, plain, ours)


_LOOPS_OVER_ROWS = {
    "map_fn": lambda h, v: tf.map_fn(lambda r: tf.tanh(r) * 2.0, h),
    "scan": lambda h, v: tf.scan(lambda a, r: tf.tanh(a + r), h),
    "foldl": lambda h, v: tf.foldl(lambda a, r: tf.tanh(a + r), h) + h,
    # Kept in place: the body reads v, which the step writes before the gradients.
    "map_fn_reading_a_written_variable": lambda h, v: tf.map_fn(lambda r: tf.tanh(r * v), h),
}


@pytest.mark.parametrize("strategy", ["optimal", "speed", "list"])
@pytest.mark.parametrize("loop", sorted(_LOOPS_OVER_ROWS))
def test_a_loop_over_an_unknown_batch(loop, strategy):
    """map_fn/scan/foldl over a batch of unknown size: while_v2 sizes the
    loop's TensorLists from its shape, which carries no gradient, so
    tf.gradients sends none there; memsave's audit took them for paths
    (an IndexError, then GradientMismatchError, where plain works; found
    by a helper)."""
    rng = np.random.RandomState(0)
    w = tf.Variable(rng.randn(4, 4) * 0.5)
    v = tf.Variable(np.full(4, 0.7))

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float64)])
    def step(x):
        below = tf.tanh(x @ w)
        h = _LOOPS_OVER_ROWS[loop](below, v)
        loss = tf.reduce_sum(tf.tanh(h @ w) ** 2)
        if loop.endswith("written_variable"):
            with tf.control_dependencies([loss]):
                v.assign(v * 5.0)
        checkpoints = [below] if strategy == "list" else strategy
        return tf.gradients(loss, [w]), memsave.gradients(
            loss, [w], checkpoints=checkpoints, fallback=False, min_checkpoint_size=0)

    plain, ours = step(tf.constant(rng.randn(3, 4)))
    np.testing.assert_allclose(ours[0], plain[0], rtol=0, atol=1e-12 * np.abs(plain[0]).max())


@pytest.mark.parametrize("strategy", ["optimal", "speed", "list"])
@pytest.mark.parametrize("lookup", ["embedding_lookup", "gather"])
def test_a_lookup_of_a_frozen_table_with_ids_computed_from_an_x(lookup, strategy):
    """Ids from an argmax (integers) into a table that is no x: tf.gradients
    sends no gradient to the lookup, which memsave's audit expected (it
    raised GradientMismatchError where plain works; found by a helper)."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        table, w = tf.Variable(rng.randn(6, 4)), tf.Variable(rng.randn(4, 4))
        h = tf.tanh(tf.constant(rng.randn(3, 4)) @ w)
        ids = tf.argmax(h, 1)
        looked_up = (tf.nn.embedding_lookup(table, ids) if lookup == "embedding_lookup"
                     else tf.gather(table, ids))
        loss = tf.reduce_sum(tf.tanh(h + looked_up) ** 2)
        plain = tf.gradients(loss, [w])
        ours = memsave.gradients(loss, [w], fallback=False, min_checkpoint_size=0,
                                 checkpoints=[h] if strategy == "list" else strategy)
    _run_equal(graph, plain, ours)


def test_the_garbage_collector_is_paused_while_building_and_left_as_it_was():
    # memsave pauses Python's cyclic collector while it builds (full
    # collections walk the whole process); it must come back as the caller
    # had it, after a plan, after an error, and off where the caller had it off.
    import gc  # pylint: disable=import-outside-toplevel
    graph, ws, hs, loss = _side_effect_graph()
    during = []

    def strategy(plan_graph):
        during.append(gc.isenabled())
        return [hs[1].name]

    def failing(plan_graph):
        during.append(gc.isenabled())
        raise RuntimeError("a strategy that fails")

    was_enabled = gc.isenabled()
    try:
        with graph.as_default():
            gc.enable()
            memsave.gradients(loss, ws, checkpoints=strategy)
            assert gc.isenabled()
            with pytest.raises(RuntimeError, match="a strategy that fails"):
                memsave.gradients(loss, ws, checkpoints=failing)
            assert gc.isenabled()
            gc.disable()
            memsave.gradients(loss, ws, checkpoints=strategy)
            assert not gc.isenabled()
    finally:
        (gc.enable if was_enabled else gc.disable)()
    assert during == [False, False, False]
