"""Real models nobody here wrote: memsave's gradients equal the plain tape's.

Keras applications (ResNet50, DenseNet121, MobileNetV2, EfficientNetB0,
ConvNeXtTiny, and MobileNetV3Small in float32; ``weights=None``, 32x32,
batch 2), keras-hub's GPT2 (causal
LM loss) and BERT (classifier) from small configs, and Keras LSTMs
(stateful too), each

- through ``memsave.GradientTape`` in a ``tf.function``, every strategy
  beside the plain tape on the *same* forward pass (one trace), and
- through ``memsave.keras.enable`` + ``fit`` over a dataset of 5 samples in
  batches of 2 (unknown batch size, partial last batch), every strategy
  against plain ``fit``: the gradients of the epoch, summed per weight by
  an optimizer that does not move the weights.

Every strategy must give the plain tape's ``None`` pattern and values, or,
for 'memory' on a graph without a bottleneck, its documented
``NoBottleneckError``. Nothing else may be raised.

Why float64: these tiny configurations are ill-conditioned (batch norm over
2 to 8 values in the last stages), so a float32 gradient changes by up to
5% of its largest entry when TensorFlow merely sums the same partial
gradients in another order; plain ``tf.gradients`` and the plain tape
agree only because they happen to use the same order. In float64 the same
pairs agree to about 1e-14, so the 1e-7 bound here catches any real
difference (a lost path, a wrong read) and no rounding noise.

Run alone with ``pytest -m real_models``; the cases marked slow (the tape on
four applications, fit on every application and with 'memory' and 'speed' on
the transformers: ``SLOW_CASES`` in tests/conftest.py and ``FIT_IN_CI``
below) run with ``make test-all``.
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import memsave

keras = pytest.importorskip("keras")
pytest.importorskip("keras_hub")

from benchmarks.zoo_models import MODELS, STATEFUL_BATCH, build  # noqa: E402
from tests.keras_helpers import GradientSum  # noqa: E402

pytestmark = pytest.mark.real_models

STRATEGIES = ("optimal", "memory", "speed", "collection")
RTOL = 1e-7          # of the largest entry (float64)
FLOAT32_RTOL = 1e-2  # float32, tiny and ill-conditioned
SAMPLES, BATCH = 5, STATEFUL_BATCH


def _compare(plain, ours, what, rtol=None):
    """A failure message, or None when ``ours`` equals ``plain``."""
    rtol = RTOL if rtol is None else rtol
    pattern = [g is None for g in plain], [g is None for g in ours]
    if pattern[0] != pattern[1]:
        return "%s: None pattern differs (plain %s, memsave %s)" % (what, *pattern)
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64))
             for a, b in zip(plain, ours) if a is not None]
    scale = max(float(np.abs(a).max()) for a, _ in pairs)
    worst = max(float(np.abs(a - b).max()) for a, b in pairs)
    if not worst <= rtol * scale:
        return "%s: max |plain - memsave| = %.3g, %.2g of the largest entry" % (
            what, worst, worst / scale)
    return None


def _dense(g):
    return None if g is None else tf.convert_to_tensor(g)


# CI leaves out the applications' cases listed in SLOW_CASES (tests/conftest.py).
@pytest.mark.parametrize("name", MODELS)
def test_tape_in_tf_function(name):
    """Each strategy's tape beside the plain one, on one forward pass."""
    batch = BATCH
    model, x, y, loss_fn = build(name, batch)
    inputs = [tf.constant(a) for a in x] if isinstance(x, list) else tf.constant(x)
    refused, kinds = {}, {}

    @tf.function
    def step():
        tapes = {"plain": tf.GradientTape()}
        tapes.update({s: memsave.GradientTape(checkpoints=s) for s in STRATEGIES})
        with contextlib.ExitStack() as stack:
            for tape in tapes.values():
                stack.enter_context(tape)
            loss = loss_fn(y, model(inputs, training=True))
        grads = {}
        for key, tape in tapes.items():
            try:
                raw = tape.gradient(loss, model.trainable_variables)
            except memsave.NoBottleneckError as e:
                refused[key] = e
                continue
            kinds[key] = [type(g).__name__ for g in raw]   # IndexedSlices where TF gives them
            grads[key] = [_dense(g) for g in raw]
        return grads

    grads = {k: [None if g is None else g.numpy() for g in v] for k, v in step().items()}
    failures = []
    for strategy in STRATEGIES:
        if strategy in refused:
            if strategy != "memory":
                failures.append("%s raised %r" % (strategy, refused[strategy]))
            continue
        failure = _compare(grads["plain"], grads[strategy], strategy)
        if failure:
            failures.append(failure)
        if kinds[strategy] != kinds["plain"]:
            failures.append("%s: gradient kinds %s, plain %s" % (
                strategy, kinds[strategy], kinds["plain"]))
    assert not failures, "%s: %s" % (name, "; ".join(failures))


