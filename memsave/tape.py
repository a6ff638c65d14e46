"""``tf.GradientTape`` with checkpointed gradients.

:class:`GradientTape` is a drop-in subclass of ``tf.GradientTape``: it records
exactly like the plain tape (it *is* a plain tape while recording), and only
``gradient()`` differs. Inside a graph (``tf.function`` or a
``tf.compat.v1`` Graph) it calls :func:`memsave.gradients` on the recorded
forward pass, so activations are recomputed instead of kept. When executing
eagerly there is no graph to rewrite, so it falls back to the plain tape and
logs a warning once.

Tape semantics are kept. A plain tape only differentiates through ops it
recorded: ops whose inputs it was watching, built while it was recording.
``memsave.gradients`` walks the graph instead, so before calling it we ask
the tape itself (the C++ tape that recorded the forward pass) which graph
tensors it tracks:

* targets the tape does not track (computed outside the ``with`` block, in
  ``stop_recording()``, or not depending on anything watched) get no
  gradient, as with the plain tape, except that one which is also a source
  hands that source its own seed (its output gradient, or ones) where no op
  the tape recorded on the way reads it, as the plain tape does;
* sources the tape does not track (unwatched tensors, variables not watched
  or not read while recording) get ``None`` (or zeros with
  ``unconnected_gradients=ZERO``);
* tensors between sources and targets that the tape does not track (built
  outside the recording, or not watched when their consumer was recorded)
  are passed to ``memsave.gradients`` as ``stop_gradients``, i.e. treated
  as constants, which is what the plain tape does with them, also where
  one is made by a function call (``tf.gradients`` differentiates a call
  whose output it stops at; for the tape, memsave's gradient calls do not,
  see :func:`memsave.rewrite.plain_gradients`' ``stops_hold``);
* a tensor watched where this tape did not track it (made before it
  began, under a tape around it, or in its ``stop_recording()``) is a leaf,
  which the walk stops at; watching one it tracks changes nothing (see
  :func:`note_watch`).

Variables are differentiated through their handles. memsave keeps the
forward pass's variable reads instead of re-reading in the backward pass, so
an update the training step makes after computing gradients (e.g. the
optimizer's) cannot leak into the recomputation.

Cases that cannot be rewritten faithfully use the plain tape (and say so
once at WARNING): eager execution, ``gradient()`` called inside the
recording context of a persistent tape or while another tape records
(higher-order gradients need the gradient ops on that tape, and memsave's
recomputed ops are not recorded), composite tensors, targets spread
over several graphs, and ops built under ``gradient_override_map`` (the
tape ignores the override, ``tf.gradients`` would apply it), and a
watched tensor that two or more other tapes tracked, where the tape set
cannot say whether it was a leaf for this one.
:class:`memsave.NoBottleneckError` from the 'memory' strategy is raised,
never papered over.

``memsave.patch(tape=True)`` and :func:`memsave.patching.scope` route every
plain ``tf.GradientTape`` through :func:`tape_gradient` as well; that
process-wide state lives in :mod:`memsave.patching`, which imports this
module (never the reverse). The options are resolved once, when the tape
is made, into :class:`memsave.settings.Settings`.
"""

import contextlib
import dataclasses
import threading

import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from memsave import api
from memsave import tf_internal
from memsave.errors import GradientMismatchError, NoBottleneckError, TapeNoBottleneckError
from memsave.graph.edit import is_outer_graph
from memsave.graph.walk import backward_ops, differentiably_connected, forward_ops
from memsave.log import logger, warn_once
from memsave.settings import DEFAULT_CHECKPOINTS, resolve

# TensorFlow's own GradientTape.gradient, whatever is installed later.
TF_GRADIENT = getattr(tf.GradientTape.gradient, "__memsave_original__",
                      tf.GradientTape.gradient)

EAGER_MESSAGE = (
    "memsave: GradientTape.gradient is executing eagerly; there is no graph to rewrite, "
    "so the plain tf.GradientTape is used and no memory is saved. Wrap the training "
    "step in tf.function to get checkpointed gradients.")

