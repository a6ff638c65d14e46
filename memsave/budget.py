"""A budget in bytes, kept on the allocator: measure the step, and replan where it misses.

A plan's estimated peak is not what the allocator measures: BFC rounds and
reuses chunks, gradient kernels allocate temporaries, and the step holds
more than the differentiated region (the loss, the optimizer's update). On
the zoo models the measured peak was 8-25% above the estimate, sometimes
below it. So a budget in bytes (``budget="6GiB"``) is a target on the
measured peak (:mod:`memsave.profile`'s meter: the allocator's peak above
the pre-step baseline), kept by a loop around the training step:

1. The first trace plans for :data:`FIRST_AIM` of the budget (or, where
   nothing fits that, the lowest plan, if its estimate is within
   :data:`LOWEST_TRIED` of the budget: estimates err both ways), so that
   the first steps fit even where the estimate is low.
2. The next :data:`MEASURED_CALLS` calls of the step are measured, and the
   largest peak is taken (the first includes tracing and one-time
   allocations). The calls of one plan vary (GPT2's with SGD updates,
   80-94% of its budget over forty calls, ``benchmarks.call_spread``), so
   a plan fits if its largest call is within :data:`AIM` of the budget and
   leaves :data:`SPREAD_MARGIN` times its calls' spread below it (a later
   call may measure more). If the peak is past that margin, or more than
   :data:`TOLERANCE` below the budget, memsave retraces once with a corrected
   target: the estimate's error, taken as a ratio or as an offset,
   whichever is safer (an estimate above the measurement trusted up to
   :data:`MOST_TRUSTED` times it), maps the budget to the estimate the next
   plan must meet (aiming at :data:`REPLAN_AIM` of the budget, the middle
   of the band a plan is kept in, lower by as much as the first plan's
   spread narrowed that band). The first plan's last
   measured call runs under TensorFlow's profiler: scratch that an op's
   backward allocates beyond its outputs (an XLA-compiled call's buffers,
   a kernel's temporaries), from :data:`SCRATCH_MIN` of the budget up, is
   put on the tensor whose backward made it in every later plan, and the
   first plan is re-estimated with it before the error is taken (a buffer
   no plan changes is not an error that scales with the plan). Two bounds
   keep the replan's own measured calls near the budget, since they run
   before the loop can go back (on a full device, a call over it is
   refused and run again, see 4.): a replan above the first plan adds to
   its estimate no more than would fit if each byte measured
   :data:`UPWARD_SLOPE` bytes, and a replan of a rewritten step stays a
   rewrite (below plain backprop's estimate), since the first plan's error
   says nothing of plain's, which runs in the executor's order. Where
   nothing fits that, the
   lowest plan is taken if it might still measure within
   :data:`LOWEST_TRIED` of the budget (on the kinder reading: one
   measurement cannot tell how the error scales, and the replan is
   measured); else a :class:`~memsave.BudgetError` says
   so before the next step runs, with the smallest figure the allocator
   would see.
3. The replanned step is measured once more and both figures are logged.
   Past the margin of 2. counts as over the budget (a later call may
   measure a few percent more). A first plan within it is taken back where
   the replan is over it or measured less than the first plan; where an
   upward replan is over it and the first plan below the band, the two
   bracket the budget, and a second replan between them (on the measured
   bytes per estimated byte, see :meth:`Loop._replan_between`) is tried
   first, the first plan kept to go back to, unless the replan's planning
   graph, planned again for that estimate, keeps what the first plan kept
   (then the loop goes back to the first plan at once). Where both
   plans fit but measured more than :data:`TOLERANCE` below the budget, and
   their calls vary less than :data:`AIM` leaves, a second replan from the
   closer of the two, on the measured bytes per estimated byte between them
   (bounded so that its calls would stay within both plans' margins at
   :data:`CLOSER_SLOPE` bytes per estimated byte), is tried, the closer kept
   to go back to (see :meth:`Loop._replan_closer`). A replan
   over it, with no first plan within it, is followed by a second replan
   for the safer of both plans' errors (see :meth:`Loop._replan_again`),
   and one over it too by the lowest plan, each measured alone, the
   earlier plans let go (a WARNING says so). The plan settled on after a
   replan is measured again once the other plan's function is let go
   (letting it go changes the allocator's free chunks, and with them the
   peak of the calls that follow): these calls are the ones that follow, so
   it keeps the lowest plan's margin; past it, it is treated as a replan
   over the budget. A retrace after the loop settled (a new batch shape)
   plans for the settled plan's target, unmeasured. The lowest plan keeps a
   narrower margin (:data:`LOWEST_AIM`, less its calls' spread), since no
   plan is left below it (a WARNING says so where it measured within that
   margin but past the others'); the lowest plan measured over
   it is a :class:`~memsave.BudgetError` with the measured figures.
4. A call of a plan on trial that the allocator refuses (a full device) is
   undone and run again: the variables it may update were copied to host
   memory (numpy) before it and are restored, the loop takes the refusal as
   a measurement of more than the budget (the call's peak so far, at least
   the budget; an estimate above that bound is not trusted) and turns to
   the plan it asks for (a replan, the first plan, the lowest plan), and
   the same call runs on it (a refused first plan's function is let go
   first: the loop never goes back to it). Where none is left, a
   :class:`~memsave.BudgetError` with the variables restored. A per-step
   temporary variable that TensorFlow left behind after the refused call
   (which fails every later step that makes one of its name) is freed by
   clearing the eager kernel cache, and the call is undone and run again.
   A call that cannot be run again (the step reads its batch from an
   iterator it is given; Keras' own iterator is read ahead and replayed)
   raises a BudgetError instead, the step's updates kept: a replan refused
   after a first plan measured within the budget gives the next calls to
   that plan; otherwise every later call raises. A later call of the
   settled plan refused so is a BudgetError with the largest peak the loop
   measured.
5. The settled plan's calls go on being measured. One past the margin the
   plan was kept under (its peaks creep as the allocator's free chunks
   change) has the step replanned as in 2., the settled plan
   read as a first plan measured so and never gone back to, at most
   :data:`DRIFT_REPLANS` times (the lowest plan is kept: none is lower).

Keras (:func:`memsave.keras.enable` with a byte budget) runs the loop
automatically; a custom loop opts in with :func:`budgeted`. A fraction
(``budget=0.5``) stays a fraction of the plain estimate, with no loop.
Without allocator statistics (a CPU without ``TF_CPU_ALLOCATOR_USE_BFC``)
the budget is kept on the estimate only, and a warning says so.
"""

import collections.abc
import dataclasses
import gc
import logging
import re
import threading

import numpy as np
import tensorflow as tf

from memsave import profile, tf_internal
from memsave.errors import BudgetError
from memsave.log import size_text, warn_once
from memsave.planning import registry
from memsave.planning.simulate import plain_peak, simulate_peak

logger = logging.getLogger("memsave")

# The first plan's target, as a fraction of the budget: the zoo's CNNs
# measured 8-12% above their first plans' estimates, so most land in the
# band a plan is kept in (90-95%) with no replan; a first plan over the
# budget is replanned, and on a full device its refused call is undone.
FIRST_AIM = 0.87
# The most of the budget a measured peak may take: a step's peak varies by a
# few percent between calls of one process.
AIM = 0.95
# Where a replan aims: inside the band it is kept in (within TOLERANCE
# below the budget, under AIM: 90-95%), a little above its middle since a
# replan takes the nearest plan below its target (ResNet50: estimated 4%
# under it); the calls of one plan vary by up to 9% (BERT at 40 MiB: 38.1
# to 41.6 MiB over six calls).
REPLAN_AIM = 0.935
TOLERANCE = 0.10   # measured this far below the budget (or above it): replan
# The most an estimate above the first plan's measurement is trusted, as a
# ratio (see _correction).
MOST_TRUSTED = 1.15
# The measured bytes per estimated byte that a replan above the first plan is
# kept within the budget at. The zoo's upward replans measured 0.5-1.1 bytes
# per estimated byte (BERT, GPT2), once 1.8 (GPT2 at 1,024 tokens: BFC does
# not split a free chunk under twice the request); at 2.0 the transformers'
# replans stopped at 80-86% of their budgets. A replan that measures over
# goes back to the first plan, and on a full device its refused call is
# undone and run again on it.
UPWARD_SLOPE = 1.25
# The measured bytes per estimated byte that a second replan from the closer
# of two plans below the band is kept within their margin at: one pair of
# plans does not bound the next (GPT2 at 2 x 128 tokens under 70% of plain's
# peak: 0.67 between its first plan and replan, 2.5 from the replan to the
# closer plan, which measured 101% of the budget).
CLOSER_SLOPE = 2.5

