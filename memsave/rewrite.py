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

import dataclasses
import logging

import toposort

from tensorflow.python.framework import indexed_slices
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import gradients_util
from tensorflow.python.ops import math_ops
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients

from memsave.graph import backward_ops, copy_ops
from memsave.graph.schedule import reducers_first

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


@dataclasses.dataclass(frozen=True)
class SwapConfig:
    """Where and when offloaded checkpoints move (see :class:`_Swapper`)."""

    tensors: tuple                      # checkpoints to keep in host memory
    host_device: str = "/device:CPU:0"
    ahead: int = 1                      # swap-in this many backward ops early
    groupby: int = 5                    # reuse a swap-in this many ops later


class _Swapper:
    """Swap-out and swap-in copies of offloaded checkpoints.

    A swap-out is an ``Identity`` on the host device, right after the forward
    pass produces the tensor; nothing else on the device reads the original
    in the backward pass, so the device frees it once the forward is done.
    Each backward segment that reads the tensor gets a swap-in (an
    ``Identity`` on the tensor's own device) triggered, by a control input,
    ``ahead`` ops before the segment starts in the order the rewrite builds
    the backward pass (a topological order), so the transfer overlaps
    compute. A swap-in is shared by segments at most ``groupby`` ops apart.
    """

    def __init__(self, graph, config, scope):
        self.graph, self.config, self.scope = graph, config, scope
        self.swap_ops = set()
        self.backward = []          # ops the rewrite made, in creation order
        self._seen = len(graph.get_operations())
        self.host = {}
        self.current = {}           # ref -> (swap-in tensor, backward position of last use)
        for t in config.tensors:
            self.host[t.ref()] = self._identity(t, t, config.host_device, "swap_out", ())

    def _identity(self, source, original, device, kind, control):
        with self.graph.name_scope(None), self.graph.control_dependencies(None):
            name = "%s/%s_%d/%s" % (self.scope, original.op.name, original.value_index, kind)
            out = array_ops.identity(source, name=name)
        out.op._set_device(device)  # pylint: disable=protected-access
        if control:
            out.op._add_control_inputs(list(control))  # pylint: disable=protected-access
        self.swap_ops.add(out.op)
        return out

    def _sync(self):
        ops = self.graph.get_operations()
        self.backward.extend(op for op in ops[self._seen:] if op not in self.swap_ops)
        self._seen = len(ops)

    def swap_in(self, reads, wait_for):
        """``{ref: swapped-in tensor}`` for the offloaded tensors in ``reads``."""
        self._sync()
        position = len(self.backward)
        out = {}
        for ref, t in reads.items():
            if ref not in self.host:
                continue
            hit = self.current.get(ref)
            if hit is not None and position - hit[1] <= self.config.groupby:
                out[ref] = hit[0]
                continue
            ahead = self.config.ahead
            trigger = ([self.backward[max(0, position - ahead)]]
                       if ahead > 0 and self.backward else wait_for)
            out[ref] = self._identity(self.host[ref], t, t.op.device, "swap_in", trigger)
        return out

    def used(self, swapped):
        """Record that the segment just built read ``swapped``."""
        self._sync()
        for ref, t in swapped.items():
            self.current[ref] = (t, len(self.backward))


def rewrite(region, checkpoints, grad_ys=None, name="gradients", swap=None, **grad_kwargs):
    """Gradients of ``region.ys`` w.r.t. ``region.xs``, recomputing between ``checkpoints``.

    ``checkpoints`` must be region tensors and must include
    ``region.forced`` (which holds the xs computed inside the region). A y
    among them starts with its ``grad_ys``. With ``swap`` (a
    :class:`SwapConfig`), its tensors, all checkpoints, wait in host memory.
    Returns one gradient (or None) per x.
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
    swapper = _Swapper(region.graph, swap, "memsave_offload") if swap and swap.tensors else None

    def run_segment(boundary, seeds, grads, wait_for):
        """Copy the ops behind ``seeds`` and differentiate ``boundary``'s copy."""
        nonlocal segment
        seed_ops = [op for op in seeds if op in within]
        ops = backward_ops(seed_ops, stop_at=stop, within=within) if seed_ops else set()
        swapped = {}
        if swapper is not None:
            swapped = swapper.swap_in(
                {t.ref(): t for op in ops for t in op.inputs if t.ref() in stop}, wait_for)
        copies = copy_ops(ops, replace=swapped, wait_for=wait_for, scope="memsave_%d" % segment)
        segment += 1

        def copied(t):
            c = copies.get(t.op)
            return t if c is None else c.outputs[t.value_index]

        readers = set(ops) | {t.op for t in boundary if t.op not in copies}
        asked_cp = {t.ref(): t for op in readers for t in op.inputs if t.ref() in stop}
        asked_x = [x for x in leaf_xs
                   if any(c in readers for c in x.consumers()) or any(x is b for b in boundary)]
        # Offloaded checkpoints are read (and differentiated) as their swap-ins.
        read_cp = [swapped.get(ref, t) for ref, t in asked_cp.items()]
        targets = read_cp + asked_x
        if not targets:
            return []
        stops = read_cp + [copied(t) for t in user_stops]
        before = len(region.graph.get_operations())
        grads_out = plain_gradients(
            [copied(t) for t in boundary], targets, grad_ys=grads, name=name,
            stop_gradients=stops, **grad_kwargs)
        reducers_first(region.graph.get_operations()[before:])
        if swapper is not None:
            swapper.used(swapped)
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
