"""Estimate the peak of a checkpointed backward pass by simulating it.

The simulation follows the rewrite's schedule on the planning graph: the
segment below the ys first, then the segments below each kept tensor that
a gradient reaches, in reverse topological order. During a segment, memory holds:

- kept tensors that a segment still to come reads (with a copy that runs,
  or in a gradient); a kept tensor nothing reads is freed by the forward pass,
- running gradient sums of kept tensors whose own segment has not run,
- the segment's recomputed activations that some gradient reads
  (``saved``), each freed once the backward sweep passes its producer,
- gradients in flight: the gradient of a tensor lives from when its first
  consumer's backward produces it until its producer's backward consumes it,
- during one backward op, the scratch it allocates (``scratch_bytes``, where
  a measurement has set it).

A matmul or convolution's gradient is two ops (``split_gradient``): the
weight gradient reads the input activation, the input gradient does not.
The rewrite runs the weight gradient first when
:func:`memsave.planning.rules.reducer_runs_first` says so, so an input
activation that no other gradient reads is freed before its own gradient is
allocated.

Memory is counted per buffer: an identity's or a reshape's output is its
input's buffer (``shares_buffer``), so holding both costs it once, and a
gradient that passes through such an op is the same buffer too.

With nothing kept it models plain backprop, which keeps every saved
activation of the forward pass (one segment holding everything).

Gradients of the xs (weights) count too: each reader's backward makes a
piece the size of the x; TensorFlow keeps a tensor's pieces until it sums
them, so pieces pile up until the segment's last one, and one sum per x then
lives to the end of the step. A weight read by every step of an unrolled RNN
is where this matters. Reads of xs (``aliases``) are differentiated in
place, never kept, as the rewrite does.

Offloaded kept tensors live in host memory. On the device, each is swapped
in for the segment that reads it; it stays through that segment's backward
only if a gradient reads it (else it is freed once the segment's forward is
recomputed). With ``prefetch`` the next segment's swap-ins also arrive
during the last step of the current one (``swapin_ahead`` > 0).
"""

import collections

from memsave.planning.dag import node_bytes, topological
from memsave.planning.rules import reducer_runs_first

# ``memo``: what was derived per kept set (see _memo), shared by every
# estimate made with this Prepared: the candidate search simulates, costs
# and grows the same kept sets several times.
Prepared = collections.namedtuple(
    "Prepared",
    "names index size saved reads_output preds ys forced early aliases pieces scratch state "
    "owner passes live reads_inputs cost memo")


def _buffer_owners(graph, names, index):
    """``owner[i]``: the node whose buffer node ``i`` is (``i`` itself, or the
    start of a chain of ``shares_buffer``; -1 for an x's buffer, which is not
    counted), and ``passes[i]``: node ``i``'s gradient reaches its input as
    the same buffer (an identity or a reshape whose gradient reads nothing)."""
    nodes = graph.nodes
    owner = list(range(len(names)))
    passes = [False] * len(names)
    for i, n in enumerate(names):
        source = nodes[n]["shares_buffer"]
        if source is not None:
            owner[i] = owner[index[source]] if source in index else -1
            passes[i] = not (nodes[n]["grad_reads_inputs"] or nodes[n]["grad_reads_output"])
    return owner, passes


def _freed_early(graph, names, size, saved, preds, owner):
    """{consumer: [buffers (owner indices) freed before the consumer's input
    gradient exists]}.

    An input's buffer qualifies when the consumer's gradient is the only one
    that reads it, through the input or any tensor sharing the buffer (no
    producer's gradient reads it, nor does any other consumer's), and the
    rewrite orders the weight gradient first (its result, the size of the
    consumer's other inputs, is small; the input gradient's is the input's
    size).
    """
    nodes = graph.nodes
    sharing = collections.defaultdict(list)
    for i, o in enumerate(owner):
        if o >= 0:
            sharing[o].append(i)
    early = {}
    for i, n in enumerate(names):
        if not nodes[n]["split_gradient"]:
            continue
        for q in preds[i]:
            o = owner[q]
            group = sharing.get(o, ())
            if (o < 0 or not any(saved[t] for t in group)
                    or any(nodes[names[t]]["grad_reads_output"] for t in group)):
                continue
            readers = {c for t in group for c in graph.successors(names[t])
                       if nodes[c]["grad_reads_inputs"]}
            others = sum(size[r] for r in preds[i] if r != q)
            if readers == {n} and reducer_runs_first(size[o], others, size[o]):
                early.setdefault(i, []).append(o)
    return early


