"""memsave under XLA (``jit_compile=True``): barriers, gradients, memory.

Each segment's recomputation reads its inputs through an XLA optimization
barrier that also takes the gradients the segment waits for. Checked here:
the barriers appear exactly where XLA compiles the step; the
recomputation survives XLA's own optimizations (the CPU compiler's
optimized HLO still holds it, and without the barriers it does not);
gradients equal plain XLA's for every strategy; Keras ``fit`` with
``jit_compile=True`` trains as plain XLA does; and, where the ``xla``
extra is installed, the GPU compiler's buffer assignment of a chain
(deviceless H100) is well below plain's.
"""

import logging
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsave
from benchmarks import xla_gpu
from tests.keras_helpers import GradientSum

BARRIER = "XlaOptimizationBarrier"


def _chain(depth=8, batch=16, width=32, dtype="float64", seed=0):
    rng = np.random.RandomState(seed)
    ws = [tf.Variable((rng.randn(width, width) / np.sqrt(width)).astype(dtype))
          for _ in range(depth)]
    x = tf.constant(rng.randn(batch, width).astype(dtype))

    def loss():
        h = x
        for i, w in enumerate(ws):
            h = h @ w
            h = tf.tanh(h) if i % 2 else 0.5 * h * (1.0 + tf.math.erf(h / np.sqrt(2.0)))
        return tf.reduce_sum(h ** 2)

    return loss, ws


def _conv_net(dtype="float32", seed=0):
    """Conv + bias + ReLU, a batch-norm-like normalization, stateless dropout,
    a skip connection and a while loop: what oneDNN, cuDNN and XLA fuse."""
    rng = np.random.RandomState(seed)
    k1 = tf.Variable(rng.randn(3, 3, 3, 8).astype(dtype) * 0.3)
    b1 = tf.Variable(rng.randn(8).astype(dtype) * 0.1)
    k2 = tf.Variable(rng.randn(3, 3, 8, 8).astype(dtype) * 0.2)
    gamma = tf.Variable(np.ones(8, dtype))
    w = tf.Variable(rng.randn(8 * 8 * 8, 4).astype(dtype) * 0.1)
    x = tf.constant(rng.rand(4, 8, 8, 3).astype(dtype))

    def loss():
        h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, k1, 1, "SAME"), b1))
        g = tf.nn.conv2d(h, k2, 1, "SAME")
        mean, var = tf.nn.moments(g, [0, 1, 2])
        g = gamma * (g - mean) * tf.math.rsqrt(var + 1e-3)
        g = tf.nn.relu(g) + h
        g = tf.nn.experimental.stateless_dropout(g, 0.25, seed=[1, 2])
        _, g = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, tf.tanh(v) * 1.1),
                             [tf.constant(0), g], maximum_iterations=3)
        return tf.reduce_sum(tf.reshape(g, [4, -1]) @ w)

    return loss, [k1, b1, k2, gamma, w]


def _language_model(dtype="float64", seed=0):
    """An embedding read by every layer and tied to the output, and a sparse
    cross-entropy over the vocabulary: the gather is recomputed in several
    segments and the cross-entropy's gradient reads its second output."""
    rng = np.random.RandomState(seed)
    table = tf.Variable(rng.randn(50, 16).astype(dtype) * 0.5)
    ws = [tf.Variable(rng.randn(16, 16).astype(dtype) * 0.25) for _ in range(4)]
    ids = tf.constant(rng.randint(0, 50, (4, 12)))
    labels = tf.constant(rng.randint(0, 50, (4, 12)))

    def loss():
        e = tf.gather(table.value(), ids)          # as Keras reads an Embedding
        h = e
        for w in ws:
            h = tf.tanh(h @ w) + e
        logits = tf.einsum("btd,vd->btv", h, table.value())
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    return loss, [table] + ws


def _step(loss, variables, jit=True, **memsave_kwargs):
    def step():
        tape = (memsave.GradientTape(**memsave_kwargs) if memsave_kwargs
                else tf.GradientTape())
        with tape:
            value = loss()
        return [tf.convert_to_tensor(g) for g in tape.gradient(value, variables)]
    return tf.function(step, jit_compile=jit)


def _ops(function):
    return [op.type for op in function.get_concrete_function().graph.get_operations()]


def _relative(plain, ours):
    scale = max(float(np.abs(g).max()) for g in plain)
    return max(float(np.abs(a - b).max()) for a, b in zip(plain, ours)) / scale