# dtypes the C++ tape considers trainable (it records ops through them).
_TAPE_DTYPES = frozenset({"resource", "variant"})


# ---------------------------------------------------------------------------
# Plain gradients on this thread (jacobians).
#
# A jacobian calls gradient() once per row inside pfor/while loops, which
# memsave cannot rewrite; both memsave.GradientTape and the patched
# tf.GradientTape give those calls TensorFlow's gradient. Thread-local, so a
# jacobian on one thread does not switch memsave off for the others.

_local = threading.local()


def bypassed():
    """True while :func:`bypass` is open on this thread."""
    return getattr(_local, "bypass", 0) > 0


@contextlib.contextmanager
def bypass():
    """Within the block, on this thread, every tape's gradient() is TensorFlow's."""
    _local.bypass = getattr(_local, "bypass", 0) + 1
    try:
        yield
    finally:
        _local.bypass -= 1


# ---------------------------------------------------------------------------
# The gradient.

def _is_graph_tensor(t):
    return isinstance(t, tf.Tensor) and not isinstance(t, tf_internal.EagerTensor)


def _differentiable(dtype):
    dtype = dtype.base_dtype
    return dtype.is_floating or dtype.is_complex


def _tape_trainable(t):
    return _differentiable(t.dtype) or t.dtype.name in _TAPE_DTYPES


def _in_graph(value, graph):
    """The tensor standing for ``value`` in ``graph``, or None if it is not there.

    Nothing is captured: a tensor or variable handle the graph never captured
    is not used by it, so nothing in it depends on that source.
    """
    if _is_graph_tensor(value) and value.graph is graph:
        return value
    if isinstance(graph, tf_internal.FuncGraph):
        for external, internal in graph.captures:
            if external is value:
                return internal
    return None


def _flat_targets(target):
    flat = tf.nest.flatten(target)
    return [t.handle if tf_internal.is_resource_variable(t) else t for t in flat]


def _check_targets_traced(target):
    """Raise _Fallback where a target leaves no graph to rewrite: an eager
    tensor, or a tf.Variable inside tf.function (its handle is an eager
    tensor there too, but the step is traced: the warning says which)."""
    if not tf.executing_eagerly() and any(
            tf_internal.is_resource_variable(t) for t in tf.nest.flatten(target)):
        raise _Fallback("variable-target", (
            "memsave: GradientTape.gradient got a tf.Variable among its targets; the "
            "plain tf.GradientTape is used for such calls and no memory is saved (pass "
            "a tensor computed from it instead, e.g. tf.identity(variable))"))
    if any(isinstance(t, tf_internal.EagerTensor) for t in _flat_targets(target)):
        raise _Fallback("eager", EAGER_MESSAGE)


def _flat_output_gradients(output_gradients):
    if output_gradients is None:
        return None
    flat = tf.nest.flatten(tf_internal.convert_variables_to_tensors(output_gradients))
    flat = tf_internal.get_flat_tensors_for_gradients(flat)
    return [None if g is None else tf.convert_to_tensor(g) for g in flat]


class _Fallback(Exception):
    """Use the plain tape; ``key`` and ``message`` say why (logged once)."""

    def __init__(self, key, message):
        super().__init__(message)
        self.key, self.message = key, message


def _tracked(tape, tensors):
    """For each graph tensor: does ``tape`` track it (would it record its consumers)?

    This asks the C++ tape that recorded the forward pass: it tracks watched
    tensors and the outputs of every op it recorded. The tape is pushed alone
    (the caller checked that no other tape is active) and no op is built
    while it is pushed.
    """
    tf_internal.push_tape(tf_internal.tape_handle(tape))
    try:
        return [tf_internal.should_record_backprop([t]) for t in tensors]
    finally:
        tf_internal.pop_tape(tf_internal.tape_handle(tape))


def _zeros_for(raw, graph_tensor):
    """What the plain tape returns for an unconnected source with ZERO."""
    if tf_internal.is_resource_variable(raw):
        if raw.shape.is_fully_defined():
            return tf.zeros(raw.shape, dtype=_variable_dtype(raw))
        # Declared with unknown dimensions: sized by its value, read here,
        # as the plain tape does.
        return tf.zeros_like(raw)
    return tf_internal.default_zeros_like(graph_tensor if graph_tensor is not None else raw)


