"""Graph edits: copying ops with replaced inputs, control inputs, captures.

Every edit here only *adds* ops to a graph. The one mutation of an existing
op, adding control inputs, refuses to touch an op that an open Session may
already have run, because such a change is silently ignored by that session.
"""

import gc
import logging
import weakref

from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.client import session as tf_session
from tensorflow.python.framework import func_graph as tf_func_graph
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import handle_data_util
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.ops import variables as tf_variables

from memsave.graph import functions
from memsave.graph.walk import topo_order

logger = logging.getLogger("memsave")

# Ops created by copy_ops: they are new, so no session has run them yet.
_created_ops = weakref.WeakSet()


def open_sessions(graph):
    """Open ``tf.compat.v1.Session`` objects built on ``graph``."""
    return [
        obj for obj in gc.get_objects()
        if isinstance(obj, tf_session.BaseSession)
        and obj.graph is graph and not getattr(obj, "_closed", True)
    ]


def add_control_inputs(targets, deps):
    """Make every op in ``targets`` wait for every op in ``deps``.

    Ops already depending on a dep are left alone, and an op never waits
    for itself. Raises ``RuntimeError`` when a target existed before memsave
    touched the graph and a Session is open on it: the session would keep
    running the old node and the edge would have no effect.
    """
    deps = [d.op if not isinstance(d, tf_ops.Operation) else d for d in deps]
    targets = list(targets)
    old = [op for op in targets if op not in _created_ops]
    if old and deps and open_sessions(old[0].graph):
        raise RuntimeError(
            "memsave would add control inputs to %r, which an open Session on this "
            "graph may already have run; TensorFlow ignores such edits in that "
            "session. Build the gradients before the first Session.run, or create "
            "a new Session after calling memsave." % old[0].name)
    for op in targets:
        have = set(op.control_inputs)
        new = [d for d in deps if d is not op and d not in have]
        if new:
            op._add_control_inputs(new)  # pylint: disable=protected-access


def copy_ops(op_set, replace=None, wait_for=(), scope="memsave"):
    """Copy ``op_set`` into its graph and return ``{original_op: copy}``.

    Inputs are resolved in order: ``replace`` (a ``{tensor.ref(): tensor}``
    map) first, then copies of ops in ``op_set``, else the original tensor.
    Devices, output shapes, handle data, attributes and the gradient function
    are kept; control-flow ops get deep copies of their bodies (see
    :mod:`memsave.graph.functions`). Control inputs among copied ops are
    mapped to the copies; control inputs on ops outside the set are kept as
    they are. Every copy also waits for the ops in ``wait_for``, which stops
    Grappler from merging the copy back into its original (CSE) or hoisting
    it into the forward pass.
    """
    replace = dict(replace or {})
    order = topo_order(op_set)
    if not order:
        return {}
    graph = order[0].graph
    wait_for = [d.op if not isinstance(d, tf_ops.Operation) else d for d in wait_for]
    copies = {}

    def source(t):
        hit = replace.get(t.ref())
        if hit is not None:
            return hit
        if t.op in copies:
            return copies[t.op].outputs[t.value_index]
        return t

    for op in order:
        inputs = [source(t) for t in op.inputs]
        control = [copies.get(c, c) for c in op.control_inputs] + wait_for
        copies[op] = copy_op(graph, op, inputs, "%s/%s" % (scope, op.name), control)
    return copies


def copy_op(graph, op, inputs, name, control=()):
    """One copy of ``op`` in ``graph`` reading ``inputs`` and waiting for ``control``.

    Control inputs go straight onto the new op: a control_dependencies()
    block would also mark each dependency with an attribute, mutating ops a
    Session may already have run.
    """
    control = list(control)
    with graph.name_scope(None), graph.control_dependencies(None):
        if control and op.type in _GROWS_INPUTS:
            inputs = list(inputs)
            inputs[0] = _gated(graph, inputs[0], control, op.device, name + "/memsave_gate")
            control = []
        attrs = dict(op.node_def.attr)
        bodies = {}
        if functions.has_bodies(op):
            new_attrs, bodies = functions.copy_bodies(op, inputs, graph, copy_op)
            attrs.update(new_attrs)
        new = graph._create_op_internal(  # pylint: disable=protected-access
            op.type,
            inputs,
            dtypes=[o.dtype for o in op.outputs],
            input_types=op._input_types,  # pylint: disable=protected-access
            name=name,
            attrs=attrs,
            op_def=op.op_def,
            compute_device=False)
    new._set_device(op.device)  # pylint: disable=protected-access
    new._gradient_function = op._gradient_function  # pylint: disable=protected-access
    for py_attr, body in bodies.items():
        setattr(new, py_attr, body)
    for old_t, new_t in zip(op.outputs, new.outputs):
        new_t.set_shape(old_t.shape)
        handle_data_util.copy_handle_data(old_t, new_t)
    if control:
        new._add_control_inputs(control)  # pylint: disable=protected-access
    _created_ops.add(new)
    return new


# while_v2's gradient, in a plain Graph, appends accumulator inputs to the
# forward While. A NodeDef must list data inputs before control inputs, so a
# copied While cannot carry control inputs itself; it waits through a gated
# first input (the loop counter) instead.
_GROWS_INPUTS = frozenset({"While", "StatelessWhile"})


def _gated(graph, t, control, device, name):
    """An Identity of ``t`` that runs only after the ops in ``control``."""
    gate = graph._create_op_internal(  # pylint: disable=protected-access
        "Identity", [t], dtypes=[t.dtype], name=name,
        attrs={"T": attr_value_pb2.AttrValue(type=t.dtype.as_datatype_enum)},
        compute_device=False)
    gate._set_device(device)  # pylint: disable=protected-access
    gate.outputs[0].set_shape(t.shape)
    handle_data_util.copy_handle_data(t, gate.outputs[0])
    gate._add_control_inputs(control)  # pylint: disable=protected-access
    _created_ops.add(gate)
    return gate.outputs[0]


def graph_tensor(x, graph):
    """The graph tensor that stands for ``x`` in ``graph``.

    Resource variables become their handle. Inside a ``tf.function`` the
    handle of a variable created outside is an EagerTensor; it is captured
    into the FuncGraph, which gives the placeholder ops actually read. So are
    tensors of graphs enclosing the FuncGraph; a tensor of an unrelated graph
    is returned unchanged.
    """
    if resource_variable_ops.is_resource_variable(x):
        x = x.handle
    elif isinstance(x, tf_variables.Variable):
        # A TF1 reference variable: tf.gradients differentiates by its ref tensor.
        x = x._ref()  # pylint: disable=protected-access
    elif hasattr(x, "value") and resource_variable_ops.is_resource_variable(getattr(x, "value", None)):
        # Keras 3 variables wrap a tf.Variable in ``.value``.
        x = x.value.handle
    if isinstance(x, tf_ops.EagerTensor):
        if not isinstance(graph, tf_func_graph.FuncGraph):
            raise ValueError("%r belongs to another graph than the one being differentiated" % (x,))
        return graph.capture(x)
    x_graph = getattr(x, "graph", None)
    if x_graph is not None and _is_outer_graph(x_graph, graph):
        x = graph.capture(x)
    # Anything else is returned as it is; the caller reports a foreign graph.
    return x


def _is_outer_graph(outer, graph):
    """True if ``outer`` encloses the FuncGraph ``graph`` (so it can be captured)."""
    while isinstance(graph, tf_func_graph.FuncGraph):
        graph = graph.outer_graph
        if graph is outer:
            return True
    return False