def test_barriers_where_xla_compiles_and_only_there():
    loss, ws = _chain()
    assert BARRIER in _ops(_step(loss, ws, jit=True, checkpoints="optimal"))
    # No XLA: the barrier has no kernel, and control inputs do the job.
    assert BARRIER not in _ops(_step(loss, ws, jit=False, checkpoints="optimal"))
    # The override, both ways.
    assert BARRIER not in _ops(_step(loss, ws, jit=True, checkpoints="optimal", xla=False))
    assert BARRIER in _ops(_step(loss, ws, jit=False, checkpoints="optimal", xla=True))


def test_xla_option_is_checked_when_called():
    with pytest.raises(TypeError, match="xla"):
        memsave.GradientTape(xla="yes")
    loss, ws = _chain()
    with pytest.raises(TypeError, match="xla must be"):
        _step(loss, ws, checkpoints="optimal", xla="yes").get_concrete_function()


def _count(hlo, opcode):
    return len(re.findall(r"= \S+ %s\(" % opcode, hlo))


def test_recomputation_survives_xla_optimizations():
    """XLA's CPU compiler runs the same CSE as the GPU one: its optimized HLO
    still holds the recomputed activations (tanh, the GELUs' erf) with the
    barriers, and none without."""
    loss, ws = _chain(depth=12, dtype="float32")

    def optimized(**kwargs):
        return _step(loss, ws, **kwargs).experimental_get_compiler_ir()(stage="optimized_hlo")

    def activations(hlo):
        return _count(hlo, "tanh") + _count(hlo, "erf")

    plain = activations(optimized())
    assert plain == 12
    ours = optimized(checkpoints="optimal", min_checkpoint_size=0)
    assert activations(ours) > plain
    merged = optimized(checkpoints="optimal", min_checkpoint_size=0, xla=False)
    assert activations(merged) == plain


CONFIGS = [dict(checkpoints="optimal"), dict(checkpoints="memory"), dict(checkpoints="speed"),
           dict(checkpoints="optimal", max_recompute=0.1)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join("%s=%s" % kv for kv in c.items()))
@pytest.mark.parametrize("model,dtype,tolerance", [
    (_chain, "float64", 1e-12), (_conv_net, "float64", 1e-12), (_conv_net, "float32", 1e-5),
    (_language_model, "float64", 1e-12)])
def test_gradients_equal_plain_xla(model, dtype, tolerance, config):
    loss, variables = model(dtype=dtype)
    plain = [g.numpy() for g in _step(loss, variables)()]
    step = _step(loss, variables, min_checkpoint_size=0, **config)
    assert BARRIER in _ops(step)
    assert _relative(plain, [g.numpy() for g in step()]) <= tolerance


@pytest.mark.parametrize("checkpoints", ["optimal", "memory", "speed"])
def test_loop_kept_in_place_under_xla(checkpoints):
    """A scan reading a variable the step writes later is never recomputed;
    its TensorList input gets a (variant) gradient, which the next segment
    waits for: XLA's barrier takes no variant (found by the fuzzer)."""
    rng = np.random.RandomState(0)
    w0, w1, w2 = (tf.Variable(rng.randn(8, 8) / 3) for _ in range(3))
    x = tf.constant(rng.randn(6, 8))

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as plain, memsave.GradientTape(
                checkpoints=checkpoints, min_checkpoint_size=0, fallback=False) as ours:
            h = tf.tanh(x @ w0)
            m = tf.scan(lambda acc, r: 0.5 * acc + tf.tanh(tf.linalg.matvec(w1, r,
                                                                             transpose_a=True)),
                        h) + h
            loss = tf.reduce_sum(tf.tanh(m @ w2) ** 2)
        with tf.control_dependencies([loss]):
            write = w1.assign_add(tf.ones_like(w1))
        with tf.control_dependencies([write]):
            return plain.gradient(loss, [w0, w1, w2]), ours.gradient(loss, [w0, w1, w2])

    plain, ours = step()
    assert BARRIER in _ops(step)
    assert _relative([g.numpy() for g in plain], [g.numpy() for g in ours]) <= 1e-12


