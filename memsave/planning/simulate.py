"""Estimate the peak of a checkpointed backward pass by simulating it.

The simulation follows the rewrite's schedule on the planning graph: the
segment below the ys first, then the segments below each kept tensor in
reverse topological order. During a segment, memory holds:

- kept tensors that a segment still to come reads,
- running gradient sums of kept tensors whose own segment has not run,
- the segment's recomputed activations that some gradient reads
  (``saved``), each freed once the backward sweep passes its producer,
- gradients in flight: the gradient of a tensor lives from when its first
  consumer's backward produces it until its producer's backward consumes it.

A matmul or convolution's gradient is two ops: the weight gradient reads
the input activation, the input gradient does not. The rewrite runs the
weight gradient first (``memsave.graph.schedule``), so an input activation
that no other gradient reads is freed before its own gradient is allocated.

With nothing kept it models plain backprop, which keeps every saved
activation of the forward pass (one segment holding everything). Sizes are
activation bytes only.

Offloaded kept tensors live in host memory. On the device, each is swapped
in for the segment that reads it; it stays through that segment's backward
only if a gradient reads it (else it is freed once the segment's forward is
recomputed). With ``prefetch`` the next segment's swap-ins also arrive
during the last step of the current one (``swapin_ahead`` > 0).
"""

import collections

from memsave.planning.plan import node_bytes, topological

Prepared = collections.namedtuple("Prepared", "names index size saved preds ys forced early")

# Ops whose gradient splits into a weight gradient (reads the input
# activation) and an input gradient (does not).
SPLIT_GRADIENT = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv", "Conv2D",
    "Conv3D", "DepthwiseConv2dNative",
})


def _freed_early(graph, names, size, saved, preds):
    """{consumer: [inputs freed before the consumer's input gradient exists]}.

    An input qualifies when the consumer's gradient is the only one that
    reads it (its producer's gradient does not read it, nor does any other
    consumer's) and the consumer's other inputs are small (weights).
    """
    nodes = graph.nodes
    early = {}
    for i, n in enumerate(names):
        if nodes[n].get("op_type") not in SPLIT_GRADIENT:
            continue
        for q in preds[i]:
            if not saved[q] or nodes[names[q]].get("grad_reads_output", True):
                continue
            readers = {c for c in graph.successors(names[q])
                       if nodes[c].get("grad_reads_inputs", True)}
            others = [o for o in preds[i] if o != q]
            if readers == {n} and all(size[o] * 4 <= size[q] for o in others):
                early.setdefault(i, []).append(q)
    return early


def prepare(graph):
    """Index the planning graph once for repeated simulations."""
    names = topological(graph, [n for n, d in graph.nodes(data=True) if not d.get("x")])
    index = {n: i for i, n in enumerate(names)}
    size = [node_bytes(graph, n) for n in names]
    saved = [bool(graph.nodes[n].get("saved", True)) for n in names]
    preds = [[index[p] for p in graph.predecessors(n) if p in index] for n in names]
    ys = [i for i, n in enumerate(names) if graph.nodes[n].get("y")]
    forced = {i for i, n in enumerate(names) if graph.nodes[n].get("forced")}
    early = _freed_early(graph, names, size, saved, preds)
    return Prepared(names, index, size, saved, preds, ys, forced, early)


def _segments(p, kept):
    """[(boundary, members)] as the rewrite forms them (walks stop at kept nodes)."""
    seeds = [(None, p.ys)] + [(k, [k]) for k in sorted(kept, reverse=True)]
    result = []
    for name, boundary in seeds:
        seen, stack = set(), list(boundary)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(q for q in p.preds[n] if q not in kept)
        result.append((name, boundary, sorted(seen)))
    return result


def simulate_peak(graph, kept=(), prepared=None, offloaded=(), prefetch=False):
    """Estimated peak device bytes of the backward pass with ``kept`` checkpoints,
    of which ``offloaded`` live on the host between their uses."""
    p = prepared or prepare(graph)
    # Plain backprop (nothing kept) has no reordering edges.
    early_free = p.early if kept else {}
    kept = {p.index[n] for n in kept if n in p.index} | p.forced
    off = {p.index[n] for n in offloaded if n in p.index} & kept
    size = p.size
    segments = _segments(p, kept)

    readers = collections.Counter()
    reads = []
    for _, _, members in segments:
        touched = {q for n in members for q in p.preds[n] if q in kept}
        reads.append(touched)
        readers.update(touched)
    # Device bytes swapped in per segment: all of them while its forward is
    # recomputed, those a gradient reads during its backward.
    swap_fwd = [sum(size[q] for q in t if q in off) for t in reads]
    swap_bwd = [sum(size[q] for q in t if q in off and p.saved[q]) for t in reads]
    ahead = [sum(size[q] for q in nxt if q in off and q not in cur) if prefetch else 0
             for cur, nxt in zip(reads, reads[1:] + [set()])]

    alive_kept = sum(size[n] for n in kept if n not in off)
    grad_sums = {}
    freed = set()
    peak = alive_kept
    for i, ((name, boundary, members), touched) in enumerate(zip(segments, reads)):
        saved = sum(size[n] for n in members if p.saved[n])
        flight = {b: (grad_sums.pop(b, size[b]) if b in kept else size[b]) for b in boundary}
        in_flight = sum(flight.values())
        sums = sum(grad_sums.values())
        peak = max(peak, alive_kept + sums + saved + in_flight + swap_fwd[i])
        swapped = swap_bwd[i]
        for step, n in enumerate(reversed(members)):
            if step == len(members) - 1:
                swapped += ahead[i]   # the next segment's swap-ins arrive
            g = flight.pop(n, 0)
            in_flight -= g
            early = [q for q in early_free.get(n, ()) if q not in kept]
            if early:   # the weight gradient runs first and frees its input
                peak = max(peak, alive_kept + sums + saved + in_flight + g + swapped)
                saved -= sum(size[q] for q in early)
                freed.update(early)
            partials = 0
            for q in p.preds[n]:
                if q in kept:
                    if q in grad_sums:
                        partials += size[q]  # added into the running sum, then freed
                    else:
                        grad_sums[q] = size[q]
                        sums += size[q]
                elif q not in flight:
                    flight[q] = size[q]
                    in_flight += size[q]
            peak = max(peak, alive_kept + sums + saved + in_flight + g + partials + swapped)
            if p.saved[n] and n not in freed:
                saved -= size[n]
        for k in touched:
            readers[k] -= 1
            if readers[k] == 0 and k not in off:
                alive_kept -= size[k]
    return int(peak)
