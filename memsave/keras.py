"""Keras 3 (TensorFlow backend): ``model.fit`` with checkpointed gradients.

``memsave.keras.enable(model)`` wraps the model's ``train_step`` so that,
while it is traced, ``tf.GradientTape.gradient`` computes gradients with
:func:`memsave.gradients` (see :func:`memsave.patching.scope`). Keras' own
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

Keras traces the step with an unknown batch dimension (its datasets do not
fix one), so the batch size ``fit``/``train_on_batch`` is given (or the
data's own) is remembered and sizes the plan, unless ``batch_size=`` or
``shapes=`` was passed to :func:`enable`.

``run_eagerly=True`` trains with the plain tape (memsave needs a graph) and
logs a warning once. Under ``jit_compile=True`` (and ``"auto"``, which Keras
turns into True where a GPU is visible) the step is traced for XLA and
:func:`memsave.gradients` puts its recomputation behind XLA optimization
barriers, so that XLA keeps it (see ``xla=`` there).
"""

import collections.abc
import functools
import logging

import keras
import tensorflow as tf

from memsave import budget, patching, tf_internal, verify
from memsave.settings import DEFAULT_CHECKPOINTS, resolve

logger = logging.getLogger("memsave")

_ATTR = "_memsave_keras"

def _check_backend():
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError("memsave.keras needs the TensorFlow backend of Keras; this "
                           "process uses %r (set KERAS_BACKEND=tensorflow before importing "
                           "keras)" % backend)


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError("memsave.keras.enable expects a keras.Model, got %r" % (model,))


def _reset_train_function(model):
    # Keras caches the traced step; the next fit/train_on_batch rebuilds it.
    if hasattr(model, "train_function"):
        model.train_function = None


def _leading_size(x):
    """Number of samples in array-like data, else None."""
    leaves = [v for v in tf.nest.flatten(x) if v is not None]
    if not leaves:
        return None
    shape = getattr(leaves[0], "shape", None)
    if shape is None or len(shape) == 0:
        return None
    return shape[0] if isinstance(shape[0], int) else None


def data_batch_size(x, batch_size=None):
    """The batch size Keras will train on, when the data says it; else None.

    Arrays and tensors: ``batch_size`` (Keras' default 32) capped by the
    number of samples. A ``tf.data.Dataset``: its static batch dimension.
    Generators and ``PyDataset``: unknown.
    """
    if isinstance(x, tf.data.Dataset):
        dims = [s.shape[0] for s in tf.nest.flatten(x.element_spec)
                if getattr(s, "shape", None) is not None and s.shape.rank]
        return dims[0] if dims and dims[0] is not None else None
    n = _leading_size(x)
    if n is None:
        return None
    return min(batch_size or 32, n) if n else None


def _declared_batch_size(data):
    """The size a ``tf.data.Dataset`` was batched with, where its pipeline
    says it (``tf_internal.declared_batch_size``), found without iterating
    it; else None (see :func:`_readable_batch`)."""
    return tf_internal.declared_batch_size(data) if _readable_batch(data) else None


def _first_batch_size(data):
    """The leading size of a ``tf.data.Dataset``'s first element, or None
    (see :func:`_readable_batch`). Reading it takes an iteration of the
    dataset: a shuffle that reshuffles each iteration then gives ``fit``
    another order, and a one-shot stream loses its first batch (so
    :func:`_batch_for` asks :func:`_declared_batch_size` first)."""
    if not _readable_batch(data):
        return None
    try:
        first = next(iter(data.take(1)))
    except (StopIteration, tf.errors.OpError):
        return None
    return _leading_size(first)


def _readable_batch(data):
    """Whether ``data`` is a ``tf.data.Dataset`` whose batch size its first
    element says (see :func:`_batch_alone_unknown`)."""
    return isinstance(data, tf.data.Dataset) and _batch_alone_unknown(data.element_spec)


def _batch_alone_unknown(spec):
    """Whether elements of ``spec`` are dense tensors whose one unknown
    dimension is the batch's (a sparse or ragged batch's other sizes stay
    nominal, and a plan for the real batch with them is no better than the
    nominal one)."""
    specs = tf.nest.flatten(spec)
    return bool(specs) and all(isinstance(s, tf.TensorSpec) and s.shape.rank
                               and s.shape[1:].is_fully_defined() for s in specs)


_UNREAD = "_memsave_unread_batch"   # the data whose first batch is to size the plan


