"""``verify=``: on the first step, also run plain backprop and compare.

What PyTorch's ``determinism_check`` is for its checkpointing: cheap
insurance for a long run. The graph gets a ``tf.cond`` on a first-step flag
whose branch runs the forward pass again from its inputs, differentiates it
with plain ``tf.gradients`` in one call, and asserts that memsave's
gradients match. TensorFlow lowers the cond to Switch/Merge: on later steps
each tensor the branch reads is dropped by its Switch once the flag is
read. The branch reads only the forward pass's inputs (and kept ops'
outputs), not its activations, so however late TensorFlow schedules the
flag nothing is held that was not alive anyway (reading the activations
instead measured 2.5x memsave's peak in one process out of four, when the
flag ran after the forward pass). Measured: later steps at memsave's peak
without ``verify`` in 8 of 8 processes (5.5-6.0 MiB against 5.5-5.8); the
first step, which runs both backward passes, about plain's peak.

A forward pass holding ops kept in place with differentiable inputs (a
loop with a stateful body) cannot be run again; there the branch reads the
forward pass's tensors and says so at INFO.

A mismatch fails the step with ``tf.errors.InvalidArgumentError`` whose
message starts with :data:`MARKER` and names the variable with the largest
difference; ``memsave.keras`` turns it into
:class:`memsave.errors.GradientMismatchError`.
"""

import contextlib
import uuid

import numpy as np
import tensorflow as tf

from memsave import tf_internal
from memsave.errors import GradientMismatchError
from memsave.graph import edit, stateful
from memsave.graph.walk import carries_gradient
from memsave.log import logger
from memsave.rewrite import plain_gradients

MARKER = "memsave verify=True: GradientMismatchError"

# Largest difference allowed, relative to the largest entry of all plain
# gradients, by the gradients' dtype (the least precise one decides). The
# check's forward pass is fused and rounded differently from the step's
# (Grappler sees another graph), and batch norm amplifies last-bit
# differences: two correct float32 backprops of a random-init Keras ResNet50
# measured 1.4-2.5% apart (224 px batch 16, 128 px batch 32, 64 px batch 8),
# MobileNetV2 0.24%, EfficientNetB0 2e-5; in float64, under 1e-9. A lost or
# doubled path moves a gradient by far more (24-100% in the classes found so
# far); the audit checks every path exactly, before any run.
TOLERANCE = {tf.float64: 1e-6, tf.float32: 5e-2, tf.float16: 1e-1, tf.bfloat16: 1e-1}


def tolerance(verify, grads):
    """The tolerance ``verify`` (checked by :mod:`memsave.settings`) asks for; None when off."""
    if verify is None or verify is False:
        return None
    if verify is True:
        dtypes = [_dense_dtype(g) for g in grads if g is not None]
        return max((TOLERANCE.get(d, TOLERANCE[tf.float32]) for d in dtypes), default=None)
    return float(verify)


def _dense_dtype(g):
    return (g.values if isinstance(g, tf.IndexedSlices) else g).dtype.base_dtype


def on_first_step(region, grad_ys, grads, tol, tf_gradients_kwargs, name):
    """``grads``, released only after the first-step check (see the module docstring).

    ``region`` is the forward pass :func:`memsave.gradients` differentiated
    (its ``ys`` and ``xs``), ``grad_ys`` what it was given, ``grads`` what it
    computed.
    """
    graph = region.graph
    pending, clear = _first_step_flag(graph)
    compared = [(x, g) for x, g in zip(region.xs, grads) if g is not None]
    if not compared:
        return grads
    recompute = _recomputable(region)
    if not recompute:
        logger.info("memsave verify: the forward pass holds ops kept in place with "
                    "differentiable inputs, so the check reads the forward pass's tensors; "
                    "TensorFlow may hold them on later steps until the first-step flag is read")

    def check():
        ys, xs, stops = region.ys, [x for x, _ in compared], tf_gradients_kwargs.get(
            "stop_gradients") or []
        if recompute:
            ys, xs, stops = _forward_again(region, [ys, xs, stops])
        kwargs = dict(tf_gradients_kwargs, stop_gradients=stops)
        plain = plain_gradients(ys, xs, grad_ys, name=name + "_verify", **kwargs)
        pairs = [(p, g) for p, (_, g) in zip(plain, compared) if p is not None]
        if len(pairs) != len(compared):
            raise GradientMismatchError("memsave verify: plain tf.gradients gives None where "
                                        "memsave gives a gradient")
        return _assert_close(pairs, [x.name for x, _ in compared], tol)

    with graph.as_default():
        ok = tf.cond(pending, check, lambda: tf.constant(False))
        with tf.control_dependencies([ok]):
            done = clear()
        out = []
        with tf.control_dependencies([ok, done]):
            for g in grads:
                out.append(None if g is None else _identity(g))
    return out


def _recomputable(region):
    """Whether the check can run the forward pass again from the region's inputs.

    A kept op is read as it is (its outputs) unless it is a variable read,
    which reads again; that is only right when no gradient goes through it,
    i.e. it has no input that carries one.
    """
    for op in region.pinned:
        if op.type in stateful.VARIABLE_READS:
            continue
        if any(carries_gradient(t) and (t.op in region.ops or t.ref() in _refs(region.xs))
               for t in op.inputs):
            return False
    return True


