"""memsave.patch routes TensorFlow's gradient functions through memsave, and nests."""

import threading

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import backprop
from tensorflow.python.ops import gradients as gradients_module
from tensorflow.python.ops import gradients_impl

import memsave
from memsave import api, patching
from memsave.profile import peak_memory, session_step
from tests.builders import tanh_chain
from tests.test_memory import ACTIVATION, _chain

POINTS = [
    (tf, "gradients"), (tf.compat.v1, "gradients"), (gradients_impl, "gradients"),
    (gradients_impl, "gradients_v2"), (gradients_module, "gradients"),
]


def _minimize_peak():
    graph = tf.Graph()
    with graph.as_default():
        loss, _ = _chain(60)
        train = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return peak_memory(session_step(sess, train)) / ACTIVATION


def test_optimizer_minimize_uses_memsave():
    plain = _minimize_peak()
    with memsave.patch("memory"):
        ours = _minimize_peak()
    print("\nGradientDescentOptimizer.minimize, 60-layer chain: plain %.1f, patched %.1f activations"
          % (plain, ours))
    assert ours < plain / 2


def test_unpatch_restores_originals():
    originals = [getattr(m, a) for m, a in POINTS]
    memsave.patch("speed")
    assert all(getattr(m, a) is not o for (m, a), o in zip(POINTS, originals))
    memsave.patch("memory")  # patching twice keeps the true originals
    memsave.unpatch()
    assert all(getattr(m, a) is o for (m, a), o in zip(POINTS, originals))
    memsave.unpatch()  # harmless
    assert all(getattr(m, a) is o for (m, a), o in zip(POINTS, originals))


def test_patched_tf_gradients_matches_plain():
    graph, _, ws, _, loss = tanh_chain(12, scale=0.3, square=False)
    with graph.as_default():
        plain = tf.gradients(loss, ws)
        with memsave.patch("memory", min_checkpoint_size=0):
            v2 = tf.gradients(loss, ws)
            v1 = tf.compat.v1.gradients(loss, ws, None, "grads", False)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b, c = sess.run([plain, v2, v1])
    for p, q, r in zip(a, b, c):
        np.testing.assert_allclose(p, q, atol=1e-6)
        np.testing.assert_allclose(p, r, atol=1e-6)


