"""Deep copies of the function bodies of functional control flow.

A ``While``, ``If`` or ``Case`` op made by ``tf.while_loop``/``tf.cond``
carries, besides its function attributes, the Python ``FuncGraph`` objects it
was traced from (``op._body_graph``, ``op._true_graph``, ...). TensorFlow's
gradient of the op works on those graphs: their captures say which inputs
are loop invariants or captured variables, and nested control-flow ops inside
them carry their own graphs. When they are missing, the gradient rebuilds
the bodies from the function library, and that rebuild loses what it cannot
read back from a ``FunctionDef``: a variable read by a loop nested in
another loop gets a zero gradient, a ``tf.cond`` in a loop body that reads a
variable has no handle data. The gradient also rewrites the op and its
bodies (to expose intermediates), naming the new functions after the old
ones; two ops sharing bodies then collide.

So a copy of such an op gets a deep copy of its bodies: new ``FuncGraph``
objects of the same kinds, with the same inputs, captures, outputs and ops,
nested control flow copied the same way, each registered under a new name.
The copy then differentiates exactly like the original. Bodies the original
does not carry (a graph imported from a ``GraphDef``) are rebuilt first, the
way TensorFlow's own gradient would rebuild them.
"""

import inspect

import tensorflow as tf

from memsave import tf_internal
from memsave.graph import optable
from memsave.graph.walk import topo_order

# op type -> (index of the first input the bodies see, [(function attr, Python attr)]).
# A ``Case`` has one list attribute; its bodies are ``_branch_graph_<i>``.
_WHILE = (0, (("cond", "_cond_graph"), ("body", "_body_graph")))
_IF = (1, (("then_branch", "_true_graph"), ("else_branch", "_false_graph")))
_CASE = (1, (("branches", "_branch_graph_%d"),))
BODIES = {
    "While": _WHILE, "StatelessWhile": _WHILE,
    "If": _IF, "StatelessIf": _IF,
    "Case": _CASE, "StatelessCase": _CASE,
}


def has_bodies(op):
    return op.type in BODIES


def is_cond(op):
    """An ``If`` or a ``Case``, stateless or not."""
    return BODIES.get(op.type) in (_IF, _CASE)


def is_loop(op):
    """A ``While``: its gradient adds inputs to the forward loop (its accumulators),
    so an op may then read tensors made after it. (A call's or a cond's
    gradient only adds outputs to the forward op.)"""
    return BODIES.get(op.type) is _WHILE


def copyable(op):
    """Whether :func:`copy_bodies` can copy ``op``'s bodies (nested ones included).

    Bodies are rebuilt as new graphs of their own class. The bodies of a
    gradient of a loop or cond (double backprop: a gradient penalty through
    a ``tf.while_loop``) are TensorFlow's gradient graph classes, which are
    built from the forward op and cannot be made that way; such an op is
    kept in place instead (see :func:`memsave.graph.stateful.is_pinned`).
    """
    for py_attr in body_attrs(op):
        body = getattr(op, py_attr, None)
        if body is None:
            continue   # rebuilt from the function library as a plain body
        if not _constructible(type(body)):
            return False
        if not all(copyable(inner) for inner in body.get_operations() if has_bodies(inner)):
            return False
    return True


def _constructible(cls):
    """Whether ``cls(name, collections=None)`` builds a body (see clone_func_graph)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False
    return "collections" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _body_slots(op):
    """``[(attr key, position in a list attr or None, Python attr, function name)]``."""
    _, attrs = BODIES[op.type]
    out = []
    for key, py_attr in attrs:
        value = op.node_def.attr[key]
        if value.HasField("func"):
            out.append((key, None, py_attr, value.func.name))
        else:
            out.extend((key, i, py_attr % i, f.name) for i, f in enumerate(value.list.func))
    return out


def body_attrs(op):
    """The names of the Python attributes that hold ``op``'s bodies (FuncGraphs)."""
    return [py_attr for _, _, py_attr, _ in _body_slots(op)]


def _input_shapes(op, offset):
    if offset == 0:   # While: the loop variables' shapes
        return [tf.TensorShape(s) for s in op.get_attr("output_shapes")]
    return [t.shape for t in op.inputs[offset:]]


def _source_body(op, attr_name, offset, func_name):
    """The FuncGraph ``op`` runs for ``attr_name``, rebuilt if ``op`` does not carry it."""
    body = getattr(op, attr_name, None)
    if body is not None:
        return body
    body = tf_internal.get_func_graph(op, _input_shapes(op, offset), func_name)
    for outer, inner in zip(op.inputs[offset:], body.inputs):
        tf_internal.copy_handle_data(outer, inner)
    return body


def _bodies_of(op):
    """``[(attr key, position in a list attr or None, Python attr, source FuncGraph)]``."""
    offset, _ = BODIES[op.type]
    return [(key, position, py_attr, _source_body(op, py_attr, offset, name))
            for key, position, py_attr, name in _body_slots(op)]


def runs_users_gradient(op, memo):
    """Whether differentiating ``op`` runs a gradient a user wrote: ``op``'s
    own (a ``tf.custom_gradient``, a ``gradient_override_map``: the
    ``_gradient_op_type`` attribute), or one inside a function it calls or a
    control-flow body of it. TensorFlow applies a gradient once, to the sum
    of the gradients its outputs receive; its own gradients are linear in
    that sum, a user's need not be (one that clips it is not).
    ``memo``: ``{FuncGraph id: answer}``, shared across calls."""
    return _has_users_gradient(op) or _found_inside(op, _has_users_gradient, memo)