def _refs(tensors):
    return {t.ref() for t in tensors}


def _forward_again(region, groups):
    """Copies, in the current graph (the check's branch), of the region's ops;
    returns ``groups`` (lists of tensors) with region tensors replaced by their
    copies.

    The branch then reads only what the forward pass had as inputs (xs,
    data, kept ops' outputs): on later steps, when the branch does not run,
    the cond's Switch ops drop nothing that was not alive anyway, however
    late TensorFlow schedules the first-step flag. Kept ops are not run
    again, but variable reads are (the check runs before the step's update).
    """
    branch = tf.compat.v1.get_default_graph()
    copies = {}

    def source(t):
        copy = copies.get(t.op)
        return t if copy is None else copy.outputs[t.value_index]

    for op in region.order:
        if op in region.pinned and op.type not in stateful.VARIABLE_READS:
            continue
        copies[op] = edit.copy_op(branch, op, [source(t) for t in op.inputs],
                                  "memsave_verify/" + op.name)
    # What the copies read from outside, the branch captured (one placeholder
    # per tensor): differentiate with respect to those.
    return [[source(t) if t.op in copies else branch.capture(t) for t in group]
            for group in groups]


def _identity(g):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(g.values), tf.identity(g.indices), g.dense_shape)
    return tf.identity(g)


def _dense(g):
    return tf.cast(tf.convert_to_tensor(g), tf.float64)


def _difference(plain, ours):
    """The largest entry of ``|plain - ours|``, where equal infinities and NaN
    against NaN agree (an overflowing float16 step, which a loss scale
    then skips, has them in both) and any other non-finite entry is an
    infinite difference."""
    plain, ours = _dense(plain), _dense(ours)
    same = tf.logical_or(tf.equal(plain, ours),
                         tf.logical_and(tf.math.is_nan(plain), tf.math.is_nan(ours)))
    finite = tf.logical_and(tf.math.is_finite(plain), tf.math.is_finite(ours))
    apart = tf.where(finite, tf.abs(plain - ours), tf.constant(np.inf, tf.float64))
    return tf.reduce_max(tf.where(same, tf.zeros_like(apart), apart))


def _largest_finite(plain):
    plain = _dense(plain)
    return tf.reduce_max(tf.where(tf.math.is_finite(plain), tf.abs(plain), tf.zeros_like(plain)))


def _assert_close(pairs, names, tol):
    """An op that fails unless every pair agrees within ``tol`` of the largest
    finite plain entry (see :func:`_difference` for non-finite ones)."""
    diffs = tf.stack([_difference(p, g) for p, g in pairs])
    scale = tf.reduce_max(tf.stack([_largest_finite(p) for p, _ in pairs]))
    worst = tf.argmax(diffs)
    relative = tf.gather(diffs, worst) / tf.maximum(scale, 1e-300)
    assertion = tf.debugging.Assert(
        tf.reduce_all(diffs <= tol * scale),
        [MARKER + ": memsave's gradients differ from plain tf.gradients' on the first step "
         "by more than %g of the largest entry (rounding alone can do that on a tiny model "
         "with batch norm over a handful of values: run the same step in float64, or pass "
         "verify=<tolerance>); worst variable:" % tol,
         tf.gather(tf.constant(names), worst), "relative difference:", relative],
        summarize=8, name="memsave_verify")
    with tf.control_dependencies([assertion]):
        return tf.constant(True)


def _first_step_flag(graph):
    """(bool tensor: is this the first run?, function building the op that clears it).

    The flag is a resource of its own (a unique ``shared_name``), not a
    ``tf.Variable``: no initializer touches it, and a tf.function may make
    one on any trace. In a tf.function it is made and set outside, and read
    inside; a read, unlike ``VarIsInitializedOp``, lets the cond drop what
    its branch reads on the later steps (measured: 28 MiB against 77). In a
    Graph the first run finds it uninitialized and initializes it.
    """
    name = "memsave_verify_" + uuid.uuid4().hex
    with graph.as_default(), tf.name_scope("memsave_verify"):
        if isinstance(graph, tf_internal.FuncGraph):
            with tf.init_scope():
                outer = tf.raw_ops.VarHandleOp(dtype=tf.bool, shape=[], shared_name=name)
                tf.raw_ops.AssignVariableOp(resource=outer, value=tf.constant(True))
            handle = graph.capture(outer)
            pending = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.bool)
        else:
            handle = tf.raw_ops.VarHandleOp(dtype=tf.bool, shape=[], shared_name=name)
            pending = tf.logical_not(tf.raw_ops.VarIsInitializedOp(resource=handle))
    return pending, lambda: tf.raw_ops.AssignVariableOp(resource=handle,
                                                        value=tf.constant(False))


@contextlib.contextmanager
def mismatch_raised():
    """Within the block, a failed first-step check (a TF error) is a GradientMismatchError."""
    try:
        yield
    except tf.errors.InvalidArgumentError as error:
        start = error.message.find(MARKER)
        if start < 0:
            raise
        raise GradientMismatchError(
            error.message[start:].split("\n")[0].split(" [[")[0]) from error
