"""Offloading checkpoints to host memory: gradients, graph structure, estimates.

There is no GPU here, so device memory cannot be measured: host and device
are the same memory. What is checked is what a GPU run relies on: exact
gradients, where every swap op is placed, which ops read what, when swap-ins
are triggered, and the planner's device-peak estimate.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.graph import topo_order
from memsave.planning import OffloadModel, PlanGraph, optimal
from tests import models
from tests.helpers import assert_same, run_function, run_session

MODES = {"session": run_session, "function": run_function}
GPU = "/device:GPU:0"
HOST = "/device:CPU:0"


# ------------------------------------------------------------------ gradients

@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", ["chain20", "resnet", "unet", "dropout", "embedding"])
@pytest.mark.parametrize("strategy", ["optimal", "memory"])
def test_offloaded_gradients_equal_plain(name, strategy, mode):
    model = models.ALL[name]()
    if strategy == "memory" and name == "unet":
        strategy = "list"     # U-Nets have no bottleneck for 'memory'
    pattern, values = MODES[mode](model, strategy, memsave_kwargs={"offload": "auto"})
    assert_same(pattern, values)


def _unet_offloading_tags():
    """Plain and memsave gradients of a U-Net whose tagged tensors (one per level)
    are the only checkpoints, all offloaded."""
    model = models.ALL["unet"]()
    vs = model.variables()

    def grads():
        out = model.forward(vs)
        plain = tf.gradients(out["ys"], out["xs"])
        ours = memsave.gradients(out["ys"], out["xs"], checkpoints=[], offload=out["tag"])
        return plain, ours
    return grads


def test_offloaded_list_on_unet_session():
    graph = tf.Graph()
    with graph.as_default():
        plain, ours = _unet_offloading_tags()()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            values = sess.run(list(zip(plain, ours)))
    assert_same(([False] * len(plain), [g is None for g in ours]), values)


def test_offloaded_list_on_unet_function():
    values = tf.function(_unet_offloading_tags())()
    pairs = [(a.numpy(), b.numpy()) for a, b in zip(*values)]
    assert_same(([False] * len(pairs), [False] * len(pairs)), pairs)


# ------------------------------------------------------------------ structure

def _gpu_chain(n=12, ahead=1, groupby=5, strategy="memory", offload="auto"):
    graph = tf.Graph()
    with graph.as_default(), tf.device(GPU):
        rng = np.random.RandomState(0)
        ws = [tf.Variable(rng.randn(16, 16).astype(np.float32) * 0.3) for _ in range(n)]
        h = tf.constant(rng.randn(8, 16).astype(np.float32))
        hs = []
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
            hs.append(h)
        loss = tf.reduce_sum(h * h)
        before = set(graph.get_operations())
        plan = memsave.plan(loss, ws, checkpoints=strategy, min_checkpoint_size=0,
                            offload=offload if offload == "auto" else offload(hs),
                            offload_model=OffloadModel(swapin_ahead=ahead))
        grads = memsave.gradients(loss, ws, checkpoints=strategy, min_checkpoint_size=0,
                                  offload=offload if offload == "auto" else offload(hs),
                                  offload_model=OffloadModel(swapin_ahead=ahead,
                                                             swapin_groupby=groupby))
        plain = tf.gradients(loss, ws)
    return graph, before, plan, grads, plain


def _swaps(graph, plan):
    """{offloaded name: (swap-out ops, swap-in ops)}."""
    out = {}
    for name in plan.offloaded:
        t = graph.get_tensor_by_name(name)
        outs = [c for c in t.consumers() if c.name.endswith("/swap_out")]
        ins = [c for o in outs for c in o.outputs[0].consumers() if "/swap_in" in c.name]
        out[name] = (outs, ins)
    return out


def test_swap_ops_placement_and_readers():
    graph, before, plan, grads, plain = _gpu_chain()
    assert plan.offloaded, plan.summary()
    swaps = _swaps(graph, plan)
    for name, (outs, ins) in swaps.items():
        t = graph.get_tensor_by_name(name)
        assert len(outs) == 1, "%s: %d swap-outs" % (name, len(outs))
        assert outs[0].device == HOST
        assert ins, "%s is never swapped in" % name
        assert all(op.device == t.op.device == GPU for op in ins)
        # No backward op reads the original: only forward ops and the swap-out do.
        strangers = [c.name for c in t.consumers() if c not in before and c is not outs[0]]
        assert not strangers, "%s is read in the backward pass by %s" % (name, strangers)


def test_swap_ins_are_triggered_ahead_without_cycles():
    graph, before, plan, grads, plain = _gpu_chain(ahead=1)
    topo_order(graph.get_operations())   # raises on a cycle (data or control edges)
    for name, (_, ins) in _swaps(graph, plan).items():
        for op in ins:
            assert op.control_inputs, "%s has no trigger" % op.name
            first_use = min(c._id for c in op.outputs[0].consumers())  # pylint: disable=W0212
            # The trigger is a backward op built before the first consumer (or,
            # for the first segment, the loss: nothing of the backward exists yet).
            assert all((c not in before or c.name == "Sum") and c._id < first_use  # noqa
                       for c in op.control_inputs), (op.name, op.control_inputs)


def test_swap_in_without_ahead_waits_for_previous_gradients():
    graph, before, plan, grads, plain = _gpu_chain(ahead=0)
    for name, (_, ins) in _swaps(graph, plan).items():
        for op in ins:
            assert op.control_inputs


@pytest.mark.parametrize("groupby,expected", [(0, 3), (10**6, 1)])
def test_swap_ins_grouped_by_distance(groupby, expected):
    """A tensor read by segments far apart (the top, the one above it, and its
    own, whose tanh gradient reads the kept value): one swap-in each, or one
    shared."""
    graph = tf.Graph()
    with graph.as_default(), tf.device(GPU):
        rng = np.random.RandomState(1)
        ws = [tf.Variable(rng.randn(16, 16).astype(np.float32) * 0.3) for _ in range(8)]
        x = tf.constant(rng.randn(8, 16).astype(np.float32))
        skip = tf.tanh(tf.matmul(x, ws[0]))
        h, cps = skip, []
        for w in ws[1:]:
            h = tf.tanh(tf.matmul(h, w))
            cps.append(h)
        loss = tf.reduce_sum((h + skip) ** 2)   # a long skip: read at the top and the bottom
        grads = memsave.gradients(loss, ws, checkpoints=cps[1::2], offload=[skip],
                                  offload_model=OffloadModel(swapin_groupby=groupby))
        plain = tf.gradients(loss, ws)
    outs = [c for c in skip.consumers() if c.name.endswith("swap_out")]
    ins = [c for c in outs[0].outputs[0].consumers() if "swap_in" in c.name]
    assert len(outs) == 1 and len(ins) == expected, [op.name for op in ins]
    _assert_runs_equal(graph, plain, grads)


def _assert_runs_equal(graph, plain, ours):
    config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        a, b = sess.run([plain, ours])
    for x, y in zip(a, b):
        assert np.max(np.abs(x - y)) <= 1e-6


def test_gpu_placed_graph_runs_with_soft_placement():
    graph, before, plan, grads, plain = _gpu_chain()
    _assert_runs_equal(graph, plain, grads)


@pytest.mark.heavy
def test_two_logical_cpus_stand_in_for_host_and_device(tmp_path):
    """Host CPU:0, device CPU:1: the swap-in runs on CPU:1 (checked in a fresh process,
    since logical devices must be set before TensorFlow starts)."""
    import subprocess
    import sys
    script = tmp_path / "two_cpus.py"
    script.write_text(_TWO_CPUS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout, out.stdout


_TWO_CPUS = r'''
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import memsave
w = [tf.Variable(np.eye(8, dtype=np.float32) * 0.5 + 0.01 * i) for i in range(6)]
x = tf.constant(np.ones((4, 8), np.float32))

@tf.function
def step():
    with tf.device("/device:CPU:1"):
        h, hs = x, []
        for v in w:
            h = tf.tanh(tf.matmul(h, v))
            hs.append(h)
        loss = tf.reduce_sum(h * h)
        ours = memsave.gradients(loss, w, checkpoints=hs[1:-1:2], offload=hs[1:-1:2])
        plain = tf.gradients(loss, w)
    graph = tf.compat.v1.get_default_graph()
    devices = {op.name.rsplit("/", 1)[-1]: op.device for op in graph.get_operations()
               if "swap_" in op.name}
    assert devices["swap_out"].endswith("CPU:0"), devices
    assert devices["swap_in"].endswith("CPU:1"), devices
    return plain, ours

plain, ours = step()
for a, b in zip(plain, ours):
    assert np.max(np.abs(a.numpy() - b.numpy())) <= 1e-6
print("OK")
'''


# ------------------------------------------------------------------ estimates

def _chain_plan_graph():
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        ws = [tf.Variable(rng.randn(64, 64).astype(np.float32) * 0.1) for _ in range(64)]
        h = tf.constant(rng.randn(4096, 64).astype(np.float32))
        acts = []
        for w in ws:
            m = tf.matmul(h, w)
            h = tf.tanh(m)
            acts += [m, h]
        loss = tf.reduce_mean(h * h)
    return graph, ws, acts, loss


def test_everything_offloaded_chain_estimate():
    """64-layer chain, every activation offloaded: the device holds about three."""
    activation = 4096 * 64 * 4
    weights = 64 * 64 * 64 * 4
    graph, ws, acts, loss = _chain_plan_graph()
    with graph.as_default():
        no_prefetch = memsave.plan(loss, ws, checkpoints=[], offload=acts[:-1],
                                   offload_model=OffloadModel(swapin_ahead=0))
        prefetch = memsave.plan(loss, ws, checkpoints=[], offload=acts[:-1])
    print("\n64-layer chain, all offloaded: device %.1f activations (swapin_ahead=0), %.1f "
          "(ahead=1); plain %.1f; host %.1f" % (
              no_prefetch.estimated_peak_bytes / activation,
              prefetch.estimated_peak_bytes / activation,
              prefetch.plain_peak_bytes / activation, prefetch.host_bytes / activation))
    # The weight gradients (64 x 16 KiB) are counted on top.
    assert no_prefetch.estimated_peak_bytes <= 3 * activation + weights
    # Prefetching holds the next swap-in during the last op of a segment.
    assert prefetch.estimated_peak_bytes <= 3 * activation + 2 * weights
    assert prefetch.host_bytes == 127 * activation
    assert prefetch.plain_peak_bytes >= 64 * activation


def test_optimal_auto_lowers_the_device_peak():
    graph, ws, acts, loss = _chain_plan_graph()
    with graph.as_default():
        kept = memsave.plan(loss, ws, checkpoints="optimal")
        moved = memsave.plan(loss, ws, checkpoints="optimal", offload="auto")
    assert moved.offloaded
    assert moved.estimated_peak_bytes < kept.estimated_peak_bytes
    assert "offloads" in moved.summary()


# ------------------------------------------------------------------ cost model

def _planning_graph(op_type, cost):
    """x -> a0 -> ... -> a7 -> y, every tensor 1 MB produced by ``op_type``."""
    g = PlanGraph()
    mb = 2**20
    conv = op_type == "Conv2D"

    def node(name, order, **flags):
        fields = dict(order=order, elements=mb // 4, bytes=0 if flags.get("x") else mb,
                      cost=cost, op_type=op_type, grad_reads_output=False, candidate=True,
                      offloadable=True, expensive=conv, split_gradient=conv)
        fields.update(flags)
        g.add_tensor(name, **fields)

    node("x", -1, x=True, candidate=False, offloadable=False)
    prev = "x"
    for i in range(8):
        node("a%d" % i, i)
        g.add_edge(prev, "a%d" % i)
        prev = "a%d" % i
    node("y", 8, y=True, candidate=False, offloadable=False)
    g.add_edge(prev, "y")
    return g


def test_cost_model_offloads_expensive_and_recomputes_cheap():
    model = OffloadModel(host_bandwidth=25e9, device_flops=1.5e13)
    conv = _planning_graph("Conv2D", cost=2.0 * 2**18 * 2304)    # 1152 FLOPs per byte
    tanh = _planning_graph("Tanh", cost=2.0**18)
    assert model.worth_offloading(conv, "a3")
    assert not model.worth_offloading(tanh, "a3")
    assert not model.worth_offloading(conv, "y")


def test_budget_prefers_offloading_expensive_tensors():
    """Under a tight budget, conv outputs go to the host rather than being recomputed."""
    model = OffloadModel()
    conv = _planning_graph("Conv2D", cost=2.0 * 2**18 * 2304)
    plan = optimal(conv, budget=0.5, offload="auto", model=model)
    assert plan.offloaded and plan.estimated_peak_bytes <= 0.5 * plan.plain_peak_bytes
    # Keeping two of the eight would fit too (5 of 11 MB), but recomputes six convolutions.
    assert plan.recompute_fraction <= 1 / 27 + 1e-9   # only y (a ninth of the forward FLOPs)
    cheap = _planning_graph("Tanh", cost=2.0**18)
    plan = optimal(cheap, budget=0.6, offload="auto", model=model)
    assert not plan.offloaded, plan.summary()


# ------------------------------------------------------------------ errors and logs

def _small():
    graph = tf.Graph()
    with graph.as_default():
        ws = [tf.Variable(np.eye(4, dtype=np.float32)) for _ in range(4)]
        h = tf.constant(np.ones((2, 4), np.float32))
        hs = []
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
            hs.append(h)
        loss = tf.reduce_sum(h)
    return graph, ws, hs, loss


@pytest.mark.parametrize("bad,error,match", [
    ("sometimes", ValueError, "offload must be None, 'auto' or a list"),
    (3, TypeError, "offload must be None, 'auto' or a list"),
    (["h"], TypeError, "list of graph tensors"),
])
def test_bad_offload_argument(bad, error, match):
    graph, ws, hs, loss = _small()
    with graph.as_default(), pytest.raises(error, match=match):
        memsave.gradients(loss, ws, checkpoints="memory", offload=bad)


def test_offloading_a_y_or_an_x_is_refused():
    graph, ws, hs, loss = _small()
    with graph.as_default():
        with pytest.raises(ValueError, match="cannot offload .*Sum"):
            memsave.gradients(loss, ws, checkpoints=[hs[1]], offload=[loss])
        x = hs[0].op.inputs[0].op.inputs[0]
        with pytest.raises(ValueError, match="cannot offload"):
            memsave.gradients(loss, ws + [x], checkpoints=[hs[1]], offload=[x])


@pytest.mark.parametrize("fields,match", [
    ({"swapin_ahead": -1}, "swapin_ahead must be an int >= 0"),
    ({"swapin_groupby": 1.5}, "swapin_groupby must be an int >= 0"),
    ({"host_bandwidth": 0}, "host_bandwidth must be a positive number"),
])
def test_bad_swap_settings(fields, match):
    with pytest.raises(ValueError, match=match):
        OffloadModel(**fields)


def test_offload_settings_are_an_offload_model():
    graph, ws, hs, loss = _small()
    with graph.as_default():
        with pytest.raises(TypeError, match="OffloadModel"):
            memsave.gradients(loss, ws, checkpoints=[hs[1]], offload=[hs[1]], swapin_ahead=0)
        with pytest.raises(TypeError, match="offload_model must be a memsave.OffloadModel"):
            memsave.gradients(loss, ws, checkpoints=[hs[1]], offload=[hs[1]],
                              offload_model={"swapin_ahead": 0})


def test_cpu_only_says_offloading_saves_nothing(caplog):
    graph, ws, hs, loss = _small()
    with graph.as_default(), caplog.at_level(logging.INFO, logger="memsave"):
        memsave.gradients(loss, ws, checkpoints=[hs[1]], offload=[hs[1]])
    assert any("no GPU" in r.getMessage() and r.levelno == logging.INFO
               for r in caplog.records), [r.getMessage() for r in caplog.records]
