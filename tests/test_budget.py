"""A byte budget kept on the allocator (memsave.budget): measured, replanned once.

The chain's activations are 2048 x 64 float32 (0.5 MiB) over 24 layers, so
plans differ by whole MiB and the allocator's figures are repeatable
(conftest sets TF_CPU_ALLOCATOR_USE_BFC=true).
"""

import gc
import logging
import os
import pathlib
import re
import subprocess
import sys
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsave
import memsave.keras
from memsave import budget, profile, tf_internal
from memsave.profile import peak_memory

BATCH, WIDTH, DEPTH = 2048, 64, 24


def _chain(budget_bytes=None, rate=None):
    """(a tf.function over 24 tanh layers, its weights), the plain tape or memsave's
    with ``budget_bytes``: the step returns the gradients of the summed squares,
    or with ``rate`` trains the weights by SGD on their mean and returns it."""
    rng = np.random.RandomState(0)
    ws = [tf.Variable((rng.randn(WIDTH, WIDTH) / np.sqrt(WIDTH)).astype(np.float32))
          for _ in range(DEPTH)]
    x = tf.constant(rng.randn(BATCH, WIDTH).astype(np.float32))

    @tf.function
    def step():
        tape = (tf.GradientTape() if budget_bytes is None else
                memsave.GradientTape(checkpoints="optimal", budget=budget_bytes))
        with tape:
            h = x
            for w in ws:
                h = tf.tanh(h @ w)
            loss = tf.reduce_sum(h * h) if rate is None else tf.reduce_mean(h * h)
        grads = tape.gradient(loss, ws)
        if rate is None:
            return grads
        for w, g in zip(ws, grads):
            w.assign_sub(rate * g)
        return loss
    return step, ws


def _chain_step(budget_bytes=None):
    """The step of :func:`_chain`, returning gradients."""
    return _chain(budget_bytes)[0]


def _settled(step):
    """Call a budgeted step until its loop has measured (and replanned) for good:
    four plans at most, each traced once and measured, and the plan settled on
    after a replan measured again (twice at most)."""
    calls = 4 * (1 + budget.MEASURED_CALLS) + 2 * budget.MEASURED_CALLS
    for _ in range(calls):
        step()
        if step.loop.done:
            return step
    raise AssertionError("the budget loop did not settle in %d calls" % calls)


def _assert_same(plain, ours):
    plain, ours = [g.numpy() for g in plain], [g.numpy() for g in ours]
    scale = max(np.abs(g).max() for g in plain)
    assert max(np.abs(a - b).max() for a, b in zip(plain, ours)) <= 1e-5 * scale


@pytest.fixture(scope="module")
def plain_peak():
    return peak_memory(_chain_step())


def test_correction_takes_the_safer_reading_of_the_error():
    # Measured above the estimate, the budget above both (loosening): the ratio
    # grows the target less than the offset would.
    aim = budget.REPLAN_AIM
    assert budget._correction(100, 120)(200) == pytest.approx(aim * 200 * 100 / 120)
    # Tightening: the offset (e.g. weight gradients outside the plan) is safer.
    assert budget._correction(100, 130)(100) == pytest.approx(aim * 100 - 30)
    # An offset larger than the budget: only the ratio is left.
    assert budget._correction(10, 100)(50) == pytest.approx(aim * 50 * 10 / 100)
    # Its inverse reads an estimate as the larger of the two.
    loop = budget.Loop("test")
    assert loop.would_measure(50) == 50   # nothing measured yet
    loop.first = (100, 130)
    assert loop.would_measure(50) == pytest.approx(max(65, 80))
    assert loop.would_measure(50, kinder=True) == pytest.approx(min(65, 80))


def test_the_lowest_plan_is_taken_where_it_would_still_fit_the_budget():
    loop = budget.Loop("test")
    loop.trace.smallest, loop.trace.promise = 95, 100
    assert loop.takes_lowest()            # before a measurement: on the estimate
    loop.first = (100, 140)               # measured 40% (and 40 bytes) above its estimate
    assert not loop.takes_lowest()        # 95 would measure 133 at least, over 1.15 x 100
    loop.trace.promise = 116
    assert loop.takes_lowest() and loop.trace.lowest   # tried: the error need not carry over
    # The lowest plan was the one measured: its figure is known, not a reading.
    loop.first_trace, loop.trace.promise = budget._Trace(lowest=True), 105
    assert not loop.takes_lowest()
    loop.trace.promise = 133
    assert loop.takes_lowest()
    # A first plan far above its estimate (ConvNeXtTiny: 282.5 -> 484.6 MiB):
    # the offset reading says the lowest (200.3) would measure 402, the ratio
    # 344; under a 359 MiB budget it is tried, and its replan measured.
    loop.first, loop.trace.smallest, loop.trace.promise = (282.5, 484.6), 200.3, 359.1
    assert loop.takes_lowest()


def test_a_lowest_plan_a_little_over_the_budget_on_its_estimate_is_tried():
    """Estimates err both ways (GPT2's lowest plan at 128 tokens: estimated 43.0
    MiB, measured 39.6, under a budget of 41.0): before a measurement the
    lowest plan is tried up to LOWEST_TRIED times the budget, and kept if it
    measures within its margin."""
    loop = budget.Loop("test")
    loop.trace.smallest, loop.trace.promise = 43.0, 41.0
    assert loop.takes_lowest() and loop.trace.lowest
    loop.trace.estimates = [43.0]
    assert loop.observe(39.6) is None and loop.done
    loop = budget.Loop("test")
    loop.trace.smallest, loop.trace.promise = budget.LOWEST_TRIED * 41.0 + 1, 41.0
    assert not loop.takes_lowest()
    # Tried, and measured over its margin: no plan is lower, so the replan's
    # planner finds none and the loop says what the allocator would see.
    loop = budget.Loop("test")
    loop.trace.smallest, loop.trace.promise = 43.0, 41.0
    assert loop.takes_lowest()
    loop.trace.estimates = [43.0]
    assert loop.observe(42.0) == budget.REPLAN
    loop.trace.smallest, loop.trace.promise = 43.0, 41.0
    assert not loop.takes_lowest()
    assert "would measure at least about" in str(loop.budget_error(memsave.BudgetError("x")))


def test_a_lowest_plan_measured_over_the_budget_is_a_budget_error_on_every_call():
    calls = []
    step = budget.MeasuredStep(lambda: lambda: calls.append(tf.ones([256, 256]) * 2), "test")
    loop = step.loop
    # The first plan measured over the budget; the replan took the lowest plan.
    loop.first, loop.first_fits, loop.replanned = (80, 2 ** 40), 95, True
    loop.trace.promise, loop.trace.estimates, loop.trace.lowest = 100, [60], True
    # All but one measured call of the replan are in; the next one is observed.
    step._calls = budget.MEASURED_CALLS   # pylint: disable=protected-access
    step._peaks = [(0, None)] * (budget.MEASURED_CALLS - 1)   # pylint: disable=protected-access
    # The replan measures over 100 bytes (its 256 KiB are).
    with pytest.raises(memsave.BudgetError, match="the lowest plan measured"):
        step()
    with pytest.raises(memsave.BudgetError, match="the lowest plan measured"):
        step()
    assert len(calls) == 1


def test_budgeted_step_holds_the_budget_with_plain_gradients(plain_peak, caplog):
    target = int(0.6 * plain_peak)
    step = memsave.budgeted(_chain_step(target))
    with caplog.at_level(logging.INFO, logger="memsave"):
        _settled(step)
    measured = peak_memory(step)
    assert measured <= target, (measured, target, plain_peak)
    assert any("budget %.1f MiB" % (target / 2**20) in r.getMessage() for r in caplog.records)
    _assert_same(_chain_step()(), step())


def test_an_estimate_that_is_low_is_corrected_by_one_replan(plain_peak, monkeypatch, caplog):
    # The first plan aims past the budget, as a low estimate would: the
    # measured peak is over, and the one replan brings it under.
    monkeypatch.setattr(budget, "FIRST_AIM", 1.6)
    target = int(0.5 * plain_peak)
    step = memsave.budgeted(_chain_step(target))
    with caplog.at_level(logging.INFO, logger="memsave"):
        for _ in range(1 + budget.MEASURED_CALLS):   # traced, then measured
            step()
        assert step.loop.replanned and step.loop.first[1] > target
        _settled(step)
    assert peak_memory(step) <= target
    assert any("replanned to estimate" in r.getMessage() for r in caplog.records)


def _settled_past_the_budget(target, first_aim, monkeypatch, caplog):
    """A budgeted chain whose first plan aims at ``first_aim`` of ``target`` and
    whose replan aims at three times it (an estimate wrong for larger plans),
    called until its loop settles, logging at INFO into ``caplog``."""
    monkeypatch.setattr(budget, "FIRST_AIM", first_aim)
    monkeypatch.setattr(budget, "_correction", lambda *error: lambda p: 3 * p)
    monkeypatch.setattr(budget, "UPWARD_SLOPE", 1e-9)   # no bound on a replan above the first
    step = memsave.budgeted(_chain_step(target))
    with caplog.at_level(logging.INFO, logger="memsave"):
        _settled(step)
    return step


def test_a_looser_replan_that_overshoots_is_followed_by_one_between_it_and_the_first_plan(
        plain_peak, monkeypatch, caplog):
    # The first plan aims well below the budget, the replan past it, as an
    # estimate that is low for larger plans would: the two bracket the
    # budget, and a plan between them is measured, the first kept to go back
    # to where it measures over too (which of the two settles depends on the
    # allocator's figures: both are within the budget).
    target = int(0.6 * plain_peak)
    step = _settled_past_the_budget(target, 0.5, monkeypatch, caplog)
    assert step.loop.replanned and step.loop.between and step.loop.first[1] <= target
    assert any("replanning once more between them" in r.getMessage() for r in caplog.records)
    assert not step.loop.last_resort
    assert peak_memory(step) <= target
    _assert_same(_chain_step()(), step())