def gives_sparse_rows(op, memo):
    """Whether differentiating ``op`` gives a table IndexedSlices, one row per
    lookup: a gather (:data:`optable.SPARSE_GRADIENT`), a sparse segment
    reduction asked for a sparse gradient (a row per distinct id,
    :data:`optable.SPARSE_GRADIENT_IF_ASKED`), or one inside a function it
    calls or a cond's branch (a loop's gradient is dense).
    Differentiated in several segments, each on part of its output
    gradient, it gives each lookup a row per segment where TensorFlow gives
    one: the same sum, other rows (Adam squares each). ``memo``:
    ``{FuncGraph id: answer}``, shared across calls (not with
    :func:`runs_users_gradient`'s)."""
    return _is_gather(op) or _found_inside(op, _is_gather, memo, enter=_not_a_loop)


def _has_users_gradient(op):
    try:
        op.get_attr("_gradient_op_type")
        return True
    except ValueError:
        return False


def _is_gather(op):
    if op.type in optable.SPARSE_GRADIENT_IF_ASKED:
        try:
            return bool(op.get_attr("sparse_gradient"))
        except ValueError:
            return False
    return op.type in optable.SPARSE_GRADIENT


def _not_a_loop(op):
    return not is_loop(op)


def _found_inside(op, found, memo, enter=lambda op: True):
    """Whether ``found`` holds for an op of a function ``op`` calls or of a
    control-flow body of it, at any depth, looking only into ops ``enter``
    accepts."""
    if not enter(op):
        return False
    if has_bodies(op):
        inner = [body for _, _, _, body in _bodies_of(op)]
    elif tf_internal.is_function_call(op):
        inner = [tf_internal.called_graph(op)]
    else:
        return False
    for graph in inner:
        if graph is None:
            continue
        if id(graph) not in memo:
            memo[id(graph)] = False   # a recursive function is not one
            memo[id(graph)] = any(found(o) or _found_inside(o, found, memo, enter)
                                  for o in graph.get_operations())
        if memo[id(graph)]:
            return True
    return False


def loop_body(op):
    """The body FuncGraph of a ``While`` ``op`` (rebuilt if ``op`` does not carry it)."""
    for key, _, _, body in _bodies_of(op):
        if key == "body":
            return body
    raise ValueError("%s is a %s, not a while loop" % (op.name, op.type))


def copy_bodies(op, inputs, outer_graph, create_op):
    """Deep copies of ``op``'s bodies for a copy of ``op`` that reads ``inputs``.

    Returns ``(attrs, graphs)``: the function attributes the copy must carry
    (pointing at the new, registered functions) and ``{Python attr: FuncGraph}``
    to set on the copy. ``create_op(graph, op, inputs, name, attrs_override,
    control)`` creates one copied op (see ``memsave.graph.edit``).
    """
    offset, _ = BODIES[op.type]
    external = list(inputs[offset:])
    attrs, graphs, lists = {}, {}, {}
    for key, position, py_attr, source in _bodies_of(op):
        new = clone_func_graph(source, outer_graph, external, create_op)
        name = tf_internal.create_new_tf_function(new)
        graphs[py_attr] = new
        old = op.node_def.attr[key]
        if position is None:
            attrs[key] = tf.compat.v1.AttrValue(func=tf.compat.v1.NameAttrList(
                name=name, attr=old.func.attr))
        else:
            lists.setdefault(key, []).append(tf.compat.v1.NameAttrList(
                name=name, attr=old.list.func[position].attr))
    for key, funcs in lists.items():
        attrs[key] = tf.compat.v1.AttrValue(
            list=tf.compat.v1.AttrValue.ListValue(func=funcs))
    return attrs, graphs


def clone_func_graph(source, outer_graph, external, create_op):
    """A new FuncGraph like ``source``, living in ``outer_graph``.

    ``external`` are the tensors of ``outer_graph`` that the new body's
    inputs stand for (the copied op's inputs): a capture of ``source`` at
    input ``k`` becomes a capture of ``external[k]``.
    """
    name = tf_internal.unique_fn_name("", "%s_memsave" % source.name)
    with outer_graph.as_default():
        # Control-flow FuncGraphs read their outer graph at construction.
        new = type(source)(name, collections=None)
    new.outer_graph = outer_graph
    for fn in tf_internal.graph_functions(source):
        # Functions the body calls (PartitionedCall) go with it.
        tf_internal.add_function(new, fn)
    mapping = {}
    with new.as_default():
        for ph in source.inputs:
            p = tf.compat.v1.placeholder(ph.dtype, ph.shape, name=ph.op.name)
            tf_internal.copy_handle_data(ph, p)
            mapping[ph.ref()] = p
        new.inputs = [mapping[ph.ref()] for ph in source.inputs]
        position = {ph.ref(): k for k, ph in enumerate(source.inputs)}
        for _, internal in source.captures:
            k = position.get(internal.ref())
            if k is not None and k < len(external):
                new.replace_capture(external[k], new.inputs[k])
        copies = {}
        input_ops = {ph.op for ph in source.inputs}
        for op in topo_order(set(source.get_operations()) - input_ops):
            inputs = [mapping.get(t.ref(), t) for t in op.inputs]
            control = [copies[c] for c in op.control_inputs if c in copies]
            copy = create_op(new, op, inputs, op.name, control)
            copies[op] = copy
            for old_t, new_t in zip(op.outputs, copy.outputs):
                mapping[old_t.ref()] = new_t
    new.outputs = [mapping[t.ref()] for t in source.outputs]
    new.control_outputs = [copies[op] for op in source.control_outputs if op in copies]
    new.structured_outputs = tf.nest.map_structure(
        lambda t: mapping.get(t.ref(), t) if _is_graph_tensor(t) else t,
        source.structured_outputs)
    new.variables = list(source.variables)
    return new


def _is_graph_tensor(t):
    return hasattr(t, "ref") and hasattr(t, "graph") and not isinstance(
        t, tf_internal.FuncGraph)