def _variable_dtype(var):
    return tf.as_dtype(var.dtype).base_dtype


def _held_dtype(handle):
    """The dtype of the variable a graph resource handle refers to (a source
    given as ``v.handle``: the plain tape differentiates its reads), or
    ``tf.resource`` where its handle data does not say."""
    found = tf_internal.resource_handle_data(handle).shape_and_type
    return tf.as_dtype(found[0].dtype) if found and found[0].dtype else tf.resource


def _grad_in_graph(g, graph):
    if g is None or (_is_graph_tensor(g) and g.graph is graph):
        return g
    found = _in_graph(g, graph)
    if found is not None:
        return found
    if _is_graph_tensor(g) and not is_outer_graph(g.graph, graph):
        # Made in a graph inside the targets' (a cond branch, a loop body, a
        # nested function that calls gradient()): memsave's backward pass is
        # built in the targets' graph, which cannot read it.
        raise _Fallback("inner-output-gradient", "memsave: GradientTape.gradient got an "
                        "output gradient made inside a tf.cond branch, loop body or nested "
                        "function, which the targets' graph cannot read; the plain "
                        "tf.GradientTape is used for such calls")
    with graph.as_default():
        return tf.identity(g)  # captures an eager or outer-graph tensor


def _checked_inputs(target, sources, output_gradients):
    """Everything memsave needs, or raise _Fallback.

    Returns (graph, flat targets, flat raw sources, flat source graph tensors,
    flat output gradients).
    """
    _check_targets_traced(target)
    flat_targets = _flat_targets(target)
    if not all(_is_graph_tensor(t) for t in flat_targets):
        raise _Fallback("composite", "memsave: GradientTape.gradient got a target that is not "
                        "a plain tf.Tensor (e.g. a RaggedTensor or IndexedSlices); the plain "
                        "tf.GradientTape is used for such calls")
    graph = flat_targets[0].graph
    if any(t.graph is not graph for t in flat_targets):
        raise _Fallback("graphs", "memsave: GradientTape.gradient got targets from several "
                        "graphs; the plain tf.GradientTape is used for such calls")
    flat_raw = tf.nest.flatten(sources)
    flat_xs = []
    for raw in flat_raw:
        value = raw.handle if tf_internal.is_resource_variable(raw) else raw
        if isinstance(value, (tf.IndexedSlices,)) or not isinstance(
                value, tf.Tensor):
            raise _Fallback("composite", "memsave: GradientTape.gradient got a source that is "
                            "not a tf.Tensor or variable (e.g. a RaggedTensor); the plain "
                            "tf.GradientTape is used for such calls")
        flat_xs.append(_in_graph(value, graph))
    flat_grads = _flat_output_gradients(output_gradients)
    if flat_grads is not None:
        if len(flat_grads) != len(flat_targets):
            raise _Fallback("mismatch", "memsave: output_gradients do not match the targets; "
                            "the plain tf.GradientTape reports the error")
        if any(g is None for g in flat_grads):
            # tf.gradients' grad_ys take None as ones; the tape refuses it.
            raise _Fallback("none-output-gradient", "memsave: an entry of output_gradients "
                            "is None; the plain tf.GradientTape reports the error")
        flat_grads = [_grad_in_graph(g, graph) for g in flat_grads]
    return graph, flat_targets, flat_raw, flat_xs, flat_grads


@dataclasses.dataclass
class _Call:
    """What to ask memsave for, and how to map its answer back to the sources."""

    ys: list
    grad_ys: list = None
    xs: list = dataclasses.field(default_factory=list)
    stops: list = dataclasses.field(default_factory=list)
    # Per flat source: None (no gradient) or i (the gradient of xs[i]).
    routes: list = dataclasses.field(default_factory=list)
    # Indices of the flat targets the tape does not track (see _seeds).
    untracked: list = dataclasses.field(default_factory=list)
    connected: bool = False   # some y depends on some x


