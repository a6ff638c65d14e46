"""The recompute estimate counts what the rewrite really runs.

The rewrite copies, for each segment, everything below its kept tensors
down to the next kept ones; a tensor below kept tensors of several segments
is copied (and recomputed) once per segment. Keeping only the matmul outputs
of a residual network recomputes the residual stream from the input in
every segment. The estimate must count those copies, 'speed' must not make
them, and a recompute cap must hold on the copies the rewrite makes.
"""

import collections
import importlib
import re

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave import tf_internal
from memsave.graph.region import BYTE_COST, GROUPED_CONV_ON_CPU, cost_parts, op_cost
from memsave.planning import simulate
from memsave.planning.strategies import step_work
from tests import builders

# What the rewrite adds around copies: gates, and the NoOps copies wait through.
_INSERTED = re.compile(r"/memsave_(gate|wait)(_\d+)?$")

optimal_module = importlib.import_module("memsave.planning.optimal")


def _copies(graph):
    """{original op name: number of copies} made by memsave's rewrite."""
    out = collections.Counter()
    for op in graph.get_operations():
        m = re.match(r"memsave_\d+/(.*)", op.name)
        if m and "/gradients" not in op.name and not _INSERTED.search(op.name):
            out[m.group(1)] += 1
    return out


def _run(chain, strategy):
    with chain.graph.as_default():
        grads = memsave.gradients(chain.loss, chain.ws, checkpoints=strategy)
        plain = tf.gradients(chain.loss, chain.ws)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, want = sess.run([grads, plain])
    for g, p in zip(got, want):
        np.testing.assert_allclose(g, p, rtol=1e-5, atol=1e-5 * np.abs(p).max())


def test_segments_model_the_copies_the_rewrite_makes():
    """Per op, the model's copies equal the rewrite's, and the recompute
    estimate counts every one of them."""
    chain = builders.tanh_chain(n=5, residual=True)
    matmuls = [t.name for t in chain.hs]
    seen = {}

    def matmul_outputs(graph):
        p = simulate.prepare(graph)
        segments = simulate.rewrite_segments(p, simulate.kept_indices(p, matmuls))
        # Variable reads are never copied: they alias the variable.
        seen["counts"] = collections.Counter(p.names[n].split(":")[0]
                                             for members in segments for n in members
                                             if n not in p.aliases)
        seen["cost"] = simulate.recompute_cost(graph, matmuls, p)
        seen["once"] = sum(d["cost"] for n, d in graph.nodes(data=True)
                           if not d["x"] and n not in matmuls and not d["forced"]
                           and not d["input_read"])
        return matmuls

    _run(chain, matmul_outputs)
    made = _copies(chain.graph)
    assert dict(made) == dict(seen["counts"])
    # The first layer's residual add sits below the four later matmuls'
    # segments and the ys' segment.
    first_add = chain.hs[1].op.inputs[0].op.name
    assert made[first_add] == 5
    assert seen["cost"] > 1.5 * seen["once"]   # the residual stream, again and again


def test_speed_recomputes_nothing_twice():
    chain = builders.tanh_chain(n=6, residual=True)
    _run(chain, "speed")
    made = _copies(chain.graph)
    assert made and max(made.values()) == 1, made


def test_recompute_cap_holds_on_the_copies_made():
    """Under max_recompute, the copies the step runs (those its gradients need,
    through data and control inputs) cost at most the cap, counting each copy.
    (Under a cap of 0.07 the plan here recomputes nothing: none under it is
    estimated lower than the one that keeps every candidate.)"""
    chain = builders.tanh_chain(n=6, batch=64, width=64, residual=True)
    box = {}

    def capped(graph):
        plan = optimal_module.optimal(graph, max_recompute=0.2)
        box.update(graph=graph, plan=plan, step=step_work(graph))
        return plan.checkpoints

    with chain.graph.as_default():
        grads = memsave.gradients(chain.loss, chain.ws, checkpoints=capped)
    graph, plan = box["graph"], box["plan"]
    assert 0 < plan.recompute_fraction <= 0.2 + 1e-9, plan.summary()
    cost = {n.split(":")[0]: d["cost"] for n, d in graph.nodes(data=True)}
    ran = sum(cost[n] * c for n, c in _copies_that_run(grads).items())
    assert 0 < ran <= 0.2 * box["step"] * 1.001, (ran, box["step"])
    _run(chain, capped)


