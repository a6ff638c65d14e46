"""The one door to TensorFlow internals: memsave.tf_internal.

Every private symbol memsave uses must exist on the pinned TensorFlow, a
different TensorFlow version must be reported, and no other module of
memsave may import ``tensorflow.python``/``core``/``compiler`` or touch the
private TF attributes tf_internal wraps.
"""

import ast
import importlib
import logging
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from memsave import tf_internal

PACKAGE = pathlib.Path(tf_internal.__file__).resolve().parent
PRIVATE_PREFIXES = ("tensorflow.python", "tensorflow.core", "tensorflow.compiler")

# Files allowed to touch TF internals besides tf_internal.py: none.
ALLOWED_FOR_NOW = frozenset()

# Private TF attributes that only tf_internal may touch (it wraps each one).
PRIVATE_TF_ATTRIBUTES = frozenset({
    "_id", "_add_control_inputs", "_add_control_input", "_control_outputs", "_set_device",
    "_input_types", "_gradient_function", "_create_op_internal", "_mutation_lock",
    "_get_function", "_functions", "_add_function_recursive", "_add_control_dependencies",
    "_ref", "_tape", "_recording", "_persistent", "_watched_variables",
    "_pop_tape", "_GradientsHelper", "_ZerosLike", "_update_input",
})


# ---------------------------------------------------------------------------
# Every symbol exists on the installed (pinned) TensorFlow.

def test_pinned_tensorflow_is_the_tested_one():
    assert tf_internal._major_minor(tf.__version__) == tf_internal.TESTED_TF  # pylint: disable=protected-access


@pytest.mark.parametrize("what,getter", tf_internal.SYMBOLS,
                         ids=[what for what, _ in tf_internal.SYMBOLS])
def test_symbol_exists(what, getter):
    assert getter() is not None, what


def test_symbols_are_unique_and_cover_the_exports():
    names = [what for what, _ in tf_internal.SYMBOLS]
    assert len(names) == len(set(names))
    for export in ("EagerTensor", "FuncGraph", "BaseSession", "copy_handle_data",
                   "is_resource_variable", "get_func_graph", "create_new_tf_function",
                   "unique_fn_name", "get_op_def", "get_gradient_function",
                   "gradients_helper", "zeros_for_unconnected", "default_zeros_like",
                   "stop_recording", "should_record_backprop", "could_possibly_record",
                   "push_tape", "pop_tape", "tape_set_is_stopped",
                   "get_flat_tensors_for_gradients", "convert_variables_to_tensors",
                   "gradients_impl_module", "gradients_module"):
        assert callable(getattr(tf_internal, export)) or export.endswith("_module"), export


def test_private_attributes_on_real_objects():
    """The instance attributes the helpers read, on objects TF really builds."""
    graph = tf.Graph()
    with graph.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [2])
        b = tf.identity(a)
        c = tf.no_op()
        tf_internal.add_control_inputs(c, [b.op])
        assert tf_internal.control_outputs(b.op) == [c]
        tf_internal.preserve(b.op)
        assert b.op.get_attr("_grappler_do_not_remove")
        assert tf_internal.op_id(a.op) < tf_internal.op_id(b.op)
        assert tf_internal.input_types(b.op) == [tf.float32]
        copy = tf_internal.create_op(graph, "Identity", [a], dtypes=[tf.float32],
                                     attrs={"T": tf.compat.v1.AttrValue(
                                         type=tf.float32.as_datatype_enum)},
                                     compute_device=False)
        tf_internal.copy_gradient_function(b.op, copy)
        tf_internal.set_device(copy, "/device:CPU:0")
        assert copy.device == "/device:CPU:0"
        with tf_internal.mutation_lock(graph):
            pass
        ref = tf.compat.v1.Variable(1.0, use_resource=False)
        assert tf_internal.ref_variable_tensor(ref).dtype.name == "float32_ref"
        session = tf.compat.v1.Session()
        assert isinstance(session, tf_internal.BaseSession)
        session.close()
    assert tf_internal.orders_stateful_ops_by_creation(graph) is False

    seen = {}

    @tf.function
    def step(x):
        graph = tf.compat.v1.get_default_graph()
        seen["graph"] = graph
        seen["ordered"] = tf_internal.orders_stateful_ops_by_creation(graph)
        return x * 2.0

    step(tf.constant(1.0))
    assert seen["ordered"] is True
    assert isinstance(seen["graph"], tf_internal.FuncGraph)

    tape = tf.GradientTape()
    assert tf_internal.tape_handle(tape) is None
    assert tf_internal.tape_persistent(tape) is False
    assert tf_internal.tape_recording(tape) is False


