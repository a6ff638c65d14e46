"""Reversible and invertible blocks (memsave.reversible).

Gradients (and losses) equal a plain tf.GradientTape over the same blocks on
the same weights, log-det included; peak memory does not grow with depth;
drifting blocks are reported and, with store_drifted=True, stored; bad input
raises clear errors; memsave's checkpointing works on models that contain a
ReversibleSequence.
"""

import json
import logging
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsave
from benchmarks.reversible import revnet_step
from memsave import reversible as R
from memsave.profile import measured_call, peak_memory

C = 8          # channels of the equality tests
MiB = 2 ** 20


@pytest.fixture(autouse=True)
def _keras_seeded():
    keras.utils.set_random_seed(0)
    yield


# --------------------------------------------------------------------------
# helpers


def _var(rng, *shape, scale=0.15):
    return tf.Variable((rng.randn(*shape) * scale).astype(np.float32))


def _mlp(w):
    def f(h):
        return tf.tanh(tf.matmul(h, w))
    return f


def _dense(units, i, activation=None):
    # Small weights keep the stacks well conditioned, so float32 round-off in
    # the reconstruction stays far below the tolerance even 32 blocks deep.
    init = keras.initializers.RandomNormal(stddev=0.15, seed=1000 + i)
    return keras.layers.Dense(units, activation=activation, kernel_initializer=init,
                              bias_initializer=keras.initializers.RandomNormal(0.1, seed=i))


def _block(kind, i, rng, channels=C, use_keras=True):
    """Block ``i`` of a stack of ``kind``: Keras layers (odd ``i``) and plain callables.

    ``use_keras=False``: plain callables only (they trace faster).
    """
    half = channels // 2
    use_keras = use_keras and i % 2 == 1
    if kind == "residual":
        if use_keras:
            return R.ReversibleResidual(_dense(half, i, "tanh"), _dense(half, i + 500, "tanh"))
        wf, wg = _var(rng, half, half), _var(rng, half, half)
        return R.ReversibleResidual(_mlp(wf), _mlp(wg), variables=[wf, wg])
    if kind == "additive":
        if use_keras:
            return R.AdditiveCoupling(keras.Sequential([_dense(16, i, "tanh"),
                                                        _dense(half, i + 500)]), swap=True)
        w1, w2 = _var(rng, half, 16), _var(rng, 16, half)
        return R.AdditiveCoupling(lambda h: tf.matmul(_mlp(w1)(h), w2), swap=i % 2 == 1,
                                  variables=[w1, w2])
    if kind == "affine":
        if use_keras:
            return R.AffineCoupling(_dense(2 * half, i), swap=True)
        w = _var(rng, half, 2 * half)
        return R.AffineCoupling(_mlp(w), swap=i % 2 == 1, variables=[w])
    if kind == "actnorm":
        return R.ActNorm(channels, scale_init=np.exp(rng.uniform(-0.05, 0.05, channels)),
                         bias_init=rng.randn(channels) * 0.1)
    if kind == "conv":
        return R.Invertible1x1Conv(channels, seed=i)
    raise AssertionError(kind)


KINDS = ["residual", "additive", "affine", "actnorm", "conv"]


def _plain(layers, x):
    """The same blocks' forward, directly (everything recorded on the tape)."""
    h, total = x, tf.zeros(tf.shape(x)[:1])
    for b in layers:
        if isinstance(b, R.InvertibleBlock):
            total += b.log_det(h)
            h = b.forward(h)
        else:
            h = b(h)
    return h, total


def _loss(y, log_det):
    return tf.reduce_mean(tf.sin(y) * y) - 0.1 * tf.reduce_mean(log_det)


def _compare(layers, x, *, eager=False, **seq_kwargs):
    """(reversible loss, plain loss, reversible grads, plain grads) w.r.t. x and weights."""
    seq = R.ReversibleSequence(layers, **seq_kwargs)
    # Build the Keras layers without a drift check: the checks (and
    # warnings) under test then come from inside the tf.function.
    seq(x, store_activations=True)
    variables = seq.trainable_variables

    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = _loss(*seq(x))
        ours = tape.gradient(loss, [x] + variables)
        with tf.GradientTape() as tape:
            tape.watch(x)
            plain_loss = _loss(*_plain(layers, x))
        plain = tape.gradient(plain_loss, [x] + variables)
        return loss, plain_loss, ours, plain

    return step() if eager else tf.function(step)()


