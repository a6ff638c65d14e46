"""memsave.GradientTape gives tf.GradientTape's gradients, with checkpointing.

Every comparison traces the same forward pass twice in a tf.function, once
recorded by tf.GradientTape and once by memsave.GradientTape, and checks the
gradients (max abs difference <= 1e-6) and their None pattern. Tensors are
tiny, so the tapes use min_checkpoint_size=0 to make 'memory' choose
checkpoints at all; a counter on memsave.api.gradients proves the rewrite
ran.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import backprop

import memsave
from memsave import api, patching
from memsave.log import reset_warnings

ATOL = 1e-6
WIDTH, BATCH = 16, 8


class _Calls(list):
    """The checkpoints of each differentiation tapes ask memsave for; ``settings`` all options."""

    def __init__(self):
        super().__init__()
        self.settings = []


@pytest.fixture
def rewrites(monkeypatch):
    """Records the differentiations tapes ask memsave for."""
    calls = _Calls()
    original = api.differentiate

    def recording(ys, xs, grad_ys, settings, **kwargs):
        calls.append(settings.checkpoints.given)
        calls.settings.append(settings)
        return original(ys, xs, grad_ys, settings, **kwargs)

    monkeypatch.setattr(api, "differentiate", recording)
    return calls


def _variables(n, seed, scale=None):
    rng = np.random.RandomState(seed)
    scale = scale if scale is not None else 1.0 / np.sqrt(WIDTH)
    return [tf.Variable((rng.randn(WIDTH, WIDTH) * scale).astype(np.float32)) for _ in range(n)]


def _input(seed=7):
    return tf.constant(np.random.RandomState(seed).randn(BATCH, WIDTH).astype(np.float32))


def chain(ws, x):
    h = x
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
    return h


def residual(ws, x):
    h = x
    for i in range(0, len(ws), 2):
        h = h + tf.matmul(tf.nn.relu(tf.matmul(h, ws[i])), ws[i + 1])
    return tf.tanh(h)


def _both(step):
    """Run ``step(tape_factory)`` with the plain and the memsave tape."""
    plain = step(lambda **kw: tf.GradientTape(**kw))
    ours = step(lambda **kw: memsave.GradientTape(min_checkpoint_size=0, **kw))
    return plain, ours


def assert_same(plain, ours, atol=ATOL):
    flat_p, flat_o = tf.nest.flatten(plain), tf.nest.flatten(ours)
    tf.nest.assert_same_structure(plain, ours)
    assert [g is None for g in flat_p] == [g is None for g in flat_o], "None pattern differs"
    pairs = [(np.asarray(tf.convert_to_tensor(a)), np.asarray(tf.convert_to_tensor(b)))
             for a, b in zip(flat_p, flat_o) if a is not None]
    assert pairs, "nothing was compared"
    worst = max(float(np.max(np.abs(a - b))) for a, b in pairs)
    assert worst <= atol, "max abs difference %.3g > %g" % (worst, atol)
    return worst


@pytest.mark.parametrize("model,n", [(chain, 16), (residual, 12)])
def test_matches_tape(model, n, rewrites):
    ws, x = _variables(n, seed=1, scale=0.3), _input()

    def step(make_tape):
        @tf.function
        def f():
            with make_tape() as tape:
                loss = tf.reduce_sum(model(ws, x) ** 2)
            return tape.gradient(loss, ws)
        return f()

    assert_same(*_both(step))
    assert rewrites == ["optimal"]   # the default


def _mean_and_chain_gradient(make_tape, ws, x, sources, output_gradients):
    """In a tf.function, the gradient of [mean of the chain, the chain] with
    respect to ``sources``, with ``output_gradients(chain)``."""
    @tf.function
    def f():
        with make_tape() as tape:
            h = chain(ws, x)
            loss = tf.reduce_mean(h)
        return tape.gradient([loss, h], sources, output_gradients=output_gradients(h))
    return f()


def test_output_gradients_and_nested_sources(rewrites):
    ws = _variables(8, seed=2)
    named = {"first": ws[0], "rest": ws[1:5], "pair": (ws[5], ws[6]), "last": ws[7]}
    x = _input()
    dh = tf.constant(np.random.RandomState(3).randn(BATCH, WIDTH).astype(np.float32))

    def step(make_tape):
        return _mean_and_chain_gradient(make_tape, ws, x, named,
                                        lambda h: [tf.constant(3.0), dh])

    plain, ours = _both(step)
    assert isinstance(ours, dict) and isinstance(ours["pair"], tuple) and len(ours["rest"]) == 4
    assert_same(plain, ours)
    assert rewrites


def test_a_none_output_gradient_is_refused_as_by_the_plain_tape():
    """tf.gradients takes a None grad_ys entry as ones; the tape raises, so must ours."""
    ws = _variables(4, seed=2)
    x = _input()

    for make_tape in (tf.GradientTape, memsave.GradientTape):
        with pytest.raises(ValueError, match="None"):
            _mean_and_chain_gradient(make_tape, ws, x, ws, lambda h: [None, tf.ones_like(h)])


@pytest.mark.parametrize("dense_read", [False, True])
def test_embedding_gradient_stays_sparse(dense_read, rewrites):
    table = tf.Variable(np.random.RandomState(16).randn(50, WIDTH).astype(np.float32))
    ws = _variables(6, seed=17)
    ids = tf.constant([[1, 4, 4, 9], [0, 3, 7, 7]] * (BATCH // 2))

    def step(make_tape):
        @tf.function
        def f():
            with make_tape() as tape:
                h = tf.reduce_mean(tf.gather(table, ids), axis=1)   # ResourceGather
                if dense_read:
                    h = h + tf.reduce_sum(table[:2])
                loss = tf.reduce_sum(chain(ws, h) ** 2)
            return tape.gradient(loss, [table] + ws)
        return f()

    plain, ours = _both(step)
    assert_same(plain, ours)
    assert type(ours[0]) is type(plain[0])
    assert isinstance(ours[0], tf.IndexedSlices) != dense_read
    assert rewrites


def test_unconnected_source_none_and_zero(rewrites):
    ws = _variables(6, seed=4)
    unused = tf.Variable(np.ones((3, 2), np.float32))
    x = _input()

    def step(make_tape, mode):
        @tf.function
        def f():
            with make_tape() as tape:
                loss = tf.reduce_sum(chain(ws, x))
            return tape.gradient(loss, [unused] + ws, unconnected_gradients=mode)
        return f()

    for mode in (tf.UnconnectedGradients.NONE, tf.UnconnectedGradients.ZERO):
        plain, ours = _both(lambda make: step(make, mode))
        assert_same(plain, ours)
    assert ours[0] is not None and ours[0].shape == (3, 2)
    assert float(tf.reduce_max(tf.abs(ours[0]))) == 0.0
    plain, ours = _both(lambda make: step(make, tf.UnconnectedGradients.NONE))
    assert ours[0] is None


def test_zero_for_an_unconnected_variable_of_unknown_shape(rewrites):
    # Declared with an unknown batch dimension and never read: the plain tape
    # gives zeros of its value's shape; memsave crashed converting (None, 2).
    ws, x = _variables(6, seed=4), _input()
    unused = tf.Variable(np.ones((3, 2), np.float32), shape=tf.TensorShape([None, 2]))

    def step(make_tape):
        @tf.function
        def f():
            with make_tape() as tape:
                loss = tf.reduce_sum(chain(ws, x))
            return tape.gradient(loss, [unused] + ws,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return f()

    plain, ours = _both(step)
    assert_same(plain, ours)
    assert ours[0].shape == (3, 2) and rewrites


@pytest.mark.parametrize("inside", ["cond", "loop", "function"])
def test_output_gradients_made_inside_a_branch_loop_or_function(inside, rewrites, caplog):
    # gradient() called in a tf.cond branch, a loop body or a nested function,
    # seeded with a tensor made there: memsave builds its backward pass in the
    # targets' graph, which cannot read that tensor, so the plain tape answers
    # (memsave crashed with InaccessibleTensorError).
    ws, x = _variables(8, seed=5, scale=0.3), _input()

    def step(make_tape):
        @tf.function
        def f():
            with make_tape(persistent=True) as tape:
                loss = tf.reduce_sum(chain(ws, x) ** 2)

            def grads(scale):
                return tape.gradient(loss, ws[:2], output_gradients=scale)
            if inside == "cond":
                return tf.cond(tf.reduce_sum(x) > -1e9, lambda: grads(tf.reduce_mean(x) * 0 + 2),
                               lambda: [tf.zeros_like(w) for w in ws[:2]])
            if inside == "loop":
                def body(i, total):
                    return i + 1, total + grads(tf.cast(i + 1, tf.float32))[0]
                return tf.while_loop(lambda i, _: i < 3, body, [0, tf.zeros_like(ws[0])])[1]
            return tf.function(grads)(tf.constant(2.0))
        return f()

    reset_warnings()
    with caplog.at_level(logging.WARNING, logger="memsave"):
        plain, ours = _both(step)
    assert_same(plain, ours)
    assert any("made inside a tf.cond branch, loop body or nested function" in r.getMessage()
               for r in caplog.records)


def test_planning_options_are_passed(rewrites):
    ws, x = _variables(12, seed=18, scale=0.3), _input()

    def step(make_tape):
        @tf.function
        def f():
            with make_tape() as tape:
                loss = tf.reduce_sum(chain(ws, x) ** 2)
            return tape.gradient(loss, ws)
        return f()

    plain = step(tf.GradientTape)
    # A budget in bytes (the weight gradients dominate this tiny chain's
    # estimate, so a fraction of plain's would not fit).
    ours = step(lambda: memsave.GradientTape(checkpoints="optimal", budget=2**20,
                                             min_checkpoint_size=0))
    assert_same(plain, ours)
    assert rewrites == ["optimal"] and rewrites.settings[0].budget == 2**20
    with pytest.raises(TypeError, match="budgt"):
        memsave.GradientTape(budgt=0.5)


def test_tape_semantics_outside_recording(rewrites):
    """Ops the plain tape did not record are constants for memsave too."""
    ws, x = _variables(10, seed=5, scale=0.3), _input()

    def step(make_tape):
        @tf.function
        def f(x):
            before = tf.tanh(tf.matmul(x, ws[0]))         # built before the tape
            with make_tape() as tape:
                tape.watch(x)
                h = tf.tanh(tf.matmul(x, ws[0])) * before
                for w in ws[1:]:
                    h = tf.tanh(tf.matmul(h, w)) + before
                with tape.stop_recording():
                    scale = tf.reduce_sum(h)               # not recorded
                h = h * scale
                loss = tf.reduce_sum(h * h)
                unwatched = x * 2.0                      # recorded: x is watched
            after = loss * 3.0                           # built after the tape
            return tape.gradient([loss, after], [ws, x, before, unwatched, scale])
        return f(x)

    plain, ours = _both(step)
    assert_same(plain, ours)
    assert plain[2] is None and plain[4] is None
    assert rewrites


@pytest.mark.parametrize("strategy", ["optimal", "speed", "memory", []])
@pytest.mark.parametrize("where", ["before", "stop_recording"])
@pytest.mark.parametrize("reads", ["watched_tensor", "source_variable", "output_watched"])
def test_a_function_call_the_tape_did_not_record_passes_no_gradient(strategy, where, reads,
                                                                   rewrites):
    """A nested tf.function called outside the recording (before the tape,
    or under stop_recording) on a source, its output used inside: a
    constant for the plain tape (a target the same weights computed, as in a
    consistency loss). tf.gradients, told to stop at the call's output,
    still differentiates the call (its SymbolicGradient): through a watched
    tensor it sent the source a gradient the plain tape does not (1.9 off,
    silently); reading a source variable, the SymbolicGradient failed at
    run time (NotFoundError). Its output watched and a source too (a leaf:
    the call's own op makes an x), the audit refused the rewrite."""
    rng = np.random.RandomState(0)
    ws = [tf.Variable(rng.randn(8, 8) * 0.3) for _ in range(3)]
    x0 = tf.constant(rng.randn(4, 8))

    @tf.function
    def target_of(h):
        if reads != "watched_tensor":
            h = tf.matmul(h, ws[0])
        return tf.tanh(h) * 2.0

    def step(make_tape):
        @tf.function
        def f(x0):
            x = x0 * 1.0
            if where == "before":
                target = target_of(x)
            with make_tape() as tape:
                tape.watch(x)
                if where == "stop_recording":
                    with tape.stop_recording():
                        target = target_of(x)
                if reads == "output_watched":
                    tape.watch(target)
                h = x
                for w in ws:
                    h = tf.tanh(tf.matmul(h, w)) + h
                loss = tf.reduce_sum((h - target) ** 2) + tf.reduce_sum(x * x)
            return tape.gradient(loss, [x, ws] + ([target] if reads == "output_watched" else []))
        return f(x0)

    plain = step(tf.GradientTape)
    ours = step(lambda: memsave.GradientTape(checkpoints=strategy, fallback=False,
                                             min_checkpoint_size=0))
    assert rewrites
    assert_same(plain, ours, atol=1e-12)


@pytest.mark.parametrize("read", [False, True], ids=["unread", "read_on_the_way"])
@pytest.mark.parametrize("given", [False, True], ids=["ones", "output_gradients"])
@pytest.mark.parametrize("where", ["stop_recording", "unwatched"])
def test_a_target_the_tape_did_not_record_seeds_itself_as_a_source(given, where, read,
                                                                   rewrites):
    """A target the tape does not track (made under stop_recording, or from
    nothing it watched) that is also a source: the plain tape hands it its
    own seed (ones, or its output gradient), d z / d z; memsave gave None
    (found by tests/test_tape_fuzz.py). Unless an op the tape recorded on
    the way to the other targets reads it: then the plain tape drops what
    arrived there, the seed too, and gives None (memsave gave the seed)."""
    ws, x = _variables(4, seed=3, scale=0.3), _input()

    def step(make_tape):
        @tf.function
        def f(x):
            with make_tape() as tape:
                loss = tf.reduce_sum(chain(ws, x) ** 2)
                if where == "stop_recording":
                    with tape.stop_recording():
                        z = tf.tanh(tf.matmul(x, ws[0]))
                else:
                    z = tf.tanh(x * 2.0)
                if read:
                    loss += tf.reduce_sum(z * chain(ws[:1], x))
            seeds = [tf.constant(0.5), tf.fill(z.shape, 3.0), tf.fill(z.shape, 2.0)]
            return tape.gradient([loss, z, z], [ws, z],
                                 output_gradients=seeds if given else None)
        return f(x)

    plain, ours = _both(step)
    assert (plain[1] is None) == read
    assert_same(plain, ours)
    assert rewrites


def test_a_variables_handle_as_a_source_gets_its_gradient(rewrites):
    """``tape.gradient(loss, [v.handle, w])`` in a tf.function: the plain tape
    differentiates the handle's reads; memsave's gave None (a resource tensor
    is not differentiable by its own dtype, but by its variable's)."""
    rng = np.random.RandomState(3)
    v, w = (tf.Variable(rng.randn(6, 6) / 3) for _ in range(2))
    x = tf.constant(rng.randn(4, 6))

    @tf.function
    def step(make):
        with make() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.sin(tf.tanh(x @ v) @ w) @ w) ** 2)
        return tape.gradient(loss, [v.handle, w])

    plain = step(tf.GradientTape)
    ours = step(lambda: memsave.GradientTape(checkpoints="optimal", min_checkpoint_size=0))
    assert all(g is not None for g in ours)
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-10, atol=1e-12)