def _observed(loop, promise, estimate, measured, spread=0):
    """``loop.observe(measured)`` for a plan of ``estimate`` under ``promise``."""
    loop.trace.promise, loop.trace.estimates = promise, [estimate]
    return loop.observe(measured, spread=spread)


def test_a_plan_whose_calls_spread_widely_keeps_a_wider_margin(monkeypatch):
    # GPT2 at 4 x 128 tokens: a plan's first calls 86.6-89.0% of its budget,
    # its next forty up to 93.5%; a replan's calls 88.6-93.1%, later 99.7%.
    # A plan fits if its largest call leaves the calls' spread (times
    # SPREAD_MARGIN) below the budget, where that is more than the 5% margin.
    monkeypatch.setattr(budget, "SPREAD_MARGIN", 1.5)
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 93, spread=2) is None and loop.done
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 93, spread=6) == budget.REPLAN
    # The replan aims lower by as much as the margin widened (5 -> 9 bytes).
    assert loop.replan_aim == pytest.approx(budget.REPLAN_AIM - 0.04)
    assert loop.correction(100) <= loop.replan_aim * 100
    # A replan whose own calls spread widely is past its margin at 92: the
    # first plan was past its own, so a second replan follows, for the safer
    # of both plans' errors (the replan's offset, 17), aiming lower by as
    # much as the wider margin asks (95 -> 91: 93.5% -> 89.5%).
    assert _observed(loop, 100, 75, 92, spread=6) == budget.REPLAN
    assert loop.replanned_again and not loop.last_resort
    assert loop.correction(100) == pytest.approx(89.5 - 17)
    # Past its margin too: the lowest plan, with no third correction.
    assert _observed(loop, 100, 70, 92, spread=6) == budget.REPLAN and loop.last_resort
    assert loop.replans == 3
    # A first plan within its margin is taken back from such a replan (one
    # estimated as the first: the two give no slope to plan between them on).
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 86, spread=2) == budget.REPLAN
    assert _observed(loop, 100, 80, 92, spread=6) == budget.FIRST and _confirmed(loop, 86)


def test_an_upward_replan_over_the_budget_and_its_first_plan_bracket_a_second_replan(caplog):
    # GPT2 at 1,024 tokens under 596.0 MiB, scaled to 100: a first plan
    # estimated 81.1 measured 77.9 (below the band), its upward replan
    # estimated 92.5 measured 100.05. Each estimated byte between them
    # measured 1.94: the step is planned once more between them, on that
    # slope, for 93.5%, the first plan kept to go back to.
    loop = budget.Loop("test")
    assert _observed(loop, 100, 81.1, 77.9) == budget.REPLAN
    with caplog.at_level(logging.INFO, logger="memsave"):
        assert _observed(loop, 100, 92.5, 100.05) == budget.REPLAN
    assert loop.between and loop.replanned_again and not loop.keeps_no_other_plan
    slope = (100.05 - 77.9) / (92.5 - 81.1)
    between = 81.1 + (93.5 - 77.9) / slope
    assert loop.planning(_settings(100)).budget == pytest.approx(between)
    assert loop.first_to_go_back_to and loop.replans == 2
    assert any("replanning once more between them" in r.getMessage() for r in caplog.records)
    # Within the band it is measured again once the first plan is let go.
    assert _observed(loop, 100, 88.0, 92.0) is None and _confirmed(loop, 92.5)
    assert loop.settled_target == pytest.approx(between)
    # Past its margin too: back to the first plan, with no third replan.
    loop = budget.Loop("test")
    assert _observed(loop, 100, 81.1, 77.9) == budget.REPLAN
    assert _observed(loop, 100, 92.5, 100.05) == budget.REPLAN
    assert _observed(loop, 100, 88.0, 97.0) == budget.FIRST and _confirmed(loop, 77.9)
    assert loop.replans == 2 and not loop.last_resort


def test_a_replan_that_lands_below_the_band_is_followed_by_one_from_the_closer_plan(caplog):
    # GPT2 at 4 x 128 tokens under 70% of plain's peak, scaled to 100: a
    # first plan estimated 72 measured 72%; its replan, for 93.5% by that
    # plan's error, estimated 92 measured 88% (a plan's error off another's
    # is a few percent either way, as wide as the band). Both below the band:
    # the step is planned once more from the closer (the replan, now the plan
    # to go back to), on the bytes measured per estimated byte between them.
    loop = budget.Loop("test")
    assert _observed(loop, 100, 72, 72) == budget.REPLAN
    with caplog.at_level(logging.INFO, logger="memsave"):
        assert _observed(loop, 100, 92, 88) == budget.REPLAN
    assert loop.replanned_again and loop.between and loop.swap_first
    assert loop.first == (92, 88) and loop.first_to_go_back_to
    # On their slope (0.8) it would aim at 98.9; the target is bounded so that
    # at CLOSER_SLOPE (2.5) measured bytes per estimated byte its calls stay
    # within the 95% margin.
    closer = min(92 + (93.5 - 88) / ((88 - 72) / (92 - 72)), 92 + (95 - 88) / budget.CLOSER_SLOPE)
    assert closer < 98 and loop.planning(_settings(100)).budget == pytest.approx(closer)
    assert any("replanning once more from the replanned plan" in r.getMessage()
               for r in caplog.records)
    # Within the band: kept, measured again once the other plan is let go.
    assert _observed(loop, 100, 99, 93) is None and _confirmed(loop, 93)
    assert loop.settled_target == pytest.approx(closer) and loop.replans == 2
    # Past its margin: back to the closer plan, with no third replan; the
    # log names it the replan it is, not the first plan.
    loop = budget.Loop("test")
    assert _observed(loop, 100, 72, 72) == budget.REPLAN
    assert _observed(loop, 100, 92, 88) == budget.REPLAN
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memsave"):
        assert _observed(loop, 100, 99, 97) == budget.FIRST and _confirmed(loop, 88)
    assert loop.replans == 2 and not loop.last_resort
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "back to the replan" in said and "first plan" not in said
    # A replan that measured less than its first plan: once more from the
    # first plan, at no less than 1 / UPWARD_SLOPE measured bytes per byte.
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 84) == budget.REPLAN
    assert _observed(loop, 100, 86, 82) == budget.REPLAN and loop.first == (80, 84)
    assert loop.planning(_settings(100)).budget == pytest.approx(
        min(80 + (93.5 - 84) * budget.UPWARD_SLOPE, 80 + (100 - 84) / budget.UPWARD_SLOPE,
            80 + (95 - 84) / budget.CLOSER_SLOPE))
    # Within the band (or over it), no second replan; nor where a plan's
    # calls spread wider than the 5% the band leaves (BERT with SGD updates:
    # one plan's three calls at 79-87% of a budget).
    loop = budget.Loop("test")
    assert _observed(loop, 100, 72, 72) == budget.REPLAN
    assert _observed(loop, 100, 92, 91) is None and _confirmed(loop, 91)
    assert loop.replans == 1
    loop = budget.Loop("test")
    assert _observed(loop, 100, 72, 72, spread=8) == budget.REPLAN
    assert _observed(loop, 100, 92, 85) is None and _confirmed(loop, 85)
    assert loop.replans == 1


def test_no_second_replan_is_traced_where_it_would_plan_the_first_plan_again(caplog):
    # Plans come in steps: between GPT2's at 1,024 tokens (estimated 483.5
    # and 551.5 MiB) none was, and the second replan between them traced and
    # measured the first plan again. Here a 24-layer chain's plans step by
    # 1 MiB (12, 13, 14 ...): a first plan estimated 12 MiB measures 70% of a
    # 20 MiB budget, its replan (13) 99.5%; between them lies 12.8 MiB, which
    # the replan's planning graph, planned again, answers with the first
    # plan: back to it, one replan in all.
    from tests.builders import plan_chain  # pylint: disable=import-outside-toplevel
    from memsave.planning import registry  # pylint: disable=import-outside-toplevel
    mib, graph = 2 ** 20, plan_chain(24)
    plans = [registry.run(_settings(1).checkpoints.strategy, graph, budget=b * mib)
             for b in (12.5, 13.5, 14.5)]
    assert [p.estimated_peak_bytes / mib for p in plans] == [12, 13, 14]

    def traced(loop, plan, measured):
        loop.planning(_settings(20 * mib), graph)
        loop.record(plan)
        return loop.observe(measured * mib)

    loop = budget.Loop("test")
    assert traced(loop, plans[0], 14.0) == budget.REPLAN
    with caplog.at_level(logging.INFO, logger="memsave"):
        assert traced(loop, plans[1], 19.9) == budget.FIRST
    assert loop.replans == 1 and not loop.between
    assert any("between the first plan and the replan, is the first plan" in r.getMessage()
               for r in caplog.records)
    assert _confirmed(loop, 14.0 * mib) and loop.first_trace.kept == [plans[0].kept]
    # Measured at 60%, and its replan estimated 14 MiB, the first plan leaves
    # 13.7 MiB between them, which plans the 13 MiB plan: that second replan
    # is traced.
    loop = budget.Loop("test")
    assert traced(loop, plans[0], 12.0) == budget.REPLAN
    assert traced(loop, plans[2], 19.9) == budget.REPLAN and loop.between
    assert loop.replans == 2