# Scratch at the first plan's measured peak (an op's temporaries, the
# buffers of an XLA-compiled call that could not be compiled ahead, see
# memsave.graph.compiled_calls) is modelled in the replan from this fraction
# of the budget up (ConvNeXtTiny on CPU, before those buffers were counted
# ahead: a 256 MiB buffer of XLA's depthwise-convolution gradient under
# budgets of 360-500 MiB).
SCRATCH_MIN = 0.02

# The calls of one plan that updates its variables measure differently
# (an update runs in place or on a copy, as the executor's order has it):
# GPT2 at 4 x 128 tokens with SGD, one plan, forty calls: 79.9-93.8% of its
# budget (a step without updates: the same figure at every call). So each
# plan's MEASURED_CALLS calls are measured, and a plan fits if its largest
# leaves its calls' spread (largest less smallest) times SPREAD_MARGIN
# below the budget, where that is more than AIM leaves. On those forty
# calls, for a plan that just passes that margin, a later call is over the
# budget 6.0% of the time with two measured calls, 3.3% with three, 2.7%
# with three and the spread's margin (1.8% at 1.5 times the spread, at the
# cost of replans: BERT's three calls once spread over 10%);
# ``python -m benchmarks.call_spread``.
SPREAD_MARGIN = 1.0

# Where nothing fits the target, the lowest plan is traced and measured if
# its estimate (after a measurement, the kinder reading of it) is at most
# LOWEST_TRIED times the budget: estimates err both ways (the zoo's lowest
# plans measured 0.91-1.47 times theirs; GPT2's and BERT's at 128 tokens 0.92
# and 0.98, within budgets of 0.3 of plain's peak that their estimates were
# over). On a full device a call over the budget is refused, undone, and the
# loop raises its BudgetError.
LOWEST_TRIED = 1.15
# The most of the budget the lowest plan's largest call may take (less its
# calls' spread, as any plan's): no lower plan is left to turn to, so only a
# margin for the meter stays (DenseNet121's lowest plan: 97.8 MiB under a
# 99.5 MiB budget, three calls within 0.3 MiB).
LOWEST_AIM = 0.99

REPLAN, FIRST = "replan", "first"   # what Loop.observe asks of the step
MEASURED_CALLS = 3   # calls of each plan measured; Loop.observe takes the largest peak
# Calls of the settled plan go on being measured (the meter costs two reads of
# the allocator's statistics): its peaks creep as the allocator's free chunks
# change (MobileNetV3Small under 80 MiB, Adam: settled on 72.5, 71.7 and 74.4
# MiB, later 78.9, then 80.7, over), so a call past the margin it was kept
# under (Loop.settle) has the step replanned as though it were a first plan measured
# so, before a later call goes over. At most this many times per step.
DRIFT_REPLANS = 2

_lock = threading.Lock()
_active = []       # the loops whose step is being called, innermost last


def is_bytes(budget):
    """A budget in bytes (a promise on the allocator), not a fraction of plain's estimate."""
    return budget is not None and budget >= 1


@dataclasses.dataclass
class _Trace:
    """What one traced step planned: its byte budget, and the estimates of what runs."""

    promise: float = None
    estimates: list = dataclasses.field(default_factory=list)
    smallest: float = None     # the smallest estimate, when no plan fitted the target
    offload_hint: bool = False   # the planner's error suggested offload='auto'
    capped: str = ""           # the planner's error named a max_recompute= cap
    lowest: bool = False       # the lowest plan was taken (nothing fitted the target)
    kept: list = dataclasses.field(default_factory=list)   # each plan's kept tensor names
    targets: list = dataclasses.field(default_factory=list)   # each region's planned estimate
    # Each region's (PlanGraph, settings as given): what a target can be
    # planned on again without a trace (see Loop._plans_the_first).
    planned: list = dataclasses.field(default_factory=list)

    @property
    def estimate(self):
        return max(self.estimates) if self.estimates else None