def test_control_flow_ops_carry_the_body_attributes_functions_reads():
    """memsave.graph.functions reads the FuncGraphs while_v2/cond_v2 put on ops."""
    from memsave.graph import functions  # pylint: disable=import-outside-toplevel
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [])
        tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0), [0, x])
        tf.cond(x > 0, lambda: x + 1.0, lambda: x - 1.0)
        tf.switch_case(tf.cast(x, tf.int32), [lambda: x + 1.0, lambda: x - 1.0])
    found = set()
    for op in graph.get_operations():
        if not functions.has_bodies(op):
            continue
        found.add(op.type)
        for _key, _position, py_attr, body in functions._bodies_of(op):  # pylint: disable=protected-access
            assert isinstance(getattr(op, py_attr), tf_internal.FuncGraph), (op.type, py_attr)
            assert body is getattr(op, py_attr)
    assert {"While", "If", "Case"} <= {t.replace("Stateless", "") for t in found}


def test_public_replacements_are_the_same_objects():
    """The public names memsave uses instead of internals are TF's very objects."""
    from tensorflow.python.autograph.impl import api as autograph_api  # pylint: disable=import-outside-toplevel
    from tensorflow.python.eager import backprop  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import config, importer, indexed_slices, ops, tensor  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import array_ops, math_ops, variables  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import unconnected_gradients  # pylint: disable=import-outside-toplevel
    from tensorflow.python.util import nest  # pylint: disable=import-outside-toplevel
    from tensorflow.core.framework import attr_value_pb2  # pylint: disable=import-outside-toplevel
    pairs = [
        (tf.Graph, ops.Graph), (tf.Operation, ops.Operation), (tf.Tensor, tensor.Tensor),
        (tf.IndexedSlices, indexed_slices.IndexedSlices), (tf.Variable, variables.Variable),
        (tf.UnconnectedGradients, unconnected_gradients.UnconnectedGradients),
        (tf.autograph.experimental.do_not_convert, autograph_api.do_not_convert),
        (tf.graph_util.import_graph_def, importer.import_graph_def),
        (tf.compat.v1.get_default_graph, ops.get_default_graph),
        (tf.compat.v1.placeholder, array_ops.placeholder),
        (tf.compat.v1.ones_like, array_ops.ones_like),
        (tf.compat.v1.AttrValue, attr_value_pb2.AttrValue),
        (tf.compat.v1.NameAttrList, attr_value_pb2.NameAttrList),
        (tf.identity, array_ops.identity), (tf.zeros, array_ops.zeros),
        (tf.concat, array_ops.concat), (tf.add_n, math_ops.add_n),
        (tf.nest.map_structure, nest.map_structure), (tf.nest.flatten, nest.flatten),
        (tf.nest.pack_sequence_as, nest.pack_sequence_as),
        (tf.GradientTape, backprop.GradientTape),
        (tf.config.list_physical_devices, config.list_physical_devices),
    ]
    for public, private in pairs:
        assert public is private, (public, private)


# ---------------------------------------------------------------------------
# Version check at import.

def _reload_with_version(version):
    """Re-import tf_internal as if TensorFlow ``version`` were installed, then restore it."""
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tf, "__version__", version)
            importlib.reload(tf_internal)
    finally:
        importlib.reload(tf_internal)


def test_mismatched_version_warns_at_import(caplog):
    with caplog.at_level(logging.WARNING, logger="memsave"):
        _reload_with_version("2.99.0")
    messages = [r.getMessage() for r in caplog.records if r.name == "memsave"]
    assert any("2.99.0" in m and tf_internal.TESTED_TF in m for m in messages), messages
    assert tf.__version__ != "2.99.0"


def test_tested_version_does_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="memsave"):
        _reload_with_version(tf_internal.TESTED_TF + ".7")
    assert not [r for r in caplog.records if r.name == "memsave"]
    assert tf_internal.check_version(tf_internal.TESTED_TF + ".0rc1") is True


def test_missing_symbol_fails_the_import_naming_it():
    from tensorflow.python.framework import func_graph  # pylint: disable=import-outside-toplevel
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tf, "__version__", "2.99.0")
            patch.delattr(func_graph, "FuncGraph")
            with pytest.raises(ImportError) as info:
                importlib.reload(tf_internal)
    finally:
        importlib.reload(tf_internal)
    message = str(info.value)
    assert "FuncGraph" in message and "2.99.0" in message and tf_internal.TESTED_TF in message
    assert tf_internal.FuncGraph is func_graph.FuncGraph


def test_missing_private_attribute_is_named():
    with pytest.raises(ImportError, match="tf.Graph._no_such_thing"):
        tf_internal._resolve("tf.Graph._no_such_thing",  # pylint: disable=protected-access
                             lambda: tf.Graph._no_such_thing)  # pylint: disable=protected-access