def test_watch_accessed_variables_false(rewrites):
    ws, x = _variables(6, seed=6), _input()

    def step(make_tape):
        @tf.function
        def f():
            with make_tape(watch_accessed_variables=False) as tape:
                tape.watch(ws[2:])
                loss = tf.reduce_sum(chain(ws, x))
            return tape.gradient(loss, ws)
        return f()

    plain, ours = _both(step)
    assert plain[0] is None and plain[1] is None
    assert_same(plain, ours)


def test_persistent_tape_twice(rewrites):
    ws, x = _variables(8, seed=8), _input()

    def step(make_tape):
        @tf.function
        def f():
            with make_tape(persistent=True) as tape:
                h = chain(ws, x)
                a = tf.reduce_sum(h)
                b = tf.reduce_mean(h * h)
            return tape.gradient(a, ws), tape.gradient(b, ws[::2])
        return f()

    assert_same(*_both(step))
    assert len(rewrites) == 2


def test_higher_order_uses_plain_tape(caplog, rewrites):
    """An outer tape must record the inner gradient: memsave steps aside."""
    ws, x = _variables(4, seed=15), _input()

    def step(make_tape):
        @tf.function
        def f():
            with tf.GradientTape() as outer:
                with make_tape() as inner:
                    loss = tf.reduce_sum(chain(ws, x) ** 2)
                grads = inner.gradient(loss, ws)
                penalty = tf.add_n([tf.reduce_sum(g * g) for g in grads])
            return outer.gradient(penalty, ws)
        return f()

    reset_warnings()
    with caplog.at_level(logging.WARNING, logger="memsave"):
        assert_same(*_both(step), atol=1e-5)
    assert not rewrites
    assert any("another GradientTape" in r.getMessage() for r in caplog.records)