class Loop:
    """One step's budget loop (see the module docstring): targets, measurements, a
    replan, and the lowest plan where that replan is over the budget too."""

    def __init__(self, where):
        self.where = where
        self.trace = _Trace()
        self.first = None          # (estimate, measured) of the first plan
        self.first_fits = None     # the most the first plan's calls may measure (see fits)
        self.correction = None     # budget -> target, after the first measurement
        self.replanned = False
        # The replan measured over too: planned once more, on both plans' errors
        # (``between``: between the two, the first plan kept to go back to).
        self.replanned_again = False
        self.between = False
        # The replan became the first plan (see _replan_closer): the step keeps
        # its function to go back to, and lets the first plan's go.
        self.swap_first = False
        # What the logs call the plan gone back to: the first plan, or the
        # replan that a closer replan took as first.
        self.first_name = "first plan"
        self.last_resort = False   # that one measured over too: the lowest plan, once
        self.done = False
        self.peaks = []            # every measured call's peak, in order (the promise's record)
        self.refusals = 0          # calls the allocator refused, undone and run again
        self.first_refused = False  # the first plan's figure is a refused call's bound
        self.scratch = None        # [(op name, bytes)] the first plan's large scratch
        self.replan_aim = REPLAN_AIM   # lower where the first plan's calls spread widely
        # (plan, lowest, measured): the plan settled on after a replan, measured
        # again once the other plan's function is let go (see _observe_confirmation).
        self.confirming = None
        self.first_trace = None    # the first plan's _Trace (what it kept, whether lowest)
        # What a retrace of the settled step (a new batch shape) plans for.
        self.settled_target = None
        self._recalibrate = None   # (measured, kept names): the first plan, to re-estimate
        self.settled_trace = None  # the _Trace of the plan settled on
        self.settled_margin = None  # the most its measured calls were held to (see settle)
        self.drift_replans = 0     # replans after a settled call measured past its margin
        self.settled_peak = None   # the largest call of a settled plan measured (see drifted)

    # -- planning side (called by memsave.planner while the step traces) --

    def planning(self, settings, graph=None):
        """``settings`` with the estimate a plan must meet for a byte budget;
        ``graph`` (the region's PlanGraph) gets the measured scratch."""
        if not is_bytes(settings.budget):
            return settings
        if graph is not None and self.scratch is not None:
            self._model_scratch(graph)
        if graph is not None:
            self.trace.planned.append((graph, settings))
        promise = self.trace.promise = settings.budget
        if self.done and self.settled_target is not None:
            # A retrace of the settled step (a new batch shape: a last partial
            # batch, another dataset) aims as the plan settled on did; at the
            # budget itself, it measured 8.6% over it. It is not measured.
            return settings.replace(budget=self.settled_target)
        if self.last_resort:
            # Nothing fits one byte: the planner reports its smallest plan,
            # which takes_lowest weighs against the budget.
            self.trace.targets.append(1.0)
            return settings.replace(budget=1.0)
        target = FIRST_AIM * promise if self.correction is None else self.correction(promise)
        target = self._bounded(target, promise, graph, len(self.trace.kept))
        self.trace.targets.append(target)
        return settings.replace(budget=target)

    def _bounded(self, target, promise, graph, region):
        """``target`` for the ``region``-th region (its PlanGraph ``graph``, if
        known) within the bounds every replan keeps: no higher than
        :meth:`_upward_bound` and, for a rewritten region, :meth:`_below_plain`;
        at least one byte."""
        if self.first is not None:
            target = min(target, self._upward_bound(promise))
        if graph is not None and self._measured_rewritten(region):
            target = min(target, self._below_plain(graph))
        return max(1.0, target)

    def settle(self, trace, margin):
        """The loop is done, on the plan ``trace`` planned, whose measured calls
        were within ``margin`` (bytes: what its later calls are held to)."""
        self.done, self.settled_trace, self.settled_margin = True, trace, margin
        if trace.targets:
            # The lowest plan again where it was the one (nothing fits 1 byte).
            self.settled_target = 1.0 if trace.lowest else min(trace.targets)

    def drifted(self, measured):
        """Take the measured peak of a call of the settled plan; True where it is
        past the margin the plan was kept under (see :meth:`settle`: :data:`AIM`
        less its calls' spread for a plan kept on its first calls, the meter's
        :data:`LOWEST_AIM` for one measured again once another plan was let
        go) and the loop is set to replan (:data:`DRIFT_REPLANS`): the settled
        plan is read as a first plan measured at ``measured``, never gone back
        to, and the replan is measured and settled as any. The lowest plan has
        none below it: it is kept (a WARNING where it passes its margin)."""
        trace, promise, margin = self.settled_trace, self.trace.promise, self.settled_margin
        if (not self.done or trace is None or promise is None or trace.estimate is None
                or margin is None):
            return False
        mib = 2 ** 20
        self.settled_peak = max(self.settled_peak or 0, measured)
        if measured <= margin:
            return False
        self.peaks.append(measured)
        if trace.lowest or self.drift_replans >= DRIFT_REPLANS:
            warn_once("budget:drift:%s" % self.where,
                      "memsave: %s: a call of the settled plan measured %.1f MiB, %.1f%% of "
                      "the budget of %.1f MiB, past the %.0f%% it was kept under; %s" % (
                          self.where, measured / mib, 100 * measured / promise, promise / mib,
                          100 * margin / promise,
                          "no plan is lower" if trace.lowest else
                          "it was replanned %d times so already" % self.drift_replans))
            return False
        self.drift_replans += 1
        self._take_as_first(trace, measured, False, 0)
        self.replanned_again, self.between, self.last_resort = False, False, False
        self.confirming, self.done = None, False
        self._replan_on_first()
        logger.warning("memsave: %s: budget %.1f MiB; a call of the settled plan (estimated "
                       "%.1f) measured %.1f MiB, past the %.0f%% it was kept under: replanning "
                       "from it", self.where, promise / mib, trace.estimate / mib,
                       measured / mib, 100 * margin / promise)
        return True

    def _upward_bound(self, promise):
        """The most a replan may estimate so that, if each byte it adds to the first
        plan's estimate measured :data:`UPWARD_SLOPE` bytes, its measured calls
        still fit the budget: they run before the loop can go back to the first
        plan (on a full device, a call over the budget is refused, undone and
        run again on the first plan)."""
        estimate, measured = self.first
        return max(estimate, estimate + (promise - measured) / UPWARD_SLOPE)

    def _measured_rewritten(self, region):
        """Whether the measured first plan rewrote the ``region``-th planned region
        (or the regions do not match up, and it may have)."""
        if self.first_kept is None:
            return False
        return region >= len(self.first_kept) or bool(self.first_kept[region])

    def _below_plain(self, graph):
        """The most a replan of a rewritten region may estimate: just below plain
        backprop's estimate. The first plan's error is an error of rewritten
        steps, whose fences fix the order; plain gradients run in the
        executor's order, and their estimate errs more (a small CNN with Adam:
        rewrites measured 0.92-1.22 times their estimates, plain 1.3 times; a
        replan that fell back to plain measured 22% over a budget). So a
        replan stays a rewrite unless plain itself was measured."""
        return plain_peak(graph) - 1

    def fits(self, spread, lowest=False):
        """The most a plan's largest measured call may be: :data:`AIM` of the
        budget (:data:`LOWEST_AIM` for the ``lowest`` plan, below which no
        plan is left), or less where its calls' ``spread`` (largest less
        smallest) asks for a wider margin (:data:`SPREAD_MARGIN`): a later
        call may measure more."""
        promise = self.trace.promise
        return min((LOWEST_AIM if lowest else AIM) * promise, promise - SPREAD_MARGIN * spread)

    @property
    def first_kept(self):
        """The measured first plan's kept names per region ([]: it ran plain), or None."""
        return None if self.first_trace is None else self.first_trace.kept

    @property
    def first_was_lowest(self):
        """Whether the measured first plan was the lowest plan."""
        return self.first_trace is not None and self.first_trace.lowest

    @property
    def first_to_go_back_to(self):
        """Whether the first plan measured within its margin and is still there
        to go back to: the lowest plan is built once the plans it replaces are
        let go."""
        # After a drift replan the first plan is the drifted one, let go.
        return (self.first is not None and not self.last_resort and not self.drift_replans
                and (self.between or not self.replanned_again)
                and self.first[1] <= self.first_fits)

    @property
    def replans(self):
        return int(self.replanned) + int(self.replanned_again) + int(self.last_resort)

    @property
    def keeps_no_other_plan(self):
        """Whether the plan on trial is measured alone: the loop goes back to no
        earlier plan from a second replan below both plans or the lowest plan,
        so their functions are let go before it is built."""
        return (self.replanned_again and not self.between) or self.last_resort

    def unfit(self, error):
        """The planner's ``BudgetError``: no plan fitted the target."""
        self.trace.smallest = getattr(error, "smallest", None)
        self.trace.offload_hint = getattr(error, "offload_hint", False)
        self.trace.capped = getattr(error, "capped", "")

    def takes_lowest(self):
        """Whether to plan for the lowest peak when nothing fits the target: the
        target keeps a margin (:data:`FIRST_AIM`, :data:`AIM`), and the lowest
        plan may still fit the budget itself (on the estimate before a
        measurement; after one, on the kinder of its two readings, since the
        replan is measured: ConvNeXtTiny's first plan measured 72% above its
        estimate, its lowest plan 50%). Records the answer for :meth:`observe`."""
        smallest, promise = self.trace.smallest, self.trace.promise
        if None in (smallest, promise):
            self.trace.lowest = False
            return False
        # The estimate errs both ways, and so does one measured plan's error
        # read onto another (ConvNeXtSmall: a first plan 150 MiB over its
        # estimate, the scratch of its depthwise gradients, said the lowest
        # would measure 281.7 MiB; it measured 261.5 under a budget of
        # 277.4): a lowest plan a little over the budget is tried
        # (LOWEST_TRIED), unless it was the plan measured.
        bound = promise if self.first_was_lowest else LOWEST_TRIED * promise
        self.trace.lowest = self.would_measure(smallest, kinder=True) <= bound
        return self.trace.lowest

    def would_measure(self, estimate, kinder=False):
        """What a plan estimated at ``estimate`` would measure: after the first
        measurement, the larger (``kinder``: the smaller) of its ratio and
        offset readings."""
        if self.first is None:
            return estimate
        first_estimate, first_measured = self.first
        pick = min if kinder else max
        return pick(estimate * first_measured / first_estimate,
                    estimate + first_measured - first_estimate)

    def record(self, plan):
        self.trace.estimates.append(runs_estimate(plan))
        runs_plain = not plan.kept or (plan.plain_peak_bytes
                                       and plan.estimated_peak_bytes >= plan.plain_peak_bytes)
        self.trace.kept.append([] if runs_plain else list(plan.kept))

    def _note_scratch(self, breakdown, measured):
        """Keep the first plan's large scratch (from its profiled call) for the
        replan's graph (see :meth:`_model_scratch`); one region only, since
        the kept sets of several cannot be re-estimated on one graph."""
        if breakdown is None or len(self.trace.kept) != 1:
            return
        large = [(op, n) for op, n in breakdown.scratch if n >= SCRATCH_MIN * self.trace.promise]
        if large:
            self.scratch = large
            self._recalibrate = (measured, self.trace.kept[0])

    def _model_scratch(self, graph):
        """Put the measured scratch on ``graph``'s tensors whose backward made it,
        and re-estimate the first plan with it: the replan's correction is then
        the error left once the scratch is modelled (a buffer that no plan
        changes is not an error of the estimate that scales with it)."""
        placed, unplaced = {}, []
        for op, nbytes in self.scratch:
            node = forward_tensor(graph, op)
            if node is not None:
                placed[node] = max(placed.get(node, 0), nbytes)
            else:
                unplaced.append("%s (%d bytes)" % (op, nbytes))
        if unplaced:
            logger.debug("memsave: %s: scratch in ops of no planning graph's tensor: %s",
                         self.where, ", ".join(unplaced))
        if not placed:
            logger.debug("memsave: %s: the measured scratch is in no planning graph (%s); "
                         "not modelled", self.where, ", ".join(op for op, _ in self.scratch))
            self.scratch = self._recalibrate = None
            return
        for node, nbytes in placed.items():
            graph.nodes[node]["scratch_bytes"] = max(graph.nodes[node]["scratch_bytes"], nbytes)
        if self._recalibrate is None:
            return
        measured, kept = self._recalibrate
        self._recalibrate = None
        estimate = simulate_peak(graph, [n for n in kept if graph.has_node(n)])
        mib = 2 ** 20
        logger.info("memsave: %s: scratch measured in %d backward op(s), %.1f MiB at most "
                    "(%s); the first plan re-estimated with it: %.1f MiB (was %.1f, measured "
                    "%.1f)", self.where, len(placed), max(placed.values()) / mib,
                    max(placed, key=placed.get), estimate / mib, self.first[0] / mib,
                    measured / mib)
        self.first = (estimate, measured)
        self.correction = _correction(estimate, measured, MOST_TRUSTED, self.replan_aim)

    # -- measuring side (called around the step) --

    def observe(self, measured, breakdown=None, refused=False, spread=0):
        """Take a plan's measured peak, its largest call's (``spread``: less its
        smallest; the :class:`~memsave.profile.PeakBreakdown` of one call, if
        profiled; ``refused``: the allocator refused a call, which needed more
        than ``measured``): :data:`REPLAN` when the step should be traced
        again, :data:`FIRST` when it should go back to the first plan, else
        None."""
        promise, estimate = self.trace.promise, self.trace.estimate
        if promise is None or estimate is None:
            self.done = True    # nothing in the step planned for a byte budget
            return None
        if self.confirming is not None:
            return self._observe_confirmation(measured, refused, spread)
        if self.replanned:
            return self._observe_replan(measured, refused, spread)
        mib = 2 ** 20
        self._take_as_first(self.trace, measured, refused, spread)
        taken = self.fits(spread, lowest=True) if self.trace.lowest else self.first_fits
        if (1 - TOLERANCE) * promise <= measured <= taken:
            self.settle(self.trace, taken)
            logger.info("memsave: %s: budget %.1f MiB, measured %.1f MiB (estimated %.1f)",
                        self.where, promise / mib, measured / mib, estimate / mib)
            self._say_lowest_above_margin(measured, spread)
            return None
        self._note_scratch(breakdown, measured)
        self._replan_on_first()
        calls = ("" if self.first_fits >= AIM * promise else
                 "; its calls spread over %.1f MiB, so at most %.1f MiB" % (
                     spread / mib, self.first_fits / mib))
        logger.info("memsave: %s: budget %.1f MiB, first plan %s %.1f MiB (estimated "
                    "%.1f%s); replanning once", self.where, promise / mib,
                    _measured_as(refused), measured / mib, estimate / mib, calls)
        return REPLAN

    def _take_as_first(self, trace, measured, refused, spread):
        """Read the plan ``trace`` planned as the first plan, measured at
        ``measured`` (``refused``: a refused call's bound) over calls spread
        over ``spread``."""
        self.first, self.first_refused = (trace.estimate, measured), refused
        self.first_trace, self.first_fits = trace, self.fits(spread)

    def _replan_on_first(self):
        """Set the loop to trace a replan for the first plan's error."""
        promise = self.trace.promise
        estimate, measured = self.first
        # A refused call needed more than ``measured``: a bound, not a
        # figure, so an estimate above it is not trusted. A spread wider
        # than AIM's margin lowers the replan's aim by as much.
        self.replan_aim = REPLAN_AIM - (AIM * promise - self.first_fits) / promise
        self.correction = _correction(estimate, measured,
                                      1.0 if self.first_refused else MOST_TRUSTED,
                                      self.replan_aim)
        self.replanned = True
        self.trace = _Trace()

    def _observe_replan(self, measured, refused, spread):
        """:meth:`observe` for the replan (or the lowest plan after it)."""
        promise = self.trace.promise
        # Within the budget, with the run-to-run noise (no lower plan is left
        # below the lowest).
        fits = self.fits(spread, lowest=self.trace.lowest)
        self.done = True
        # A first plan within the margin is kept where the replan is past
        # it, or measured less (closer to the budget is closer to plain's
        # speed: GPT2's upward replan measured 79%, its first plan 88%).
        # Past the margin is over: a later call of the same plan may
        # measure a few percent more (MobileNetV2's lowest plan: 106.6,
        # 112.0, 115.7 MiB).
        first = self.first[1]
        back = self.first_to_go_back_to and (measured > fits or measured < first)
        over = not back and measured > fits
        if over and self._kept_after_drift(measured, refused, fits):
            return None
        if over and (self.trace.lowest or self.last_resort):
            raise self._last_plan_over(measured, refused, fits)
        said = self._said_after_replan(measured, refused)
        if back and not self.replanned_again and measured > fits:
            between = self._replan_between(measured, spread, said)
            if between is not None:
                return between
        if over and not self.replanned_again:
            return self._replan_again(measured, refused, spread, said, fits)
        if not over and not refused and not self.replanned_again and not self.last_resort:
            closer = self._replan_closer(measured, spread, said, back)
            if closer is not None:
                return closer
        if over:
            # The second replan measured past the margin too (the estimate's
            # error does not scale: ConvNeXtTiny's plans estimated at 401 and
            # 317 MiB measured 560 and 510, its lowest, at 200, 303): the
            # lowest plan, measured once more, or a BudgetError.
            self.done, self.last_resort = False, True
            self.trace = _Trace()
            logger.warning("%s, over %.0f%% of the budget; planning for the lowest peak",
                           said, 100 * fits / promise)
            return REPLAN
        logger.info("%s%s", said, "; back to the %s" % self.first_name if back else "")
        if not back:
            self._say_lowest_above_margin(measured, spread)
        if self.keeps_no_other_plan:
            self.settle(self.trace, fits)   # measured alone: nothing to measure again
            return None
        self.done = False
        self.confirming = (("first", self.first_was_lowest, first) if back else
                           (_plan_on_trial(self), self.trace.lowest, measured))
        return FIRST if back else None

    def _last_plan_over(self, measured, refused, fits):
        """The BudgetError of the lowest plan (or the last resort) measured past
        its margin ``fits``: no plan is left to turn to."""
        promise, mib = self.trace.promise, 2 ** 20
        return BudgetError(
            "no plan fits a budget of %.1f MiB on the allocator: the %s plan "
            "%s %.1f MiB%s (estimated %.1f; the first plan was estimated %.1f and "
            "%s %.1f MiB)" % (
                promise / mib, "lowest" if self.trace.lowest else "last",
                _measured_as(refused), measured / mib,
                "; the allocator refused its call, which was undone" if refused else
                "" if measured > promise else
                ", more than %.0f%% of the budget, within its calls' variation"
                % (100 * fits / promise), self.trace.estimate / mib, self.first[0] / mib,
                _measured_as(self.first_refused), self.first[1] / mib))

    def _kept_after_drift(self, measured, refused, fits):
        """Whether a drift replan (training under way) that came to the lowest
        plan, its calls within the budget but past the margin ``fits`` for
        their spread, is kept (settled, with a WARNING), as a settled lowest
        plan that drifts is (see :meth:`drifted`), not stopped with a
        BudgetError."""
        promise = self.trace.promise
        if not (self.trace.lowest and self.drift_replans and not refused
                and measured <= promise):
            return False
        self.settle(self.trace, promise)
        logger.warning("%s; no plan is lower: kept, over the %.0f%% a plan is kept within "
                       "for its calls' variation; a later call may need more",
                       self._said_after_replan(measured, refused), 100 * fits / promise)
        return True

    def _said_after_replan(self, measured, refused):
        """The log line of a measured replan: both plans' estimates and figures."""
        mib = 2 ** 20
        return ("memsave: %s: budget %.1f MiB; %s estimated %.1f, %s %.1f "
                "MiB; %s %.1f, %s %.1f MiB" % (
                    self.where, self.trace.promise / mib, self.first_name, self.first[0] / mib,
                    _measured_as(self.first_refused), self.first[1] / mib,
                    "the lowest plan estimated" if self.last_resort else
                    "replanned again to estimate" if self.replanned_again else
                    "replanned to estimate", self.trace.estimate / mib,
                    _measured_as(refused), measured / mib))

    def _replan_again(self, measured, refused, spread, said, fits, estimate=None):
        """Both plans measured past their margins (or the plan settled on did,
        measured again once the other was let go), and one plan's error did
        not carry to the other (MobileNetV2 under 245.8 MiB: a first plan estimated
        211.2 measured 235.0, its replan estimated 202.2 measured 225.7-245.1;
        under 175.6, a replan estimated lower than its first plan measured
        higher). So the step is planned once more, for the safer of both plans'
        corrections, aiming lower by the wider of their calls' spreads, before
        the lowest plan is the last resort (which settled those two at 46% and
        69% of their budgets)."""
        promise = self.trace.promise
        widest = min(self.first_fits, self.fits(spread))
        aim = REPLAN_AIM - (AIM * promise - widest) / promise
        by_first = _correction(*self.first, 1.0 if self.first_refused else MOST_TRUSTED, aim)
        by_replan = _correction(self.trace.estimate if estimate is None else estimate, measured,
                                1.0 if refused else MOST_TRUSTED, aim)
        self.correction = lambda budget: min(by_first(budget), by_replan(budget))
        self.done, self.replanned_again = False, True
        self.trace = _Trace()
        logger.warning("%s, over %.0f%% of the budget; replanning once more, for the safer "
                       "of both plans' errors (aiming at %.1f%% of the budget)", said,
                       100 * fits / promise, 100 * aim)
        return REPLAN

    def _replan_between(self, measured, spread, said):
        """An upward replan measured past its margin, its first plan below the
        band: the two bracket the budget, and each estimated byte between them
        measured as many bytes as their slope says (GPT2 at 1,024 tokens: 1.9,
        against the :data:`UPWARD_SLOPE` the replan was bounded by, as BFC does
        not split a free chunk under twice the request; back on the first plan
        it settled at 78%). So the step is planned once more on that slope, for
        the replan's aim less the wider of their calls' spreads, the first plan
        kept to go back to. None where they do not bracket it (the replan
        estimated or measured no more than the first plan)."""
        promise, estimate = self.trace.promise, self.trace.estimate
        first_estimate, first = self.first
        if first >= (1 - TOLERANCE) * promise or estimate <= first_estimate or measured <= first:
            return None
        slope = (measured - first) / (estimate - first_estimate)
        widest = min(self.first_fits, self.fits(spread))
        aim = (REPLAN_AIM - (AIM * promise - widest) / promise) * promise
        target = first_estimate + (aim - first) / slope
        if not first_estimate < target < estimate or self._plans_the_first(target):
            return None
        self.correction = lambda budget: target
        self.done, self.replanned_again, self.between = False, True, True
        self.trace = _Trace()
        mib = 2 ** 20
        logger.info("%s, over %.0f%% of the budget, the first plan below %.0f%%: replanning "
                    "once more between them, for %.1f MiB estimated (%.2f measured bytes per "
                    "estimated byte between them)", said, 100 * widest / promise,
                    100 * (1 - TOLERANCE), target / mib, slope)
        return REPLAN

    def _replan_closer(self, measured, spread, said, back):
        """Both plans measured within their margins and below the band (more
        than :data:`TOLERANCE` below the budget): the step is planned once
        more from the closer of the two, on the measured bytes per estimated
        byte between them, for the replan's aim, and that plan is kept to go
        back to (a closer replan becomes the first plan). A plan's error off
        the first plan's reading is a few percent either way (GPT2 at 8 x 128
        tokens under 70% of plain's peak: a replan for 93.5% of the budget, by
        the first plan's error, measured 90%, then 85% once the first plan was
        let go), as wide as the band. None where the two tell no slope (the
        same estimate), the plan for that target is the closer one, or either
        plan's calls spread wider than :data:`AIM` leaves below the budget: a
        step whose calls vary so much cannot be placed within the band, and a
        plan settled closer to it has a later call over the budget sooner
        (BERT at 4 x 128 tokens with SGD updates: one plan's three calls at
        79-87% of a budget)."""
        promise, estimate = self.trace.promise, self.trace.estimate
        first_estimate, first = self.first
        low, steady = (1 - TOLERANCE) * promise, AIM * promise
        if (self.first_refused or self.drift_replans or first > self.first_fits
                or measured > self.fits(spread) or max(first, measured) >= low
                or estimate == first_estimate
                or min(self.first_fits, self.fits(spread)) < steady):
            return None
        # Each byte above the closer plan is taken to measure as many bytes as
        # between the two, and no fewer than 1 / UPWARD_SLOPE (upward replans
        # measured 0.35-1.9 bytes per estimated byte; a replan that measured
        # less than its first plan tells no slope); the target is bounded as
        # any upward replan's, from the closer plan (see _upward_bound), and so
        # that at CLOSER_SLOPE its calls stay within both plans' margins.
        slope = max((measured - first) / (estimate - first_estimate), 1 / UPWARD_SLOPE)
        widest = min(self.first_fits, self.fits(spread))
        aim = (self.replan_aim - (AIM * promise - widest) / promise) * promise
        earlier = (self.first, self.first_trace, self.first_fits, self.first_refused,
                   self.first_name)
        closer_is_replan = measured >= first and not back
        if closer_is_replan:
            self._take_as_first(self.trace, measured, False, spread)
            self.first_name = "replan"
        base_estimate, base = self.first
        target = min(base_estimate + (aim - base) / slope,
                     base_estimate + (widest - base) / CLOSER_SLOPE,
                     self._upward_bound(promise))
        if target <= base_estimate or self._plans_the_first(target):
            (self.first, self.first_trace, self.first_fits, self.first_refused,
             self.first_name) = earlier
            return None
        self.swap_first = closer_is_replan
        self.correction = lambda budget: target
        self.done, self.replanned_again, self.between = False, True, True
        self.trace = _Trace()
        logger.info("%s, both below %.0f%% of the budget: replanning once more from the %s "
                    "plan, for %.1f MiB estimated (%.2f measured bytes per estimated byte "
                    "between them)", said, 100 * (1 - TOLERANCE),
                    "replanned" if closer_is_replan else "first", target / 2 ** 20, slope)
        return REPLAN

    def _plans_the_first(self, target):
        """Whether planning for ``target`` (the replan's estimate of a plan
        between the first plan and the replan) would keep what the first plan
        kept: plans come in steps, and between GPT2's at 1,024 tokens, 483.5
        and 551.5 MiB estimated, none was, so a second replan traced and
        measured the first plan again. Asked of the replan's own planning
        graph, without a trace; one region only (False where it cannot tell)."""
        if len(self.trace.planned) != 1 or not self.first_kept or len(self.first_kept) != 1:
            return False
        graph, settings = self.trace.planned[0]
        if settings.checkpoints.strategy is None:
            return False
        bound = self._bounded(target, self.trace.promise, graph, 0)
        try:
            plan = registry.run(settings.checkpoints.strategy, graph,
                                **settings.replace(budget=bound).strategy_options())
        except BudgetError:
            return False
        if list(plan.kept) != list(self.first_kept[0]):
            return False
        logger.info("memsave: %s: the plan for %.1f MiB estimated, between the %s and "
                    "the replan, is the %s", self.where, bound / 2 ** 20, self.first_name,
                    self.first_name)
        return True

    def _observe_confirmation(self, measured, refused, spread):
        """:meth:`observe` for the plan settled on after a replan, measured again
        once the other plan's function is let go. Its calls were measured while
        that function was alive, and letting it go changes the allocator's free
        chunks, so the calls that follow measure differently (a 24-layer chain's
        replan under a 6.3 MiB budget: 5.5 MiB while the first plan's function
        was alive, 6.4 after; 11 of 12 such pairs differed, by -7% to +15%).
        These calls are the ones that follow, so only the meter's margin is
        kept, as for the lowest plan (:data:`LOWEST_AIM`, less their spread):
        within it the plan is kept; past it, a second replan below both plans
        follows (:meth:`_replan_again`; MobileNetV2 under 259.2 MiB: a replan
        at 94.9% while its first plan's function was alive, 96.8% after, and
        the lowest plan then settled at 48%), the lowest plan after a second
        replan, and a BudgetError after the lowest plan or the last resort."""
        plan, lowest, before = self.confirming
        promise, mib = self.trace.promise, 2 ** 20
        fits = self.fits(spread, lowest=True)
        self.confirming, self.done = None, True
        said = ("memsave: %s: budget %.1f MiB; the %s measured %.1f MiB while the "
                "other plan's function was alive, and %s %.1f MiB once it was let go" % (
                    self.where, promise / mib,
                    self.first_name if plan == "first" else plan + " plan", before / mib,
                    _measured_as(refused),
                    measured / mib))
        if measured <= fits and not refused:
            self.settle(self.first_trace if plan == "first" else self.trace, fits)
            logger.info("%s", said)
            return None
        if lowest or self.last_resort:
            raise BudgetError(
                "no plan fits a budget of %.1f MiB on the allocator: %s, more than %.0f%% "
                "of the budget" % (promise / mib, said[len("memsave: "):], 100 * fits / promise))
        if not self.replanned_again:
            return self._replan_again(measured, refused, spread, said, fits,
                                      self.first[0] if plan == "first" else self.trace.estimate)
        self.done, self.last_resort = False, True
        self.trace = _Trace()
        logger.warning("%s, over %.0f%% of the budget; planning for the lowest peak",
                       said, 100 * fits / promise)
        return REPLAN

    def _say_lowest_above_margin(self, measured, spread):
        """A WARNING where the lowest plan was taken above the margin any other
        plan keeps below the budget (:data:`AIM`): a later call may measure more."""
        if self.trace.lowest and measured > self.fits(spread):
            logger.warning(
                "memsave: %s: the lowest plan measured %.1f MiB, %.1f%% of the budget of "
                "%.1f MiB: over the %.0f%% other plans are kept within for the calls' "
                "variation, taken as no plan is lower; a later call may need more",
                self.where, measured / 2 ** 20, 100 * measured / self.trace.promise,
                self.trace.promise / 2 ** 20, 100 * AIM)

    def budget_error(self, error):
        """``error`` (no plan fitted the target) in the budget's terms."""
        smallest, promise = self.trace.smallest, self.trace.promise
        if smallest is None or promise is None:
            return error
        sizes = getattr(error, "sizes_note", "")
        # max_recompute= binds too: say so (a plan recomputing more may fit).
        # (Read from the loop: tf.function raises a copy of the error, without
        # the planner's attributes.)
        capped = self.trace.capped
        if self.first is None:
            return BudgetError(
                "no plan fits a budget of %s%s: the smallest plan is estimated at %s%s%s" % (
                    size_text(promise), capped, size_text(smallest), "; offload='auto' may "
                    "go lower on a GPU" if self.trace.offload_hint else "", sizes))
        estimate, measured = self.first
        return BudgetError(
            "no plan fits a budget of %s on the allocator%s: the smallest plan would "
            "measure at least about %s (estimated %s; the first plan was "
            "estimated %s and measured %s)%s" % (
                size_text(promise), capped, size_text(self.would_measure(smallest, kinder=True)),
                size_text(smallest), size_text(estimate), size_text(measured), sizes))


