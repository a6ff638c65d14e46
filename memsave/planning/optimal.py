"""The 'optimal' strategy: a frontier dynamic program over any DAG.

Articulation points only exist where a single tensor cuts the graph; skip
connections (U-Net, DenseNet) remove them. Here the graph is linearized in
topological order instead. A *cut* after position i keeps every tensor that
is alive across it (produced at or before i, consumed after i): its
*frontier*. Choosing cuts c1 < c2 < ... keeps the union of their frontiers,
and backprop recomputes one segment between neighbouring cuts at a time.

Because a tensor is alive across an interval of positions, the bytes a cut
b adds to the union after a previous cut a are exactly the tensors produced
in (a, b] and still alive after b. For a bound M on a segment's saved bytes,
a shortest path over cuts minimizes the kept bytes; we minimize kept + M
over a few values of M. With ``budget`` we instead pick, among the plans
whose estimate fits, the one that recomputes the fewest FLOPs.
"""

import logging

import numpy as np

from memsave.errors import BudgetError
from memsave.log import size_text
from memsave.planning.offload import OffloadModel, host_bytes, offloadable
from memsave.planning.dag import node_bytes, nodes_where, saved_bytes, topological, validate
from memsave.planning.plan import Plan
from memsave.planning.simulate import (fits as fits_in, plain_peak, prepare, recompute_cost,
                                       simulate_peak)
from memsave.planning.strategies import (MAX_RECOMPUTE_ERROR, memory_spacing, recompute_once,
                                         speed_candidates, step_work)

logger = logging.getLogger("memsave")

_SPLIT_STEPS = 128   # _blends bisects a split to 1/128 of the graph
# A dropped-in-order search looks closer where its lowest grid point's peak
# is this near its limit (see _first_fitting_span).
_NEAR = 1.1
# The chosen plan's refinement (see _refined) tries, per pass and in at most
# _REFINE_PASSES passes, as many tensors as make about _REFINE_WORK graph
# nodes' worth of estimates (each try simulates the whole graph), between
# _REFINE_FEWEST and _REFINE_MOST; it keeps again only tensors whose
# recomputation is at least _WORTH of the plan's.
_REFINE_PASSES = 3
_REFINE_WORK = 24000
_REFINE_FEWEST, _REFINE_MOST = 8, 24
_WORTH = 0.002


def _linearize(graph):
    nodes = topological(graph, [n for n, d in graph.nodes(data=True) if not d["x"]])
    position = {n: i for i, n in enumerate(nodes)}
    m = len(nodes)
    last_use = np.empty(m, dtype=np.int64)
    keep_bytes = np.zeros(m, dtype=np.float64)
    seg_bytes = np.zeros(m, dtype=np.float64)
    for i, n in enumerate(nodes):
        data = graph.nodes[n]
        uses = [position[s] for s in graph.successors(n) if s in position]
        last_use[i] = m if data["y"] else max(uses, default=i)
        # Only candidates cost anything to keep: ys are the top boundary,
        # forced tensors are kept anyway, variable reads are aliases.
        keep_bytes[i] = node_bytes(graph, n) if data["candidate"] else 0.0
        seg_bytes[i] = saved_bytes(graph, n)
    return nodes, last_use, keep_bytes, seg_bytes