def test_non_persistent_tape_is_used_up():
    ws, x = _variables(4, seed=9), _input()

    @tf.function
    def f():
        with memsave.GradientTape(min_checkpoint_size=0) as tape:
            loss = tf.reduce_sum(chain(ws, x))
        tape.gradient(loss, ws)
        return tape.gradient(loss, ws)

    with pytest.raises(RuntimeError, match="non-persistent"):
        f()


def test_eager_fallback_warns_once(caplog, rewrites):
    ws, x = _variables(4, seed=10), _input()
    reset_warnings()
    results = []
    with caplog.at_level(logging.WARNING, logger="memsave"):
        for _ in range(3):
            with memsave.GradientTape() as tape:
                loss = tf.reduce_sum(chain(ws, x))
            results.append(tape.gradient(loss, ws))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(chain(ws, x))
    plain = tape.gradient(loss, ws)
    assert_same(plain, results[-1])
    warnings = [r for r in caplog.records if "tf.function" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert not rewrites


def test_a_variable_target_in_tf_function_falls_back_saying_why(caplog, rewrites):
    """A tf.Variable target's handle is eager inside tf.function: that is no
    eager execution, and the fallback's warning must not say it is."""
    ws, x = _variables(4, seed=12), _input()
    reset_warnings()

    def step(tape_type):
        @tf.function
        def f():
            with tape_type() as tape:
                loss = tf.reduce_sum(chain(ws, x))
            return tape.gradient([loss, ws[0]], ws)
        return f()

    with caplog.at_level(logging.WARNING, logger="memsave"):
        ours = step(memsave.GradientTape)
    assert_same(step(tf.GradientTape), ours)
    said = [r.getMessage() for r in caplog.records]
    assert any("tf.Variable among its targets" in m for m in said), said
    assert not any("executing eagerly" in m for m in said), said
    assert not rewrites


@tf.RegisterGradient("memsave_test_clipped_tanh")
def _clipped_tanh_gradient(op, grad):
    return tf.clip_by_value(grad, -0.01, 0.01) * (1 - op.outputs[0] ** 2)


def test_a_gradient_override_is_ignored_as_the_tape_ignores_it(caplog, rewrites):
    """tf.GradientTape looks gradients up by op type; tf.gradients applies
    gradient_override_map's: memsave's tape gives the tape's gradients."""
    ws, x = _variables(6, seed=13, scale=0.6), _input()
    reset_warnings()

    def step(tape_type):
        @tf.function
        def f():
            with tape_type() as tape:
                h = chain(ws[:2], x)
                with tf.compat.v1.get_default_graph().gradient_override_map(
                        {"Tanh": "memsave_test_clipped_tanh"}):
                    h = tf.tanh(h @ ws[2])
                loss = tf.reduce_sum(chain(ws[3:], h) ** 2)
            return tape.gradient(loss, ws), tf.gradients(loss, ws)
        return f()

    with caplog.at_level(logging.WARNING, logger="memsave"):
        ours, _ = step(memsave.GradientTape)
    plain, overridden = step(tf.GradientTape)
    assert_same(plain, ours)
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain, overridden)) > 1e-3
    said = [r.getMessage() for r in caplog.records]
    assert any("gradient_override_map" in m for m in said), said
    assert not rewrites