def _plan_on_trial(loop):
    return ("lowest" if loop.last_resort else "second replanned" if loop.replanned_again
            else "replanned" if loop.replanned else "first")


def _measured_as(refused):
    return "needed more than" if refused else "measured"


_GRADIENT_SCOPES = re.compile(r"^(gradients(_\d+)?|gradient_tape|memsave_\d+)$")


def forward_tensor(graph, op_name):
    """The planning graph's tensor whose backward (or recomputation) runs the op
    ``op_name`` ('gradients/memsave_0/block/ln/mul_grad/Mul' -> 'block/ln/mul:0',
    'gradient_tape/block/ln/mul/Mul' -> the same), or None."""
    parts = op_name.split("/")
    while parts and _GRADIENT_SCOPES.match(parts[0]):
        parts.pop(0)
    for i, part in enumerate(parts):
        if part.endswith("_grad"):   # tf.gradients: 'fwd_grad/op'
            name = "/".join(parts[:i] + [part[:-len("_grad")]]) + ":0"
            return name if graph.has_node(name) else None
    # The tape names a gradient op 'gradient_tape/fwd/op': the longest prefix.
    for end in range(len(parts), 0, -1):
        name = "/".join(parts[:end]) + ":0"
        if graph.has_node(name):
            return name
    return None