# ---------------------------------------------------------------------------
# Nothing else in memsave reaches into TensorFlow's internals.

def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel != "tf_internal.py":
            yield rel, ast.parse(path.read_text(), filename=str(path))


def _is_private(name):
    return isinstance(name, str) and any(
        name == p or name.startswith(p + ".") for p in PRIVATE_PREFIXES)


def _private_imports(tree):
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if _is_private(node.module):
                found.append((node.lineno, node.module))
            elif node.module == "tensorflow" and any(
                    a.name in ("python", "core", "compiler") for a in node.names):
                found.append((node.lineno, "from tensorflow import python/core/compiler"))
        elif isinstance(node, ast.Constant) and _is_private(node.value):
            # importlib.import_module("tensorflow.python...") and the like
            found.append((node.lineno, node.value))
    return found


def _private_attributes(tree):
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_TF_ATTRIBUTES:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_TF_ATTRIBUTES:
            found.append((node.lineno, node.value))   # getattr(x, "_tape", ...)
    return found


def test_only_tf_internal_imports_tensorflow_internals():
    offenders = {rel: hits for rel, tree in _modules()
                 if (hits := _private_imports(tree)) and rel not in ALLOWED_FOR_NOW}
    assert not offenders, "use memsave.tf_internal or the public tf API: %s" % offenders


def test_only_tf_internal_touches_private_tf_attributes():
    offenders = {rel: hits for rel, tree in _modules()
                 if (hits := _private_attributes(tree)) and rel not in ALLOWED_FOR_NOW}
    assert not offenders, "use a helper of memsave.tf_internal: %s" % offenders


def test_the_scan_finds_private_imports():
    tree = ast.parse("import importlib\n"
                     "from tensorflow.python.framework import ops\n"
                     "import tensorflow.core.framework.attr_value_pb2\n"
                     "m = importlib.import_module('tensorflow.python.ops.gradients')\n"
                     "x = op._id\n")
    assert [line for line, _ in _private_imports(tree)] == [2, 3, 4]
    assert _private_attributes(tree) == [(5, "_id")]


# ---------------------------------------------------------------------------
# tf.gradients' forward walk, replaced within memsave's calls: same answer.

def _reach_graph():
    """A FuncGraph that reads captured variables (one capture per weight, the
    case TF's walk scans per tensor), an int branch and a TensorList."""
    weights = [tf.Variable(tf.ones([4, 4]) * (i + 1)) for i in range(3)]
    graphs = {}

    @tf.function
    def step(x):
        h = x
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
        count = tf.shape(h)[0] * 2   # int32: not trainable, not followed
        items = tf.raw_ops.TensorListFromTensor(
            tensor=h, element_shape=tf.constant([4], tf.int32))
        back = tf.raw_ops.TensorListStack(
            input_handle=items, element_shape=tf.constant([4], tf.int32),
            element_dtype=tf.float32, num_elements=-1)
        graphs["g"] = tf.compat.v1.get_default_graph()

        @tf.function
        def inner():   # captures h and back: a walk through them enters here
            graphs["inner"] = tf.compat.v1.get_default_graph()
            return tf.reduce_sum(h * back)

        return inner() + tf.cast(count, tf.float32)

    step.get_concrete_function(tf.TensorSpec([2, 4], tf.float32))
    return graphs["g"], graphs["inner"]


def test_fast_reachability_marks_the_ops_tf_marks():
    graph, inner = _reach_graph()
    starts = [op for op in graph.get_operations() if op.type in ("Placeholder", "ReadVariableOp")]
    func_graphs = [inner, graph]   # as a tf.gradients call inside ``inner`` sees them
    for from_ops in ([starts[0]], starts):
        theirs, ours = set(), set()
        tf_internal.mark_reached_ops(from_ops, theirs, func_graphs)
        tf_internal._mark_reached_ops(from_ops, ours, func_graphs)  # pylint: disable=protected-access
        assert ours == theirs and len(ours) > len(from_ops)
        assert any(op.graph is inner for op in ours)   # through the captures


def test_fast_reachability_leaves_out_the_skipped_ops_once():
    graph, _ = _reach_graph()
    ops = graph.get_operations()
    tanh = [op for op in ops if op.type == "Tanh"]
    lo, hi = tf_internal.op_id(tanh[1]), tf_internal.op_id(tanh[1]) + 1
    with tf_internal.fast_reachability((graph, lo, hi)):
        assert tf_internal.gradients_util_module._MarkReachedOps is not tf_internal.mark_reached_ops  # pylint: disable=protected-access
        skipped, again = set(), set()
        tf_internal.gradients_util_module._MarkReachedOps(ops[:1], skipped, [graph])  # pylint: disable=protected-access
        tf_internal.gradients_util_module._MarkReachedOps(ops[:1], again, [graph])  # pylint: disable=protected-access
    assert tanh[1] not in skipped and tanh[0] in skipped
    assert tanh[1] in again   # the skip is for the next walk only
    assert tf_internal.gradients_util_module._MarkReachedOps is tf_internal.mark_reached_ops  # pylint: disable=protected-access