def test_elementwise_cost_counts_bytes_moved():
    """An elementwise op moves bytes: it costs more than one FLOP per element,
    and a byte costs it more than a matmul (whose FLOPs hide its traffic);
    softmax more still."""
    with tf.Graph().as_default():
        a = tf.zeros([1000])
        b = tf.zeros([1000])
        add = a + b
        mm = tf.matmul(tf.zeros([100, 50]), tf.zeros([50, 20]))
        soft = tf.nn.softmax(b)
    assert op_cost(add.op) == 1000 + BYTE_COST["other"] * 3 * 4000
    assert op_cost(mm.op) == 2 * 100 * 20 * 50 + BYTE_COST["dense"] * 4 * (5000 + 1000 + 2000)
    assert op_cost(soft.op) == 1000 + BYTE_COST["softmax"] * 2 * 4000
    assert BYTE_COST["softmax"] > BYTE_COST["other"] > BYTE_COST["dense"]


def test_a_reshape_costs_nothing_and_a_call_costs_its_body():
    """A reshape's output is its input's buffer: recomputing it moves nothing.
    A function call (Keras runs grouped convolutions as XLA-compiled calls)
    costs the ops it runs, not one FLOP per output element."""
    @tf.function(jit_compile=True)
    def depthwise(x, w):
        return tf.nn.depthwise_conv2d(x, w, [1, 1, 1, 1], "SAME")

    @tf.function
    def step(x, w):
        return tf.reshape(depthwise(x, w), [-1])

    graph = step.get_concrete_function(tf.TensorSpec([2, 8, 8, 4]),
                                       tf.TensorSpec([7, 7, 4, 1])).graph
    ops = {op.type: op for op in graph.get_operations()}
    call = ops.get("StatefulPartitionedCall", ops.get("PartitionedCall"))
    assert op_cost(ops["Reshape"]) == 0
    inner = next(op for op in tf_internal.called_graph(call).get_operations()
                 if op.type == "DepthwiseConv2dNative")
    assert op_cost(call) == op_cost(inner) > 2 * (2 * 8 * 8 * 4) * 49


def test_a_grouped_convolution_on_a_cpu_costs_its_measured_rate():
    """TensorFlow's CPU kernels cannot group, so Keras compiles grouped
    convolutions with XLA, whose CPU convolution runs them at about 1 GFLOP/s:
    their FLOPs cost GROUPED_CONV_ON_CPU each there, a dense convolution's
    (and one on a GPU) one."""
    @tf.function(jit_compile=True)
    def grouped(x, w):
        return tf.nn.conv2d(x, w, 1, "SAME")

    @tf.function
    def step(x, w, dense):
        return grouped(x, w), tf.nn.conv2d(x, dense, 1, "SAME")

    graph = step.get_concrete_function(tf.TensorSpec([2, 8, 8, 8]), tf.TensorSpec([3, 3, 2, 8]),
                                       tf.TensorSpec([3, 3, 8, 8])).graph
    call = next(op for op in graph.get_operations() if tf_internal.called_graph(op) is not None)
    inner = next(op for op in tf_internal.called_graph(call).get_operations()
                 if op.type == "Conv2D")
    dense = next(op for op in graph.get_operations() if op.type == "Conv2D")
    flops = 2.0 * (2 * 8 * 8 * 8) * (3 * 3 * 2)
    moved = BYTE_COST["dense"] * 4 * (2 * 8 * 8 * 8 * 2 + 3 * 3 * 2 * 8)
    on_gpu = cost_parts(inner, device="/device:GPU:0")
    assert on_gpu == (flops, {"dense": moved / BYTE_COST["dense"]})
    if not tf.config.list_physical_devices("GPU"):
        assert op_cost(call) == GROUPED_CONV_ON_CPU * flops + moved
    assert cost_parts(dense)[0] == 2.0 * (2 * 8 * 8 * 8) * (3 * 3 * 8)