def _batch_for(model, settings, batch_of, args, kwargs):
    """The batch size the data gives (``batch_of``). Under a byte budget
    data whose batch size is unknown (a dataset batched without
    ``drop_remainder``, a generator, a ``PyDataset``) is sized by its first
    batch: the loop keeps bytes, and a plan for a guessed batch (32 where
    600 came) is dominated by the weights' gradients, recomputes little and
    misleads the loop (a helper saw BudgetError where plans at 9 MiB fit a
    15 MiB budget). Where the pipeline says the size it was batched with,
    that is the size, found now, so that a ``fit`` at another batch size
    than the last starts a loop of its own (see :func:`_trained_on_batch`).
    Else the budget loop reads each batch it measures before the call (see
    :func:`_replayed_batch`), so the first is sized there, as ``fit`` reads
    it; a settled loop's step is not traced again for it (its batch
    dimension is unknown)."""
    model.__dict__.pop(_UNREAD, None)
    found = batch_of(*args, **kwargs)
    if found is None and budget.is_bytes(settings.budget):
        data = args[0] if args else kwargs.get("x")
        found = _declared_batch_size(data)
        if found is None:
            model.__dict__[_UNREAD] = data
        else:
            logger.info("memsave.keras: the data's batch dimension is unknown; it was "
                        "batched by %d, planned for", found)
    return found


def _size_unread_batch(model, data=None, spec=None):
    """Where :func:`_batch_for` left the batch size to the loop's first read:
    set it from ``data`` (the batch the loop read ahead, whose element spec
    is ``spec``, where known), or, where the loop cannot read ahead (several
    steps per call, a distributed iterator), by reading a dataset's first
    element once more (see :func:`_first_batch_size`)."""
    if _UNREAD not in model.__dict__:
        return
    unread = model.__dict__.pop(_UNREAD)
    if data is None:
        found = _first_batch_size(unread)
    else:
        found = _leading_size(data) if spec is None or _batch_alone_unknown(spec) else None
    if found is not None:
        logger.info("memsave.keras: the data's batch dimension is unknown; its first "
                    "batch has %d, planned for", found)
    _store_data_batch(model, found)


def _data_batch(model):
    """The batch size the data of ``model``'s last ``fit``/``train_on_batch``
    gave: in its :func:`enable` state, or on a :class:`MemorySavingModel`."""
    state = model.__dict__.get(_ATTR)
    return model.__dict__.get("_memsave_data_batch") if state is None else state.get("data_batch")


def _store_data_batch(model, found):
    state = model.__dict__.get(_ATTR)
    if state is not None:
        state["data_batch"] = found
    else:
        model.__dict__["_memsave_data_batch"] = found


def _remembering_batch(model, method, batch_of):
    """Wrap ``method`` so the batch its data gives is set before it traces,
    and a failed ``verify=`` check is a GradientMismatchError."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        state = model.__dict__.get(_ATTR)
        if state is None:
            with verify.mismatch_raised():
                return method(*args, **kwargs)
        return _trained_on_batch(model, state["settings"], batch_of, method, args, kwargs)
    return wrapper


def _trained_on_batch(model, settings, batch_of, method, args, kwargs):
    """``method(*args, **kwargs)`` (``fit`` or ``train_on_batch``) with the
    batch size its data gives stored (see :func:`_batch_for`). Under a byte
    budget a ``fit`` whose batch size is not the previous call's starts a
    budget loop of its own: a step Keras does not trace
    again (an unknown batch dimension) ran the plan for the old batch, and
    the loop, measuring the new one against that plan's estimate, read a
    factor of five as its error and raised BudgetError where plans fit (a
    helper: ``fit`` at 256, then at 1024)."""
    previous = _data_batch(model)
    found = _batch_for(model, settings, batch_of, args, kwargs)
    if (batch_of is _fit_batch and budget.is_bytes(settings.budget)
            and None not in (previous, found) and found != previous):
        logger.info("memsave.keras: %s: the batch size is %d, the budget loop's %d; its step "
                    "is traced and measured again", model.name, found, previous)
        _reset_train_function(model)
    _store_data_batch(model, found)
    try:
        with verify.mismatch_raised():
            return method(*args, **kwargs)
    finally:
        model.__dict__.pop(_UNREAD, None)   # the data is not held past the call


def _fit_batch(x=None, y=None, batch_size=None, *args, **kwargs):
    return data_batch_size(x, batch_size)


def _train_on_batch_batch(x=None, *args, **kwargs):
    # One call, one batch: all of the samples given.
    return data_batch_size(x) if isinstance(x, tf.data.Dataset) else _leading_size(x)


def _sized(settings, data_batch, model):
    """``settings`` with the data's batch size, unless the user sized the step.

    Under a tf.distribute strategy each replica traces the step for its own
    share of the global batch.
    """
    if not data_batch or settings.batch_size is not None or settings.shapes is not None:
        return settings
    replicas = getattr(model.distribute_strategy, "num_replicas_in_sync", 1) or 1
    return settings.replace(batch_size=max(1, -(-data_batch // replicas)))


def _make_train_function(model, make, settings):
    """``make`` (Keras' ``make_train_function``) whose step keeps a byte budget on
    the allocator: measured, and traced again once if off (:mod:`memsave.budget`)."""
    if not budget.is_bytes(settings.budget) or model.run_eagerly:
        return make(force=True)

    def build():
        outer = model.train_function
        make(force=True)
        inner, model.train_function = model.train_function, outer
        return inner
    model.train_function = budget.MeasuredStep(
        build, "memsave.keras(%s)" % model.name, state=lambda: _training_state(model),
        replay=lambda args, kwargs: _replayed_batch(model, args, kwargs),
        compiled=_compiled_step)
    return model.train_function


def _compiled_step(train_function, args, kwargs):
    """The ``tf.function`` Keras' train function calls with its iterator, or None.

    Keras wraps it in a Python function; its trace names every variable the
    step captures, beyond the model's, its optimizer's and its metrics': a
    custom ``train_step``'s own optimizers (a GAN's), a layer's counter, a
    ``tf.random.Generator``. Found among the wrapper's closure, where Keras
    keeps it. It takes ``fit``'s ``tf.data`` iterators only: Keras runs
    ``train_on_batch``'s batch (a Python iterator) through its single step
    on data, which would have to read the batch to be traced (None).
    """
    if kwargs or len(args) != 1 or not isinstance(
            args[0], (tf.data.Iterator, tf.distribute.DistributedIterator)):
        return None
    found = [cell.cell_contents for cell in (getattr(train_function, "__closure__", None) or ())
             if isinstance(cell.cell_contents, tf.types.experimental.PolymorphicFunction)]
    return found[0] if len(found) == 1 else None


def _training_state(model):
    """What a training step may update: the model's, the optimizer's and the metrics'
    variables (restored if the allocator refuses a call, see :mod:`memsave.budget`).
    The optimizer is built first, as ``fit`` would in the first step: slots made
    inside a refused call would keep its update."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built and model.trainable_variables:
        # (A model whose layers make their variables on its first call has
        # none yet: its optimizer is built by the step, as plain fit's.)
        with model.distribute_strategy.scope():
            optimizer.build(model.trainable_variables)
    return (list(model.variables) + list(getattr(optimizer, "variables", None) or [])
            + list(getattr(model, "metrics_variables", None) or []))