def _sources_tracked(tape, flat_raw, flat_xs):
    """Whether the tape tracks each source present in the graph.

    A variable, or an eager tensor the graph captured, is tracked when the
    tape watched it: the tape records a nested function call (Keras runs
    grouped convolutions as one) on the variable's own handle or the eager
    tensor itself, not on the placeholder this graph captured for it, which
    the tape may never have seen.
    """
    present = [(raw.handle if tf_internal.is_resource_variable(raw)
                else raw if isinstance(raw, tf_internal.EagerTensor) else x)
               for raw, x in zip(flat_raw, flat_xs) if x is not None]
    return _tracked(tape, present)


def _check_routes(tape, call, flat_raw, flat_xs):
    """Raise unless every variable the plain tape would differentiate is asked for.

    Independent of how the routes were chosen: a variable the tape watched,
    read in this graph by an op the tape recorded (its output is tracked)
    on the way to the targets, gets a gradient from the plain tape, so it
    must get one from memsave.
    """
    watched = {v.handle.ref() for v in tape.watched_variables()
               if tf_internal.is_resource_variable(v)}
    unrouted = [(raw, x) for raw, x, route in zip(flat_raw, flat_xs, call.routes)
                if route is None and x is not None and tf_internal.is_resource_variable(raw)
                and raw.handle.ref() in watched and _differentiable(_variable_dtype(raw))]
    if not unrouted or not call.ys:
        return
    behind = backward_ops([y.op for y in call.ys])
    for raw, x in unrouted:
        for op in x.consumers():
            if op in behind and any(_tracked(tape, list(op.outputs))):
                raise GradientMismatchError(
                    "memsave.GradientTape: the tape recorded %s reading the variable %s on "
                    "the way to the targets, so the plain tape gives it a gradient, but "
                    "memsave would give None. This is a memsave bug: please report it."
                    % (op.name, raw.name))


# Attributes of a tape (memsave's, or a plain one while tapes are routed):
# the graph tensors it watched that it did not track then (leaves), and
# those it watched where the tape set could not say (see _tracked_alone).
_LEAVES = "_memsave_leaves"
_UNSURE = "_memsave_unsure_leaves"


def _tracked_alone(tape, t):
    """Whether ``tape`` itself tracks the graph tensor ``t`` (True/False), or
    None where the tape set cannot tell.

    The C++ tape set answers for every active tape at once: another tape
    recording around this one may track ``t`` where this one does not,
    and this one may be off the set (in its ``stop_recording()``, after its
    ``with`` block). Its count of tapes tracking ``t`` (0, 1, or 2 for more,
    a persistent tape counting 2) is read without and with this tape: they
    differ exactly when this tape tracks ``t``, unless the others already
    count 2.
    """
    handle = tf_internal.tape_handle(tape)
    active = tf_internal.tape_recording(tape)
    if active:
        tf_internal.pop_tape(handle)
    try:
        others = tf_internal.possible_gradient_types([t])
        tf_internal.push_tape(handle)
        try:
            with_it = tf_internal.possible_gradient_types([t])
        finally:
            tf_internal.pop_tape(handle)
    finally:
        if active:
            tf_internal.push_tape(handle)
    if others >= 2:
        return None
    return with_it > others


def note_watch(tape, tensor):
    """Remember which of the tensors ``tape`` is about to watch are leaves.

    The C++ tape records a watched tensor whose producer it never saw (made
    under ``stop_recording()``, outside the ``with`` block, or before this
    tape began under a tape around it) as a leaf; memsave walks the graph,
    so it must be told. Whether this tape tracks a tensor can only be asked
    now, before the watch (see :func:`_tracked_alone`). While recording is
    paused on the thread the watch does nothing, and nothing is noted.
    """
    if tf_internal.tape_set_is_stopped():
        return
    for t in tf.nest.flatten(tensor):
        if not (_is_graph_tensor(t) and _tape_trainable(t)):
            continue
        tracked = _tracked_alone(tape, t)
        if tracked:
            continue
        if not hasattr(tape, _LEAVES):
            setattr(tape, _LEAVES, [])
            setattr(tape, _UNSURE, [])
        noted = getattr(tape, _LEAVES if tracked is False else _UNSURE)
        if not any(t is leaf for leaf in noted):
            noted.append(t)