def runs_estimate(plan):
    """The estimated peak of what runs: plain backprop's where the plan keeps nothing
    or is not below plain (memsave then runs plain gradients)."""
    plain = plan.plain_peak_bytes
    if not plan.kept or (plain and plan.estimated_peak_bytes >= plain):
        return plain
    return plan.estimated_peak_bytes


def _correction(estimate, measured, most_trusted=MOST_TRUSTED, replan_aim=REPLAN_AIM):
    """budget -> the estimate to plan for: the safer of the error as a ratio and
    as an offset (a ratio shrinks an offset such as the weights' gradients
    with the plan; an offset overstates a ratio when the plan grows). An
    estimate above what the first plan measured is trusted up to
    :data:`MOST_TRUSTED` times the measurement: GPT2's and BERT's plans at 128 tokens
    estimate 8-11% above their measurements, every plan alike, and a replan
    measured over the budget goes back to the first plan."""
    measured = max(measured, 1)   # a meter that saw nothing allocated
    ratio = min(most_trusted, estimate / measured)
    offset = max(measured * (1 - most_trusted), measured - estimate)

    def target(promise):
        aim = replan_aim * promise
        by_offset = aim - offset
        return min(aim * ratio, by_offset) if by_offset > 0 else aim * ratio
    return target


# ---------------------------------------------------------------------------
# The planner's side: the innermost loop of this process, if a step is being called.

