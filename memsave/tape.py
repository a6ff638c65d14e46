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
  gradient, as with the plain tape;
* sources the tape does not track (unwatched tensors, variables not watched
  or not read while recording) get ``None`` (or zeros with
  ``unconnected_gradients=ZERO``);
* tensors between sources and targets that the tape does not track (built
  outside the recording, or not watched when their consumer was recorded)
  are passed to ``memsave.gradients`` as ``stop_gradients``, i.e. treated
  as constants, which is what the plain tape does with them.

Variables are differentiated through their handles. memsave keeps the
forward pass's variable reads instead of re-reading in the backward pass, so
an update the training step makes after computing gradients (e.g. the
optimizer's) cannot leak into the recomputation.

Cases that cannot be rewritten faithfully use the plain tape (and say so
once at WARNING): eager execution, ``gradient()`` called inside the
recording context of a persistent tape or while another tape records
(higher-order gradients need the gradient ops on that tape, and memsave's
recomputed ops are not recorded), composite tensors, and targets spread
over several graphs. :class:`memsave.NoBottleneckError` from the 'memory'
strategy is raised, never papered over.

``memsave.patch(tape=True)`` routes every ``tf.GradientTape`` through the
same code by replacing ``tf.GradientTape.gradient``; :func:`scope` does the
same for the current thread only, for the duration of a ``with`` block
(this is what :mod:`memsave.keras` uses).
"""

import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
import warnings

from tensorflow.python import pywrap_tfe
from tensorflow.python.autograph.impl.api import do_not_convert
from tensorflow.python.eager import backprop
from tensorflow.python.eager import record
from tensorflow.python.eager import tape as tape_lib
from tensorflow.python.framework import composite_tensor_gradient
from tensorflow.python.framework import func_graph as tf_func_graph
from tensorflow.python.framework import indexed_slices
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.framework import tensor as tf_tensor
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import default_gradient
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.util import nest
from tensorflow.python.util import variable_utils

from memsave import api
from memsave.graph.walk import backward_ops, forward_ops
from memsave.errors import NoBottleneckError, TapeNoBottleneckError

logger = logging.getLogger("memsave")

# TensorFlow's own GradientTape.gradient, whatever is installed later.
_TF_GRADIENT = getattr(backprop.GradientTape.gradient, "__memsave_original__",
                       backprop.GradientTape.gradient)

EAGER_MESSAGE = (
    "memsave: GradientTape.gradient is executing eagerly; there is no graph to rewrite, "
    "so the plain tf.GradientTape is used and no memory is saved. Wrap the training "
    "step in tf.function to get checkpointed gradients.")

# dtypes the C++ tape considers trainable (it records ops through them).
_TAPE_DTYPES = frozenset({"resource", "variant"})


# The strategy of tapes, patch() and Keras: 'optimal' was as good as or
# better than the others on every model measured (memsave.gradients keeps
# 'collection' for parity with the original library).
DEFAULT_CHECKPOINTS = "optimal"


def renamed_strategy(checkpoints, kwargs, where):
    """``checkpoints``, or the value of the old ``strategy=`` keyword (popped)."""
    if "strategy" not in kwargs:
        return checkpoints
    value = kwargs.pop("strategy")
    warnings.warn("%s: strategy= is now called checkpoints=, as in memsave.gradients"
                  % where, DeprecationWarning, stacklevel=3)
    return value


# Keyword-only planning options of memsave.gradients (e.g. 'budget',
# 'batch_size') that tapes pass along.
OPTION_NAMES = frozenset(
    name for name, p in inspect.signature(api.gradients).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name not in ("min_checkpoint_size", "name"))


@dataclasses.dataclass(frozen=True)
class Config:
    """What a tape passes to :func:`memsave.gradients`."""

    checkpoints: object = DEFAULT_CHECKPOINTS
    min_checkpoint_size: int = 1024
    options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.checkpoints, str) and self.checkpoints not in api.STRATEGIES:
            raise ValueError("unknown checkpoints strategy %r; use one of %s or a list of "
                             "tensors" % (self.checkpoints, ", ".join(map(repr, api.STRATEGIES))))
        if not isinstance(self.checkpoints, (str, list, tuple)):
            raise TypeError("checkpoints must be a strategy name (%s) or a list of tensors, "
                            "got %r" % (", ".join(api.STRATEGIES), self.checkpoints))
        if self.min_checkpoint_size < 0:
            raise ValueError("min_checkpoint_size must be >= 0, got %r"
                             % (self.min_checkpoint_size,))
        unknown = sorted(set(self.options) - OPTION_NAMES)
        if unknown:
            raise TypeError("unexpected option(s) %s; memsave.gradients accepts %s"
                            % (", ".join(unknown), ", ".join(
                                ["min_checkpoint_size"] + sorted(OPTION_NAMES))))

    @classmethod
    def make(cls, checkpoints=DEFAULT_CHECKPOINTS, min_checkpoint_size=1024, **options):
        return cls(checkpoints, min_checkpoint_size, dict(options))


def config_kwargs(kwargs):
    """The entries of ``kwargs`` (e.g. ``memsave.patch``'s) that tapes use."""
    return {k: v for k, v in kwargs.items() if k == "min_checkpoint_size" or k in OPTION_NAMES}


# ---------------------------------------------------------------------------
# Warnings that are worth saying once per process.

_warned = set()
_warned_lock = threading.Lock()


def _warn_once(key, message, *args):
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message, *args)


def reset_warnings():
    """Forget which once-only warnings were given (for tests)."""
    with _warned_lock:
        _warned.clear()


# ---------------------------------------------------------------------------
# The gradient.

def _is_graph_tensor(t):
    return isinstance(t, tf_tensor.Tensor) and not isinstance(t, tf_ops.EagerTensor)


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
    if isinstance(graph, tf_func_graph.FuncGraph):
        for external, internal in graph.captures:
            if external is value:
                return internal
    return None


def _flat_targets(target):
    flat = nest.flatten(target)
    return [t.handle if resource_variable_ops.is_resource_variable(t) else t for t in flat]


def _flat_output_gradients(output_gradients):
    if output_gradients is None:
        return None
    flat = nest.flatten(variable_utils.convert_variables_to_tensors(output_gradients))
    flat = composite_tensor_gradient.get_flat_tensors_for_gradients(flat)
    return [None if g is None else tf_ops.convert_to_tensor(g) for g in flat]


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
    tape_lib.push_tape(tape._tape)  # pylint: disable=protected-access
    try:
        return [record.should_record_backprop([t]) for t in tensors]
    finally:
        tape_lib.pop_tape(tape._tape)  # pylint: disable=protected-access


def _zeros_for(raw, graph_tensor):
    """What the plain tape returns for an unconnected source with ZERO."""
    if resource_variable_ops.is_resource_variable(raw):
        return array_ops.zeros(raw.shape, dtype=_variable_dtype(raw))
    return default_gradient.zeros_like(graph_tensor if graph_tensor is not None else raw)


def _variable_dtype(var):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return tf.as_dtype(var.dtype).base_dtype


def _grad_in_graph(g, graph):
    if g is None or (_is_graph_tensor(g) and g.graph is graph):
        return g
    found = _in_graph(g, graph)
    if found is not None:
        return found
    with graph.as_default():
        return array_ops.identity(g)  # captures an eager or outer-graph tensor


def _checked_inputs(target, sources, output_gradients):
    """Everything memsave needs, or raise _Fallback.

    Returns (graph, flat targets, flat raw sources, flat source graph tensors,
    flat output gradients).
    """
    flat_targets = _flat_targets(target)
    if any(isinstance(t, tf_ops.EagerTensor) for t in flat_targets):
        raise _Fallback("eager", EAGER_MESSAGE)
    if not all(_is_graph_tensor(t) for t in flat_targets):
        raise _Fallback("composite", "memsave: GradientTape.gradient got a target that is not "
                        "a plain tf.Tensor (e.g. a RaggedTensor or IndexedSlices); the plain "
                        "tf.GradientTape is used for such calls")
    graph = flat_targets[0].graph
    if any(t.graph is not graph for t in flat_targets):
        raise _Fallback("graphs", "memsave: GradientTape.gradient got targets from several "
                        "graphs; the plain tf.GradientTape is used for such calls")
    flat_raw = nest.flatten(sources)
    flat_xs = []
    for raw in flat_raw:
        value = raw.handle if resource_variable_ops.is_resource_variable(raw) else raw
        if isinstance(value, (indexed_slices.IndexedSlices,)) or not isinstance(
                value, tf_tensor.Tensor):
            raise _Fallback("composite", "memsave: GradientTape.gradient got a source that is "
                            "not a tf.Tensor or variable (e.g. a RaggedTensor); the plain "
                            "tf.GradientTape is used for such calls")
        flat_xs.append(_in_graph(value, graph))
    flat_grads = _flat_output_gradients(output_gradients)
    if flat_grads is not None:
        if len(flat_grads) != len(flat_targets):
            raise _Fallback("mismatch", "memsave: output_gradients do not match the targets; "
                            "the plain tf.GradientTape reports the error")
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
    connected: bool = False   # some y depends on some x


def _plan_call(tape, flat_targets, flat_raw, flat_xs, flat_grads):
    """Which targets, sources and constants give the plain tape's answer."""
    tracked = _tracked(tape, flat_targets)
    keep = [i for i, ok in enumerate(tracked) if ok]
    call = _Call(ys=[flat_targets[i] for i in keep])
    if flat_grads is not None and any(flat_grads[i] is not None for i in keep):
        call.grad_ys = [flat_grads[i] for i in keep]
    if not call.ys:
        call.routes = [None] * len(flat_raw)
        return call
    behind = backward_ops([y.op for y in call.ys])

    where = {}

    def x_index(t):
        if t.ref() not in where:
            where[t.ref()] = len(call.xs)
            call.xs.append(t)
        return where[t.ref()]

    # A variable is tracked when the tape watched the variable itself: the
    # tape records a nested function call (Keras runs grouped convolutions
    # as one) on the variable's own handle, not on the placeholder this
    # graph captured for it, which the tape may never have seen.
    present = [(raw.handle if resource_variable_ops.is_resource_variable(raw) else x)
               for raw, x in zip(flat_raw, flat_xs) if x is not None]
    present_ok = iter(_tracked(tape, present))
    for raw, x in zip(flat_raw, flat_xs):
        ok = next(present_ok) if x is not None else False
        is_var = resource_variable_ops.is_resource_variable(raw)
        dtype = _variable_dtype(raw) if is_var else (x.dtype if x is not None else None)
        if not ok or not _differentiable(dtype):
            call.routes.append(None)
            continue
        # Variables are differentiated through their handle; memsave never
        # re-reads a variable in the backward pass (it keeps the forward
        # reads), so an update later in the step cannot leak in.
        call.routes.append(x_index(x))
    if not call.xs:
        return call

    # Tensors on a path from the xs to the ys that the tape did not track
    # are constants for the plain tape: make them constants for memsave.
    starts = [c for x in call.xs for c in x.consumers() if c in behind]
    y_refs = {y.ref() for y in call.ys}
    call.connected = bool(starts) or any(x.ref() in y_refs for x in call.xs)
    between = forward_ops(starts, within=behind)
    inner, seen = [], set(where)
    for op in sorted(between, key=lambda op: op._id):  # pylint: disable=protected-access
        for t in op.inputs:
            if t.ref() in seen or t.op not in between:
                continue
            seen.add(t.ref())
            if _tape_trainable(t):
                inner.append(t)
    call.stops = [t for t, ok in zip(inner, _tracked(tape, inner)) if not ok]
    if call.stops:
        logger.info("memsave: %d tensor(s) between sources and target were not recorded by "
                    "the tape; they are treated as constants, as the plain tape does: %s",
                    len(call.stops), ", ".join(t.name for t in call.stops[:8]))
    return call


# Plain Python graph rewriting: autograph must not convert it inside tf.function.
@do_not_convert
def tape_gradient(tape, config, target, sources, output_gradients=None,
                  unconnected_gradients=UnconnectedGradients.NONE):
    """``tape.gradient(...)`` computed by :func:`memsave.gradients` with ``config``.

    Falls back to TensorFlow's ``GradientTape.gradient`` where the rewrite
    cannot honour the tape's semantics (see the module docstring).
    """
    def plain():
        return _TF_GRADIENT(tape, target, sources, output_gradients, unconnected_gradients)

    # Errors the plain tape reports (used tape, None target, bad option).
    if tape._tape is None or target is None:  # pylint: disable=protected-access
        return plain()
    try:
        unconnected = UnconnectedGradients(unconnected_gradients)
    except ValueError:
        return plain()

    try:
        if any(isinstance(t, tf_ops.EagerTensor) for t in _flat_targets(target)):
            raise _Fallback("eager", EAGER_MESSAGE)
        if tape._recording:  # pylint: disable=protected-access
            if tape._persistent:  # pylint: disable=protected-access
                raise _Fallback("persistent-recording", (
                    "memsave: gradient() was called inside the recording context of a "
                    "persistent tape, which records the gradient for higher-order "
                    "derivatives; memsave's recomputed ops would be missing from it, so "
                    "the plain tf.GradientTape is used. Call gradient() after the with "
                    "block to save memory."))
            tape._pop_tape()  # pylint: disable=protected-access
        graph, flat_targets, flat_raw, flat_xs, flat_grads = _checked_inputs(
            target, sources, output_gradients)
        if record.could_possibly_record() or pywrap_tfe.TFE_Py_TapeSetIsStopped():
            raise _Fallback("nested", (
                "memsave: another GradientTape is recording while gradient() runs (e.g. "
                "higher-order gradients); it would not see memsave's recomputed ops, so "
                "the plain tf.GradientTape is used for this call"))
    except _Fallback as why:
        _warn_once(why.key, why.message)
        return plain()

    call = _plan_call(tape, flat_targets, flat_raw, flat_xs, flat_grads)
    grads = [None] * len(call.xs)
    if call.connected:
        kwargs = {"stop_gradients": call.stops} if call.stops else {}
        try:
            grads = api.gradients(call.ys, call.xs, call.grad_ys,
                                  checkpoints=config.checkpoints,
                                  min_checkpoint_size=config.min_checkpoint_size,
                                  **config.options, **kwargs)
        except NoBottleneckError as e:
            raise TapeNoBottleneckError(
                "%s (from GradientTape.gradient; pass checkpoints='optimal' to "
                "memsave.GradientTape, or to memsave.patch / memsave.keras.enable)" % e) from None
    flat_grad = []
    for route in call.routes:
        flat_grad.append(None if route is None else grads[route])
    if unconnected == UnconnectedGradients.ZERO:
        with graph.as_default():
            flat_grad = [_zeros_for(raw, x) if g is None else g
                         for g, raw, x in zip(flat_grad, flat_raw, flat_xs)]

    if not tape._persistent:  # pylint: disable=protected-access
        # As the plain tape: remember the watched variables, then forget the tape.
        tape._watched_variables = tape._tape.watched_variables()  # pylint: disable=W0212
        tape._tape = None  # pylint: disable=protected-access
    return nest.pack_sequence_as(sources, flat_grad)


# ---------------------------------------------------------------------------
# The subclass.

class GradientTape(backprop.GradientTape):
    """A ``tf.GradientTape`` whose ``gradient()`` recomputes activations.

    ``checkpoints``, ``min_checkpoint_size`` and further planning options
    (``budget``, ``batch_size``, ``shapes``) mean what they mean for
    :func:`memsave.gradients`; the default, 'optimal', keeps the tensors
    with the lowest estimated peak. Everything else, including ``jacobian``, behaves like
    ``tf.GradientTape``; see the module docstring for the cases that use the
    plain tape.
    """

    def __init__(self, persistent=False, watch_accessed_variables=True, *,
                 checkpoints=DEFAULT_CHECKPOINTS, min_checkpoint_size=1024, **options):
        super().__init__(persistent=persistent,
                         watch_accessed_variables=watch_accessed_variables)
        self._memsave_config = Config.make(checkpoints, min_checkpoint_size, **options)
        self._memsave_bypass = 0

    @property
    def checkpoints(self):
        return self._memsave_config.checkpoints

    @do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=UnconnectedGradients.NONE):
        if self._memsave_bypass or _bypassed():
            return _TF_GRADIENT(self, target, sources, output_gradients, unconnected_gradients)
        return tape_gradient(self, self._memsave_config, target, sources, output_gradients,
                             unconnected_gradients)

    gradient.__doc__ = _TF_GRADIENT.__doc__

    # Jacobians call gradient() per row inside pfor/while loops; they keep
    # the plain tape's gradient.
    def jacobian(self, *args, **kwargs):
        with _bypass():
            return super().jacobian(*args, **kwargs)

    def batch_jacobian(self, *args, **kwargs):
        with _bypass():
            return super().batch_jacobian(*args, **kwargs)


