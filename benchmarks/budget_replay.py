"""The budget loop replayed on measured plans: where it settles, without running a model.

``python -m benchmarks.budget_replay`` (``--draws 40``, ``--plan-noise 0.03``,
``--call-noise 0.015``): every model and budget of the stored budget sweep
(``benchmarks/results/budget_sweep.json``: each plan a budget can be given,
its estimate and its measured peak) is driven through memsave's own loop
(:class:`memsave.budget.MeasuredStep`), in ``--draws`` worlds each. In a
world, each plan measures its stored peak times one draw of
1 ± ``--plan-noise`` (the same plan measures differently in another
process: GPT2 at 1,024 tokens, a plan estimated 323.3 MiB measured 408.3 in
the sweep and 336.2 in another process), each call that times 1 ±
``--call-noise``, and the budget is the fraction of plain's measured peak
times a draw of its own. The step plans as memsave's planner asks the loop:
the plan with the largest estimate within the target, or where none is,
the lowest (if the loop takes it). No scratch is modelled and no plan is
measured again once another is let go, so this isolates the loop's rule
from the allocator.

For each model and budget: the draws where a plan measures at 90-95% of the
budget (one a loop could keep), those whose settled plan measured within
10% below the budget (of all draws, and of those), those where no call
measured over the budget, and the traces per draw (first plan and
replans). Writes ``benchmarks/results/budget_replay.{json,md}``. No model
runs: about ten seconds.
"""

import collections
import contextlib
import json
import os
import random
import sys
import time

from benchmarks import cli

MIB = 2 ** 20
CALLS = 20   # calls of each draw's step: enough for any loop to settle


class Settings:
    """The part of the planner's settings the loop reads and replaces."""

    def __init__(self, promise):
        self.budget = promise

    def replace(self, budget):   # pylint: disable=redefined-outer-name
        return Settings(budget)


class Plan:
    """What memsave's planner gives the loop (an estimate, plain's, what is
    kept), and what the plan measures in a replay (``measured``)."""

    def __init__(self, estimate, plain, measured=None, index=None):
        self.estimated_peak_bytes, self.plain_peak_bytes = estimate, plain
        self.measured, self.index = measured, index
        name = "kept_%s:0" % (index if index is not None else repr(estimate))
        self.kept = [name] if estimate < plain else []


def planned(plans, promise):
    """The plan of ``plans`` (ascending estimates) memsave's planner would give a
    step tracing under the active loop with a byte budget ``promise``: the
    largest estimate within the loop's target, or where none is, the lowest
    if the loop takes it (else the planner's BudgetError)."""
    from memsave import budget   # pylint: disable=import-outside-toplevel
    from memsave.errors import BudgetError   # pylint: disable=import-outside-toplevel
    loop = budget.active()
    target = loop.planning(Settings(promise)).budget
    fitting = [p for p in plans if p.estimated_peak_bytes <= target]
    if fitting:
        plan = fitting[-1]
    else:
        error = BudgetError("no plan fits")
        error.smallest = plans[0].estimated_peak_bytes
        loop.unfit(error)
        if not loop.takes_lowest():
            raise error
        plan = plans[0]
    loop.record(plan)
    return plan


class World:
    """One draw of a model's stored plans under one budget."""

    def __init__(self, row, fraction, seed, plan_noise, call_noise):
        rng = self.rng = random.Random(seed)
        plain = row["plans"][0]["plain_estimated_mib"] * MIB
        self.plans = sorted(
            (Plan(p["estimated_mib"] * MIB, plain,
                  p["measured_mib"] * MIB * (1 + rng.uniform(-plan_noise, plan_noise)))
             for p in row["plans"]), key=lambda p: (p.estimated_peak_bytes, p.measured))
        self.promise = fraction * row["plain_mib"] * MIB * (1 + rng.uniform(-plan_noise,
                                                                             plan_noise))
        self.call_noise = call_noise
        self.peak, self.peaks, self.traces = 0, [], 0

    def build(self):
        """A fresh traced step: it plans on its first call, as memsave's planner does."""
        world, state = self, {}

        def step():
            if "plan" not in state:
                world.traces += 1
                state["plan"] = planned(world.plans, world.promise)
            plan = state["plan"]
            world.peak = plan.measured * (1 + world.rng.uniform(-world.call_noise,
                                                                 world.call_noise))
            world.peaks.append(world.peak)
            return plan
        return step