def test_no_bottleneck_raises():
    """Every activation is bypassed by a skip to the output: 'memory' cannot cut."""
    ws, x = _variables(6, seed=11), _input()

    @tf.function
    def f():
        with memsave.GradientTape(checkpoints="memory", min_checkpoint_size=0) as tape:
            h, total = x, 0.0
            for w in ws:
                z = tf.matmul(h, w)
                h = tf.tanh(z)
                total = total + tf.reduce_sum(z) + tf.reduce_sum(h)
        return tape.gradient(total, ws)

    with pytest.raises(memsave.NoBottleneckError):
        f()


def test_patch_tape_routes_plain_tapes_and_unpatch_restores(rewrites):
    original = tf.GradientTape.gradient
    assert original is backprop.GradientTape.__dict__["gradient"]
    originals = {k: backprop.GradientTape.__dict__[k]
                 for k in ("gradient", "jacobian", "batch_jacobian")}
    ws, x = _variables(8, seed=12), _input()

    def step():
        @tf.function
        def f():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(chain(ws, x))
            return tape.gradient(loss, ws)
        return f()

    plain = step()
    assert not rewrites
    with memsave.patch("memory", tape=True, min_checkpoint_size=0):
        assert tf.GradientTape.gradient is not original
        ours = step()
        assert rewrites == ["memory"]
    assert tf.GradientTape.gradient is original
    for name, fn in originals.items():
        assert backprop.GradientTape.__dict__[name] is fn
    assert_same(plain, ours)

    memsave.patch("speed", tape=True)
    memsave.patch("speed")            # tape=False again: tapes are unpatched
    assert tf.GradientTape.gradient is original
    memsave.unpatch()
    memsave.unpatch()
    assert tf.GradientTape.gradient is original
    step()
    assert rewrites == ["memory"]


