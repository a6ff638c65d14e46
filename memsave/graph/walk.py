"""Graph walks and a deterministic topological order.

These replace ``tf.contrib.graph_editor``'s walks. Sets of *operations* are
plain Python sets (ops hash by identity); tensors are keyed by ``Tensor.ref()``
because TF2 tensors are not hashable.
"""

import collections
import heapq

import tensorflow as tf

from memsave import tf_internal


def as_op(item):
    """Return the operation behind a tensor, variable handle or operation."""
    if isinstance(item, tf.Operation):
        return item
    op = getattr(item, "op", None)
    if isinstance(op, tf.Operation):
        return op
    raise TypeError("expected a tf.Tensor or tf.Operation, got %r" % (item,))


def refs(tensors):
    """The set of ``Tensor.ref()`` keys of ``tensors``."""
    return {t.ref() for t in tensors}


def components(tensors):
    """The graph tensors of ``tensors``: each tensor, and each IndexedSlices'
    values, indices and (where it is a tensor) dense shape."""
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            yield from (c for c in (t.values, t.indices, t.dense_shape)
                        if isinstance(c, tf.Tensor))
        else:
            yield t


def _stop_refs(stop_at):
    """A walk's ``stop_at``: tensors, or already a set or dict of their refs."""
    return stop_at if isinstance(stop_at, (set, frozenset, dict)) else refs(stop_at)


def backward_ops(seeds, stop_at=(), within=None, control=False, stopped=None):
    """Ops reachable backward from ``seeds`` (seeds included).

    The walk does not cross a tensor in ``stop_at``; ops outside ``within``
    (when given) are neither included nor crossed. With ``control`` the walk
    also follows control inputs. If ``stopped`` is a dict, the ``stop_at``
    tensors the walk ran into are put in it, keyed by ref.
    """
    stop = _stop_refs(stop_at)

    def producers(op):
        for t in op.inputs:
            if t.ref() in stop:
                if stopped is not None:
                    stopped[t.ref()] = t
                continue
            yield t.op
        if control:
            yield from op.control_inputs

    return _walk(seeds, within, producers)


def forward_ops(seeds, stop_at=(), within=None, control=False, leaves=None):
    """Ops reachable forward from ``seeds`` (seeds included).

    The walk does not leave through a tensor in ``stop_at`` (tensors, or a
    set or dict of their refs), nor through one ``leaves(t)`` is false for
    (when given); ops outside ``within`` (when given) are neither included
    nor crossed.
    """
    stop = _stop_refs(stop_at)

    def consumers(op):
        for t in op.outputs:
            if t.ref() not in stop and (leaves is None or leaves(t)):
                yield from t.consumers()
        if control:
            yield from tf_internal.control_outputs(op)

    return _walk(seeds, within, consumers)


def _walk(seeds, within, neighbours):
    """The depth-first walk both directions share: ``seeds`` and the ops
    ``neighbours(op)`` leads to, transitively, never leaving ``within``."""
    seeds = [as_op(s) for s in seeds]
    seen = set()
    stack = [op for op in seeds if within is None or op in within]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(n for n in neighbours(op) if within is None or n in within)
    return seen


def topo_order(op_set):
    """Ops of ``op_set`` in topological order (data and control edges).

    Ties are broken by creation order, so the result is the same on every
    run: rewrites are reproducible and graph names are stable.
    """
    op_set = set(op_set)
    indegree = {}
    children = collections.defaultdict(list)
    for op in op_set:
        parents = {t.op for t in op.inputs if t.op in op_set}
        parents.update(c for c in op.control_inputs if c in op_set)
        indegree[op] = len(parents)
        for p in parents:
            children[p].append(op)
    heap = [(tf_internal.op_id(op), op) for op, d in indegree.items() if d == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, op = heapq.heappop(heap)
        order.append(op)
        for c in children[op]:
            indegree[c] -= 1
            if indegree[c] == 0:
                heapq.heappush(heap, (tf_internal.op_id(c), c))
    if len(order) != len(op_set):
        raise ValueError("the graph has a cycle among %d ops" % (len(op_set) - len(order)))
    return order


def differentiably_connected(xs, ys, stop_at=()):
    """For each x, whether a path of differentiable data edges leads to a y.

    This is ``tf.gradients``' own reachability (it never propagates through
    integer, boolean or string tensors, nor past ``stop_gradients``), without
    asking each op's gradient function: an op whose gradient is None (Floor,
    Round) still counts as connected here.
    """
    # Like tf.gradients, a stop tensor gets its gradient but its op passes none on.
    stop_ops = {t.op for t in stop_at}
    reaching = set()   # refs of differentiable tensors with a path to a y
    frontier = [y for y in ys if carries_gradient(y)]
    while frontier:
        t = frontier.pop()
        if t.ref() in reaching:
            continue
        reaching.add(t.ref())
        if t.op not in stop_ops:
            frontier.extend(i for i in t.op.inputs if carries_gradient(i))
    return [carries_gradient(x) and x.ref() in reaching for x in xs]


def carries_gradient(t):
    """Whether ``tf.gradients`` backpropagates through ``t`` (its dtype is
    trainable: floating, complex, and also ``resource`` (variable handles)
    and ``variant`` (TensorLists of loops, ``map_fn``, TensorArrays))."""
    dtype = t.dtype.base_dtype
    return dtype.is_floating or dtype.is_complex or dtype.name in ("resource", "variant")
