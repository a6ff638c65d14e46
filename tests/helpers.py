"""Run plain tf.gradients and memsave on the same forward graph and compare."""

import numpy as np
import tensorflow as tf

import memsave


def _dense(g):
    if isinstance(g, tf.IndexedSlices):
        return tf.convert_to_tensor(g)
    return g


def _grads(model_out, strategy, memsave_kwargs=None, **kwargs):
    ys, xs, grad_ys = model_out["ys"], model_out["xs"], model_out.get("grad_ys")
    if strategy == "list":
        checkpoints = model_out["tag"]
    else:
        checkpoints = strategy
        if strategy == "collection":
            for t in model_out["tag"]:
                tf.compat.v1.add_to_collection("checkpoints", t)
    plain = tf.gradients(ys, xs, grad_ys, **kwargs)
    memsave_kwargs = dict(memsave_kwargs or {})
    if memsave_kwargs.get("budget") == "midway":
        # Halfway between the lowest estimate and plain's: a budget that binds
        # and fits, whatever share of the peak the weight gradients take.
        lowest = memsave.plan(ys, xs, checkpoints="optimal")
        memsave_kwargs["budget"] = (lowest.estimated_peak_bytes + lowest.plain_peak_bytes) // 2
    # Test tensors are tiny; let 'memory' consider all of them.
    ours = memsave.gradients(ys, xs, grad_ys, checkpoints=checkpoints, min_checkpoint_size=0,
                             **memsave_kwargs, **kwargs)
    return plain, ours


def _pack(plain, ours):
    pattern = ([g is None for g in plain], [g is None for g in ours])
    fetch = [(_dense(a), _dense(b)) for a, b in zip(plain, ours) if a is not None and b is not None]
    return pattern, fetch


def run_session(model, strategy, **kwargs):
    """(None pattern of plain, of memsave, list of (plain, memsave) arrays) in a Session."""
    graph = tf.Graph()
    with graph.as_default():
        vs = model.variables()
        out = model.forward(vs)
        plain, ours = _grads(out, strategy, **kwargs)
        pattern, fetch = _pack(plain, ours)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            values = sess.run(fetch)
    return pattern, values


def run_function(model, strategy, **kwargs):
    """The same, with everything traced inside one tf.function."""
    vs = model.variables()
    holder = {}

    @tf.function
    def step():
        out = model.forward(vs)
        plain, ours = _grads(out, strategy, **kwargs)
        holder["pattern"], fetch = _pack(plain, ours)
        return fetch

    values = [(a.numpy(), b.numpy()) for a, b in step()]
    return holder["pattern"], values


def assert_same_as_plain(graph, loss, ws, grads):
    """``grads`` (memsave's, already built in ``graph``) equal plain tf.gradients."""
    with graph.as_default():
        plain = tf.gradients(loss, ws)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            ours, theirs = sess.run([grads, plain])
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def assert_same(pattern, values, atol=1e-6):
    assert pattern[0] == pattern[1], "None pattern differs: plain %s, memsave %s" % pattern
    assert values, "nothing was compared"
    worst = max(float(np.max(np.abs(a - b))) for a, b in values)
    assert worst <= atol, "max abs difference %.3g > %.1g" % (worst, atol)
    return worst


def run_budgeted(runner, model, budget="midway"):
    """``runner`` (run_session or run_function) with 'optimal' and a budget
    (bytes, a fraction of plain's estimate, or 'midway': see ``_grads``)."""
    return runner(model, "optimal", memsave_kwargs={"budget": budget})
