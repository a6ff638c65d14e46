"""Strategies as data: user-defined callables, registered names, composable
policies, the planning-graph schema, and the package's shape (no TF op
names in the planners, no import cycles, modules that are modules)."""

import ast
import pathlib
import subprocess
import sys

import networkx as nx
import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave import planning
from memsave.errors import PlanGraphError, StrategyError
from memsave.planning import PlanGraph, rules, simulate_peak
from tests.builders import tanh_chain
from tests.helpers import assert_same_as_plain

ROOT = pathlib.Path(memsave.__file__).resolve().parent
MB = 2**20


# ----------------------------------------------------------------- the package

def test_modules_are_modules_and_functions_are_functions():
    out = subprocess.run(
        [sys.executable, "-c",
         "import sys, types, memsave, memsave.planning, memsave.planning.policies\n"
         "import memsave.planning as P\n"
         "assert isinstance(P, types.ModuleType), P\n"
         "assert 'tensorflow' not in sys.modules, 'planning loaded TensorFlow'\n"
         "import memsave.patching\n"
         "assert isinstance(memsave.patching, types.ModuleType)\n"
         "assert callable(memsave.plan) and callable(memsave.patch)\n"
         "assert not isinstance(memsave.plan, types.ModuleType)\n"
         "assert memsave.OffloadModel is P.OffloadModel\n"],
        capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]


def _tf_op_names():
    return {n for n in dir(tf.raw_ops) if n[:1].isupper()} | {"_FusedMatMul", "_FusedConv2D"}


