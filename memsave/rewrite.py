"""Execute a plan: recompute forward segments and chain partial gradients.

Given the kept tensors (checkpoints), the backward pass is split into
segments. The first copies the ops from the ys down to the checkpoints and
differentiates the copy with respect to the checkpoints it reads and the xs.
Then, for groups of checkpoints in reverse topological order, the ops below
each group are copied down to the next checkpoints and differentiated with
``grad_ys`` set to the gradients the group has accumulated.

Checkpoints are disconnected by passing them to ``tf.gradients`` as
``stop_gradients``: backprop through a copy stops at the checkpoint it reads,
exactly as if it read ``tf.stop_gradient(checkpoint)``, but no extra op is
added and ops that must not be copied (stateful random ops) are handled the
same way. Every copied op waits (control inputs) for all gradients of the
segment processed before it, so recomputation happens just in time and
Grappler cannot merge the copies back into the forward pass.
"""

import logging

import toposort

from tensorflow.python.framework import indexed_slices
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import gradients_util
from tensorflow.python.ops import math_ops
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients

from memsave.graph import backward_ops, copy_ops

logger = logging.getLogger("memsave")


def plain_gradients(ys, xs, grad_ys=None, **kwargs):
    """TensorFlow's own gradients, called below every patch point."""
    graph = ys[0].graph
    with graph._mutation_lock():  # pylint: disable=protected-access
        return gradients_util._GradientsHelper(ys, xs, grad_ys, **kwargs)  # pylint: disable=protected-access


def aggregate(grads):
    """Sum partial gradients; IndexedSlices stay sparse unless mixed with dense."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return None
    if len(grads) == 1:
        return grads[0]
    if all(isinstance(g, indexed_slices.IndexedSlices) for g in grads):
        shape = next((g.dense_shape for g in grads if g.dense_shape is not None), None)
        return indexed_slices.IndexedSlices(
            array_ops.concat([g.values for g in grads], axis=0),
            array_ops.concat([g.indices for g in grads], axis=0), shape)
    return math_ops.add_n([tf_ops.convert_to_tensor(g) for g in grads])


class _Accumulator:
    """Running sums of partial gradients per tensor ref.

    Each new partial is added to the running sum at once, so only one buffer
    per checkpoint stays alive between segments; keeping the partials and
    summing them when needed would hold all of them (DenseNet-style graphs
    would keep O(n^2) activations' worth of partial gradients).
    """

    def __init__(self):
        self._sums = {}

    def add(self, t, grad):
        """Add a partial gradient; return the new running sum (None if none)."""
        if grad is None:
            return None
        self._sums[t.ref()] = total = aggregate([self._sums.get(t.ref()), grad])
        return total

    def total(self, t):
        return self._sums.get(t.ref())


def _checkpoint_levels(region, checkpoints, stop):
    """Checkpoints grouped so that each group only depends on earlier ones."""
    deps = {}
    for r in checkpoints:
        hit = {}
        backward_ops([r.op], stop_at=stop, within=region.ops, stopped=hit)
        hit.pop(r.ref(), None)
        deps[r.ref()] = set(hit)
    return [sorted(level, key=lambda ref: (ref.deref().op._id, ref.deref().value_index))  # pylint: disable=protected-access
            for level in toposort.toposort(deps)]


def rewrite(region, checkpoints, grad_ys=None, name="gradients", **grad_kwargs):
    """Gradients of ``region.ys`` w.r.t. ``region.xs``, recomputing between ``checkpoints``.

    ``checkpoints`` must be region tensors and must include
    ``region.forced`` (which holds the xs computed inside the region). A y
    among them starts with its ``grad_ys``. Returns one gradient (or None)
    per x.
    """
    ys, xs = region.ys, region.xs
    unconnected = grad_kwargs.pop("unconnected_gradients", UnconnectedGradients.NONE)
    user_stops = list(grad_kwargs.pop("stop_gradients", None) or [])
    stop = {t.ref(): t for t in checkpoints}
    # xs computed inside the region are checkpoints (region.forced): their
    # gradients accumulate like a checkpoint's. Each leaf x is asked once.
    leaf_xs = list({x.ref(): x for x in region.leaf_xs}.values())
    within = region.copyable
    d_cp, d_xs = _Accumulator(), _Accumulator()
    segment = 0

    def run_segment(boundary, seeds, grads, wait_for):
        """Copy the ops behind ``seeds`` and differentiate ``boundary``'s copy."""
        nonlocal segment
        seed_ops = [op for op in seeds if op in within]
        ops = backward_ops(seed_ops, stop_at=stop, within=within) if seed_ops else set()
        copies = copy_ops(ops, wait_for=wait_for, scope="memsave_%d" % segment)
        segment += 1

        def copied(t):
            c = copies.get(t.op)
            return t if c is None else c.outputs[t.value_index]

        readers = set(ops) | {t.op for t in boundary if t.op not in copies}
        asked_cp = {t.ref(): t for op in readers for t in op.inputs if t.ref() in stop}
        asked_x = [x for x in leaf_xs
                   if any(c in readers for c in x.consumers()) or any(x is b for b in boundary)]
        targets = list(asked_cp.values()) + asked_x
        if not targets:
            return []
        stops = list(asked_cp.values()) + [copied(t) for t in user_stops]
        grads_out = plain_gradients(
            [copied(t) for t in boundary], targets, grad_ys=grads, name=name,
            stop_gradients=stops, **grad_kwargs)
        sums = [d_cp.add(t, g) for t, g in zip(asked_cp.values(), grads_out)]
        sums += [d_xs.add(t, g) for t, g in zip(asked_x, grads_out[len(asked_cp):])]
        logger.debug("memsave: segment %d copied %d ops, asked %d checkpoint(s) and %d x(s)",
                     segment - 1, len(copies), len(asked_cp), len(asked_x))
        # The next segment waits for the running sums, not just the partials,
        # so each partial is folded in (and freed) before more is recomputed.
        return [g for g in sums if g is not None]

    wait = [y.op for y in ys] + [_op(g) for g in (grad_ys or []) if g is not None]
    # A y that is a checkpoint (e.g. also an x) starts with its grad_ys; the
    # first segment runs from the other ys down to the checkpoints.
    top, top_grads = [], []
    for i, y in enumerate(ys):
        g = grad_ys[i] if grad_ys else None
        if y.ref() in stop:
            d_cp.add(y, g if g is not None else array_ops.ones_like(y))
        else:
            top.append(y)
            top_grads.append(g)
    if top:
        produced = run_segment(top, [y.op for y in top], top_grads if grad_ys else None, wait)
        if produced:
            wait = [_op(g) for g in produced]

    for level in reversed(_checkpoint_levels(region, checkpoints, stop)):
        active = [ref.deref() for ref in level if d_cp.total(ref.deref()) is not None]
        if not active:
            continue
        produced = run_segment(active, [r.op for r in active],
                               [d_cp.total(r) for r in active], wait)
        if produced:
            wait = [_op(g) for g in produced]

    results = []
    for x in xs:
        g = d_cp.total(x) if x.ref() in stop else d_xs.total(x)
        if g is None and unconnected == UnconnectedGradients.ZERO:
            g = gradients_util._ZerosLike(x)  # pylint: disable=protected-access
        results.append(g)
    return results


def _op(grad):
    if isinstance(grad, indexed_slices.IndexedSlices):
        return grad.values.op
    return grad.op
