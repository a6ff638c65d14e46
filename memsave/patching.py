"""Every function memsave replaces inside TensorFlow, and how replacements nest.

Two kinds of patch points live here, in one module because they share one
lock, one rule ("the settings on top are in force") and one promise (the
very same original objects come back):

* ``tf.gradients``, ``tf.compat.v1.gradients``, the ``gradients_impl``
  functions and ``tensorflow.python.ops.gradients.gradients`` (which
  ``tf.compat.v1.train.Optimizer`` calls; those TF modules come from
  :data:`memsave.tf_internal.PATCHABLE_MODULES`), routed to
  :func:`memsave.gradients`;
* ``tf.GradientTape.gradient``, routed to :func:`memsave.tape.tape_gradient`
  (``jacobian``/``batch_jacobian`` are wrapped so their per-row gradients
  stay TensorFlow's, see :func:`memsave.tape.bypass`; ``watch`` notes the
  tensors that are leaves for the tape, see :func:`memsave.tape.note_watch`).

:func:`patch` pushes a level (its :class:`~memsave.settings.Settings` and
whether tapes are routed) on a process-wide stack;
the top level is in force. Leaving a ``with memsave.patch(...)`` block
removes exactly that block's level, so the level below is in force again,
tapes included; when the stack is empty the original functions are back.
A bare ``memsave.patch(...)`` (no ``with``) pushes a level that stays until
:func:`unpatch`, which clears the whole stack.

The stack is shared by all threads. :func:`scope` is the per-thread
alternative for tapes (what :mod:`memsave.keras` uses): on its thread it
wins over the stack, other threads do not see it.

memsave itself differentiates through TensorFlow's internal helper, below
every patch point, so patching cannot recurse. :mod:`memsave.tape`
translates one tape call and holds no process state; this module imports
it, never the reverse.
"""

import contextlib
import dataclasses
import functools
import threading

import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from memsave import api
from memsave import tape as _tape
from memsave import tf_internal
from memsave.log import logger
from memsave.settings import DEFAULT_CHECKPOINTS, resolve

# (module name, attribute, signature) of every tf.gradients patch point. The
# names other than "tensorflow" and "tensorflow.compat.v1" are keys of
# tf_internal.PATCHABLE_MODULES (TensorFlow's gradients_impl and gradients modules).
_V1, _V2 = "v1", "v2"
_POINTS = (
    ("tensorflow", "gradients", _V2),
    ("tensorflow.compat.v1", "gradients", _V1),
    ("gradients_impl", "gradients", _V1),
    ("gradients_impl", "gradients_v2", _V2),
    ("gradients", "gradients", _V1),
)
_TAPE_POINTS = ("gradient", "jacobian", "batch_jacobian", "watch")


@dataclasses.dataclass(frozen=True, eq=False)
class Level:
    """One :func:`patch` call's settings (compared by identity: each call is its own level)."""

    settings: object         # memsave.settings.Settings
    tape: bool = False       # whether plain tapes are routed at this level


# Everything below is guarded by _lock (re-entrant: _apply runs under it).
_lock = threading.RLock()
_stack = []              # Levels, bottom first; the top one is in force
_originals = {}          # (module name, attribute) -> TF's own, while patched
_tape_originals = {}     # GradientTape attribute -> TF's own, while tapes are routed
_open_scopes = [0]       # scope()s open on any thread

_local = threading.local()   # .settings: this thread's scope() stack


def _module(name):
    if name == "tensorflow":
        return tf
    if name == "tensorflow.compat.v1":
        return tf.compat.v1
    return tf_internal.PATCHABLE_MODULES[name]


def current():
    """The :class:`Level` in force now (the top of the stack), or None."""
    with _lock:
        return _stack[-1] if _stack else None


# ---------------------------------------------------------------------------
# tf.gradients and friends.