def prepare(graph):
    """Index the planning graph once for repeated simulations."""
    names = topological(graph, [n for n, d in graph.nodes(data=True) if not d["x"]])
    index = {n: i for i, n in enumerate(names)}
    size = [node_bytes(graph, n) for n in names]
    saved = [graph.nodes[n]["saved"] for n in names]
    reads_output = [graph.nodes[n]["grad_reads_output"] for n in names]
    preds = [[index[p] for p in graph.predecessors(n) if p in index] for n in names]
    ys = [i for i, n in enumerate(names) if graph.nodes[n]["y"]]
    forced = {i for i, n in enumerate(names) if graph.nodes[n]["forced"]}
    owner, passes = _buffer_owners(graph, names, index)
    early = _freed_early(graph, names, size, saved, preds, owner)
    aliases, pieces = _gradient_pieces(graph, names, index)
    scratch = [graph.nodes[n]["scratch_bytes"] for n in names]
    state = [graph.nodes[n].get("state_bytes", 0) for n in names]
    # What a gradient reaches from the ys: a kept tensor off every path to
    # them (an output nothing consumes) has no backward segment.
    live = [False] * len(names)
    for i in range(len(names) - 1, -1, -1):
        live[i] = graph.nodes[names[i]]["y"] or any(
            live[index[c]] for c in graph.successors(names[i]) if c in index)
    return Prepared(names, index, size, saved, reads_output, preds, ys, forced, early, aliases,
                    pieces, scratch, state, owner, passes, live,
                    [graph.nodes[n]["grad_reads_inputs"] for n in names],
                    [graph.nodes[n]["cost"] for n in names], {})


def _memo(p, kind, kept, make):
    """``make()``, computed once per (``kind``, kept index set) for ``p``."""
    key = (kind, frozenset(kept))
    found = p.memo.get(key)
    if found is None:
        found = p.memo[key] = make()
    return found


def _closures(p, kept):
    """What backprop recomputes per segment with kept indices ``kept``, walked
    once per kept set: ``(top, below)``, ``top`` the ys' segment and
    ``below[k]`` kept node ``k``'s, each ``(sorted members, kept nodes they
    read, the members as a frozenset)``.

    The searches simulate many kept sets that differ in a few places
    (:func:`recompute_once` grows one a few nodes per round; a bisection
    moves a split), so most walks are the same as one made for an earlier
    set, and those are reused. A walk is the same where the new set keeps
    none of its members but its boundary's own kept nodes and keeps every
    kept node it read: it stops at the same places. The same objects come
    back, so what is derived from a walk can be reused too (see
    :func:`_simulate`). A few walks are remembered per boundary.
    """
    kept = frozenset(kept)
    key = ("closures", kept)
    found = p.memo.get(key)
    if found is None:
        walks = p.memo.setdefault("walks", {})
        at_ys = kept.intersection(p.ys)
        top = (_remembered(walks, None, kept, at_ys)
               or _remember(walks, None, _walk(p, p.ys, kept), p.ys, at_ys))
        # A kept node's own walk starts at it, kept: nothing to compare there.
        # (The planner's hottest loop after the simulation: _remembered inlined.)
        below, live, get = {}, p.live, walks.get
        for k in kept:
            if live[k]:
                for walk, inner, _ in get(k, ()):
                    if kept.isdisjoint(inner) and walk[1] <= kept:
                        break
                else:
                    walk = _remember(walks, k, _walk(p, [k], kept), [k], None)
                below[k] = walk
        found = p.memo[key] = (top, below)
    return found


# Walks remembered per boundary for reuse by later kept sets (see _closures).
_WALKS_REMEMBERED = 4


def _remembered(walks, key, kept, at_boundary):
    """A walk remembered under ``key`` that is the same under ``kept`` (see
    :func:`_closures`; ``at_boundary``: the boundary's kept nodes), or None."""
    for walk, inner, was_at_boundary in walks.get(key, ()):
        if was_at_boundary == at_boundary and kept.isdisjoint(inner) and walk[1] <= kept:
            return walk
    return None


def _remember(walks, key, walk, boundary, at_boundary):
    """Remember ``walk`` (of ``boundary``, whose kept nodes were ``at_boundary``)
    under ``key``, newest first; return it."""
    remembered = walks.setdefault(key, [])
    remembered.insert(0, (walk, walk[2].difference(boundary), at_boundary))
    del remembered[_WALKS_REMEMBERED:]
    return walk


