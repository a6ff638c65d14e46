"""Order gradient ops so that large forward activations are freed early.

The gradient of ``y = matmul(x, w)`` (or a convolution) is two ops: one
reads the activation ``x`` and makes the small weight gradient, the other
makes the large input gradient ``dx`` without reading ``x``. TensorFlow
runs them in whatever order; when ``dx`` comes first, ``x``, ``dy`` and
``dx`` are alive together. Running the weight gradient first lets ``x`` go
(if nothing else in the backward pass reads it) before ``dx`` is allocated.
On a U-Net's wide concatenations this is the difference between one and two
copies of the widest tensor. Which pairs are ordered is decided by
:func:`memsave.planning.rules.reducer_runs_first`, the rule the estimator
(``memsave.planning.simulate``) models.
"""

import collections

from memsave import tf_internal
from memsave.graph.optable import METADATA
from memsave.tf_internal import op_id
from memsave.planning.rules import reducer_runs_first


def tensor_bytes(t):
    """Static byte size of ``t``, or None when its shape is not fully known."""
    if not t.shape.is_fully_defined():
        return None
    return t.shape.num_elements() * max(t.dtype.size, 1)


def _grad_scope(op):
    scope = op.name.rpartition("/")[0]
    return scope if scope.endswith("_grad") else None


def _is_ancestor(candidate, op, new_ids):
    """Whether ``candidate`` (a new op) feeds ``op`` (walks only newer ops)."""
    if op_id(candidate) > op_id(op):
        return False  # an op's inputs all exist before it
    floor = op_id(candidate)
    stack, seen = [op], set()
    while stack:
        current = stack.pop()
        if current is candidate:
            return True
        for parent in list(current.control_inputs) + [t.op for t in current.inputs]:
            pid = op_id(parent)
            if pid >= floor and pid in new_ids and pid not in seen:
                seen.add(pid)
                stack.append(parent)
    return False


def reducers_first(new_ops):
    """Make gradient ops that reduce a large forward activation to a small
    result run before their siblings (same ``*_grad`` scope) that allocate a
    large result without reading it. ``new_ops`` are the ops one gradient
    call created; anything else is forward. Returns the number of edges."""
    new_ids = {op_id(op) for op in new_ops}
    scopes = collections.defaultdict(list)
    for op in new_ops:
        scope = _grad_scope(op)
        if scope is not None:
            scopes[scope].append(op)
    added = 0
    for ops in scopes.values():
        if len(ops) < 2:
            continue
        for reducer in ops:
            if reducer.type in METADATA:
                continue
            out = sum(tensor_bytes(t) or 0 for t in reducer.outputs)
            for f in reducer.inputs:
                if op_id(f.op) in new_ids:
                    continue
                size = tensor_bytes(f)
                if not size or not reducer_runs_first(size, out, size):
                    continue
                for other in ops:
                    if (other is reducer or other.type in METADATA
                            or any(t is f for t in other.inputs)
                            or reducer in other.control_inputs
                            or not reducer_runs_first(
                                size, out, sum(tensor_bytes(t) or 0 for t in other.outputs))
                            or _is_ancestor(other, reducer, new_ids)):
                        continue
                    tf_internal.add_control_input(other, reducer)
                    added += 1
    return added