def test_a_replan_over_the_budget_is_planned_again_on_both_plans_errors():
    # MobileNetV2 under 245.8 MiB, scaled to 100: a first plan estimated 86
    # measured 95.6 (over AIM); its replan, estimated 82.3, measured 91.8 to
    # 99.7 (past its margin). The lowest plan would settle at 46%: a second
    # replan plans for the safer of both errors (the replan's offset, 17.4),
    # aiming lower by its wider spread (95 -> 92.1: 93.5% -> 90.6%).
    loop = budget.Loop("test")
    assert _observed(loop, 100, 86, 95.6, spread=2) == budget.REPLAN
    assert _observed(loop, 100, 82.3, 99.7, spread=7.9) == budget.REPLAN
    assert loop.replanned_again and not loop.last_resort and not loop.first_to_go_back_to
    assert loop.correction(100) == pytest.approx(90.6 - 17.4)
    # Measured alone (the earlier plans were let go), it settles at once.
    assert _observed(loop, 100, 73, 90) is None and loop.done and loop.confirming is None
    assert loop.replans == 2


def test_a_replan_that_measures_less_than_a_first_plan_within_the_budget_gives_way_to_it():
    # GPT2's upward replan measured 79% of its budget, its first plan 88%:
    # both fit, and the one closer to the budget is kept (it recomputes less).
    # Both below the band: one more replan from the first plan, and a plan
    # measured less than it gives way to it too.
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 88) == budget.REPLAN
    assert _observed(loop, 100, 90, 79) == budget.REPLAN and loop.first == (80, 88)
    assert _observed(loop, 100, 85, 84) == budget.FIRST and _confirmed(loop, 88)
    # A replan that measures more, within the band, is kept.
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 85) == budget.REPLAN
    assert _observed(loop, 100, 90, 92) is None and _confirmed(loop, 92)
    # A first plan over the budget is never taken back, however low the replan.
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 104) == budget.REPLAN
    assert _observed(loop, 100, 60, 70) is None and _confirmed(loop, 70)


def _confirmed(loop, measured, spread=0):
    """Whether ``loop``, settling after a replan, waited for its plan to be
    measured again and, measured at ``measured``, is done."""
    return (not loop.done and loop.confirming is not None
            and loop.observe(measured, spread=spread) is None and loop.done)


def test_the_plan_settled_on_is_measured_again_once_the_other_is_let_go(caplog):
    # The replan's calls ran while the first plan's function was alive;
    # letting it go changes the allocator's free chunks (a chain's replan
    # measured 5.5 MiB, and 6.4 MiB after, under a budget of 6.3). Measured
    # again: within the meter's margin it is kept, as the lowest plan is.
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 104) == budget.REPLAN
    assert _observed(loop, 100, 70, 90) is None and _confirmed(loop, 98.5)
    # Past it, a second replan below both plans follows (a WARNING says so),
    # built once the others are let go and measured once more: kept without
    # another check. (MobileNetV2 under 259.2 MiB: a replan at 94.9%, then
    # 96.8%; the lowest plan, which followed it then, settled at 48%.)
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 104) == budget.REPLAN
    assert _observed(loop, 100, 70, 90) is None
    with caplog.at_level(logging.WARNING, logger="memsave"):
        assert loop.observe(99.5) == budget.REPLAN and not loop.done
    assert loop.replanned_again and not loop.between and not loop.last_resort
    assert any("once it was let go" in r.getMessage()
               and "replanning once more" in r.getMessage() for r in caplog.records)
    assert _observed(loop, 100, 60, 85) is None and loop.done and loop.confirming is None
    # Past its margin too, the lowest plan.
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 104) == budget.REPLAN
    assert _observed(loop, 100, 70, 90) is None
    assert loop.observe(99.5) == budget.REPLAN
    assert _observed(loop, 100, 60, 97) == budget.REPLAN and loop.last_resort
    assert _observed(loop, 100, 50, 80) is None and loop.done and loop.confirming is None
    # The first plan fitted and measured more than the replan, but its
    # function is gone: the second replan is kept (found by CI, with the
    # lowest plan: the step was handed a None function).
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 88) == budget.REPLAN
    assert _observed(loop, 100, 90, 92) is None
    assert loop.observe(99.5) == budget.REPLAN and not loop.first_to_go_back_to
    assert _observed(loop, 100, 60, 70) is None and loop.done
    # A first plan taken back and then measured past the margin: the same,
    # its own two measurements read as the two plans' errors. (The replan is
    # estimated as the first: both below the band, they tell no slope to
    # plan once more from.)
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 88) == budget.REPLAN
    assert _observed(loop, 100, 80, 79) == budget.FIRST
    assert loop.observe(99.5) == budget.REPLAN and loop.replanned_again
    assert loop.correction(100) == pytest.approx(93.5 - 19.5)
    assert _observed(loop, 100, 60, 70) is None and loop.done


def test_a_retrace_of_the_settled_step_aims_as_the_settled_plan_did():
    # A new batch shape (the last partial batch, another dataset) traces the
    # step again after the loop settled: planned for the budget itself, it
    # measured 8.6% over it (found by a helper); it aims as the plan kept.
    loop = budget.Loop("test")
    first = loop.planning(_settings(100)).budget
    assert first == pytest.approx(budget.FIRST_AIM * 100)
    assert _observed(loop, 100, 80, 93) is None and loop.done
    assert loop.planning(_settings(100)).budget == pytest.approx(first)
    # Settled on a replan, measured again: its own target.
    loop = budget.Loop("test")
    loop.planning(_settings(100))
    assert _observed(loop, 100, 80, 104) == budget.REPLAN
    replan = loop.planning(_settings(100)).budget
    assert replan < first
    assert _observed(loop, 100, 70, 90) is None and _confirmed(loop, 91)
    assert loop.planning(_settings(100)).budget == pytest.approx(replan)


def test_a_settled_plan_whose_calls_creep_past_its_margin_is_replanned_from_them(caplog):
    # A helper's MobileNetV3Small under 80 MiB settled on calls of 72.5, 71.7
    # and 74.4 MiB; later calls measured 78.9, then 80.7, over the budget.
    loop = budget.Loop("test")
    settled = loop.planning(_settings(100)).budget
    assert _observed(loop, 100, 80, 93) is None and loop.done
    assert not loop.drifted(95)   # within the margin it was kept under
    with caplog.at_level(logging.WARNING, logger="memsave"):
        assert loop.drifted(98.6)
    assert any("replanning from it" in r.getMessage() for r in caplog.records)
    assert not loop.done and loop.replanned and not loop.first_to_go_back_to
    assert loop.first == (80, 98.6) and loop.peaks[-1] == 98.6
    replan = loop.planning(_settings(100)).budget
    assert replan < settled
    # Measured as any replan (kept, then measured again as the calls that follow).
    assert _observed(loop, 100, replan, 88) is None and _confirmed(loop, 89) and loop.done
    assert loop.planning(_settings(100)).budget == pytest.approx(replan)
    # At most DRIFT_REPLANS times; the lowest plan is kept (no plan is lower).
    loop.drift_replans = budget.DRIFT_REPLANS
    assert not loop.drifted(99) and loop.done
    loop = budget.Loop("test")
    loop.planning(_settings(100))
    loop.trace.lowest = True
    assert _observed(loop, 100, 80, 95) is None and loop.done
    assert not loop.drifted(99.5) and loop.done


def test_a_budgeted_step_replans_where_its_settled_calls_creep(plain_peak, monkeypatch):
    # The meter reads 91% of the budget for every call (the first plan is
    # kept), then the budget itself for one call of the settled plan: the
    # step is replanned below it, and trains with plain's gradients.
    target = int(0.9 * plain_peak)
    creep = []
    measured = budget.profile.measured_call

    def metered(call, *args, **kwargs):
        out, _ = measured(call, *args, **kwargs)
        return out, (target if creep and not creep[0] else 0.91 * target)
    monkeypatch.setattr(budget.profile, "measured_call", metered)
    step = _settled(memsave.budgeted(_chain_step(target)))
    assert step.loop.replans == 0 and not step.loop.settled_trace.lowest
    settled = step.loop.settled_target
    creep.append(0)
    step()
    assert step.loop.drift_replans == 1 and not step.loop.done
    creep[0] = 1
    _settled(step)
    assert step.loop.settled_target < settled
    _assert_same(_chain_step()(), step())


def test_a_budgeted_step_lets_the_other_plan_go_before_it_is_measured_again():
    made = []

    def build():
        def step():
            return tf.ones([64, 64])
        made.append(weakref.ref(step))
        return step
    step = budget.MeasuredStep(build, "test")
    loop = step.loop
    # The first plan measured over the budget, and the replan is on trial.
    loop.first, loop.first_fits, loop.replanned = (80, 2 ** 40), 2 ** 30, True
    step._first, step._step = step._step, build()   # pylint: disable=protected-access
    loop.trace.promise, loop.trace.estimates = 2 ** 30, [2 ** 29]
    step._calls = budget.MEASURED_CALLS   # pylint: disable=protected-access
    step._peaks = [(0, None)] * (budget.MEASURED_CALLS - 1)   # pylint: disable=protected-access
    step()   # the replan's last measured call: kept, measured again
    assert loop.confirming is not None and not loop.done
    assert made[0]() is None and made[1]() is not None   # the first plan's function is gone
    for _ in range(budget.MEASURED_CALLS):
        step()
    assert loop.done and loop.confirming is None


def test_a_replan_over_the_budget_is_followed_by_the_lowest_plan(plain_peak, monkeypatch,
                                                                 caplog):
    # The first plan overshoots and the replans' correction is wrong the other
    # way (as ConvNeXtTiny's estimates were): the three measure over the
    # budget, and the lowest plan, measured once more, holds it. (The lowest plan
    # measures 43-48% of plain's peak, as BFC's free chunks fall: a budget of
    # half of plain's peak left it within a call's variation of the margin.)
    target = int(0.6 * plain_peak)
    step = _settled_past_the_budget(target, 1.6, monkeypatch, caplog)
    assert step.loop.replanned_again and step.loop.last_resort and step.loop.replans == 3
    assert [r.levelno == logging.WARNING for r in caplog.records
            if "replanning once more" in r.getMessage()
            or "planning for the lowest peak" in r.getMessage()] == [True, True]
    assert peak_memory(step) <= target
    _assert_same(_chain_step()(), step())


