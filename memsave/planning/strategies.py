"""The built-in checkpoint strategies 'memory' and 'speed' (no TensorFlow here).

They work on a :class:`~memsave.planning.dag.PlanGraph` and return a
:class:`~memsave.planning.plan.Plan`; 'optimal' is in
:mod:`memsave.planning.optimal`. :func:`plan_for` turns any kept set into a
Plan with estimates, which is what user-defined strategies get too.
"""

import dataclasses
import logging

import networkx as nx

from memsave.errors import NoBottleneckError
from memsave.planning.dag import node_bytes, nodes_where, saved_bytes, topological, validate
from memsave.planning.offload import OffloadModel, host_bytes, offloadable
from memsave.planning.plan import Plan
from memsave.planning.simulate import (prepare, recompute_cost, shared_recomputation,
                                       plain_peak, simulate_peak)

logger = logging.getLogger("memsave")

_SINK = ("memsave", "sink")


def plan_for(graph, chosen, strategy, notes=(), prepared=None):
    """A :class:`Plan` that keeps ``chosen`` (names in ``graph``), with estimates
    (``prepared``: the strategy's :func:`prepare` of ``graph``, if it made one)."""
    chosen = topological(graph, set(chosen))
    forced = nodes_where(graph, "forced")
    prepared = prepared or prepare(graph)
    peak = simulate_peak(graph, set(chosen) | set(forced), prepared)
    plain = plain_peak(graph, prepared)
    # Nothing kept at all is plain backprop, which recomputes nothing.
    work = recompute_cost(graph, chosen, prepared) if chosen or forced else 0.0
    return Plan(strategy=strategy, checkpoints=chosen, forced=forced,
                estimated_peak_bytes=peak, plain_peak_bytes=plain, notes=list(notes),
                recompute_fraction=work / step_work(graph))


# A training step in forward passes: a matmul's or convolution's backward
# computes the gradients of both operands, about twice its forward FLOPs.
# Recompute fractions and max_recompute count in steps, what a user sees as
# step time (Megatron-LM states its selective recomputation's cost so too).
FORWARDS_PER_STEP = 3.0


def forward_work(graph):
    """The work of one forward pass (``cost`` summed)."""
    return sum(d["cost"] for _, d in graph.nodes(data=True) if not d["x"])


# The one wording of a bad max_recompute, for the options' check at call time
# (memsave.settings) and optimal()'s own (called directly on a PlanGraph).
MAX_RECOMPUTE_ERROR = ("max_recompute must be a fraction of a training step's work >= 0 "
                       "(0.05: at most 5%% extra work), got %r")


def step_work(graph):
    """The work of one training step, :data:`FORWARDS_PER_STEP` forward passes:
    what recompute fractions and ``max_recompute`` count in."""
    return FORWARDS_PER_STEP * (forward_work(graph) or 1.0)


def with_offload(graph, plan, names=None, model=None):
    """``plan`` with tensors moved to the host between forward and backward.

    ``names=None`` offloads every kept tensor that can be (what
    ``offload='auto'`` means for strategies other than 'optimal', which
    weighs each tensor itself). Named tensors that the plan does not keep
    become checkpoints. The estimated peak becomes a device peak.
    """
    model = model or OffloadModel()
    if names is None:
        names = offloadable(graph, plan.kept)
    chosen = topological(graph, set(plan.checkpoints) | (set(names) - set(plan.forced)))
    names = topological(graph, set(names))
    peak = simulate_peak(graph, set(chosen) | set(plan.forced), offloaded=names,
                         prefetch=model.prefetch)
    return dataclasses.replace(plan, checkpoints=chosen, estimated_peak_bytes=peak,
                               offloaded=names, host_bytes=host_bytes(graph, names))


def explicit(graph, names, strategy="list"):
    """Keep exactly ``names`` (those that are valid checkpoints).

    Names that are xs or ys are ignored (DEBUG log); names off the xs->ys
    path are reported by the caller before they reach here.
    """
    validate(graph)
    chosen = []
    for n in names:
        data = graph.nodes.get(n)
        if data is None:
            continue
        if data["x"] or data["y"]:
            logger.debug("memsave: checkpoint %s is an x or a y; ignored", n)
            continue
        chosen.append(n)
    return plan_for(graph, chosen, strategy)


def speed_candidates(graph):
    """Candidate tensors produced by expensive ops, in graph order."""
    return topological(graph, [n for n, d in graph.nodes(data=True)
                               if d["candidate"] and d["expensive"]])