def test_no_tensorflow_op_names_in_the_planners():
    ops = _tf_op_names()
    found = []
    for path in sorted((ROOT / "planning").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value in ops:
                found.append("%s:%d %r" % (path.name, node.lineno, node.value))
    assert not found, "TF op names belong in memsave/graph/optable.py: %s" % found
    # The check is not vacuous: the op table itself is full of them.
    table = [n.value for n in ast.walk(ast.parse((ROOT / "graph" / "optable.py").read_text()))
             if isinstance(n, ast.Constant) and n.value in ops]
    assert "MatMul" in table and "ReadVariableOp" in table


def _module_imports(path):
    """memsave modules ``path`` imports at module level (not inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memsave"):
            found.add(node.module)
            found.update("%s.%s" % (node.module, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("memsave"))
    return found


def test_no_function_is_over_60_lines():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append("%s:%d %s (%d lines)" % (path.relative_to(ROOT), node.lineno,
                                                         node.name, lines))
    assert not long, "split these into named steps: %s" % long


def test_no_import_cycles():
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_node(name)
        for target in _module_imports(path):
            if target in modules and target != name:
                g.add_edge(name, target)
    # A package's __init__ re-exporting its own modules is not a cycle.
    g.remove_edges_from([(a, b) for a, b in list(g.edges) if b.startswith(a + ".")])
    cycles = list(nx.simple_cycles(g))
    assert not cycles, cycles
    assert g.has_edge("memsave.planning.optimal", "memsave.planning.strategies")


# ------------------------------------------------------------------ the schema

def test_schema_refuses_what_it_does_not_know(plan_chain):
    g = PlanGraph()
    with pytest.raises(PlanGraphError, match="bites"):
        g.add_tensor("a", order=0, bites=4)
    with pytest.raises(PlanGraphError, match="candidate must be a bool"):
        g.add_tensor("a", order=0, candidate="yes")
    with pytest.raises(PlanGraphError, match="bytes must be None or an int"):
        g.add_tensor("a", order=0, bytes=-1)
    with pytest.raises(PlanGraphError, match="not candidates"):
        g.add_tensor("a", order=0, y=True, candidate=True)
    g = plan_chain(3)
    g.add_edge("a2", "stray")            # networkx makes a bare node
    with pytest.raises(PlanGraphError, match="'stray' lacks"):
        g.validate()
    g = plan_chain(3)
    g.add_edge("a2", "a0")
    with pytest.raises(PlanGraphError, match="against the topological order"):
        g.validate()
    raw = nx.DiGraph()
    raw.add_node("a", order=0)
    for strategy in (planning.optimal, planning.memory, planning.speed):
        with pytest.raises(PlanGraphError, match="add_tensor"):
            strategy(raw)
    with pytest.raises(TypeError, match="PlanGraph"):
        planning.optimal({"a": 1})
    node = plan_chain(2).tensor("a1")
    assert node.bytes == MB and node.candidate and not node.expensive


def test_reducer_rule_is_one_rule():
    """The estimator frees a split-gradient input early exactly when the rewriter
    would order its weight gradient first: both ask memsave.planning.rules."""
    def net(size):
        g = PlanGraph()
        g.add_tensor("x", order=-1, x=True)
        g.add_tensor("w", order=0, bytes=0, input_read=True)
        g.add_tensor("a", order=1, elements=size // 4, bytes=size, candidate=True,
                     grad_reads_output=False)
        g.add_tensor("m", order=2, elements=size // 4, bytes=size, candidate=True,
                     split_gradient=True, expensive=True, grad_reads_output=False)
        g.add_tensor("y", order=3, elements=1, bytes=4, y=True)
        g.add_edges_from([("x", "a"), ("a", "m"), ("w", "m"), ("m", "y")])
        return g

    for size in (rules.MIN_ACTIVATION_BYTES // 2, rules.MIN_ACTIVATION_BYTES * 4):
        g = net(size)
        early = planning.simulate.prepare(g).early
        assert bool(early) == rules.reducer_runs_first(size, 0, size), size


# ------------------------------------------------------- strategies as callables

def _tf_chain(graph):
    """8 layers whose 256 KiB activations outweigh the weights, so plans differ."""
    chain = tanh_chain(8, batch=1024, width=64, scale=0.2, graph=graph)
    return chain.loss, chain.ws, chain.hs


def every_third_tanh(graph):
    """A user's strategy: keep every third Tanh output."""
    tanhs = planning.dag.topological(graph, [n for n, d in graph.nodes(data=True)
                                             if d["candidate"] and d["op_type"] == "Tanh"])
    return tanhs[::3]


def test_a_plain_function_is_a_strategy():
    graph = tf.Graph()
    loss, ws, acts = _tf_chain(graph)
    with graph.as_default():
        plan = memsave.plan(loss, ws, checkpoints=every_third_tanh)
        assert plan.strategy == "every_third_tanh"
        assert plan.checkpoints == [acts[i].name for i in (0, 3, 6)]
        assert 0 < plan.estimated_peak_bytes < plan.plain_peak_bytes
        grads = memsave.gradients(loss, ws, checkpoints=every_third_tanh)
    assert_same_as_plain(graph, loss, ws, grads)


def test_a_five_line_strategy_reports_as_much_as_a_built_in():
    def every_other_tanh(graph):
        return [n for n, d in graph.nodes(data=True)
                if d.candidate and d.op_type == "Tanh" and d.order % 4 == 0]

    graph = tf.Graph()
    loss, ws, _ = _tf_chain(graph)
    with graph.as_default():
        ours = memsave.plan(loss, ws, checkpoints=every_other_tanh)
        built_in = memsave.plan(loss, ws, checkpoints="speed")
    assert ours.strategy == "every_other_tanh" and ours.checkpoints
    assert ours.recompute_fraction > 0

    def lines(plan):
        return [line.split(":")[0].split("(")[0].split(" about")[0]
                for line in plan.summary().splitlines()]

    assert lines(ours) == lines(built_in), (ours.summary(), built_in.summary())


def test_keep_expensive_and_matching():
    graph = tf.Graph()
    loss, ws, acts = _tf_chain(graph)
    with graph.as_default():
        expensive = memsave.plan(loss, ws, checkpoints=planning.keep_expensive)
        assert expensive.strategy == "keep_expensive" and expensive.checkpoints
        assert all(graph.get_tensor_by_name(n).op.type == "MatMul"
                   for n in expensive.checkpoints)
        pattern = planning.matching(r"^Tanh(_[0-9]+)?:0$")
        by_pattern = memsave.plan(loss, ws, checkpoints=planning.keep_names(pattern))
        by_type = memsave.plan(loss, ws, checkpoints=planning.keep_op_types("Tanh"))
        assert by_pattern.checkpoints and by_pattern.checkpoints == by_type.checkpoints
        assert set(by_pattern.checkpoints) <= {a.name for a in acts}
        grads = [memsave.gradients(loss, ws, checkpoints=c) for c in (
            planning.keep_expensive, planning.never_keep(pattern))]
    for g in grads:
        assert_same_as_plain(graph, loss, ws, g)
    with pytest.raises(ValueError, match="regular expression"):
        planning.matching("(")


def test_registered_names_and_policies():
    graph = tf.Graph()
    loss, ws, acts = _tf_chain(graph)
    memsave.register_strategy("every_third_tanh", every_third_tanh)
    try:
        with pytest.raises(ValueError, match="already registered"):
            memsave.register_strategy("every_third_tanh", every_third_tanh)
        with pytest.raises(ValueError, match="built-in"):
            memsave.register_strategy("optimal", every_third_tanh)
        with graph.as_default():
            by_name = memsave.plan(loss, ws, checkpoints="every_third_tanh")
            assert by_name.checkpoints == [acts[i].name for i in (0, 3, 6)]
            matmuls = memsave.plan(loss, ws, checkpoints=planning.keep_op_types("MatMul"))
            assert matmuls.checkpoints and all(
                graph.get_tensor_by_name(n).op.type == "MatMul" for n in matmuls.checkpoints)
            assert matmuls.checkpoints == memsave.plan(loss, ws, checkpoints="speed").checkpoints
            named = memsave.plan(loss, ws, checkpoints=planning.keep_names(acts[2].op.name))
            assert named.checkpoints == [acts[2].name]
            # 'optimal' planning around a constraint; budget= reaches it.
            free = memsave.plan(loss, ws, checkpoints="optimal")
            banned = memsave.plan(loss, ws, checkpoints=planning.never_keep(*free.checkpoints))
            assert not set(banned.checkpoints) & set(free.checkpoints)
            assert banned.strategy.startswith("never_keep(")
            pinned = memsave.plan(loss, ws, checkpoints=planning.always_keep(acts[4].name),
                                  budget=0.9)
            assert acts[4].name in pinned.checkpoints
            assert pinned.estimated_peak_bytes <= 0.9 * pinned.plain_peak_bytes
            both = memsave.plan(loss, ws, checkpoints=planning.combine(
                "every_third_tanh", planning.keep_names(acts[1].name)))
            assert set(both.checkpoints) == {acts[i].name for i in (0, 1, 3, 6)}
            grads = [memsave.gradients(loss, ws, checkpoints=c) for c in (
                "every_third_tanh", planning.keep_op_types("MatMul"),
                planning.never_keep("Tanh"), planning.always_keep(acts[4].name))]
    finally:
        planning.unregister_strategy("every_third_tanh")
    for g in grads:
        assert_same_as_plain(graph, loss, ws, g)
    with graph.as_default(), pytest.raises(ValueError, match="unknown checkpoints strategy"):
        memsave.plan(loss, ws, checkpoints="every_third_tanh")


def test_options_reach_strategies_that_take_them():
    graph = tf.Graph()
    loss, ws, _ = _tf_chain(graph)
    seen = {}

    def with_budget(graph, budget=None, min_checkpoint_size=None):
        seen.update(budget=budget, min_checkpoint_size=min_checkpoint_size)
        return planning.optimal(graph, budget=budget)

    with graph.as_default():
        plan = memsave.plan(loss, ws, checkpoints=with_budget, budget=0.7,
                            min_checkpoint_size=5)
        assert seen == {"budget": 0.7, "min_checkpoint_size": 5}
        assert plan.estimated_peak_bytes <= 0.7 * plan.plain_peak_bytes
        with pytest.raises(ValueError, match="budget= needs checkpoints='optimal' or a strategy"):
            memsave.plan(loss, ws, checkpoints=every_third_tanh, budget=0.5)
        # offload='auto' on a strategy that does not take offload= moves what it keeps.
        moved = memsave.plan(loss, ws, checkpoints=every_third_tanh, offload="auto")
        assert moved.offloaded == moved.checkpoints


@pytest.mark.parametrize("result, message", [
    (None, "returned None"),
    (3, "returned 3"),
    ("a0:0", "returned 'a0:0'"),
    (["no/such:0"], "not tensors between xs and ys: no/such:0"),
    ([7], "returned 7 among its names"),
])
def test_a_strategy_that_returns_nonsense_is_refused(result, message):
    graph = tf.Graph()
    loss, ws, _ = _tf_chain(graph)
    with graph.as_default(), pytest.raises(StrategyError, match=message):
        memsave.gradients(loss, ws, checkpoints=lambda graph: result)


def test_policies_check_their_arguments(plan_chain):
    with pytest.raises(ValueError, match="at least one"):
        planning.keep_names()
    with pytest.raises(TypeError, match="selector"):
        planning.never_keep(3)
    with pytest.raises(TypeError, match="op types"):
        planning.keep_op_types(None)
    with pytest.raises(ValueError, match="at least two"):
        planning.combine("optimal")
    with pytest.raises(ValueError, match="unknown checkpoints strategy 'fastest'"):
        planning.never_keep("Tanh", then="fastest")(plan_chain(4))
    with pytest.raises(TypeError, match="callable"):
        memsave.register_strategy("x", "optimal")


def test_policies_on_a_planning_graph(plan_chain):
    g = plan_chain(12)
    plain = simulate_peak(g, ())
    by_index = planning.never_keep(lambda name, node: node.order % 2 == 0)
    plan = planning.run(by_index, g)
    assert plan.checkpoints and all(g.nodes[n]["order"] % 2 for n in plan.checkpoints)
    assert plan.estimated_peak_bytes < plain
    assert planning.run(lambda graph: [], g).checkpoints == []


# ---------------------------------------- through GradientTape and Keras fit

def test_a_plain_function_through_gradient_tape():
    rng = np.random.RandomState(0)
    ws = [tf.Variable(rng.randn(32, 32).astype(np.float32) * 0.3) for _ in range(6)]
    x = tf.constant(rng.randn(64, 32).astype(np.float32))
    calls = []

    def thirds(graph):
        calls.append(graph.number_of_nodes())
        return every_third_tanh(graph)

    def step(tape_cls, **kwargs):
        @tf.function
        def run():
            with tape_cls(**kwargs) as tape:
                h = x
                for w in ws:
                    h = tf.tanh(tf.matmul(h, w))
                loss = tf.reduce_sum(h * h)
            return tape.gradient(loss, ws)
        return [g.numpy() for g in run()]

    ours = step(memsave.GradientTape, checkpoints=thirds)
    theirs = step(tf.GradientTape)
    assert calls, "the strategy was never called"
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    with pytest.raises(TypeError, match="callable strategy"):
        memsave.GradientTape(checkpoints=3)


def test_a_plain_function_through_keras_fit():
    import keras  # pylint: disable=import-outside-toplevel
    import memsave.keras  # pylint: disable=import-outside-toplevel,redefined-outer-name

    def model_and_data():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,))] + [
            keras.layers.Dense(32, activation="tanh") for _ in range(5)] + [keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
        rng = np.random.RandomState(0)
        return model, rng.randn(70, 16).astype(np.float32), rng.randn(70, 1).astype(np.float32)

    calls = []

    def thirds(graph):
        calls.append(1)
        return every_third_tanh(graph)

    ours, x, y = model_and_data()
    memsave.keras.enable(ours, checkpoints=thirds)
    ours.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)   # last batch: 6
    theirs, _, _ = model_and_data()
    theirs.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert calls, "the strategy was never called"
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_memory_keeps_the_residual_stream_where_weights_are_reshaped():
    """keras-hub's projections (EinsumDense) read a reshaped weight. A reshape
    is in its input's buffer, so the matmul beyond it cuts no activation off
    from the loss: counted as one, each projection was a bottleneck, and
    'memory' kept GPT2's (130% of a training step recomputed, its peak
    above plain's) and ResNet50's matmul outputs (63% recomputed, 82% of
    plain's peak measured). Only the residual stream cuts this network."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        ws = [tf.Variable(rng.randn(16 * 16) * 0.2) for _ in range(8)]
        h = tf.constant(rng.randn(32, 16))
        stream = []
        for w in ws:
            h = h + tf.tanh(tf.matmul(h, tf.reshape(w, [16, 16])))
            stream.append(h.name)
        loss = tf.reduce_sum(h ** 2)
        plan = memsave.plan(loss, ws, checkpoints="memory", min_checkpoint_size=0)
        assert plan.checkpoints and set(plan.checkpoints) <= set(stream), plan.checkpoints
        assert plan.estimated_peak_bytes < plan.plain_peak_bytes
        ours = memsave.gradients(loss, ws, checkpoints="memory", min_checkpoint_size=0)
        plain = tf.gradients(loss, ws)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            ours, plain = sess.run([ours, plain])
    largest = max(np.abs(g).max() for g in plain)
    assert max(np.abs(a - b).max() for a, b in zip(ours, plain)) <= 1e-12 * largest