def _walk(p, boundary, kept):
    """(sorted :func:`_closure` of ``boundary``, the kept nodes its members
    read, the members as a frozenset)."""
    closure = frozenset(_closure(p, boundary, kept))
    members = sorted(closure)
    return members, {q for n in members for q in p.preds[n] if q in kept}, closure


def _gradient_pieces(graph, names, index):
    """Where gradients of xs are made, as the rewrite makes them.

    Returns (aliases, pieces). ``aliases`` maps each read of an x (a
    variable read, ``input_read`` with only xs as inputs) to that x: the
    rewrite differentiates such a read in place on the way to its x instead
    of keeping it as a checkpoint. ``pieces[i]`` lists (x, bytes) for every
    gradient piece node ``i``'s backward sends to an x, directly or through
    an alias.
    """
    nodes = graph.nodes
    aliases = {}
    for n in names:
        if nodes[n]["input_read"]:
            preds = list(graph.predecessors(n))
            if preds and all(nodes[q]["x"] for q in preds):
                aliases[index[n]] = preds[0]
    pieces = [[] for _ in names]
    for i, n in enumerate(names):
        for q in graph.predecessors(n):
            if q in index and index[q] in aliases:
                root, nbytes = aliases[index[q]], nodes[q]["grad_bytes"]
            elif nodes[q]["x"]:
                root, nbytes = q, nodes[q]["grad_bytes"]
            else:
                continue
            if nbytes:
                pieces[i].append((root, nbytes))
    return aliases, pieces


def _segments(p, kept):
    """[(boundary, members, kept nodes read)] as the rewrite forms them (walks
    stop at kept nodes)."""
    top, below = _closures(p, kept)
    return [(p.ys,) + top[:2]] + [([k],) + below[k][:2] for k in sorted(below, reverse=True)]


def _closure(p, boundary, kept):
    """``boundary`` and what backprop below it recomputes: walks stop at kept nodes."""
    preds, seen = p.preds, set(boundary)
    stack = list(seen)
    while stack:
        for q in preds[stack.pop()]:
            if q not in kept and q not in seen:
                seen.add(q)
                stack.append(q)
    return seen


def kept_indices(p, kept):
    """Indices of what the rewrite keeps: ``kept`` and the forced nodes, less
    reads of xs (differentiated in place, never kept)."""
    return ({p.index[n] for n in kept if n in p.index} | p.forced) - set(p.aliases)


def rewrite_segments(p, kept):
    """Node indices each backward segment copies, as the rewrite groups them.

    The ys' segment first; then one per *level* of kept nodes (a level
    depends only on earlier ones through unkept nodes; see
    ``memsave.rewrite._checkpoint_levels``), last level first. A node below
    kept nodes of several levels is copied once per level: the rewrite
    recomputes it that many times.
    """
    return _memo(p, "rewrite", kept, lambda: _rewrite_segments(p, kept))


def _rewrite_segments(p, kept):
    top, below = _closures(p, kept)
    level = {}
    depth = level.__getitem__
    for k in sorted(below):  # topological indices: a node's deps come first
        # (A kept node is no ancestor of itself: its walk never reads it.)
        reads = below[k][1]
        level[k] = 1 + max(map(depth, reads)) if reads else 0
    # A level of one kept node (most are) is its walk's members as they are.
    by_level = {}
    for k, (_, _, members) in below.items():
        lv = level[k]
        joined = by_level.get(lv)
        if joined is None:
            by_level[lv] = members
        elif isinstance(joined, frozenset):   # a walk's own set: joined in a new one
            by_level[lv] = set(joined).union(members)
        else:
            joined |= members
    return [top[2]] + [by_level[lv] for lv in sorted(by_level, reverse=True)]


def recompute_cost(graph, kept, prepared=None):
    """Work (``TensorNode.cost``) that the rewrite recomputes keeping ``kept``.

    A segment's copies run only where its gradients read them: an unkept
    copy that some gradient reads (``saved``), and every copy those are
    computed from. The rest are made but never run (TensorFlow prunes what
    no fetch needs): recomputing attention's softmax runs the scores'
    matmul, not the matmul of the probabilities with the values above it,
    and a kept tensor's gradient reads the kept value, not a copy (see
    ``memsave.rewrite``). A copy runs once per segment that makes it. Variable
    reads are never copied. (With nothing kept and nothing forced, memsave
    runs plain backprop instead, which recomputes nothing; callers check
    that case.)
    """
    p = prepared or prepare(graph)
    idx = kept_indices(p, kept)
    return _memo(p, "cost", idx, lambda: _recompute_cost(p, idx))


