"""Graph edits: copying ops with replaced inputs, control inputs, captures.

Every edit here only *adds* ops to a graph. The one mutation of an existing
op, adding control inputs, refuses to touch an op that an open Session may
already have run, because such a change is silently ignored by that session.
"""

import gc
import logging
import weakref

from tensorflow.python.client import session as tf_session
from tensorflow.python.framework import func_graph as tf_func_graph
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import handle_data_util
from tensorflow.python.ops import resource_variable_ops

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
    Devices, output shapes, handle data, attributes (including function
    attributes of control-flow and call ops) and the gradient function are
    kept. Control inputs among copied ops are mapped to the copies; control
    inputs on ops outside the set are kept as they are. Every copy also waits
    for the ops in ``wait_for``, which stops Grappler from merging the copy
    back into its original (CSE) or hoisting it into the forward pass.
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

    # Control inputs go straight onto the new ops: a control_dependencies()
    # block would also mark each dependency with an attribute, mutating ops
    # a Session may already have run.
    with graph.name_scope(None), graph.control_dependencies(None):
        for op in order:
            new = graph._create_op_internal(  # pylint: disable=protected-access
                op.type,
                [source(t) for t in op.inputs],
                dtypes=[o.dtype for o in op.outputs],
                input_types=op._input_types,  # pylint: disable=protected-access
                name="%s/%s" % (scope, op.name),
                attrs=dict(op.node_def.attr),
                op_def=op.op_def,
                compute_device=False)
            new._set_device(op.device)  # pylint: disable=protected-access
            new._gradient_function = op._gradient_function  # pylint: disable=protected-access
            for old_t, new_t in zip(op.outputs, new.outputs):
                new_t.set_shape(old_t.shape)
                handle_data_util.copy_handle_data(old_t, new_t)
            control = [copies.get(c, c) for c in op.control_inputs] + wait_for
            if control:
                new._add_control_inputs(control)  # pylint: disable=protected-access
            copies[op] = new
            _created_ops.add(new)
    return copies


def graph_tensor(x, graph):
    """The graph tensor that stands for ``x`` in ``graph``.

    Resource variables become their handle. Inside a ``tf.function`` the
    handle of a variable created outside is an EagerTensor; it is captured
    into the FuncGraph, which gives the placeholder ops actually read.
    """
    if resource_variable_ops.is_resource_variable(x):
        x = x.handle
    elif hasattr(x, "value") and resource_variable_ops.is_resource_variable(getattr(x, "value", None)):
        # Keras 3 variables wrap a tf.Variable in ``.value``.
        x = x.value.handle
    if isinstance(x, tf_ops.EagerTensor) or (
            hasattr(x, "graph") and x.graph is not graph and isinstance(graph, tf_func_graph.FuncGraph)):
        if not isinstance(graph, tf_func_graph.FuncGraph):
            raise ValueError("%r belongs to another graph than the one being differentiated" % (x,))
        x = graph.capture(x)
    return x