def recompute_once(graph, kept, prepared=None, rounds=8, latest=True):
    """``kept`` grown until no tensor is recomputed by more than one segment.

    The rewrite copies what each segment needs down to the kept tensors, so
    an unkept tensor below kept tensors of several segments is recomputed
    once per segment: keeping only the matmul outputs of a transformer
    recomputes the residual stream from the embeddings in every segment
    (quadratic in depth). Each round keeps the latest such tensors, which
    ends the walks that went further back; with ``latest=False``, every
    one of them (see :func:`speed`).
    """
    prepared = prepared or prepare(graph)
    kept = list(kept)
    for _ in range(rounds):
        shared = shared_recomputation(graph, kept, prepared, latest=latest)
        if not shared:
            break
        kept += shared
    return topological(graph, set(kept))


def speed(graph):
    """Keep the outputs of expensive ops (matmuls, convolutions, einsums), and
    what several segments would otherwise each recompute.

    Backprop then recomputes only cheap elementwise work, once, so the step
    time barely rises; memory drops less than with 'memory'. To keep the
    outputs of other op types, use :func:`memsave.planning.keep_op_types`.
    Where that still recomputes more than a forward pass, everything several
    segments recompute is kept: for a recurrence whose state every step's
    projection reads (Qwen3.5's gated delta rule over 32 tokens), each
    round keeps one more step's state, and after eight the state chain
    below was recomputed once per step (405% of a training step, a step 14
    times plain's).
    """
    chosen = speed_candidates(validate(graph))
    notes = [] if chosen else ["no matmul/conv/einsum outputs between xs and ys"]
    prepared = prepare(graph)
    if chosen:
        chosen = recompute_once(graph, chosen, prepared)
        if recompute_cost(graph, chosen, prepared) > forward_work(graph):
            chosen = recompute_once(graph, chosen, prepared, latest=False)
    return plan_for(graph, chosen, "speed", notes, prepared)


def bottlenecks(graph, shared_buffers_weigh=False):
    """Tensors whose removal cuts some activations off from the ys.

    These are the articulation points of the undirected region without the
    xs, their variable reads and the tensors no y depends on (with a sink
    joined to every y) that separate
    some activation bytes from the sink: everything on the far side is an
    ancestor that the checkpoint lets backprop forget. A tensor in its
    input's buffer (a reshape) holds no activation bytes of its own unless
    ``shared_buffers_weigh`` (see :func:`memory_spacing`). Returned in
    topological order.
    """
    und = _live_undirected(graph)
    if und.number_of_nodes() < 3:
        return []
    aps = set(nx.articulation_points(und))
    if not aps:
        return []

    def weight(n):
        # Activation bytes (an unknown size counts). A tensor in its input's
        # buffer (a reshape) holds none of its own: a reshaped weight, alone
        # beyond a matmul, made each projection of keras-hub's attention a
        # "bottleneck".
        if n == _SINK or (graph.nodes[n]["shares_buffer"] is not None
                          and not shared_buffers_weigh):
            return 0
        b = graph.nodes[n]["bytes"]
        return 1 if b is None else b

    parents, below = _bytes_below_cuts(und, aps, weight)
    found = [n for n in aps if n != _SINK and ("cut", n) in parents
             and below[("cut", n)] - weight(n) > 0]
    return topological(graph, found)


def _live_undirected(graph):
    """The region as an undirected graph of what backprop keeps alive, joined at a sink."""
    und = nx.Graph(graph.to_undirected(as_view=True))
    # xs and reads of them are alive for the whole step: a path through them
    # (a weight shared by layers, a weight-decay term) never makes backprop
    # keep or recompute an activation, so it must not hide a bottleneck.
    und.remove_nodes_from([n for n, d in graph.nodes(data=True)
                           if d["x"] or d["input_read"]])
    ys = [n for n, d in graph.nodes(data=True) if d["y"]]
    # Outputs no y reads (a batch norm's batch statistics) come and go with
    # their op: hanging off one input, they would make it look like a cut.
    live = set(ys).union(*(nx.ancestors(graph, y) for y in ys))
    und.remove_nodes_from([n for n in graph if n not in live])
    und.add_edges_from((_SINK, y) for y in ys)
    return und


def _bytes_below_cuts(und, aps, weight):
    """The block-cut tree rooted at the sink: (parents, bytes of each subtree).

    A cut vertex's subtree is exactly what its removal disconnects from the sink.
    """
    tree = nx.Graph()
    own = {}
    root = ("cut", _SINK) if _SINK in aps else None
    for i, block in enumerate(nx.biconnected_components(und)):
        node = ("block", i)
        own[node] = sum(weight(n) for n in block if n not in aps)
        tree.add_node(node)
        if root is None and _SINK in block:
            root = node
        tree.add_edges_from((node, ("cut", n)) for n in block if n in aps)
    for n in aps:
        own[("cut", n)] = weight(n)
    parents = dict(nx.bfs_predecessors(tree, root))
    below = dict(own)
    for node in reversed([root] + list(parents)):
        if node in parents:
            below[parents[node]] += below[node]
    return parents, below