def _shortest_cuts(last_use, keep_bytes, prefix, limit, dying=None):
    """Cuts minimizing kept bytes with every segment's saved bytes <= limit.

    ``dying`` (:func:`_dying`) can be shared by calls on the same arrays.
    """
    m = len(last_use)
    dying = _dying(last_use, keep_bytes) if dying is None else dying
    dist = np.full(m + 1, np.inf)  # dist[c + 1]: best kept bytes with a cut after c
    dist[0] = 0.0
    back = np.full(m + 1, -1, dtype=np.int64)
    # A previous cut at dist index j (after position j - 1) makes the new
    # segment positions j..b; the bytes it adds are the tensors produced
    # there that are still alive after b: added[j] + shift, kept up to date
    # as b advances. Byte counts are integers (or quarters), so these sums
    # are exact and equal the sums made afresh for each b.
    added, shift = np.zeros(m + 1), 0.0
    lo = 0  # smallest dist index allowed for the previous cut
    for b in range(m):
        while prefix[b + 1] - prefix[lo] > limit:
            lo += 1
        if lo > b:
            return None  # a single tensor exceeds the limit
        for i, nbytes in dying[b]:
            if i >= lo:
                added[lo:i + 1] -= nbytes
        added[b] = -shift
        if last_use[b] > b:
            shift += keep_bytes[b]
        cand = dist[lo:b + 1] + added[lo:b + 1]
        k = int(cand.argmin())
        dist[b + 1] = cand[k] + shift
        back[b + 1] = lo + k
    cuts, c = [], m
    while c > 0:
        cuts.append(c - 1)
        c = back[c]
    return dist[m], sorted(cuts)


def _dying(last_use, keep_bytes):
    """Per position b: (i, bytes) of the earlier tensors whose last use is b."""
    dying = [[] for _ in range(len(last_use))]
    for i, last in enumerate(last_use.tolist()):
        if i < last < len(last_use) and keep_bytes[i]:
            dying[last].append((i, float(keep_bytes[i])))
    return dying


def _kept(nodes, last_use, candidate, cuts):
    """Candidates alive across some cut other than the final one."""
    inner = np.asarray(cuts[:-1], dtype=np.int64)
    if not len(inner):
        return []
    pos = np.arange(len(nodes))
    j = np.searchsorted(inner, pos)
    hit = j < len(inner)
    across = np.zeros(len(nodes), dtype=bool)
    across[hit] = inner[j[hit]] < last_use[hit]
    return [nodes[i] for i in np.nonzero(across & candidate)[0]]


def _selective(graph, prepared, cap=None, limit=None, forced=()):
    """Kept sets that keep every candidate but the cheapest to recompute per
    byte, each by its own cost: elementwise outputs (layer norm, GELU,
    softmax: 6-9 FLOP-equivalents per byte) go first, then matmuls over
    short inner dimensions (attention scores). See :func:`_dropped_in_order`.
    """
    nodes = graph.nodes
    order = sorted((n for n, d in nodes(data=True) if d["candidate"]),
                   key=lambda n: nodes[n]["cost"] / max(node_bytes(graph, n), 1))
    return _dropped_in_order(graph, prepared, order, cap, limit, forced)


def _cheapest_of_plain(graph, prepared, cap=None, limit=None, forced=()):
    """Kept sets that keep what plain backprop keeps (the candidates some
    gradient reads), less the bytes cheapest to recompute (for caps: see
    :func:`_candidate_kept_sets` on budgets).

    Each is priced by what dropping it alone recomputes: itself and what it
    is computed from down to what plain keeps. A GELU's intermediates cost
    a few elementwise ops on the kept matmul output; attention's softmax
    costs the scores' matmul too, which is cheap per byte where the
    sequence is long for the width (Megatron-LM's selective recomputation,
    found from costs). See :func:`_dropped_in_order`.
    """
    nodes, index, preds = graph.nodes, prepared.index, prepared.preds
    saved = [n for n, d in nodes(data=True) if d["candidate"] and d["saved"]]
    base = {index[n] for n in saved} | prepared.forced | set(prepared.aliases)
    cost = [nodes[n]["cost"] for n in prepared.names]

    def dropping(n):
        seen, stack = set(), [index[n]]
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                stack.extend(q for q in preds[i] if q not in base)
        return sum(cost[i] for i in seen) / max(node_bytes(graph, n), 1)

    order = sorted(saved, key=dropping)
    return _dropped_in_order(graph, prepared, order, cap, limit, forced)