def _pruning_graph():
    """x [3, 4] minus a broadcast constant, and x's squared difference from its
    stopped mean (as a batch norm's variance): neither second input needs a gradient."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [3, 4])
        shifted = x - tf.constant([1.0, 2.0, 3.0, 4.0], tf.float64)
        spread = tf.math.squared_difference(x, tf.stop_gradient(tf.reduce_mean(x, axis=0)))
        y = tf.reduce_sum(tf.square(shifted) * spread)
    return graph, x, y, [shifted.op, spread.op]


def test_prunable_ops_skip_the_inputs_no_gradient_goes_on_from_during_the_walk_only():
    _, x, _, (sub, sqd) = _pruning_graph()
    walk = tf_internal.gradients_util_module
    with pytest.raises(RuntimeError):
        with tf_internal.fast_reachability(prunable=[sub, sqd]):
            walk._MarkReachedOps([x.op], set(), [])  # pylint: disable=protected-access
            assert sub.skip_input_indices == (1,)    # a constant: not reached
            assert sqd.skip_input_indices == (1,)    # reached, but a StopGradient
            raise RuntimeError("the call failed")
    assert not hasattr(sub, "skip_input_indices") and not hasattr(sqd, "skip_input_indices")
    with tf_internal.fast_reachability(prunable=[sub]):
        walk._MarkReachedOps([x.op], set(), [])  # pylint: disable=protected-access
        walk._MarkReachedOps([x.op], set(), [])  # pylint: disable=protected-access
        assert sub.skip_input_indices == (1,)    # set by the first walk, kept for its call
    assert not hasattr(sub, "skip_input_indices")


def test_a_stopped_tensor_asked_for_is_not_skipped():
    graph = tf.Graph()
    with graph.as_default():
        stopped = tf.stop_gradient(tf.constant([1.0, 2.0]))
        scaled = stopped * tf.constant(3.0)
        y = tf.reduce_sum(scaled)
    with tf_internal.fast_reachability(prunable=[scaled.op]):
        tf_internal.gradients_util_module._MarkReachedOps([stopped.op], set(), [])  # pylint: disable=protected-access
        assert scaled.op.skip_input_indices == (1,)   # the constant only
    from memsave.rewrite import plain_gradients  # pylint: disable=import-outside-toplevel
    with graph.as_default():
        grad = plain_gradients([y], [stopped], prunable=[scaled.op])[0]
    with tf.compat.v1.Session(graph=graph) as session:
        assert session.run(grad).tolist() == [3.0, 3.0]


def test_gradients_with_prunable_ops_build_fewer_ops_and_give_tf_values():
    from memsave.rewrite import plain_gradients  # pylint: disable=import-outside-toplevel
    graph, x, y, prunable = _pruning_graph()
    grads, made = [], []
    with graph.as_default():
        for ops in (None, prunable):
            before = len(graph.get_operations())
            grads.append(plain_gradients([y], [x], prunable=ops)[0])
            made.append(len(graph.get_operations()) - before)
    (plain, pruned), (plain_ops, pruned_ops) = grads, made
    assert pruned_ops < plain_ops
    assert not any(hasattr(op, "skip_input_indices") for op in prunable)
    with tf.compat.v1.Session(graph=graph) as session:
        a, b = session.run([plain, pruned], {x: [[0.5, -1.0, 2.0, 0.25], [1.5, 0.0, -2.0, 3.0],
                                                 [1.0, 1.0, -0.5, 2.5]]})
    assert (a == b).all() and abs(a).max() > 0


def test_a_pipelines_declared_batch_size_is_read_without_iterating_it():
    rows = tf.data.Dataset.from_tensor_slices(np.zeros((1000, 3), np.float32))

    def same(x):
        return x

    declared = tf_internal.declared_batch_size
    assert declared(rows.batch(64)) == 64
    assert declared(rows.shuffle(100, seed=1).batch(64).prefetch(2).repeat().cache()) == 64
    assert declared(rows.batch(64, num_parallel_calls=2)) == 64
    assert declared(rows.padded_batch(32)) == 32
    assert declared(rows.filter(lambda x: True).batch(50)) == 50   # unknown count: the size
    assert declared(rows.take(10).batch(64)) == 10                  # fewer rows than a batch
    assert declared(rows) is None
    assert declared(rows.batch(64).map(same)) is None               # a map may change it
    assert declared(rows.batch(64).unbatch().batch(8)) == 8