def _saved(ys, xs):
    from memsave.graph.region import analyze, to_plan_graph  # pylint: disable=C0415
    graph = to_plan_graph(analyze(ys, [w.handle for w in xs]))
    return {n.rsplit(":", 1)[0] for n, d in graph.nodes(data=True) if d["saved"]}


def test_gradients_no_input_needs_read_nothing():
    """What only the gradient of a constant or of data would read is not kept:
    the step prunes that gradient (``0.5 * h`` keeps nothing, ``h ** 3``
    not its output, ``data @ w`` only ``data``, which is no region tensor)."""
    with tf.Graph().as_default():
        data = tf.constant(np.ones((4, 8), np.float32), name="data")
        w = tf.Variable(np.ones((8, 8), np.float32))
        first = tf.matmul(data, w, name="first")         # dW reads data; no d(data)
        half = tf.multiply(0.5, first, name="half")      # d(first) reads the constant only
        cube = tf.pow(half, 3.0, name="cube")            # d(half) reads half and 3, not cube
        act = tf.tanh(cube, name="act")                  # reads its output
        loss = tf.reduce_sum(act * half)                 # both factors need gradients
        saved = _saved([loss], [w])
    assert {n for n in saved if not n.startswith("Variable")} == {"half", "act"}, saved


def test_gelu_keeps_no_power_nor_constant_products():
    """tf.nn.gelu(approximate=True) (Keras' and BERT's GELU): x ** 3 and the
    products with constants keep nothing (see tests/test_memory.py for the
    measured peak)."""
    chain = builders.tanh_chain(4, batch=256, width=64, scale=1 / 8, square=False,
                                activation=builders.gelu)
    graph = chain.graph
    with graph.as_default():
        saved = _saved([chain.loss], chain.ws)
    kinds = collections.Counter(graph.get_operation_by_name(n).type for n in saved
                                if not n.endswith("ReadVariableOp"))
    # Per layer tanh's output is kept, x ** 3 is not (nor is x scaled by a
    # constant; tests/test_memory.py measures what that does to the peak).
    assert kinds["Pow"] == 0, kinds
    assert kinds["Tanh"] == 4, kinds


def test_einsum_cost_counts_the_contracted_axes():
    """An einsum's FLOPs are 2 x output elements x its contracted axes
    (attention scores 'bqhd,bkhd->bhqk' multiply over d), not one per element."""
    with tf.Graph().as_default():
        q, k = tf.zeros([2, 16, 4, 8]), tf.zeros([2, 32, 4, 8])
        scores = tf.einsum("bqhd,bkhd->bhqk", q, k)
        proj = tf.einsum("...c,cd->...d", tf.zeros([2, 16, 24]), tf.zeros([24, 10]))
        outer = tf.einsum("i,j->ij", tf.zeros([5]), tf.zeros([7]))
    byte = BYTE_COST["dense"]
    moved = byte * 4 * (2 * 16 * 4 * 8 + 2 * 32 * 4 * 8 + 2 * 4 * 16 * 32)
    assert op_cost(scores.op) == 2 * (2 * 4 * 16 * 32) * 8 + moved
    assert op_cost(proj.op) == 2 * (2 * 16 * 10) * 24 + byte * 4 * (
        2 * 16 * 24 + 24 * 10 + 2 * 16 * 10)
    assert op_cost(outer.op) == 2 * 35 + byte * 4 * (5 + 7 + 35)


