"""Strategies on plain networkx graphs: no TensorFlow involved."""

import math

import pytest

from tests.builders import plan_chain
from memsave.planning import (NoBottleneckError, PlanGraph, bottlenecks, explicit, memory,
                              speed)

MB = 2**20


def _node(g, name, order, op_type="Tanh", x=False, y=False, saved=True, size=MB):
    matmul = op_type == "MatMul"
    g.add_tensor(name, order=order, elements=size // 4, bytes=0 if x else size, cost=1.0,
                 op_type=op_type, x=x, y=y, saved=saved, candidate=not (x or y),
                 expensive=matmul, split_gradient=matmul)


def chain(n):
    """x -> a0 -> a1 -> ... -> y, one saved activation per layer (odd layers: MatMul)."""
    return plan_chain(n, op_types=("Tanh", "MatMul"))


def test_memory_on_a_chain_keeps_about_sqrt_2n():
    for n in (16, 100, 400):
        p = memory(chain(n))
        k = len(p.checkpoints)
        assert 0.5 * math.sqrt(2 * n) <= k <= 2 * math.sqrt(2 * n), (n, k)
        # The modelled peak is near sqrt(2n) activations, far below n.
        assert p.estimated_peak_bytes <= 2 * math.sqrt(2 * n) * MB
        # Plain keeps every activation (y included) plus a few gradients in flight.
        assert (n + 1) * MB <= p.plain_peak_bytes <= (n + 5) * MB


def test_bottlenecks_skip_bypassed_tensors():
    g = chain(6)
    g.add_edge("a1", "a4")  # a skip over a2 and a3
    found = bottlenecks(g)
    assert "a2" not in found and "a3" not in found
    assert {"a1", "a4", "a5"} <= set(found)


def test_side_outputs_no_y_reads_make_no_bottleneck():
    """A batch norm's statistics hang off its input; they must not make that
    input look like a cut inside a residual block."""
    g = chain(6)
    g.add_edge("a1", "a4")          # the block's skip over a2 and a3
    _node(g, "a2_mean", 2.5)        # a second output of a2's consumer, read by nothing
    g.add_edge("a2", "a2_mean")
    found = bottlenecks(g)
    assert "a2" not in found and "a2_mean" not in found
    assert {"a1", "a4", "a5"} <= set(found)


def test_no_bottleneck_raises_with_alternatives():
    g = PlanGraph()
    _node(g, "x", -1, x=True)
    _node(g, "a", 0)
    _node(g, "b", 1)
    _node(g, "y", 2, y=True)
    g.add_edges_from([("x", "a"), ("x", "b"), ("a", "y"), ("b", "y")])
    with pytest.raises(NoBottleneckError, match="'optimal'"):
        memory(g)


def test_small_tensors_are_not_checkpoints():
    g = chain(50)
    for n in g.nodes:
        g.nodes[n]["elements"] = 10
    with pytest.raises(NoBottleneckError):
        memory(g, min_checkpoint_size=1024)


def test_speed_keeps_matmul_outputs():
    p = speed(chain(10))
    assert p.checkpoints == ["a1", "a3", "a5", "a7", "a9"]


def test_explicit_ignores_xs_and_ys():
    p = explicit(chain(10), ["x", "a3", "y", "a7"])
    assert p.checkpoints == ["a3", "a7"]
    assert "checkpoint" in p.summary()


def test_a_reshaped_weight_makes_no_bottleneck():
    """A residual block whose matmul reads a reshaped weight: the reshape is in
    the weight's buffer, so the matmul cuts no activation off (a bottleneck
    once, that made 'memory' keep every projection of keras-hub's attention);
    the block's input and output do."""
    g = PlanGraph()
    _node(g, "x", -1, x=True)
    _node(g, "h0", 0)
    g.add_edge("x", "h0")
    prev, order = "h0", 1
    for i in range(3):
        w, r, q, t, h = ("w%d" % i, "r%d" % i, "q%d" % i, "t%d" % i, "h%d" % (i + 1))
        _node(g, w, -2 - i, x=True)
        g.add_tensor(r, order=order, elements=MB // 4, bytes=MB, cost=0.0, op_type="Reshape",
                     saved=False, candidate=True, shares_buffer=w)
        _node(g, q, order + 1, op_type="MatMul")
        _node(g, t, order + 2)
        _node(g, h, order + 3, op_type="AddV2", saved=False)
        g.add_edges_from([(w, r), (r, q), (prev, q), (q, t), (prev, h), (t, h)])
        prev, order = h, order + 4
    _node(g, "y", order, y=True)
    g.add_edge(prev, "y")
    found = set(bottlenecks(g))
    assert not found & {"q0", "q1", "q2", "r0", "r1", "r2"}, found
    assert {"h1", "h2"} <= found
