"""The planning graph: the one schema every strategy, the estimator and the
TF side (``memsave.graph.region.to_plan_graph``) agree on.

A :class:`PlanGraph` is a networkx DiGraph whose nodes are tensors and whose
edges go from an op's inputs to its outputs. Every node carries exactly the
fields of :class:`TensorNode`; :meth:`PlanGraph.add_tensor` is the only way
nodes are made, so readers index ``graph.nodes[n]["bytes"]`` without
guessing defaults. Op semantics reach the planners as neutral flags
(``expensive``, ``split_gradient``, ...), never as TensorFlow op names:
``op_type`` is carried for people and for policies that match on it.
"""

import dataclasses
import typing

import networkx as nx

from memsave.errors import PlanGraphError


@dataclasses.dataclass(frozen=True)
class TensorNode:
    """What the planners know about one tensor.

    Sizes: ``elements``/``bytes`` are None when the rank is unknown;
    ``sized_exactly`` is False when some dimension was guessed. ``bytes`` of
    an x is not counted (xs live for the whole step). ``cost`` is the work
    of the op that produces the tensor, FLOPs plus memory traffic in
    FLOP-equivalents (recomputing it costs that much).

    Roles: ``x`` (differentiated against; outside the recomputable region),
    ``y`` (differentiated), ``forced`` (kept whatever the strategy: an op
    that must not be recomputed made it), ``candidate`` (a strategy may keep
    it), ``offloadable`` (may wait in host memory between its uses).

    What backprop reads: ``saved`` (some gradient reads it, so plain
    backprop keeps it alive), ``grad_reads_output`` (its producer's gradient
    reads it: a kept copy still runs), ``grad_reads_inputs`` (its producer's
    gradient reads the producer's inputs).

    Op kinds: ``expensive`` (a matmul or convolution: many FLOPs per byte),
    ``split_gradient`` (its producer's gradient is a weight gradient that
    reads the input activation plus an input gradient that does not; the
    rewrite runs the first one first, see :mod:`memsave.planning.rules`),
    ``input_read`` (an alias of an x, such as a variable read: no memory).

    ``grad_bytes`` is the size of the gradient piece each reader's backward
    sends to an x or an alias of one (None: nothing to count). Those pieces
    are not activations, but TensorFlow holds all of a tensor's pieces until
    it sums them, so a weight that an unrolled RNN reads at every step costs
    one piece per step.

    ``shares_buffer``: the input (a predecessor's name) whose buffer this
    tensor is, where its op forwards it (an identity, a reshape): holding
    both costs one buffer, and the gradient may pass through as one too.

    ``scratch_bytes``: what its producer's backward allocates beyond the
    gradients it makes and frees when done (kernel scratch, an XLA-compiled
    call's buffers). Only a measurement knows it: a byte budget's loop sets
    it from a profiled step (see :mod:`memsave.budget`).

    ``state_bytes``: what its producer keeps for its own backward beyond
    its outputs (a while loop's accumulators), held from when the producer
    runs (kept: the forward pass; recomputed: its segment's recomputation)
    until its backward. Set on one output of the producer.
    """

    order: int
    elements: typing.Optional[int] = None
    bytes: typing.Optional[int] = None
    cost: float = 0.0
    op_type: str = ""
    x: bool = False                     # the docstring's roles start here
    y: bool = False
    forced: bool = False
    candidate: bool = False
    offloadable: bool = False
    saved: bool = True                  # what backprop reads
    grad_reads_output: bool = True
    grad_reads_inputs: bool = True
    sized_exactly: bool = True          # a size flag (see Sizes)
    expensive: bool = False             # op kinds
    split_gradient: bool = False
    input_read: bool = False
    grad_bytes: typing.Optional[int] = None
    shares_buffer: typing.Optional[str] = None
    scratch_bytes: int = 0
    state_bytes: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type is bool and not isinstance(value, bool):
                raise PlanGraphError("%s must be a bool, got %r" % (field.name, value))
        if isinstance(self.order, bool) or not isinstance(self.order, (int, float)):
            raise PlanGraphError("order must be a number, got %r" % (self.order,))
        for name in ("elements", "bytes", "grad_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise PlanGraphError("%s must be None or an int >= 0, got %r" % (name, value))
        for name in ("scratch_bytes", "state_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanGraphError("%s must be an int >= 0, got %r" % (name, value))
        if self.shares_buffer is not None and not isinstance(self.shares_buffer, str):
            raise PlanGraphError("shares_buffer must be None or a tensor name, got %r"
                                 % (self.shares_buffer,))
        if isinstance(self.cost, bool) or not isinstance(self.cost, (int, float)) or self.cost < 0:
            raise PlanGraphError("cost must be a number >= 0, got %r" % (self.cost,))
        if self.x and (self.y or self.candidate or self.forced):
            raise PlanGraphError("an x is never a y, a candidate or forced")
        if self.candidate and (self.y or self.forced):
            raise PlanGraphError("ys and forced tensors are kept anyway: not candidates")


FIELDS = tuple(f.name for f in dataclasses.fields(TensorNode))


class NodeRecord(dict):
    """A tensor's fields as a :class:`PlanGraph` stores them: ``node["bytes"]`` or ``node.bytes``.

    The one record strategies, policies and selectors all read.
    """

    __slots__ = ()

    def __getattr__(self, field):
        try:
            return self[field]
        except KeyError:
            raise AttributeError(field) from None


class PlanGraph(nx.DiGraph):
    """A DAG of :class:`TensorNode` tensors (see the module docstring).

    ``graph.nodes[name]`` is the tensor's :class:`NodeRecord`.
    ``unknown_dims`` counts tensors whose shape was not fully known when the
    graph was built; ``compiled`` says XLA compiles the step (its estimates
    are of XLA's buffer assignment, see :mod:`memsave.graph.region`).
    """

    node_attr_dict_factory = NodeRecord

    def add_tensor(self, name, **fields):
        """Add (or replace) tensor ``name``; unknown or ill-typed fields raise."""
        try:
            node = TensorNode(**fields)
        except TypeError as e:
            raise PlanGraphError("tensor %r: %s (fields: %s)" % (name, e, ", ".join(FIELDS))) \
                from None
        # The fields are scalars: a shallow copy is what asdict's deep one gives.
        self.add_node(name, **{f: getattr(node, f) for f in FIELDS})
        return name

    def tensor(self, name):
        """The :class:`TensorNode` of ``name``."""
        return TensorNode(**self.nodes[name])

    @property
    def unknown_dims(self):
        return self.graph.get("unknown_dims", 0)

    @unknown_dims.setter
    def unknown_dims(self, value):
        self.graph["unknown_dims"] = int(value)

    @property
    def compiled(self):
        return self.graph.get("compiled", False)

    @compiled.setter
    def compiled(self, value):
        self.graph["compiled"] = bool(value)

    def validate(self):
        """See :func:`validate`; returns the graph."""
        return validate(self)


def validate(graph):
    """Raise unless ``graph`` keeps the schema: a networkx DiGraph whose nodes
    all carry the :class:`TensorNode` fields (as :meth:`PlanGraph.add_tensor`
    makes them), with edges that follow ``order`` and none into an x, and
    ``shares_buffer`` naming an input.
    Strategies call it first, so a hand-built graph fails with a clear
    message rather than a KeyError deep inside. Returns ``graph``."""
    if not isinstance(graph, nx.DiGraph):
        raise TypeError("a planning graph is a memsave.planning.PlanGraph, got %r" % (graph,))
    nodes = graph.nodes
    for name, data in nodes(data=True):
        if len(data) < len(FIELDS) or any(f not in data for f in FIELDS):
            missing = [f for f in FIELDS if f not in data]
            raise PlanGraphError(
                "tensor %r lacks %s: add nodes with PlanGraph.add_tensor (an edge to an "
                "unknown name creates a bare node)" % (name, ", ".join(missing)))
    for name, data in nodes(data=True):
        source = data["shares_buffer"]
        if source is not None and not graph.has_edge(source, name):
            raise PlanGraphError("tensor %r shares the buffer of %r, which is not one of its "
                                 "inputs" % (name, source))
    for a, b in graph.edges:
        if nodes[b]["x"]:
            raise PlanGraphError("edge %r -> %r: nothing in the graph feeds an x" % (a, b))
        if nodes[a]["order"] >= nodes[b]["order"]:
            raise PlanGraphError("edge %r -> %r goes against the topological order" % (a, b))
    return graph


def node_bytes(graph, name):
    """Bytes of ``name``; 0 when unknown."""
    b = graph.nodes[name]["bytes"]
    return 0 if b is None else b


def saved_bytes(graph, name):
    """Bytes backprop keeps alive for ``name`` (0 if no gradient reads it)."""
    return node_bytes(graph, name) if graph.nodes[name]["saved"] else 0


def topological(graph, names):
    """``names`` sorted by the graph's ``order`` field."""
    return sorted(names, key=lambda n: graph.nodes[n]["order"])


def nodes_where(graph, field):
    """Names whose boolean ``field`` is set, in topological order."""
    return topological(graph, [n for n, d in graph.nodes(data=True) if d[field]])
