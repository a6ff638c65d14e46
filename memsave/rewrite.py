"""Execute a plan: recompute forward segments and chain partial gradients.

Given the kept tensors (checkpoints), the backward pass is split into
segments. The first copies the ops from the ys down to the checkpoints and
differentiates the copy with respect to the checkpoints it reads and the xs.
Then, for groups of checkpoints in reverse topological order, the ops below
each group are copied down to the next checkpoints and differentiated with
``grad_ys`` set to the gradients the group has accumulated. Consecutive
groups that only differentiate kept ops share one call (see
:func:`_segment_groups`).

Checkpoints are disconnected by passing them to ``tf.gradients`` as
``stop_gradients``: backprop through a copy stops at the checkpoint it reads,
exactly as if it read ``tf.stop_gradient(checkpoint)``, but no extra op is
added and ops that must not be copied (stateful random ops) are handled the
same way. The running sums a segment hands on go through fences
(:func:`memsave.graph.edit.fence`), and every copied op of the next segment
waits (control inputs) for them, so recomputation happens just in time,
Grappler cannot merge the copies back into the forward pass, and no fusion
spans two segments. What is built is recorded for the audit
(:mod:`memsave.graph.audit`).
"""

import bisect
import collections
import dataclasses
import itertools
import logging
import math

import tensorflow as tf

from memsave import tf_internal
from memsave.graph import backward_ops, copy_ops, functions, optable
from memsave.graph.edit import SizedUnderXla, barrier, fence, joined_waits, order_token
from memsave.graph.region import (differentiable, in_place_closure, num_elements,
                                  sums_bias_in_half_precision)
from memsave.graph.schedule import reducers_first
from memsave.graph.walk import components, forward_ops

logger = logging.getLogger("memsave")

# Segments may share one tf.gradients call while all but the first recompute
# this little, against the region's largest tensor: each tensor at most
# 1/SMALL_PART of it (a batch norm's per-channel vector beside a feature
# map), 1/MERGED_PART of it in all per shared call (see _segment_groups).
SMALL_PART = 256
MERGED_PART = 16


def plain_gradients(ys, xs, grad_ys=None, skip=None, prunable=None, stops_hold=False,
                    **kwargs):
    """TensorFlow's own gradients, called below every patch point (``skip``:
    ops no ancestor of ``ys`` is among; ``prunable``: the caller's own ops,
    whose unneeded input gradients are left out; see
    :func:`tf_internal.fast_reachability`).

    ``stops_hold``: no gradient passes a tensor of ``stop_gradients``, as
    for the tape, where one it did not record is a constant. tf.gradients
    stops at such a tensor's op, except at a function call, which it
    differentiates anyway (its SymbolicGradient): the call's gradient
    reached the sources (a call on a watched tensor made before the tape),
    or failed at run time (a call reading a variable). With ``stops_hold``
    its walk does not enter such calls (one making an x it walks through:
    its consumers are reached), and they are not differentiated.
    """
    graph = ys[0].graph
    barred = None
    if stops_hold:
        barred = {t.op for t in kwargs.get("stop_gradients") or ()
                  if tf_internal.is_function_call(t.op)}
    with tf_internal.mutation_lock(graph), tf_internal.fast_reachability(skip, prunable, barred):
        return tf_internal.gradients_helper(ys, xs, grad_ys, **kwargs)