def test_the_last_resort_is_taken_once():
    # A plan for the lowest peak that the planner did not mark as the lowest
    # (no BudgetError on the way) and that measures over: an error, not a
    # fourth replan.
    loop = budget.Loop("test")
    loop.first, loop.first_fits, loop.replanned = (80, 150), 95, True
    loop.replanned_again = loop.last_resort = True
    loop.trace.promise, loop.trace.estimates = 100, [60]
    with pytest.raises(memsave.BudgetError, match="the last plan measured"):
        loop.observe(120)
    assert loop.replans == 3


def test_a_replan_within_the_budget_but_past_the_margin_is_not_kept(caplog):
    # A step's peak varies by a few percent between calls: a second replan
    # measured at 98% of the budget is followed by the lowest plan. A plan not
    # known to be the lowest measured there is a BudgetError, not a promise a
    # later call breaks.
    def replanned_to(lowest):
        loop = budget.Loop("test")
        loop.first, loop.first_fits, loop.replanned = (80, 97), 95, True
        loop.replanned_again = True
        loop.trace.promise, loop.trace.estimates = 100, [70]
        assert loop.observe(98) == budget.REPLAN and loop.last_resort
        loop.trace.promise, loop.trace.estimates, loop.trace.lowest = 100, [60], lowest
        return loop
    with pytest.raises(memsave.BudgetError, match="more than 95% of the budget"):
        replanned_to(lowest=False).observe(98)
    # The lowest plan has no plan below it to turn to: it keeps a margin of
    # 1%, and its calls' spread (the meter's and the updates' variation).
    with pytest.raises(memsave.BudgetError, match="more than 97% of the budget"):
        replanned_to(lowest=True).observe(98, spread=3)
    with caplog.at_level(logging.WARNING, logger="memsave"):
        loop = replanned_to(lowest=True)
        assert loop.observe(98) is None and loop.done
    assert any("the lowest plan measured 0.0 MiB, 98.0% of the budget" in r.getMessage()
               for r in caplog.records)
    # Within the margin, the replan is kept.
    loop = budget.Loop("test")
    loop.first, loop.first_fits, loop.replanned = (80, 97), 95, True
    loop.trace.promise, loop.trace.estimates = 100, [70]
    assert loop.observe(94) is None and _confirmed(loop, 94) and not loop.last_resort


def test_no_plan_fits_is_a_budget_error_before_the_step():
    step = memsave.budgeted(_chain_step(2 ** 20))
    with pytest.raises(memsave.BudgetError, match=r"budget of 1\.0 MiB: the smallest plan"):
        step()


def test_a_budget_error_says_where_max_recompute_binds():
    # A helper's transformer under 45 MiB with max_recompute=0.05: the
    # BudgetError did not say the cap was why (39 MiB fits without it).
    rng = np.random.RandomState(0)
    ws = [tf.Variable(rng.randn(WIDTH, WIDTH).astype(np.float32)) for _ in range(DEPTH)]
    x = tf.constant(rng.randn(BATCH, WIDTH).astype(np.float32))

    @tf.function
    def step():
        with memsave.GradientTape(checkpoints="optimal", budget=2 ** 20,
                                  max_recompute=0.02) as tape:
            h = x
            for w in ws:
                h = tf.tanh(h @ w)
            loss = tf.reduce_sum(h * h)
        return tape.gradient(loss, ws)
    with pytest.raises(memsave.BudgetError, match=r"budget of 1\.0 MiB recomputing at most "
                                                  r"2% of a training step: the smallest plan"):
        memsave.budgeted(step)()


def test_a_small_budget_that_no_plan_fits_is_said_in_kib():
    """A budget under a MiB read "a budget of 0.0 MiB: ... estimated at 0.0 MiB"
    (found by a helper trying memsave's API)."""
    step = memsave.budgeted(_chain_step(2 ** 10))
    with pytest.raises(memsave.BudgetError,
                       match=r"budget of 1\.0 KiB: the smallest plan is estimated at [0-9.]+ (KiB|MiB)"):
        step()
    assert memsave.log.size_text(3) == "3 bytes" and memsave.log.size_text(2 ** 21) == "2.0 MiB"


def test_a_budget_on_nominal_sizes_says_to_pass_the_batch_size():
    """A batch unknown where the step is built (a placeholder, a tf.data batch
    without drop_remainder) is planned on nominal sizes, whose bytes need not
    be the step's: a budget no plan fits says how to give the real sizes."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, WIDTH])
        rng = np.random.RandomState(0)
        ws = [tf.Variable((rng.randn(WIDTH, WIDTH) / np.sqrt(WIDTH)).astype(np.float32))
              for _ in range(8)]
        h = x
        for w in ws:
            h = tf.tanh(h @ w)
        with pytest.raises(memsave.BudgetError, match="nominal.*batch_size="):
            memsave.gradients(tf.reduce_sum(h * h), ws, checkpoints="optimal", budget=2 ** 10)


def test_budgeted_refuses_what_is_not_a_step():
    with pytest.raises(TypeError, match="callable"):
        memsave.budgeted("step")


def _dense_model(optimizer="sgd", built=True):
    """Twelve Dense(64, tanh) layers; ``built=False``: without an Input, its
    variables made by its first call."""
    keras.utils.set_random_seed(0)
    inputs = [keras.Input((64,))] if built else []
    model = keras.Sequential(inputs + [
        keras.layers.Dense(64, activation="tanh") for _ in range(12)] + [keras.layers.Dense(4)])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), jit_compile=False)
    return model


def _fit(model, batch_size=1024, epochs=16):
    """The last loss of fitting ``model``: at batch 1024, a call per epoch, as many
    as a budget loop settling through the lowest plan takes (a first plan's
    four, a replan's four, the three that measure it again, the lowest
    plan's four)."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(1024, 64).astype("float32"), rng.randint(0, 4, 1024)
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
                     shuffle=False).history["loss"][-1]


def test_keras_keeps_a_byte_budget_automatically(caplog):
    model = memsave.keras.enable(_dense_model(), budget="3MiB")
    with caplog.at_level(logging.INFO, logger="memsave"):
        # Sixteen calls, and sixteen more where the loop took its longest
        # path (a replan measured past its margin once the first plan was let
        # go: a second replan, measured again, then the lowest plan), which
        # the allocator's free chunks decide (2 of 4 runs of some -n 2 orders).
        epochs = 16
        loss = _fit(model, epochs=epochs)
        if model.train_function.loop.settled_trace is None:
            epochs += 16
            loss = _fit(model, epochs=16)
    plain = _fit(_dense_model(), epochs=epochs)
    # Settled (a later call past its margin may have it replanned since).
    assert isinstance(model.train_function, budget.MeasuredStep)
    assert model.train_function.loop.settled_trace is not None
    said = [r.getMessage() for r in caplog.records if "memsave.keras(" in r.getMessage()]
    # (The longest path ends on the lowest plan's "... of the budget of 3.0 MiB".)
    assert said and re.search(r"budget (of )?3\.0 MiB", said[-1]), said[-1]
    assert loss == pytest.approx(plain, rel=1e-5)


class _InUse(keras.callbacks.Callback):
    """The CPU allocator's bytes in use before each batch fit trains on."""

    def __init__(self):
        super().__init__()
        self.before, self.settled = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.before.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
        self.settled.append(getattr(self.model.train_function.loop, "done", False))

    def growth(self):
        """Bytes in use once the budget loop settled, above the first batch's
        (a measured call's batch, given again in a dataset, is a reference
        cycle until the loop settles and collects it)."""
        return max(b for b, done in zip(self.before, self.settled) if done) - self.before[0]

    def mib(self):
        return [round(b / 2 ** 20, 1) for b in self.before]


@pytest.mark.parametrize("confirmed", [True, False])
def test_keras_lets_go_of_the_batches_its_budget_loop_measured(confirmed, monkeypatch):
    # Each call the loop measures is given its batch again from a dataset of
    # its own (to run it again if the allocator refuses it); one made by
    # Dataset.from_generator kept its batch for the life of the process (a
    # helper found 11 batches of 16 MiB held after fit settled). A traced
    # call's dataset is a reference cycle: where the first plan's call
    # measured again once the replan was let go is 8 MiB over, the loop
    # replans again and settles on that plan holding its batch until Python
    # collected it.
    if not confirmed:
        measured_call, calls = profile.measured_call, []

        def over_once(*args, **kwargs):
            out, peak = measured_call(*args, **kwargs)
            calls.append(peak)
            return out, peak + (8 * 2 ** 20 if len(calls) == 9 else 0)
        monkeypatch.setattr(profile, "measured_call", over_once)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,))] + [
        keras.layers.Dense(64, activation="tanh") for _ in range(6)] + [keras.layers.Dense(4)])
    model.compile(optimizer="sgd", jit_compile=False, loss=(
        keras.losses.SparseCategoricalCrossentropy(from_logits=True)))
    memsave.keras.enable(model, budget="9MiB")
    in_use = _InUse()
    batches = _owned_batches(1024, 1024)   # 4 MiB a batch
    # Python's collector off: the batches the loop gave again are let go
    # when it settles, not when the collector happens to run.
    gc.disable()
    try:
        model.fit(batches, epochs=20, verbose=0, shuffle=False, callbacks=[in_use])
    finally:
        gc.enable()
    loop = model.train_function.loop
    assert loop.settled_trace is not None and len(loop.peaks) >= 4
    assert confirmed or loop.replanned_again
    assert in_use.growth() < 2 * 2 ** 20, in_use.mib()