def _branches_with_rows(branching, depth=12, at=5, seed=0):
    """A tanh chain with a cond (or a switch_case) in the middle whose taken
    branch adds rows of an embedding table: the branch's gradient is
    IndexedSlices whose row count XLA knows only at run time."""
    rng = np.random.RandomState(seed)
    ws = [tf.Variable(rng.randn(32, 32) * 0.3) for _ in range(depth)]
    table = tf.Variable(rng.randn(50, 32))
    x = tf.constant(rng.randn(64, 32))
    ids = tf.constant(rng.randint(0, 50, size=64))

    def with_rows(h):
        if branching == "cond":
            return tf.cond(tf.reduce_sum(h) > -1e9, lambda: h + tf.gather(table, ids),
                           lambda: h)
        return tf.switch_case(tf.constant(1), [lambda: h * 0.5,
                                               lambda: h + tf.gather(table, ids)])

    def loss():
        h = x
        for i, w in enumerate(ws):
            h = tf.tanh(h @ w)
            if i == at:
                h = with_rows(h)
        return tf.reduce_sum(h ** 2)

    return loss, ws + [table]


@pytest.mark.parametrize("checkpoints", ["optimal", "memory", "speed"])
@pytest.mark.parametrize("branching", ["cond", "switch_case"])
def test_gradient_rows_sized_at_run_time_under_xla(branching, checkpoints):
    """XLA's barrier takes no tensor it sizes at run time ("Asked to propagate
    a dynamic dimension ... to opt-barrier"): a segment waiting on such a
    gradient waits on a scalar read of it (found by a helper breaking memsave)."""
    loss, variables = _branches_with_rows(branching)
    plain = [g.numpy() for g in _step(loss, variables)()]
    step = _step(loss, variables, checkpoints=checkpoints, min_checkpoint_size=0)
    assert BARRIER in _ops(step)
    assert _relative(plain, [g.numpy() for g in step()]) <= 1e-12


def test_static_sizes_under_xla_are_told_from_run_time_ones():
    graph = tf.Graph()
    with graph.as_default():
        batch = tf.compat.v1.placeholder(tf.float32, [None, 4])
        rows = tf.boolean_mask(batch, batch[:, 0] > 0)
        dense = tf.tanh(batch) * 2.0
        sized = memsave.graph.edit.SizedUnderXla()
        assert sized(dense) and sized(batch)
        assert not sized(rows) and not sized(tf.reshape(rows, [-1])) and not sized(rows * 2.0)
        assert sized(tf.reduce_sum(rows))


def test_verify_under_xla_is_refused_clearly():
    loss, ws = _chain()
    with pytest.raises(ValueError, match="jit_compile=False"):
        _step(loss, ws, checkpoints="optimal", verify=True).get_concrete_function()


def test_explicit_checkpoints_under_xla():
    loss, ws = _chain()

    def step():
        with tf.GradientTape() as tape:
            value = loss()
        plain = tape.gradient(value, ws)
        keep = [t for t in tf.compat.v1.get_default_graph().get_operations()
                if t.type == "Tanh"]
        ours = memsave.gradients(value, ws, checkpoints=[op.outputs[0] for op in keep])
        return plain, ours

    plain, ours = tf.function(step, jit_compile=True)()
    assert _relative([g.numpy() for g in plain], [g.numpy() for g in ours]) <= 1e-12


def test_offloading_under_xla(caplog):
    """A compiled step cannot address host memory: a list is refused, 'auto'
    plans without offloading (and says so)."""
    loss, ws = _chain()

    def step_with(offload):
        def step():
            with tf.GradientTape() as tape:
                value = loss()
            listed = offload if offload == "auto" else [
                op.outputs[0] for op in tf.compat.v1.get_default_graph().get_operations()
                if op.type == "Tanh"][:1]
            return memsave.gradients(value, ws, checkpoints="optimal", offload=listed,
                                     min_checkpoint_size=0)
        return tf.function(step, jit_compile=True)

    with pytest.raises(ValueError, match="host"):
        step_with("list").get_concrete_function()
    plain = [g.numpy() for g in _step(loss, ws)()]
    with caplog.at_level(logging.WARNING, logger="memsave"):
        ours = [g.numpy() for g in step_with("auto")()]
    assert any("offload='auto' under XLA" in r.getMessage() for r in caplog.records)
    assert _relative(plain, ours) <= 1e-12


def _keras_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, padding="same"),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.Dropout(0.3),
        keras.layers.Conv2D(8, 3, padding="same", activation="gelu"),
        keras.layers.Flatten(),
        keras.layers.Dense(4)])


