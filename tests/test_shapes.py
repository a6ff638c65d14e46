"""Planning on unknown shapes: hints, first-trace shapes, Keras' batch, and the
fallback to plain gradients when a plan would not save memory."""

import logging
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.keras import data_batch_size
from memsave.planning.plan import MIN_SAVING
from memsave.profile import peak_memory

B, S = 8, 128   # the U-Net of the original library's issue #11: batch 8 at 128x128


def _unet(x, rng, levels=4, channels=32):
    """conv-BN-ReLU U-Net whose upsampling follows the skips' dynamic shapes."""
    weights = []

    def conv(h, cout, k=3):
        cin = h.shape[-1]
        w = tf.Variable((rng.randn(k, k, cin, cout) / np.sqrt(k * k * cin)).astype(np.float32))
        weights.append(w)
        return tf.nn.conv2d(h, w, 1, "SAME")

    def block(h, cout):
        h = conv(h, cout)
        scale, offset = tf.Variable(tf.ones([cout])), tf.Variable(tf.zeros([cout]))
        weights.extend([scale, offset])
        h, _, _ = tf.compat.v1.nn.fused_batch_norm(h, scale, offset, is_training=True)
        return tf.nn.relu(h)

    h, skips = x, []
    for level in range(levels):
        h = block(block(h, channels * 2 ** level), channels * 2 ** level)
        skips.append(h)
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
    h = block(h, channels * 2 ** levels)
    for skip in reversed(skips):
        h = tf.image.resize(h, tf.shape(skip)[1:3], method="nearest")
        h = tf.concat([h, skip], -1)
        h = block(block(h, skip.shape[-1]), skip.shape[-1])
    return tf.reduce_mean(tf.square(conv(h, 1, 1))), weights


def _unet_graph(shape):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, shape)
        loss, weights = _unet(x, np.random.RandomState(0))
    return graph, x, loss, weights


def test_shapes_hint_sizes_the_plan_as_known_shapes_would():
    graph, x, loss, ws = _unet_graph([None, None, None, 3])
    with graph.as_default():
        blind = memsave.plan(loss, ws)
        hinted = memsave.plan(loss, ws, shapes={x: (B, S, S, 3)})
        by_name = memsave.plan(loss, ws, shapes={x.name: [B, S, S, 3]})
    graph, x, loss, ws = _unet_graph([B, S, S, 3])
    with graph.as_default():
        known = memsave.plan(loss, ws)
    assert any("shapes=" in n for n in hinted.notes)
    # Batch norm's reserve-space outputs have no static shape even then; the
    # activations all do, so the estimates match the known-shape graph's.
    assert hinted.plain_peak_bytes == known.plain_peak_bytes
    assert hinted.checkpoints == known.checkpoints == by_name.checkpoints
    # Blind, the input is sized nominally (batch 32 at 128x128): absolute
    # sizes are 4x off, relative ones right, so the plan is the same, and it
    # says that its sizes are a guess (no fallback to plain on them).
    assert any("nominal sizes" in n for n in blind.notes), blind.notes
    assert blind.checkpoints == known.checkpoints
    assert blind.unknown_dims > known.unknown_dims
    assert 3.5 < blind.plain_peak_bytes / known.plain_peak_bytes < 4.01


@pytest.mark.heavy
def test_unet_with_unknown_height_and_width():
    """Issue #11 of the original library, as its user wrote it (a Session, no
    hints): 'optimal' >= 30% below plain; with shapes= >= 40%."""
    data = np.random.RandomState(1).randn(B, S, S, 3).astype(np.float32)

    def measure(strategy, hinted=False):
        graph, x, loss, ws = _unet_graph([None, None, None, 3])
        with graph.as_default():
            if strategy == "plain":
                grads = tf.gradients(loss, ws)
            else:
                grads = memsave.gradients(loss, ws, checkpoints=strategy,
                                          shapes={x: data.shape} if hinted else None)
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                return peak_memory(lambda: sess.run(grads, {x: data}))

    plain, blind, hinted = measure("plain"), measure("optimal"), measure("optimal", True)
    print("\nU-Net, unknown batch/H/W, batch 8 at 128x128: plain %.1f MB, optimal %.1f MB "
          "(%.0f%% lower), with shapes= %.1f MB (%.0f%% lower)" % (
              plain / 2**20, blind / 2**20, 100 * (1 - blind / plain), hinted / 2**20,
              100 * (1 - hinted / plain)))
    assert blind <= 0.7 * plain
    assert hinted <= 0.6 * plain