FLOAT32 = ("ResNet50", "DenseNet121", "GPT2", "MobileNetV3Small")


@pytest.mark.both_onednn
@pytest.mark.parametrize("name", FLOAT32)
def test_tape_in_float32_where_onednn_fuses(name):
    """The same in float32, which oneDNN fuses (conv + bias + relu, matmul +
    bias, batch norm): `make test` runs it with oneDNN on and off. These tiny
    models are ill-conditioned in float32 (see the module docstring), so the
    bound is loose; what it must catch is a crash ('N nodes in a cycle') or
    a lost path, which is off by a large fraction of the largest entry.

    Each strategy runs in a step of its own that returns only its gradients,
    as a training step does: a step that also computes the plain tape's
    keeps the whole forward pass alive, where Grappler would otherwise prune
    the forward tail behind the loss (MobileNetV3Small's 'speed' plan closed
    a cycle only then)."""
    model, x, y, loss_fn = build(name, 4, dtype="float32")
    inputs = [tf.constant(a) for a in x] if isinstance(x, list) else tf.constant(x)

    def gradients(make_tape):
        @tf.function
        def step():
            with make_tape() as tape:
                loss = loss_fn(y, model(inputs, training=True))
            return [_dense(g) for g in tape.gradient(loss, model.trainable_variables)]
        return [None if g is None else g.numpy() for g in step()]

    plain = gradients(tf.GradientTape)
    for strategy in ("optimal", "speed"):
        ours = gradients(lambda s=strategy: memsave.GradientTape(checkpoints=s))
        failure = _compare(plain, ours, strategy, rtol=FLOAT32_RTOL)
        assert not failure, "%s: %s" % (name, failure)


# keras.enable + fit on an application costs 40-130 s per strategy on 2
# cores. To keep `make test` within 15 minutes, CI fits the transformers with
# 'optimal' (the default) and 'collection', and the LSTMs with every strategy;
# the tape test above covers every strategy on the models it runs. `make
# test-all` (or -m slow) runs the rest.
FIT_IN_CI = {"GPT2": ("optimal", "collection"), "BERT": ("optimal", "collection"),
             "LSTM": STRATEGIES, "LSTMStateful": STRATEGIES}


def _fit_cases():
    for name in MODELS:
        for strategy in STRATEGIES:
            slow = strategy not in FIT_IN_CI.get(name, ())
            yield pytest.param(name, strategy, id="%s-%s" % (name, strategy),
                               marks=[pytest.mark.slow] if slow else [])


def _fit(name, strategy):
    """The gradients of one epoch of fit, summed per weight (memsave or plain)."""
    stateful = name == "LSTMStateful"
    samples = 2 * BATCH if stateful else SAMPLES   # a stateful RNN needs full batches
    model, x, y, loss_fn = build(name, samples)
    model.compile(optimizer=GradientSum(), loss=loss_fn, jit_compile=False)
    if strategy != "plain":
        memsave.keras.enable(model, strategy)
    # A dataset's batch dimension is unknown: Keras traces the step once, for
    # every batch, and the last batch is partial, as in a real epoch.
    features = tuple(x) if isinstance(x, list) else x
    data = tf.data.Dataset.from_tensor_slices((features, y)).batch(BATCH)
    history = model.fit(data, epochs=1, shuffle=False, verbose=0)
    assert len(history.history["loss"]) == 1, "fit ran no epoch"
    return [v.numpy() for v in model.optimizer.sums]


_PLAIN_FITS = {}


@pytest.mark.parametrize("name,strategy", list(_fit_cases()))
def test_keras_fit_with_a_partial_last_batch(name, strategy):
    """The gradients fit applies over an epoch (summed per weight) equal plain
    fit's, relative to the largest entry."""
    if name not in _PLAIN_FITS:
        _PLAIN_FITS[name] = _fit(name, "plain")
    plain = _PLAIN_FITS[name]
    try:
        ours = _fit(name, strategy)
    except memsave.NoBottleneckError:
        if strategy == "memory":
            return   # its documented error on graphs without a bottleneck
        raise
    failure = _compare(plain, ours, strategy)
    assert not failure, "%s: %s" % (name, failure)