def _assert_close(ours, plain, rtol=1e-5):
    assert len(ours) == len(plain)
    for a, b in zip(ours, plain):
        assert a is not None and b is not None
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(a))
        scale = max(1.0, float(np.max(np.abs(b))))
        assert float(np.max(np.abs(a - b))) <= rtol * scale, (
            "max |a - b| = %g, max |b| = %g" % (float(np.max(np.abs(a - b))), scale))


# --------------------------------------------------------------------------
# gradient equality


@pytest.mark.parametrize("depth", [1, 8, 32])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_plain_tape(kind, depth):
    rng = np.random.RandomState(depth)
    x = tf.constant(rng.randn(6, 3, C).astype(np.float32))
    # 32 blocks: plain callables only, for tracing time (Keras layers are
    # covered at depths 1 and 8).
    layers = [_block(kind, i, rng, use_keras=depth < 32) for i in range(depth)]
    loss, plain_loss, ours, plain = _compare(layers, x)
    np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6, atol=1e-6)
    _assert_close(ours, plain)


@pytest.mark.parametrize("kind", KINDS)
def test_non_invertible_block_in_the_middle(kind):
    rng = np.random.RandomState(7)
    x = tf.constant(rng.randn(10, C).astype(np.float32))
    layers = [_block(kind, i, rng) for i in range(4)]
    layers += [keras.layers.Dense(C, activation="tanh")]
    layers += [_block(kind, i, rng) for i in range(4, 8)]
    seq = R.ReversibleSequence(layers)
    assert [type(s).__name__ for s in seq._segments] == ["_Run", "Dense", "_Run"]
    loss, plain_loss, ours, plain = _compare(layers, x)
    np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6, atol=1e-6)
    _assert_close(ours, plain)


def test_a_block_used_twice_accumulates_its_gradients():
    rng = np.random.RandomState(2)
    x = tf.constant(rng.randn(6, C).astype(np.float32))
    shared, other = _block("affine", 0, rng), _block("conv", 1, rng)
    loss, plain_loss, ours, plain = _compare([shared, other, shared, keras.layers.Dense(C), shared],
                                             x, check_inverse=True)
    np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6, atol=1e-6)
    _assert_close(ours, plain)


def _two_revnet_blocks(weights):
    return R.ReversibleSequence([
        R.ReversibleResidual(lambda h: tf.tanh(h @ weights[0]), lambda h: tf.tanh(h @ weights[1]),
                             variables=weights[:2]),
        R.ReversibleResidual(lambda h: tf.tanh(h @ weights[2]), lambda h: tf.tanh(h @ weights[3]),
                             variables=weights[2:])])


@pytest.mark.parametrize("mode", ["eager", "function", "session"])
def test_a_higher_order_gradient_through_reconstructed_inputs_raises(mode):
    """A gradient penalty through two blocks needs how the second block's input
    depends on the first block's weights, which its reconstruction lacks: it
    was 26% off, silently. First-order gradients of the same run still match."""
    rng = np.random.RandomState(4)
    x_np, w_np = rng.randn(4, 8), [rng.randn(4, 4) * 0.4 for _ in range(4)]
    match = "higher-order gradient"
    if mode == "session":
        with tf.Graph().as_default():
            weights = [tf.Variable(w) for w in w_np]
            y, _ = _two_revnet_blocks(weights)(tf.constant(x_np))
            grads = tf.gradients(tf.reduce_sum(tf.sin(y) * y), weights)
            with pytest.raises(ValueError, match=match):
                tf.gradients(tf.add_n([tf.reduce_sum(g * g) for g in grads]), weights)
        return
    weights = [tf.Variable(w) for w in w_np]
    seq = _two_revnet_blocks(weights)

    def penalty_gradient():
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                y, _ = seq(tf.constant(x_np))
                loss = tf.reduce_sum(tf.sin(y) * y)
            grads = inner.gradient(loss, weights)
            penalty = tf.add_n([tf.reduce_sum(g * g) for g in grads])
        return outer.gradient(penalty, weights)
    with pytest.raises(ValueError, match=match):
        penalty_gradient() if mode == "eager" else tf.function(penalty_gradient)()


def test_mixed_stack_eagerly():
    rng = np.random.RandomState(3)
    x = tf.constant(rng.randn(5, 2, C).astype(np.float32))
    layers = [_block(k, i, rng) for i, k in enumerate(KINDS + KINDS)]
    loss, plain_loss, ours, plain = _compare(layers, x, eager=True)
    np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6, atol=1e-6)
    _assert_close(ours, plain)