# ---------------------------------------------------------------------------
# Routing plain tf.GradientTape objects (patch(tape=True) and scope()).

_local = threading.local()
_lock = threading.RLock()
_installed = {"global": None, "scopes": 0, "originals": {}}


def _scopes():
    if not hasattr(_local, "configs"):
        _local.configs = []
        _local.bypass = 0
    return _local.configs


def _bypassed():
    _scopes()
    return _local.bypass > 0


@contextlib.contextmanager
def _bypass():
    _scopes()
    _local.bypass += 1
    try:
        yield
    finally:
        _local.bypass -= 1


def active_config():
    """The config plain tapes use on this thread now, or None."""
    configs = _scopes()
    if _local.bypass:
        return None
    if configs:
        return configs[-1]
    return _installed["global"]


@do_not_convert
def _patched_gradient(self, target, sources, output_gradients=None,
                      unconnected_gradients=UnconnectedGradients.NONE):
    config = active_config()
    if config is None:
        return _TF_GRADIENT(self, target, sources, output_gradients, unconnected_gradients)
    return tape_gradient(self, config, target, sources, output_gradients, unconnected_gradients)


_patched_gradient.__doc__ = _TF_GRADIENT.__doc__
_patched_gradient.__memsave_original__ = _TF_GRADIENT


