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
activation of the forward pass (one segment holding everything). Sizes are
activation bytes only.

Offloaded kept tensors live in host memory. On the device, each is swapped
in for the segment that reads it; it stays through that segment's backward
only if a gradient reads it (else it is freed once the segment's forward is
recomputed). With ``prefetch`` the next segment's swap-ins also arrive
during the last step of the current one (``swapin_ahead`` > 0).
"""

import collections

from memsave.plan.plan import node_bytes, topological

Prepared = collections.namedtuple("Prepared", "names index size saved preds ys forced")


def prepare(graph):
    """Index the planning graph once for repeated simulations."""
    names = topological(graph, [n for n, d in graph.nodes(data=True) if not d.get("x")])
    index = {n: i for i, n in enumerate(names)}
    size = [node_bytes(graph, n) for n in names]
    saved = [bool(graph.nodes[n].get("saved", True)) for n in names]
    preds = [[index[p] for p in graph.predecessors(n) if p in index] for n in names]
    ys = [i for i, n in enumerate(names) if graph.nodes[n].get("y")]
    forced = {i for i, n in enumerate(names) if graph.nodes[n].get("forced")}
    return Prepared(names, index, size, saved, preds, ys, forced)


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
            if p.saved[n]:
                saved -= size[n]
        for k in touched:
            readers[k] -= 1
            if readers[k] == 0 and k not in off:
                alive_kept -= size[k]
    return int(peak)