def test_scope_is_per_block(rewrites):
    original = tf.GradientTape.gradient
    ws, x = _variables(6, seed=13), _input()

    @tf.function
    def f():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(chain(ws, x))
        return tape.gradient(loss, ws)

    with patching.scope("speed"):
        assert tf.GradientTape.gradient is not original
        f()
    assert tf.GradientTape.gradient is original
    assert rewrites == ["speed"]


def test_jacobian_uses_plain_gradient(rewrites):
    w = tf.Variable(np.random.RandomState(14).randn(3, 3).astype(np.float32))

    def step(make_tape):
        @tf.function
        def f():
            with make_tape(persistent=True) as tape:
                y = tf.tanh(tf.matmul(tf.ones([2, 3]), w))
            return tape.jacobian(y, w)
        return f()

    assert_same(*_both(step))
    assert not rewrites


@pytest.mark.parametrize("strategy", ["speed", "optimal"])
def test_variables_read_inside_a_nested_function_call(strategy):
    """Keras runs a grouped Conv2D as a nested tf.function (a call op); the tape
    records that call on the variable's own handle. Its kernel must get a
    gradient, as with the plain tape (it used to be None)."""
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((12, 12, 8)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(16, 3, groups=4, padding="same", activation="relu"),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3),
    ])
    x = tf.constant(np.random.RandomState(0).randn(4, 12, 12, 8).astype(np.float32))
    weights = model.trainable_variables

    def step(make_tape):
        @tf.function
        def f():
            with make_tape() as tape:
                loss = tf.reduce_sum(model(x) ** 2)
            return tape.gradient(loss, weights)
        return f()

    plain = step(lambda: tf.GradientTape())
    ours = step(lambda: memsave.GradientTape(checkpoints=strategy, min_checkpoint_size=0))
    assert all(g is not None for g in plain)
    assert_same(plain, ours, atol=1e-5 * max(float(np.abs(g).max()) for g in plain))


