"""Property tests: on random DAGs nobody hand-picked, memsave equals tf.gradients.

Graphs are drawn as plain data (:mod:`tests.graphgen`) and built in a fresh
``tf.Graph`` per example (or a fresh ``tf.function`` for the smaller
function-mode run). For every strategy ('memory', 'speed', 'optimal', 'collection'
and an explicit list) memsave's gradients must equal plain ``tf.gradients``
elementwise within ``|a - b| <= 1e-5 * max(1, |a|)``, with the same None
pattern and the same sparse/dense kind.

'memory' may raise ``NoBottleneckError``; then the graph must really have
no bottleneck under memsave's documented definition, which is checked by an
independent brute force (remove each candidate tensor, see whether some
activation loses its path to the ys). Such graphs must stay a minority.
When 'memory' does plan, every tensor it keeps must be such a bottleneck.

The weak-spot tests draw graphs with loops (stateful bodies, variables
written later in the step), conds, nested calls, custom gradients, Pow/GELU
and float32 conv + bias, and run every strategy with and without
``offload='auto'``, an offloaded list and a budget.

Hypothesis profiles are registered here: "ci" (the default, and `make
test-all`'s: derandomized, 240 Session examples, 40 tf.function examples,
240 planning-only examples, 120 + 40 + 20 weak-spot examples (Session,
tf.function, XLA), no deadline), "quick" (`make test`'s: the same with 80
examples: 80 / 13 / 80, weak spots 40 + 13 + 10) and "long"
(``HYPOTHESIS_PROFILE=long``: 2000 / 333 / 2000, weak spots 2000 + 333,
random). Each test applies the chosen profile through ``settings(parent=...)``
rather than loading it globally, so other test files are unaffected.
"""

import collections
import contextlib
import functools
import os

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, Phase, assume, given, note, settings
from tensorflow.python.framework.ops import EagerTensor

import memsave
from memsave.graph import optable
from memsave.graph.region import analyze
from tests import graphgen

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
           HealthCheck.large_base_example]
settings.register_profile("ci", derandomize=True, max_examples=240, deadline=None,
                          suppress_health_check=_HEALTH, database=None, print_blob=True)
# `make test` (CI) runs a third as many (`make test-all`: "ci", the default).
settings.register_profile("quick", derandomize=True, max_examples=80, deadline=None,
                          suppress_health_check=_HEALTH, database=None, print_blob=True)