def _recompute_cost(p, idx):
    cost, total = p.cost, 0.0
    for members in rewrite_segments(p, idx):
        for n in _copies_that_run(p, members, idx):
            total += cost[n]
    return total


def _copies_that_run(p, members, idx):
    """The ``members`` of one segment whose copies run (see :func:`recompute_cost`)."""
    inside = members if isinstance(members, (set, frozenset)) else set(members)
    saved, preds, aliases, forced = p.saved, p.preds, p.aliases, p.forced
    stack = [n for n in inside if saved[n] and n not in idx]
    run = set()
    while stack:
        n = stack.pop()
        if n in run or n in aliases or n in forced:
            continue
        run.add(n)
        for q in preds[n]:
            if q in inside and q not in idx and q not in run:
                stack.append(q)
    return run


def shared_recomputation(graph, kept, prepared=None, latest=True):
    """Unkept nodes that more than one segment recomputes, latest first.

    Only the latest of them (none of whose consumers is also shared) are
    returned: keeping those stops every walk that went further back. With
    ``latest=False``, every one of them (candidates all).
    """
    p = prepared or prepare(graph)
    idx = kept_indices(p, kept)
    seen, shared = set(), set()
    for members in rewrite_segments(p, idx):
        recomputed = members - idx
        shared |= recomputed & seen
        seen |= recomputed
    preds = p.preds
    if latest and shared:
        shared = shared.difference(*(preds[n] for n in shared))
    return [p.names[n] for n in sorted(shared, reverse=True)
            if graph.nodes[p.names[n]]["candidate"]]


def simulate_peak(graph, kept=(), prepared=None, offloaded=(), prefetch=False):
    """Estimated peak device bytes of the backward pass with ``kept`` checkpoints,
    of which ``offloaded`` live on the host between their uses."""
    p = prepared or prepare(graph)
    idx, off, early_free, key = _peak_key(p, kept, offloaded, prefetch)
    found = p.memo.get(key)
    if found is None:
        found = p.memo[key] = _simulate(p, idx, off, prefetch, early_free)[0]
    return found


def plain_peak(graph, prepared=None):
    """Estimated peak device bytes of plain backprop, what memsave falls back
    to: nothing kept, not even the forced tensors, which only a rewrite
    keeps (plain backprop differentiates a pinned op like any other).
    ``simulate_peak(graph, ())`` is the rewrite that keeps only those."""
    p = prepared or prepare(graph)
    key = ("plain",)
    if key not in p.memo:
        p.memo[key] = _simulate(p, frozenset(), frozenset(), False, {})[0]
    return p.memo[key]


def _peak_key(p, kept, offloaded=(), prefetch=False):
    """``(kept indices, offloaded indices, early frees, memo key)`` of the
    simulation of ``kept`` (names): :func:`simulate_peak` and :func:`fits`
    share what they learn of a kept set."""
    # Plain backprop (nothing kept) has no reordering edges.
    early_free = p.early if kept else {}
    idx = frozenset(kept_indices(p, kept))
    off = frozenset({p.index[n] for n in offloaded if n in p.index} & idx)
    return idx, off, early_free, (("peak", off, bool(prefetch), bool(early_free)), idx)


def fits(graph, kept, limit, prepared=None):
    """Whether ``simulate_peak(graph, kept, prepared) <= limit``.

    The plan searches ask this of many kept sets that are far over the
    limit, where the peak passes it in the first segments (everything kept
    is alive when the backward pass starts): the simulation stops there.
    What it learnt (the exact peak, or that the peak is above a figure) is
    remembered for later questions about the same kept set.
    """
    p = prepared or prepare(graph)
    idx, off, early_free, key = _peak_key(p, kept)
    exact = p.memo.get(key)
    if exact is not None:
        return exact <= limit
    above = p.memo.get(("above",) + key, -1)   # the peak is known to exceed this
    if above > limit:
        return False
    peak, finished = _simulate(p, idx, off, False, early_free, stop_above=limit)
    if finished:
        p.memo[key] = peak
        return peak <= limit
    p.memo[("above",) + key] = max(above, peak)
    return False


