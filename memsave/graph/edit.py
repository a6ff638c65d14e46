"""Graph edits: copying ops with replaced inputs, control inputs, captures.

Every edit here only *adds* ops to a graph (control inputs go on the new
ops only): a Session that already ran the graph ignores changes to ops it
ran, so memsave never makes any.
"""

import logging

import tensorflow as tf

from memsave import tf_internal
from memsave.graph import functions
from memsave.graph.walk import topo_order

logger = logging.getLogger("memsave")

class Copies:
    """What :func:`copy_ops` made: ``of`` maps each original op to its copy;
    ``made`` lists every new op in creation order, the gates that some
    copies read through included (see :data:`_WAIT_THROUGH_INPUT`)."""

    def __init__(self):
        self.of = {}
        self.made = []

    def output(self, t):
        """The copy of tensor ``t``, or ``t`` itself when its op was not copied."""
        c = self.of.get(t.op)
        return t if c is None else c.outputs[t.value_index]


def copy_ops(op_set, replace=None, wait_for=(), scope="memsave"):
    """Copy ``op_set`` into its graph and return a :class:`Copies`.

    Inputs are resolved in order: ``replace`` (a ``{tensor.ref(): tensor}``
    map) first, then copies of ops in ``op_set``, else the original tensor.
    Devices, output shapes, handle data, attributes and the gradient function
    are kept; control-flow ops get deep copies of their bodies (see
    :mod:`memsave.graph.functions`). Control inputs among copied ops are
    mapped to the copies; control inputs on ops outside the set are kept as
    they are. Every copy also waits for ``wait_for`` (ops or tensors; directly, or
    through a copy it reads), which stops Grappler from merging the copy back
    into its original (CSE) or hoisting it into the forward pass.

    In a Session's graph the originals' outputs become unfeedable: a value
    fed for one would reach the forward pass and plain gradients but not the
    copy, which computes it again, so the gradients would silently differ;
    ``Session.run`` raises "may not be fed" instead.
    """
    replace = dict(replace or {})
    order = topo_order(op_set)
    result = Copies()
    if not order:
        return result
    graph = order[0].graph
    copies = result.of

    def source(t):
        hit = replace.get(t.ref())
        if hit is not None:
            return hit
        if t.op in copies:
            return copies[t.op].outputs[t.value_index]
        return t

    # A copy that reads another copy runs after it, hence after wait_for:
    # only the first copies on each path wait explicitly (every copy waiting
    # gave ResNet50's rewrite 29,896 control edges; Grappler removed the
    # redundant ones).
    members = set(order)
    first = [op for op in order if not any(t.op in members for t in op.inputs)
             and not any(c in members for c in op.control_inputs)]
    waits = joined_waits(graph, first, wait_for, scope)
    for op in order:
        inputs = [source(t) for t in op.inputs]
        control = [copies.get(c, c) for c in op.control_inputs] + waits.get(op, [])
        copies[op] = copy_op(graph, op, inputs, "%s/%s" % (scope, op.name), control,
                             made=result.made)
    if not isinstance(graph, tf_internal.FuncGraph):   # a tf.function is never fed
        for op in order:
            for t in op.outputs:
                graph.prevent_feeding(t)
    return result


def joined_waits(graph, first, wait_for, scope):
    """``{op: the ops it (or its copy) waits for}`` for each op in ``first``.

    ``first`` are the ops of a segment that start it (its first copies, or
    gradient ops that read nothing the segment made) and ``wait_for`` the
    running sums (tensors or ops) of the segment before: about 30 on
    ResNet50, for up to hundreds of ops, and m ops each waiting for k sums is
    m x k control edges (4,138 of the 5,028 the first copies alone made on
    ResNet50's rewrite). Where that is more than m + k, the ops on a device
    wait for one NoOp there that waits for the k sums: the same order, and
    1,520 control edges in all for ResNet50's rewrite (the copies' joins
    alone took a tenth off its Grappler time).
    """
    wait_for = [d if isinstance(d, tf.Operation) else d.op for d in wait_for]
    by_device = {}
    for op in first:
        by_device.setdefault(op.device, []).append(op)
    waits = {}
    for device, ops in by_device.items():
        if (len(ops) - 1) * (len(wait_for) - 1) <= 1:
            waits.update((op, list(wait_for)) for op in ops)
            continue
        # Named after the first op it serves, so that its name says where it
        # belongs (a replica's scope, a layer's).
        with graph.name_scope(None), graph.control_dependencies(None):
            join = tf_internal.create_op(graph, "NoOp", [], dtypes=[],
                                         name="%s/%s/memsave_wait" % (scope, ops[0].name),
                                         compute_device=False)
        tf_internal.set_device(join, device)
        tf_internal.add_control_inputs(join, wait_for)
        waits.update((op, [join]) for op in ops)
    return waits


