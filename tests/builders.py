"""Graph builders many tests share (as fixtures, see conftest.py).

Every test used to grow its own tanh(matmul) chain; these are that chain,
seeded, for a tf.Graph and for a planning graph (which needs no TensorFlow,
so importing this module does not load it).
"""

import collections

import numpy as np

from memsave.planning import PlanGraph

MB = 2**20

Chain = collections.namedtuple("Chain", "graph x ws hs loss")


def tanh_chain(n=6, batch=4, width=8, scale=0.3, square=True, graph=None, seed=0,
               residual=False, activation=None):
    """x -> tanh(h @ w_i) n times -> sum(h * h) (or sum(h)), in a tf.Graph.

    The variables are named w0, w1, ... and the input x, so tests can name them.
    With ``residual``, each layer is h + tanh(h @ w_i), a residual stream as
    in transformers and ResNets, and ``hs`` are the matmul outputs.
    ``activation`` replaces tanh (``gelu``, below).
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    activation = activation or tf.tanh
    graph = graph or tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(seed)
        ws = [tf.Variable(rng.randn(width, width).astype(np.float32) * scale, name="w%d" % i)
              for i in range(n)]
        x = tf.constant(rng.randn(batch, width).astype(np.float32), name="x")
        h, hs = x, []
        for w in ws:
            a = tf.matmul(h, w)
            h = h + activation(a) if residual else activation(a)
            hs.append(a if residual else h)
        loss = tf.reduce_sum(h * h) if square else tf.reduce_sum(h)
    return Chain(graph, x, ws, hs, loss)


def gelu(h):
    """tf.nn.gelu's tanh approximation, Keras' (and BERT's, GPT-2's) GELU."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return tf.nn.gelu(h, approximate=True)


def plan_chain(n, size=MB, op_types=("Tanh",), expensive=("MatMul",), saved=True):
    """x -> a0 -> ... -> a{n-1} -> y as a PlanGraph; layer i's op type cycles
    through ``op_types`` (those in ``expensive`` get the expensive and
    split-gradient flags, as the TF side gives MatMul)."""
    g = PlanGraph()
    g.add_tensor("x", order=-1, bytes=0, elements=size // 4, cost=1.0, x=True,
                 op_type=op_types[0])
    prev = "x"
    for i in range(n):
        kind = op_types[i % len(op_types)]
        heavy = kind in expensive
        g.add_tensor("a%d" % i, order=i, elements=size // 4, bytes=size, cost=1.0,
                     op_type=kind, saved=saved, candidate=True, expensive=heavy,
                     split_gradient=heavy)
        g.add_edge(prev, "a%d" % i)
        prev = "a%d" % i
    g.add_tensor("y", order=n, elements=size // 4, bytes=size, cost=1.0, op_type=op_types[0],
                 y=True)
    g.add_edge(prev, "y")
    return g