def _simulate(p, kept, off, prefetch, early_free, stop_above=None):
    """:func:`simulate_peak` on kept and offloaded indices: ``(peak, True)``; with
    ``stop_above``, ``(a peak so far, False)`` as soon as it passes that."""
    size = p.size
    segments = _segments(p, kept)

    # A walk reused for another kept set (see _closures) reads the same kept
    # nodes there: its members' inputs are members or kept in both.
    cache = p.memo.setdefault("reads", {})
    reads = []
    for boundary, members, _ in segments:
        found = cache.get(id(members))
        if found is None or found[0] is not members:
            found = cache[id(members)] = (members, _kept_reads(p, kept, boundary, members))
        reads.append(found[1])
    readers = collections.Counter()
    for touched in reads:
        readers.update(touched)
    # Device bytes swapped in per segment: all of them while its forward is
    # recomputed, those a gradient reads during its backward.
    swap_fwd = [sum(size[q] for q in t if q in off) for t in reads]
    swap_bwd = [sum(size[q] for q in t if q in off and p.saved[q]) for t in reads]
    ahead = [sum(size[q] for q in nxt if q in off and q not in cur) if prefetch else 0
             for cur, nxt in zip(reads, reads[1:] + [set()])]

    # A kept tensor that no segment reads (an output nothing consumes) is
    # freed when the forward pass made it.
    sim = _Backward(p, kept, {k for k in kept if readers[k] and k not in off}, early_free)
    for i, (boundary, members, _) in enumerate(segments):
        # Kept boundary nodes read last by their own gradient: freed by it.
        sim.own = {b for b in boundary if b in kept and p.reads_output[b] and readers[b] == 1
                   and b not in off}
        sim.segment(boundary, members, swap_fwd[i], swap_bwd[i], ahead[i])
        if stop_above is not None and sim.peak > stop_above:
            return int(sim.peak), False
        for k in reads[i]:
            readers[k] -= 1
            if readers[k] == 0 and k not in off and k not in sim.own:
                sim.release(k)
    return int(sim.peak), True


def _kept_reads(p, kept, boundary, members):
    """The kept nodes one segment reads: inputs of the copies that run (a copy
    no gradient needs is pruned, and so is its read), inputs its gradients
    read, and boundary nodes whose gradient reads their output (the kept
    value, in their own segment: see memsave.rewrite). A kept node lives
    until the last segment that reads it."""
    running = _copies_that_run(p, members, kept)
    reads = {b for b in boundary if b in kept and p.reads_output[b]}
    for m in members:
        if m in running:
            reads.update(q for q in p.preds[m] if q in kept)
        elif p.reads_inputs[m]:
            reads.update(q for q in p.preds[m] if q in kept and p.saved[q])
    return reads