def aggregate(grads):
    """Sum partial gradients; IndexedSlices stay sparse unless mixed with dense."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return None
    if len(grads) == 1:
        return grads[0]
    if all(isinstance(g, tf.IndexedSlices) for g in grads):
        shape = next((g.dense_shape for g in grads if g.dense_shape is not None), None)
        indices = [g.indices for g in grads]
        if len({i.dtype for i in indices}) > 1:
            # Gathers with int32 and int64 ids: as TensorFlow sums them, in int64.
            indices = [tf.cast(i, tf.int64) for i in indices]
        return tf.IndexedSlices(
            tf.concat([g.values for g in grads], axis=0), tf.concat(indices, axis=0), shape)
    return tf.add_n([tf.convert_to_tensor(g) for g in grads])


def non_finite_throughout(grad):
    """``grad``, unchanged unless it is IndexedSlices with a non-finite entry:
    then every entry is NaN.

    Keras' LossScaleOptimizer checks IndexedSlices for inf/NaN by densifying
    ``is_finite`` of their rows, which ORs the rows of one index: a finite
    duplicate row hides an overflowed one. Recomputed in segments, a half-
    precision sum that overflows in plain backprop upstream (where dense
    gradients see it too) may overflow in memsave's sum across segments and
    reach only the sparse rows: an embedding model under mixed_float16 took
    such a step and its weights became NaN (2 of 12 seeds; plain's 0). A
    step whose gradient is not finite is skipped however its rows are
    checked; a finite gradient is returned as it is.
    """
    if not isinstance(grad, tf.IndexedSlices) or not grad.values.dtype.is_floating:
        return grad
    values = grad.values
    with tf.device(values.device):
        finite = tf.reduce_all(tf.math.is_finite(values))
        nan = tf.constant(float("nan"), values.dtype)
        values = tf.where(finite, values, tf.fill(tf.shape(values), nan))
    return tf.IndexedSlices(values, grad.indices, grad.dense_shape)


class _Accumulator:
    """Running sums of partial gradients per tensor ref.

    Each new partial is added to the running sum at once, so only one buffer
    per checkpoint stays alive between segments; keeping the partials and
    summing them when needed would hold all of them (DenseNet-style graphs
    would keep O(n^2) activations' worth of partial gradients).

    Sparse partials (IndexedSlices) given a ``position`` are the exception:
    they are kept apart and concatenated in the order of their positions by
    :meth:`total`, so that a variable read by several lookups gets their
    rows in the order plain backprop reaches the lookups, not the order the
    segments ran (see :func:`_backward_positions`). A concatenation as they
    come would hold as much: each holds every row so far.
    """

    def __init__(self):
        self._sums = {}
        self._rows = {}      # ref -> [position, arrival, IndexedSlices, fenced]
        self._changed = {}

    def add(self, t, grad, position=None):
        """Add a partial gradient to ``t``'s running sum (a sparse one with a
        ``position``, or after one, to its rows kept apart)."""
        if grad is None:
            return
        ref = t.ref()
        self._changed[ref] = True
        if (isinstance(grad, tf.IndexedSlices) and ref not in self._sums
                and (position is not None or ref in self._rows)):
            rows = self._rows.setdefault(ref, [])
            rows.append([math.inf if position is None else position, len(rows), grad, False])
            return
        self._sums[ref] = aggregate([self._rows_in_order(ref), self._sums.get(ref), grad])

    def _rows_in_order(self, ref, keep=False):
        """The rows kept apart for ``ref``, concatenated in position order, or
        None; no longer kept apart unless ``keep``."""
        rows = self._rows.get(ref) if keep else self._rows.pop(ref, None)
        if not rows:
            return None
        return aggregate([grad for _, _, grad, _ in sorted(rows, key=lambda r: r[:2])])

    def fence_changed(self):
        """Fence the sums (or new rows) changed since the last call (see
        :func:`fence`); return them."""
        out = []
        for ref in self._changed:
            if ref in self._sums:
                self._sums[ref] = fenced = fence(self._sums[ref])
                out.append(fenced)
                continue
            for row in self._rows[ref]:
                if not row[3]:
                    row[2], row[3] = fence(row[2]), True
                    out.append(row[2])
        self._changed = {}
        return out

    def total(self, t):
        ref = t.ref()
        if ref in self._rows:
            return self._rows_in_order(ref, keep=True)
        return self._sums.get(ref)


def _backward_positions(region):
    """``{op: position}`` in the order ``tf.gradients`` takes the ops of
    ``region``'s graph going back from its ys: its ops between the xs and the
    ys (reached from the xs through differentiable tensors, and reaching
    the ys), each taken once every such op that reads it was, first come
    first served (a queue; the tape's is one too, over the ops reached from
    every variable it watched, sources or not). A variable read by
    several lookups gets their rows concatenated in this order. The walk is
    TensorFlow's, not the region's: on a fuzzed graph the region held ten
    ops that TensorFlow's walk does not (a cond and a comparison among
    them), and each op the queue takes or waits on moves the others (walked
    on the region, that graph's two lookups came swapped)."""
    reached = set()
    tf_internal.mark_reached_ops([x.op for x in region.xs], reached, [])
    between, queue = set(), collections.deque(y.op for y in region.ys)
    while queue:
        op = queue.popleft()
        if op in reached and op not in between:
            between.add(op)
            queue.extend(t.op for t in op.inputs)
    pending = collections.Counter(t.op for op in between for t in op.inputs if t.op in between)
    queue, queued = collections.deque(), set()
    for y in region.ys:
        if y.op in between and not pending[y.op] and y.op not in queued:
            queued.add(y.op)
            queue.append(y.op)
    positions = {}
    while queue:
        op = queue.popleft()
        positions[op] = len(positions)
        for t in op.inputs:
            if t.op in between:
                pending[t.op] -= 1
                if not pending[t.op]:
                    queue.append(t.op)
    return positions


def differentiated_once(region, checkpoints):
    """``checkpoints``, and the outputs of each op that runs a user's gradient
    (see :func:`functions.runs_users_gradient`) or gives sparse rows (a
    gather, or a call or cond with one inside: see
    :func:`functions.gives_sparse_rows`) or adds a bias in half precision,
    which several segments would differentiate.

    An op recomputed in several segments is differentiated in each, with
    the part of its output gradient that segment's readers send, and the
    parts' results are summed: right for a gradient linear in the output
    gradient, as TensorFlow's are. A ``tf.custom_gradient`` that clips its
    output gradient is not (gradients up to 0.88 of the largest entry off
    plain's, without an error). Kept, such an op is differentiated once, in
    its own segment, with its outputs' whole running sums. Keeping a tensor
    can only split segments, so this repeats until nothing changes.

    A gather's parts are IndexedSlices, which concatenate to one row per
    lookup and segment where TensorFlow's one differentiation gives one row
    per lookup: the dense sum is the same, but an optimizer that reads the
    rows does not see it (Keras' Adam, RMSprop and Adagrad square each row:
    an embedding model's weights 0.25 of their largest entry off plain's
    after four Adam steps; Keras' mixed-precision check skipped no step
    where one piece overflowed). Summing the rows per index instead
    (``tf.unique``) is a loop of one iteration per row under XLA on a GPU
    (BERT at 1,024 tokens under 'speed': 139,264 iterations, an estimated
    24x plain's step time on an H100), and still not TensorFlow's rows.
    Kept, the gather gives one part, plain backprop's.

    A half-precision bias add's gradient is summed in that dtype (see
    :func:`~memsave.graph.region.sums_bias_in_half_precision`); summed per
    segment, a Keras conv + attention model under mixed_bfloat16 got its
    convolution's bias gradient 0.08 of the largest entry off plain's
    (oneDNN off). Kept, it is summed once, over the whole output gradient.
    """
    users = _differentiate_once(region)
    if not users:
        return list(checkpoints)
    kept = list(checkpoints)
    stop = {t.ref() for t in kept}
    ys = {y.ref() for y in region.ys}
    added, changed = [], True
    while changed:
        changed = False
        for op in users:
            outs = [t for t in op.outputs if t.ref() not in stop and differentiable(t)
                    and (t.ref() in ys or any(c in region.ops for c in t.consumers()))]
            if outs and _segments_reaching(op, stop, ys, region) > 1:
                kept.extend(outs)
                stop.update(t.ref() for t in outs)
                added.append((users[op], outs))
                changed = True
    _say_kept(added)
    return kept


# Why :func:`differentiated_once` keeps an op's outputs, as logged.
_ONCE_WHY = {
    "user": ("output(s) of ops whose gradient a user wrote (tf.custom_gradient, a gradient "
             "override): such a gradient need not be linear in its output gradient, so it "
             "runs once, on the whole of it"),
    "rows": ("gather output(s): each segment's sparse gradient would add rows of the same "
             "lookups, where plain backprop gives one row per lookup"),
    "bias": ("half-precision bias add output(s): TF sums a bias gradient in that dtype, so "
             "it runs once, on the whole output gradient, as in plain backprop"),
}


def _differentiate_once(region):
    """``{op: why}`` (a key of :data:`_ONCE_WHY`) for the region's copyable
    ops that must be differentiated in one segment only."""
    memo, sparse_memo, found = {}, {}, {}
    for op in region.order:
        if op not in region.copyable:
            continue
        if functions.runs_users_gradient(op, memo):
            found[op] = "user"
        elif functions.gives_sparse_rows(op, sparse_memo):
            found[op] = "rows"
        elif sums_bias_in_half_precision(op):
            found[op] = "bias"
    return found


def _say_kept(added):
    """Log what :func:`differentiated_once` kept, ``[(why, outputs kept)]``."""
    for why, text in _ONCE_WHY.items():
        kept = [t for reason, outs in added if reason == why for t in outs]
        if kept:
            logger.info("memsave: %d more tensor(s) kept that the plan would differentiate in "
                        "several segments, %s: %s", len(kept), text,
                        ", ".join(t.name for t in kept[:5]))


def _segments_reaching(op, stop, ys, region):
    """How many segments would differentiate ``op`` (at most: each kept tensor,
    of the refs ``stop``, reached from it without crossing another counts as
    one, the ys not kept as one)."""
    reached = forward_ops([op], stop_at=stop, within=region.ops)
    boundaries = {t.ref() for o in reached for t in o.outputs if t.ref() in stop}
    top = any(ref not in stop and ref.deref().op in reached for ref in ys)
    return len(boundaries) + int(top)


def _checkpoint_levels(region, checkpoints, stop):
    """Checkpoints grouped so that each group only depends on earlier ones:
    by the longest chain of checkpoints below each (linear in their
    dependencies; grouping by repeated passes over the remaining ones was
    quadratic, a second of DenseNet121's rewrite with 1,088 levels)."""
    deps = {}
    for r in checkpoints:
        hit = {}
        backward_ops([r.op], stop_at=stop, within=region.ops, stopped=hit)
        hit.pop(r.ref(), None)
        deps[r.ref()] = list(hit)
    depth = {}
    for ref in deps:
        stack = [ref]
        while stack:
            cur = stack[-1]
            if cur in depth:
                stack.pop()
                continue
            below = deps.get(cur, ())
            todo = [d for d in below if d not in depth]
            if todo:
                stack.extend(todo)
                continue
            depth[cur] = 1 + max((depth[d] for d in below), default=-1)
            stack.pop()
    levels = [[] for _ in range(1 + max(depth.values(), default=-1))]
    for ref, d in depth.items():
        levels[d].append(ref)
    return [sorted(level, key=lambda ref: (tf_internal.op_id(ref.deref().op),
                                           ref.deref().value_index))
            for level in levels]


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

    def __init__(self, graph, config, scope, foreign):
        self.graph, self.config, self.scope = graph, config, scope
        self.foreign = foreign      # ops made in gradient calls but not theirs (see _Rewrite._own)
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
            out = tf.identity(source, name=name)
        tf_internal.set_device(out.op, device)
        if control:
            tf_internal.add_control_inputs(out.op, control)
        self.swap_ops.add(out.op)
        return out

    def _sync(self):
        ops = self.graph.get_operations()
        self.backward.extend(op for op in ops[self._seen:]
                             if op not in self.swap_ops and op not in self.foreign)
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
                       if ahead > 0 and self.backward else [t.op for t in wait_for])
            out[ref] = self._identity(self.host[ref], t, t.op.device, "swap_in", trigger)
        return out

    def used(self, swapped):
        """Record that the segment just built read ``swapped``."""
        self._sync()
        for ref, t in swapped.items():
            self.current[ref] = (t, len(self.backward))