settings.register_profile("long", max_examples=2000, deadline=None,
                          suppress_health_check=_HEALTH, print_blob=True)
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
N = PROFILE.max_examples          # session-mode examples
N_FUNCTION = max(N // 6, 10)      # tf.function examples (each traces a new function)
N_STRICT = N                      # planning-only examples (no session, fast)

RTOL = 1e-5
STRATEGIES = ("memory", "speed", "optimal", "collection", "list")
# The weak-spot graphs also run with offloading and a budget: (label, strategy, options).
CONFIGS = tuple((s, s, {}) for s in STRATEGIES) + (
    ("optimal+offload", "optimal", {"offload": "auto"}),
    ("speed+offload", "speed", {"offload": "auto"}),
    ("list+offload", "list", {"offload": "listed"}),
    ("optimal+budget", "optimal", {"budget": "midway"}),
)
LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
N_WEAK = N if LONG else N // 2    # weak-spot examples, in a Session
N_WEAK_FUNCTION = max(N // 6, 10)  # and in a tf.function
N_WEAK_XLA = N_WEAK_FUNCTION if LONG else max(N // 12, 10)   # and jit-compiled


# ---------------------------------------------------------------- comparison

def _kind(g):
    if g is None:
        return None
    return "sparse" if isinstance(g, tf.IndexedSlices) else "dense"


def _dense(g):
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def assert_close(plain, ours, what, scale=None):
    """|a - b| <= 1e-5 * max(1, ``scale``) everywhere; non-finite entries must
    match exactly. ``scale``: the largest |a| of all the step's gradients
    (:func:`largest`), else of this one. Relative to the largest entry, not
    to each entry: float32 convolutions (oneDNN's, multithreaded) round
    small entries differently from run to run (seen: 1.2e-5 off on an entry
    of a gradient whose largest is 3.7, not reproducible); and of all
    gradients, since a gradient that is truly zero (a bias that a mean
    subtraction follows) is the rounding noise of the others' size (seen:
    1.5e-5 off, float32 'speed')."""
    a = np.asarray(plain, np.float64)
    b = np.asarray(ours, np.float64)
    assert a.shape == b.shape, "%s: shape %s vs %s" % (what, a.shape, b.shape)
    finite = np.isfinite(a)
    assert np.array_equal(np.isfinite(b), finite), "%s: non-finite entries differ" % what
    assert np.array_equal(a[~finite], b[~finite], equal_nan=True), "%s: inf/nan differ" % what
    err = np.abs(a[finite] - b[finite])
    if scale is None:
        scale = largest([a])
    bound = RTOL * max(1.0, scale)
    bad = err > bound
    assert not bad.any(), "%s: %d entries off, worst |a-b| = %.3g (|a| = %.3g, scale %.3g)" % (
        what, int(bad.sum()), float(err.max()), float(np.abs(a[finite]).max(initial=0.0)),
        scale)


def largest(values):
    """The largest finite |entry| of ``values`` (arrays), 0 for none."""
    return max((float(np.abs(v[np.isfinite(v)]).max(initial=0.0))
                for v in (np.asarray(x, np.float64) for x in values)), default=0.0)


def check_pattern(plain, ours, strategy):
    kinds_plain = [_kind(g) for g in plain]
    kinds_ours = [_kind(g) for g in ours]
    assert kinds_plain == kinds_ours, "%s: gradient kinds differ: plain %s, memsave %s" % (
        strategy, kinds_plain, kinds_ours)


# ---------------------------------------------------------------- bottlenecks

def _handles(xs):
    """Graph tensors for xs: variables by their handle, captured inside tf.function."""
    graph = tf.compat.v1.get_default_graph()
    out = []
    for x in xs:
        t = x.handle if hasattr(x, "handle") else x
        if isinstance(t, EagerTensor) or t.graph is not graph:
            t = graph.capture(t)
        out.append(t)
    return out


def _region(ys, xs):
    """Ops on a path from an x to a y (an independent re-derivation)."""
    behind, stack = set(), [y.op for y in ys]
    while stack:
        op = stack.pop()
        if op not in behind:
            behind.add(op)
            stack.extend(t.op for t in op.inputs)
    ahead, stack = set(), [c for x in xs for c in x.consumers() if c in behind]
    while stack:
        op = stack.pop()
        if op not in ahead and op in behind:
            ahead.add(op)
            stack.extend(c for t in op.outputs for c in t.consumers())
    # An x computed from another x is inside (tf.gradients differentiates through it).
    return ahead


def brute_force_bottlenecks(ys, xs, strict=False):
    """Names of candidate tensors whose removal cuts some activation off from the ys.

    Nodes are the xs and region op outputs, edges go from op inputs to op
    outputs, and a sink joins the ys. An activation is any node but an x,
    a variable read, or a tensor in a node's buffer (an op forwarding its
    input: a reshape holds no bytes of its own). With ``strict`` the xs
    (and reads of them) are not nodes at all: they are inputs, alive for
    the whole step, so a path through them (a shared weight, a weight-decay
    term) does not make a recomputed segment's activations necessary.
    """
    xs = _handles(xs)
    region = _region(ys, xs)
    # Leaf xs are inputs; an x computed inside the region is an activation that
    # memsave must keep (so it is no candidate), but paths through it count.
    x_names = {x.name for x in xs if x.op not in region}
    nested_xs = {x.name for x in xs} - x_names
    adj = collections.defaultdict(set)
    nodes = set(x_names)
    reads = set()
    for op in region:
        for t in op.outputs:
            nodes.add(t.name)
            if op.type == "ReadVariableOp":
                reads.add(t.name)
            for i in op.inputs:
                if i.op in region or i.name in x_names:
                    adj[i.name].add(t.name)
                    adj[t.name].add(i.name)
    sink = "<sink>"
    y_names = {y.name for y in ys}
    # A y that is also an x is an input: it gives no path to the ys.
    for y in (y_names & nodes) - x_names:
        adj[sink].add(y)
        adj[y].add(sink)
    dropped = (x_names | reads) if strict else set()
    in_a_nodes_buffer = set()
    for op in region:
        for k, t in enumerate(op.outputs):
            source = optable.forwarded_input(op, k)
            if source is not None and source.name in nodes:
                in_a_nodes_buffer.add(t.name)

    def reached(without):
        seen, stack = {sink}, [sink]
        while stack:
            n = stack.pop()
            for m in adj[n]:
                if m not in seen and m != without and m not in dropped:
                    seen.add(m)
                    stack.append(m)
        return seen

    # Activations that feed the ys at all (a region op whose only path to
    # the ys runs through an x has none).
    activations = {n for n in reached(None) if n != sink and n not in x_names
                   and n not in reads and n not in in_a_nodes_buffer}
    # Ops memsave keeps in place are no candidates (a call whose body only
    # reads is stateful by its op type, yet recomputable), nor the tensors it
    # keeps for them anyway (their inputs).
    analysis = analyze(ys, xs)
    forced = {t.name for t in analysis.forced}
    candidates = sorted(
        t.name for op in region if op not in analysis.pinned for t in op.outputs
        if t.name not in forced
        if (t.dtype.is_floating or t.dtype.is_complex) and t.name not in y_names
        and t.name not in nested_xs)
    found = []
    for c in candidates:
        seen = reached(c)
        if any(a not in seen and a != c for a in activations):
            found.append(c)
    return found


# ---------------------------------------------------------------- one example

def _call(strategy, built, options=None):
    ys, xs, grad_ys = built["ys"], built["xs"], built["grad_ys"]
    if strategy == "list":
        cps = built["checkpoints"]
    else:
        cps = strategy
    options = dict(options or {})
    if options.get("offload") == "listed":
        options["offload"] = built["checkpoints"]
    if options.get("budget") == "midway":
        # Halfway between the lowest estimate and plain's: it binds, and fits
        # (a budget is at least a byte, also where nothing between xs and ys has a size).
        lowest = memsave.plan(ys, xs, checkpoints="optimal", min_checkpoint_size=0)
        options["budget"] = max(1, (lowest.estimated_peak_bytes + lowest.plain_peak_bytes) // 2)
    return memsave.gradients(ys, xs, grad_ys, checkpoints=cps, min_checkpoint_size=0,
                             **options)


def _try(label, strategy, options, built, stats, oracle=True):
    """memsave's gradients for one configuration, or None where it documents a refusal.

    With ``oracle``, 'memory' may refuse only graphs the brute force finds
    no bottleneck in (the weak-spot tests check gradients, not that)."""
    try:
        return _call(strategy, built, options)
    except memsave.NoBottleneckError:
        assert strategy == "memory"
        stats["no_bottleneck"] += 1
        if oracle:
            found = brute_force_bottlenecks(built["ys"], built["xs"], strict=True)
            assert not found, "NoBottleneckError, but %s cut the graph" % found
    except memsave.BudgetError:
        assert "budget" in options, label
        stats["budget refused"] += 1
    except ValueError as e:
        # A listed tensor that cannot wait in host memory (a y, an x, read
        # in place by a kept op), or any under XLA: the documented refusals.
        refusal = "cannot offload" in str(e) or "offload= under XLA" in str(e)
        if not refusal or options.get("offload") != "listed":
            raise
        stats["offload refused"] += 1
    return None


REWRITTEN_BY_TF = ("While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
                   "PartitionedCall", "StatefulPartitionedCall")


def _snapshot(graph, skip=()):
    return {op.name: (op.node_def.SerializeToString(deterministic=True),
                      [t.name for t in op.inputs], [c.name for c in op.control_inputs])
            for op in graph.get_operations() if op.type not in skip}


def _count_kinds(spec, built, stats):
    stats["examples"] += 1
    kinds = {op[0] for op in spec.ops} | {op[1] for op in spec.ops if op[0] == "loop"}
    for kind in ("dropout", "fracpool", "inplace", "embed", "loop", "cond", "call", "custom", "pow", "conv",
                 "map_dropout", "map_print", "scan", "while"):
        stats["with " + kind] += kind in kinds
    stats["with a later write"] += bool(spec.writes)
    stats["several ys"] += len(built["ys"]) > 1
    stats["with grad_ys"] += spec.grad_ys is not None


def run_session_example(spec, stats, configs=CONFIGS[:len(STRATEGIES)], oracle=True):
    note(repr(spec))
    # TensorFlow's gradient of a cond, while loop or call made in a Graph
    # rewrites that op to output its intermediates (plain tf.gradients does
    # it, and so does memsave for ops it keeps in place): a Session made
    # before that cannot run the result. With such ops, the forward pass
    # runs in a Session of its own and another one runs the gradients.
    control_flow = any(op[0] in ("loop", "cond", "call") for op in spec.ops)
    graph = tf.Graph()
    with graph.as_default(), contextlib.ExitStack() as stack:
        variables = graphgen.make_variables(tf, spec)
        built = graphgen.build(tf, spec, variables)
        for t in built["checkpoints"]:
            tf.compat.v1.add_to_collection("checkpoints", t)
        init = tf.compat.v1.global_variables_initializer()
        # Fetch forward tensors through Identity ops: with oneDNN, Grappler's
        # remapper fuses sigmoid(x) * x into one op and drops a *fetched*
        # Sigmoid ("Tensor Sigmoid:0 ... was not found in the Graph"), a
        # TensorFlow bug unrelated to memsave.
        forward = [tf.identity(t) for t in built["forward"]]
        # The session runs the forward pass before memsave touches the graph.
        first = tf.compat.v1.Session(graph=graph)
        if control_flow:
            with first:
                first.run(init)
                forward_before = first.run(forward)
        else:
            sess = stack.enter_context(first)
            sess.run(init)
            forward_before = sess.run(forward)
        before = _snapshot(graph, skip=REWRITTEN_BY_TF if control_flow else ())
        ours = {}
        for label, strategy, options in configs:
            grads = _try(label, strategy, options, built, stats, oracle)
            if grads is None:
                continue
            ours[label] = grads
            if oracle and strategy == "memory" and not options and _region(built["ys"],
                                                                 _handles(built["xs"])):
                plan = memsave.plan(built["ys"], built["xs"], checkpoints="memory", min_checkpoint_size=0)
                note("memory kept %s" % (plan.checkpoints,))
                true = set(brute_force_bottlenecks(built["ys"], built["xs"], strict=True))
                assert set(plan.checkpoints) <= true, (
                    "'memory' kept non-bottlenecks %s" % sorted(set(plan.checkpoints) - true))
        _count_kinds(spec, built, stats)
        # Rewriting only added ops (but for kept control flow and calls, which
        # TensorFlow's own gradient rewrites).
        after = _snapshot(graph)
        changed = sorted(k for k in before if after[k] != before[k])
        assert not changed, "memsave changed existing ops: %s" % changed
        # Plain gradients last, as a user adding memsave to a graph would.
        plain = tf.gradients(built["ys"], built["xs"], built["grad_ys"])
        for label, grads in ours.items():
            check_pattern(plain, grads, label)
        stats["with a None gradient"] += any(g is None for g in plain)
        stats["with a sparse gradient"] += any(isinstance(g, tf.IndexedSlices) for g in plain)

        fetch = {"plain": [_dense(g) for g in plain if g is not None],
                 "forward": forward, "writes": built["writes"]}
        for label, grads in ours.items():
            fetch[label] = [_dense(g) for g in grads if g is not None]
        if control_flow:
            sess = stack.enter_context(tf.compat.v1.Session(graph=graph))
            sess.run(init)
        # One run: the writes (after the ys) happen in it, as in a training step.
        values = sess.run(fetch)
        alone = {}
        for label in ours:
            sess.run(init)     # undoes the writes
            alone[label] = sess.run(fetch[label])
    _check_alone(spec, values["plain"], alone)
    # Forward values are unchanged by the rewrite (dropout draws a new mask per run).
    if not graphgen.is_random(spec):
        for i, (a, b) in enumerate(zip(forward_before, values["forward"])):
            assert_close(a, b, "forward tensor %d" % i)
    scale = largest(values["plain"])
    for label in ours:
        for i, (a, b) in enumerate(zip(values["plain"], values[label])):
            assert_close(a, b, "%s: gradient %d" % (label, i), scale)


def run_function_example(spec, stats, configs=CONFIGS[:len(STRATEGIES)], oracle=True,
                         jit_compile=None):
    note(repr(spec))
    variables = graphgen.make_variables(tf, spec)
    out = {}

    initial = [v.numpy() for v in variables.values()]

    def ours(built, chosen, counts):
        grads_of = {}
        for label, strategy, options in chosen:
            if strategy == "collection":
                graph = tf.compat.v1.get_default_graph()
                graph.clear_collection("checkpoints")
                for t in built["checkpoints"]:
                    graph.add_to_collection("checkpoints", t)
            grads = _try(label, strategy, options, built, counts, oracle)
            if grads is not None:
                grads_of[label] = grads
        return grads_of

    @tf.function(jit_compile=jit_compile)
    def step():
        built = graphgen.build(tf, spec, variables)
        grads_of = ours(built, configs, stats)
        results = {label: [_dense(g) for g in grads if g is not None]
                   for label, grads in grads_of.items()}
        plain = tf.gradients(built["ys"], built["xs"], built["grad_ys"])
        for label, grads in grads_of.items():
            check_pattern(plain, grads, label)
        results["plain"] = [_dense(g) for g in plain if g is not None]
        out["labels"] = list(grads_of)
        _count_kinds(spec, built, stats)
        return results

    def alone(config):
        @tf.function(jit_compile=jit_compile)
        def step_alone():
            grads = ours(graphgen.build(tf, spec, variables), [config], collections.Counter())
            return [_dense(g) for g in grads[config[0]] if g is not None]
        for v, value in zip(variables.values(), initial):
            v.assign(value)    # undoes the writes
        return [t.numpy() for t in step_alone()]

    values = step()
    scale = largest([t.numpy() for t in values["plain"]])
    for label in out["labels"]:
        for i, (a, b) in enumerate(zip(values["plain"], values[label])):
            assert_close(a.numpy(), b.numpy(), "%s: gradient %d" % (label, i), scale)
    _check_alone(spec, [t.numpy() for t in values["plain"]],
                 {c[0]: alone(c) for c in configs if c[0] in out["labels"]})


def _check_alone(spec, plain, alone):
    """memsave's gradients from steps that return nothing else (one per
    configuration) equal plain's.

    The step above also returns plain's gradients and the other
    configurations' (and, in a Session, the forward tensors), which keep
    the whole forward pass alive. A training step returns only the
    gradients it applies: Grappler then prunes what nothing reads (the
    forward tail behind a loss), and what it hands on (a wait, down to a
    kept convolution that oneDNN then fused with the copy reading it) can
    close a cycle that the shared step hid.
    """
    scale = largest(plain)
    for label, grads in alone.items():
        if graphgen.is_random(spec):
            continue        # dropout drew new masks: it ran, which is the point
        for i, (a, b) in enumerate(zip(plain, grads)):
            assert_close(a, b, "%s alone: gradient %d" % (label, i), scale)


def _minority(stats, limit=0.5):
    print("\n%d examples, 'memory' found no bottleneck in %d; %s" % (
        stats["examples"], stats["no_bottleneck"],
        ", ".join("%s: %d" % kv for kv in sorted(stats.items())
                  if kv[0] not in ("examples", "no_bottleneck"))))
    assert stats["examples"] > 0
    assert stats["no_bottleneck"] <= limit * stats["examples"], (
        "NoBottleneckError in %d of %d examples: the generator must keep these a minority"
        % (stats["no_bottleneck"], stats["examples"]))


# ---------------------------------------------------------------- the tests

@pytest.mark.heavy
def test_random_dags_session():
    stats = collections.Counter()

    @settings(parent=PROFILE, max_examples=N)
    @given(spec=graphgen.specs(min_ops=5, max_ops=60))
    def check(spec):
        run_session_example(spec, stats)

    check()
    _minority(stats)


@pytest.mark.heavy
def test_random_dags_tf_function():
    stats = collections.Counter()

    @settings(parent=PROFILE, max_examples=N_FUNCTION)
    @given(spec=graphgen.specs(min_ops=5, max_ops=30))
    def check(spec):
        run_function_example(spec, stats)

    check()
    _minority(stats)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["session", "tf_function", "xla"])
def test_weak_spots(mode):
    """Loops (stateful ones too, and ones reading a variable written later),
    conds, nested calls, custom gradients, Pow/GELU and float32 conv + bias:
    every strategy, with and without offloading, and a budget; in a Session,
    in a tf.function, and jit-compiled by XLA (against plain XLA)."""
    stats = collections.Counter()
    run, examples, max_ops = {
        "session": (run_session_example, N_WEAK, 24),
        "tf_function": (run_function_example, N_WEAK_FUNCTION, 16),
        "xla": (functools.partial(run_function_example, jit_compile=True), N_WEAK_XLA, 16),
    }[mode]

    @settings(parent=PROFILE, max_examples=examples)
    @given(spec=graphgen.specs(min_ops=4, max_ops=max_ops, weak_spots=True))
    def check(spec):
        if mode == "xla":
            assume(not graphgen.without_xla_kernels(spec))   # tf.print, fractional pools
        run(spec, stats, CONFIGS, oracle=False)

    check()
    _minority(stats)


@pytest.mark.heavy
def test_no_bottleneck_only_when_none_exists_strict():
    """When 'memory' gives up, no tensor may cut activations off from the ys,
    counting xs (always-live inputs) as no path at all."""

    @settings(parent=PROFILE, max_examples=N_STRICT, phases=[Phase.explicit, Phase.generate])
    @given(spec=graphgen.specs(min_ops=5, max_ops=40, allow_dropout=False))
    def check(spec):
        note(repr(spec))
        graph = tf.Graph()
        with graph.as_default():
            built = graphgen.build(tf, spec, graphgen.make_variables(tf, spec))
            try:
                memsave.plan(built["ys"], built["xs"], checkpoints="memory", min_checkpoint_size=0)
            except memsave.NoBottleneckError:
                found = brute_force_bottlenecks(built["ys"], built["xs"], strict=True)
                assert not found, "NoBottleneckError, but %s cut the graph" % found

    check()


def test_weight_decay_chain_has_bottlenecks():
    """An L2 term joins every weight to the loss; the layers still cut the chain."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        ws = [tf.Variable(rng.randn(8, 8).astype(np.float32) * 0.3) for _ in range(8)]
        h = tf.constant(np.ones((4, 8), np.float32))
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h) + 1e-3 * tf.add_n([tf.reduce_sum(w * w) for w in ws])
        assert brute_force_bottlenecks([loss], ws, strict=True)  # h1..h7 each cut the chain
        plan = memsave.plan(loss, ws, checkpoints="memory", min_checkpoint_size=0)
    assert plan.checkpoints


def test_shared_weight_rnn_keeps_inner_checkpoints():
    """One weight read by every step of an unrolled RNN must not hide the bottlenecks."""
    graph = tf.Graph()
    with graph.as_default():
        w = tf.Variable(np.eye(8, dtype=np.float32) * 0.5)
        h = tf.constant(np.ones((4, 8), np.float32))
        hs = []
        for _ in range(16):
            h = tf.tanh(tf.matmul(h, w))
            hs.append(h)
        loss = tf.reduce_sum(h)
        plan = memsave.plan(loss, [w], checkpoints="memory", min_checkpoint_size=0)
    # A step's matmul output cuts the chain as well as its tanh output.
    inner = {t.name for h in hs[:-2] for t in (h, h.op.inputs[0])}
    assert inner & set(plan.checkpoints), plan.checkpoints


def test_brute_force_agrees_with_a_known_graph():
    """The independent checker itself: a chain has bottlenecks, a diamond's
    branches do not (each is bypassed by the other)."""
    graph = tf.Graph()
    with graph.as_default():
        w = tf.Variable(np.ones((3, 3), np.float32))
        x = tf.constant(np.ones((2, 3), np.float32))
        a = tf.tanh(tf.matmul(x, w))
        b = tf.sigmoid(a)
        c = tf.tanh(a)
        loss = tf.reduce_sum(b * c)
        found = set(brute_force_bottlenecks([loss], [w]))
    product = loss.op.inputs[0]
    assert a.name in found and product.name in found
    # Cutting the matmul output off only separates w and its read: no activation.
    assert a.op.inputs[0].name not in found
    assert b.name not in found and c.name not in found


@pytest.mark.heavy
def test_random_dags_nested_xs():
    """xs where one x is computed from another (e.g. an input and a hidden layer)."""

    @settings(parent=PROFILE, max_examples=max(N // 8, 10),
              phases=[Phase.explicit, Phase.generate])
    @given(spec=graphgen.specs(min_ops=5, max_ops=30, nested_xs=True))
    def check(spec):
        assume(graphgen.has_nested_xs(spec))
        run_session_example(spec, collections.Counter())

    check()


def test_nested_xs_minimal():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.linspace(-1, 1, 6, dtype=np.float32))
        h = tf.tanh(x)
        a = tf.tanh(h)
        loss = tf.reduce_sum(tf.tanh(a))
        plain = tf.gradients(loss, [x, h])
        ours = memsave.gradients(loss, [x, h], checkpoints=[a])
        assert [g is None for g in ours] == [g is None for g in plain]
        with tf.compat.v1.Session(graph=graph) as sess:
            for p, o in zip(*sess.run([plain, ours])):
                assert_close(p, o, "nested x")