def memory(graph, min_checkpoint_size=1024):
    """Keep about sqrt(N) bottleneck tensors, spaced to minimize the peak.

    Bottlenecks are tensors of at least ``min_checkpoint_size`` elements
    that cut the graph (see :func:`bottlenecks`); how many are kept and
    where follows the peak model of :func:`_best_spacing`, which lands near
    the square root of the depth.
    Small tensors are never chosen: keeping them saves nothing.
    Raises :class:`NoBottleneckError` when the graph has no bottleneck
    (e.g. a U-Net, whose skip connections bypass every tensor).
    """
    chosen, found, sized = memory_spacing(graph, min_checkpoint_size)
    return plan_for(graph, chosen, "memory",
                      ["%d bottleneck(s) among %d activations; kept %d" % (
                          len(found), sized, len(chosen))])


def memory_spacing(graph, min_checkpoint_size=1024, shared_buffers_weigh=False):
    """What :func:`memory` keeps, without its plan's estimates (for planners
    that estimate it themselves): ``(kept names, bottlenecks of at least
    that size, count of candidates of at least that size)``.

    ``shared_buffers_weigh``: bottlenecks as though a reshape held bytes of
    its own, so that a matmul reading a reshaped weight cuts the graph (see
    :func:`memsave.planning.optimal._candidate_kept_sets`)."""
    if min_checkpoint_size < 0:
        raise ValueError("min_checkpoint_size must be >= 0, got %r" % (min_checkpoint_size,))
    validate(graph)

    def big(n):
        # An element count made with unknown dimensions taken as 1 is only a
        # lower bound (Keras retraces the last, smaller batch with an unknown
        # batch size): it cannot rule a tensor out.
        d = graph.nodes[n]
        e = d["elements"]
        return e is None or not d["sized_exactly"] or e >= min_checkpoint_size

    sized = sum(1 for n, d in graph.nodes(data=True) if d["candidate"] and big(n))
    cuts = [n for n in bottlenecks(graph, shared_buffers_weigh) if graph.nodes[n]["candidate"]]
    found = [n for n in cuts if big(n)]
    if cuts and not found:
        raise NoBottleneckError(
            "checkpoints='memory' found %d bottleneck tensor(s) between xs and ys, all "
            "smaller than min_checkpoint_size=%d elements, so keeping them saves "
            "nothing. Lower min_checkpoint_size, or use checkpoints='optimal'."
            % (len(cuts), min_checkpoint_size))
    if not found:
        raise NoBottleneckError(
            "checkpoints='memory' found no bottleneck tensor (of at least %d elements) "
            "between xs and ys: every activation is bypassed by another path, as in "
            "U-Nets or dense blocks. Use checkpoints='optimal' (any graph), "
            "checkpoints='collection' with tensors added to the 'checkpoints' "
            "collection, or pass an explicit list of tensors." % min_checkpoint_size)
    chosen, _ = _best_spacing(graph, found)
    return chosen, found, sized


def _best_spacing(graph, found):
    """Bottlenecks spaced so that the modelled peak is as low as possible.

    Segments are processed from the ys down; while the segment just above
    checkpoint i is recomputed, checkpoints 1..i are still alive (those
    above were consumed already). So the peak is the worst, over segments, of
    the checkpoints below it plus the segment's saved bytes. Lower segments
    can therefore be longer than upper ones: for a uniform chain of n layers
    this keeps about sqrt(2n) checkpoints and peaks near sqrt(2n) layers,
    where equal spacing peaks near 2*sqrt(n). We binary-search the peak and
    place checkpoints greedily (each as far up as the peak allows).
    Returns (checkpoints, modelled peak bytes).
    """
    running, position = 0, {}
    for n in topological(graph, [n for n, d in graph.nodes(data=True) if not d["x"]]):
        running += saved_bytes(graph, n)
        position[n] = running
    sizes = [node_bytes(graph, n) for n in found]
    cuts = [position[n] for n in found]

    def place(peak):
        chosen, alive, last, i = [], 0, 0, 0
        while running - last > peak - alive:
            best = None
            while i < len(found) and cuts[i] - last <= peak - alive:
                if cuts[i] > last:
                    best = i
                i += 1
            if best is None:
                return None
            chosen.append(found[best])
            alive += sizes[best]
            last = cuts[best]
            i = best + 1
        return chosen

    low, high = 0, running
    while low < high:
        mid = (low + high) // 2
        if place(mid) is None:
            low = mid + 1
        else:
            high = mid
    return place(low), low