def _replayed_batch(model, args, kwargs):
    """``replay`` for Keras' train function (see :class:`memsave.budget.MeasuredStep`).

    ``fit`` passes an iterator that the function reads inside ``tf.function``:
    its next batch is read here and given again, in an iterator of its own
    with the same element spec (so nothing is traced again), to each run of
    the call; ``train_on_batch`` passes a generator of its one batch, read
    here the same way. None (the call is not run again) where a call reads
    several batches (``steps_per_execution``) or a distributed iterator.
    """
    if kwargs or len(args) != 1 or getattr(model, "steps_per_execution", 1) != 1:
        _size_unread_batch(model)
        return None
    batches = args[0]
    if isinstance(batches, tf.data.Iterator):
        value = batches.get_next_as_optional()
        if not value.has_value():
            return lambda: (args, kwargs)   # the end of the data: Keras stops on its own
        data = value.get_value()
        _size_unread_batch(model, data, batches.element_spec)
        dataset = _dataset_of(data, batches.element_spec)   # iterated again by each run

        def replay():
            return (iter(dataset),), {}
        # Read here, before the call; a settled call reads it inside, where
        # the meter counts it (a 4 MiB batch: 2.2 MiB measured on trial, 7.2
        # once settled), so the loop adds it to the calls it measures.
        replay.read_ahead = replay.batch_bytes = budget.batch_bytes(data)
        return replay
    if isinstance(batches, collections.abc.Iterator) and not isinstance(
            batches, tf.distribute.DistributedIterator):
        data = next(batches, _END)
        if data is _END:
            return lambda: (args, kwargs)
        _size_unread_batch(model, data)
        return lambda: ((iter([data]),), {})
    _size_unread_batch(model)
    return None


_END = object()