def test_log_det_and_inverse_of_a_flow():
    rng = np.random.RandomState(4)
    x = tf.constant(rng.randn(7, 3, C).astype(np.float32))
    layers = [_block(k, i, rng) for i, k in enumerate(["actnorm", "conv", "affine"] * 2)]
    seq = R.ReversibleSequence(layers)
    y, log_det = seq(x)
    assert log_det.shape == (7,)
    np.testing.assert_allclose(seq.inverse(y).numpy(), x.numpy(), atol=1e-5)
    # The log-det is the log |det| of the per-example Jacobian. (Not with
    # pfor: on TF 2.21 CPU, pfor's Jacobian of a rank-3 x rank-2 tf.matmul
    # comes out wrong or crashes, with or without memsave.)
    xs = tf.reshape(x[:1], [-1])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xs)
        ys = tf.reshape(seq(tf.reshape(xs, [1, 3, C]))[0], [-1])
    jacobian = tape.jacobian(ys, xs, experimental_use_pfor=False)
    _, want = np.linalg.slogdet(jacobian.numpy().astype(np.float64))
    np.testing.assert_allclose(float(log_det[0]), want, rtol=1e-4, atol=1e-4)


def test_affine_scale_has_no_nan_gradients():
    rng = np.random.RandomState(5)
    w = tf.Variable((rng.randn(C // 2, C) * 1e4).astype(np.float32))   # huge raw scales
    seq = R.ReversibleSequence([R.AffineCoupling(_mlp(w), variables=[w]),
                                R.AffineCoupling(lambda h: 1e4 * tf.tile(h, [1, 2]), swap=True)])
    x = tf.constant(rng.randn(9, C).astype(np.float32) * 10)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = _loss(*seq(x))
    grads = tape.gradient(loss, [x, w])
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(g.numpy())) for g in grads)


def test_trainable_variables_cover_keras_and_explicit_ones():
    rng = np.random.RandomState(6)
    w = _var(rng, C // 2, C // 2)
    dense = keras.layers.Dense(C // 2)
    block = R.ReversibleResidual(dense, _mlp(w), variables=[w])
    stem = keras.layers.Dense(C)
    seq = R.ReversibleSequence([stem, block, R.ActNorm(C)])
    seq(tf.zeros([2, 3]))
    ids = {id(v) for v in seq.trainable_variables}
    expected = list(stem.trainable_variables) + list(dense.trainable_variables) + [w]
    expected += [seq.blocks[2].scale, seq.blocks[2].bias]
    assert ids == {id(v) for v in expected}


# --------------------------------------------------------------------------
# memory

def _least_peak(step, calls=3):
    """The least peak of a few calls after a warm-up: in a test worker, one
    call's peak varies with the chunks earlier tests left in the allocator
    (a RevNet of depth 8 measured 4.7 MiB there, 6.5 alone)."""
    step()
    return min(measured_call(step)[1] for _ in range(calls))


@pytest.mark.heavy
def test_peak_memory_constant_in_depth():
    rev = {n: _least_peak(revnet_step(n, False)) / MiB for n in (8, 32, 128)}
    plain = {n: peak_memory(revnet_step(n, True)) / MiB for n in (8, 128)}
    logging.getLogger("memsave").info("reversible %s MiB, plain %s MiB", rev, plain)
    assert rev[128] / rev[8] <= 1.5, rev
    assert rev[32] / rev[8] <= 1.5, rev
    assert plain[128] / plain[8] >= 8, plain
    assert rev[8] < plain[8]


@pytest.mark.heavy
def test_drift_checks_keep_memory_constant():
    # The check of each block runs before the next block starts, and the
    # store of a healthy block is empty.
    checked = {n: peak_memory(revnet_step(n, False, check_inverse=True, store_drifted=True)) / MiB
               for n in (8, 32)}
    assert checked[32] / checked[8] <= 1.5, checked


# --------------------------------------------------------------------------
# drift


def _ill_conditioned(kind):
    if kind == "actnorm":
        # y = 1 + 1e-7 x in float32 keeps about one bit of x.
        return R.ActNorm(C, scale_init=1e-7, bias_init=1.0, name="tiny_scale")
    rng = np.random.RandomState(8)
    q, _ = np.linalg.qr(rng.randn(C, C))
    s = np.ones(C)
    s[-1] = 1e-7
    return R.Invertible1x1Conv(C, weight=(q * s) @ q.T, name="near_singular")


@pytest.mark.parametrize("kind", ["actnorm", "conv"])
def test_drift_warns_and_store_fallback_is_exact(kind, caplog):
    rng = np.random.RandomState(9)
    x = tf.constant(rng.randn(16, C).astype(np.float32))

    def layers():
        tf.random.set_seed(1)
        return [R.Invertible1x1Conv(C, seed=1), _block("affine", 0, np.random.RandomState(2)),
                _ill_conditioned(kind), R.Invertible1x1Conv(C, seed=2)]

    with caplog.at_level(logging.WARNING, logger="memsave"):
        _, _, ours, plain = _compare(layers(), x, check_inverse=True)
    hits = [r for r in caplog.records if r.name == "memsave" and r.levelno == logging.WARNING]
    assert hits and "block 2" in hits[0].getMessage()
    assert ("tiny_scale" if kind == "actnorm" else "near_singular") in hits[0].getMessage()
    # Without the fallback the reconstructed input is wrong, and so are the
    # gradients of the blocks below it.
    errors = [np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(1, np.max(np.abs(b)))
              for a, b in zip(ours, plain)]
    assert max(errors) > 1e-3

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="memsave"):
        loss, plain_loss, ours, plain = _compare(layers(), x, check_inverse=True,
                                                 store_drifted=True)
    assert any("store_drifted=True" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6)
    _assert_close(ours, plain)


def test_check_every_and_drift_report(caplog):
    rng = np.random.RandomState(10)
    x = tf.constant(rng.randn(8, C).astype(np.float32))
    layers = [R.ActNorm(C), _ill_conditioned("actnorm")]
    seq = R.ReversibleSequence(layers, check_inverse=True, check_every=3, store_drifted=True)
    step = tf.function(lambda: seq(x))
    with caplog.at_level(logging.WARNING, logger="memsave"):
        step()
    assert len([r for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "memsave"]) == 1
    drift = seq.drift
    assert drift[0] < 1e-6 and drift[1] > 1e-4
    for _ in range(4):          # checks again on call 4, warns only once per block
        step()
    assert len([r for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "memsave"]) == 1
    assert int(seq._calls.numpy()) == 5


def test_healthy_blocks_do_not_warn(caplog):
    rng = np.random.RandomState(11)
    x = tf.constant(rng.randn(8, C).astype(np.float32))
    with caplog.at_level(logging.WARNING, logger="memsave"):
        _, _, ours, plain = _compare([_block(k, 0, rng) for k in KINDS], x,
                                     check_inverse=True, store_drifted=True)
    # (TensorFlow's own retracing warnings may land here: count memsave's.)
    assert not [r for r in caplog.records if r.name == "memsave"]
    _assert_close(ours, plain)


# --------------------------------------------------------------------------
# working together with checkpointing


@pytest.mark.parametrize("checkpoints", ["list", "outputs", "memory", "optimal"])
def test_memsave_gradients_on_a_model_with_a_reversible_sequence(checkpoints):
    rng = np.random.RandomState(12)
    half = C // 2
    ws = [_var(rng, half, half) for _ in range(8)]
    blocks = [R.ReversibleResidual(_mlp(ws[2 * i]), _mlp(ws[2 * i + 1]),
                                   variables=ws[2 * i:2 * i + 2]) for i in range(4)]
    seq = R.ReversibleSequence(blocks)
    w_stem, w_head = _var(rng, 5, C), _var(rng, C, 3)
    x = tf.constant(rng.randn(32, 5).astype(np.float32))
    variables = [w_stem, w_head] + ws

    def model(store):
        h0 = tf.tanh(tf.matmul(x, w_stem))
        h1 = tf.tanh(2.0 * h0)
        y, log_det = seq(h1, store_activations=store)
        h2 = tf.tanh(tf.matmul(y, w_head))
        h3 = tf.sin(h2)
        kept = {"list": [h1, h2], "outputs": [h1, y, log_det]}.get(checkpoints, checkpoints)
        return tf.reduce_mean(h3 * h3) + tf.reduce_mean(log_det), kept

    @tf.function
    def step():
        loss, kept = model(store=False)
        ours = memsave.gradients(loss, variables, min_checkpoint_size=0, checkpoints=kept)
        ref = tf.gradients(loss, variables)
        plain_loss, _ = model(store=True)
        plain = tf.gradients(plain_loss, variables)
        return ours, ref, plain

    ours, ref, plain = step()
    _assert_close(ours, ref, rtol=1e-6)
    _assert_close(ours, plain)


# --------------------------------------------------------------------------
# bad input


def test_bad_sequences_raise():
    with pytest.raises(TypeError, match="list of blocks"):
        R.ReversibleSequence(R.ActNorm(4))
    with pytest.raises(TypeError, match="list of blocks"):
        R.ReversibleSequence(3)
    with pytest.raises(ValueError, match="at least one block"):
        R.ReversibleSequence([])
    with pytest.raises(TypeError, match="block 1 is 'x'"):
        R.ReversibleSequence([R.ActNorm(4), "x"])
    with pytest.raises(TypeError, match="block 0"):
        R.ReversibleSequence([R.ActNorm])          # the class, not a block
    with pytest.raises(TypeError, match="store_drifted"):
        R.ReversibleSequence([R.ActNorm(4)], check_inverse=True, store_drifted="store")
    with pytest.raises(ValueError, match="needs check_inverse=True"):
        R.ReversibleSequence([R.ActNorm(4)], store_drifted=True)
    with pytest.raises(ValueError, match="tolerance"):
        R.ReversibleSequence([R.ActNorm(4)], tolerance=-1)
    with pytest.raises(ValueError, match="check_every"):
        R.ReversibleSequence([R.ActNorm(4)], check_every=0)
    with pytest.raises(TypeError, match="check_inverse"):
        R.ReversibleSequence([R.ActNorm(4)], check_inverse="yes")


def test_bad_blocks_raise():
    with pytest.raises(TypeError, match="callable f"):
        R.ReversibleResidual(None, tf.tanh)
    with pytest.raises(TypeError, match="callable g"):
        R.ReversibleResidual(tf.tanh, 3)
    with pytest.raises(TypeError, match="callable f"):
        R.AffineCoupling("dense")
    with pytest.raises(ValueError, match="eps"):
        R.AffineCoupling(tf.tanh, eps=0)
    with pytest.raises(TypeError, match="tf.Variable"):
        R.AdditiveCoupling(tf.tanh, variables=[np.zeros(3)])
    with pytest.raises(ValueError, match="positive integer"):
        R.ActNorm(0)
    with pytest.raises(ValueError, match="positive integer"):
        R.Invertible1x1Conv(2.5)
    with pytest.raises(ValueError, match="non-zero"):
        R.ActNorm(4, scale_init=0.0)
    with pytest.raises(ValueError, match="scalars or 4 values"):
        R.ActNorm(4, scale_init=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"shape \(4, 4\)"):
        R.Invertible1x1Conv(4, weight=np.eye(3))


def test_bad_calls_raise():
    x = tf.zeros([2, 6])
    with pytest.raises(ValueError, match="expects 4 channels"):
        R.ReversibleSequence([R.ActNorm(4)])(x)
    with pytest.raises(ValueError, match="must return 3 channels"):
        R.ReversibleSequence([R.AdditiveCoupling(keras.layers.Dense(2))])(x)
    with pytest.raises(ValueError, match="must return 6 channels"):
        R.ReversibleSequence([R.AffineCoupling(keras.layers.Dense(3))])(x)
    with pytest.raises(TypeError, match="floating-point"):
        R.ReversibleSequence([R.ActNorm(6)])(tf.zeros([2, 6], tf.int32))
    with pytest.raises(ValueError, match=r"\[batch, \.\.\., channels\]"):
        R.ReversibleSequence([R.ActNorm(6)])(tf.zeros([6]))
    with pytest.raises(TypeError, match="every block to be an InvertibleBlock"):
        R.ReversibleSequence([R.ActNorm(6), tf.tanh]).inverse(x)

    class Half(R.InvertibleBlock):
        def forward(self, x):
            return x

    with pytest.raises(NotImplementedError, match="inverse"):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, _ = R.ReversibleSequence([Half()])(x)
        tape.gradient(y, x)


def test_import_is_lazy_and_light():
    code = ("import sys, tensorflow\n"
            "before = {m for m in sys.modules if m.startswith('keras')}\n"
            "import memsave\n"
            "assert 'memsave.reversible' not in sys.modules\n"
            "import memsave.reversible\n"
            "assert memsave.reversible.ReversibleSequence\n"
            "assert {m for m in sys.modules if m.startswith('keras')} == before\n"
            "import tensorflow as tf\n"
            "assert tf.GradientTape.__module__.startswith('tensorflow')\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.heavy
def test_benchmark_runs_tiny(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.reversible", "--depths", "2", "4",
                          "--repeats", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "reversible.json").read_text())
    assert {r["method"] for r in data["rows"]} == {"plain tape", "reversible",
                                                  "reversible, checked"}
    assert "| blocks |" in (tmp_path / "reversible.md").read_text()