def rewrite(region, checkpoints, ledger, grad_ys=None, name="gradients", swap=None,
            barriers=False, **grad_kwargs):
    """Gradients of ``region.ys`` w.r.t. ``region.xs``, recomputing between ``checkpoints``.

    ``checkpoints`` must be region tensors and must include
    ``region.forced`` (which holds the xs computed inside the region). A y
    among them starts with its ``grad_ys``. With ``swap`` (a
    :class:`SwapConfig`), its tensors, all checkpoints, wait in host memory.
    What is built is recorded in ``ledger`` (a :class:`memsave.graph.audit.Ledger`
    made before the call), for the audit. With ``barriers`` (the step is
    compiled by XLA), each segment reads its inputs through an XLA
    optimization barrier that also takes the gradients it waits for (see
    :func:`memsave.graph.edit.barrier`). Returns one gradient (or None) per x.
    """
    unconnected = grad_kwargs.pop("unconnected_gradients", tf.UnconnectedGradients.NONE)
    checkpoints = differentiated_once(region, checkpoints)
    run = _Rewrite(region, checkpoints, ledger, name, swap, barriers, grad_kwargs)
    run.top_segment(grad_ys)
    for refs in _segment_groups(_checkpoint_levels(region, run.checkpoints, run.stop), run):
        run.checkpoint_segment(refs)
    return run.results(unconnected)