def copy_op(graph, op, inputs, name, control=(), made=None):
    """One copy of ``op`` in ``graph`` reading ``inputs`` and waiting for ``control``.

    Control inputs go straight onto the new op: a control_dependencies()
    block would also mark each dependency with an attribute, mutating ops a
    Session may already have run. Every op created (a gate, then the copy)
    is appended to ``made`` when given.
    """
    control = list(control)
    with graph.name_scope(None), graph.control_dependencies(None):
        if control and op.type in _WAIT_THROUGH_INPUT:
            inputs = list(inputs)
            inputs[0] = _gated(graph, inputs[0], control, op.device, name + "/memsave_gate")
            control = []
            if made is not None:
                made.append(inputs[0].op)
        attrs = dict(op.node_def.attr)
        bodies = {}
        if functions.has_bodies(op):
            new_attrs, bodies = functions.copy_bodies(op, inputs, graph, copy_op)
            attrs.update(new_attrs)
        new = tf_internal.create_op(
            graph,
            op.type,
            inputs,
            dtypes=[o.dtype for o in op.outputs],
            input_types=tf_internal.input_types(op),
            name=name,
            attrs=attrs,
            op_def=op.op_def,
            compute_device=False)
    tf_internal.set_device(new, op.device)
    tf_internal.copy_gradient_function(op, new)
    for py_attr, body in bodies.items():
        setattr(new, py_attr, body)
    for old_t, new_t in zip(op.outputs, new.outputs):
        new_t.set_shape(old_t.shape)
        tf_internal.copy_handle_data(old_t, new_t)
    if control:
        tf_internal.add_control_inputs(new, control)
    if made is not None:
        made.append(new)
    return new


# Copies of these ops wait through a gated first input (an Identity that
# carries the control inputs) instead of carrying control inputs themselves:
# - While, StatelessWhile: while_v2's gradient, in a plain Graph, appends
#   accumulator inputs to the forward While, and a NodeDef must list data
#   inputs before control inputs.
# - Pow: Grappler's arithmetic optimizer turns Pow(x, 3) into x * Square(x)
#   by copying the Pow node and dropping its *last* input, which is a control
#   input when there is one; the Square then has two data inputs, Grappler
#   rejects the whole function's optimization ("Ignoring multi-device
#   function optimization failure") and the step runs unoptimized (GELU's
#   x**3 made GPT2 and BERT steps 20-30% slower, TF 2.21).
_WAIT_THROUGH_INPUT = frozenset({"While", "StatelessWhile", "Pow"})


def _gated(graph, t, control, device, name):
    """An Identity of ``t`` that runs only after the ops in ``control``."""
    out = _identity(graph, t, device, name, {})
    tf_internal.add_control_inputs(out.op, control)
    return out


def _identity(graph, t, device, name, extra_attrs):
    with graph.name_scope(None), graph.control_dependencies(None):
        op = tf_internal.create_op(
            graph, "Identity", [t], dtypes=[t.dtype], name=name,
            attrs={"T": tf.compat.v1.AttrValue(type=t.dtype.as_datatype_enum), **extra_attrs},
            compute_device=False)
    tf_internal.set_device(op, device)
    op.outputs[0].set_shape(t.shape)
    tf_internal.copy_handle_data(t, op.outputs[0])
    return op.outputs[0]