@pytest.mark.heavy
def test_import_patches_nothing():
    """A fresh interpreter: importing memsave leaves TF and Python settings alone."""
    import subprocess
    import sys
    code = (
        "import sys, tensorflow as tf\n"
        "from tensorflow.python.ops import gradients as gm, gradients_impl as gi\n"
        "from tensorflow.python.eager import backprop\n"
        "points = lambda: [tf.gradients, tf.compat.v1.gradients, gi.gradients, gi.gradients_v2,"
        " gm.gradients, backprop.GradientTape.gradient]\n"
        "before, limit = points(), sys.getrecursionlimit()\n"
        "g = tf.Graph()\n"
        "import memsave\n"
        "assert all(a is b for a, b in zip(points(), before)), 'import patched something'\n"
        "assert sys.getrecursionlimit() == limit\n"
        "assert g.get_all_collection_keys() == []\n"
        "print('clean')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "clean" in out.stdout


# ------------------------------------------------------------------ nesting

TAPE_POINTS = ("gradient", "jacobian", "batch_jacobian")


@pytest.fixture(autouse=True)
def _unpatched_after():
    """A failing test must not leave TensorFlow patched for the next one."""
    yield
    memsave.unpatch()


@pytest.fixture
def rewrites(monkeypatch):
    """The checkpoints and min_checkpoint_size of each differentiation memsave makes."""
    calls = []
    original = api.differentiate

    def recording(ys, xs, grad_ys, settings, **kwargs):
        calls.append((settings.checkpoints.given, settings.min_checkpoint_size))
        return original(ys, xs, grad_ys, settings, **kwargs)

    monkeypatch.setattr(api, "differentiate", recording)
    return calls


def _points():
    return [getattr(m, a) for m, a in POINTS]


def _tape_points():
    return [backprop.GradientTape.__dict__[name] for name in TAPE_POINTS]


def _same(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _small_graph():
    graph, _, ws, _, loss = tanh_chain(6, scale=0.3, square=False)
    return graph, loss, ws


def _tape_step(ws):
    """A fresh tf.function (so it traces now) taking a plain tf.GradientTape's gradient."""
    @tf.function
    def f():
        h = tf.ones([4, 8])
        with tf.GradientTape() as tape:
            for w in ws:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(h)
        return tape.gradient(loss, ws)
    return f()


def test_nested_blocks_restore_the_outer_level(rewrites):
    originals = _points()
    graph, loss, ws = _small_graph()
    with graph.as_default():
        with memsave.patch("memory", min_checkpoint_size=0):
            outer = _points()
            tf.gradients(loss, ws)
            with memsave.patch("speed"):
                tf.gradients(loss, ws)
                assert patching.current().settings.checkpoints.given == "speed"
            assert _same(_points(), outer)
            assert patching.current().settings.checkpoints.given == "memory"
            tf.gradients(loss, ws)
        assert tf.gradients is originals[0]
        assert _same(_points(), originals)
        assert patching.current() is None
        tf.gradients(loss, ws)   # plain again: not recorded
    assert rewrites == [("memory", 0), ("speed", 1024), ("memory", 0)]   # no options leak in


def test_tape_routing_nests_both_ways(rewrites):
    originals = _tape_points()
    ws = [tf.Variable(np.random.RandomState(i).randn(8, 8).astype(np.float32) * 0.3)
          for i in range(4)]
    with memsave.patch("memory"):
        assert _same(_tape_points(), originals)
        with memsave.patch("speed", tape=True, min_checkpoint_size=0):
            assert tf.GradientTape.gradient is not originals[0]
            _tape_step(ws)
        assert _same(_tape_points(), originals)
        _tape_step(ws)
    assert rewrites == [("speed", 0)]

    with memsave.patch("speed", tape=True, min_checkpoint_size=0):
        with memsave.patch("memory"):
            assert _same(_tape_points(), originals)
            _tape_step(ws)
        assert tf.GradientTape.gradient is not originals[0]
        assert patching.active_settings().min_checkpoint_size == 0
        _tape_step(ws)
    assert _same(_tape_points(), originals)
    assert rewrites == [("speed", 0), ("speed", 0)]


def test_an_exception_in_the_inner_block_still_pops():
    originals, tape_originals = _points(), _tape_points()
    with memsave.patch("memory"):
        outer = _points()
        with pytest.raises(KeyError):
            with memsave.patch("speed", tape=True):
                raise KeyError("inner")
        assert patching.current().settings.checkpoints.given == "memory"
        assert _same(_points(), outer)
        assert _same(_tape_points(), tape_originals)
    assert _same(_points(), originals)


def test_unpatch_inside_nested_blocks():
    originals, tape_originals = _points(), _tape_points()
    with memsave.patch("memory"):
        with memsave.patch("speed", tape=True):
            memsave.unpatch()
            assert _same(_points(), originals)
            assert _same(_tape_points(), tape_originals)
            memsave.unpatch()
        assert patching.current() is None
    assert _same(_points(), originals)
    assert _same(_tape_points(), tape_originals)


def test_a_bare_patch_pushes_a_level_that_stays_until_unpatch():
    originals = _points()
    with memsave.patch("memory"):
        memsave.patch("speed")
        assert patching.current().settings.checkpoints.given == "speed"
    assert patching.current().settings.checkpoints.given == "speed"   # the block removed only its own level
    memsave.unpatch()
    assert _same(_points(), originals)


def test_a_wrapper_kept_past_unpatch_is_plain(rewrites):
    graph, loss, ws = _small_graph()
    with memsave.patch("speed"):
        kept = tf.gradients
    with graph.as_default():
        grads = kept(loss, ws)
    assert len(grads) == len(ws) and not rewrites


def test_threads_pushing_and_popping_leave_the_originals():
    originals, tape_originals = _points(), _tape_points()
    errors = []

    def work(seed):
        try:
            for i in range(40):
                with memsave.patch("speed" if (seed + i) % 2 else "memory", tape=bool(i % 3)):
                    with memsave.patch("optimal"):
                        assert tf.gradients is not originals[0]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert patching.current() is None
    assert _same(_points(), originals)
    assert _same(_tape_points(), tape_originals)


@pytest.mark.parametrize("how", ["patch", "scope"])
@pytest.mark.parametrize("checkpoints", ["optimal", "speed", "memory"])
def test_recompute_grad_under_a_patched_tape(checkpoints, how):
    """tf.recompute_grad's gradient function takes a tape's gradient itself;
    under a patched tape that call reaches memsave while memsave is rewriting
    the enclosing backward pass. It gets plain tf.gradients there (a rewrite
    of its own interleaved its fences with the enclosing ones, and the audit
    refused the step)."""
    rng = np.random.RandomState(3)
    w1, w2 = tf.Variable(rng.randn(6, 6) * 0.4), tf.Variable(rng.randn(6, 6) * 0.4)
    x = tf.constant(rng.randn(4, 6))

    def deep(h, w, n):
        for _ in range(n):
            h = tf.tanh(tf.matmul(h, w)) + 0.2 * h
        return h

    block = tf.recompute_grad(lambda a: deep(a, w2, 2))

    def step():
        with tf.GradientTape() as tape:
            h = deep(x, w1, 3)
            h = block(h) * h
            loss = tf.reduce_sum(deep(h, w1, 3) ** 2)
        return tape.gradient(loss, [w1, w2])

    plain = [g.numpy() for g in tf.function(step)()]
    options = dict(fallback=False, min_checkpoint_size=0)
    if how == "patch":
        with memsave.patch(checkpoints, tape=True, **options):
            ours = tf.function(step)()
    else:
        def scoped():
            with memsave.patching.scope(checkpoints, **options):
                return step()
        ours = tf.function(scoped)()
    scale = max(np.abs(a).max() for a in plain)
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(b.numpy(), a, rtol=0, atol=1e-12 * scale)


def _two_device_chain():
    """A Graph whose first four layers ask for CPU:0 and last four for CPU:1
    (placement happens at run time: no such device is needed to build it)."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        h = tf.constant(rng.randn(8, 16))
        ws = []
        for i in range(8):
            with tf.device("/device:CPU:%d" % (i // 4)), tf.name_scope("layer%d" % i):
                ws.append(tf.Variable(rng.randn(16, 16) * 0.3))
                h = tf.tanh(tf.matmul(h, ws[-1]))
        loss = tf.reduce_sum(h * h)
    return graph, loss, ws


def _misplaced_gradient_ops(graph):
    """Gradient ops of a layer's forward ops whose device is not that layer's."""
    wrong = []
    for op in graph.get_operations():
        if "_grad/" not in op.name:
            continue
        for i in range(8):
            if "layer%d/" % i in op.name and "CPU:%d" % (i // 4) not in op.device:
                wrong.append((op.name, op.device))
    return wrong


@pytest.mark.parametrize("entry", ["memsave.gradients", "patched tf.gradients"])
def test_gradient_ops_are_colocated_with_their_forward_ops(entry):
    # TF2's tf.gradients always colocates; memsave did not, so the backward
    # ops of layers under tf.device('/CPU:1') ran on CPU:0 (values unchanged,
    # placement and memory wrong).
    graph, loss, ws = _two_device_chain()
    with graph.as_default():
        if entry == "memsave.gradients":
            grads = memsave.gradients(loss, ws, checkpoints="memory", min_checkpoint_size=0,
                                      fallback=False)
        else:
            with memsave.patch("memory", min_checkpoint_size=0, fallback=False):
                grads = tf.gradients(loss, ws)
    assert all(g is not None for g in grads)
    assert any(op.name.startswith("memsave") for op in graph.get_operations())
    assert not _misplaced_gradient_ops(graph)


def test_colocation_can_be_turned_off_as_in_tf_compat_v1():
    graph, loss, ws = _two_device_chain()
    with graph.as_default():
        memsave.gradients(loss, ws, checkpoints="memory", min_checkpoint_size=0,
                          fallback=False, colocate_gradients_with_ops=False)
    assert _misplaced_gradient_ops(graph)
