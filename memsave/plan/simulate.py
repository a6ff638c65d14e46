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

With nothing kept it models plain backprop, which keeps every saved
activation of the forward pass. Sizes are activation bytes only.
"""

import collections

from memsave.plan.plan import node_bytes, topological


def _segments(graph, kept, order):
    """{boundary: nodes} as the rewrite forms them (walks stop at kept nodes)."""
    ys = [n for n in order if graph.nodes[n].get("y")]
    seeds = [("ys", ys)] + [(k, [k]) for k in reversed(order) if k in kept]
    owner = {}
    result = []
    for name, boundary in seeds:
        members, stack = [], list(boundary)
        while stack:
            n = stack.pop()
            if (n, name) in owner:
                continue
            owner[(n, name)] = True
            members.append(n)
            for p in graph.predecessors(n):
                if p not in kept and not graph.nodes[p].get("x"):
                    stack.append(p)
        result.append((name, boundary, members))
    return result


def simulate_peak(graph, kept=()):
    """Estimated peak bytes of the backward pass with ``kept`` checkpoints."""
    kept = set(kept) | {n for n, d in graph.nodes(data=True) if d.get("forced")}
    order = topological(graph, [n for n, d in graph.nodes(data=True) if not d.get("x")])
    index = {n: i for i, n in enumerate(order)}
    size = {n: node_bytes(graph, n) for n in order}
    segments = _segments(graph, kept, order)

    # Which segments read each kept tensor; it is freed after the last one.
    readers = collections.defaultdict(int)
    for _, _, members in segments:
        for k in {p for n in members for p in graph.predecessors(n) if p in kept}:
            readers[k] += 1

    # Plain backprop is the same sweep over one segment holding everything:
    # the forward pass left all saved activations alive, as a recompute would.
    alive_kept = sum(size[n] for n in kept if n in size)
    grad_sums = {}
    peak = alive_kept
    for name, boundary, members in segments:
        members = sorted(set(members), key=index.get)
        saved = sum(size[n] for n in members if graph.nodes[n].get("saved", True))
        flight = {}
        for b in boundary:
            if b in kept:
                flight[b] = grad_sums.pop(b, size[b])
            else:
                flight[b] = size[b]
        base = alive_kept + sum(grad_sums.values())
        peak = max(peak, base + saved + sum(flight.values()))
        for n in reversed(members):
            g = flight.pop(n, 0)
            outputs = 0
            for p in graph.predecessors(n):
                if graph.nodes[p].get("x"):
                    continue
                if p in kept:
                    if p in grad_sums:
                        outputs += size[p]  # a partial, added into the running sum
                    grad_sums[p] = size[p]
                elif p not in flight:
                    flight[p] = size[p]
                    outputs += size[p]
            base = alive_kept + sum(grad_sums.values())
            peak = max(peak, base + saved + sum(flight.values()) + g + outputs)
            if graph.nodes[n].get("saved", True):
                saved -= size[n]
        for k in {p for n in members for p in graph.predecessors(n) if p in kept}:
            readers[k] -= 1
            if readers[k] == 0:
                alive_kept -= size.get(k, 0)
    return int(peak)