def _segment_groups(levels, run):
    """The checkpoints of each segment below the top one, in the order they run.

    One segment per level, except that a run of consecutive levels shares
    one ``tf.gradients`` call when every level after the run's first only
    differentiates kept ops on their kept values, recomputing at most a few
    small tensors (a batch norm's per-channel scale; see
    :meth:`_Rewrite.merge_info`). The call computes what a call per level
    does, in the same order (each op's gradient waits for its output
    gradient), without the per-call and per-fence build time (DenseNet121
    under a budget of 0.7 of plain's peak: 1,088 levels in 521 calls). Everything a
    segment recomputes waits for the gradients handed on before it: the
    run's first level recomputes as its own segment would, and the later
    levels' small recomputations, which may run as early, are capped
    (:data:`MERGED_PART`). A recomputation in the run reads the copies of
    the kept values of the levels after it, so those copies run: a level
    may only join if the copies so read are small and read small tensors
    (a batch norm's ``variance + epsilon``), else it starts a new run.
    """
    groups, current, spent, read = [], [], 0, set()
    for level in reversed(levels):
        info = run.merge_info(level)
        if info is None:
            if current:
                groups.append(current)
                current, spent, read = [], 0, set()
            groups.append(list(level))
            continue
        joinable, size, reads, cheap = info
        conflict = read.intersection(level)
        if current and joinable and conflict <= cheap.keys():
            extra = sum(cheap[ref][0] for ref in conflict)
            if spent + size + extra <= run.merged_bytes:
                current.extend(level)
                spent += size + extra
                read.update(reads)
                for ref in conflict:
                    read.update(cheap[ref][1])
                continue
        if current:
            groups.append(current)
        current, spent, read = list(level), size if joinable else 0, set(reads)
    if current:
        groups.append(current)
    return groups