def _plan_call(tape, flat_targets, flat_raw, flat_xs, flat_grads):
    """Which targets, sources and constants give the plain tape's answer."""
    tracked = _tracked(tape, flat_targets)
    keep = [i for i, ok in enumerate(tracked) if ok]
    call = _Call(ys=[flat_targets[i] for i in keep],
                 untracked=[i for i, ok in enumerate(tracked) if not ok])
    if flat_grads is not None and any(flat_grads[i] is not None for i in keep):
        call.grad_ys = [flat_grads[i] for i in keep]
    if any(y.dtype.is_complex for y in call.ys):
        # The tape seeds a target without an output gradient with ones, complex
        # ones too; tf.gradients refuses a complex y without its grad_y.
        given = call.grad_ys or [None] * len(call.ys)
        with call.ys[0].graph.as_default():
            call.grad_ys = [tf.ones_like(y) if g is None and y.dtype.is_complex else g
                            for y, g in zip(call.ys, given)]
    if not call.ys:
        call.routes = [None] * len(flat_raw)
        return call
    _route_sources(tape, call, flat_raw, flat_xs)
    if call.xs:
        _stop_where_the_tape_did_not_record(tape, call)
    return call


def _route_sources(tape, call, flat_raw, flat_xs):
    """Fill ``call.xs`` and ``call.routes``: each tracked, differentiable source once."""
    where = {}
    present_ok = iter(_sources_tracked(tape, flat_raw, flat_xs))
    for raw, x in zip(flat_raw, flat_xs):
        ok = next(present_ok) if x is not None else False
        is_var = tf_internal.is_resource_variable(raw)
        dtype = (_variable_dtype(raw) if is_var else None if x is None
                 else _held_dtype(x) if x.dtype == tf.resource else x.dtype)
        if not ok or not _differentiable(dtype):
            call.routes.append(None)
            continue
        # Variables are differentiated through their handle; memsave never
        # re-reads a variable in the backward pass (it keeps the forward
        # reads), so an update later in the step cannot leak in.
        if x.ref() not in where:
            where[x.ref()] = len(call.xs)
            call.xs.append(x)
        call.routes.append(where[x.ref()])


def _stop_where_the_tape_did_not_record(tape, call):
    """Set ``call.connected`` and ``call.stops``.

    Tensors on a path from the xs to the ys that the tape did not track are
    constants for the plain tape: they become constants for memsave.
    """
    behind = backward_ops([y.op for y in call.ys])
    starts = [c for x in call.xs for c in x.consumers() if c in behind]
    y_refs = {y.ref() for y in call.ys}
    call.connected = bool(starts) or any(x.ref() in y_refs for x in call.xs)
    between = forward_ops(starts, within=behind)
    _check_gradients_by_type(between)
    inner, seen = [], {x.ref() for x in call.xs}
    for op in sorted(between, key=tf_internal.op_id):
        for t in op.inputs:
            if t.ref() in seen or t.op not in between:
                continue
            seen.add(t.ref())
            if _tape_trainable(t):
                inner.append(t)
    call.stops = [t for t, ok in zip(inner, _tracked(tape, inner)) if not ok]
    # A tensor watched when the tape did not track it is a leaf for the tape:
    # its producer was not recorded, so backprop stops there (a stop that is
    # a source still gets its own gradient).
    unsure = [t for t in getattr(tape, _UNSURE, ()) if t.op in between]
    if unsure:
        raise _Fallback("watch-unsure", (
            "memsave: %s was watched while two or more other tapes tracked it, so memsave "
            "cannot tell whether it is a leaf for this tape; the plain tf.GradientTape is "
            "used for this call" % unsure[0].name))
    stopped = {t.ref() for t in call.stops}
    call.stops += [t for t in getattr(tape, _LEAVES, ())
                   if t.op in between and t.ref() not in stopped]
    if call.stops:
        logger.info("memsave: %d tensor(s) between sources and target were not recorded by "
                    "the tape; they are treated as constants, as the plain tape does: %s",
                    len(call.stops), ", ".join(t.name for t in call.stops[:8]))