class _Backward:
    """Device memory through a simulated backward pass, segment by segment.

    Across segments it tracks the kept tensors still alive, the running
    gradient sums of kept tensors, and the gradient pieces of the xs (they
    wait for the segment's last one: TF sums a tensor's pieces with one
    AddN, then one running sum per x lives on). Within a segment: its saved
    activations, gradients in flight, and the pieces pending per x.

    Memory is counted per buffer: tensors that share one (``Prepared.owner``)
    cost it once, and it lives while any of them is held.
    """

    def __init__(self, p, kept, held, early_free):
        self.p, self.kept, self.early_free = p, kept, early_free
        # Kept tensors held on the device per buffer (``held``): the buffer is
        # freed with the last of them.
        self.holders = collections.Counter(p.owner[n] for n in held if p.owner[n] >= 0)
        self.alive_kept = sum(p.size[o] for o in self.holders)
        # State a kept node's producer keeps for its backward (a loop's
        # accumulators) is made by the forward pass and freed by that backward.
        self.alive_kept += sum(p.state[k] for k in kept)
        self.grad_sums = {}
        self.freed = set()
        self.peak = self.alive_kept
        self.held, self.totals = 0, set()
        self.own = set()   # kept nodes the current segment frees at their own backward
        # The current segment's (see segment()).
        self.saved = self.in_flight = self.sums = self.swapped = 0
        self.buffers = set()   # its recomputed buffers that backprop reads
        self.flight, self.left, self.pending = {}, collections.Counter(), collections.Counter()
        self.sent = collections.Counter()   # the pieces the current segment sends per x

    def release(self, k):
        """Kept node ``k`` is read no more: its buffer goes with its last holder."""
        o = self.p.owner[k]
        if o >= 0:
            self.holders[o] -= 1
            if self.holders[o] == 0:
                self.alive_kept -= self.p.size[o]

    def _resident(self):
        """Bytes held whatever the current op: kept, sums, saved, in flight."""
        return self.alive_kept + self.sums + self.saved + self.in_flight

    def segment(self, boundary, members, swap_fwd, swap_bwd, ahead):
        """Recompute ``members`` (peak with the segment's swap-ins), then run
        their backward ops last first; ``ahead``: the next segment's swap-ins."""
        p, size, kept = self.p, self.p.size, self.kept
        # Kept members are not recomputed: their gradients read the kept value
        # (and a member sharing a kept buffer is that buffer).
        self.buffers = {p.owner[n] for n in members if p.saved[n] and n not in kept} & (
            set(members) - kept)
        self.saved = sum(size[o] for o in self.buffers)
        # A recomputed member's state lives from the recomputation to its backward.
        self.saved += sum(p.state[n] for n in members if n not in kept)
        self.freed = set()
        # A kept boundary node's running sum becomes the gradient in flight.
        self.flight = flight = {}
        sums = self.grad_sums
        for b in boundary:
            if b in kept and b in sums:
                flight[b] = sums.pop(b)
                self.sums -= flight[b]
            else:
                flight[b] = size[b]
        self.in_flight = sum(flight.values())
        self.peak = max(self.peak, self._resident() + swap_fwd + self.held)
        self.left = left = collections.Counter()
        pieces = p.pieces
        for n in members:
            if pieces[n]:
                for root, _ in pieces[n]:
                    left[root] += 1
        self.sent = collections.Counter(left)
        self.pending = collections.Counter()
        self.swapped = swap_bwd
        backward_op = self._backward_op
        for n in reversed(members[1:]):
            backward_op(n)
        if members:
            self.swapped += ahead   # the next segment's swap-ins arrive
            backward_op(members[0])

    def _backward_op(self, n):
        """``n``'s backward: consumes its gradient, makes its inputs' gradients
        (a kept input's is added into its running sum, then freed) and the
        pieces it sends to xs, then frees ``n`` if it was saved."""
        # The planner's innermost loop: every op of every segment of every
        # candidate plan simulated, so attribute lookups are hoisted (sizes
        # are ints: the sums are exact in any order).
        p, size, flight = self.p, self.p.size, self.flight
        g = flight.pop(n, 0)
        self.in_flight -= g
        frees = self.early_free.get(n)
        if frees:
            early = [o for o in frees if o in self.buffers and o not in self.freed]
            if early:   # the weight gradient runs first and frees its input
                self.peak = max(self.peak, self._resident() + g + self.swapped + self.held)
                self.saved -= sum(size[o] for o in early)
                self.freed.update(early)
        kept, sums, partials = self.kept, self.grad_sums, 0
        for q in p.preds[n]:
            if q in kept:
                if q in sums:
                    partials += size[q]  # added into the running sum, then freed
                else:
                    sums[q] = size[q]
                    self.sums += size[q]
            elif q not in flight:
                flight[q] = size[q]
                self.in_flight += size[q]
        pieces = p.pieces[n]
        if pieces:
            pending = self.pending
            for root, nbytes in pieces:
                pending[root] += nbytes
                self.held += nbytes
        # A gradient that passes through (a reshape's) is the same buffer.
        base = (self.alive_kept + self.sums + self.saved + self.in_flight
                + (0 if p.passes[n] else g) + partials + self.swapped)
        top = base + self.held + p.scratch[n]
        if top > self.peak:
            self.peak = top
        if pieces:
            self._sum_pieces(n, base)
        if n in self.buffers and n not in self.freed:
            self.saved -= size[n]
            self.freed.add(n)
        if p.state[n]:
            if n in kept:
                self.alive_kept -= p.state[n]
            else:
                self.saved -= p.state[n]
        if n in self.own:
            self.release(n)

    def _sum_pieces(self, n, base):
        """Sum each x's pieces once ``n`` sent the segment's last one."""
        for root, nbytes in self.p.pieces[n]:
            self.left[root] -= 1
            if self.left[root] == 0 and self.pending[root]:
                if self.sent[root] == 1 and root not in self.totals:
                    # One piece and no running sum yet: that piece is the
                    # x's gradient, as TensorFlow takes a single gradient
                    # without an AddN and the rewrite's first partial is its
                    # sum (a stack of 2048x2048 Dense layers, plain backprop:
                    # 80.1 MiB estimated with a sum buffer here, 64.2
                    # measured, 64.1 without).
                    self.pending.pop(root)
                    self.totals.add(root)
                    continue
                # The segment's sum (and the new running sum) appear while
                # the pieces are still alive.
                self.peak = max(self.peak, base + self.held + nbytes)
                self.held -= self.pending.pop(root)
                if root not in self.totals:
                    self.totals.add(root)
                    self.held += nbytes
