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