def _owned_batches(rows, columns):
    """A dataset of one batch of ``rows`` x ``columns`` float32 features and
    labels made in TensorFlow's allocator, read as it is: a NumPy array is
    copied in or not as its address is aligned, and ``fit`` prefetches its
    batches (a thread that allocates when it runs), which moved the bytes
    in use between calls by a batch or two as other tests had run before."""
    features = tf.random.stateless_normal([rows, columns], seed=[0, 0])
    labels = tf.random.stateless_uniform([rows], seed=[0, 1], maxval=4, dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(rows)


def test_keras_lets_go_of_sparse_batches_its_budget_loop_measured():
    # As the dense batches above: a sparse batch went through
    # Dataset.from_generator, which kept every one (a helper found it).
    keras.utils.set_random_seed(0)
    inputs = keras.Input((1024,), sparse=True)
    h = inputs
    for _ in range(4):
        h = keras.layers.Dense(64, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(4)(h))
    model.compile(optimizer="sgd", jit_compile=False, loss=(
        keras.losses.SparseCategoricalCrossentropy(from_logits=True)))
    memsave.keras.enable(model, budget="80MiB")
    in_use = _InUse()
    rng = np.random.RandomState(0)
    x = rng.randn(1024, 1024).astype("float32") * (rng.rand(1024, 1024) < 0.1)
    batches = tf.data.Dataset.from_tensor_slices(   # the batch axis unknown in its spec
        (tf.sparse.from_dense(x), rng.randint(0, 4, 1024))).batch(1024)
    model.fit(batches, epochs=14, verbose=0, shuffle=False, callbacks=[in_use])  # 2 MiB a batch
    loop = model.train_function.loop
    assert loop.settled_trace is not None and len(loop.peaks) >= budget.MEASURED_CALLS
    assert in_use.growth() < 2 ** 20, in_use.mib()


@pytest.mark.parametrize("kind", ["ragged", "sparse", "mixed"])
def test_a_composite_batch_is_given_again_with_its_iterators_spec_and_no_python_function(kind):
    # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import script_ops   # where from_generator's functions stay
    ragged = tf.data.Dataset.from_tensor_slices(
        tf.ragged.constant([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0], [7.0]])).batch(2)
    sparse = tf.data.Dataset.from_tensor_slices(tf.sparse.from_dense(
        tf.constant([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0], [4.0, 0.0, 0.0]]))).batch(2)
    dense = tf.data.Dataset.from_tensor_slices((tf.ones([5, 3]), tf.range(5))).batch(2)
    batches = {"ragged": ragged, "sparse": sparse,
               "mixed": tf.data.Dataset.zip((ragged, (dense, sparse)))}[kind]
    data = next(iter(batches))
    registered = script_ops._py_funcs.size()   # pylint: disable=protected-access
    again = memsave.keras._dataset_of(data, batches.element_spec)  # pylint: disable=W0212
    assert script_ops._py_funcs.size() == registered   # pylint: disable=protected-access
    assert again.element_spec == batches.element_spec
    for got, want in zip(tf.nest.flatten(next(iter(again)), expand_composites=True),
                         tf.nest.flatten(data, expand_composites=True)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_keras_train_on_batch_keeps_a_byte_budget():
    # train_on_batch gives Keras' train function a Python iterator, which it
    # runs through its step on data, not the tf.function fit's iterators go
    # through: tracing that one with it raised AttributeError (found by a
    # helper).
    # Tensors made in TensorFlow's allocator: a NumPy batch is copied in
    # within the measured call or not as its address is aligned, so calls
    # measured apart by a batch (a settled call past its margin, a replan,
    # more calls to settle than the 16 planned for).
    batches = [(tf.random.stateless_normal([1024, 64], seed=[i, 0]),
                tf.random.stateless_uniform([1024], seed=[i, 1], maxval=4, dtype=tf.int32))
               for i in range(32)]
    plain, model = _dense_model(), memsave.keras.enable(_dense_model(), budget="3MiB")
    losses = [float(model.train_on_batch(x, y)) for x, y in batches[:16]]
    while not model.train_function.loop.done and len(losses) < len(batches):
        losses.append(float(model.train_on_batch(*batches[len(losses)])))  # after a replan
    assert model.train_function.loop.done
    assert losses == pytest.approx([float(plain.train_on_batch(x, y))
                                    for x, y in batches[:len(losses)]], rel=1e-5)


def test_keras_undoes_a_refused_call_and_trains_on_its_batch_again(monkeypatch):
    # The first plan's first call runs (it reads its batch and Adam updates
    # every variable) and then the allocator refuses it, as a full device
    # would part way: the call is undone and the same batch trained on by
    # the replan. fit then ends where plain's ends, no batch skipped or
    # taken twice.
    plain = _dense_model("adam")
    _fit(plain, batch_size=256)
    calls = []
    measured_step = budget.MeasuredStep.__init__

    def refusing_first_plan(self, build, where, **kwargs):
        def build_refusing():
            step = build()
            if calls:
                return step

            def refused(*args):
                out = step(*args)
                calls.append(out)
                raise tf.errors.ResourceExhaustedError(
                    None, None, "OOM when allocating tensor with shape[256,64] and type float")
            return refused
        measured_step(self, build_refusing, where, **kwargs)
    monkeypatch.setattr(budget.MeasuredStep, "__init__", refusing_first_plan)
    model = memsave.keras.enable(_dense_model("adam"), budget="3MiB")
    _fit(model, batch_size=256)
    assert len(calls) == 1 and model.train_function.loop.refusals == 1
    assert model.train_function.loop.replans >= 1 and model.train_function.loop.done
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 64
    for ours, theirs in zip(model.variables, plain.variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-4, atol=1e-6)


def _wide_model(steps_per_execution=1):
    """Twelve Dense(256) layers and Adam: about 12 MiB of plain step at batch 1024."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,))] + [
        keras.layers.Dense(256, activation="relu") for _ in range(12)] + [keras.layers.Dense(10)])
    model.compile(optimizer="adam", jit_compile=False, steps_per_execution=steps_per_execution,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _learnable(rows=4096):
    rng = np.random.RandomState(1)
    x = rng.randn(rows, 256).astype("float32")
    return x, np.argmax(x @ np.random.RandomState(99).randn(256, 10), 1)


def _assert_trained_alike(model, plain):
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations)
    for ours, theirs in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("steps_per_execution, pipeline",
                         [(1, "batched"), (2, "batched"), (1, "mapped")])
def test_keras_sizes_an_unknown_batch_from_the_batch_fit_reads(caplog, steps_per_execution,
                                                               pipeline):
    # A dataset of unknown batch size was read once before fit to size the
    # plan: a shuffle that reshuffles each iteration then gave fit another
    # order (weights 1.9 apart, relative), and a stream lost its first batch;
    # a later fit read it again (a helper found both). The plan is sized
    # from the size the pipeline was batched with, read without iterating
    # it, or where a step follows that may change it (a map), from the first
    # batch the loop reads ahead of its call, as fit reads it.
    x, y = _learnable()
    plain, model = (_wide_model(steps_per_execution),
                    memsave.keras.enable(_wide_model(steps_per_execution), budget="40MiB"))
    with caplog.at_level(logging.INFO, logger="memsave"):
        for fitted in (plain, model):
            data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096, seed=3).batch(1024)
            if pipeline == "mapped":
                data = data.map(lambda a, b: (a * 1.0, b))
            assert data.element_spec[0].shape[0] is None
            for _ in range(2):   # a second fit: the loop settled in the first
                fitted.fit(data, epochs=8, verbose=0)
    assert model.train_function.loop.done
    said = "it was batched by 1024" if pipeline == "batched" else "its first batch has 1024"
    assert any(said in r.getMessage() for r in caplog.records)
    _assert_trained_alike(model, plain)


def test_keras_trains_a_generator_under_a_byte_budget_for_its_real_batch():
    # A generator's batch size is unknown before fit reads it: the plan was
    # made for a nominal batch, its estimate a fifth of what ran, and fit
    # raised BudgetError where a budget held on arrays (a helper found it).
    x, y = _learnable()

    def batches():
        while True:
            for i in range(0, 4096, 1024):
                yield x[i:i + 1024], y[i:i + 1024]
    plain, model = _wide_model(), memsave.keras.enable(_wide_model(), budget="10MiB")
    for fitted in (plain, model):
        fitted.fit(batches(), steps_per_epoch=4, epochs=4, verbose=0)
    assert model.train_function.loop.done
    _assert_trained_alike(model, plain)


@pytest.mark.parametrize("second", ["arrays", "dataset"])
def test_keras_starts_a_budget_loop_for_a_fit_at_another_batch_size(second):
    # fit at 256, then at 1024: Keras kept the step traced for an unknown
    # batch, so the plan for 256 ran at 1024, and the loop read the factor
    # of five between its estimate and the measurement as its error: a
    # BudgetError where a fresh loop at 1024 trains (a helper found it with
    # arrays; with a dataset batched by 1024, whose batch dimension is
    # unknown, the new size was only read inside the call, too late).
    # The second fit is one epoch of 32 steps: on this meter one call per
    # epoch, where a new epoch's input pipeline fills on the same allocator,
    # measured 3-4 MiB over the others, and eight epochs under a 12 MiB
    # budget had the settled plan replanned for drift, now and then to a
    # BudgetError (about one run in 17). Without the new loop, the plan for
    # 256 now runs at 1024 within this budget's margin (10.5-10.8 MiB), so
    # the arrays case checks that such a fit trains; the dataset case still
    # fails without its fix.
    x, y = _learnable()
    tiled_x, tiled_y = np.tile(x, (8, 1)), np.tile(y, 8)
    plain, model = _wide_model(), memsave.keras.enable(_wide_model(), budget="12MiB")
    for fitted in (plain, model):
        fitted.fit(x, y, batch_size=256, epochs=1, verbose=0, shuffle=False)
        if second == "arrays":
            fitted.fit(tiled_x, tiled_y, batch_size=1024, epochs=1, verbose=0, shuffle=False)
        else:
            data = tf.data.Dataset.from_tensor_slices((tiled_x, tiled_y)).batch(1024)
            assert data.element_spec[0].shape[0] is None
            fitted.fit(data, epochs=1, verbose=0)
    assert model.train_function.loop.done
    _assert_trained_alike(model, plain)


def test_keras_keeps_a_byte_budget_for_a_model_built_on_its_first_call(monkeypatch):
    # The budget loop built the optimizer, to copy its slots before a call,
    # from the model's variables before there were any: Keras' optimizer
    # then refused the step's ("Unknown variable", found by a helper). The
    # first call, refused, is undone and trained on again.
    plain = _dense_model("adam", built=False)
    _fit(plain, batch_size=256)
    calls = _refuse_the_first_call(monkeypatch)
    model = memsave.keras.enable(_dense_model("adam", built=False), budget="3MiB")
    _fit(model, batch_size=256)
    assert len(calls) == 1 and model.train_function.loop.refusals == 1
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 64
    for ours, theirs in zip(model.variables, plain.variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-4, atol=1e-6)


def _refuse_the_first_call(monkeypatch):
    """The first call of a measured step runs, then the allocator refuses it
    (as a full device would part way); returns the list of refused calls."""
    calls = []
    traced = budget.MeasuredStep._traced

    def refused_once(self, *args, **kwargs):
        out = traced(self, *args, **kwargs)
        if not calls:
            calls.append(out)
            raise tf.errors.ResourceExhaustedError(
                None, None, "OOM when allocating tensor with shape[256,64] and type float")
        return out
    monkeypatch.setattr(budget.MeasuredStep, "_traced", refused_once)
    return calls


def test_keras_undoes_a_refused_first_call_in_the_metrics_its_trace_made(monkeypatch):
    """Keras makes its compiled metrics' variables in the first trace: a
    refused first call is not counted in them."""
    def one_epoch(model):
        xent = keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")
        model.compile(optimizer="sgd", jit_compile=False, metrics=[xent], loss=(
            keras.losses.SparseCategoricalCrossentropy(from_logits=True)))
        rng = np.random.RandomState(0)
        x, y = rng.randn(1024, 64).astype("float32"), rng.randint(0, 4, 1024)
        return model.fit(x, y, batch_size=256, epochs=1, verbose=0, shuffle=False).history
    plain = one_epoch(_dense_model())
    calls = _refuse_the_first_call(monkeypatch)
    ours = one_epoch(memsave.keras.enable(_dense_model(), budget="3MiB"))
    assert len(calls) == 1
    assert ours["xent"] == pytest.approx(plain["xent"], rel=1e-5)
    assert ours["loss"] == pytest.approx(plain["loss"], rel=1e-5)


class OwnOptimizer(keras.Model):
    """A custom ``train_step`` that trains the last layer with an optimizer of
    its own and counts its steps in a raw ``tf.Variable`` (Keras' GAN
    layout): neither is among the model's, its optimizer's or its metrics'
    variables."""

    def __init__(self):
        super().__init__()
        self.body = _dense_model().layers
        self.head_optimizer = keras.optimizers.Adam(0.01)
        self.steps_seen = tf.Variable(0.0)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def call(self, x, training=False):
        for layer in self.body:
            x = layer(x, training=training)
        return x

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.loss_fn(y, self(x, training=True))
        weights = self.trainable_variables
        grads = tape.gradient(loss, weights)
        self.optimizer.apply(grads[:-2], weights[:-2])
        self.head_optimizer.apply(grads[-2:], weights[-2:])
        self.steps_seen.assign_add(1.0)
        return {"loss": loss}


def test_keras_undoes_what_a_custom_train_step_updates_beyond_the_models_variables(monkeypatch):
    """Every variable the traced step captures is restored: the call refused
    part way is not counted twice by the step's own optimizer or counter."""
    def own(model):
        model.compile(optimizer="adam", jit_compile=False)
        model(np.zeros((1, 64), "float32"))
        return model
    plain = own(OwnOptimizer())
    _fit(plain, batch_size=256)
    calls = _refuse_the_first_call(monkeypatch)
    model = memsave.keras.enable(own(OwnOptimizer()), budget="3MiB")
    _fit(model, batch_size=256)
    assert len(calls) == 1 and model.train_function.loop.refusals == 1
    assert int(model.head_optimizer.iterations) == int(plain.head_optimizer.iterations) == 64
    assert float(model.steps_seen) == float(plain.steps_seen) == 64
    for ours, theirs in zip(model.variables, plain.variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-4, atol=1e-6)


def test_a_fraction_is_no_promise_on_the_allocator():
    # 0.7 of plain's estimate: a plan fits it (the lowest is at 0.54).
    model = memsave.keras.enable(_dense_model(), budget=0.7)
    _fit(model)
    assert not isinstance(model.train_function, budget.MeasuredStep)
    memsave.keras.disable(model)
    assert "make_train_function" not in model.__dict__


@pytest.mark.heavy   # six processes, about two minutes
def test_two_models_train_under_a_hard_limit_where_plain_runs_out_of_memory(tmp_path):
    """benchmarks.budget_limit --quick: under TF_CPU_BFC_MEM_LIMIT_IN_MB plain's
    steps run out of memory; memsave's budgeted steps train within the budget,
    their first gradients plain's."""
    from benchmarks import budget_limit   # pylint: disable=import-outside-toplevel
    # A cap of 80% of plain's peak; memsave's budget, 65% of that, is 52% of
    # plain's: GPT2's lowest plan measures about 44%, within 95% of it.
    rows = [budget_limit.measure(name, True, 0.8) for name in budget_limit.MODELS]
    assert len(rows) >= 2
    for row in rows:
        assert row["plain"]["outcome"].startswith("out of memory"), row
        ours = row["memsave"]
        assert ours["outcome"] == "trained", row
        # A replan measured again once the first plan is let go may be past
        # its margin (GPT2 at 4 x 128 tokens, once in several runs): the
        # lowest plan follows, a second replan; a replan past it, a second
        # replan and then, past it too, the lowest plan: a third.
        assert ours["peak"] <= row["budget"] and ours["replans"] <= 3, row
        assert ours["gradient_error"] <= 1e-5, row


def _named_chain(n):
    """tests.builders.plan_chain with TensorFlow's tensor names (a0:0, ...)."""
    import networkx as nx   # pylint: disable=import-outside-toplevel
    from tests.builders import plan_chain   # pylint: disable=import-outside-toplevel
    graph = plan_chain(n)
    return nx.relabel_nodes(graph, {name: name + ":0" for name in graph})


def test_a_gradient_op_is_charged_to_the_tensor_whose_backward_runs_it():
    graph = _named_chain(4)
    assert budget.forward_tensor(graph, "gradients/memsave_0/a2_grad/TanhGrad") == "a2:0"
    assert budget.forward_tensor(graph, "gradients_3/memsave_3/a1_grad/x/Tile") == "a1:0"
    assert budget.forward_tensor(graph, "gradient_tape/a3/Mul") == "a3:0"   # the plain tape
    assert budget.forward_tensor(graph, "memsave_1/a0") == "a0:0"   # a recomputed copy
    assert budget.forward_tensor(graph, "gradients/AddN_4") is None
    assert budget.forward_tensor(graph, "gradients/b7_grad/Mul") is None


def test_scratch_measured_in_the_first_plan_is_modelled_in_the_replan():
    """ConvNeXtTiny on CPU: XLA's gradient of its depthwise convolutions
    allocates up to 256 MiB that no estimate saw, so the first plan measured
    far above its estimate, and a correction by that error put the replan far
    below the budget. The scratch goes on the tensor whose backward made it,
    and only the error left once it is modelled corrects the replan."""
    from memsave.planning.simulate import simulate_peak   # pylint: disable=C0415
    from memsave.profile import PeakBreakdown   # pylint: disable=C0415
    mib = 2 ** 20
    graph = _named_chain(8)
    kept = ["a2:0", "a5:0"]
    loop = budget.Loop("test")
    loop.trace.promise, loop.trace.estimates, loop.trace.kept = 100 * mib, [5 * mib], [kept]
    measured = 40 * mib
    breakdown = PeakBreakdown(peak=measured, at=None, live=(), unnamed=30 * mib, scratch=(
        ("gradients/memsave_0/a6_grad/TanhGrad", 30 * mib),
        ("gradients/AddN_2", 20 * mib),                  # no tensor's backward: not modelled
        ("gradients/memsave_0/a3_grad/TanhGrad", mib)))  # under SCRATCH_MIN of the budget
    assert loop.observe(measured, breakdown) == budget.REPLAN
    plain_estimate = simulate_peak(graph, kept)
    loop._model_scratch(graph)   # pylint: disable=protected-access
    assert graph.nodes["a6:0"]["scratch_bytes"] == 30 * mib
    assert graph.nodes["a3:0"]["scratch_bytes"] == 0
    estimate = simulate_peak(graph, kept)
    assert plain_estimate < estimate <= plain_estimate + 30 * mib
    assert loop.first == (estimate, measured)
    assert loop.correction(100 * mib) == budget._correction(estimate, measured)(100 * mib)
    # The next trace's graph gets the scratch too, without re-estimating.
    again = _named_chain(8)
    loop._model_scratch(again)   # pylint: disable=protected-access
    assert again.nodes["a6:0"]["scratch_bytes"] == 30 * mib and loop.first[0] == estimate


def test_an_estimate_above_the_measurement_is_trusted_up_to_a_bound():
    # GPT2's plans at 128 tokens estimate 8-11% above what they measure: the
    # replan may plan above the aim, by the safer reading of the error.
    aim = budget.REPLAN_AIM * 100
    assert budget._correction(109, 100)(100) == pytest.approx(min(aim * 1.09, aim + 9))
    assert budget._correction(109, 100)(100) > aim
    # Beyond MOST_TRUSTED, no more.
    most = budget.MOST_TRUSTED
    assert budget._correction(300, 100)(100) == pytest.approx(
        min(aim * most, aim + 100 * (most - 1)))


def _settings(nbytes):
    return memsave.settings.resolve("optimal", {"budget": nbytes}, "test")


def test_a_replan_above_the_first_plan_fits_the_budget_at_the_steepest_slope():
    # The first plan measured 40% below a 100-byte budget: a replan may add
    # to its estimate only what, measured UPWARD_SLOPE times over, still fits.
    loop = budget.Loop("test")
    loop.first, loop.first_trace = (70, 60), budget._Trace(kept=[["a"]])
    loop.correction = budget._correction(70, 60)
    planned = loop.planning(_settings(100)).budget
    assert planned == pytest.approx(70 + 40 / budget.UPWARD_SLOPE)
    assert planned < loop.correction(100)   # what the error alone would allow
    # A first plan over the budget: the replan goes down, by the correction.
    loop.first, loop.correction = (70, 120), budget._correction(70, 120)
    assert loop.planning(_settings(100)).budget == pytest.approx(loop.correction(100))


def test_a_replan_of_a_rewritten_region_stays_a_rewrite():
    """A small CNN with Adam: its rewritten plans measured 0.92-1.22 times their
    estimates, plain backprop 1.3 times; a replan whose target reached plain's
    estimate ran plain and measured 22% over the budget. Unless the measured
    first plan ran plain itself, a replan is planned below plain's estimate."""
    from memsave.planning.simulate import simulate_peak   # pylint: disable=C0415
    graph = _named_chain(8)
    plain = simulate_peak(graph, ())
    loop = budget.Loop("test")
    loop.first, loop.first_trace = (plain / 2, plain / 4), budget._Trace(kept=[["a3:0"]])
    loop.correction = lambda promise: 10 * promise
    assert loop.planning(_settings(10 * plain), graph).budget == plain - 1
    # The first plan ran plain: plain was measured, and may be planned again.
    loop.first_trace = budget._Trace(kept=[[]])
    assert loop.planning(_settings(10 * plain), graph).budget > plain
    # Before a measurement, nothing is capped.
    assert budget.Loop("test").planning(_settings(10 * plain), graph).budget > plain


# Enough calls to settle: a replan, its check, a second replan, the lowest
# plan, its check.
TRAINING_STEPS, RATE = 20, 0.05

# Under a hard limit: a budgeted training step whose plan on trial the
# allocator refuses. argv: the budget, where to save the weights, and which
# plan is over the limit ('first': the first plan aims past it; 'replan': the
# replan's corrected target is past it).
_REFUSED = """
import logging
import sys
import numpy as np
logging.basicConfig()   # memsave's warnings to stderr
import memsave
from memsave import budget
from tests import test_budget as t
target, path, which = int(sys.argv[1]), sys.argv[2], sys.argv[3]
# The refusal of a plan on trial is under test, not the settled plan's drift
# (tested on its own): a drift replan would take the correction set below.
budget.DRIFT_REPLANS = 0
if which == "first":
    budget.FIRST_AIM = 4.0   # plain backprop's plan: over the limit
else:
    budget.FIRST_AIM, budget.UPWARD_SLOPE = 0.5, 1e-9
    budget._correction = lambda *error: lambda promise: 3 * promise
step, ws = t._chain(target, t.RATE)
step = memsave.budgeted(step)
settled = None
for _ in range(t.TRAINING_STEPS):
    step()
    if step.loop.done and settled is None:
        # The measured calls the loop settled on (a replan's may run over the
        # budget before the loop goes back or lower; under this cap they are
        # not refused). Later calls of the settled plan may creep a few
        # percent past it, which the drift guard, left out here, answers.
        settled = step.loop.peaks[-budget.MEASURED_CALLS:]
print("REFUSALS", step.loop.refusals, "REPLANS", step.loop.replans, "DONE", step.loop.done,
      "WITHIN", settled is not None and max(settled) <= target)
np.save(path, np.concatenate([w.numpy().ravel() for w in ws]))
"""


def _plain_trained():
    step, ws = _chain(rate=RATE)
    for _ in range(TRAINING_STEPS):
        step()
    return np.concatenate([w.numpy().ravel() for w in ws])


def _tracked_step():
    """A MeasuredStep of small functions, and a weak reference to each it builds."""
    made = []

    def build():
        function = tf.function(lambda: tf.ones([4]) * 2.0)
        made.append(weakref.ref(function))
        return function
    return budget.MeasuredStep(build, "test"), made


def _step_observed(step, estimate, measured, refused=False):
    """``step`` observes a plan of ``estimate`` measured at ``measured`` under a
    budget of 100, as :func:`_observed` for a loop."""
    step.loop.trace.promise, step.loop.trace.estimates = 100, [estimate]
    step._observe(measured, refused=refused)   # pylint: disable=protected-access


def test_a_second_replan_between_two_plans_keeps_the_first_to_go_back_to():
    step, made = _tracked_step()
    _step_observed(step, 81, 78)
    _step_observed(step, 92, 100)
    assert step.loop.between and len(made) == 3
    assert made[0]() is step._first is not None   # pylint: disable=protected-access
    assert made[1]() is None   # the replan on trial went
    _step_observed(step, 88, 97)
    assert step._step is made[0]() and step._first is None   # pylint: disable=W0212
    assert made[2]() is None


def test_a_second_replan_from_the_closer_plan_stays_within_the_margin_at_a_steeper_slope():
    # GPT2 at 2 x 128 tokens under 70% of plain's peak, scaled to 100: a first
    # plan measured 81%, its replan 89%, 0.67 measured bytes per estimated
    # byte between them. The closer plan, aimed on the floor slope of 0.8,
    # measured 101% (2.5 bytes per byte from the replan): its calls run
    # before the loop can go back, so its target keeps them within the 95%
    # margin at 2.5.
    loop = budget.Loop("test")
    assert _observed(loop, 100, 80, 81) == budget.REPLAN
    assert _observed(loop, 100, 92, 89) == budget.REPLAN and loop.first == (92, 89)
    target = loop.planning(_settings(100)).budget
    unbounded = 92 + (93.5 - 89) * budget.UPWARD_SLOPE
    assert 89 + (unbounded - 92) * 2.5 > 100                # what it measured before
    assert target == pytest.approx(92 + (95 - 89) / 2.5)
    assert 89 + (target - 92) * 2.5 == pytest.approx(95)    # now: at the margin


def test_a_second_replan_from_the_closer_replan_keeps_the_replan_to_go_back_to():
    step, made = _tracked_step()
    _step_observed(step, 72, 72)
    _step_observed(step, 92, 88)
    assert len(made) == 3 and not step.loop.swap_first
    assert made[1]() is step._first is not None   # pylint: disable=protected-access
    assert made[0]() is None   # the first plan went
    _step_observed(step, 99, 97)
    assert step._step is made[1]() and step._first is None   # pylint: disable=W0212
    assert made[2]() is None


def test_a_refused_first_plan_is_let_go_before_the_replan_is_built():
    """The loop never goes back to a first plan the allocator refused, so its
    function (and what its kernels hold) goes before the replan's is built:
    under a hard cap, TensorFlow's constant folding of DeBERTaV3's replan
    crashed the process where an allocation it needed failed (found by a
    helper)."""
    step, made = _tracked_step()
    _step_observed(step, 60, 120, refused=True)
    assert len(made) == 2 and made[0]() is None
    assert step._first is None         # pylint: disable=protected-access
    # A first plan measured over the budget, not refused, stays to go back to.
    step, made = _tracked_step()
    _step_observed(step, 60, 120)
    assert made[0]() is step._first is not None   # pylint: disable=protected-access


def test_the_plans_before_a_second_replan_are_let_go_before_it_is_built():
    """The loop goes back to no plan from a second replan, so it is measured
    alone: the first plan's and the replan's functions go before it is built."""
    step, made = _tracked_step()
    _step_observed(step, 80, 120)
    assert made[0]() is step._first is not None   # pylint: disable=protected-access
    _step_observed(step, 70, 110)
    assert step.loop.replanned_again and len(made) == 3
    assert made[0]() is None and made[1]() is None
    assert step._first is None   # pylint: disable=protected-access


@pytest.mark.heavy   # two processes under a hard limit
@pytest.mark.parametrize("which", ["first", "replan"])
def test_a_call_the_allocator_refuses_is_undone_and_run_again_on_a_lower_plan(
        plain_peak, tmp_path, which):
    # A plan on trial measured over a hard limit (the allocator of a full GPU)
    # fails part way. The call is undone (the weights restored from host
    # copies) and run again on the plan the loop turns to: a replan below
    # the refused first plan, or the first plan below the refused replan.
    # Training goes on and ends where plain's training ends.
    target = int(0.6 * plain_peak)
    # oneDNN off: TensorFlow 2.21 can crash in a oneDNN kernel whose
    # allocation is refused, where other kernels raise.
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2",
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(target // 2 ** 20 + 4), TF_ENABLE_ONEDNN_OPTS="0",
               PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    path = tmp_path / "weights.npy"
    out = subprocess.run([sys.executable, "-c", _REFUSED, str(target), str(path), which],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    # One refusal, undone; settled within the budget (a replan of a 7 MiB step
    # may measure a few percent over 95% of it, and the lowest plan follows).
    assert re.search(r"REFUSALS 1 REPLANS [123] DONE True WITHIN True", out.stdout), (
        out.stdout, out.stderr[-3000:])
    assert "the allocator refused a call of the %s plan" % (
        "first" if which == "first" else "replanned") in out.stderr, out.stderr[-3000:]
    plain, ours = _plain_trained(), np.load(path)
    assert np.abs(plain - ours).max() <= 1e-5 * np.abs(plain).max()


def test_the_refused_allocation_is_named_from_either_allocator_message():
    def refused(message):
        return tf.errors.ResourceExhaustedError(None, None, message)
    hint = ("Hint: If you want to see a list of allocated tensors when OOM happens, add "
            "report_tensor_allocations_upon_oom to RunOptions for current allocation info.")
    graph = refused("Graph execution error:\n\nDetected at node x defined at:\n"
                    "OOM when allocating tensor with shape[8,1024] and type float on "
                    "/job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu\n" + hint)
    xla = refused("Graph execution error:\n\nOut of memory while trying to allocate "
                  "220.50MiB.\n\t [[{{node f}}]]\n" + hint)
    assert budget._oom_line(graph).startswith("OOM when allocating tensor with shape[8,1024]")
    assert budget._oom_line(xla) == "Out of memory while trying to allocate 220.50MiB."
    assert budget._oom_line(refused("first\nlast")) == "last"


_LEFT_BEHIND = ("Resource __per_step_0/ArithmeticOptimizer/AddOpsRewrite_AddN_1/tmp_var/"
                "N10tensorflow19TemporaryVariableOp6TmpVarE does not exist")


def _leaking_step(weight, outcomes):
    """A MeasuredStep whose calls update ``weight`` and then raise the next of
    ``outcomes`` (an error class, or None: the call runs), as TF does after a
    refused call whose per-step temporary variable it left behind."""
    def build():
        def step():
            weight.assign_add(1.0)
            error = outcomes.pop(0) if outcomes else None
            if error is not None:
                raise error(None, None, "OOM when allocating" if
                            error is tf.errors.ResourceExhaustedError else _LEFT_BEHIND)
            return weight.value()
        return step
    step = budget.MeasuredStep(build, "test", state=lambda: [weight])
    step.loop.trace.promise, step.loop.trace.estimates = 2 ** 20, [2 ** 19]
    return step


def test_a_temporary_variable_left_behind_by_a_refused_call_is_freed_and_the_call_run_again(
        monkeypatch, caplog):
    # TensorFlow does not free the per-step temporary variable of an aborted
    # step (Grappler's AccumulateNV2 of a large gradient sum) until a function
    # kernel is destroyed, and every step that makes one of that name fails:
    # the rerun is undone, the kernel cache cleared, and the call run again.
    cleared = []
    monkeypatch.setattr(tf_internal, "clear_kernel_cache", lambda: cleared.append(1))
    weight = tf.Variable(1.0)
    step = _leaking_step(weight, [tf.errors.ResourceExhaustedError, tf.errors.AlreadyExistsError])
    with caplog.at_level(logging.WARNING, logger="memsave"):
        assert step().numpy() == 2.0   # applied once: the refused call and the failed rerun undone
    assert cleared == [1] and step.loop.refusals == 1
    assert any("eager kernel cache is cleared" in r.getMessage() for r in caplog.records)
    assert step._calls == 1   # pylint: disable=protected-access   (its plan's first call)


def test_a_temporary_variable_left_behind_again_is_a_budget_error(monkeypatch):
    # Clearing the kernel cache did not free it: undone, and said, not left
    # half applied behind a raw AlreadyExistsError.
    monkeypatch.setattr(tf_internal, "clear_kernel_cache", lambda: None)
    weight = tf.Variable(1.0)
    step = _leaking_step(weight, [tf.errors.ResourceExhaustedError,
                                  tf.errors.AlreadyExistsError, tf.errors.AlreadyExistsError])
    with pytest.raises(memsave.BudgetError, match="left a per-step temporary variable"):
        step()
    assert weight.numpy() == 1.0 and step.loop.refusals == 1
    with pytest.raises(memsave.BudgetError, match="left a per-step temporary variable"):
        step()
    assert weight.numpy() == 1.0


def test_a_call_is_run_again_with_its_arguments_unless_it_reads_an_iterator():
    x = tf.ones([2])
    again = budget.same_arguments((x,), {"scale": 2.0})
    assert again() == ((x,), {"scale": 2.0})
    batches = iter(tf.data.Dataset.range(3))
    assert budget.same_arguments((batches,), {}) is None   # a run again reads the next batch
    assert budget.same_arguments((), {"data": iter([1, 2])}) is None


def test_a_call_the_allocator_refuses_is_a_budget_error():
    calls = []

    def build():
        def step():
            calls.append(1)
            raise tf.errors.ResourceExhaustedError(
                None, None, "Graph execution error:\n\nOOM when allocating tensor with shape[8]")
        return step
    step = budget.MeasuredStep(build, "test")
    step.loop.trace.promise, step.loop.trace.estimates = 2 ** 20, [2 ** 19]
    with pytest.raises(memsave.BudgetError, match="ran out of memory in a call of the first "
                       r"plan.*cannot be run again \(its variables are not known.*no plan is "
                       r"known to fit it.*OOM when allocating tensor with shape\[8\]"):
        step()
    with pytest.raises(memsave.BudgetError, match="ran out of memory"):
        step()
    assert len(calls) == 1   # never run again
    # A settled plan that a later call needs more for: said in the budget's terms.
    step = budget.MeasuredStep(build, "test")
    step.loop.trace.promise, step.loop.peaks, step.loop.done = 2 ** 20, [2 ** 19], True
    with pytest.raises(memsave.BudgetError, match=r"settled plan \(the loop's measured calls: 0\.5 MiB at most"):
        step()
    # A step that planned for no byte budget: the allocator's own error.
    step = budget.MeasuredStep(build, "test")
    with pytest.raises(tf.errors.ResourceExhaustedError):
        step()


def test_a_smaller_last_batch_is_not_taken_for_the_calls_variation():
    """The spread a plan keeps below its budget is its calls' variation: a
    call on a smaller batch (an epoch's last, batched without
    ``drop_remainder``) measures less, and that is no variation."""
    mib = 2 ** 20
    spread = budget._spread   # pylint: disable=protected-access
    assert spread([(12.5 * mib, 600), (12.4 * mib, 600), (6.0 * mib, 248)]) == pytest.approx(
        0.1 * mib)
    assert spread([(12.5 * mib, None), (6.0 * mib, None), (12.0 * mib, None)]) == 6.5 * mib
    assert spread([(10 * mib, 8), (11 * mib, 8), (12 * mib, 8)]) == 2 * mib


def test_keras_plans_a_byte_budget_for_the_first_batch_of_a_dataset_of_unknown_batch(caplog):
    # A dataset batched without drop_remainder has no static batch size: the
    # step was planned for 32 samples where 600 came, its plans dominated by
    # the weights' gradients, and with the smaller last batch taken for the
    # calls' variation the loop raised BudgetError where plans at 9 MiB fit
    # 15 (a helper found it).
    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((64,))] + [
            keras.layers.Dense(256, activation="tanh") for _ in range(10)]
            + [keras.layers.Dense(5)])
        model.compile(optimizer="adam", jit_compile=False, loss=(
            keras.losses.SparseCategoricalCrossentropy(from_logits=True)))
        return model
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2048, 64)), rng.integers(0, 5, 2048)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(600)
    assert data.element_spec[0].shape[0] is None
    plain = build()
    plain.fit(data, epochs=4, verbose=0)
    model = memsave.keras.enable(build(), budget="7MiB")
    with caplog.at_level(logging.INFO, logger="memsave"):
        model.fit(data, epochs=4, verbose=0)
    said = [r.getMessage() for r in caplog.records]
    assert any("it was batched by 600" in m for m in said), said
    assert model.train_function.loop.settled_trace is not None, said
    for ours, theirs in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not tf.test.is_built_with_xla(), reason="needs XLA")