def _attention(seq=64, width=32, heads=2, layers=2):
    """Two pre-LN self-attention blocks (einsum scores, softmax, GELU MLP)
    in a tf.Graph: ``(graph, loss, weights)``."""
    rng = np.random.RandomState(0)
    graph = tf.Graph()
    with graph.as_default():
        h = tf.constant(rng.randn(2, seq, width).astype(np.float32), name="x")
        weights = []
        for i in range(layers):
            wq, wk, wv, w1, w2 = [
                tf.Variable(rng.randn(*s).astype(np.float32) * 0.2, name="l%d_%s" % (i, n))
                for n, s in (("q", (width, heads, width // heads)),
                             ("k", (width, heads, width // heads)),
                             ("v", (width, heads, width // heads)),
                             ("up", (width, 4 * width)), ("down", (4 * width, width)))]
            weights += [wq, wk, wv, w1, w2]
            x = tf.nn.l2_normalize(h, axis=-1)
            q, k, v = (tf.einsum("bsc,chd->bshd", x, w) for w in (wq, wk, wv))
            scores = tf.einsum("bqhd,bkhd->bhqk", q, k, name="l%d_scores" % i)
            probs = tf.nn.softmax(scores * (width // heads) ** -0.5, name="l%d_probs" % i)
            out = tf.einsum("bhqk,bkhd->bqhd", probs, v, name="l%d_context" % i)
            h = h + tf.reshape(out, [2, seq, width])
            h = h + tf.matmul(tf.nn.gelu(tf.matmul(h, w1), approximate=True), w2)
        loss = tf.reduce_sum(h * h)
    return graph, loss, weights


def _copies_that_run(fetches):
    """{original op name: copies} of memsave's copies that ``fetches`` need
    (through data and control inputs): the ones a step runs."""
    seen, stack = set(), [t.op if hasattr(t, "op") else t for t in fetches]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    out = collections.Counter()
    for op in seen:
        m = re.match(r"memsave_\d+/(.*)", op.name)
        if m and "/gradients" not in op.name and not _INSERTED.search(op.name):
            out[m.group(1)] += 1
    return out


def test_recompute_cost_counts_the_copies_that_run():
    """Recomputing attention's softmax runs the scores' einsum, not the
    einsum of the probabilities with the values above it (its gradient reads
    its inputs, which are recomputed or kept): the estimate counts the
    copies the step needs, each as often as it is made."""
    graph, loss, weights = _attention()
    box = {}

    def softmax_recomputed(plan_graph):
        kept = [n for n, d in plan_graph.nodes(data=True)
                if d["candidate"] and d["saved"] and "probs" not in n]
        box.update(graph=plan_graph, cost=simulate.recompute_cost(plan_graph, kept))
        return kept

    with graph.as_default():
        grads = memsave.gradients(loss, weights, checkpoints=softmax_recomputed)
        want = tf.gradients(loss, weights)
        ran = _copies_that_run(grads)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, want = sess.run([grads, want])
    scale = max(np.abs(w).max() for w in want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale)
    assert {n for n in ran if "_scores" in n} == {"l0_scores/Einsum", "l1_scores/Einsum"}, ran
    assert not any("context" in n for n in ran), ran
    cost = {n.split(":")[0]: d["cost"] for n, d in box["graph"].nodes(data=True)}
    assert sum(cost[n] * c for n, c in ran.items()) == pytest.approx(box["cost"], rel=1e-9)


def test_speed_keeps_a_recurrences_state_when_its_rounds_run_out():
    """A recurrence whose state every step's projection reads (Qwen3.5's
    gated delta rule): each round of ``recompute_once`` keeps one more
    step's state, and after its rounds the state chain below was copied
    once per step (405% of a training step, a step 14 times plain's). Where
    'speed' would recompute more than a forward pass, it keeps every
    tensor several segments recompute."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default() as graph:
        w = tf.Variable(rng.randn(16, 16).astype(np.float32) / 4)
        u = tf.Variable(np.float32(0.9))
        state, outs = tf.zeros([8, 16]), []
        for _ in range(24):
            # Each step's update reads the last step's projection, so each
            # projection is a level of its own (a segment of the rewrite).
            outs.append(tf.tanh(tf.matmul(state, w)))
            state = state * u + 0.1 * outs[-1]
        loss = tf.add_n([tf.reduce_sum(o) for o in outs])
        grads = memsave.gradients(loss, [w, u], checkpoints="speed", fallback=False)
        plain = tf.gradients(loss, [w, u])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, want = sess.run([grads, plain])
    made = _copies(graph)
    assert max(made.values(), default=1) == 1, made.most_common(3)
    scale = max(np.abs(p).max() for p in want)
    for g, p in zip(got, want):
        np.testing.assert_allclose(g, p, rtol=0, atol=1e-6 * scale)
