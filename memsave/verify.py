"""``verify=``: on the first step, also run plain backprop and compare.

What PyTorch's ``determinism_check`` is for its checkpointing: cheap
insurance for a long run. The graph gets a ``tf.cond`` on a first-step flag
whose branch computes plain ``tf.gradients`` of the same forward pass and
asserts that memsave's gradients match. TensorFlow lowers the cond to
Switch/Merge, so on every later step each forward tensor the branch reads
is dropped as soon as it is made: no memory is held for the check (a
24-layer chain measured 28 MiB with the check off, 29 without it; the
first step, which runs both backward passes, 79 MiB: about plain's peak).

A mismatch fails the step with ``tf.errors.InvalidArgumentError`` whose
message starts with :data:`MARKER` and names the variable with the largest
difference; ``memsave.keras`` turns it into
:class:`memsave.errors.GradientMismatchError`.
"""

import uuid

import tensorflow as tf

from memsave import tf_internal
from memsave.errors import GradientMismatchError
from memsave.rewrite import plain_gradients

MARKER = "memsave verify=True: GradientMismatchError"

# Largest difference allowed, relative to the largest entry of all plain
# gradients, by the gradients' dtype (the least precise one decides). float32
# has room for oneDNN's and Grappler's other summation orders.
TOLERANCE = {tf.float64: 1e-7, tf.float32: 1e-3, tf.float16: 5e-2, tf.bfloat16: 5e-2}


def tolerance(verify, grads):
    """The tolerance ``verify`` asks for (None when off), checked at call time."""
    if verify is None or verify is False:
        return None
    if verify is True:
        dtypes = [_dense_dtype(g) for g in grads if g is not None]
        return max((TOLERANCE.get(d, 1e-3) for d in dtypes), default=None)
    if isinstance(verify, bool) or not isinstance(verify, (int, float)) or not verify > 0:
        raise ValueError("verify must be True, False or a tolerance > 0 (relative to the "
                         "largest gradient entry), got %r" % (verify,))
    return float(verify)


def check_option(verify):
    """Raise on a ``verify=`` value no call could accept."""
    tolerance(verify, [])


def _dense_dtype(g):
    return (g.values if isinstance(g, tf.IndexedSlices) else g).dtype.base_dtype


def on_first_step(ys, xs, grad_ys, grads, tol, tf_gradients_kwargs, name):
    """``grads``, released only after the first-step check (see the module docstring).

    ``ys``, ``xs`` and ``grad_ys`` are what :func:`memsave.gradients` was
    given (graph tensors), ``grads`` what it computed.
    """
    graph = ys[0].graph
    pending, clear = _first_step_flag(graph)
    compared = [(x, g) for x, g in zip(xs, grads) if g is not None]
    if not compared:
        return grads

    def check():
        plain = plain_gradients(ys, [x for x, _ in compared], grad_ys, name=name + "_verify",
                                **tf_gradients_kwargs)
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


def _identity(g):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(g.values), tf.identity(g.indices), g.dense_shape)
    return tf.identity(g)


def _dense(g):
    return tf.cast(tf.convert_to_tensor(g), tf.float64)


def _assert_close(pairs, names, tol):
    """An op that fails unless every pair agrees within ``tol`` of the largest plain entry."""
    diffs = tf.stack([tf.reduce_max(tf.abs(_dense(p) - _dense(g))) for p, g in pairs])
    scale = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(_dense(p))) for p, _ in pairs]))
    worst = tf.argmax(diffs)
    relative = tf.gather(diffs, worst) / tf.maximum(scale, 1e-300)
    assertion = tf.debugging.Assert(
        tf.reduce_all(diffs <= tol * scale),
        [MARKER + ": memsave's gradients differ from plain tf.gradients' on the first step "
         "by more than %g of the largest entry; worst variable:" % tol,
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


def raise_mismatch(error):
    """Re-raise a failed first-step check (a TF error) as GradientMismatchError."""
    message = getattr(error, "message", str(error))
    start = message.find(MARKER)
    if start < 0:
        raise error
    raise GradientMismatchError(message[start:].split("\n")[0].split(" [[")[0]) from error