@pytest.mark.parametrize("strategy", ["optimal", "speed"])
def test_a_watched_eager_tensor_passed_to_a_nested_function_call(strategy):
    """An eager tensor the step captures, watched, and passed to a nested
    tf.function: the tape records the call on the eager tensor itself, not on
    the placeholder the step captured for it, so its gradient comes from
    that record, as with the plain tape (it used to be None). Unwatched, it
    gets None from both."""
    rng = np.random.RandomState(0)
    w = tf.Variable(rng.randn(8, 8))
    x = tf.constant(rng.randn(4, 8))   # eager: the step captures it
    c = tf.constant(rng.randn(4, 8))   # captured too, never watched

    @tf.function
    def layer(h):
        return tf.tanh(tf.matmul(h, w))

    def grads(tape):
        with tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(layer(layer(x) + layer(c))) ** 2)
        return tape.gradient(loss, [w, x, c])

    @tf.function
    def step():
        return grads(tf.GradientTape()), grads(memsave.GradientTape(checkpoints=strategy))

    plain, ours = step()
    assert [g is None for g in plain] == [False, False, True]
    assert_same(plain, ours, atol=1e-12)


@pytest.mark.parametrize("strategy", ["optimal", "memory"])
def test_a_complex_target_without_output_gradients(strategy):
    """The tape seeds a complex target with ones, as for a real one, where
    tf.gradients refuses a complex y without grad_ys: memsave's tape must
    give the tape's gradients (it raised TensorFlow's TypeError)."""
    rng = np.random.RandomState(0)

    def complex_normal(*shape):
        return ((rng.randn(*shape) + 1j * rng.randn(*shape)) * 0.3).astype(np.complex128)
    ws = [tf.Variable(complex_normal(8, 8)) for _ in range(5)]
    x = tf.constant(complex_normal(4, 8))

    def grads(tape):
        with tape:
            h = x
            for w in ws:
                h = tf.sin(tf.matmul(h, w))
        return tape.gradient(h, ws)

    @tf.function
    def step():
        return grads(tf.GradientTape()), grads(memsave.GradientTape(
            checkpoints=strategy, min_checkpoint_size=0, fallback=False))

    plain, ours = step()
    assert all(np.isfinite(g.numpy()).all() for g in plain)
    assert_same(plain, ours, atol=1e-12)