def fence(grad):
    """``grad`` (a tensor or IndexedSlices) read through an Identity Grappler keeps.

    A checkpointed backward pass hands each segment's gradients to the next
    one, whose recomputation waits for them. If an op of the next segment
    read a gradient tensor that an op of this segment also reads, a fusion
    of the two (oneDNN's Conv2DBackpropFilter + BiasAddGrad, cuDNN's
    FusedBatchNormGrad + ReluGrad) would make one node both before and
    after the recomputation: "N nodes in a cycle". Fusions match direct
    data edges, so a kept Identity between segments rules out every such
    pattern, whatever the ops; Identity forwards its input's buffer.
    """
    if isinstance(grad, tf.IndexedSlices):
        shape = grad.dense_shape
        return tf.IndexedSlices(fence(grad.values), fence(grad.indices),
                                fence(shape) if isinstance(shape, tf.Tensor) else shape)
    return _identity(grad.graph, grad, grad.op.device, "memsave_fence/" + grad.op.name,
                     tf_internal.PRESERVE)


def barrier(tensors, name):
    """``tensors`` read through one XLA optimization barrier: its outputs, in order.

    Under XLA, control inputs order nothing and identical computations are
    merged (CSE), so copies of forward ops would collapse back into the
    forward pass. A recomputed segment that reads its checkpoints through a
    barrier which also takes the gradients the segment waits for is neither
    mergeable (XLA cannot see through the barrier) nor runnable before those
    gradients exist. Only inserted where XLA compiles the step.
    """
    graph = tensors[0].graph
    with graph.as_default(), graph.name_scope(None), graph.control_dependencies(None), \
            graph.device(tensors[0].op.device):
        outs = tf_internal.xla_optimization_barrier(list(tensors), name=name)
    # TensorFlow registers no gradient for the barrier; a gradient of the
    # rewritten backward pass itself (a gradient penalty) needs one. It is
    # an identity per output, set on this op only (no global registration).
    tf_internal.set_gradient_function(outs[0].op, _pass_through_gradient)
    for t, out in zip(tensors, outs):
        out.set_shape(t.shape)
    return list(outs)


# Ops whose outputs XLA may size only at run time (bounded dynamic
# dimensions): sizes that depend on values, and control flow whose branches
# or iterations may give different sizes (a cond's gradient: a gather's rows
# from one branch, none from the other). TF1 loops' Merge is here too, which
# also keeps the walk below off their back edges.
_SIZED_AT_RUN_TIME = frozenset({
    "Where", "Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2",
    "DynamicPartition", "NonMaxSuppressionV3", "NonMaxSuppressionV4",
    "NonMaxSuppressionV5", "If", "StatelessIf", "Case", "StatelessCase", "While",
    "StatelessWhile", "PartitionedCall", "StatefulPartitionedCall", "Merge",
})


class SizedUnderXla:
    """Whether XLA compiles a tensor with static sizes, which its
    optimization barrier needs ("Asked to propagate a dynamic dimension ...
    to opt-barrier ... not implemented"; a shape read off a barrier's output
    is then no compile-time constant either).

    A tensor whose static shape TF knows is static. One with unknown axes is
    static unless its size comes from an op in :data:`_SIZED_AT_RUN_TIME`,
    directly or through the sizes and integer values (shapes) its op reads:
    a ``tf.function``'s arguments are sized when XLA compiles it, so an
    unknown batch axis is no dynamic one. Answers are kept for the rewrite.
    """

    def __init__(self):
        self._at_run_time = {}

    def __call__(self, t):
        return t.shape.is_fully_defined() or not self._sized_at_run_time(t)

    def _verdict(self, t):
        """True/False where ``t`` alone decides, else None (ask its op's inputs)."""
        if not t.op.inputs:
            return False
        if t.op.type in _SIZED_AT_RUN_TIME and not t.shape.is_fully_defined():
            return True
        if t.shape.is_fully_defined() and not t.dtype.is_integer:
            return False
        return None

    def _sized_at_run_time(self, t):
        memo = self._at_run_time
        stack = [(t, False)]
        while stack:
            top, expanded = stack.pop()
            ref = top.ref()
            if expanded:
                # An input still in progress closes a cycle: taken as dynamic.
                memo[ref] = any(memo.get(i.ref()) is not False for i in top.op.inputs)
                continue
            if ref in memo:
                continue
            verdict = self._verdict(top)
            if verdict is not None:
                memo[ref] = verdict
                continue
            memo[ref] = None
            stack.append((top, True))
            stack.extend((i, False) for i in top.op.inputs if i.ref() not in memo)
        return memo[t.ref()]