def active():
    with _lock:
        return _active[-1] if _active else None


class _Entered:
    def __init__(self, loop):
        self.loop = loop

    def __enter__(self):
        with _lock:
            _active.append(self.loop)

    def __exit__(self, *exc):
        with _lock:
            _active.remove(self.loop)


# ---------------------------------------------------------------------------
# The measuring side.

class MeasuredStep:
    """A step that keeps the byte budget its plans were given (see the module docstring).

    ``build()`` returns a fresh traced step (a ``tf.function``); it is called
    again for the one replan. ``state()`` returns variables a call may
    update beyond those the traced ``tf.function`` captures, and
    ``replay(args, kwargs)`` returns a function that gives the arguments of
    each run of one call, or None where the call cannot be run again (its
    batch is read inside the step): a call of a plan on trial that the
    allocator refuses is undone and run again on the plan the loop turns to.
    That function's ``read_ahead`` (if any) is the bytes of a batch it read
    before the call, which the call's measured peak counts as a settled
    call, reading its batch inside, does.
    ``compiled(step, args, kwargs)`` returns the ``tf.function`` a step calls
    with those arguments of its own (default: the step itself), whose trace
    names the variables it captures, or None where none takes them as they
    are (then ``state()`` alone is restored).
    """

    def __init__(self, build, where, state=None, replay=None, compiled=None):
        self._build = build
        self.loop = Loop(where)
        self._step = build()
        self._state = state
        self._compiled = compiled or (lambda step, args, kwargs: step)
        self._replay = replay or same_arguments
        self._first = None    # the first plan's step, while a replan is on trial
        self._calls = 0
        self._peaks = []      # the current plan's measured calls: (peak, batch bytes)
        self._batch = None    # the bytes of the batch of the call on trial, where known
        self._unfit = None    # the BudgetError of a lowest plan measured over the budget
        self._cleared = 0     # kernel caches cleared of what a refused call left behind
        self._ahead = 0       # bytes of the batch the call on trial was read ahead

    def __call__(self, *args, **kwargs):
        if self._unfit is not None:
            raise self._unfit   # every later call too: no step runs over the budget
        if not self.loop.done:
            return self._trial(args, kwargs)
        # The settled plan's calls are measured where the loop measured any
        # (see DRIFT_REPLANS).
        watched = self.loop.trace.promise is not None and bool(self.loop.peaks)
        try:
            with _Entered(self.loop):   # a retrace plans as the settled plan did
                if not watched:
                    return self._step(*args, **kwargs)
                out, peak = profile.measured_call(self._step, *args, **kwargs)
        except tf.errors.ResourceExhaustedError as error:
            if self.loop.trace.promise is None or not self.loop.peaks:
                raise   # nothing in the step planned for a byte budget, or measured
            raise self._ran_out(error, settled=True) from error
        if self.loop.drifted(peak):
            self._let_go()   # the settled plan is never gone back to
            self._step, self._calls, self._peaks = self._build(), 0, []
        return out

    def _let_go(self):
        """Drop the plans' functions, with what their kernels hold, before the
        next is built: TensorFlow's constant folding of the next function
        crashed the process where an allocation it needed failed (DeBERTaV3
        under a hard cap), and the next is measured without them."""
        self._step = self._first = None
        gc.collect()

    def _trial(self, args, kwargs):
        """A call while the loop measures: a call the allocator refuses is undone
        (the variables restored from host copies taken before it) and run again
        on the plan the loop turns to (:meth:`_refused`), until one runs or
        none is left (a BudgetError, the variables restored)."""
        again = self._replay(args, kwargs)
        # A batch read ahead (to run the call again) is allocated before the
        # call, where a settled call reads it inside: counted as inside.
        self._ahead = getattr(again, "read_ahead", 0)
        self._batch = getattr(again, "batch_bytes", None)
        while True:
            if again is not None:
                args, kwargs = again()
            saved = self._saved(args, kwargs) if again is not None else None
            base = _meter_base()
            try:
                with _Entered(self.loop):
                    self._calls += 1
                    if self._calls == 1:   # tracing and one-time allocations
                        return self._traced(*args, **kwargs)
                    return self._measured(*args, **kwargs)
            except tf.errors.ResourceExhaustedError as error:
                if self.loop.trace.promise is None:
                    raise   # nothing in the step planned for a byte budget
                if saved is None:
                    raise self._ran_out(error, settled=False, why=(
                        "it reads its batch itself" if again is None else
                        "its variables are not known")) from error
                saved.restore()
                self._refused(error, base)
            except tf.errors.AlreadyExistsError as error:
                if not self.loop.refusals or "__per_step" not in (error.message or ""):
                    raise
                if saved is not None:
                    saved.restore()
                if saved is None or self._cleared >= self.loop.refusals:
                    raise self._left_behind(error) from error
                self._clear_left_behind(error)

    def _saved(self, args, kwargs):
        """Host copies of what a call may update, or None if they cannot be found:
        those ``state()`` names (it may make some, as Keras' optimizer slots)
        and every variable the traced step captures (a GAN's second optimizer,
        a ``tf.random.Generator``), copied after the trace, which makes some
        too (Keras' compiled metrics), at their initial values."""
        # The trace first: it makes the variables of a model built on its
        # first call, which state() then finds.
        captured = self._captured(args, kwargs)
        state = self._state() if self._state is not None else None
        if captured is None and state is None:
            return None
        return _HostCopies(list(captured or ()) + list(state or ()))

    def _captured(self, args, kwargs):
        """The variables the traced step captures (traced first, as its call would)."""
        trace = getattr(self._compiled(self._step, args, kwargs), "get_concrete_function", None)
        if trace is None:
            return None
        with _Entered(self.loop):
            try:
                return trace(*args, **kwargs).variables
            except BudgetError as error:
                raise self.loop.budget_error(error) from None

    def _traced(self, *args, **kwargs):
        try:
            return self._step(*args, **kwargs)
        except BudgetError as error:
            raise self.loop.budget_error(error) from None

    def _measured(self, *args, **kwargs):
        try:
            profile.memory_info()
        except RuntimeError as error:
            warn_once("budget:no-meter", "memsave: %s: the budget is kept on the estimate "
                      "only: %s" % (self.loop.where, error))
            self.loop.done = True
            return self._traced(*args, **kwargs)
        breakdown = None
        if len(self._peaks) == MEASURED_CALLS - 1 and self.loop.first is None:
            # The first plan's last measured call, under the profiler: the
            # scratch at its peak (see Loop._model_scratch).
            (out, breakdown), peak = profile.measured_call(
                profile.profiled_call, self._traced, *args, strict=False, **kwargs)
        else:
            out, peak = profile.measured_call(self._traced, *args, **kwargs)
        peak += self._ahead
        self._peaks.append((peak, self._batch))
        self.loop.peaks.append(peak)
        if len(self._peaks) < MEASURED_CALLS:
            return out
        measured, self._peaks = self._peaks, []
        self._observe(max(p for p, _ in measured), breakdown, spread=_spread(measured))
        return out

    def _observe(self, peak, breakdown=None, refused=False, spread=0):
        """Give the loop a plan's measured peak and turn to the plan it asks for."""
        try:
            action = self.loop.observe(peak, breakdown, refused, spread)
        except BudgetError as error:
            self._unfit = error
            raise
        if action == REPLAN:
            if self.loop.keeps_no_other_plan or (refused and self._first is None):
                # The loop never goes back to a first plan the allocator
                # refused, nor from a second replan below both plans or the
                # lowest plan: the functions it leaves go (see _let_go).
                self._let_go()
            elif self.loop.swap_first:
                # The replan on trial is the plan to go back to now.
                self.loop.swap_first = False
                self._first = self._step
                gc.collect()
            elif self._first is None:
                self._first = self._step   # the first plan, to go back to
            # (else the replan on trial goes, and the first plan stays)
            self._step = self._build()
            self._calls = 0
        elif action == FIRST:
            self._step = self._first
        if self.loop.done or (self.loop.confirming is not None and self._first is not None):
            # The other plan's function is let go now, not at a later garbage
            # collection, so the calls confirmed are like those that follow;
            # so are the batches the measured calls were given again (a
            # dataset is a reference cycle: each held its batch until Python's
            # collector ran, a 4 MiB batch into training once settled).
            self._first = None
            gc.collect()

    def _refused(self, error, base):
        """An undone call the allocator refused: a measurement of more than the
        budget (its peak so far, at least the budget), which the loop answers
        like one over it: a replan, the first plan, the lowest plan, or a
        BudgetError. (The refused allocation is not added: it may be scratch
        that no plan changes, such as XLA's 220 MiB buffer of a depthwise
        convolution's gradient, or a chunk that only the pool's
        fragmentation refused.)"""
        needed = max(self.loop.trace.promise, _peak_since(base) + self._ahead)
        self._peaks = []
        logger.warning("memsave: %s: the allocator refused a call of the %s plan (estimated "
                       "%.1f MiB; it needed more than %.1f MiB): undone, and run again on "
                       "the plan the budget loop turns to: %s", self.loop.where,
                       _plan_on_trial(self.loop),
                       (self.loop.trace.estimate or 0) / 2 ** 20, needed / 2 ** 20,
                       _oom_line(error))
        self.loop.refusals += 1
        self._observe(needed, refused=True)

    def _clear_left_behind(self, error):
        """A call run again after a refused one found a per-step temporary variable
        that the refused call made and TensorFlow did not free (Grappler rewrites a
        large gradient sum into AccumulateNV2, which runs on a TemporaryVariable;
        it lives in a step container that function kernels share and that is
        cleaned only when a kernel is destroyed): the eager kernel cache is
        cleared, which frees it, and the call, undone, runs again (the failed run
        not counted among the plan's calls). Once per refused call."""
        self._cleared += 1
        self._calls -= 1
        logger.warning("memsave: %s: a call run again after a refused one found a per-step "
                       "temporary variable the refused call left behind; the call was undone, "
                       "the eager kernel cache is cleared to free it (stateful kernels restart, "
                       "functions are optimized again), and the call runs again: %s",
                       self.loop.where, _line_with(error, "__per_step"))
        tf_internal.clear_kernel_cache()

    def _left_behind(self, error):
        """The BudgetError, for this and every later call, where a per-step temporary
        variable that a refused call left behind is found again after the kernel
        cache was cleared (see :meth:`_clear_left_behind`), or by a call that
        cannot be undone."""
        self._unfit = BudgetError(
            "memsave: %s: after the allocator refused a call under a budget of %.1f MiB, "
            "TensorFlow left a per-step temporary variable of that call behind, and "
            "clearing the eager kernel cache did not free it (or the call cannot be "
            "undone); the call was undone where it could be (the variables restored). "
            "Restart the process with a lower budget: %s" % (
                self.loop.where, self.loop.trace.promise / 2 ** 20 if self.loop.trace.promise
                else 0.0, _line_with(error, "__per_step")))
        return self._unfit

    def _ran_out(self, error, settled, why=None):
        """The BudgetError for a call the allocator refused that cannot be undone.
        A plan on trial whose call cannot be run again (``why``: it reads its
        batch itself, or its variables are not known): the step failed part
        way (some variables may be updated); a replan whose first plan
        measured within the budget gives way to that plan for the next
        calls, otherwise every later call raises. The
        ``settled`` plan: said with the largest peak the loop measured."""
        loop, mib = self.loop, 2 ** 20
        promise = loop.trace.promise
        if settled:
            return BudgetError(
                "memsave: %s: the allocator ran out of memory under a budget of %.1f MiB in "
                "a call of the settled plan (the loop's measured calls: %.1f MiB at most; a "
                "later call needed more: other inputs, or the allocator's fragmentation): %s"
                % (loop.where, promise / mib, max(loop.peaks) / mib, _oom_line(error)))
        first = loop.first_to_go_back_to
        said = ("memsave: %s: the allocator ran out of memory in a call of the %s "
                "plan (estimated %.1f MiB) under a budget of %.1f MiB; the step failed and "
                "cannot be run again (%s; variables it updated before the failure keep "
                "the update)" % (
                    loop.where, _plan_on_trial(loop), (loop.trace.estimate or 0) / mib,
                    promise / mib, why))
        if loop.replanned and first:
            self._step, self._first = self._first, None
            loop.settle(loop.first_trace, loop.first_fits)
            logger.warning("%s; back to the %s, measured %.1f MiB",
                           said, loop.first_name, loop.first[1] / mib)
            return BudgetError(said + "; the next calls run the %s, measured %.1f "
                               "MiB: %s" % (loop.first_name, loop.first[1] / mib,
                                            _oom_line(error)))
        self._unfit = BudgetError(said + "; no plan is known to fit it (a first plan aims at "
                                  "%.0f%% of the budget on its estimate): %s" % (
                                      100 * FIRST_AIM, _oom_line(error)))
        return self._unfit