@pytest.mark.parametrize("strategy", ["optimal", "speed"])
def test_a_watched_tensor_the_tape_did_not_record_is_a_leaf(strategy):
    """Made under stop_recording() then watched: the plain tape stops there,
    so memsave must not backpropagate through its unrecorded producer."""
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(4, 8))
    w1 = tf.Variable(rng.randn(8, 8))
    w2 = tf.Variable(rng.randn(8, 8))

    def grads(tape):
        with tape:
            a = tf.matmul(x, w1)
            with tape.stop_recording():
                h = tf.tanh(a)
            tape.watch(h)
            loss = tf.reduce_sum(tf.tanh(tf.matmul(h, w2)) ** 2) + tf.reduce_sum(tf.sin(a))
        return tape.gradient(loss, [w1, w2, h])   # the leaf is a source too

    @tf.function
    def step():
        return grads(tf.GradientTape()), grads(memsave.GradientTape(
            checkpoints=strategy, min_checkpoint_size=0))

    plain, ours = step()
    assert_same(plain, ours, atol=1e-12)


@pytest.mark.parametrize("strategy", ["optimal", "speed"])
def test_a_tensor_only_a_tape_around_it_recorded_is_a_leaf(strategy, rewrites):
    """h = tanh(x) made under an outer tape before this tape began, then watched
    by it: the outer tape tracks h, this one does not, so h is a leaf for it
    (the plain tape's dl/dx is 2x; backprop through tanh was 0.17 of the
    largest entry off, and a loss of h alone gave x a gradient, not None)."""
    x0 = tf.constant(np.random.RandomState(0).randn(4, 3))

    def grads(tape):
        x = x0 * 1.0
        with tf.GradientTape() as outer:
            outer.watch(x)
            h = tf.tanh(x)
            with tape:
                tape.watch(x)
                tape.watch(h)
                both = tf.reduce_sum(h ** 3) + tf.reduce_sum(x ** 2)
                through_h = tf.reduce_sum(h ** 3)
        del outer
        return tape.gradient([both], [x, h]), tape.gradient(through_h, x)

    @tf.function
    def step():
        return (grads(tf.GradientTape(persistent=True)),
                grads(memsave.GradientTape(persistent=True, checkpoints=strategy,
                                           min_checkpoint_size=0, fallback=False)))

    (plain, plain_none), (ours, ours_none) = step()
    assert plain_none is None and ours_none is None
    assert_same(plain, ours, atol=1e-12)
    np.testing.assert_allclose(ours[0], 2 * x0.numpy(), atol=1e-12)
    assert rewrites   # the rewrite ran, it did not fall back