class _Rewrite:
    """The state of one :func:`rewrite`: where backprop stops, how checkpoints
    are read, the running gradient sums, and what the next segment waits for.

    Segments are built one after the other (:meth:`run_segment`); the order
    in which their ops are made is the order the audit and the swapper see.
    """

    def __init__(self, region, checkpoints, ledger, name, swap, barriers, grad_kwargs):
        self.region, self.ledger, self.name = region, ledger, name
        self.barriers, self.grad_kwargs = barriers, grad_kwargs
        self.sized = SizedUnderXla()
        self.user_stops = list(grad_kwargs.pop("stop_gradients", None) or [])
        # xs computed inside the region are checkpoints (region.forced): their
        # gradients accumulate like a checkpoint's. Each leaf x is asked once.
        self.leaf_xs = list({x.ref(): x for x in region.leaf_xs}.values())
        self.leaf_refs = [(x, x.ref()) for x in self.leaf_xs]
        # A kept read of a leaf x (a variable read that must not be redone) is
        # differentiated in place on the way to its x: a segment that reads it
        # asks for the x. As a checkpoint it would hold a running gradient sum
        # the size of the variable per read until the end of the backward pass,
        # and an unrolled RNN reads its weights once per step.
        self.aliases = _x_reads(region, self.leaf_xs)
        self.positions = _backward_positions(region)
        self.checkpoints = [t for t in checkpoints if t.ref() not in self.aliases]
        self.stop = {t.ref(): t for t in self.checkpoints}
        # tf.gradients differentiates a function call even when its output is in
        # stop_gradients, so copies read such a checkpoint through an Identity,
        # which the stop does hold (else the call's inputs get the gradient twice).
        self.shields = _shields(region, self.checkpoints)
        ledger.inserted(self.shields.values())
        self.within = region.copyable
        self.prunable = not any(functions.is_loop(op) for op in region.ops)
        self.d_cp, self.d_xs = _Accumulator(), _Accumulator()
        # The parts of xs' gradients that went on through a call in place.
        self.d_passed = _Accumulator()
        self.x_refs = {x.ref() for x in region.xs}
        self.segment = 0
        self.wait = []
        self.swapper = (_Swapper(region.graph, swap, "memsave_offload", ledger.foreign)
                        if swap and swap.tensors else None)
        # Checkpoints whose segments never merge (see merge_info).
        self.special = ({t.ref() for t in list(region.xs) + list(region.ys)}
                        | set(self.shields))
        self._users_memo = {}
        largest = max((num_elements(t.shape) * t.dtype.size for op in region.ops
                       for t in op.outputs if t.shape.is_fully_defined()), default=0)
        self.small_bytes, self.merged_bytes = largest // SMALL_PART, largest // MERGED_PART
        if self.swapper is not None:
            ledger.inserted(self.swapper.host.values())

    def top_segment(self, grad_ys):
        """Seed the ys and run the first segment, from the ys that are not
        checkpoints down to the checkpoints."""
        ys = self.region.ys
        self.wait = _first_waits(ys, grad_ys)
        self.ledger.inserted(self.wait, fence=True)
        # A y that is a checkpoint (e.g. also an x) starts with its grad_ys; the
        # first segment runs from the other ys down to the checkpoints.
        top, top_grads = [], []
        for i, y in enumerate(ys):
            g = grad_ys[i] if grad_ys else None
            if y.ref() in self.stop and g is None:
                g = tf.compat.v1.ones_like(y)
            self.ledger.seed(g, y)
            if y.ref() in self.stop:
                self.d_cp.add(y, g)
            else:
                top.append(y)
                top_grads.append(g)
        if top:
            self.run_segment(top, [y.op for y in top], top_grads if grad_ys else None)

    def merge_info(self, level):
        """Whether the segment of ``level`` (checkpoint refs) may share a
        ``tf.gradients`` call with the levels around it (see
        :func:`_segment_groups`): None if it may not, else ``(joinable,
        bytes, reads, cheap)``.

        ``joinable``: it may follow others in a shared call, as it recomputes
        nothing but small tensors (of known shape, each at most a
        :data:`SMALL_PART` of the region's largest; ``bytes`` together) and
        every output of its checkpoints' ops is kept, so their gradients
        read kept values (:func:`_read_kept`) and their copies never run.
        ``reads``: the checkpoints read by the copies that may run.
        ``cheap``: ``{ref: (bytes, reads)}`` for its checkpoints whose copies
        would be small and read small tensors only. None for an x or a y
        (their sums are results or seeds), a call, control flow, an op whose
        gradient a user wrote, or where kept values are read through
        substitutes (a shield, a swap-in, an XLA barrier), which a shared
        call's copies would read in place of each other's copies.
        """
        if self.swapper is not None or self.barriers:
            return None
        seeds = [ref.deref().op for ref in level]
        if any(ref in self.special or op not in self.within for ref, op in zip(level, seeds)):
            return None
        joinable, size, reads = True, 0, set()
        for op in backward_ops(seeds, stop_at=self.stop, within=self.within):
            if (functions.has_bodies(op) or tf_internal.is_function_call(op)
                    or functions.runs_users_gradient(op, self._users_memo)):
                return None
            if op in seeds:
                if all(t.ref() in self.stop for t in op.outputs):
                    continue
                joinable = False
            small = self._small_bytes(op.outputs)
            if small is None:
                joinable = False
            else:
                size += small
            reads.update(t.ref() for t in op.inputs if t.ref() in self.stop)
        cheap = {}
        for ref, op in zip(level, seeds):
            small = self._small_bytes(op.outputs)
            if small is not None and self._small_bytes(op.inputs) is not None:
                cheap[ref] = (small, {t.ref() for t in op.inputs if t.ref() in self.stop})
        return joinable, size, reads, cheap

    def _small_bytes(self, tensors):
        """The bytes of ``tensors`` if each is of known shape and at most a
        :data:`SMALL_PART` of the region's largest, else None."""
        total = 0
        for t in tensors:
            if not t.shape.is_fully_defined():
                return None
            size = num_elements(t.shape) * t.dtype.size
            if size > self.small_bytes:
                return None
            total += size
        return total

    def checkpoint_segment(self, refs):
        """The segment of the checkpoints ``refs`` (one level, or a run of
        levels that recompute nothing, see :func:`_segment_groups`):
        differentiate those with a running sum, through the others."""
        group = [ref.deref() for ref in refs]
        # In the order plain backprop takes their ops (see
        # _backward_positions), as the call then takes them: sparse rows
        # that two of them send one variable (two lookups of one table)
        # come in plain's order (a helper found them swapped). Others
        # newest first.
        positions = self.positions
        active = sorted((t for t in group if self.d_cp.total(t) is not None),
                        key=lambda t: (positions.get(t.op, math.inf), -tf_internal.op_id(t.op),
                                       -t.value_index))
        # Under offloading or XLA nothing merges (see merge_info): a level's
        # checkpoints are independent, and only those with a sum are read.
        through = group if self.swapper is None and not self.barriers else ()
        if active:
            self.run_segment(active, [t.op for t in active],
                             [self.d_cp.total(t) for t in active], through=through)

    def run_segment(self, boundary, seeds, grads, through=()):
        """Copy the ops behind ``seeds`` and differentiate ``boundary``'s copy.
        ``through``: checkpoints the copy goes through (read as copies, whose
        gradients read their kept values) rather than stopping at them."""
        own = list({t.ref(): t for t in list(boundary) + list(through)
                    if t.ref() in self.stop}.values())
        copies, swapped, barred, read_as = self._copy_segment(seeds, own, through)
        reads = _segment_reads(copies, boundary, self.stop, read_as, self.region.ops)
        owners = [owner for owner, _ in reads.checkpoints]
        read_cp = [t for _, t in reads.checkpoints]
        asked_x = self._asked_xs(reads, boundary)
        passed = self._xs_passed_in_place(reads, boundary)
        targets = read_cp + asked_x + passed
        if not targets:
            return
        grads_out = self._differentiate(copies, boundary, grads, targets, read_cp, barred,
                                        _own_values(own, read_as))
        if self.swapper is not None:
            self.swapper.used(swapped)
        for t, g in zip(owners, grads_out):
            self.d_cp.add(t, g)
        for t, g, at in zip(asked_x, grads_out[len(owners):],
                            self._reached_at(asked_x, copies, reads, boundary)):
            self.d_xs.add(t, g, at)
        for t, g in zip(passed, grads_out[len(owners) + len(asked_x):]):
            self.d_passed.add(t, g)
        logger.debug("memsave: segment %d copied %d ops, asked %d checkpoint read(s) and "
                     "%d x(s)", self.segment - 1, len(copies.of), len(read_cp), len(asked_x))
        self._hand_on()

    def _copy_segment(self, seeds, own=(), through=()):
        """Copy the ops behind ``seeds``, waiting for ``self.wait``; checkpoints are
        read through their shields, swap-ins and (``barriers``) XLA barriers.
        ``own``: the checkpoints the segment differentiates (their gradients
        may read them: an offloaded one is swapped in too, and the swap-in
        only runs if a gradient reads it).
        Returns (copies, swapped-in, barred, every substitute read)."""
        ledger = self.ledger
        ledger.segment()
        seed_ops = [op for op in seeds if op in self.within]
        stop = self.stop
        if through:
            stop = dict(stop)
            for t in through:
                stop.pop(t.ref(), None)
        ops = (backward_ops(seed_ops, stop_at=stop, within=self.within)
               if seed_ops else set())
        # In creation order, so that swap-ins and barrier inputs are built in
        # the same order on every run (a set's order follows memory addresses).
        ordered = sorted(ops, key=tf_internal.op_id)
        swapped = {}
        if self.swapper is not None:
            reads = {t.ref(): t for op in ordered for t in op.inputs if t.ref() in self.stop}
            reads.update((t.ref(), t) for t in own)
            swapped = self.swapper.swap_in(reads, self.wait)
            ledger.inserted(swapped.values())
        # A checkpoint made by an op copied for another of its outputs (one
        # piece of a split kept, another recomputed) is read as kept, like
        # any checkpoint, not as the copy's: the segment then asks for its
        # gradient, which an x among them must get (tf.gradients(y, [piece,
        # x]): the audit found it dropped).
        kept_outputs = {t.ref(): t for op in ordered for t in op.outputs if t.ref() in stop}
        read_as = {**kept_outputs, **self.shields, **swapped}
        barred = {}
        if self.barriers:
            barred = _barred_reads(ordered, self.stop, read_as, self.region, self.wait,
                                   self.segment, self.sized, own)
            ledger.inserted(barred.values())
            read_as.update(barred)
        copies = copy_ops(ops, replace=read_as, wait_for=self.wait,
                          scope="memsave_%d" % self.segment)
        ledger.copied(copies)
        self.segment += 1
        return copies, swapped, barred, read_as

    def _asked_xs(self, reads, boundary):
        """The leaf xs a segment's gradient call asks for: those it reads,
        directly or through a kept read of them, and those in ``boundary``."""
        asked = reads.refs | {self.aliases[ref].ref() for ref in reads.refs if ref in self.aliases}
        in_boundary = {id(b) for b in boundary}
        return [x for x, ref in self.leaf_refs if ref in asked or id(x) in in_boundary]

    def _reached_at(self, xs, copies, reads, boundary):
        """Per x in ``xs``, the earliest position (see :func:`_backward_positions`)
        of the segment's ops that read it, directly or through a kept read of
        it: where its sparse rows go among the other segments' (None: no op
        of the segment reads it)."""
        wanted = {x.ref() for x in xs}
        found = {}
        for op in itertools.chain(copies.of, reads.in_place, (t.op for t in boundary)):
            at = self.positions.get(op)
            if at is None:
                continue
            for t in op.inputs:
                ref = self.aliases[t.ref()].ref() if t.ref() in self.aliases else t.ref()
                if ref in wanted and at < found.get(ref, math.inf):
                    found[ref] = at
        return [found.get(x.ref()) for x in xs]

    def _xs_passed_in_place(self, reads, boundary):
        """The xs among the checkpoints that a function call differentiated in
        place in this segment makes (besides its boundary). tf.gradients
        differentiates such a call in the segment's own call (see
        :func:`memsave.graph.region.in_place_closure`): the gradient arriving
        there goes on through the call, so it is not the checkpoint's to
        carry, but the x's result needs it (a helper found it dropped: an x
        made by a tf.function called in a Graph, read by a while loop)."""
        made_here = {t.op for t in boundary}
        return [t for op in reads.in_place if op not in made_here for t in op.outputs
                if t.ref() in self.x_refs and t.ref() in self.stop]

    def _differentiate(self, copies, boundary, grads, targets, read_cp, barred, own_values):
        """TensorFlow's gradients of ``boundary``'s copy w.r.t. ``targets``,
        recorded for the audit; the gradient ops it makes read the copies
        (and, for the checkpoints in ``own_values``, the kept values rather
        than their copies), and run their reducers first."""
        graph = self.region.graph
        stops = _segment_stops(read_cp, self.user_stops, copies, barred)
        existing = graph.get_operations()
        before, start = len(existing), tf_internal.op_id(existing[-1]) + 1
        boundary_copies = [copies.output(t) for t in boundary]
        grads_out = plain_gradients(boundary_copies, targets, grad_ys=grads, name=self.name,
                                    stop_gradients=stops,
                                    skip=self._not_ancestors(existing, boundary_copies),
                                    prunable=copies.of.values(),
                                    **self.grad_kwargs)
        made = graph.get_operations()[before:]
        grads_out = tf_internal.in_graph(grads_out, graph, like=targets)
        self.ledger.call(boundary_copies, grads, targets, stops, grads_out, start)
        made_now = self._own(made, grads_out)
        _read_copies(made_now, copies.of)
        _read_kept(made_now, copies, own_values)
        _gradients_wait(made_now, copies, self.wait, "memsave_%d" % (self.segment - 1))
        reducers_first(made_now)
        return grads_out

    def _own(self, made, grads_out):
        """The ops of ``made`` (the graph's ops created during this segment's
        ``tf.gradients`` call, in creation order) that its results depend on;
        the rest are recorded in the ledger as not this rewrite's.

        Under a MirroredStrategy the replicas trace in turns, each in its own
        thread: a cross-replica call in a gradient (a synchronized batch
        norm's all-reduce) hands over to the other replicas, which build
        their own copies and gradients before this call returns. Making those
        ops wait for this replica's sums, or read its copies, tied the
        replicas' segments into a cycle. The collective ops the strategy
        builds for this replica are among the results' inputs, so they stay
        this call's. An op of this call that no result depends on does not
        run and needs no order.
        """
        outs = [t.op for t in components(g for g in grads_out if g is not None)]
        ours = backward_ops(outs, within=set(made), control=True)
        self.ledger.foreign.update(op for op in made if op not in ours)
        return [op for op in made if op in ours]

    def _not_ancestors(self, existing, ys):
        """``(graph, first id, end id)`` of ops that cannot be ancestors of this
        segment's gradient call's ``ys`` (so the call need not walk them), else
        None. ``existing``: the graph's ops now.

        An op's inputs exist before it, so they have smaller ids: below the
        segment's first op, an ancestor of ``ys`` is at most the newest op
        that an op of this segment reads, or an original y itself. Everything
        above that and below the segment is skipped: the forward pass past the
        segment's checkpoints, and what earlier segments made (their copies
        and gradients). The ids only order creation where nothing rewires an
        existing op: while_v2 adds inputs to the loop it differentiates, so no
        walk is left out where the region holds a while loop (a call's or a
        cond's gradient only adds outputs to the forward op).
        """
        if not self.prunable:
            return None
        start = self.ledger.spans[-1]
        made = existing[bisect.bisect_left(existing, start, key=tf_internal.op_id):]
        newest = max((tf_internal.op_id(t.op) for op in made for t in op.inputs
                      if tf_internal.op_id(t.op) < start), default=-1)
        newest = max([newest] + [tf_internal.op_id(y.op) for y in ys
                                 if tf_internal.op_id(y.op) < start])
        if newest + 1 >= start:
            return None
        return self.region.graph, newest + 1, start

    def _hand_on(self):
        """Fence the running sums the segment changed; the next one waits for them."""
        # The next segment waits for the running sums, not just the partials,
        # so each partial is folded in (and freed) before more is recomputed.
        # They cross over fenced (see memsave.graph.edit.fence).
        fenced = (self.d_cp.fence_changed() + self.d_xs.fence_changed()
                  + self.d_passed.fence_changed())
        self.ledger.inserted(fenced, fence=True)
        if fenced:
            self.wait = [_dense_part(g) for g in fenced]

    def results(self, unconnected):
        """One gradient (or None, or zeros with ``unconnected`` ZERO) per x."""
        results = []
        for x in self.region.xs:
            g = self.d_cp.total(x) if x.ref() in self.stop else self.d_xs.total(x)
            g = aggregate([g, self.d_passed.total(x)])
            if g is None and unconnected == tf.UnconnectedGradients.ZERO:
                g = tf_internal.zeros_for_unconnected(x)
                self.ledger.unconnected(g)
            results.append(g)
        return results