def _spread(measured):
    """The spread (largest less smallest) of a plan's measured calls
    ``[(peak, batch bytes)]``, among those of its largest batch where the
    batches are known: the last batch of an epoch is often smaller (a
    dataset batched without ``drop_remainder``), and its lower peak is not
    the calls' variation (a helper saw 6.5 MiB of 15 taken for it, and a
    BudgetError where plans fit)."""
    largest = max((b for _, b in measured if b is not None), default=None)
    peaks = [p for p, b in measured if largest is None or b == largest]
    return max(peaks) - min(peaks)


def batch_bytes(structure):
    """The bytes of the tensors of known shape in ``structure`` (a batch)."""
    return sum(t.shape.num_elements() * t.dtype.size
               for t in tf.nest.flatten(structure, expand_composites=True)
               if isinstance(t, tf.Tensor) and t.shape.is_fully_defined())


def same_arguments(args, kwargs):
    """``replay`` for a step given its batch: the same arguments again. None
    where one is an iterator: a run again would read the next batch."""
    for a in tf.nest.flatten((args, kwargs)):
        if isinstance(a, (tf.data.Iterator, tf.distribute.DistributedIterator,
                          collections.abc.Iterator)):
            return None

    def replay():
        return args, kwargs
    replay.batch_bytes = batch_bytes((args, kwargs))
    return replay