def test_batch_size_sets_the_leading_axis_only():
    def graph_with(shape):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, shape)
            ws = [tf.Variable(tf.ones([16, 16])) for _ in range(6)]
            h = x
            for w in ws:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(h)
        return graph, loss, ws

    graph, loss, ws = graph_with([None, 16])
    with graph.as_default():
        sized = memsave.plan(loss, ws, checkpoints="memory", min_checkpoint_size=0,
                             batch_size=64)
    graph, loss, ws = graph_with([64, 16])
    with graph.as_default():
        known = memsave.plan(loss, ws, checkpoints="memory", min_checkpoint_size=0)
    assert sized.plain_peak_bytes == known.plain_peak_bytes
    assert sized.unknown_dims == 0
    assert any("batch_size=64 for the leading axis" in n for n in sized.notes)


def _conv_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((32, 32, 3))]
        + [keras.layers.Conv2D(16, 3, padding="same", activation="relu") for _ in range(6)]
        + [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1)])


def test_relaxed_retrace_plans_on_the_first_trace_shapes(caplog):
    """tf.function generalizes the batch axis on the second shape it sees; the
    plan of that trace is sized from the first one, and measures the same."""
    model = _conv_model()
    full = np.random.RandomState(0).randn(32, 32, 32, 3).astype(np.float32)

    @tf.function(reduce_retracing=True)
    def step(x):
        with memsave.GradientTape(checkpoints="optimal") as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        return tape.gradient(loss, model.trainable_variables)

    with caplog.at_level(logging.INFO, logger="memsave"):
        step(full)
        step(full[:5])
    assert any("sizes from the first trace of step" in r.getMessage() for r in caplog.records)
    assert not any(r.levelno >= logging.WARNING and "unknown dimensions" in r.getMessage()
                   for r in caplog.records)
    first = step.get_concrete_function(tf.TensorSpec(full.shape))
    relaxed = step.get_concrete_function(tf.TensorSpec((None,) + full.shape[1:]))
    assert first is not relaxed
    data = tf.constant(full)
    for a, b in zip(first(data), relaxed(data)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    at_first, at_relaxed = peak_memory(first, data), peak_memory(relaxed, data)
    assert at_relaxed <= 1.1 * at_first, (at_first, at_relaxed)


def test_relaxed_retrace_takes_its_batch_from_batch_size_over_the_first_trace(caplog):
    """A retrace for another batch (Keras' fit at 32, then at 128) is planned
    for that batch where ``batch_size=`` says it, not for the first trace's."""
    model = _conv_model()
    data = np.random.RandomState(0).randn(32, 32, 32, 3).astype(np.float32)

    def step_for(batch_size):
        @tf.function(reduce_retracing=True)
        def step(x):
            with memsave.GradientTape(checkpoints="optimal", batch_size=batch_size) as tape:
                loss = tf.reduce_mean(tf.square(model(x)))
            return tape.gradient(loss, model.trainable_variables)
        return step

    with caplog.at_level(logging.INFO, logger="memsave"):
        first = step_for(None)
        first(data)
        first(data[:5])   # relaxed, on the first trace's sizes
        relaxed = _estimated_peaks(caplog)
        caplog.clear()
    assert len(relaxed) == 2 and relaxed[0] == relaxed[1]   # both traces sized at 32
    with caplog.at_level(logging.INFO, logger="memsave"):
        second = step_for(128)
        second(data)
        second(data[:5])
        messages = [r.getMessage() for r in caplog.records]
        peaks = _estimated_peaks(caplog)
    assert any("batch_size=128 for the leading axis" in m for m in messages), messages
    assert len(peaks) == 2 and peaks[1] > 3 * peaks[0]   # 32 at its first trace, 128 after


def _estimated_peaks(caplog):
    """The estimated peaks (MiB) of the plans logged, in order."""
    return [float(m) for r in caplog.records
            for m in re.findall(r"estimated backward peak: ([0-9.]+) MiB", r.getMessage())]


def test_data_batch_size():
    x = np.zeros((300, 4), "float32")
    assert data_batch_size(x, 128) == 128
    assert data_batch_size(x) == 32   # Keras' default
    assert data_batch_size(x[:10], 128) == 10
    assert data_batch_size({"a": x, "b": x}, 64) == 64
    assert data_batch_size(tf.data.Dataset.from_tensor_slices(x).batch(16)) is None
    assert data_batch_size(tf.data.Dataset.from_tensor_slices(x).batch(
        16, drop_remainder=True)) == 16
    assert data_batch_size(iter([x])) is None


def test_keras_fit_plans_on_the_batch_it_was_given(caplog):
    model = _conv_model()
    model.compile("sgd", "mse", jit_compile=False)
    memsave.keras.enable(model)
    x = np.random.RandomState(0).randn(40, 32, 32, 3).astype(np.float32)
    y = np.zeros((40, 1), "float32")
    with caplog.at_level(logging.INFO, logger="memsave"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "batch_size=16 for the leading axis" in text, text
    assert "plan (optimal)" in text


@pytest.mark.fallback
def test_fallback_to_plain_when_the_plan_does_not_pay(caplog):
    """A chain of two wide layers: nothing to recompute that would lower the
    estimate; a named strategy then uses plain tf.gradients, a list is kept."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.ones((4, 64), "float32"))
        w1, w2 = tf.Variable(tf.ones([64, 64])), tf.Variable(tf.ones([64, 1]))
        h = tf.tanh(tf.matmul(x, w1))
        loss = tf.reduce_sum(tf.matmul(h, w2))
        chosen = memsave.plan(loss, [w1, w2], checkpoints="speed")
        assert chosen.worse_than_plain(), chosen.summary()
        before = len(graph.get_operations())
        with caplog.at_level(logging.INFO, logger="memsave"):
            grads = memsave.gradients(loss, [w1, w2], checkpoints="speed")
        plain_ops = len(graph.get_operations()) - before
        assert "not 10% below plain" in caplog.text
        assert not any("memsave" in op.name for op in graph.get_operations()[before:]
                       if op.type != "NoOp"), "rewrote although the plan does not pay"
        kept = memsave.gradients(loss, [w1, w2], checkpoints=[h], name="kept")
        assert len(graph.get_operations()) - before - plain_ops > plain_ops
        # 'collection' is a name too: the tensors tagged into it are a request
        # to save memory, and fall back like the other names.
        tf.compat.v1.add_to_collection("checkpoints", h)
        tagged = len(graph.get_operations())
        memsave.gradients(loss, [w1, w2], checkpoints="collection", name="tagged")
        assert not any("memsave" in op.name for op in graph.get_operations()[tagged:]
                       if op.type != "NoOp")
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b, c = sess.run([grads, tf.gradients(loss, [w1, w2]), kept])
    for p, q, r in zip(a, b, c):
        np.testing.assert_allclose(p, q)
        np.testing.assert_allclose(r, q)


@pytest.mark.fallback
def test_a_plan_saving_less_than_the_margin_falls_back_unless_asked(caplog):
    """A plan estimated below plain's peak by less than MIN_SAVING (10%) of it
    saves less than the estimate's error, for its recomputation: without a
    budget or a cap a named strategy uses plain tf.gradients;
    ``fallback=False``, a budget it fits and a cap rewrite. All give plain's
    gradients."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        # Sixteen layers whose activations (288 x 256) just outweigh the
        # weights' gradients that the backward pass ends holding.
        h = tf.constant(rng.rand(288, 256).astype("float32"))
        ws = [tf.Variable(rng.rand(256, 256).astype("float32") / 256) for _ in range(16)]
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h)
        chosen = memsave.plan(loss, ws, checkpoints="optimal")
        ratio = chosen.estimated_peak_bytes / chosen.plain_peak_bytes
        assert 1 - MIN_SAVING <= ratio < 1, chosen.summary()

        def rewrote(**options):
            before = len(graph.get_operations())
            grads = memsave.gradients(loss, ws, checkpoints="optimal", **options)
            return grads, any("memsave" in op.name for op in graph.get_operations()[before:]
                              if op.type != "NoOp")

        with caplog.at_level(logging.INFO, logger="memsave"):
            fell_back, rewritten = rewrote()
        assert not rewritten and "not 10% below plain" in caplog.text
        forced, rewritten = rewrote(fallback=False)
        assert rewritten
        budgeted, rewritten = rewrote(budget=0.95)
        assert rewritten
        capped, rewritten = rewrote(max_recompute=1.0)
        assert rewritten
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            plain, *ours = sess.run([tf.gradients(loss, ws), fell_back, forced, budgeted,
                                     capped])
    scale = max(np.abs(g).max() for g in plain)
    for grads in ours:
        for p, q in zip(plain, grads):
            assert np.abs(p - q).max() <= 1e-5 * scale


def test_a_fused_batch_norms_reserve_space_is_not_an_unknown_size(caplog):
    """FusedBatchNormV3's reserve space (its sixth output) has no static shape:
    its kernel sizes it (empty on CPU). On a graph whose shapes are all
    known otherwise, the plan must not say that sizes were guessed (and warn
    to pass shapes=, which cannot size it), nor lose the fallback that
    guessed sizes disable."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        h = tf.constant(rng.rand(8, 16, 16, 8).astype("float32"))
        ws = []
        for _ in range(3):
            w = tf.Variable(rng.rand(3, 3, 8, 8).astype("float32") / 72)
            scale, offset = tf.Variable(tf.ones([8])), tf.Variable(tf.zeros([8]))
            ws += [w, scale, offset]
            h, _, _ = tf.compat.v1.nn.fused_batch_norm(
                tf.nn.conv2d(h, w, 1, "SAME"), scale, offset, is_training=True)
            h = tf.nn.relu(h)
        loss = tf.reduce_sum(h)
        bn = [op for op in graph.get_operations() if op.type == "FusedBatchNormV3"]
        assert bn and not bn[0].outputs[5].shape.is_fully_defined()
        with caplog.at_level(logging.INFO, logger="memsave"):
            chosen = memsave.plan(loss, ws, checkpoints="optimal")
    assert chosen.unknown_dims == 0, chosen.summary()
    assert "unknown dimensions" not in chosen.summary() + caplog.text


def test_bad_shape_hints():
    graph, x, loss, ws = _unet_graph([None, None, None, 3])
    with graph.as_default():
        with pytest.raises(TypeError, match="shapes must be a dict"):
            memsave.plan(loss, ws, shapes=[(8, 128, 128, 3)])
        with pytest.raises(ValueError, match="incompatible"):
            memsave.plan(loss, ws, shapes={x: (8, 128, 128, 4)})
        with pytest.raises(ValueError, match="no tensor"):
            memsave.plan(loss, ws, shapes={"nope:0": (8, 128, 128, 3)})
        with pytest.raises(ValueError, match="batch_size must be an int"):
            memsave.plan(loss, ws, batch_size=0)


def _masked_chain(which, n=1024, width=64, depth=6):
    """The plan of a tanh chain on ``which`` rows of ``n``: all of them ('all'),
    those a mask keeps ('mask', tf.boolean_mask), or the distinct rows of an
    embedding that ids pick ('unique', as a sparse lookup does), or sums
    of rows per segment id ('segments')."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        x = tf.compat.v1.placeholder(tf.float32, [n, width])
        ws = [tf.Variable((rng.randn(width, width) / 8).astype(np.float32))
              for _ in range(depth)]
        if which == "mask":
            h = tf.boolean_mask(x, x[:, 0] > 0)
        elif which == "unique":
            table = tf.Variable(rng.randn(n, width).astype(np.float32))
            ws.append(table)
            ids, _ = tf.unique(tf.compat.v1.placeholder(tf.int32, [n]))
            h = tf.gather(table, ids)
        elif which == "segments":
            h = tf.math.segment_sum(x, tf.compat.v1.placeholder(tf.int32, [n]))
        else:
            h = x
        for w in ws[:depth]:
            h = tf.tanh(h @ w)
        return memsave.plan(tf.reduce_sum(h * h), ws)


@pytest.mark.parametrize("which", ["mask", "unique", "segments"])
def test_data_dependent_sizes_are_taken_at_their_largest(which):
    # tf.where's (boolean_mask's), tf.unique's and segment sums' outputs have
    # no static size; taken as 1, the chain after them looked empty and any
    # plan fitted. At their largest (every row kept, every id distinct, a
    # segment per id), the chain is sized as on all the rows, erring high,
    # and the plan says so.
    plan, rows = _masked_chain(which), _masked_chain("all")
    assert not any("taken as 1" in n for n in plan.notes), plan.notes
    assert any("data-dependent sizes taken at their largest" in n for n in plan.notes)
    assert plan.unknown_dims > 0   # a guess: never taken as worse than plain on it
    assert rows.plain_peak_bytes <= plan.plain_peak_bytes < 1.5 * rows.plain_peak_bytes