def _first_waits(ys, grad_ys):
    """What the first segment waits for: the ys and their given gradients,
    through fences. A wait on a y itself lets Grappler, in a step that does
    not use the y's value (a training step returns the gradients, not the
    loss), prune the forward ops behind it and hand the wait down to their
    inputs, kept tensors among them; a fusion of a kept tensor's op with a
    copy that reads it (oneDNN's convolution + bias add) then closes a cycle."""
    return [fence(y) for y in ys] + [fence(_dense_part(g)) for g in (grad_ys or [])
                                     if g is not None]


def _segment_stops(read_cp, user_stops, copies, barred):
    """A segment's backprop stops at every checkpoint read it asks for (what
    lies below is another segment's), at the copies of the user's stops and
    at what it reads through an XLA barrier: the barrier also takes the
    gradients the segment waits for, which depend on the xs, and backprop
    must not follow that path, which plain backprop does not have."""
    asked = {t.ref() for t in read_cp}
    return (read_cp + [copies.output(t) for t in user_stops]
            + [t for t in barred.values() if t.ref() not in asked])


@dataclasses.dataclass
class _Reads:
    """What one segment's gradient call reads from outside the segment."""

    refs: set            # refs of every tensor read from outside
    checkpoints: list    # (checkpoint, the tensor read for it: itself or a substitute)
    in_place: list       # the ops differentiated in place (see in_place_closure)