def _check_gradients_by_type(ops):
    """Raise _Fallback where an op was built under ``gradient_override_map``:
    the plain tape looks gradients up by op type and ignores the override,
    which ``tf.gradients`` would apply. ``tf.custom_gradient``'s IdentityN
    carries one too, and the tape applies the same function there (it
    recorded it)."""
    overridden = [op for op in ops if op.type != "IdentityN"
                  and tf_internal.gradient_override_name(op) is not None]
    if overridden:
        raise _Fallback("gradient-override", (
            "memsave: %s was built under gradient_override_map, which tf.GradientTape "
            "ignores (tf.gradients applies it); the plain tf.GradientTape is used for "
            "such calls, and no memory is saved" % overridden[0].name))


def _rewritable_call(tape, target, sources, output_gradients):
    """:func:`_checked_inputs`, once the tape's state allows a rewrite (else _Fallback).

    Pauses a non-persistent tape that is still recording, as the plain tape does.
    """
    _check_targets_traced(target)
    if tf_internal.tape_recording(tape):
        if tf_internal.tape_persistent(tape):
            raise _Fallback("persistent-recording", (
                "memsave: gradient() was called inside the recording context of a "
                "persistent tape, which records the gradient for higher-order "
                "derivatives; memsave's recomputed ops would be missing from it, so "
                "the plain tf.GradientTape is used. Call gradient() after the with "
                "block to save memory."))
        tf_internal.pause_tape(tape)
    checked = _checked_inputs(target, sources, output_gradients)
    if tf_internal.could_possibly_record() or tf_internal.tape_set_is_stopped():
        raise _Fallback("nested", (
            "memsave: another GradientTape is recording while gradient() runs (e.g. "
            "higher-order gradients); it would not see memsave's recomputed ops, so "
            "the plain tf.GradientTape is used for this call"))
    return checked


def _differentiate(call, settings):
    """memsave's gradients for ``call.xs`` (None each when no y depends on them)."""
    if not call.connected:
        return [None] * len(call.xs)
    kwargs = {"stop_gradients": call.stops} if call.stops else {}
    try:
        grads = api.differentiate(call.ys, call.xs, call.grad_ys, settings, stops_hold=True,
                                  **kwargs)
    except NoBottleneckError as e:
        raise TapeNoBottleneckError(
            "%s (from GradientTape.gradient; pass checkpoints='optimal' to "
            "memsave.GradientTape, or to memsave.patch / memsave.keras.enable)" % e) from None
    # tf.gradients gives zeros for an unused output of an op it differentiates
    # (a Split's unused half) that is an x; the tape gives None for a source
    # no target depends on.
    return [g if connected else None for g, connected in
            zip(grads, differentiably_connected(call.xs, call.ys, call.stops))]


def _seeds(tape, call, flat_targets, flat_xs, flat_grads, flat_grad):
    """``flat_grad`` with the seed of each target the tape does not track
    given to the source that is that very tensor, where the plain tape keeps
    it: it seeds such a target with its output gradient, or ones, and hands
    that to the source (d z / d z; memsave had None), unless an op it
    recorded on the way back from the targets reads the tensor (then what
    arrived there, the seed too, is dropped once that op is differentiated,
    and the source gets None)."""
    out, recorded = list(flat_grad), None
    for j, (x, route) in enumerate(zip(flat_xs, call.routes)):
        if route is not None or x is None or not _differentiable(x.dtype):
            continue
        seeds = [tf.ones_like(x) if flat_grads is None else flat_grads[i]
                 for i in call.untracked if flat_targets[i] is x]
        if not seeds:
            continue
        if recorded is None:
            recorded = _recorded_behind(tape, call.ys)
        if not any(c in recorded for c in x.consumers()):
            out[j] = seeds[0] if len(seeds) == 1 else tf.add_n(seeds)
    return out