@pytest.mark.parametrize("checkpoints", ["optimal", "speed"])
@pytest.mark.parametrize("optimizer", ["gradient_sum", "sgd"])
def test_keras_fit_with_jit_compile_trains_as_plain_xla(checkpoints, optimizer):
    """Gradient sums (weights fixed: the sums compare exactly), and weights
    after SGD steps."""
    rng = np.random.RandomState(0)
    x, y = rng.rand(16, 8, 8, 3).astype("float32"), rng.randint(0, 4, 16)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    models = []
    for use in (False, True):
        model = _keras_model()
        model.compile(optimizer=GradientSum() if optimizer == "gradient_sum"
                      else keras.optimizers.SGD(0.05), loss=loss, jit_compile=True)
        if use:
            memsave.keras.enable(model, checkpoints, min_checkpoint_size=0, fallback=False)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        models.append(model)
    if optimizer == "gradient_sum":
        plain, ours = ([s.numpy() for s in m.optimizer.sums] for m in models)
        assert _relative(plain, ours) <= 1e-5
    for a, b in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)   # BN statistics too




@pytest.mark.skipif(not xla_gpu.available(), reason="needs the xla extra (jax, CUDA plugin)")
def test_deviceless_h100_chain_memory_well_below_plain():
    """The regression guard for XLA memory: 16 layers, 2 MiB activations;
    plain keeps all 16, 'optimal' about 5 (measured 66 and 20 MiB)."""
    loss, ws = _chain(depth=16, batch=2048, width=256, dtype="float32")
    plain = xla_gpu.step_memory(_step(loss, ws))["temp"]
    ours = xla_gpu.step_memory(_step(loss, ws, checkpoints="optimal"))["temp"]
    assert ours <= 0.5 * plain, (ours / 2**20, plain / 2**20)


@pytest.mark.skipif(not xla_gpu.available(), reason="needs the xla extra (jax, CUDA plugin)")
def test_deviceless_h100_matmuls_show_what_a_recompute_cap_recomputes():
    """The compiled step's matmul FLOPs (after XLA's dead-code elimination
    and CSE) are what the cap is about: plain runs 8 forward and 15 backward
    matmuls; the default recomputes some; a 1.5% cap may recompute none of
    them (each is an eighth of the forward pass's matmuls, 4% of a step), though each
    GELU and tanh reads its matmul's output inside a fusion."""
    loss, ws = _chain(depth=8, batch=256, width=64, dtype="float32")

    def matmul_flops(**options):
        hlo = _step(loss, ws, **options).experimental_get_compiler_ir()(stage="hlo_serialized")
        return xla_gpu.matmul_flops(xla_gpu.compile_hlo(hlo))

    one = 2 * 256 * 64 * 64
    assert matmul_flops() == 23 * one
    assert matmul_flops(checkpoints="optimal") > 23 * one
    assert matmul_flops(checkpoints="optimal", max_recompute=0.015) == 23 * one


def test_plans_see_xla_fusions():
    """Under XLA an elementwise chain is one fused kernel: what one op hands
    the next is neither held by plain backprop nor costly to recompute."""
    from memsave.graph import graph_tensor
    from memsave.graph.region import analyze, to_plan_graph
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (8, 16))
        w = tf.Variable(tf.ones((16, 16)))
        h = x @ w
        inner = h * h                 # read only by the next multiply: fused
        out = tf.tanh(inner * h) @ w  # tanh's output feeds a matmul: materialized
        region = analyze([tf.reduce_sum(out)], [graph_tensor(w, graph)])
    eager = to_plan_graph(region)
    compiled = to_plan_graph(region, compiled=True)
    assert eager.nodes[inner.name]["saved"] and eager.nodes[inner.name]["cost"] > 0
    assert not compiled.nodes[inner.name]["saved"]
    assert compiled.nodes[inner.name]["cost"] == 0 and compiled.nodes[inner.name]["candidate"]
    tanh = out.op.inputs[0].name
    assert compiled.nodes[tanh]["saved"] and compiled.nodes[tanh]["cost"] > 0