def _route(original, ys, xs, grad_ys, name, kwargs, implied=None):
    """``implied``: what the original does without taking it as an argument
    (TF2's ``tf.gradients`` colocates), passed to memsave only."""
    level = current()
    if level is None:
        # A wrapper someone kept a reference to after unpatch(): TF's answer.
        return original(ys, xs, grad_ys=grad_ys, name=name, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs.update(implied or {})
    return api.differentiate(ys, xs, grad_ys, level.settings, name=name, **kwargs)


def _make_v1(original):
    @functools.wraps(original)
    def gradients(ys, xs, grad_ys=None, name="gradients", colocate_gradients_with_ops=False,
                  gate_gradients=False, aggregation_method=None, stop_gradients=None,
                  unconnected_gradients=tf.UnconnectedGradients.NONE):
        return _route(original, ys, xs, grad_ys, name, dict(
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            stop_gradients=stop_gradients, unconnected_gradients=unconnected_gradients))
    gradients.__memsave_original__ = original
    return gradients


def _make_v2(original):
    @functools.wraps(original)
    def gradients(ys, xs, grad_ys=None, name="gradients", gate_gradients=False,
                  aggregation_method=None, stop_gradients=None,
                  unconnected_gradients=tf.UnconnectedGradients.NONE):
        # TF2's tf.gradients always colocates gradient ops with their forward ops.
        return _route(original, ys, xs, grad_ys, name, dict(
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            stop_gradients=stop_gradients, unconnected_gradients=unconnected_gradients),
            implied=dict(colocate_gradients_with_ops=True))
    gradients.__memsave_original__ = original
    return gradients


def _patch_points():
    if _originals:
        return
    for module_name, attr, signature in _POINTS:
        module = _module(module_name)
        original = getattr(module, attr)
        _originals[(module_name, attr)] = original
        setattr(module, attr, (_make_v1 if signature == _V1 else _make_v2)(original))


def _restore_points():
    while _originals:
        (module_name, attr), original = _originals.popitem()
        setattr(_module(module_name), attr, original)


# ---------------------------------------------------------------------------
# Plain tf.GradientTape objects.

def _scopes():
    if not hasattr(_local, "settings"):
        _local.settings = []
    return _local.settings


def active_settings():
    """The settings plain tapes use on this thread now, or None."""
    if _tape.bypassed():
        return None
    scoped = _scopes()
    if scoped:
        return scoped[-1]
    level = current()
    return level.settings if level is not None and level.tape else None


@do_not_convert
def _patched_gradient(self, target, sources, output_gradients=None,
                      unconnected_gradients=tf.UnconnectedGradients.NONE):
    settings = active_settings()
    if settings is None:
        return _tape.TF_GRADIENT(self, target, sources, output_gradients, unconnected_gradients)
    return _tape.tape_gradient(self, settings, target, sources, output_gradients,
                               unconnected_gradients)


_patched_gradient.__doc__ = _tape.TF_GRADIENT.__doc__
_patched_gradient.__memsave_original__ = _tape.TF_GRADIENT


def _patched_jacobian(original):
    @functools.wraps(original)
    def jacobian(self, *args, **kwargs):
        with _tape.bypass():
            return original(self, *args, **kwargs)
    jacobian.__memsave_original__ = original
    return jacobian


def _patched_watch(original):
    @functools.wraps(original)
    def watch(self, tensor):
        _tape.note_watch(self, tensor)
        return original(self, tensor)
    watch.__memsave_original__ = original
    return watch


def _sync_tapes():
    """Route tapes while the top level asks for it or a scope is open, else restore."""
    wanted = (bool(_stack) and _stack[-1].tape) or _open_scopes[0] > 0
    cls = tf.GradientTape
    if wanted and not _tape_originals:
        for name in _TAPE_POINTS:
            _tape_originals[name] = cls.__dict__[name]
        cls.gradient = _patched_gradient
        cls.watch = _patched_watch(_tape_originals["watch"])
        cls.jacobian = _patched_jacobian(_tape_originals["jacobian"])
        cls.batch_jacobian = _patched_jacobian(_tape_originals["batch_jacobian"])
    elif not wanted:
        while _tape_originals:
            name, original = _tape_originals.popitem()
            setattr(cls, name, original)


def scope(checkpoints=DEFAULT_CHECKPOINTS, **options):
    """Within the block, on this thread, ``tf.GradientTape.gradient`` uses memsave.

    Other threads are not affected. ``tf.GradientTape.gradient`` is patched
    while any scope is open (or a ``patch(tape=True)`` level is in force)
    and restored afterwards. The options are those of every entry point
    (see :mod:`memsave.settings`), checked here.
    """
    return using(resolve(checkpoints, options, "memsave.patching.scope"))


@contextlib.contextmanager
def using(settings):
    """:func:`scope` with resolved :class:`~memsave.settings.Settings` (what Keras uses)."""
    with _lock:
        _open_scopes[0] += 1
        _sync_tapes()
    scoped = _scopes()
    scoped.append(settings)
    try:
        yield settings
    finally:
        scoped.pop()
        with _lock:
            _open_scopes[0] -= 1
            _sync_tapes()


# ---------------------------------------------------------------------------
# The stack.

def _apply():
    """Make TensorFlow match the top of the stack (the caller holds _lock)."""
    if _stack:
        _patch_points()
    else:
        _restore_points()
    _sync_tapes()


def _remove(level):
    with _lock:
        for i in range(len(_stack) - 1, -1, -1):
            if _stack[i] is level:
                del _stack[i]
                _apply()
                logger.debug("memsave.patch: left checkpoints=%s; %d level(s) remain",
                             level.settings.checkpoints.label, len(_stack))
                return
        # unpatch() already removed it: nothing to undo.


class _Patch:
    """Returned by :func:`patch`; leaving its ``with`` block removes its own level."""

    def __init__(self, level):
        self.level = level

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _remove(self.level)
        return False


def patch(checkpoints=DEFAULT_CHECKPOINTS, tape=False, **options):
    """Make TensorFlow's gradient functions use memsave with ``checkpoints``.

    ``checkpoints`` is anything ``memsave.gradients`` accepts ('optimal' by
    default), and the options are those of every entry point (see
    :mod:`memsave.settings`), checked here. With ``tape=True``
    ``tf.GradientTape.gradient`` uses the same settings.

    Each call pushes a level; the newest is in force. As a context manager
    the level is removed when the block is left (also on an exception) and
    the previous settings come back. Called bare, the level stays until
    :func:`unpatch`.
    """
    if not isinstance(tape, bool):
        raise TypeError("memsave.patch: tape must be True or False, got %r" % (tape,))
    level = Level(resolve(checkpoints, options, "memsave.patch"), tape)
    with _lock:
        _stack.append(level)
        _apply()
        depth = len(_stack)
    logger.info("memsave: tf.gradients and friends%s now use checkpoints=%s (patch level %d)",
                " and tf.GradientTape" if tape else "", level.settings.checkpoints.label, depth)
    return _Patch(level)


def unpatch():
    """Clear every :func:`patch` level and put back the original functions.

    Safe to call twice, and inside ``with memsave.patch(...)`` blocks (leaving
    them afterwards changes nothing). Tapes stay routed while a
    :func:`scope` is open and are restored when the last one closes.
    """
    with _lock:
        _stack.clear()
        _apply()