def _segment_reads(copies, boundary, stop, read_as, region_ops):
    """The tensors the ops of a segment read from outside it.

    The segment is every op :func:`copy_ops` made (copies, and the gates
    some read through) plus the ops differentiated in place: boundary ops
    never copied (kept ops) and the function calls feeding them (see
    :func:`memsave.graph.region.in_place_closure`). Its gradient call must
    ask for each checkpoint it reads, under whichever name it reads it: the
    original, or a substitute from ``read_as`` (an offloaded tensor's
    swap-in, a call output's shield). Derived from the built ops, so an op
    that reads through something (a gate) cannot hide a read.
    """
    in_place = in_place_closure([t.op for t in boundary if t.op not in copies.of], region_ops)
    made = set(copies.made) | set(in_place)
    readers = list(copies.made) + in_place
    owner_of = {sub.ref(): stop[ref] for ref, sub in read_as.items() if ref in stop}
    refs, checkpoints = set(), []
    for op in readers:
        for t in op.inputs:
            if t.op in made or t.ref() in refs:
                continue
            refs.add(t.ref())
            owner = stop.get(t.ref())
            if owner is None:
                owner = owner_of.get(t.ref())
            if owner is not None:
                checkpoints.append((owner, t))
    return _Reads(refs, checkpoints, in_place)


def _read_copies(grad_ops, copies):
    """Point ``grad_ops`` at the recomputed copies wherever they read an original.

    A registered gradient reads its op's inputs and outputs, which for a copy
    are copies. A gradient that closes over forward tensors instead
    (``tf.custom_gradient``: ``tf.nn.silu``, hence every Keras swish) reads
    the originals: they then stay alive from the forward pass to this
    segment, and recomputing them saves nothing. A copy holds its original's
    value (only ops whose values cannot change are copied) and depends on
    nothing this segment's gradients compute, so the swap is safe.
    """
    moved = 0
    for op in grad_ops:
        for i, t in enumerate(op.inputs):
            copy = copies.get(t.op)
            if copy is not None:
                tf_internal.update_input(op, i, copy.outputs[t.value_index])
                moved += 1
    if moved:
        logger.debug("memsave: %d gradient input(s) read a forward original; now its copy", moved)


def _own_values(own, read_as):
    """``{checkpoint ref: the tensor that holds its kept value}`` for the
    checkpoints a segment differentiates: the checkpoint, its shield or its
    swap-in."""
    return {t.ref(): read_as.get(t.ref(), t) for t in own}