class _HostCopies:
    """Host copies (numpy, outside TensorFlow's allocator and the device) of
    variables, to undo a call the allocator refused."""

    def __init__(self, variables):
        unique = {id(v): v for v in variables}.values()
        self._values = [(v, np.array(v.numpy(), copy=True)) for v in unique]

    def restore(self):
        for v, value in self._values:
            v.assign(value)


def _meter_base():
    """The allocator's bytes in use, its peak reset (None without statistics)."""
    try:
        base = profile.memory_info()["current"]
    except RuntimeError:
        return None
    tf.config.experimental.reset_memory_stats(profile.default_device())
    return base


def _peak_since(base):
    """The allocator's peak above ``base`` since :func:`_meter_base` (0 if unknown)."""
    if base is None:
        return 0
    try:
        return max(0, profile.memory_info()["peak"] - base)
    except RuntimeError:
        return 0


# The allocator's line (TensorFlow's kernels), or XLA's ('... allocate 220.50MiB.').
_OOM_NAMED = re.compile(r"OOM when allocating tensor|Out of memory while trying to allocate")

def _message_lines(error):
    """``error``'s message, a stripped line each, blank lines left out."""
    return [line.strip() for line in (error.message or "").splitlines() if line.strip()]


def _line_with(error, text):
    """The first line of ``error``'s message that contains ``text`` (else its last)."""
    lines = _message_lines(error)
    return next((line for line in lines if text in line), lines[-1] if lines else "")


def _oom_line(error):
    """The line of an allocator's error that names the refused allocation (a
    graph's error starts with 'Graph execution error:' and ends with a hint
    that mentions OOM too)."""
    lines = _message_lines(error)
    named = [line for line in lines if _OOM_NAMED.search(line)]
    return (named or [line for line in lines if "OOM" in line and not line.startswith("Hint")]
            or lines[-1:] or [""])[0]


def budgeted(step):
    """``step`` (a ``tf.function``, or a Python function to trace) keeping the
    byte budgets of the memsave tapes and gradients inside it on the allocator.

    The next :data:`MEASURED_CALLS` calls after a trace are measured; if
    the largest peak is over a byte budget, less a margin for the calls'
    variation (or more than 10% below it), the step is traced again with a
    corrected target, once. A call the allocator refuses meanwhile is undone
    (the variables the traced step captures are restored) and run again
    with the same arguments on the plan the loop turns to, unless one of
    them is an iterator. See the module docstring. Returns a callable to
    use in place of ``step``.
    """
    if not callable(step):
        raise TypeError("memsave.budgeted needs a callable step, got %r" % (step,))
    if isinstance(step, MeasuredStep):
        return step
    if isinstance(step, tf.types.experimental.PolymorphicFunction):
        python_function, options = step.python_function, tf_internal.function_options(step)
    else:
        python_function, options = step, {}

    def build():
        return tf.function(python_function, **options)
    name = getattr(python_function, "__name__", "step")
    return MeasuredStep(build, "memsave.budgeted(%s)" % name)