def _recorded_behind(tape, ys):
    """The ops the plain tape differentiates going back from ``ys``: their
    producers, and those of the tensors it tracks that they read."""
    ops, frontier = set(), list(ys)
    while frontier:
        fresh = {t.op: None for t in frontier if t.op not in ops}
        ops.update(fresh)
        inputs = [t for op in fresh for t in op.inputs]
        frontier = [t for t, ok in zip(inputs, _tracked(tape, inputs)) if ok]
    return ops


# Plain Python graph rewriting: autograph must not convert it inside tf.function.
@do_not_convert
def tape_gradient(tape, settings, target, sources, output_gradients=None,
                  unconnected_gradients=tf.UnconnectedGradients.NONE):
    """``tape.gradient(...)`` computed by :func:`memsave.gradients` with ``settings``.

    Falls back to TensorFlow's ``GradientTape.gradient`` where the rewrite
    cannot honour the tape's semantics (see the module docstring).
    """
    def plain():
        return TF_GRADIENT(tape, target, sources, output_gradients, unconnected_gradients)

    # Errors the plain tape reports (used tape, None target, bad option).
    if tf_internal.tape_handle(tape) is None or target is None:
        return plain()
    try:
        unconnected = tf.UnconnectedGradients(unconnected_gradients)
    except ValueError:
        return plain()

    try:
        graph, flat_targets, flat_raw, flat_xs, flat_grads = _rewritable_call(
            tape, target, sources, output_gradients)
        call = _plan_call(tape, flat_targets, flat_raw, flat_xs, flat_grads)
    except _Fallback as why:
        warn_once("tape:" + why.key, why.message)
        return plain()

    _check_routes(tape, call, flat_raw, flat_xs)
    grads = _differentiate(call, settings)
    flat_grad = []
    for route in call.routes:
        flat_grad.append(None if route is None else grads[route])
    with graph.as_default():
        flat_grad = _seeds(tape, call, flat_targets, flat_xs, flat_grads, flat_grad)
        if unconnected == tf.UnconnectedGradients.ZERO:
            flat_grad = [_zeros_for(raw, x) if g is None else g
                         for g, raw, x in zip(flat_grad, flat_raw, flat_xs)]

    if not tf_internal.tape_persistent(tape):
        # As the plain tape: remember the watched variables, then forget the tape.
        tf_internal.release_tape(tape)
    return tf.nest.pack_sequence_as(sources, flat_grad)


# ---------------------------------------------------------------------------
# The subclass.

class GradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` whose ``gradient()`` recomputes activations.

    ``checkpoints`` and memsave's other keywords (``budget``,
    ``max_recompute``, ``offload``, ...; see :mod:`memsave.settings`) mean
    what they mean for :func:`memsave.gradients` and are checked here; the
    default, 'optimal', keeps the tensors with the lowest estimated peak.
    Everything else, including ``jacobian``, behaves like
    ``tf.GradientTape``; see the module docstring for the cases that use the
    plain tape.
    """

    def __init__(self, persistent=False, watch_accessed_variables=True, *,
                 checkpoints=DEFAULT_CHECKPOINTS, **options):
        settings = resolve(checkpoints, options, "memsave.GradientTape")
        super().__init__(persistent=persistent,
                         watch_accessed_variables=watch_accessed_variables)
        self._memsave_settings = settings

    @property
    def checkpoints(self):
        return self._memsave_settings.checkpoints.given

    def watch(self, tensor):
        note_watch(self, tensor)
        super().watch(tensor)

    watch.__doc__ = tf.GradientTape.watch.__doc__

    @do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        if bypassed():
            return TF_GRADIENT(self, target, sources, output_gradients, unconnected_gradients)
        return tape_gradient(self, self._memsave_settings, target, sources, output_gradients,
                             unconnected_gradients)

    gradient.__doc__ = TF_GRADIENT.__doc__

    # Per-row gradients of a jacobian are TensorFlow's (see bypass()).
    def jacobian(self, *args, **kwargs):
        with bypass():
            return super().jacobian(*args, **kwargs)

    def batch_jacobian(self, *args, **kwargs):
        with bypass():
            return super().batch_jacobian(*args, **kwargs)
