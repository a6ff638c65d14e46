"""memsave.patch routes TensorFlow's gradient functions through memsave."""

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gradients as gradients_module
from tensorflow.python.ops import gradients_impl

import memsave
from memsave.patching import call_count
from memsave.profile import peak_memory, session_step
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
    before = call_count()
    with memsave.patch("memory"):
        ours = _minimize_peak()
    assert call_count() > before
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
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        ws = [tf.Variable(rng.randn(8, 8).astype(np.float32) * 0.3) for _ in range(12)]
        h = tf.constant(rng.randn(4, 8).astype(np.float32))
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h)
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