def _dataset_of(data, spec):
    """A dataset of the one element ``data`` whose element spec is ``spec`` (a
    less specific shape, as the iterator it was read from had: Keras' train
    function is then not traced again).

    Its tensors go in as they are, each component (a dense tensor's self, a
    ragged tensor's values and row splits, a sparse tensor's indices, values
    and shape) through a ``PlaceholderWithDefault`` whose shape is the
    spec's. ``Dataset.from_generator`` would keep every batch given to it
    for good: in eager mode its Python function is registered on the global
    default graph, which holds it and the generator's batch for the life of
    the process (one batch per call the budget loop measured, found by a
    helper: 11 batches of 16 MiB). It is the way only where the components
    do not match the spec's.
    """
    parts = tf.nest.flatten(data, expand_composites=True)
    specs = tf.nest.flatten(spec, expand_composites=True)
    if len(parts) == len(specs):
        def relaxed(element):
            return tf.nest.pack_sequence_as(
                spec, [tf.raw_ops.PlaceholderWithDefault(input=t, shape=s.shape)
                       for t, s in zip(tf.nest.flatten(element, expand_composites=True), specs)],
                expand_composites=True)
        try:
            dataset = tf.data.Dataset.from_tensors((data,)).map(relaxed)
        except (TypeError, ValueError):
            dataset = None
        if dataset is not None and dataset.element_spec == spec:
            return dataset
    return tf.data.Dataset.from_generator(lambda: iter([data]), output_signature=spec)


def _budget_keeping(model, make):
    """Wrap the model's ``make_train_function`` (see :func:`_make_train_function`)."""
    @functools.wraps(make)
    def make_train_function(force=False):
        if model.train_function is not None and not force:
            return model.train_function
        return _make_train_function(model, make, model.__dict__[_ATTR]["settings"])
    return make_train_function


def enable(model, checkpoints=DEFAULT_CHECKPOINTS, **options):
    """Make ``model.fit`` (and ``train_on_batch``) use checkpointed gradients.

    ``checkpoints`` is any strategy :func:`memsave.gradients` accepts
    ('optimal', the default, 'memory', 'speed', ...), and the options are
    those of every entry point (see :mod:`memsave.settings`), checked here.
    Enabling again replaces the settings. Returns the model.
    """
    settings = resolve(checkpoints, options, "memsave.keras.enable")
    _check_backend()
    _check_model(model)
    state = model.__dict__.get(_ATTR)
    if state is None:
        # The step Keras would call now: a custom train_step or Keras' own.
        original = model.train_step
    else:
        original = state["original"]

    @functools.wraps(original)
    def train_step(data):
        state = model.__dict__[_ATTR]
        with patching.using(_sized(state["settings"], state.get("data_batch"), model)):
            return original(data)

    object.__setattr__(model, _ATTR, {"original": original, "settings": settings})
    object.__setattr__(model, "train_step", train_step)
    if state is None:
        for name, batch_of in (("fit", _fit_batch), ("train_on_batch", _train_on_batch_batch)):
            object.__setattr__(model, name,
                               _remembering_batch(model, getattr(model, name), batch_of))
        object.__setattr__(model, "make_train_function",
                           _budget_keeping(model, model.make_train_function))
    _reset_train_function(model)
    logger.info("memsave.keras: %s trains with checkpoints=%s", model.name,
                settings.checkpoints.label)
    return model


def disable(model):
    """Undo :func:`enable`; ``model.fit`` uses plain Keras gradients again."""
    state = model.__dict__.get(_ATTR)
    if state is None:
        return model
    for name in ("train_step", "fit", "train_on_batch", "make_train_function"):
        if name in model.__dict__:
            object.__delattr__(model, name)
    object.__delattr__(model, _ATTR)
    _reset_train_function(model)
    return model


def is_enabled(model):
    return _ATTR in model.__dict__


class MemorySavingModel:
    """Mixin: ``class Net(memsave.keras.MemorySavingModel, keras.Model)``.

    Its ``train_step`` is the next class's (Keras' or your own) run under
    memsave. Set ``memsave_checkpoints``, ``memsave_min_checkpoint_size`` or
    ``memsave_options`` on the class or the instance to change the strategy
    (``memsave_strategy``, the old name, is still read).
    """

    memsave_checkpoints = DEFAULT_CHECKPOINTS
    memsave_min_checkpoint_size = 1024
    memsave_options = {}   # further memsave.gradients options, e.g. {"budget": 0.3}

    def fit(self, *args, **kwargs):
        return self._memsave_trained(_fit_batch, super().fit, args, kwargs)

    def train_on_batch(self, *args, **kwargs):
        return self._memsave_trained(_train_on_batch_batch, super().train_on_batch, args, kwargs)

    def _memsave_trained(self, batch_of, method, args, kwargs):
        return _trained_on_batch(self, self._memsave_settings(), batch_of, method, args, kwargs)

    def _memsave_settings(self):
        checkpoints = getattr(self, "memsave_strategy", None) or self.memsave_checkpoints
        return resolve(checkpoints, dict(
            {"min_checkpoint_size": self.memsave_min_checkpoint_size}, **self.memsave_options),
            "memsave.keras.MemorySavingModel")

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        return _make_train_function(self, super().make_train_function, self._memsave_settings())

    def train_step(self, data):
        _check_backend()
        settings = self._memsave_settings()
        with patching.using(_sized(settings, getattr(self, "_memsave_data_batch", None), self)):
            return super().train_step(data)