def order_token(t):
    """A scalar computed from ``t``, for a barrier to wait on where ``t``
    itself cannot go through one (see :class:`SizedUnderXla`): one read
    of a gradient the segment waits for, which XLA cannot fold away."""
    graph = t.graph
    with graph.as_default(), graph.name_scope(None), graph.control_dependencies(None), \
            graph.device(t.op.device):
        return tf.reduce_sum(t, name="memsave_order_token/" + t.op.name)


def _pass_through_gradient(op, *grads):  # pylint: disable=unused-argument
    return list(grads)


def graph_tensor(x, graph):
    """The graph tensor that stands for ``x`` in ``graph``.

    Resource variables become their handle. Inside a ``tf.function`` the
    handle of a variable created outside is an EagerTensor; it is captured
    into the FuncGraph, which gives the placeholder ops actually read. So are
    tensors of graphs enclosing the FuncGraph; a tensor of an unrelated graph
    is returned unchanged.
    """
    x = _variable_tensor(x)
    if isinstance(x, tf_internal.EagerTensor):
        if not isinstance(graph, tf_internal.FuncGraph):
            raise ValueError("%r belongs to another graph than the one being differentiated" % (x,))
        return graph.capture(x)
    x_graph = getattr(x, "graph", None)
    if x_graph is not None and is_outer_graph(x_graph, graph):
        x = graph.capture(x)
    # Anything else is returned as it is; the caller reports a foreign graph.
    return x


def _variable_tensor(x):
    """``x``, or for a variable the tensor ``tf.gradients`` differentiates it by."""
    if tf_internal.is_resource_variable(x):
        return x.handle
    if isinstance(x, tf.Variable):
        # A TF1 reference variable: tf.gradients differentiates by its ref tensor.
        return tf_internal.ref_variable_tensor(x)
    if hasattr(x, "value") and tf_internal.is_resource_variable(getattr(x, "value", None)):
        # Keras 3 variables wrap a tf.Variable in ``.value``.
        return x.value.handle
    return x


def is_outer_graph(outer, graph):
    """True if ``outer`` encloses the FuncGraph ``graph`` (so it can be captured)."""
    while isinstance(graph, tf_internal.FuncGraph):
        graph = graph.outer_graph
        if graph is outer:
            return True
    return False


def reaches_xs_through_captures(ys, xs, graph):
    """Whether a y of the FuncGraph ``graph`` reads a tensor captured from an
    enclosing graph that the enclosing graph computes from an x.

    ``tf.gradients`` called in a ``tf.cond`` branch or a loop body follows
    such a capture out into the enclosing graph (``tf.hessians`` does this
    in a while body); memsave rewrites one graph, so the x would get None.
    A capture that is the x itself (Keras' steps in a while loop capture
    the variables' handles) is read inside and is no such path.
    """
    if not isinstance(graph, tf_internal.FuncGraph) or all(
            isinstance(external, tf_internal.EagerTensor) for external, _ in graph.captures):
        return False
    targets = {t.ref() for t in map(_variable_tensor, xs)
               if isinstance(t, tf.Tensor) and not isinstance(t, tf_internal.EagerTensor)}
    externals = {}   # graph -> {placeholder ref: the captured tensor of an enclosing graph}

    def external_of(t):
        g = t.graph
        if g not in externals:
            externals[g] = ({internal.ref(): external for external, internal in g.captures
                             if not isinstance(external, tf_internal.EagerTensor)}
                            if isinstance(g, tf_internal.FuncGraph) else {})
        return externals[g].get(t.ref())

    from memsave.graph.walk import backward_ops   # pylint: disable=import-outside-toplevel
    read = [t for op in backward_ops([y.op for y in ys]) for t in op.outputs]
    stack = [e for e in map(external_of, read) if e is not None and e.ref() not in targets]
    seen = set()
    while stack:   # back through the enclosing graphs, from the captured tensors
        t = stack.pop()
        if t.ref() in seen:
            continue
        seen.add(t.ref())
        if t.ref() in targets:
            return True
        outer = external_of(t)
        stack.extend([outer] if outer is not None else t.op.inputs)
    return False