def _dropped_in_order(graph, prepared, order, cap, limit, forced):
    """Kept sets that keep ``order`` (candidates, cheapest to drop first) less
    a prefix of it: as many dropped as ``cap`` allows, or as few as make the
    estimated peak fit ``limit`` (a budget: the least recomputation that
    fits; also one fewer dropped, just over it, for :func:`_fills`, and the
    last one dropped kept, with as few later ones dropped as fit). What
    several segments would each recompute is kept again
    (:func:`recompute_once`). The count dropped is binary-searched (under a
    cap, a few smaller counts compete on the peak estimate).
    """
    kept_after = _kept_suffixes(graph, prepared, order)
    if cap is not None:
        lo, hi = 0, len(order)
        while lo < hi:   # the most dropped whose recomputation is under the cap
            mid = (lo + hi + 1) // 2
            if recompute_cost(graph, kept_after(mid), prepared) <= cap:
                lo = mid
            else:
                hi = mid - 1
        return [kept_after(c) for c in sorted({lo, lo * 7 // 8, lo * 3 // 4, lo // 2}) if c]

    def fits(kept, bound=limit):
        # Dropping every candidate keeps only what recompute_once adds back,
        # possibly nothing: plain backprop, which is no budget plan.
        kept = set(kept) | set(forced)
        return bool(kept) and fits_in(graph, kept, bound, prepared)

    span = _first_fitting_span(
        len(order), lambda c, bound: fits(kept_after(c), bound),
        lambda c: simulate_peak(graph, set(kept_after(c)) | set(forced), prepared), limit)
    if span is None:
        return []
    lo, hi = span
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(kept_after(mid)):
            hi = mid
        else:
            lo = mid + 1
    if not hi:
        return [kept_after(hi)]
    return [kept_after(hi), kept_after(hi - 1)] + _keeping_the_last_dropped(
        graph, prepared, order, hi, fits)


def _first_fitting_span(count, fits, peak, limit, points=17):
    """``(lo, hi)``: counts dropped (of ``count``) between which the fewest that
    fits ``limit`` lies, ``fits(hi, limit)`` true and every grid count before
    ``hi`` not; or None. ``fits(count, bound)``: whether that count's peak is
    at most ``bound``; ``peak(count)``: the peak itself.

    The peak falls as more is dropped, then rises again towards plain
    backprop (nothing kept), and it is ragged near its bottom, so the
    counts that fit may be a narrow window: on MobileNetV2 at 142 MiB only
    657 of 765 (134.5 MiB, recomputing 15% of a training step; 654 gives
    142.5, 660 gives 145.3), which a grid of 17 misses, leaving a plan at
    110 MiB that recomputes 23%. Where no grid count fits but the lowest
    ``peak`` is within :data:`_NEAR` of ``limit``, the grid is laid again,
    finer, around that lowest (the most dropped of equal peaks: the peak
    drifts down until it rises), until it is one count apart.
    """
    lo, hi = 0, count
    while True:
        grid = sorted({int(round(c)) for c in np.linspace(lo, hi, points)})
        first = next((i for i, c in enumerate(grid) if fits(c, limit)), None)
        if first is not None:
            return (grid[first - 1] + 1 if first else grid[0]), grid[first]
        if len(grid) == hi - lo + 1:
            return None
        # The lowest is among the near ones, if any: only those are simulated whole.
        near = [i for i, c in enumerate(grid) if fits(c, _NEAR * limit)]
        if not near:
            return None
        best = min(near, key=lambda i: (peak(grid[i]), -i))
        lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]


def _kept_suffixes(graph, prepared, order):
    """``count -> order`` less its first ``count``, grown by :func:`recompute_once`
    (each count made once)."""
    made = {}

    def kept_after(count):
        if count not in made:
            made[count] = recompute_once(graph, order[count:], prepared)
        return made[count]
    return kept_after


def _keeping_the_last_dropped(graph, prepared, order, count, fits):
    """Dropping one large tensor can jump far below the limit (EfficientNetB0
    under 135 MiB: 135.1 MiB recomputing 4.3% of a training step, one more
    dropped 123.1 at 6%): the first ``count`` of ``order`` dropped but the
    last, kept, and as few of the next ones dropped as ``fits`` (doubling,
    then bisecting; there, 130.6 MiB at 5%). A list of at most one kept set."""
    # The last one dropped moves to the end of the order: never dropped.
    moved = order[:count - 1] + order[count:] + [order[count - 1]]
    kept_after = _kept_suffixes(graph, prepared, moved)
    first, most = count - 1, len(moved) - 1
    lo, hi = 0, 1
    while first + hi <= most and not fits(kept_after(first + hi)):
        lo, hi = hi, 2 * hi
    if first + hi > most:
        return []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(kept_after(first + mid)):
            hi = mid
        else:
            lo = mid
    return [kept_after(first + hi)]


def plans(graph, values=8, prefer_speed=False, offload_model=None, prepared=None):
    """Candidate plans: (estimated peak, recompute cost, kept) for a grid of limits.

    One pass minimizes kept bytes. With ``prefer_speed`` a second pass counts
    expensive tensors whose copies need not run (matmul, conv outputs) at a
    quarter of their size, which yields plans that recompute less for a
    little more memory (for budgets). With ``offload_model`` a further pass
    counts tensors worth offloading as free, so cuts gather at them.
    """
    nodes, last_use, keep_bytes, seg_bytes = _linearize(graph)
    if not nodes:
        return []
    prepared = prepared or prepare(graph)
    candidate = np.array([graph.nodes[n]["candidate"] for n in nodes], dtype=bool)
    prefix = np.concatenate([[0.0], np.cumsum(seg_bytes)])
    total = prefix[-1]
    smallest = max(float(seg_bytes.max()), 1.0)
    grid = sorted(set(np.geomspace(smallest, max(total, smallest), values).tolist()))
    cheap_to_keep = np.array([
        0.25 if (graph.nodes[n]["expensive"] and not graph.nodes[n]["grad_reads_output"])
        else 1.0
        for n in nodes])
    found = {}

    def evaluate(limit, weights, dying):
        result = _shortest_cuts(last_use, weights, prefix, limit, dying)
        if result is None:
            return None
        cuts = result[1]
        kept = _kept(nodes, last_use, candidate, cuts)
        peak = sum(node_bytes(graph, n) for n in kept) + _largest_segment(prefix, cuts)
        key = tuple(kept)
        if key not in found:
            found[key] = (float(peak), recompute_cost(graph, kept, prepared), kept)
        return peak

    passes = [keep_bytes]
    if prefer_speed:
        passes.append(keep_bytes * cheap_to_keep)
    if offload_model is not None:
        on_host = np.array([0.0 if offload_model.worth_offloading(graph, n) else 1.0
                            for n in nodes])
        passes.append(keep_bytes * on_host)
    for weights in passes:
        dying = _dying(last_use, weights)
        scored = [(p, lim) for lim in grid for p in [evaluate(lim, weights, dying)]
                  if p is not None]
        if not scored:
            continue
        best = min(scored)[1]
        i = grid.index(best)
        lo = grid[i - 1] if i > 0 else best / 2
        hi = grid[i + 1] if i + 1 < len(grid) else best
        for limit in np.linspace(lo, hi, 5)[1:-1]:
            evaluate(float(limit), weights, dying)
    return sorted(found.values(), key=lambda p: p[0])


def _largest_segment(prefix, cuts):
    bounds = [0] + [c + 1 for c in cuts]
    return max(float(prefix[b] - prefix[a]) for a, b in zip(bounds, bounds[1:]))


def optimal(graph, budget=None, offload=None, model=None, max_recompute=None):
    """The plan with the lowest estimated peak, or, with ``budget`` (bytes, or a
    fraction of the plain estimate when below 1), the one that fits it with
    the least extra time. Estimates come from :func:`simulate_peak`.

    ``max_recompute`` caps the recomputed FLOPs, as a fraction of one
    training step's work (0.05: at most 5% extra work, see
    :func:`~memsave.planning.strategies.step_work`): among the plans
    under the cap, the lowest peak (with ``budget`` too: the least time
    among those that fit both).

    With ``offload='auto'`` every candidate is also tried with its kept
    tensors offloaded (those worth it under ``model``, or all that can be),
    and peaks are device peaks; extra time is recomputation plus transfers
    (see :class:`memsave.planning.offload.OffloadModel`).
    """
    _check_options(budget, offload, max_recompute)
    model = model or OffloadModel()
    forced = nodes_where(validate(graph), "forced")
    prepared = prepare(graph)
    plain = plain_peak(graph, prepared)
    limit = None if budget is None else (budget * plain if budget < 1 else float(budget))
    step = step_work(graph)
    cap = None if max_recompute is None else max_recompute * step
    # Every matmul/conv output kept, recomputing only the cheap ops between
    # them: a candidate under a budget or cap, and an end of the blends.
    fast = (None if limit is None and cap is None
            else recompute_once(graph, speed_candidates(graph), prepared))
    kept_sets = _candidate_kept_sets(graph, prepared, forced, limit, cap,
                                     model if offload else None, fast)
    options = _scored_options(graph, prepared, kept_sets, forced, offload, model)
    if options and fast is not None:
        low = min(options, key=lambda p: (p[0], p[1]))[2]
        options += _scored_options(graph, prepared,
                                   _blends(graph, prepared, forced, low, fast, limit, cap),
                                   forced, offload, model)
    if limit is not None:
        fills = _fills(graph, prepared, forced, options, limit)
        options += _scored_options(graph, prepared, fills, forced, offload, model)
    if cap is not None:
        options = [p for p in options if p[4] <= cap]
    if not options and limit is None:
        # Only plain backprop recomputes nothing at all (forced tensors are
        # kept there anyway): an empty plan.
        return Plan("optimal", [], [], int(plain), int(plain),
                    ["no checkpointed plan recomputes at most %g%% of a training step: "
                     "plain backprop" % (100 * max_recompute)], recompute_fraction=0.0)
    peak, _, kept, off, flops = _choose(options, limit, cap, plain, max_recompute, offload)
    if cap is not None and limit is None and not off and kept:
        kept, peak, flops = _refined(graph, prepared, kept, forced, cap, peak, flops)
    notes = [] if limit is None else ["budget %.1f MiB" % (limit / 2**20)]
    if cap is not None:
        notes.append("recompute capped at %g%% of a training step" % (100 * max_recompute))
    return Plan("optimal", topological(graph, kept), forced, int(peak), int(plain), notes,
                recompute_fraction=flops / step,
                offloaded=off, host_bytes=host_bytes(graph, off))


def _refined(graph, prepared, kept, forced, cap, peak, flops):
    """The plan ``kept`` chosen under ``cap`` (estimated ``peak``, recomputing
    ``flops``) with its recomputation spent where it lowers the peak:
    ``(kept, peak, flops)``.

    The candidates drop tensors in one order (cheapest per byte first) or
    blend two plans, and what they drop is not all where the peak is: a
    transformer's last layer is recomputed at the start of the backward
    pass, below the peak. Each pass keeps again the dropped tensors (those
    plain backprop keeps) whose recomputation costs most, one at a time,
    where the estimate does not rise, then drops the largest kept tensors,
    cheapest per byte first, where that lowers it within the cap. The
    costliest (largest) are tried, as many per pass as a graph of its size
    affords (:data:`_REFINE_WORK`). On the zoo, measured: MobileNetV2 under
    ``max_recompute=0.05`` at 70% of plain's peak (80% before), GPT2 at
    1,024 tokens under 0.1 at 54% (61%).

    Not for budgets: there the moves keep more where the estimate has room
    and it runs low by more where a plan keeps more (see
    :func:`_candidate_kept_sets`): with budgets refined, a run of the zoo's
    budgets (``benchmarks.zoo``, 'budget' configurations) had 7 of 20 with a
    call over the budget, against 3 unrefined.
    """
    moves = _Moves(graph, prepared, forced)
    kept = set(kept)
    for _ in range(_REFINE_PASSES):
        kept, flops, kept_more = moves.keep_again(kept, flops, peak)
        peak = simulate_peak(graph, kept | moves.forced, prepared)
        kept, flops, peak, dropped_more = moves.drop_where_lower(kept, flops, peak, cap)
        if not (kept_more or dropped_more):
            break
    return topological(graph, kept), peak, flops


class _Moves:
    """The two moves of :func:`_refined` on one planning graph."""

    def __init__(self, graph, prepared, forced):
        self.graph, self.prepared, self.forced = graph, prepared, set(forced)
        nodes = graph.nodes
        self.saved = [n for n, d in nodes(data=True)
                      if d["candidate"] and d["saved"] and n not in self.forced]
        self.tries = min(_REFINE_MOST, max(_REFINE_FEWEST, _REFINE_WORK // max(len(nodes), 1)))

    def _priced(self, trial):
        trial = set(recompute_once(self.graph, trial, self.prepared))
        return trial, recompute_cost(self.graph, trial, self.prepared)

    def _fits(self, trial, bound):
        return fits_in(self.graph, trial | self.forced, bound, self.prepared)

    def keep_again(self, kept, flops, bound):
        """The dropped tensors whose recomputation costs most kept again, one
        at a time, where the estimate stays within ``bound``: ``(kept,
        flops, whether any was)``."""
        nodes, changed = self.graph.nodes, False
        dropped = sorted((n for n in self.saved if n not in kept
                          and nodes[n]["cost"] >= _WORTH * flops),
                         key=lambda n: nodes[n]["cost"], reverse=True)[:self.tries]
        for n in dropped:
            trial, spent = self._priced(kept | {n})
            if spent < flops and self._fits(trial, bound):
                kept, flops, changed = trial, spent, True
        return kept, flops, changed

    def drop_where_lower(self, kept, flops, peak, within):
        """The largest kept tensors, cheapest per byte first, dropped where
        that lowers the estimate recomputing at most ``within``: ``(kept,
        flops, peak, whether any was)``."""
        graph, changed = self.graph, False
        largest = sorted((n for n in self.saved if n in kept), key=lambda n: node_bytes(graph, n),
                         reverse=True)[:self.tries]
        for n in sorted(largest, key=lambda n: graph.nodes[n]["cost"]
                        / max(node_bytes(graph, n), 1)):
            trial, spent = self._priced(kept - {n})
            if spent <= within and self._fits(trial, peak - 1):
                kept, flops, changed = trial, spent, True
                peak = simulate_peak(graph, kept | self.forced, self.prepared)
        return kept, flops, peak, changed


def _check_options(budget, offload, max_recompute):
    """Refuse options :func:`optimal` cannot honour before any planning work."""
    if budget is not None and budget <= 0:
        raise ValueError("budget must be > 0 (bytes, or a fraction of the plain peak), got %r"
                         % (budget,))
    if offload not in (None, "auto"):
        raise ValueError("optimal() chooses offloading itself: offload must be None or "
                         "'auto', got %r" % (offload,))
    if max_recompute is not None and (isinstance(max_recompute, bool) or not isinstance(
            max_recompute, (int, float)) or max_recompute < 0):
        raise ValueError(MAX_RECOMPUTE_ERROR % (max_recompute,))


def _candidate_kept_sets(graph, prepared, forced, limit, cap, offload_model, fast):
    """Kept sets worth simulating: the DP's most promising plans, plain
    backprop, the 'memory' spacing and, under a cap or budget, selective
    recomputation. ``offload_model`` is set when offloading is tried."""
    # The DP's own estimate (kept + largest segment) ranks candidates; only
    # the promising ones are simulated.
    candidates = plans(graph, prefer_speed=limit is not None or cap is not None,
                       offload_model=offload_model, prepared=prepared)
    if cap is not None:
        # The lowest (an end of the blends, see _blends), and those under the cap.
        candidates = candidates[:1] + [c for c in candidates[1:] if c[1] <= cap]
    # (The DP's estimate ignores offloading: with it, every candidate is simulated.)
    if offload_model is None:
        if limit is None:
            candidates = candidates[:6]
        else:
            candidates = [c for c in candidates if c[0] <= 1.5 * limit][:12] or candidates[:3]
    kept_sets = [kept for _, _, kept in candidates] + [[]]
    # Where single-tensor bottlenecks exist, the 'memory' spacing (denser near
    # the ys) can beat uniform segments; let it compete on the same estimate.
    # It spaces the bottlenecks a reshaped weight makes too (a projection of
    # keras-hub's attention): on GPT2 at 1,024 tokens under XLA, checkpoints
    # after each other layer's attention measured 3,845 MiB of XLA's temp
    # buffers on an H100, the 'memory' strategy's at the layers' ends 5,021,
    # though estimated 24 MiB lower.
    try:
        kept_sets.append(topological(graph, memory_spacing(
            graph, min_checkpoint_size=0, shared_buffers_weigh=True)[0]))
    except ValueError:
        pass
    if fast is not None:
        # Keeping every matmul/conv output and recomputing only the cheap ops
        # between them (selective recomputation) is what a tight cap allows,
        # and often the least recomputation that fits a budget.
        kept_sets.append(fast)
    if cap is not None:
        kept_sets += _selective(graph, prepared, cap=cap)
        kept_sets += _cheapest_of_plain(graph, prepared, cap=cap)
    if limit is not None:
        kept_sets += _selective(graph, prepared, limit=limit, forced=forced)
        if graph.graph.get("compiled", False):
            # What plain keeps less the cheapest, under a budget only where
            # XLA compiles the step: its buffer assignment matched these
            # estimates (GPT2 at 1,024 tokens: 6,218 MiB estimated, 6,052
            # on the H100). Without XLA such plans keep many tensors and
            # little is recomputed, where the estimate runs low (BERT's, at
            # 27.8 MiB, measured 38.5 against a 39.9 MiB budget).
            kept_sets += _cheapest_of_plain(graph, prepared, limit=limit, forced=forced)
    return kept_sets


def _blends(graph, prepared, forced, low, fast, limit, cap):
    """Kept sets for a budget ``limit`` or a cap, between the lowest plan
    ``low`` and ``fast`` (every matmul/conv output kept): ``low``'s kept
    tensors on one side of a split position in topological order, ``fast``'s
    on the other.

    The DP's plans recompute about one forward pass (a third of a step) and
    the speed set almost nothing; in between, recomputing only where
    activations are large for their FLOPs (a CNN's first stages) cuts most
    of the peak for part of the work (ResNet50 at 128 px: 60% of plain's
    estimate recomputing 9% of a step, where the DP's plans recompute 30%).
    Taking more of ``low`` lowers the peak and adds recomputation, so for
    each side the split is
    bisected: the least of ``low`` that fits ``limit``, or under ``cap``
    alone the most of ``low`` within it. Returns the kept sets tried.

    (Not for the lowest peak itself: a blend estimated as low as ``low``
    measured higher on every zoo CNN, 9% on ResNet50 and 17% on
    ConvNeXtTiny, as the estimate misses more where more is kept.)
    """
    position, m = prepared.index, len(prepared.names)

    def enough(kept):
        """Monotone in the amount of ``low`` taken (false, then true)."""
        everything = set(kept) | set(forced)
        if limit is not None:
            return fits_in(graph, everything, limit, prepared)
        return bool(everything) and recompute_cost(graph, kept, prepared) > cap

    tried = {}
    for low_first in (True, False):
        def blend(amount, low_first=low_first):
            if (low_first, amount) not in tried:
                split = amount if low_first else m - amount
                first, then = (low, fast) if low_first else (fast, low)
                tried[low_first, amount] = recompute_once(
                    graph, [n for n in first if position[n] < split]
                    + [n for n in then if position[n] >= split], prepared)
            return tried[low_first, amount]
        lo, hi = 0, m   # amount of low: enough(blend(hi)) is taken as true
        while hi - lo > max(1, m // _SPLIT_STEPS):
            mid = (lo + hi) // 2
            if enough(blend(mid)):
                hi = mid
            else:
                lo = mid
        blend(lo)
        blend(hi)
    return list(tried.values())


def _fills(graph, prepared, forced, options, limit, tries=3):
    """Kept sets that spend more of a budget ``limit`` to recompute less: blends
    (see :func:`_blends`) between the fastest plan that fits and each of the
    ``tries`` lowest plans that are faster but over it.

    The candidates are far apart on a transformer: GPT2 (128 tokens) had
    plans estimated at 62 MiB (recomputing 10% of a training step) and 79
    (6.3%), none between; with the blends, a 67 MiB target gets 66 MiB at
    8% and a 70 MiB one 69 MiB at 7.3%.
    """
    chosen = _fastest_fitting(options, limit)
    if chosen is None:
        return []
    faster = {}
    for p in sorted(options, key=lambda p: p[0]):
        if p[0] > limit and p[1] < chosen[1] and len(faster) < tries:
            faster.setdefault(tuple(p[2]), p[2])
    kept_sets = []
    for kept in faster.values():
        kept_sets += _blends(graph, prepared, forced, chosen[2], kept, limit, None)
    return kept_sets


def _scored_options(graph, prepared, kept_sets, forced, offload, model):
    """(simulated peak, seconds, kept, offloaded, recomputed FLOPs) for each kept
    set, and with ``offload`` for each way of offloading it."""
    options = []
    for kept in kept_sets:
        everything = set(kept) | set(forced)
        # Nothing kept at all is plain backprop: nothing recomputed.
        flops = recompute_cost(graph, kept, prepared) if everything else 0.0
        choices = [()]
        if offload:
            movable = offloadable(graph, topological(graph, everything))
            worth = [n for n in movable if model.worth_offloading(graph, n)]
            choices += [tuple(c) for c in (worth, movable) if c]
        for off in dict.fromkeys(choices):
            peak = simulate_peak(graph, everything, prepared, off, prefetch=model.prefetch)
            options.append((peak, model.seconds(graph, flops, off), kept, list(off), flops))
    return options


def _choose(options, limit, cap, plain, max_recompute, offload):
    """The lowest peak without a budget; with one, the least time among those
    that fit it (:class:`BudgetError` when none does)."""
    if limit is None:
        return min(options, key=lambda p: (p[0], p[1]))
    chosen = _fastest_fitting(options, limit)
    if chosen is None:
        capped = ("" if cap is None else
                  " recomputing at most %g%% of a training step" % (100 * max_recompute))
        error = BudgetError(
            "no plan fits a budget of %s%s; the smallest estimated peak is %s "
            "(plain: %s)%s" % (
                size_text(limit), capped,
                size_text(min(p[0] for p in options)) if options else "plain's",
                size_text(plain), "" if offload else "; offload='auto' may go lower on a GPU"))
        # For memsave.budget, which restates the error in the budget's terms.
        error.smallest = min((p[0] for p in options), default=None)
        error.capped = capped
        error.offload_hint = not offload
        raise error
    return chosen


def _fastest_fitting(options, limit):
    """The option that fits ``limit`` with the least time (then the lowest
    peak), or None."""
    return min((p for p in options if p[0] <= limit), key=lambda p: (p[1], p[0]), default=None)