@pytest.mark.parametrize("where", ["stop_recording", "after_with"])
@pytest.mark.parametrize("persistent", [False, True])
def test_watching_a_tensor_the_tape_recorded_changes_nothing(where, persistent):
    """tape.watch(h) on a tensor this tape recorded, while it is off the tape
    stack (in its stop_recording(), or after its with block): the plain tape's
    watch changes nothing; memsave took h for a leaf (0.24 of the largest
    entry off; None where w reaches the loss only through h)."""
    if where == "after_with" and not persistent:
        pytest.skip("a non-persistent tape's gradient() is its last call")
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(4, 3))
    w = tf.Variable(rng.randn(3, 3))

    def grads(tape):
        with tape:
            h = tf.tanh(tf.matmul(x, w))
            if where == "stop_recording":
                with tape.stop_recording():
                    tape.watch(h)
            loss = tf.reduce_sum(h ** 2) + tf.reduce_sum(tf.matmul(x, w))
            only_h = tf.reduce_sum(h ** 2)
        if where == "after_with":
            tape.watch(h)
        return tape.gradient([loss, only_h] if not persistent else loss, w), (
            tape.gradient(only_h, w) if persistent else None)

    @tf.function
    def step():
        return (grads(tf.GradientTape(persistent=persistent)),
                grads(memsave.GradientTape(persistent=persistent, min_checkpoint_size=0)))

    plain, ours = step()
    assert_same([g for g in plain if g is not None], [g for g in ours if g is not None],
                atol=1e-12)
    assert [g is None for g in plain] == [g is None for g in ours]


def test_a_tensor_watched_while_other_tapes_track_it_uses_the_plain_tape(caplog, rewrites):
    """Two tapes around (a persistent one counts as two) both track h: whether
    this tape does cannot be asked, so the plain tape answers, saying why."""
    reset_warnings()
    x0 = tf.constant(np.random.RandomState(0).randn(4, 3))

    def grads(tape):
        x = x0 * 1.0
        with tf.GradientTape(persistent=True) as outer:
            outer.watch(x)
            h = tf.tanh(x)
            with tape:
                tape.watch(x)
                tape.watch(h)
                loss = tf.reduce_sum(h ** 3) + tf.reduce_sum(x ** 2)
        del outer
        return tape.gradient(loss, x)

    @tf.function
    def step():
        return grads(tf.GradientTape()), grads(memsave.GradientTape(fallback=False))

    with caplog.at_level(logging.WARNING, logger="memsave"):
        plain, ours = step()
    assert_same([plain], [ours], atol=1e-12)
    assert any("cannot tell whether it is a leaf" in r.getMessage() for r in caplog.records)
    assert not rewrites


def test_a_routed_plain_tape_knows_its_leaves_too():
    rng = np.random.RandomState(1)
    x = tf.constant(rng.randn(4, 8))
    w1 = tf.Variable(rng.randn(8, 8))
    w2 = tf.Variable(rng.randn(8, 8))

    def grads():
        with tf.GradientTape() as tape:
            a = tf.matmul(x, w1)
            with tape.stop_recording():
                h = tf.tanh(a)
            tape.watch(h)
            loss = tf.reduce_sum(tf.tanh(tf.matmul(h, w2)) ** 2) + tf.reduce_sum(tf.sin(a))
        return tape.gradient(loss, [w1, w2])

    plain = tf.function(grads)()
    with memsave.patch("optimal", tape=True, min_checkpoint_size=0):
        ours = tf.function(grads)()
    assert_same(plain, ours, atol=1e-12)