def test_a_fused_value_a_gradient_reads_is_recomputed_from_the_fusions_inputs():
    """XLA's backward fusion recomputes a fused value from the fusion's
    inputs: GELU's input (a bias add) from the matmul under it. So the
    matmul output is what plain XLA holds, and a plan that keeps only the
    activation recomputes the matmul (GPT2 at 1,024 tokens: a cap of 1.7%
    of a step, estimated 1.6%, recomputed 7.7%, every layer's MLP matmul,
    as the H100's compiled HLO showed)."""
    from memsave.graph import graph_tensor
    from memsave.graph.region import analyze, to_plan_graph
    from memsave.planning.simulate import recompute_cost
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (8, 16))
        w = tf.Variable(tf.ones((16, 16)))
        b = tf.Variable(tf.zeros((16,)))
        m = x @ w                          # BiasAdd's gradient does not read it
        pre = tf.nn.bias_add(m, b)         # read only by elementwise ops: fused
        act = tf.tanh(pre) * pre           # its gradient reads pre
        out = act @ w
        region = analyze([tf.reduce_sum(out)], [graph_tensor(w, graph), graph_tensor(b, graph)])
    eager = to_plan_graph(region)
    compiled = to_plan_graph(region, compiled=True)
    assert eager.nodes[pre.name]["saved"] and not eager.nodes[m.name]["saved"]
    assert not compiled.nodes[pre.name]["saved"] and compiled.nodes[m.name]["saved"]
    matmul = compiled.nodes[m.name]["cost"]
    assert matmul > 0
    assert recompute_cost(compiled, [act.name]) >= matmul
    assert recompute_cost(compiled, [act.name, m.name]) < matmul


@pytest.mark.parametrize("jit", [True, False])
def test_gradient_of_memsave_gradients(jit):
    """A gradient penalty differentiates the rewritten backward pass itself,
    through the barriers (identity per output) under XLA."""
    loss, ws = _chain(depth=4)

    def step(gradients):
        @tf.function(jit_compile=jit)
        def run():
            grads = gradients(loss(), ws)
            return tf.gradients(tf.add_n([tf.reduce_sum(g ** 2) for g in grads]), ws)
        return [g.numpy() for g in run()]

    plain = step(tf.gradients)
    ours = step(lambda y, xs: memsave.gradients(y, xs, checkpoints="optimal",
                                                min_checkpoint_size=0, fallback=False))
    assert _relative(plain, ours) <= 1e-12


@pytest.mark.parametrize("jit", [True, False])
def test_memsave_gradients_under_a_recording_tape_uses_plain(jit, caplog):
    """An outer tape records none of memsave's copies: its second-order
    gradients would be None. memsave.gradients then says so and uses plain."""
    from memsave.log import reset_warnings
    reset_warnings()
    loss, ws = _chain(depth=4)

    def step(gradients):
        @tf.function(jit_compile=jit)
        def run():
            with tf.GradientTape() as outer:
                grads = gradients(loss(), ws)
                penalty = tf.add_n([tf.reduce_sum(g ** 2) for g in grads])
            return outer.gradient(penalty, ws)
        return run()

    plain = step(tf.gradients)
    with caplog.at_level(logging.WARNING, logger="memsave"):
        ours = step(lambda y, xs: memsave.gradients(y, xs, checkpoints="optimal",
                                                    min_checkpoint_size=0, fallback=False))
    assert all(g is not None for g in ours)
    assert _relative([g.numpy() for g in plain], [g.numpy() for g in ours]) <= 1e-12
    assert any("GradientTape is recording" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("checkpoints", ["optimal", "speed", "memory", []])
def test_a_split_piece_as_an_x_under_xla(checkpoints):
    """One piece of a split as an x beside a weight, the other pieces feeding
    the ys too: tf.gradients differentiates their consumers and drops what
    reaches the split (it makes an x, so it is not differentiated). Under XLA
    a segment reads the pieces through a barrier, so its copies of those
    consumers were not reached from the xs; the gradient dropped there
    reached no x, yet the audit refused the rewrite (found by the tape
    fuzzer). Gradients equal plain XLA's."""
    rng = np.random.RandomState(0)
    w = tf.Variable(rng.randn(6, 6))
    h = tf.constant(rng.randn(4, 6))

    def step(ours):
        @tf.function(jit_compile=True)
        def f():
            p0, p1, p2 = tf.split(tf.concat([h, h], axis=1), [1, 6, 5], axis=1)
            mixed = p1 + 0.5 * tf.concat([p2, p0], axis=1)
            loss = tf.reduce_sum(tf.tanh(mixed @ w @ w) ** 2)
            if ours:
                return memsave.gradients(loss, [w, p1], checkpoints=checkpoints,
                                         fallback=False, min_checkpoint_size=0)
            return tf.gradients(loss, [w, p1])
        return f()

    assert _relative(step(False), step(True)) <= 1e-12
