"""Route TensorFlow's own gradient entry points through memsave.

``memsave.patch(strategy)`` replaces ``tf.gradients``,
``tf.compat.v1.gradients``, the ``gradients_impl`` functions and
``tensorflow.python.ops.gradients.gradients`` (which
``tf.compat.v1.train.Optimizer`` calls), so existing code gets checkpointed
gradients without edits. ``memsave.unpatch()`` puts back the very same
function objects. memsave itself differentiates through TensorFlow's
internal helper, below every patch point, so patching cannot recurse.

``memsave.patch(strategy, tape=True)`` also replaces
``tf.GradientTape.gradient`` (see :mod:`memsave.tape`), so Keras and other
tape-based training loops get checkpointed gradients inside ``tf.function``.
"""

import functools
import importlib
import logging

import tensorflow as tf
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients

from memsave import api
from memsave import tape as _tape

logger = logging.getLogger("memsave")

# (module name, attribute, signature) of every patch point.
_V1, _V2 = "v1", "v2"
_POINTS = (
    ("tensorflow", "gradients", _V2),
    ("tensorflow.compat.v1", "gradients", _V1),
    ("tensorflow.python.ops.gradients_impl", "gradients", _V1),
    ("tensorflow.python.ops.gradients_impl", "gradients_v2", _V2),
    ("tensorflow.python.ops.gradients", "gradients", _V1),
)

_originals = {}   # (module name, attribute) -> original object
_state = {"strategy": None, "kwargs": {}, "calls": 0}


def _module(name):
    if name == "tensorflow":
        return tf
    if name == "tensorflow.compat.v1":
        return tf.compat.v1
    return importlib.import_module(name)


def call_count():
    """How many gradient calls the patch has routed through memsave."""
    return _state["calls"]


def is_patched():
    return bool(_originals)


def _route(ys, xs, grad_ys, name, kwargs):
    _state["calls"] += 1
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return api.gradients(ys, xs, grad_ys, checkpoints=_state["strategy"], name=name,
                         **_state["kwargs"], **kwargs)


def _make_v1(original):
    @functools.wraps(original)
    def gradients(ys, xs, grad_ys=None, name="gradients", colocate_gradients_with_ops=False,
                  gate_gradients=False, aggregation_method=None, stop_gradients=None,
                  unconnected_gradients=UnconnectedGradients.NONE):
        return _route(ys, xs, grad_ys, name, dict(
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            stop_gradients=stop_gradients, unconnected_gradients=unconnected_gradients))
    gradients.__memsave_original__ = original
    return gradients


def _make_v2(original):
    @functools.wraps(original)
    def gradients(ys, xs, grad_ys=None, name="gradients", gate_gradients=False,
                  aggregation_method=None, stop_gradients=None,
                  unconnected_gradients=UnconnectedGradients.NONE):
        return _route(ys, xs, grad_ys, name, dict(
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            stop_gradients=stop_gradients, unconnected_gradients=unconnected_gradients))
    gradients.__memsave_original__ = original
    return gradients


class _Patch:
    """Returned by :func:`patch`; leaving its ``with`` block unpatches."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        unpatch()
        return False


def patch(checkpoints=_tape.DEFAULT_CHECKPOINTS, tape=False, **kwargs):
    """Make TensorFlow's gradient functions use memsave with ``checkpoints``.

    ``checkpoints`` is anything ``memsave.gradients`` accepts ('optimal' by
    default); extra keyword arguments (e.g. ``min_checkpoint_size``) are
    passed along. With ``tape=True`` ``tf.GradientTape.gradient`` is
    replaced too (tapes take the planning options, e.g.
    ``min_checkpoint_size``). Usable as a context manager. Patching again
    only changes the strategy (and whether tapes are patched).
    """
    strategy = _tape.renamed_strategy(checkpoints, kwargs, "memsave.patch")
    if isinstance(strategy, str) and strategy not in api.STRATEGIES:
        raise ValueError("unknown strategy %r; use one of %s" % (strategy, ", ".join(api.STRATEGIES)))
    _state["strategy"] = strategy
    _state["kwargs"] = dict(kwargs)
    if not _originals:
        for module_name, attr, signature in _POINTS:
            module = _module(module_name)
            original = getattr(module, attr)
            _originals[(module_name, attr)] = original
            setattr(module, attr, (_make_v1 if signature == _V1 else _make_v2)(original))
        logger.info("memsave: tf.gradients and friends now use strategy %r", strategy)
    if tape:
        _tape.install(strategy, **_tape.config_kwargs(kwargs))
    else:
        _tape.uninstall()
    return _Patch()


def unpatch():
    """Restore the original functions (the same objects). Safe to call twice."""
    while _originals:
        (module_name, attr), original = _originals.popitem()
        setattr(_module(module_name), attr, original)
    _state["strategy"] = None
    _state["kwargs"] = {}
    _tape.uninstall()