def test_a_first_plan_fits_where_an_xla_compiled_gradient_allocates_most_of_the_peak():
    """Six GELU layers, then a grouped convolution (256 channels) that Keras
    compiles with XLA on a CPU: its gradient allocates a 24.5 MiB buffer at
    the start of the backward pass, when every kept tensor is alive. Planned
    blind to it, the first plan at 0.6 of plain's peak measured 84.6 MiB
    against a 77.2 MiB budget (at 0.75: 112.6 against 96.5), a call a full
    device refuses; counted ahead (memsave.graph.compiled_calls), 60.6."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((4, 4, 256))] + [keras.layers.Dense(256, activation="gelu")
                                           for _ in range(6)]
    model = keras.Sequential(layers + [keras.layers.Conv2D(256, 7, padding="same", groups=256)])
    x = tf.constant(np.random.RandomState(0).rand(256, 4, 4, 256).astype(np.float32))

    def step_for(budget_bytes):
        @tf.function
        def step():
            tape = (tf.GradientTape() if budget_bytes is None else
                    memsave.GradientTape(checkpoints="optimal", budget=budget_bytes))
            with tape:
                loss = tf.reduce_sum(tf.square(model(x, training=True)))
            return tape.gradient(loss, model.trainable_variables)
        return step

    plain = step_for(None)
    target = int(0.6 * peak_memory(plain))
    step = memsave.budgeted(step_for(target))
    for _ in range(1 + budget.MEASURED_CALLS):   # traced, then measured
        step()
    estimated, measured = step.loop.first
    assert measured <= target, (estimated / 2**20, measured / 2**20, target / 2**20)
    _settled(step)
    assert peak_memory(step) <= target
    _assert_same(plain(), step())
