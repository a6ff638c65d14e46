"""Variable updates in the same tf.function step must not leak into recomputation.

Regression: memsave used to re-read weights in the backward pass; with the
update ops in the same step (IdentityN over the gradients, learning rate in a
variable, as Keras does) Grappler could order an update before a re-read,
and lower layers got gradients computed with new weights.
"""

import numpy as np
import tensorflow as tf

import memsave


def test_updates_in_the_same_step_do_not_change_gradients():
    rng = np.random.RandomState(0)
    dims = [32, 64, 64, 64, 1]
    ws = [tf.Variable((rng.randn(a, b) / np.sqrt(a)).astype(np.float32))
          for a, b in zip(dims[:-1], dims[1:])]
    bs = [tf.Variable(np.zeros(b, np.float32)) for b in dims[1:]]
    x = tf.constant(rng.randn(16, 32).astype(np.float32))
    y = tf.constant(rng.randn(16, 1).astype(np.float32))
    lr = tf.Variable(0.05)
    params = [p for pair in zip(ws, bs) for p in pair]
    init = [p.numpy() for p in params]

    def make(grad_fn):
        @tf.function
        def step():
            h = x
            for i, (w, b) in enumerate(zip(ws, bs)):
                h = tf.nn.bias_add(h @ w, b)
                if i < len(ws) - 1:
                    h = tf.tanh(h)
            grads = grad_fn(tf.reduce_mean((h - y) ** 2), params)
            for g, p in zip(tf.identity_n(grads), params):
                p.assign_sub(g * lr)
            return grads
        return step

    def run(fn):
        for p, v in zip(params, init):
            p.assign(v)
        return [t.numpy() for t in make(fn)()]

    plain = run(tf.gradients)
    ours = run(lambda loss, xs: memsave.gradients(loss, xs, checkpoints="memory",
                                                  min_checkpoint_size=0))
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_strategy_errors_keep_their_type_through_tf_function():
    v = tf.Variable(np.ones([64, 64], np.float32))

    @tf.function
    def step():
        loss = tf.reduce_sum(tf.tanh(v)) + tf.reduce_sum(tf.sigmoid(v))
        return memsave.gradients(loss, [v], checkpoints="memory")

    try:
        step()
    except memsave.NoBottleneckError as e:
        assert "checkpoints='speed'" in str(e)
    else:
        raise AssertionError("NoBottleneckError was not raised")
