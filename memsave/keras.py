"""Keras 3 (TensorFlow backend): ``model.fit`` with checkpointed gradients.

``memsave.keras.enable(model)`` wraps the model's ``train_step`` so that,
while it is traced, ``tf.GradientTape.gradient`` computes gradients with
:func:`memsave.gradients` (see :func:`memsave.tape.scope`). Keras' own
``train_step`` (or the model's custom one) runs unchanged: the forward pass,
loss scaling by ``optimizer.scale_loss`` (``LossScaleOptimizer``,
``mixed_float16``), the optimizer update and the metrics are Keras' code;
only the backward pass recomputes activations instead of keeping them.

Stateful forward ops keep their plain-Keras behaviour: BatchNormalization's
moving statistics are assigned once per step (the assignments are not on the
path from the weights to the loss, so they are never copied), and a
Dropout layer's mask is recomputed from the same seed tensor (the
``SeedGenerator`` state is read and advanced once, in the forward pass), so
forward and backward use the same mask.

``run_eagerly=True`` trains with the plain tape (memsave needs a graph) and
logs a warning once. ``jit_compile=True`` is refused with a clear error:
XLA re-schedules and deduplicates the recomputed ops, so the memory saving
would silently be lost.
"""

import functools
import logging

import keras

from memsave import tape as _tape

logger = logging.getLogger("memsave")

_ATTR = "_memsave_keras"

JIT_MESSAGE = (
    "memsave.keras: the model is compiled with jit_compile=True. XLA merges memsave's "
    "recomputed ops back into the forward pass and schedules its own buffers, so "
    "checkpointing would silently save nothing. Compile with jit_compile=False (the "
    "default 'auto' resolves to True for some models on GPU), or call "
    "memsave.keras.disable(model).")


def _check_backend():
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError("memsave.keras needs the TensorFlow backend of Keras; this "
                           "process uses %r (set KERAS_BACKEND=tensorflow before importing "
                           "keras)" % backend)


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError("memsave.keras.enable expects a keras.Model, got %r" % (model,))


def _check_jit(model):
    # Keras resolves jit_compile='auto' lazily; the train step is traced
    # after that, so this sees the final value.
    if getattr(model, "jit_compile", False) is True and not getattr(model, "run_eagerly", False):
        raise ValueError(JIT_MESSAGE)


def _reset_train_function(model):
    # Keras caches the traced step; the next fit/train_on_batch rebuilds it.
    if hasattr(model, "train_function"):
        model.train_function = None


def enable(model, strategy="memory", **kwargs):
    """Make ``model.fit`` (and ``train_on_batch``) use checkpointed gradients.

    ``strategy`` is any strategy name :func:`memsave.gradients` accepts as
    ``checkpoints`` ('memory', 'speed', ...); its planning options
    (``min_checkpoint_size``, ``budget``, ...) may be given as keywords.
    Enabling again replaces the settings. Returns the model.
    """
    _check_backend()
    _check_model(model)
    config = _tape.Config.make(strategy, **kwargs)
    if model.__dict__.get("_jit_compile") is True and not getattr(model, "run_eagerly", False):
        raise ValueError(JIT_MESSAGE)   # compiled already; else checked when tracing
    state = model.__dict__.get(_ATTR)
    if state is None:
        # The step Keras would call now: a custom train_step or Keras' own.
        original = model.train_step
    else:
        original = state["original"]

    @functools.wraps(original)
    def train_step(data):
        settings = model.__dict__[_ATTR]["config"]
        _check_jit(model)
        with _tape.scope(settings.checkpoints, settings.min_checkpoint_size,
                         **settings.options):
            return original(data)

    object.__setattr__(model, _ATTR, {"original": original, "config": config})
    object.__setattr__(model, "train_step", train_step)
    _reset_train_function(model)
    logger.info("memsave.keras: %s trains with checkpoints=%r", model.name, strategy)
    return model


def disable(model):
    """Undo :func:`enable`; ``model.fit`` uses plain Keras gradients again."""
    state = model.__dict__.get(_ATTR)
    if state is None:
        return model
    object.__delattr__(model, "train_step")
    object.__delattr__(model, _ATTR)
    _reset_train_function(model)
    return model


def is_enabled(model):
    return _ATTR in model.__dict__


class MemorySavingModel:
    """Mixin: ``class Net(memsave.keras.MemorySavingModel, keras.Model)``.

    Its ``train_step`` is the next class's (Keras' or your own) run under
    memsave. Set ``memsave_strategy``, ``memsave_min_checkpoint_size`` or
    ``memsave_options`` on the class or the instance to change the strategy.
    """

    memsave_strategy = "memory"
    memsave_min_checkpoint_size = 1024
    memsave_options = {}   # further memsave.gradients options, e.g. {"budget": 0.3}

    def train_step(self, data):
        _check_backend()
        _check_jit(self)
        with _tape.scope(self.memsave_strategy, self.memsave_min_checkpoint_size,
                         **self.memsave_options):
            return super().train_step(data)