@contextlib.contextmanager
def scripted_meter(worlds):
    """The loop's meter reads the current world's figure; nothing is profiled, and
    the plans' functions hold no memory to collect when the loop lets them go."""
    import types   # pylint: disable=import-outside-toplevel
    from memsave import budget, profile   # pylint: disable=import-outside-toplevel
    patched = [(budget, "gc", types.SimpleNamespace(collect=lambda *a: 0)),
               (profile, "measured_call",
                lambda step, *a, device=None, **k: (step(*a, **k), worlds[-1].peak)),
               (profile, "profiled_call",
                lambda step, *a, device=None, strict=True, **k: (step(*a, **k), None)),
               (profile, "memory_info", lambda *a, **k: {"current": 0, "peak": 0}),
               (budget, "_meter_base", lambda: 0),
               (budget, "_peak_since", lambda base: worlds[-1].peak)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    for module, name, value in patched:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def replay(results, budgets, draws, plan_noise, call_noise):
    """One row per model and budget (see the module docstring)."""
    import logging   # pylint: disable=import-outside-toplevel
    from memsave import budget   # pylint: disable=import-outside-toplevel
    from memsave.errors import BudgetError   # pylint: disable=import-outside-toplevel
    logging.getLogger("memsave").setLevel(logging.ERROR)
    worlds, rows = [], []
    with scripted_meter(worlds):
        for result in results:
            for fraction in budgets:
                count = collections.Counter()
                for seed in range(draws):
                    world = World(result, fraction, seed, plan_noise, call_noise)
                    worlds.append(world)
                    step = budget.MeasuredStep(world.build, "replay", state=lambda: [])
                    plan = None
                    try:
                        for _ in range(CALLS):
                            plan = step()
                    except BudgetError:
                        plan = None
                    promise = world.promise
                    band = any(0.9 * promise <= p.measured <= 0.95 * promise
                               for p in world.plans)
                    count["band"] += band
                    count["traces"] += world.traces
                    if plan is None:
                        count["budget_error"] += 1
                        continue
                    within = 0.9 * promise <= plan.measured <= promise
                    count["within"] += within
                    count["within_of_band"] += within and band
                    count["held"] += max(world.peaks) <= promise
                rows.append(dict(model=result["model"], budget=fraction, draws=draws,
                                 **{k: count[k] for k in ("band", "within", "within_of_band",
                                                          "held", "budget_error", "traces")}))
    return rows


# The loop's rules compared, each as a patch of memsave.budget.Loop (None: as it is).
VARIANTS = (("the loop", None),
            ("its second replan from the closer plan not bounded by CLOSER_SLOPE",
             (None, "CLOSER_SLOPE", 1e-12)),   # a bound far above any target
            ("without the second replan from the closer plan",
             ("Loop", "_replan_closer", lambda self, *args: None)))


def replay_variants(results, budgets, draws, plan_noise, call_noise):
    """{variant: rows} for each of :data:`VARIANTS`: each patches an attribute of
    :mod:`memsave.budget` (or of one of its classes) for its replay."""
    from memsave import budget   # pylint: disable=import-outside-toplevel
    out = {}
    for label, patch in VARIANTS:
        owner = saved = None
        if patch is not None:
            owner = budget if patch[0] is None else getattr(budget, patch[0])
            saved = getattr(owner, patch[1])
            setattr(owner, patch[1], patch[2])
        try:
            out[label] = replay(results, budgets, draws, plan_noise, call_noise)
        finally:
            if patch is not None:
                setattr(owner, patch[1], saved)
    return out


_COUNTS = ("draws", "band", "within", "within_of_band", "held", "budget_error", "traces")


def markdown(variants, plan_noise, call_noise):
    """The per-model table of the loop as it is, and every variant's totals."""
    rows = variants[VARIANTS[0][0]]
    lines = [
        "**Per model**",
        "",
        "The budget loop (memsave.budget.MeasuredStep) replayed on the budget sweep's "
        "measured plans: each draw scales every plan's stored peak by 1 ± %g, each call's "
        "by 1 ± %g, and the budget (a fraction of plain's measured peak) by 1 ± %g; "
        "'a plan at 90-95%%': draws where one measures there; 'within 10%%': draws whose "
        "settled plan measured 90-100%% of the budget (of all draws, and of those with a "
        "plan at 90-95%%); 'held': no call over the budget; 'traces': per draw, the "
        "first plan's and the replans'." % (plan_noise, call_noise, plan_noise),
        "",
        "| model | budget | draws | a plan at 90-95% | within 10% | of those | held "
        "| BudgetError | traces |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append("| %s | %g × plain | %d | %d | %d | %d | %d | %d | %.1f |" % (
            row["model"], row["budget"], row["draws"], row["band"], row["within"],
            row["within_of_band"], row["held"], row["budget_error"],
            row["traces"] / row["draws"]))
    lines += ["", "**Totals**", "",
              "| loop | draws | a plan at 90-95% | within 10% | of those | held | BudgetError "
              "| traces |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, _ in VARIANTS:
        total = collections.Counter()
        for row in variants[label]:
            total.update({k: row[k] for k in _COUNTS})
        lines.append("| %s | %d | %d | %d | %d | %d | %d | %.2f |" % (
            label, total["draws"], total["band"], total["within"], total["within_of_band"],
            total["held"], total["budget_error"], total["traces"] / max(1, total["draws"])))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--sweep", default=str(cli.RESULTS / "budget_sweep.json"),
                        help="the stored budget sweep to replay")
    parser.add_argument("--draws", type=int, default=40)
    parser.add_argument("--plan-noise", type=float, default=0.03)
    parser.add_argument("--call-noise", type=float, default=0.015)
    parser.add_argument("--stem", default="budget_replay")
    args = cli.parse(parser, argv)
    cli.environment()
    start = time.time()
    with open(args.sweep, encoding="utf-8") as stored:
        sweep = json.load(stored)
    variants = replay_variants(sweep["results"], sweep["budgets"], args.draws,
                               args.plan_noise, args.call_noise)
    table = markdown(variants, args.plan_noise, args.call_noise)
    cli.write(args.out, args.stem, dict(
        variants=variants, draws=args.draws, plan_noise=args.plan_noise, call_noise=args.call_noise,
        sweep=os.path.basename(args.sweep), seconds=time.time() - start), table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
