"""memsave's gradients equal plain tf.gradients on many graphs, in both modes."""

import pytest

from tests import models
from tests.helpers import assert_same, run_function, run_session

STRATEGIES = ["optimal", "memory", "speed", "collection", "list"]
MODES = {"session": run_session, "function": run_function}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(models.ALL))
def test_gradients_equal_plain(name, strategy, mode):
    pattern, values = MODES[mode](models.ALL[name](), strategy)
    assert_same(pattern, values)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_unconnected_zero(mode):
    from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
    pattern, values = MODES[mode](models.Unconnected(), "memory",
                                  unconnected_gradients=UnconnectedGradients.ZERO)
    assert pattern == ([False] * 4, [False] * 4)
    assert_same(pattern, values)


def test_sparse_gradients_stay_sparse():
    import tensorflow as tf
    import memsave
    graph = tf.Graph()
    with graph.as_default():
        model = models.Embedding()
        out = model.forward(model.variables())
        plain = tf.gradients(out["ys"], out["xs"])
        ours = memsave.gradients(out["ys"], out["xs"], checkpoints=out["tag"])
    assert isinstance(plain[0], tf.IndexedSlices)
    assert isinstance(ours[0], tf.IndexedSlices)


def test_control_flow_and_calls_are_recomputed():
    """In a tf.function, copies of If, While and the nested call exist (they
    were not pinned); in a Session, where an update made after the gradients
    may write the variables their bodies read, they are kept."""
    import tensorflow as tf
    import memsave
    model = models.ControlFlow()

    def copied_types(graph, build):
        before = len(graph.get_operations())
        build()
        return {op.type for op in graph.get_operations()[before:]
                if op.name.startswith("memsave_")}

    variables = model.variables()
    found = {}

    @tf.function
    def step():
        out = model.forward(variables)
        graph = tf.compat.v1.get_default_graph()
        found["copied"] = copied_types(graph, lambda: memsave.gradients(
            out["ys"], out["xs"], checkpoints=[out["tag"][0]]))
        return out["ys"]

    step.get_concrete_function()
    assert {"If", "While", "StatefulPartitionedCall"} <= found["copied"], found["copied"]

    graph = tf.Graph()
    with graph.as_default():
        out = model.forward(model.variables())
        copied = copied_types(graph, lambda: memsave.gradients(
            out["ys"], out["xs"], checkpoints=[out["tag"][0]]))
    assert not {"If", "While", "StatefulPartitionedCall"} & copied, copied


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", ["chain20", "resnet", "unet", "dense"])
def test_budgeted_plans_equal_plain(name, mode):
    from tests.helpers import run_budgeted
    pattern, values = run_budgeted(MODES[mode], models.ALL[name]())
    assert_same(pattern, values)


def test_a_gather_read_by_several_segments_under_xla_is_differentiated_once():
    """Under XLA, a gather recomputed in several segments would give its
    table one IndexedSlices part per segment, whose rows memsave sums with
    tf.unique: XLA runs that as a loop with one iteration per row (on BERT
    at 1,024 tokens, an estimated 24x plain's step on an H100). The gather's
    output is kept instead: no Unique, one sparse gradient, plain's values."""
    import numpy as np
    import tensorflow as tf
    import memsave
    rng = np.random.RandomState(3)
    table = tf.Variable(rng.randn(40, 8))
    ws = [tf.Variable(rng.randn(8, 8) / 3) for _ in range(3)]
    ids = tf.constant(rng.randint(0, 40, 24))
    found = {}

    @tf.function(jit_compile=True)
    def step():
        e = tf.gather(table.value(), ids)     # as Keras reads an Embedding
        h, tag = e, []
        for w in ws:            # every layer reads the lookup again
            h = tf.tanh(h @ w) + e
            tag.append(h)
        loss = tf.reduce_sum(h * h)
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        ours = memsave.gradients(loss, [table] + ws, checkpoints=tag[:-1])
        found["types"] = {op.type for op in graph.get_operations()[before:]}
        found["sparse"] = isinstance(ours[0], tf.IndexedSlices)
        plain = tf.gradients(loss, [table] + ws)
        return [tf.convert_to_tensor(g) for g in ours], [tf.convert_to_tensor(g) for g in plain]

    ours, plain = step()
    assert "Unique" not in found["types"] and found["sparse"]
    scale = max(float(np.max(np.abs(p))) for p in plain)
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * scale)