def _gradients_wait(grad_ops, copies, wait_for, scope):
    """Make a segment's gradient ops wait, as its copies do, for every running
    sum the segment before changed.

    Waiting copies order recomputation, but a segment's gradient ops need not
    read any copy that runs: they read the incoming gradients, kept values
    and copies that :func:`_read_kept` left unread. Where none of its copies
    runs, nothing made the sums it does not read (a weight's gradient, a
    bias's) come first, and the executor left those reductions to the end of
    the step, each holding the large gradient it reduces (keras-hub GPT2 at
    128 tokens, max_recompute=0.1: 73.8 MiB measured against 59.1
    estimated, 56.6 with the wait). The ops that read nothing made in the
    segment wait; the rest run after them. Such an op that is an Identity
    (``tf.gradients``' own of the incoming gradient) is kept from Grappler:
    removed, its wait moved onto its readers, and oneDNN fused no
    BiasAddGrad that waits with its convolution's filter gradient, which
    sums the bias gradient in float32 (bfloat16 bias gradients 0.04-0.09 of
    the largest entry off plain's).
    """
    if not wait_for:
        return
    inside = {tf_internal.op_id(op) for op in grad_ops}
    inside.update(tf_internal.op_id(op) for op in copies.made)
    roots = [op for op in grad_ops
             if (op.inputs or op.control_inputs)
             and not any(tf_internal.op_id(t.op) in inside for t in op.inputs)
             and not any(tf_internal.op_id(c) in inside for c in op.control_inputs)]
    if not roots:
        return
    for op, wait in joined_waits(roots[0].graph, roots, wait_for, scope).items():
        tf_internal.add_control_inputs(op, wait)
        if op.type == "Identity":
            tf_internal.preserve(op)


def _read_kept(grad_ops, copies, own_values):
    """Point ``grad_ops`` at the kept value wherever they read the copy of a
    checkpoint their segment differentiates.

    A gradient that reads its op's output (tanh, relu, softmax) would read
    the copy, and recomputing the copy recomputes what lies below it: the
    GELU's whole chain under a kept tanh, the attention scores' matmul
    under a kept softmax. The kept value is the same (only ops whose values
    cannot change are copied), so the copy is left unread and never runs.
    """
    kept_of = {}
    for ref, value in own_values.items():
        copy = copies.of.get(ref.deref().op)
        if copy is not None:
            kept_of[copy.outputs[ref.deref().value_index].ref()] = value
    if not kept_of:
        return
    for op in grad_ops:
        for i, t in enumerate(op.inputs):
            value = kept_of.get(t.ref())
            if value is not None:
                tf_internal.update_input(op, i, value)


def _shields(region, checkpoints):
    """``{ref: Identity}`` for checkpoints a function call produces (see rewrite)."""
    out = {}
    for t in checkpoints:
        if t.op in region.ops and tf_internal.is_function_call(t.op):
            graph = region.graph
            with graph.as_default(), graph.name_scope(None), \
                    graph.control_dependencies(None), graph.device(t.op.device):
                out[t.ref()] = tf.identity(t, name="memsave_shield")
    return out


def _x_reads(region, leaf_xs):
    """``{read.ref(): x}`` for outputs of kept (pinned) variable reads whose only
    inputs are leaf xs (see :func:`memsave.planning.simulate.prepare`, which
    models the same)."""
    roots = {x.ref(): x for x in leaf_xs}
    xs = {x.ref() for x in region.xs}
    found = {}
    for op in region.pinned:
        if op.type not in optable.INPUT_READS or not op.inputs:
            continue
        if all(t.ref() in roots for t in op.inputs):
            for out in op.outputs:
                # A read that is an x itself gets its own (total) gradient.
                if out.ref() not in xs:
                    found[out.ref()] = roots[op.inputs[0].ref()]
    return found


def _dense_part(grad):
    """The tensor that holds ``grad``'s values (an IndexedSlices' ``values``)."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _barred_reads(ordered, stop, read_as, region, wait_for, segment, sized, own=()):
    """``{ref: barrier output}`` for the float tensors the segment's ops
    (``ordered``, in creation order) read from outside.

    Checkpoints (``own`` too: the segment's gradients may read them) and
    float tensors computed outside the region (the batch) go through one
    barrier together with the float ones of ``wait_for``
    (the gradients the segment waits for), which orders the recomputation
    after them. XLA's barrier takes no ``variant`` (the gradient of a
    loop's TensorList). Others are read as they are: integers may be shapes XLA needs as compile-time
    constants; the xs and the kept reads of xs are what the segment's
    gradient call asks for by name; resources and TensorLists are handles,
    not values; tensors XLA sizes at run time cannot go through (``sized``:
    an :class:`~memsave.graph.edit.SizedUnderXla`), and such a wait is
    waited on through a scalar read of it.
    """
    xs = {x.ref() for x in region.xs}
    ops = set(ordered)
    reads = {}
    for op in ordered:
        for t in op.inputs:
            if t.op in ops or not t.dtype.is_floating:
                continue
            if t.ref() in stop or (t.op not in region.ops and t.ref() not in xs
                                   and t.op.type != "Const"):
                reads[t.ref()] = read_as.get(t.ref(), t)
    for t in own:
        if t.dtype.is_floating:
            reads.setdefault(t.ref(), read_as.get(t.ref(), t))
    unsized = [ref for ref, t in reads.items() if not sized(t)]
    if unsized:
        logger.debug("memsave: segment %d reads %d tensor(s) XLA sizes at run time without "
                     "a barrier (XLA may merge what it computes from them back into the "
                     "forward pass)", segment, len(unsized))
        for ref in unsized:
            del reads[ref]
    if not reads:
        return {}
    waits = [t if sized(t) else order_token(t) for t in wait_for
             if t.dtype.is_floating or t.dtype.is_complex]
    outs = barrier(list(reads.values()) + waits, "memsave_%d/memsave_barrier" % segment)
    return dict(zip(reads, outs))
