"""The byte budget's loop (memsave.budget.MeasuredStep and Loop) driven through
thousands of calls of scripted worlds: plans with estimates, what each
measures (a ratio and an offset off its estimate, a per-plan error, per-call
noise, a creep of the allocator's free chunks), and an allocator that refuses
calls past a cap. No model runs: the step plans as memsave's planner asks
the loop, and the meter reads the world's figure.

The loop's states (first plan, replan, a replan between, a second replan, the
lowest plan, a confirmation once the other plan is let go, a refused call
undone, a settled plan's drift) meet in orders no model reaches in a test;
a scripted world found the loop going back to a plan whose function it had
let go (a drift replan measured below the drifted plan): ``'NoneType' object
is not callable`` part way through training.
"""

import random

import pytest
import tensorflow as tf

from memsave import budget, profile
from memsave.errors import BudgetError

MIB = 2 ** 20
CALLS = 48


class _Settings:
    """The part of the planner's settings the loop reads and replaces."""

    def __init__(self, promise):
        self.budget = promise

    def replace(self, budget):   # pylint: disable=redefined-outer-name
        return _Settings(budget)


class _Plan:
    """What memsave.planner gives the loop: an estimate, plain's, what is kept."""

    def __init__(self, index, estimate, plain):
        self.index, self.estimated_peak_bytes, self.plain_peak_bytes = index, estimate, plain
        self.kept = ["kept_%d:0" % index] if estimate < plain else []


class _World:
    """One step's plans and allocator, drawn from ``seed``."""

    def __init__(self, seed):
        rng = self.rng = random.Random(seed)
        self.promise = rng.uniform(10, 500) * MIB
        plain = self.promise * rng.uniform(1.2, 4)
        self.plans = [_Plan(i, e, plain) for i, e in enumerate(
            sorted(rng.uniform(0.2, 1.0) * plain for _ in range(rng.randint(2, 12))))]
        self.ratio, self.offset = rng.uniform(0.7, 1.6), rng.uniform(-0.1, 0.3) * self.promise
        self.noise = rng.uniform(0, 0.08)
        self.error = {p.index: rng.uniform(-0.1, 0.1) for p in self.plans}
        self.creep = rng.choice([0, 0, rng.uniform(0, 0.01)])
        self.cap = self.promise * rng.choice([float("inf"), rng.uniform(1.0, 1.6)])
        self.calls, self.peak, self.traces = 0, 0, 0

    def measure(self, plan):
        self.calls += 1
        mean = ((plan.estimated_peak_bytes * self.ratio + self.offset)
                * (1 + self.error[plan.index]) + self.creep * self.calls * self.promise)
        return max(1.0, mean * (1 + self.rng.uniform(-self.noise, self.noise)))

    def build(self):
        return _Step(self)


class _Step:
    """A traced step: plans on its first call, as memsave.planner asks the loop."""

    def __init__(self, world):
        self.world, self.plan = world, None

    def __call__(self):
        world = self.world
        if self.plan is None:
            world.traces += 1
            loop = budget.active()
            target = loop.planning(_Settings(world.promise)).budget
            fitting = [p for p in world.plans if p.estimated_peak_bytes <= target]
            if fitting:
                self.plan = fitting[-1]
            else:
                error = BudgetError("no plan fits")
                error.smallest = world.plans[0].estimated_peak_bytes
                loop.unfit(error)
                if not loop.takes_lowest():
                    raise error
                self.plan = world.plans[0]
            loop.record(self.plan)
        world.peak = world.measure(self.plan)
        if world.peak > world.cap:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating")
        return self.plan.index


@pytest.fixture
def scripted_meter(monkeypatch):
    """The meter reads the world's figure; nothing is collected or profiled."""
    worlds = []

    def measured_call(step, *args, device=None, **kwargs):   # pylint: disable=unused-argument
        out = step(*args, **kwargs)
        return out, worlds[-1].peak
    monkeypatch.setattr(profile, "measured_call", measured_call)
    monkeypatch.setattr(profile, "profiled_call",
                        lambda step, *a, device=None, strict=True, **k: (step(*a, **k), None))
    monkeypatch.setattr(profile, "memory_info", lambda *a, **k: {"current": 0, "peak": 0})
    monkeypatch.setattr(budget, "_meter_base", lambda: 0)
    monkeypatch.setattr(budget, "_peak_since", lambda base: worlds[-1].peak)
    monkeypatch.setattr(budget.gc, "collect", lambda *a: 0)
    return worlds


def _drive(world):
    """Call ``world``'s measured step CALLS times; the outcome of each call.
    Any exception but a BudgetError fails the test: a ResourceExhaustedError
    the loop let through (a refused call is undone and run again), or a
    TypeError from calling a plan's function it let go."""
    step = budget.MeasuredStep(world.build, "world", state=lambda: [])
    outcomes = []
    for _ in range(CALLS):
        try:
            outcomes.append(step())
        except BudgetError:
            outcomes.append("BudgetError")
    return step, outcomes


@pytest.mark.parametrize("first", range(0, 2000, 200))
def test_the_budget_loop_keeps_its_promises_in_scripted_worlds(first, scripted_meter):
    for seed in range(first, first + 200):
        world = _World(seed)
        scripted_meter.append(world)
        step, outcomes = _drive(world)
        # pylint: disable=protected-access
        loop, said, unfit_loop = step.loop, "seed %d: %s" % (seed, outcomes), step._unfit
        if "BudgetError" in outcomes:
            unfit = outcomes.index("BudgetError")
            if unfit_loop is not None or set(outcomes[unfit:]) == {"BudgetError"}:
                # No plan fits: no later call runs, each says so.
                assert set(outcomes[unfit:]) == {"BudgetError"}, said
                continue
            # Otherwise only a settled plan's call the allocator refused
            # raised (it cannot be undone); the next calls run.
            assert loop.done, said
        # No plan stays on trial past its measured calls (a first call, the
        # measured ones, those measured again once another plan is let go).
        assert loop.done or step._calls <= 3 * budget.MEASURED_CALLS + 1, said
        # Traces: the first plan, at most three replans, and as many after each drift.
        assert world.traces <= 4 * (1 + loop.drift_replans), said
        assert loop.drift_replans <= budget.DRIFT_REPLANS, said


@pytest.mark.parametrize("seed", [62, 665])
def test_a_drift_replan_measured_below_the_drifted_plan_stays(seed, scripted_meter):
    # The settled plan's function is let go before its drift replan is
    # built, so the loop cannot go back to it even where the replan measures
    # less: it went back, and the next call called None.
    world = _World(seed)
    scripted_meter.append(world)
    step, outcomes = _drive(world)
    assert step.loop.drift_replans == 1 and step.loop.done
    assert "BudgetError" not in outcomes


def test_a_drift_replan_to_the_lowest_plan_within_the_budget_keeps_training(scripted_meter):
    # Seed 41: a plan settled at 91% of its budget drifts to 93.6%; its
    # replan is the lowest plan, whose calls measure 84-94%, within the
    # budget but spread over more than its margin. Training goes on with a
    # WARNING, as for a settled lowest plan that drifts; it was stopped by
    # a BudgetError at every later call.
    world = _World(41)
    scripted_meter.append(world)
    step, outcomes = _drive(world)
    assert step.loop.drift_replans == 1 and step.loop.done and step.loop.settled_trace.lowest
    assert "BudgetError" not in outcomes