def _patched_jacobian(original):
    @functools.wraps(original)
    def jacobian(self, *args, **kwargs):
        with _bypass():
            return original(self, *args, **kwargs)
    jacobian.__memsave_original__ = original
    return jacobian


def _install():
    if _installed["originals"]:
        return
    cls = backprop.GradientTape
    for name in ("gradient", "jacobian", "batch_jacobian"):
        _installed["originals"][name] = cls.__dict__[name]
    cls.gradient = _patched_gradient
    cls.jacobian = _patched_jacobian(_installed["originals"]["jacobian"])
    cls.batch_jacobian = _patched_jacobian(_installed["originals"]["batch_jacobian"])


def _uninstall_if_unused():
    if _installed["global"] is not None or _installed["scopes"]:
        return
    originals = _installed["originals"]
    while originals:
        name, original = originals.popitem()
        setattr(backprop.GradientTape, name, original)


def is_installed():
    """True while ``tf.GradientTape.gradient`` is memsave's."""
    return bool(_installed["originals"])


def install(checkpoints=DEFAULT_CHECKPOINTS, min_checkpoint_size=1024, **options):
    """Route every ``tf.GradientTape.gradient`` through memsave (``patch(tape=True)``)."""
    config = Config.make(checkpoints, min_checkpoint_size, **options)
    with _lock:
        _installed["global"] = config
        _install()
    logger.info("memsave: tf.GradientTape.gradient now uses checkpoints=%r", checkpoints)


def uninstall():
    """Undo :func:`install`: the original function objects are put back.

    If a :func:`scope` is open (on any thread) the originals come back when
    the last one closes.
    """
    with _lock:
        _installed["global"] = None
        _uninstall_if_unused()


@contextlib.contextmanager
def scope(checkpoints=DEFAULT_CHECKPOINTS, min_checkpoint_size=1024, **options):
    """Within the block, on this thread, ``tf.GradientTape.gradient`` uses memsave.

    Other threads are not affected. ``tf.GradientTape.gradient`` is patched
    while any scope is open (or ``memsave.patch(tape=True)`` is on) and
    restored afterwards.
    """
    config = Config.make(checkpoints, min_checkpoint_size, **options)
    with _lock:
        _installed["scopes"] += 1
        _install()
    configs = _scopes()
    configs.append(config)
    try:
        yield config
    finally:
        configs.pop()
        with _lock:
            _installed["scopes"] -= 1
            _uninstall_if_unused()
